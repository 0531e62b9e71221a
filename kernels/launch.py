"""Eager GPU launches of a ``@triton.jit`` kernel without Triton's per-call argument binding.

``kernel[grid](*args, **constexprs)`` specializes every argument again on every call (pointer
alignment, integer divisibility, the cache key): on the H200 machine's host about 30 µs of a
36 µs conventional launcher call, against 9 µs for the compiled kernel's own launcher
(kernels/README.md, "launch.py"). :class:`CompiledLaunch` makes the first call of a call
signature through ``kernel[grid]`` and keeps the compiled kernel's launcher
(``CompiledKernel[grid]``, the launch path Triton gives compiled kernels); later calls with the
same signature go straight to it.

A signature is what Triton specializes on, taken conservatively: the launch's constexprs (the
launcher's cached plan, by identity), the grid, the device, each tensor argument's dtype and
whether its address is a multiple of 16, and the exact value of every other argument, except
``volatile`` ones (declared ``do_not_specialize`` in the kernel), of which only the integer
type Triton gives them counts. CPU tensors (the interpreter) always take ``kernel[grid]``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

# Eager GPU calls after the first of a call signature launch the compiled kernel directly;
# False: every call through ``kernel[grid]``.
ENABLED = True
# Entries kept per kernel before the table starts again (call signatures come from shapes and
# strides, so a serving engine meets few; the bound only keeps a pathological caller finite).
MAX_SIGNATURES = 4096


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

    def __init__(self, kernel, volatile: Sequence[str] = ()):
        self.kernel = kernel
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
        if not (ENABLED and on_gpu):
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


def replace_kernel(module, name: str, replacement) -> None:
    """Put ``replacement`` in place of ``module``'s kernel ``name``, in the module and in the
    :class:`CompiledLaunch` objects that wrap it: for tools that record or stub launches
    (``bench.sass_count``, ``bench/host_overhead.py``)."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    for value in vars(module).values():
        if isinstance(value, CompiledLaunch) and value.kernel is original:
            value.kernel = replacement
            value.clear()
