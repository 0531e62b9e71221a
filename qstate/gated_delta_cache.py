"""``GatedDeltaReplayCache``: the device tensors of replay decoding for one gated delta rule
layer (GDN or KDA; ``docs/design.md#gdn-replay``).

Per slot (one sequence) it holds:

==================  =================================================  ==========================
tensor              shape                                              dtype
==================  =================================================  ==========================
``checkpoint``      ``(slots, HV, V, K)``                              fp32, bf16 or fp16
``read``            ``(slots, HV, V, K)`` or None                      read storage dtype
``read_scale``      ``(slots, HV, V)`` (row formats) or None            fp32
``ring_k``          ``(slots, HK, capacity, K)``                       ``input_dtype``: raw keys
``ring_v``          ``(slots, HV, capacity, V)``                       ``input_dtype``
``ring_g``          ``(slots, HV, capacity)`` or ``(…, capacity, K)``  fp32: log-space gates
``ring_beta``       ``(slots, HV, capacity)``                          fp32
``ring_inverse``    ``(slots, HV, ring_len, ring_len)`` or None         fp32: rows of ``(I + B)⁻¹``
``cursor``          ``(slots,)``                                       int32: tokens in the ring
``drafts``          ``(slots,)``                                       int32: pending drafts
``commit_errors``   ``(1,)``                                           int32: error bits
``slot_flags``      ``(slots,)``                                       int32: flag bits
==================  =================================================  ==========================

The ring holds the layer's own inputs, never the corrected value (``docs/design.md#gdn-ring-designs``):
keys per key head as the caller gave them (normalized where read), values, gates and β per value
head; each head's ring is one contiguous block, read by a program in one sweep. ``ring_g`` has
one gate per head (``gate="scalar"``, GDN) or one per key channel (``gate="channel"``, KDA).
``ring_inverse`` (KDA caches without ``max_draft``; None otherwise) holds, for each token the ring
holds, its row of ``(I + B)⁻¹``, the matrix by which a flush carries earlier corrections into
later reads (``kernels/gated_delta/README.md#replay``): the step that appends token j writes row
j, so a flush reads rows it need not compute. Rows at and past the cursor are never read. A GDN
flush computes the whole matrix from one Gram product, cheaper than keeping it.

Speculative decoding (:func:`qstate.gated_delta_replay_verify`,
:func:`qstate.gated_delta_replay_commit`; kernels/gated_delta/README.md#speculative) needs room
for the drafts past the committed tokens: ``allocate(..., max_draft=T_max)`` makes the ring
``capacity = ring_len + max_draft`` tokens long (``capacity == ring_len`` without it). A commit
flushes a slot once ``ring_len`` tokens are committed, so between rounds ``cursor < ring_len``.
``drafts[s]`` counts the drafts the last verify appended past the cursor (0: nothing to commit);
``commit_errors`` collects the bits of commits refused on the device
(:func:`qstate.gated_delta_replay_check_commits` reads and clears them). ``slot_flags[s]``
holds the bits the kernels OR in on the device, as ``qstate.ReplayCache``'s
(``qstate/cache.py`` has the table): ``SLOT_BAD_CURSOR`` when the slot's cursor lies outside
its ring (the row outputs NaN and nothing of the slot is written, its cursor included),
``SLOT_NONFINITE`` when a NaN or ±inf reaches one of the slot's outputs. They are sticky until
the caller clears them (:meth:`reset` clears the reset slots').

A serving engine that owns its memory builds a cache over its own tensors with
:meth:`GatedDeltaReplayCache.from_tensors`, then admits each sequence with :meth:`reset`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import _cache_slots, _validate
from ._cache_slots import SlotsLike
from .formats import FormatLike, StateFormat, as_format
from .reference.gated_delta import l2norm

__all__ = ["GatedDeltaReplayCache", "CHECKPOINT_FORMATS", "READ_FORMATS", "GATES"]

CHECKPOINT_FORMATS = ("fp32", "bf16", "fp16")
READ_FORMATS = ("bf16", "fp8_e4m3:row", "fp8_e5m2:row", "int8:row")
GATES = ("scalar", "channel")


def _formats(checkpoint, read, names=("checkpoint", "read")):
    ck = as_format(checkpoint, names[0])
    if str(ck) not in CHECKPOINT_FORMATS:
        raise ValueError(f"{names[0]}: expected one of {list(CHECKPOINT_FORMATS)}, got '{ck}'")
    if read is None:
        return ck, None
    rd = as_format(read, names[1])
    if str(rd) not in READ_FORMATS:
        raise ValueError(f"{names[1]}: expected None or one of {list(READ_FORMATS)}, got '{rd}'")
    return ck, rd


@dataclasses.dataclass(eq=False)
class GatedDeltaReplayCache:
    """Replay state of one gated delta rule layer: checkpoint, read copy, input ring, cursors.

    Build with :meth:`allocate` or :meth:`from_tensors`; do not construct directly.
    """

    checkpoint_format: StateFormat
    read_format: Optional[StateFormat]
    checkpoint: torch.Tensor
    read: Optional[torch.Tensor]
    read_scale: Optional[torch.Tensor]
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    ring_g: torch.Tensor
    ring_beta: torch.Tensor
    cursor: torch.Tensor
    max_draft: int = 0
    drafts: Optional[torch.Tensor] = None
    commit_errors: Optional[torch.Tensor] = None
    slot_flags: Optional[torch.Tensor] = None
    ring_inverse: Optional[torch.Tensor] = None

    def __post_init__(self):
        # Small counters not given get zeroed tensors here.
        for name, shape in (("drafts", self.cursor.shape), ("commit_errors", (1,)), ("slot_flags", self.cursor.shape)):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(shape, dtype=torch.int32, device=self.cursor.device))
        if self.ring_inverse is None and self.keeps_inverse:
            slots, HV, L = self.ring_beta.shape
            self.ring_inverse = torch.zeros((slots, HV, L, L), dtype=torch.float32, device=self.ring_beta.device)

    @classmethod
    def allocate(
        cls, num_slots: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, *,
        gate: str = "scalar", ring_len: int = 16, checkpoint: FormatLike = "fp32",
        read: Optional[FormatLike] = "fp8_e4m3:row", input_dtype: torch.dtype = torch.bfloat16, device=None,
        max_draft: int = 0,
    ) -> "GatedDeltaReplayCache":
        """A zeroed cache of ``num_slots`` slots (cursors at 0, states zero).

        ``gate``: ``"scalar"`` (GDN, ``g (batch, HV)``) or ``"channel"`` (KDA, ``g (batch, HV,
        K)``). ``checkpoint``: fp32, bf16 or fp16; ``read``: None (outputs read the checkpoint),
        bf16, ``fp8_e4m3:row``, ``fp8_e5m2:row`` or ``int8:row``. ``input_dtype``: the dtype of
        the ring's k and v, which must be that of the decode inputs (fp32, bf16 or fp16).
        ``max_draft``: the most drafts one :func:`qstate.gated_delta_replay_verify` may take (0:
        no speculative decoding); the ring then holds ``ring_len + max_draft`` tokens.
        """
        for name, value in (("num_slots", num_slots), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
                            ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("ring_len", ring_len)):
            _validate.positive_int(name, value)
        if num_v_heads % num_k_heads:
            raise ValueError(f"num_v_heads: expected a multiple of num_k_heads = {num_k_heads}, got {num_v_heads}")
        if gate not in GATES:
            raise ValueError(f"gate: expected one of {list(GATES)}, got {gate!r}")
        _cache_slots.check_max_draft(max_draft)
        ck_fmt, rd_fmt = _formats(checkpoint, read)
        _cache_slots.check_input_dtype(input_dtype)
        capacity = ring_len + max_draft
        device = torch.device("cpu") if device is None else torch.device(device)
        shape = (num_slots, num_v_heads, head_v_dim, head_k_dim)

        def zeros(shp, dtype):
            return torch.zeros(shp, dtype=dtype, device=device)

        gate_shape = (num_slots, num_v_heads, capacity) + ((head_k_dim,) if gate == "channel" else ())
        cache = cls(
            checkpoint_format=ck_fmt, read_format=rd_fmt, checkpoint=zeros(shape, ck_fmt.storage_dtype),
            read=None if rd_fmt is None else zeros(shape, rd_fmt.storage_dtype),
            read_scale=None if rd_fmt is None or not rd_fmt.scaled else zeros(rd_fmt.scale_shape(shape), torch.float32),
            ring_k=zeros((num_slots, num_k_heads, capacity, head_k_dim), input_dtype),
            ring_v=zeros((num_slots, num_v_heads, capacity, head_v_dim), input_dtype),
            ring_g=zeros(gate_shape, torch.float32), ring_beta=zeros((num_slots, num_v_heads, capacity), torch.float32),
            cursor=zeros((num_slots,), torch.int32), max_draft=max_draft,
        )
        if device.type != "meta":
            cache.reset(range(num_slots))
        return cache

    @classmethod
    def from_tensors(
        cls, *, checkpoint: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
        ring_beta: torch.Tensor, cursor: torch.Tensor, checkpoint_format: FormatLike = "fp32",
        read_format: Optional[FormatLike] = None, read: Optional[torch.Tensor] = None,
        read_scale: Optional[torch.Tensor] = None, max_draft: int = 0, drafts: Optional[torch.Tensor] = None,
        commit_errors: Optional[torch.Tensor] = None, slot_flags: Optional[torch.Tensor] = None,
        ring_inverse: Optional[torch.Tensor] = None, use_qk_l2norm: bool = True,
    ) -> "GatedDeltaReplayCache":
        """A cache over tensors the caller owns (shapes and dtypes in the module docstring);
        nothing is copied or cleared: zero ``drafts`` and ``commit_errors`` and :meth:`reset`
        every slot before the first step (``drafts``, ``commit_errors`` and ``slot_flags`` are
        allocated, zeroed, when not given). The ring holds ``ring_k.shape[2] = ring_len +
        max_draft`` tokens. The cursors and drafts are read once here (one host sync) and must
        lie in the ring: ``0 <= cursor < ring_len`` and ``0 <= drafts <= max_draft`` (a cursor that
        memory written later puts outside is met on the device: ``SLOT_BAD_CURSOR``).
        ``ring_inverse`` (KDA, without ``max_draft``): as another cache's held it over the same
        ring; None allocates it and computes its rows from the ring's tokens below the cursors,
        with ``use_qk_l2norm`` as the steps will take it."""
        ck_fmt, rd_fmt = _formats(checkpoint_format, read_format, ("checkpoint_format", "read_format"))
        _cache_slots.check_max_draft(max_draft)
        _validate.tensor("ring_k", ring_k, ndim=4)
        if ring_k.shape[2] <= max_draft:
            raise ValueError(f"ring_k: expected more than max_draft = {max_draft} tokens (ring_len + max_draft) in "
                             f"dim 2, got shape {tuple(ring_k.shape)}")
        cache = cls(checkpoint_format=ck_fmt, read_format=rd_fmt, checkpoint=checkpoint, read=read,
                    read_scale=read_scale, ring_k=ring_k, ring_v=ring_v, ring_g=ring_g, ring_beta=ring_beta,
                    cursor=cursor, max_draft=max_draft, drafts=drafts, commit_errors=commit_errors,
                    slot_flags=slot_flags, ring_inverse=ring_inverse)
        cache.validate()
        _cache_slots.check_counter("cursor", cursor, cache.ring_len, "")
        _cache_slots.check_counter("drafts", cache.drafts, max_draft + 1, "")
        if ring_inverse is None and cache.keeps_inverse:
            if not isinstance(use_qk_l2norm, bool):
                raise TypeError(f"use_qk_l2norm: expected a bool, got {type(use_qk_l2norm).__name__}")
            cache._rebuild_ring_inverse(use_qk_l2norm)
        return cache

    def validate(self) -> None:
        """Check shapes, dtypes, devices and contiguity of every tensor; raise naming the field."""
        _validate.tensor("checkpoint", self.checkpoint, ndim=4, floating=False)
        _validate.tensor("ring_k", self.ring_k, ndim=4)
        _validate.tensor("ring_g", self.ring_g)
        slots, HV, V, K = self.checkpoint.shape
        HK, L = self.ring_k.shape[1], self.ring_k.shape[2]
        if min(V, K, HV, L - self.max_draft) < 1:
            raise ValueError(f"checkpoint: expected HV, V, K >= 1 and a ring of >= 1 token, got checkpoint "
                             f"{tuple(self.checkpoint.shape)}, ring_k {tuple(self.ring_k.shape)}")
        if HK < 1 or HV % HK:
            raise ValueError(f"ring_k: expected HK dividing HV = {HV} in dim 1, got shape {tuple(self.ring_k.shape)}")
        if self.ring_g.dim() not in (3, 4):
            raise ValueError(f"ring_g: expected (slots, HV, ring_len) or (slots, HV, ring_len, K), got shape "
                             f"{tuple(self.ring_g.shape)}")
        _cache_slots.check_input_dtype(self.ring_k.dtype, "ring_k")
        shape = (slots, HV, V, K)
        gate = (slots, HV, L) + ((K,) if self.ring_g.dim() == 4 else ())
        expected = {
            "checkpoint": (self.checkpoint, shape, self.checkpoint_format.storage_dtype),
            "ring_k": (self.ring_k, (slots, HK, L, K), self.ring_k.dtype),
            "ring_v": (self.ring_v, (slots, HV, L, V), self.ring_k.dtype),
            "ring_g": (self.ring_g, gate, torch.float32),
            "ring_beta": (self.ring_beta, (slots, HV, L), torch.float32),
            "cursor": (self.cursor, (slots,), torch.int32),
            "drafts": (self.drafts, (slots,), torch.int32),
            "commit_errors": (self.commit_errors, (1,), torch.int32),
            "slot_flags": (self.slot_flags, (slots,), torch.int32),
        }
        rd = self.read_format
        _cache_slots.expect_optional(expected, "read", self.read, None if rd is None else (shape, rd.storage_dtype),
                                     rd)
        _cache_slots.expect_optional(expected, "read_scale", self.read_scale,
                                     None if rd is None or not rd.scaled else (rd.scale_shape(shape), torch.float32),
                                     rd)
        if not self.keeps_inverse:
            if self.ring_inverse is not None:
                why = f"max_draft = {self.max_draft}" if self.max_draft else 'gate "scalar"'
                raise ValueError(f"ring_inverse: expected None with {why}, got a tensor")
        else:
            expected["ring_inverse"] = (self.ring_inverse, (slots, HV, L, L), torch.float32)
        _validate.cache_tensors(expected, self.checkpoint.device)

    # ---------------------------------------------------------------- sizes

    @property
    def ring_len(self) -> int:
        """Committed tokens that make a flush: ``capacity − max_draft``."""
        return self.ring_k.shape[2] - self.max_draft

    @property
    def capacity(self) -> int:
        """Tokens the ring holds: ``ring_len + max_draft``."""
        return self.ring_k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.checkpoint.shape[0]

    @property
    def num_k_heads(self) -> int:
        return self.ring_k.shape[1]

    @property
    def num_v_heads(self) -> int:
        return self.checkpoint.shape[1]

    @property
    def head_v_dim(self) -> int:
        return self.checkpoint.shape[2]

    @property
    def head_k_dim(self) -> int:
        return self.checkpoint.shape[3]

    @property
    def gate(self) -> str:
        return "channel" if self.ring_g.dim() == 4 else "scalar"

    @property
    def keeps_inverse(self) -> bool:
        """Whether the steps keep rows of ``(I + B)⁻¹`` in ``ring_inverse`` (KDA, no drafts)."""
        return self.max_draft == 0 and self.gate == "channel"

    @property
    def device(self) -> torch.device:
        return self.checkpoint.device

    @property
    def input_dtype(self) -> torch.dtype:
        return self.ring_k.dtype

    def tensors(self) -> dict:
        names = ("checkpoint", "read", "read_scale", "ring_k", "ring_v", "ring_g", "ring_beta", "ring_inverse",
                 "cursor", "drafts", "commit_errors", "slot_flags")
        return {n: getattr(self, n) for n in names}

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors of the cache."""
        return _cache_slots.tensor_bytes(self.tensors().values())

    def bytes_per_step(self) -> float:
        """Bytes of cache traffic per slot and decode step, averaged over one flush cycle: the
        state read of the ``ring_len − 1`` normal steps (read copy with scales, or checkpoint),
        the flush (read and write the checkpoint, write the read copy), each token's append and
        the ring reads (``n`` tokens at a normal step ``n``, ``L − 1`` at the flush), and KDA's
        rows of ``ring_inverse`` (``n`` read and one written at a normal step ``n``, ``L − 1``
        read at the flush). Decode inputs and outputs are not included. For :func:`qstate.gated_delta_replay` (caches
        without ``max_draft``)."""
        L = self.ring_len
        ck = _cache_slots.slot_state_bytes(self.checkpoint, None)
        rd = ck if self.read is None else _cache_slots.slot_state_bytes(self.read, self.read_scale)
        per_token = sum(t[0, :, 0].numel() * t.element_size() for t in (self.ring_k, self.ring_v, self.ring_g,
                                                                       self.ring_beta))
        flush = 2 * ck + (0 if self.read is None else rd)
        ring_reads = (L - 1) * (L - 2) // 2 + (L - 1)
        inverse_rows = ring_reads + (L - 1)
        inverse = 0 if self.ring_inverse is None else inverse_rows * self.num_v_heads * L * 4
        return ((L - 1) * rd + flush + (ring_reads + L) * per_token + inverse) / L

    # ---------------------------------------------------------------- admission and read-out

    def _slots(self, slots: SlotsLike, name: str = "slots") -> torch.Tensor:
        return _cache_slots.slot_index(slots, self.num_slots, self.device, name)

    def reset(self, slots: SlotsLike, state: Optional[torch.Tensor] = None) -> None:
        """Admit sequences: checkpoint ← ``quantize(state)`` (or zeros), read copy ←
        ``quantize(dequantize(checkpoint))``, ring emptied (cursor 0), as the reference does.
        ``state (len(slots), HV, V, K)``, floating point (the prefill's final state, V-first).
        Pending drafts and the slots' flags are cleared."""
        idx = self._slots(slots)
        shape = (idx.numel(), self.num_v_heads, self.head_v_dim, self.head_k_dim)
        values = _cache_slots.admission_values(state, shape, self.device, "(len(slots), HV, V, K)")
        if idx.numel() == 0:
            return
        _cache_slots.admit(idx, values, self.checkpoint_format, self.checkpoint, None, self.read_format, self.read,
                           self.read_scale)
        self.cursor[idx] = 0
        self.drafts[idx] = 0
        self.slot_flags[idx] = 0

    def checkpoint_values(self, slots: SlotsLike) -> torch.Tensor:
        """fp32 values of the stored checkpoints of ``slots``: ``(n, HV, V, K)``."""
        return _cache_slots.stored_values(self.checkpoint, None, self.checkpoint_format, self._slots(slots))

    def read_values(self, slots: SlotsLike) -> torch.Tensor:
        """fp32 values the normal steps read: the read copy, or the checkpoint without one."""
        if self.read is None:
            return self.checkpoint_values(slots)
        return _cache_slots.stored_values(self.read, self.read_scale, self.read_format, self._slots(slots))

    def materialize(self, slots: SlotsLike, *, use_qk_l2norm: bool = True) -> torch.Tensor:
        """fp32 state of ``slots`` with their rings folded in: ``(n, HV, V, K)``, computed in fp64
        from the checkpoint and the ``cursor`` tokens of each ring, then rounded to fp32.
        ``use_qk_l2norm`` as given to the steps (the ring holds raw keys)."""
        idx = self._slots(slots)
        S = self.checkpoint_values(idx).double()
        group = self.num_v_heads // self.num_k_heads
        for row, slot in enumerate(idx.tolist()):
            for j in range(int(self.cursor[slot])):
                k = self.ring_k[slot, :, j]
                k = (l2norm(k) if use_qk_l2norm else k).double().repeat_interleave(group, dim=0)  # [HV, K]
                alpha = torch.exp(self.ring_g[slot, :, j].double())
                alpha = alpha[:, None, :] if alpha.dim() == 2 else alpha[:, None, None]
                beta = self.ring_beta[slot, :, j].double()[:, None]
                s = S[row] * alpha
                d = beta * (self.ring_v[slot, :, j].double() - (s * k[:, None, :]).sum(-1))
                S[row] = s + d[..., None] * k[:, None, :]
        return S.float()

    def _rebuild_ring_inverse(self, use_qk_l2norm: bool) -> None:
        """``ring_inverse``'s rows below each slot's cursor from the ring's tokens, in fp64 (what
        the steps that appended them would have written, up to fp32 rounding); zero elsewhere."""
        L, group = self.ring_len, self.num_v_heads // self.num_k_heads
        position = torch.arange(L, device=self.device)
        self.ring_inverse.zero_()
        for slot, count in enumerate(self.cursor.tolist()):
            live = position < count
            earlier = (position[None, :] < position[:, None]) & live[:, None] & live[None, :]  # [L, L]: i < j
            k = self.ring_k[slot]
            k = (l2norm(k) if use_qk_l2norm else k).double().repeat_interleave(group, dim=0)  # [HV, L, K]
            k = torch.where(live[None, :, None], k, 0.0)
            beta = torch.where(live, self.ring_beta[slot].double(), 0.0)  # [HV, L]
            # A log-gate per key channel: gamma [HV, L, K], exponent [HV, L, L, K].
            gamma = torch.cumsum(torch.where(live[None, :, None], self.ring_g[slot].double(), 0.0), dim=1)
            exponent = torch.where(earlier[None, :, :, None], gamma[:, :, None, :] - gamma[:, None, :, :], 0.0)
            gram = torch.einsum("hjc,hic,hjic->hji", k, k, torch.exp(exponent))
            B = torch.where(earlier[None], beta[:, :, None] * gram, 0.0)
            identity = torch.eye(L, dtype=torch.float64, device=self.device).expand_as(B)
            inverse = torch.linalg.solve_triangular(identity + B, identity, upper=False, unitriangular=True)
            self.ring_inverse[slot] = torch.where(live[None, :, None], inverse, 0.0).float()
