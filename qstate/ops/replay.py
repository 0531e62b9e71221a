"""Replay decode as a ``torch.library`` custom op (``qstate::replay_decode``) and its public
function :func:`replay_decode`.

The op mutates the cache's tensors and ``out``; it has a fake (meta) implementation, so it
traces under ``torch.compile`` and records into CUDA graphs. The flush decision, the flush list
and the cursors live on the device: no call reads anything back to the host except the
slot-index checks, which run on CPU tensors only (on a GPU an index past the cache outputs NaN
and writes nothing; repeats are the caller's contract).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validate
from ..cache import ReplayCache
from ..kernels.common.launch import Dispatch
from ..kernels.mamba2 import replay as _kernel
from . import _common, _replay_checks
from ._register import eager, mutating_op

__all__ = ["replay_decode"]

_MUTATED = ("out", "checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B",
            "cursor", "generation", "flush_rows", "flush_counters", "slot_flags")


def _replay_decode_impl(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], dt_softplus: bool,
    slot_indices: Optional[torch.Tensor], out: torch.Tensor,
    checkpoint: torch.Tensor, checkpoint_scale: Optional[torch.Tensor], read: Optional[torch.Tensor],
    read_scale: Optional[torch.Tensor], ring_x: torch.Tensor, ring_dt: torch.Tensor, ring_B: torch.Tensor,
    cursor: torch.Tensor, generation: torch.Tensor, flush_rows: torch.Tensor, flush_counters: torch.Tensor,
    slot_flags: torch.Tensor, checkpoint_format: str, read_format: Optional[str], seed: int,
) -> None:
    args, kwargs = _launch_arguments(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out, checkpoint, checkpoint_scale, read,
        read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags,
        checkpoint_format, read_format, seed)
    _kernel.launch_replay_decode(*args, **kwargs)


def _launch_arguments(*op_args):
    """``(args, kwargs)`` of the kernel launcher for the op's arguments."""
    *args, checkpoint_format, read_format, seed = op_args
    return args, dict(checkpoint_format=_common.format_constants(checkpoint_format).fmt,
                      read_format=None if read_format is None else _common.format_constants(read_format).fmt,
                      seed=seed)


_replay_decode_op = mutating_op("qstate::replay_decode", _replay_decode_impl, _MUTATED)
_DISPATCH = Dispatch("qstate::replay_decode")


def _check_decode_args(cache, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out) -> None:
    """Every check of :func:`replay_decode` that reads only metadata (its signature)."""
    if not isinstance(cache, ReplayCache):
        raise TypeError(f"cache: expected a qstate.ReplayCache, got {type(cache).__name__}")
    if cache.max_draft:
        # Its ring is longer than ring_len and its cursors may pass ring_len - 1, which the step
        # kernel's flush rule does not cover; a verify of one token is the plain step there.
        raise ValueError(f"cache: expected a cache without speculative room (max_draft 0) for replay_decode, "
                         f"got max_draft {cache.max_draft}; decode with replay_verify (T = 1) + replay_commit")
    _validate.tensor("x", x, ndim=3)
    batch = x.shape[0]
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    _validate.shape("x", x, (batch, H, P), "(batch, nheads, headdim) of the cache")
    _validate.tensor("dt", dt, ndim=2)
    _validate.shape("dt", dt, (batch, H), "(batch, nheads)")
    for name, t in (("B", B), ("C", C)):
        _validate.tensor(name, t, ndim=3)
        _validate.shape(name, t, (batch, G, N), "(batch, ngroups, dstate) of the cache")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None or name == "A":
            _validate.tensor(name, t, ndim=1)
            _validate.shape(name, t, (H,), "(nheads,)")
    if z is not None:
        _validate.tensor("z", z, ndim=3)
        _validate.shape("z", z, (batch, H, P), "(batch, nheads, headdim)")
    named = [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias)]
    for name, t in named:
        if t is not None and t.device != cache.device:
            raise ValueError(f"{name}: expected device {cache.device} (the cache's), got {t.device}")
    for name, t in (("x", x), ("B", B), ("C", C), ("z", z)):
        if t is not None:
            _replay_checks.inner_contiguous(name, t)
    for name, t in named:
        _common.float_input(name, t)
    _replay_checks.check_ring_inputs(cache, x, B, dt_softplus)
    _replay_checks.check_slot_layout(slot_indices, batch, cache)
    if out is not None:
        _replay_checks.check_out(out, x, "(batch, nheads, headdim)")


def replay_decode(
    cache: ReplayCache, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, slot_indices: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode token per batch row with replay state (docs/design.md#replay, #read-copy).

    Shapes (compact Mamba-2, docs/design.md#recurrence):

    ==================  ==============================================
    ``x``, ``z``        ``(batch, nheads, headdim)``, ``cache.input_dtype``
                        for ``x`` (it joins the ring), any float for ``z``
    ``dt``              ``(batch, nheads)``, before ``dt_bias`` / softplus
    ``A``, ``D``,       ``(nheads,)``
    ``dt_bias``
    ``B``               ``(batch, ngroups, dstate)``, ``cache.input_dtype``
    ``C``               ``(batch, ngroups, dstate)``
    ``slot_indices``    ``(batch,)`` int32/int64, contiguous: the cache slot of each row
                        (None: row i uses slot i); negative = padding
    ``out``             ``(batch, nheads, headdim)``, dtype of ``x``
    ==================  ==============================================

    A row reads its slot's read copy (or the checkpoint without one) and ring, and appends the
    token to the ring. The row whose ring becomes full (``cache.ring_len`` tokens) flushes: the
    ring is folded into the checkpoint in fp32 starting from the stored checkpoint, its output
    comes from that unrounded fold (it reads the checkpoint, not the read copy), and the new
    checkpoint and its read copy are written. Padding rows output zeros and write nothing.
    Slots may not repeat within a call. A NaN or inf in a row's inputs stays in that row: it
    reaches the row's outputs from then on and, at the slot's next flush, its checkpoint and
    read copy (NaN, inf or saturated codes); no other slot is read or written; the slot's
    ``cache.slot_flags`` gets ``SLOT_NONFINITE`` when a non-finite value reaches its output. A
    cursor outside the ring (memory a caller wrote) is met on the device: the row outputs NaN,
    nothing of its slot is written and its flags get ``SLOT_BAD_CURSOR``. Returns
    ``y (batch, nheads, headdim)`` (``out`` if given).
    """
    # The signature holds the cache's tensors' metadata, formats and seed: with the call's, every
    # argument of the two launches but the tensors' addresses (kernels/README.md#dispatch).
    out, entry = _replay_checks.checked_ring_call(_DISPATCH, _check_decode_args, cache, x, dt, A, B, C, D, z,
                                                  dt_bias, dt_softplus, slot_indices, out, launched=True)
    if x.shape[0] == 0:
        return out
    state = _replay_checks.ring_state(cache)
    tensors = (x, dt, A, B, C, D, z, dt_bias, slot_indices, out, *state)
    run_eagerly = eager(x)
    if run_eagerly and entry.launch(*tensors):
        return out
    formats = (str(cache.checkpoint_format), None if cache.read_format is None else str(cache.read_format))
    compact_dt, compact_A, compact_D, compact_dt_bias = _common.unit_stride_params(dt, A, D, dt_bias)
    args = (x, compact_dt, compact_A, B, C, compact_D, z, compact_dt_bias, dt_softplus, slot_indices, out, *state,
            *formats, cache.seed)
    _replay_decode_op(*args)
    if run_eagerly and entry.unprepared:
        launch_args, launch_kwargs = _launch_arguments(*args)
        entry.keep(_kernel.prepare_decode(tensors, *launch_args, **launch_kwargs))
    return out
