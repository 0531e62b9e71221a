"""``ReplayCache``: the device tensors of replay decoding (docs/design.md#replay, #read-copy).

One cache serves one SSM layer. Per slot (one sequence) it holds:

==================  =================================================  ==========================
tensor              shape                                              dtype
==================  =================================================  ==========================
``checkpoint``      ``(slots, nheads, headdim, dstate)``               checkpoint storage dtype
``checkpoint_scale````checkpoint.scale_shape`` or None                   fp32
``read``            ``(slots, nheads, headdim, dstate)`` or None       read storage dtype
``read_scale``      ``read.scale_shape`` or None                       fp32
``ring_x``          ``(slots, nheads, capacity, headdim)``             ``input_dtype``
``ring_dt``         ``(slots, nheads, capacity)``                      fp32 (processed dt)
``ring_B``          ``(slots, ngroups, capacity, dstate)``             ``input_dtype``
``cursor``          ``(slots,)``                                       int32: tokens in the ring
``drafts``          ``(slots,)``                                       int32: tentative tokens
``commit_errors``   ``(1,)``                                           int32: error bits
``slot_flags``      ``(slots,)``                                       int32: flag bits
``generation``      ``(slots,)``                                       int32: flushes so far
``flush_rows``      ``(slots,)``                                       int32: scratch of a step
``flush_counters``  ``(2,)``                                           int32: scratch of a step
==================  =================================================  ==========================

The ring is laid out per head (``ring_x[s, h]`` is one contiguous ``ring_len × headdim``
block) so that a kernel program reads its head's ring in one sweep; ``B`` is stored once per
group, as the inputs give it. ``generation`` numbers the flushes of a slot; stochastic
rounding draws its noise from it, so replaying a CUDA graph draws fresh noise.
``flush_rows`` and ``flush_counters`` are the work list of one step (rows whose ring became
full), zero between ``replay_decode`` calls (the flush kernel empties the list; the single-launch
step counts per-slot tickets in ``flush_rows`` and zeroes them); a verify's list in
``flush_rows`` stays, and nothing reads it past the count.

Speculative decoding (:func:`qstate.replay_verify`, :func:`qstate.replay_commit`, docs/design.md#speculative)
needs room for the drafts beyond the committed tokens: ``allocate(..., max_draft=T_max)``
makes the ring ``capacity = ring_len + max_draft`` tokens long (``capacity == ring_len``
without it). ``drafts[s]`` counts the tokens a verify appended beyond the cursor (0: nothing
to commit); ``commit_errors`` collects the bits of commits refused on the device
(:func:`qstate.replay_check_commits` reads and clears them).

``slot_flags[s]`` holds bits the kernels OR in on the device, sticky until the caller clears
them (:meth:`ReplayCache.reset` clears the reset slots'; ``slot_flags.zero_()`` all). An engine
reads them whenever it likes, e.g. copied to the host asynchronously with the outputs; no op
syncs for them:

===================  =====  ==================================================================
constant             bit    set when
===================  =====  ==================================================================
``SLOT_BAD_CURSOR``  1      the slot's ``cursor`` lies outside its ring (``0 ≤ cursor <
                            capacity`` broken by memory a caller wrote), or a commit would move
                            it there: the call outputs NaN for the row and writes nothing of
                            the slot (not its ring, state, cursor or drafts)
``SLOT_NONFINITE``   2      a NaN or ±inf reached one of the slot's outputs (replay decode,
                            flush, verify) or a verify flush's new checkpoint: every input
                            token, ring entry in use and state element reaches them. The values
                            stay in the slot (formats.py, "Non-finite values", says what each
                            state format stores for them); no other slot is read or written
===================  =====  ==================================================================

A serving engine that owns its memory builds a cache over its own tensors with
:meth:`ReplayCache.from_tensors` (same shapes and dtypes as the table; the checkpoint, read
copy and ring may be views into a larger pool as long as each is contiguous), then admits each
sequence with :meth:`reset` after prefill.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import torch

from . import _cache_slots, _validate
from ._cache_slots import SlotsLike
from .formats import FLT_MIN, FormatLike, StateFormat, as_format
from .kernels.common import slot_flags as _slot_flags

__all__ = ["ReplayCache", "SLOT_BAD_CURSOR", "SLOT_NONFINITE"]

SLOT_BAD_CURSOR = _slot_flags.SLOT_BAD_CURSOR.value
SLOT_NONFINITE = _slot_flags.SLOT_NONFINITE.value


@dataclasses.dataclass(eq=False)
class ReplayCache:
    """Replay state of one layer: checkpoint, read copy, ring of recent inputs, cursors.

    Build with :meth:`allocate` or :meth:`from_tensors`; do not construct directly.
    """

    checkpoint_format: StateFormat
    read_format: Optional[StateFormat]
    ring_len: int
    checkpoint: torch.Tensor
    checkpoint_scale: Optional[torch.Tensor]
    read: Optional[torch.Tensor]
    read_scale: Optional[torch.Tensor]
    ring_x: torch.Tensor
    ring_dt: torch.Tensor
    ring_B: torch.Tensor
    cursor: torch.Tensor
    generation: torch.Tensor
    flush_rows: torch.Tensor
    flush_counters: torch.Tensor
    seed: int = 0
    max_draft: int = 0
    drafts: Optional[torch.Tensor] = None
    commit_errors: Optional[torch.Tensor] = None
    slot_flags: Optional[torch.Tensor] = None

    def __setattr__(self, name, value):
        # The kernels take the seed as it is at each call: a seed set later is checked like one given.
        if name == "seed":
            _check_seed(value)
        super().__setattr__(name, value)

    def __post_init__(self):
        # Small counters not given get zeroed tensors here.
        if self.drafts is None:
            self.drafts = torch.zeros(self.cursor.shape, dtype=torch.int32, device=self.cursor.device)
        if self.commit_errors is None:
            self.commit_errors = torch.zeros((1,), dtype=torch.int32, device=self.cursor.device)
        if self.slot_flags is None:
            self.slot_flags = torch.zeros(self.cursor.shape, dtype=torch.int32, device=self.cursor.device)

    # ---------------------------------------------------------------- construction

    @classmethod
    def allocate(
        cls, num_slots: int, nheads: int, headdim: int, dstate: int, ngroups: int = 1, *,
        ring_len: int = 16, checkpoint: FormatLike = "fp32", read: Optional[FormatLike] = "fp8_e4m3:row",
        input_dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0, max_draft: int = 0,
    ) -> "ReplayCache":
        """A zeroed cache of ``num_slots`` slots (cursors at 0, states zero).

        ``checkpoint`` and ``read`` are format strings (``read=None``: no read copy, outputs
        read the checkpoint). ``input_dtype`` is the dtype of the ring's ``x`` and ``B`` (the
        dtype of the decode inputs; fp32, bf16 or fp16). ``seed``, an int in ``[0, 2**31)``,
        seeds stochastic rounding (the rule of every seed in qstate: nothing is masked).
        ``max_draft``: the most draft tokens one :func:`qstate.replay_verify` may append (0: no
        speculative decoding); the ring then holds ``ring_len + max_draft`` tokens.
        """
        for name, v in (("num_slots", num_slots), ("nheads", nheads), ("headdim", headdim),
                        ("dstate", dstate), ("ngroups", ngroups), ("ring_len", ring_len)):
            _validate.positive_int(name, v)
        if nheads % ngroups:
            raise ValueError(f"ngroups: nheads ({nheads}) must be a multiple of ngroups, got {ngroups}")
        _cache_slots.check_max_draft(max_draft)
        capacity = ring_len + max_draft
        ck_fmt, read_fmt = _formats(checkpoint, read)
        _cache_slots.check_input_dtype(input_dtype)
        device = _device(device)
        _check_seed(seed)
        shape = (num_slots, nheads, headdim, dstate)
        _check_block32(ck_fmt, "checkpoint", dstate)
        _check_block32(read_fmt, "read", dstate)

        def zeros(shp, dtype):
            return torch.zeros(shp, dtype=dtype, device=device)

        def scale(fmt):
            # A zero state's scale, as quantize(zeros) gives it: FLT_MIN, or 2**(-1 - emax) for block32.
            if fmt is None or not fmt.scaled:
                return None
            zero = 2.0 ** (-1 - fmt.emax) if fmt.granularity == "block32" else FLT_MIN
            return torch.full(fmt.scale_shape(shape), zero, dtype=torch.float32, device=device)

        return cls(
            checkpoint_format=ck_fmt, read_format=read_fmt, ring_len=ring_len,
            checkpoint=zeros(shape, ck_fmt.storage_dtype), checkpoint_scale=scale(ck_fmt),
            read=None if read_fmt is None else zeros(shape, read_fmt.storage_dtype),
            read_scale=scale(read_fmt),
            ring_x=zeros((num_slots, nheads, capacity, headdim), input_dtype),
            ring_dt=zeros((num_slots, nheads, capacity), torch.float32),
            ring_B=zeros((num_slots, ngroups, capacity, dstate), input_dtype),
            cursor=zeros((num_slots,), torch.int32), generation=zeros((num_slots,), torch.int32),
            flush_rows=zeros((num_slots,), torch.int32), flush_counters=zeros((2,), torch.int32),
            seed=int(seed), max_draft=max_draft,
        )

    @classmethod
    def from_tensors(
        cls, *, checkpoint: torch.Tensor, ring_x: torch.Tensor, ring_dt: torch.Tensor, ring_B: torch.Tensor,
        cursor: torch.Tensor, generation: torch.Tensor, flush_rows: torch.Tensor, flush_counters: torch.Tensor,
        checkpoint_format: FormatLike = "fp32", checkpoint_scale: Optional[torch.Tensor] = None,
        read_format: Optional[FormatLike] = None, read: Optional[torch.Tensor] = None,
        read_scale: Optional[torch.Tensor] = None, seed: int = 0, max_draft: int = 0,
        drafts: Optional[torch.Tensor] = None, commit_errors: Optional[torch.Tensor] = None,
        slot_flags: Optional[torch.Tensor] = None,
    ) -> "ReplayCache":
        """A cache over tensors the caller owns (shapes and dtypes in the module docstring).

        Nothing is copied or cleared: zero ``flush_rows``, ``flush_counters``, ``drafts`` and
        ``commit_errors`` and :meth:`reset` every slot before the first decode step. The ring's
        length is ``ring_len + max_draft``; ``drafts``, ``commit_errors`` and ``slot_flags`` are
        allocated (zeroed) when not given. The kernels address a slot's ring at its cursor, so the
        cursors and drafts are read once here (one host sync) and must lie in the ring:
        ``0 <= cursor < ring_len + max_draft``, ``0 <= drafts <= max_draft`` and
        ``cursor + drafts <= ring_len + max_draft``.
        """
        ck_fmt, read_fmt = _formats(checkpoint_format, read_format, ("checkpoint_format", "read_format"))
        _validate.tensor("ring_x", ring_x, ndim=4)
        _cache_slots.check_max_draft(max_draft)
        _check_seed(seed)
        if ring_x.shape[2] <= max_draft:
            raise ValueError(f"ring_x: expected more than max_draft = {max_draft} tokens (ring_len + max_draft), "
                             f"got {ring_x.shape[2]}")
        cache = cls(
            checkpoint_format=ck_fmt, read_format=read_fmt, ring_len=ring_x.shape[2] - max_draft,
            checkpoint=checkpoint, checkpoint_scale=checkpoint_scale, read=read, read_scale=read_scale,
            ring_x=ring_x, ring_dt=ring_dt, ring_B=ring_B, cursor=cursor, generation=generation,
            flush_rows=flush_rows, flush_counters=flush_counters, seed=int(seed), max_draft=max_draft,
            drafts=drafts, commit_errors=commit_errors, slot_flags=slot_flags,
        )
        cache.validate()
        _check_ring_positions(cache)
        return cache

    def validate(self) -> None:
        """Check shapes, dtypes, devices and contiguity of every tensor; raise naming the field."""
        _validate.tensor("checkpoint", self.checkpoint, ndim=4, floating=False)
        slots, nheads, headdim, dstate = self.checkpoint.shape
        _validate.tensor("ring_B", self.ring_B, ndim=4, floating=False)
        ngroups = self.ring_B.shape[1]
        shape = tuple(self.checkpoint.shape)
        L = self.capacity
        expected = {
            "checkpoint": (self.checkpoint, shape, self.checkpoint_format.storage_dtype),
            "ring_x": (self.ring_x, (slots, nheads, L, headdim), self.ring_x.dtype),
            "ring_dt": (self.ring_dt, (slots, nheads, L), torch.float32),
            "ring_B": (self.ring_B, (slots, ngroups, L, dstate), self.ring_x.dtype),
            "cursor": (self.cursor, (slots,), torch.int32),
            "generation": (self.generation, (slots,), torch.int32),
            "flush_rows": (self.flush_rows, (slots,), torch.int32),
            "flush_counters": (self.flush_counters, (2,), torch.int32),
            "drafts": (self.drafts, (slots,), torch.int32),
            "commit_errors": (self.commit_errors, (1,), torch.int32),
            "slot_flags": (self.slot_flags, (slots,), torch.int32),
        }
        fields = [("checkpoint_scale", self.checkpoint_scale, self.checkpoint_format),
                  ("read", self.read, self.read_format), ("read_scale", self.read_scale, self.read_format)]
        for name, t, fmt in fields:
            if name == "read":
                want = None if fmt is None else (shape, fmt.storage_dtype)
            else:
                want = None if fmt is None or not fmt.scaled else (fmt.scale_shape(shape), torch.float32)
            _cache_slots.expect_optional(expected, name, t, want, fmt)
        _cache_slots.check_input_dtype(self.ring_x.dtype, "ring_x")
        if ngroups < 1 or nheads % ngroups:
            raise ValueError(f"ring_B: nheads ({nheads}) must be a multiple of ngroups, got {ngroups}")
        _check_block32(self.checkpoint_format, "checkpoint", dstate)
        _check_block32(self.read_format, "read", dstate)
        _validate.cache_tensors(expected, self.checkpoint.device)

    # ---------------------------------------------------------------- sizes

    @property
    def capacity(self) -> int:
        """Tokens the ring holds: ``ring_len + max_draft``."""
        return self.ring_len + self.max_draft

    @property
    def num_slots(self) -> int:
        return self.checkpoint.shape[0]

    @property
    def nheads(self) -> int:
        return self.checkpoint.shape[1]

    @property
    def headdim(self) -> int:
        return self.checkpoint.shape[2]

    @property
    def dstate(self) -> int:
        return self.checkpoint.shape[3]

    @property
    def ngroups(self) -> int:
        return self.ring_B.shape[1]

    @property
    def device(self) -> torch.device:
        return self.checkpoint.device

    @property
    def input_dtype(self) -> torch.dtype:
        return self.ring_x.dtype

    def tensors(self) -> dict:
        """Every tensor of the cache by field name (None for absent ones)."""
        names = ("checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B",
                 "cursor", "generation", "flush_rows", "flush_counters", "drafts", "commit_errors", "slot_flags")
        return {n: getattr(self, n) for n in names}

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors of the cache."""
        return _cache_slots.tensor_bytes(self.tensors().values())

    def bytes_per_step(self) -> float:
        """Bytes of cache traffic per slot and decode step, averaged over one flush cycle.

        Counts what the kernels move (kernels/README.md, "Replay: traffic"): the state read of
        the ``ring_len − 1`` normal steps (read copy, or checkpoint, with scales), the flush
        (read the checkpoint, write it and the read copy) and the ring (the reads
        of the tokens already in it, each token's append, and the flush's read of all of them).
        Decode inputs and outputs (x, dt, B, C, z, y) are not included.
        """
        L = self.ring_len
        ck = _cache_slots.slot_state_bytes(self.checkpoint, self.checkpoint_scale)
        rd = ck if self.read is None else _cache_slots.slot_state_bytes(self.read, self.read_scale)
        per_token = self.nheads * (self.headdim * self.ring_x.element_size() + 4) + \
            self.ngroups * self.dstate * self.ring_B.element_size()
        flush = ck + ck + (0 if self.read is None else rd)
        normal_ring_reads = (L - 1) * (L - 2) // 2  # tokens already in the ring, steps n = 0 .. L-2
        ring = (normal_ring_reads + L + L) * per_token  # + the flush's read of L tokens + L appends
        return ((L - 1) * rd + flush + ring) / L

    # ---------------------------------------------------------------- admission and read-out

    def _slots(self, slots: SlotsLike, name: str = "slots") -> torch.Tensor:
        return _cache_slots.slot_index(slots, self.num_slots, self.device, name)

    def reset(self, slots: SlotsLike, state: Optional[torch.Tensor] = None, *,
              generator: Optional[torch.Generator] = None) -> None:
        """Admit sequences: checkpoint ← ``state`` (or zeros), read copy rebuilt, ring emptied,
        ``slot_flags`` cleared.

        ``state (len(slots), nheads, headdim, dstate)``, floating point (the prefill's final
        state), any device. The checkpoint stores ``quantize(state, checkpoint_format)`` and the
        read copy ``quantize(dequantize(checkpoint), read_format)``, as the reference does.
        Stochastic formats (checkpoint and read copy) draw from ``generator`` (None: torch's
        global generator).
        """
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        idx = self._slots(slots)
        shape = (idx.numel(), self.nheads, self.headdim, self.dstate)
        values = _cache_slots.admission_values(state, shape, self.device, "(len(slots), nheads, headdim, dstate)")
        if idx.numel() == 0:
            return
        _cache_slots.admit(idx, values, self.checkpoint_format, self.checkpoint, self.checkpoint_scale,
                           self.read_format, self.read, self.read_scale, generator)
        self.cursor[idx] = 0
        self.drafts[idx] = 0
        self.slot_flags[idx] = 0

    def checkpoint_values(self, slots: SlotsLike) -> torch.Tensor:
        """fp32 values of the stored checkpoints of ``slots``: ``(n, nheads, headdim, dstate)``."""
        return _cache_slots.stored_values(self.checkpoint, self.checkpoint_scale, self.checkpoint_format,
                                          self._slots(slots))

    def read_values(self, slots: SlotsLike) -> torch.Tensor:
        """fp32 values the outputs read: the read copy, or the checkpoint without one."""
        if self.read is None:
            return self.checkpoint_values(slots)
        return _cache_slots.stored_values(self.read, self.read_scale, self.read_format, self._slots(slots))

    def materialize(self, slots: SlotsLike, A: torch.Tensor) -> torch.Tensor:
        """fp32 state of ``slots`` with their rings folded in: ``(n, nheads, headdim, dstate)``.

        ``S = exp(A·Λ)·deq(checkpoint) + Σ_j exp(A·(Λ − Λ_j))·dt_j · x_j ⊗ B_j`` over the
        ``cursor`` tokens in each ring (docs/design.md#replay), computed in fp64 and rounded to fp32.
        ``A (nheads,)`` is the layer's ``A``, needed for the decay. Ring entries past the
        cursor (tokens of an earlier cycle, rejected drafts) are not read, so a NaN there does
        not reach the result.
        """
        idx = self._slots(slots)
        _validate.tensor("A", A, ndim=1)
        _validate.shape("A", A, (self.nheads,), "(nheads,)")
        f = torch.float64
        S = self.checkpoint_values(idx).to(f)
        n = self.cursor[idx].long()  # [n_slots]
        live = torch.arange(self.capacity, device=self.device)[None, :] < n[:, None]  # [n_slots, L]
        # Selected, not multiplied by 0: an entry past the cursor may hold NaN or inf.
        dts = torch.where(live[:, None, :], self.ring_dt[idx].to(f), 0.0)  # [n_slots, nheads, L]
        xs = torch.where(live[:, None, :, None], self.ring_x[idx].to(f), 0.0)  # [n_slots, nheads, L, P]
        Bs = torch.where(live[:, None, :, None], self.ring_B[idx].to(f), 0.0)  # [n_slots, ngroups, L, N]
        suffix = dts.sum(-1, keepdim=True) - torch.cumsum(dts, dim=-1)  # Λ − Λ_j
        Af = A.to(device=self.device, dtype=f)[None, :, None]
        decay = torch.exp(Af * dts.sum(-1, keepdim=True))[..., None]  # [n_slots, nheads, 1, 1]
        w = torch.exp(Af * suffix) * dts  # [n_slots, nheads, L]
        Bh = Bs.repeat_interleave(self.nheads // self.ngroups, dim=1)  # [n, H, L, N]
        ring = torch.einsum("shl,shlp,shln->shpn", w, xs, Bh)
        return (decay * S + ring).float()


def _formats(checkpoint: FormatLike, read: Optional[FormatLike], names=("checkpoint", "read")):
    ck_fmt = as_format(checkpoint, names[0])
    read_fmt = None if read is None else as_format(read, names[1])
    if ck_fmt.granularity not in (None, "row"):
        raise ValueError(f"{names[0]}: expected fp32, bf16, fp16 (optionally +sr) or an 8-bit ':row' format, got {ck_fmt}")
    return ck_fmt, read_fmt


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch.device, a device string or None, got {device!r}") from None
    if device.type != "meta":
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as err:
            raise ValueError(f"device: {device} is not usable on this machine ({str(err).splitlines()[0]})") from None
    return device


SEED_LIMIT = 2**31


def _check_seed(seed) -> None:
    """Seeds are ints in [0, 2**31): the kernels add the slot and generation above bit 31."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed: expected an int in [0, 2**31), got {seed}")


def _check_ring_positions(cache: "ReplayCache") -> None:
    """Cursors and drafts inside each slot's ring (a kernel addresses the ring at them)."""
    cap = cache.capacity
    cursor, drafts = cache.cursor.long().cpu(), cache.drafts.long().cpu()
    _cache_slots.check_counter("cursor", cursor, cap, " (ring_len + max_draft)")
    bad = (drafts < 0) | (drafts > cache.max_draft)
    if bool(bad.any()):
        raise ValueError(f"drafts: expected values in [0, {cache.max_draft}] (max_draft), got "
                         f"{drafts[bad].tolist()} at slots {bad.nonzero().flatten().tolist()}")
    bad = cursor + drafts > cap
    if bool(bad.any()):
        raise ValueError(f"drafts: expected cursor + drafts <= {cap} (ring_len + max_draft), got "
                         f"{(cursor + drafts)[bad].tolist()} at slots {bad.nonzero().flatten().tolist()}")


def _check_block32(fmt: Optional[StateFormat], name: str, dstate: int) -> None:
    if fmt is not None and fmt.granularity == "block32" and dstate % 32:
        raise ValueError(f"{name}: format {fmt} needs dstate % 32 == 0, got dstate {dstate}")

