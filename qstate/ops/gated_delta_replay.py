"""``gated_delta_replay``: one replay decode step of a gated delta rule layer over a
:class:`qstate.GatedDeltaReplayCache`, as the custom op ``qstate::gated_delta_replay`` (fake impl
included, so it works under ``torch.compile`` and CUDA-graph capture)."""

from __future__ import annotations

from typing import Optional

import torch

from ..gated_delta_cache import GatedDeltaReplayCache
from ..kernels.gated_delta import replay as _kernel
from ..kernels.common.launch import Dispatch
from . import _common, _gated_delta_checks
from ._register import eager, mutating_op

_OP_NAME = "qstate::gated_delta_replay"


class _CacheView:
    """The cache as the launcher reads it, rebuilt inside the custom op from its tensors."""

    def __init__(self, checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta, ring_inverse, cursor,
                 slot_flags, ck_format, rd_format):
        self.checkpoint, self.read, self.read_scale = checkpoint, read, read_scale
        self.ring_k, self.ring_v, self.ring_g, self.ring_beta = ring_k, ring_v, ring_g, ring_beta
        self.ring_inverse, self.cursor = ring_inverse, cursor
        self.slot_flags = slot_flags
        self.checkpoint_format = _common.format_constants(ck_format).fmt
        self.read_format = None if rd_format == "" else _common.format_constants(rd_format).fmt
        self.ring_len = ring_k.shape[2]
        self.num_slots = checkpoint.shape[0]
        self.device = checkpoint.device


def _gated_delta_replay_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    slot_indices: Optional[torch.Tensor], out: torch.Tensor, checkpoint: torch.Tensor, read: Optional[torch.Tensor],
    read_scale: Optional[torch.Tensor], ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
    ring_beta: torch.Tensor, ring_inverse: Optional[torch.Tensor], cursor: torch.Tensor, slot_flags: torch.Tensor,
    row_cursor: torch.Tensor, checkpoint_format: str, read_format: str, qk_scale: float, use_qk_l2norm: bool,
) -> None:
    cache = _CacheView(checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta, ring_inverse, cursor,
                       slot_flags, checkpoint_format, read_format)
    _kernel.launch(cache, q, k, v, g, beta, slot_indices, out, row_cursor, qk_scale=qk_scale,
                   use_qk_l2norm=use_qk_l2norm)


_gated_delta_replay_op = mutating_op(
    _OP_NAME, _gated_delta_replay_impl,
    ("out", "checkpoint", "read", "read_scale", "ring_k", "ring_v", "ring_g", "ring_beta", "ring_inverse", "cursor",
     "slot_flags", "row_cursor"))
# Checks once per signature; an eager GPU repeat launches what its first call prepared.
_DISPATCH = Dispatch(_OP_NAME)


def _check_args(cache, q, k, v, g, beta, scale, use_qk_l2norm, slot_indices, out) -> None:
    """Every check of :func:`gated_delta_replay` that reads only metadata (its signature)."""
    if not isinstance(cache, GatedDeltaReplayCache):
        raise TypeError(f"cache: expected a qstate.GatedDeltaReplayCache, got {type(cache).__name__}")
    cache.validate()
    if cache.max_draft:
        raise ValueError(f"cache: expected a cache without drafts (max_draft 0) for the plain step, got max_draft "
                         f"{cache.max_draft}: use gated_delta_replay_verify with T = 1 and gated_delta_replay_commit")
    dims = _gated_delta_checks.check_token(q, k, v, g, beta, num_v_heads=cache.num_v_heads,
                                           head_k_dim=cache.head_k_dim, head_v_dim=cache.head_v_dim,
                                           device=cache.device, owner="the cache")
    _gated_delta_checks.check_cache_inputs(cache, k, v, g, dims.num_k_heads, dims.channel_gate, "batch")
    _gated_delta_checks.check_scale(scale)
    _common.bool_flag("use_qk_l2norm", use_qk_l2norm)
    _gated_delta_checks.check_slots(slot_indices, dims.batch, cache.num_slots, cache.device, "v")
    if out is not None:
        _gated_delta_checks.check_out(out, v)


def gated_delta_replay(
    cache: GatedDeltaReplayCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, *, scale: Optional[float] = None, use_qk_l2norm: bool = True,
    slot_indices: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One gated delta rule decode token by replay (``docs/design.md#gdn-replay``): outputs from
    the cache's read copy (or checkpoint) and its ring of inputs; the checkpoint changes only
    when a slot's ring fills.

    ======================  ==============================================================
    ``cache``               a :class:`qstate.GatedDeltaReplayCache` (its HK, HV, K, V, gate
                            kind and input dtype fix the inputs')
    ``q``, ``k``            ``(batch, HK, K)``, unit inner stride; ``k`` (and ``v``) in the
                            cache's ``input_dtype``, ``q`` fp32/bf16/fp16
    ``v``, ``out``          ``(batch, HV, V)``, unit inner stride
    ``g``                   ``(batch, HV)`` for a ``gate="scalar"`` cache (GDN) or
                            ``(batch, HV, K)`` for ``gate="channel"`` (KDA): log-space, ``<= 0``
    ``beta``                ``(batch, HV)`` in ``[0, 1]``
    ``slot_indices``        ``(batch,)`` int32/int64, contiguous: each row's slot; negative =
                            padding (output zero, nothing written)
    ======================  ==============================================================

    Each row appends ``(k, v, g, β)`` to its slot's ring. A row whose ring is not yet full
    outputs ``o = S_t q̂`` by the adjoint sweep through the ring from the read copy (one rounding
    of the checkpoint, carried through the ring's contraction) and writes only its ring entry;
    the row whose ring fills folds the ring into the checkpoint in fp32, outputs from the
    unrounded result, stores the checkpoint and rebuilds the read copy; then its cursor returns
    to 0 (``qstate.reference.gated_delta.decode_replay(..., ring="inputs")`` is the reference).
    ``q̂ = l2(q)·scale`` and ``k̂ = l2(k)`` in fp32 as in :func:`qstate.gated_delta_update`;
    ``use_qk_l2norm`` and ``scale`` must stay the same for every step between resets (the ring
    keeps raw keys). The flush decision is made on the device, so a step can be captured in a
    CUDA graph. On CPU tensors an index ``≥ num_slots``, a slot named twice, a gate ``> 0`` or a
    ``beta`` outside ``[0, 1]`` raise; on a GPU they are the caller's contract (a row ``≥
    num_slots`` outputs NaN and writes nothing). A row whose slot's cursor lies outside the ring
    (memory written behind :meth:`~qstate.GatedDeltaReplayCache.from_tensors`' check) outputs
    NaN, writes nothing of its slot and sets ``qstate.SLOT_BAD_CURSOR`` in ``cache.slot_flags``; a
    NaN or ±inf reaching a row's output sets ``qstate.SLOT_NONFINITE`` in its slot's flags and
    stays in that slot. Returns ``out`` (allocated like ``v`` when None).
    """
    # The signature fixes every argument of the two launches but the tensors' addresses
    # (kernels/README.md#dispatch): the cache's formats and ring room, and its tensors' layouts.
    plain, cache_tensors = _gated_delta_checks.cache_signature(cache, scale, use_qk_l2norm)
    entry = _DISPATCH.entry(plain, (q, k, v, g, beta, slot_indices, out, *cache_tensors), _check_args, cache, q, k,
                            v, g, beta, scale, use_qk_l2norm, slot_indices, out)
    _common.check_slot_values(slot_indices, cache.num_slots, name="slot_indices")
    _gated_delta_checks.check_values(g, beta)
    if out is None:
        out = torch.empty_like(v)
    if v.shape[0] == 0:
        return out
    row_cursor = torch.empty(v.shape[0], dtype=torch.int32, device=cache.device)
    tensors = (q, k, v, g, beta, slot_indices, out, cache.checkpoint, cache.read, cache.read_scale, cache.ring_k,
               cache.ring_v, cache.ring_g, cache.ring_beta, cache.ring_inverse, cache.cursor, cache.slot_flags,
               row_cursor)
    run_eagerly = eager(v)
    if run_eagerly and entry.launch(*tensors):
        return out
    qk_scale = cache.head_k_dim ** -0.5 if scale is None else float(scale)
    _gated_delta_replay_op(*tensors, str(cache.checkpoint_format),
                           "" if cache.read_format is None else str(cache.read_format), qk_scale, use_qk_l2norm)
    if run_eagerly and entry.unprepared:
        entry.keep(_kernel.prepare(tensors, cache, q, k, v, g, beta, slot_indices, out, row_cursor,
                                   qk_scale=qk_scale, use_qk_l2norm=use_qk_l2norm))
    return out
