"""How an op's call reaches its kernels: one :class:`Dispatch` per op, one entry per call signature.

:class:`Dispatch` keeps, for each signature of an op's calls, one entry: the op's checks passed
for it, and after its first eager GPU call the launches of that call prepared
(:class:`PreparedLaunch`: the compiled kernel's launcher with every argument but the call's
tensors bound). A repeat eager GPU call launches those directly; every other call (the
interpreter, ``torch.compile``, fake tensors) goes through the op's ``torch.library`` op to
its launcher (kernels/README.md#dispatch).

Below the op, :class:`CompiledLaunch` makes a launcher's launches without Triton's per-call
argument binding: ``kernel[grid](*args, **constexprs)`` specializes every argument again on
every call (pointer alignment, integer divisibility, the cache key), on the H200 machine's host
about 30 µs of a 36 µs conventional launcher call against 9 µs for the compiled kernel's own
launcher. The first call of a kernel signature goes through ``kernel[grid]`` and keeps the
compiled kernel's launcher (``CompiledKernel[grid]``); later calls go straight to it. A kernel
signature is what Triton specializes on, taken conservatively: the launch's constexprs (the
launcher's cached plan, by identity), the grid, the device, each tensor argument's dtype and
whether its address is a multiple of 16, and the exact value of every other argument, except
``volatile`` ones (declared ``do_not_specialize`` in the kernel), of which only the integer
type Triton gives them counts. CPU tensors (the interpreter) always take ``kernel[grid]``.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Hashable, Optional, Sequence

import torch

from .signature import TensorsLike, tensor_metas

# Eager GPU calls after the first of a signature launch the compiled kernel directly (prepared,
# or from CompiledLaunch's table); False: every call through ``kernel[grid]``.
ENABLED = True
# Entries kept per op or kernel before the table starts again (signatures come from shapes and
# strides, so a serving engine meets few; the bound only keeps a pathological caller finite).
MAX_SIGNATURES = 4096
# Layouts per plain key whose guards a call tries before the key: a serving loop alternates a few
# batch sizes; a guard is made once per entry (about 19 µs for 22 tensors on a 2-core CPU host).
RECENT_LAYOUTS = 4


class Dispatch:
    """One op's calls by signature: one :class:`DispatchEntry` per signature.

    A signature is a call's plain arguments (``plain``: formats, flags, pad ids, what the op's
    checks and launches read besides tensors) and its tensors' metadata (``tensors``: shapes,
    strides, dtypes, devices; ``signature.tensor_metas``), but no tensor address and no device
    data. ``entry(plain, tensors, check, *args)`` runs ``check(*args)`` the first time it meets
    a signature and keeps an entry if it passes (an error propagates; nothing is kept); a repeat
    returns the entry without checking. Each entry holds a C++ tensor guard of its layout
    (``signature.TensorsLike``, made once), and a repeat of one of the last ``RECENT_LAYOUTS``
    layouts met with the same ``plain`` is recognized by it instead of by the key (outside
    ``torch.compile`` tracing, where torch has a working guard). An unhashable ``plain`` (an
    argument of a type the checks reject) is checked every call and gets an entry kept nowhere.
    """

    def __init__(self, name: str):
        self.name = name
        self._entries: dict = {}
        # plain -> its entries with a guard, the latest met first (at most RECENT_LAYOUTS)
        self._recent: dict = {}
        _DISPATCHES.add(self)

    def entry(self, plain: Hashable, tensors: Sequence, check: Callable[..., None], *args) -> "DispatchEntry":
        try:
            recent = self._recent.get(plain)
        except TypeError:
            check(*args)
            return DispatchEntry()
        # torch.compile traces the key path only (it cannot trace the guard).
        tracing = torch.compiler.is_compiling()
        if recent is not None and not tracing:
            for entry in recent:
                if entry.like(tensors):
                    return entry
        signature = (plain, tensor_metas(tensors))
        entry = self._entries.get(signature)
        if entry is None:
            check(*args)
            if len(self._entries) >= MAX_SIGNATURES:
                self.clear()
            entry = self._entries[signature] = DispatchEntry()
        if not tracing:
            if entry.like is None:
                entry.like = TensorsLike.of(tensors)
            if entry.like is not None:
                recent = self._recent.setdefault(plain, [])
                if entry not in recent:
                    recent.insert(0, entry)
                    del recent[RECENT_LAYOUTS:]
        return entry

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._recent.clear()


_DISPATCHES: "weakref.WeakSet[Dispatch]" = weakref.WeakSet()


def clear_dispatches() -> None:
    """Forget every op's entries (their prepared launches hold the kernels and plans of the
    moment they were made)."""
    for dispatch in _DISPATCHES:
        dispatch.clear()


class DispatchEntry:
    """What a signature of an op keeps: its checks passed; ``prepared``, the launches of its
    first eager GPU call (a :class:`PreparedLaunch` or :class:`PreparedLaunches`): None until that
    call, False where they cannot be prepared; and ``like``, the guard of its tensors' layout."""

    __slots__ = ("prepared", "like")

    def __init__(self):
        self.prepared = None
        self.like = None  # made at the signature's first call outside torch.compile tracing

    @property
    def unprepared(self) -> bool:
        """Whether an eager GPU call should prepare its launches here (none tried yet, and
        ``ENABLED``)."""
        return self.prepared is None and ENABLED

    def keep(self, prepared) -> None:
        """Keep ``prepared`` (None: the launches cannot be prepared; later calls take the full path)."""
        self.prepared = False if prepared is None else prepared

    def launch(self, *tensors) -> bool:
        """The prepared launches with the call's tensors; False, and nothing launched, if there
        are none (or ``ENABLED`` is off) or they do not fit these tensors."""
        prepared = self.prepared
        return bool(prepared) and ENABLED and prepared(*tensors)


def register_cap(maxnreg: Optional[int], device: torch.device) -> dict:
    """Launch options capping a kernel's registers per thread (ptxas ``.maxnreg``; more programs
    per multiprocessor, some spills): ``{}`` for None or under the interpreter."""
    return {"maxnreg": maxnreg} if maxnreg and device.type == "cuda" else {}


def _integer_type(value: int) -> str:
    # The type Triton gives an unspecialized integer argument.
    if -2**31 <= value < 2**31:
        return "i32"
    return "i64" if value < 2**63 else "u64"


class CompiledLaunch:
    """``launch(grid, args, constexprs, on_gpu)``: ``kernel[grid](*args, **constexprs)``, through
    the kernel's compiled launcher once the call signature has been seen (``on_gpu`` and
    ``ENABLED``)."""

    def __init__(self, kernel, volatile: Sequence[str] = (), stand_in: bool = False):
        self.kernel = kernel
        # A stand-in kernel (a tool's recording or no-op object) is launched as a compiled GPU
        # kernel would be, whatever the tensors' device.
        self.stand_in = stand_in
        self.volatile = tuple(volatile)
        self._volatile = frozenset(kernel.arg_names.index(name) for name in volatile)
        self._launchers: dict = {}

    def clear(self) -> None:
        self._launchers.clear()

    def _signature(self, grid, args, constexprs):
        key = [id(constexprs), grid, args[0].device.index]  # the ops put every tensor on one device
        for position, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                key.append((value.dtype, value.data_ptr() % 16 == 0))
            elif position in self._volatile:
                key.append(_integer_type(value))
            else:
                key.append((type(value), value))
        return tuple(key)

    def __call__(self, grid, args: Sequence, constexprs: dict, on_gpu: bool) -> None:
        if not (ENABLED and (on_gpu or self.stand_in)):
            self.kernel[grid](*args, **constexprs)
            return
        signature = self._signature(grid, args, constexprs)
        entry = self._launchers.get(signature)
        if entry is None:
            kernel = self.kernel[grid](*args, **constexprs)
            defaults = self.kernel.signature.parameters
            trailing = tuple(constexprs[name] if name in constexprs else defaults[name].default
                             for name in self.kernel.arg_names[len(args):])
            if len(self._launchers) >= MAX_SIGNATURES:
                self._launchers.clear()
            # The plan's constexprs are kept with the entry, so their id in the key is not reused.
            # The compiled kernel's launcher reads three grid dimensions.
            self._launchers[signature] = (kernel[(*grid, 1, 1)[:3]], trailing, constexprs)
            return
        launcher, trailing, _ = entry
        launcher(*args, *trailing)

    def prepare(self, grid, args: Sequence, constexprs: dict, leading: Sequence,
                on_gpu: bool) -> Optional["PreparedLaunch"]:
        """The launch just made with ``(grid, args, constexprs)`` as a :class:`PreparedLaunch`
        whose first ``len(leading)`` arguments a call supplies, or None where it cannot be
        prepared: the launch is not compiled (``on_gpu`` False: the interpreter), or one of
        ``leading`` is not what the caller will pass in that place (the argument itself, or for
        a tensor one at the same address, the caller's tensor of which the argument is a view;
        not a copy made for the launch)."""
        on_gpu = on_gpu or self.stand_in
        entry = self._launchers.get(self._signature(grid, args, constexprs)) if on_gpu else None
        if entry is None:
            return None
        for given, passed in zip(leading, args):
            if isinstance(passed, torch.Tensor):
                fits = isinstance(given, torch.Tensor) and given.data_ptr() == passed.data_ptr()
            else:
                fits = type(given) is type(passed)
            if not fits:
                return None
        launcher, trailing, _ = entry
        count = len(leading)
        return PreparedLaunch(
            launcher, (*args[count:], *trailing),
            tuple((position, value.data_ptr() % 16 == 0) for position, value in enumerate(args[:count])
                  if isinstance(value, torch.Tensor)),
            tuple((position, _integer_type(args[position])) for position in sorted(self._volatile)
                  if position < count))


def _split_alignment(aligned) -> tuple[tuple, list]:
    """``(position, aligned)`` pairs as the positions and the list of flags a call's alignment is
    compared with in one comprehension (the comparison runs on every call)."""
    pairs = tuple(aligned)
    return tuple(position for position, _ in pairs), [flag for _, flag in pairs]


class PreparedLaunch:
    """A compiled kernel's launch with every argument after the leading ones bound.

    ``prepared(*leading)`` launches with ``leading`` in front and returns True, unless a leading
    tensor's 16-byte alignment or a volatile integer's type differs from the call it was
    prepared from (Triton would have compiled another kernel): then it launches nothing and
    returns False. ``fits`` and ``launch`` are the two halves, for an op that must know all its
    launches fit before making the first. The caller vouches for everything else (shapes,
    strides, dtypes, devices and plain arguments equal to the prepared call's): that is what the
    op's :class:`Dispatch` signature holds."""

    __slots__ = ("_launcher", "_bound", "_positions", "_aligned", "_integer_types")

    def __init__(self, launcher, bound: tuple, aligned: tuple, integer_types: tuple):
        self._launcher = launcher
        self._bound = bound
        self._positions, self._aligned = _split_alignment(aligned)
        self._integer_types = integer_types

    def fits(self, *leading) -> bool:
        if [leading[position].data_ptr() % 16 == 0 for position in self._positions] != self._aligned:
            return False
        for position, integer_type in self._integer_types:
            if _integer_type(leading[position]) != integer_type:
                return False
        return True

    def launch(self, *leading) -> None:
        self._launcher(*leading, *self._bound)

    def __call__(self, *leading) -> bool:
        if not self.fits(*leading):
            return False
        self.launch(*leading)
        return True


class PreparedLaunches:
    """Several :class:`PreparedLaunch` made as one call: ``prepared(*tensors)`` launches them all,
    each with its leading arguments taken from the op's tensors (``split(*tensors)``, in launch
    order), and returns True; or, if a tensor's 16-byte alignment differs from the ``tensors``
    they were prepared with, launches none and returns False (a later launch refused never
    leaves an earlier one made twice). Every leading tensor of the launches is one of the op's
    tensors at the same address (what :meth:`CompiledLaunch.prepare` checked), so the op's
    tensors' alignment, checked once each, is every launch's; their leading arguments hold no
    volatile integer."""

    __slots__ = ("_launches", "_split", "_positions", "_aligned")

    def __init__(self, launches: Sequence[PreparedLaunch], split: Callable[..., tuple], tensors: Sequence):
        if any(prepared._integer_types for prepared in launches):
            raise ValueError("launches: expected no volatile integer among the leading arguments")
        self._launches = tuple(launches)
        self._split = split
        self._positions, self._aligned = _split_alignment(
            (position, tensor.data_ptr() % 16 == 0) for position, tensor in enumerate(tensors)
            if isinstance(tensor, torch.Tensor))

    def __call__(self, *tensors) -> bool:
        if [tensors[position].data_ptr() % 16 == 0 for position in self._positions] != self._aligned:
            return False
        for prepared, leading in zip(self._launches, self._split(*tensors)):
            prepared.launch(*leading)
        return True


class StandInKernel:
    """A kernel that launches nothing, called as :class:`CompiledLaunch` calls a compiled GPU
    kernel: ``stand_in[grid](*args, **constexprs)`` binds and returns the compiled kernel, whose
    ``[grid]`` (three dimensions) is its launcher. ``record``, if given, receives
    ``("bind", name, args, constexprs)`` and ``("compiled", name, all_args)``. For tools that time
    or inspect launches without a GPU (``bench/host_overhead.py``, the tests), installed with
    ``stand_in=True``."""

    def __init__(self, kernel, record: Optional[Callable[[tuple], None]] = None):
        fn = getattr(kernel, "fn", kernel)
        self.name = fn.__name__
        self.signature = inspect.signature(fn)
        self.arg_names = list(self.signature.parameters)
        self._record = record

    def __getitem__(self, grid):
        def bind(*args, **constexprs):
            if self._record is None:
                launcher = lambda *all_args: None  # noqa: E731
            else:
                self._record(("bind", self.name, args, constexprs))
                launcher = lambda *all_args: self._record(("compiled", self.name, all_args))  # noqa: E731
            return {(*grid, 1, 1)[:3]: launcher}

        return bind


def replace_kernel(module, name: str, replacement, stand_in: bool = False) -> None:
    """Put ``replacement`` in place of ``module``'s kernel ``name``, in the module and in the
    :class:`CompiledLaunch` objects that wrap it: for tools that record or stub launches
    (``bench.sass_count``, ``bench/host_overhead.py``). ``stand_in``: launch it as a compiled GPU
    kernel whatever the tensors' device (``replacement[grid](*args, **constexprs)`` must then
    return an object whose ``[grid]`` is the launcher, as :class:`StandInKernel` does)."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    for value in vars(module).values():
        if isinstance(value, CompiledLaunch) and value.kernel is original:
            value.kernel = replacement
            value.stand_in = stand_in
            value.clear()
    clear_dispatches()  # prepared launches hold the kernel's compiled launcher
