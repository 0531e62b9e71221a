"""Speculative decoding (docs/design.md#speculative) as ``torch.library`` custom ops with fake impls:

* :func:`replay_verify` / :func:`replay_commit` on a :class:`~qstate.ReplayCache` allocated with
  ``max_draft``: verify writes no state (except an early flush of committed tokens), commit is a
  cursor move on the device;
* the baseline serving engines use today, :func:`selective_state_update_drafts` (one state
  written per draft token into intermediate slots) and :func:`commit_drafts` (copy the accepted
  state into the slot).

How a bad commit is reported without a host sync: on CPU tensors :func:`replay_commit` checks
the values on the host and raises. On a GPU the commit kernel leaves a row untouched when its
slot has no pending verify or ``num_accepted`` is outside ``0 … T`` and sets a bit in
``cache.commit_errors``; :func:`replay_check_commits` reads that word (one sync, call it where a
sync is cheap, e.g. outside a captured graph every few hundred steps) and raises.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validate
from ..cache import ReplayCache
from ..kernels.common.launch import Dispatch
from . import _common, _replay_checks
from ._register import host_values, mutating_op

__all__ = ["replay_verify", "replay_commit", "replay_check_commits", "selective_state_update_drafts",
           "commit_drafts"]

_VERIFY_MUTATED = ("out", "checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B",
                   "cursor", "generation", "drafts", "flush_rows", "flush_counters", "slot_flags")


def _replay_verify_impl(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor], z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], dt_softplus: bool,
    slot_indices: Optional[torch.Tensor], out: torch.Tensor,
    checkpoint: torch.Tensor, checkpoint_scale: Optional[torch.Tensor], read: Optional[torch.Tensor],
    read_scale: Optional[torch.Tensor], ring_x: torch.Tensor, ring_dt: torch.Tensor, ring_B: torch.Tensor,
    cursor: torch.Tensor, generation: torch.Tensor, drafts: torch.Tensor, flush_rows: torch.Tensor,
    flush_counters: torch.Tensor, slot_flags: torch.Tensor, checkpoint_format: str, read_format: Optional[str],
    seed: int,
) -> None:
    from ..kernels.mamba2.speculative import launch_replay_verify

    launch_replay_verify(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out,
        checkpoint, checkpoint_scale, read, read_scale, ring_x, ring_dt, ring_B, cursor, generation, drafts,
        flush_rows, flush_counters, slot_flags, checkpoint_format=_common.format_constants(checkpoint_format).fmt,
        read_format=None if read_format is None else _common.format_constants(read_format).fmt, seed=seed,
    )


_replay_verify_op = mutating_op("qstate::replay_verify", _replay_verify_impl, _VERIFY_MUTATED)


def _replay_commit_impl(num_accepted: torch.Tensor, slot_indices: Optional[torch.Tensor], cursor: torch.Tensor,
                        drafts: torch.Tensor, commit_errors: torch.Tensor, slot_flags: torch.Tensor,
                        capacity: int) -> None:
    from ..kernels.mamba2.speculative import launch_replay_commit

    launch_replay_commit(num_accepted, slot_indices, cursor, drafts, commit_errors, slot_flags, cursor.shape[0],
                         capacity)


_replay_commit_op = mutating_op("qstate::replay_commit", _replay_commit_impl,
                                ("cursor", "drafts", "commit_errors", "slot_flags"))


def _drafts_impl(
    state: torch.Tensor, state_scale: Optional[torch.Tensor], intermediate: torch.Tensor,
    intermediate_scale: Optional[torch.Tensor], x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
    B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor], dt_softplus: bool, slot_indices: Optional[torch.Tensor], out: torch.Tensor,
    state_format: str,
) -> None:
    from ..kernels.mamba2.speculative import launch_drafts

    launch_drafts(state, state_scale, intermediate, intermediate_scale, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                  slot_indices, out, state_format=_common.format_constants(state_format).fmt)


_drafts_op = mutating_op("qstate::selective_state_update_drafts", _drafts_impl,
                         ("intermediate", "intermediate_scale", "out"))


def _commit_drafts_impl(state: torch.Tensor, state_scale: Optional[torch.Tensor], intermediate: torch.Tensor,
                        intermediate_scale: Optional[torch.Tensor], num_accepted: torch.Tensor,
                        slot_indices: Optional[torch.Tensor]) -> None:
    from ..kernels.common.copy_accepted import launch_copy_accepted

    launch_copy_accepted(intermediate, state, num_accepted, slot_indices)
    if state_scale is not None:
        launch_copy_accepted(intermediate_scale, state_scale, num_accepted, slot_indices)


_commit_drafts_op = mutating_op("qstate::commit_drafts", _commit_drafts_impl, ("state", "state_scale"))


# ------------------------------------------------------------------------------------ validation


def _check_draft_inputs(x, dt, A, B, C, D, z, dt_bias, *, nheads: int, headdim: int, dstate: int,
                        ngroups: Optional[int], device: torch.device):
    """Shapes ``x, z (batch, T, nheads, headdim)``, ``dt (batch, T, nheads)``, ``B, C (batch, T,
    ngroups, dstate)``, ``A, D, dt_bias (nheads,)``; returns ``(batch, T, ngroups)``."""
    _validate.tensor("x", x, ndim=4)
    batch, T = x.shape[0], x.shape[1]
    _validate.shape("x", x, (batch, T, nheads, headdim), "(batch, T, nheads, headdim)")
    _validate.tensor("dt", dt, ndim=3)
    _validate.shape("dt", dt, (batch, T, nheads), "(batch, T, nheads)")
    _validate.tensor("B", B, ndim=4)
    if ngroups is None:
        ngroups = B.shape[2]
        if ngroups < 1 or nheads % ngroups:
            raise ValueError(f"B: nheads ({nheads}) must be a multiple of ngroups, got ngroups {ngroups}")
    for name, t in (("B", B), ("C", C)):
        _validate.tensor(name, t, ndim=4)
        _validate.shape(name, t, (batch, T, ngroups, dstate), "(batch, T, ngroups, dstate)")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None or name == "A":
            _validate.tensor(name, t, ndim=1)
            _validate.shape(name, t, (nheads,), "(nheads,)")
    if z is not None:
        _validate.tensor("z", z, ndim=4)
        _validate.shape("z", z, (batch, T, nheads, headdim), "(batch, T, nheads, headdim)")
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias)):
        _common.float_input(name, t)
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected device {device} (the state's), got {t.device}")
    for name, t in (("x", x), ("B", B), ("C", C), ("z", z)):
        if t is not None:
            _replay_checks.inner_contiguous(name, t)
    return batch, T, ngroups


def _check_num_accepted(num_accepted, batch: int, device: torch.device) -> None:
    if not isinstance(num_accepted, torch.Tensor):
        raise TypeError(f"num_accepted: expected a torch.Tensor, got {type(num_accepted).__name__}")
    if num_accepted.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"num_accepted: expected dtype torch.int32 or torch.int64, got {num_accepted.dtype}")
    _validate.shape("num_accepted", num_accepted, (batch,), "(batch,)")
    if num_accepted.device != device:
        raise ValueError(f"num_accepted: expected device {device} (the cache's), got {num_accepted.device}")
    if not num_accepted.is_contiguous():
        raise ValueError(f"num_accepted: expected a contiguous tensor, got strides {num_accepted.stride()}")


# ------------------------------------------------------------------------------------ public ops


def _check_verify_args(cache, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out) -> None:
    """Every check of :func:`replay_verify` that reads only metadata (its signature)."""
    if not isinstance(cache, ReplayCache):
        raise TypeError(f"cache: expected a qstate.ReplayCache, got {type(cache).__name__}")
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    batch, T, _ = _check_draft_inputs(x, dt, A, B, C, D, z, dt_bias, nheads=H, headdim=P, dstate=N, ngroups=G,
                                      device=cache.device)
    if T < 1 or T > cache.max_draft:
        raise ValueError(f"x: expected 1 <= T <= cache.max_draft = {cache.max_draft} draft tokens "
                         f"(allocate the cache with max_draft), got T = {T}")
    _replay_checks.check_ring_inputs(cache, x, B, dt_softplus)
    _replay_checks.check_slot_layout(slot_indices, batch, cache)
    if out is not None:
        _replay_checks.check_out(out, x, "(batch, T, nheads, headdim)")


# The per-draft baseline's states and their scales, as errors name their dimensions.
_INTERMEDIATE = "(batch, T_max, nheads, headdim, dstate)"
_SCALES = "(batch, T_max, ...) scales"

# Checks once per signature; a verify's launches are not prepared (each call allocates its B·C buffer).
_VERIFY_DISPATCH = Dispatch("qstate::replay_verify")


def replay_verify(
    cache: ReplayCache, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, slot_indices: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Outputs of T draft tokens per row from replay state, without writing state (docs/design.md#speculative).

    ==================  ==============================================
    ``x``, ``z``        ``(batch, T, nheads, headdim)``; ``x`` in ``cache.input_dtype``
                        (it joins the ring), ``z`` any float
    ``dt``              ``(batch, T, nheads)``, before ``dt_bias`` / softplus
    ``A``, ``D``,       ``(nheads,)``
    ``dt_bias``
    ``B``               ``(batch, T, ngroups, dstate)``, ``cache.input_dtype``
    ``C``               ``(batch, T, ngroups, dstate)``
    ``slot_indices``    ``(batch,)`` int32/int64, contiguous (None: row i uses slot i);
                        negative = padding (zero outputs, nothing written)
    ``out``             ``(batch, T, nheads, headdim)``, dtype of ``x``
    ==================  ==============================================

    Draft i of a row outputs what decoding its slot's committed tokens and drafts ``0 … i`` one
    by one would: from the read copy (or the checkpoint), the ``cursor`` committed ring tokens
    and the drafts, causally. The drafts are appended to the ring beyond the cursor,
    tentatively, until :func:`replay_commit`. Nothing else is written, except when the ring
    could not hold the next round (``cursor > 0`` and ``cursor + 2T > ring_len + max_draft``):
    then the committed tokens are first folded into the checkpoint (fp32, from the stored
    checkpoint), the read copy is rebuilt, the cursor becomes 0 and the outputs read the new
    read copy. The decision is taken on the device. Requires ``T ≤ cache.max_draft``; each
    verify must be followed by a :func:`replay_commit` of the same slots (a second verify
    replaces the pending drafts). A non-finite value reaching a row's outputs (or a flush's new
    checkpoint) sets ``SLOT_NONFINITE`` in its slot's ``cache.slot_flags``; a cursor outside the
    ring sets ``SLOT_BAD_CURSOR``, and the row outputs NaN and writes nothing. Returns ``out``.
    """
    out, _ = _replay_checks.checked_ring_call(_VERIFY_DISPATCH, _check_verify_args, cache, x, dt, A, B, C, D, z,
                                              dt_bias, dt_softplus, slot_indices, out)
    if x.shape[0] == 0:
        return out
    dt, A, D, dt_bias = _common.unit_stride_params(dt, A, D, dt_bias)
    _replay_verify_op(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out,
        cache.checkpoint, cache.checkpoint_scale, cache.read, cache.read_scale, cache.ring_x, cache.ring_dt,
        cache.ring_B, cache.cursor, cache.generation, cache.drafts, cache.flush_rows, cache.flush_counters,
        cache.slot_flags, str(cache.checkpoint_format), None if cache.read_format is None else str(cache.read_format), cache.seed,
    )
    return out


def replay_commit(cache: ReplayCache, num_accepted: torch.Tensor, slot_indices: Optional[torch.Tensor] = None) -> None:
    """Keep the first ``num_accepted[i]`` drafts of row i's last :func:`replay_verify`.

    ``num_accepted (batch,)`` int32/int64 in ``0 … T``; ``slot_indices (batch,)`` as in the
    verify (negative = padding, untouched). The slot's cursor moves past the accepted drafts;
    the others vanish (the next verify overwrites them). One small kernel, no host sync: it
    records into CUDA graphs. A row whose slot has no pending verify, or whose ``num_accepted``
    is outside ``0 … T``, is an error: on CPU tensors it raises ``ValueError`` here (and
    nothing is changed); on a GPU that row's slot is left untouched and
    :func:`replay_check_commits` raises. A slot whose cursor lies, or would land, outside its
    ring (memory a caller wrote) is left untouched and gets ``SLOT_BAD_CURSOR`` in
    ``cache.slot_flags``.
    """
    if not isinstance(cache, ReplayCache):
        raise TypeError(f"cache: expected a qstate.ReplayCache, got {type(cache).__name__}")
    if not isinstance(num_accepted, torch.Tensor):
        raise TypeError(f"num_accepted: expected a torch.Tensor, got {type(num_accepted).__name__}")
    if num_accepted.dim() != 1:
        raise ValueError(f"num_accepted: expected shape (batch,), got {tuple(num_accepted.shape)}")
    batch = num_accepted.shape[0]
    _check_num_accepted(num_accepted, batch, cache.device)
    _replay_checks.check_slot_indices(slot_indices, batch, cache, rows="num_accepted")
    if batch == 0:
        return
    if host_values(cache.device):
        _common.check_commit_counts(cache.drafts, num_accepted, slot_indices, "replay_verify")
    _replay_commit_op(num_accepted, slot_indices, cache.cursor, cache.drafts, cache.commit_errors, cache.slot_flags,
                      cache.capacity)


def replay_check_commits(cache: ReplayCache) -> None:
    """Raise ``ValueError`` if a commit on the device was refused since the last check (reads
    ``cache.commit_errors``: one host sync), and clear the record."""
    if not isinstance(cache, ReplayCache):
        raise TypeError(f"cache: expected a qstate.ReplayCache, got {type(cache).__name__}")
    from ..kernels.mamba2.speculative import ERROR_ACCEPTED_RANGE, ERROR_NO_VERIFY

    _common.raise_commit_errors(cache.commit_errors, ERROR_NO_VERIFY, ERROR_ACCEPTED_RANGE, "replay_verify",
                                "replay_commit")


def selective_state_update_drafts(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, state_batch_indices: Optional[torch.Tensor] = None, *,
    intermediate: torch.Tensor, state_scale: Optional[torch.Tensor] = None,
    intermediate_scale: Optional[torch.Tensor] = None, state_format: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Baseline verify: T conventional steps per row, one stored state per draft token.

    ========================  ========================================================
    ``state``                 ``(nslots, nheads, headdim, dstate)``, ``state_format``'s
                              storage dtype, contiguous; read, never written
    ``intermediate``          ``(batch, T_max, nheads, headdim, dstate)``, same dtype,
                              contiguous: ``[row, t]`` gets the state after draft t
    ``state_scale``,          fp32 scales of the two (8-bit formats): row granularity
    ``intermediate_scale``    ``(nslots, nheads, headdim)`` / ``(batch, T_max, nheads, headdim)``
    ``x``, ``z``, ``out``     ``(batch, T, nheads, headdim)``
    ``dt``                    ``(batch, T, nheads)``
    ``B``, ``C``              ``(batch, T, ngroups, dstate)``
    ``A``, ``D``, ``dt_bias`` ``(nheads,)``
    ``state_batch_indices``   ``(batch,)`` int32/int64, contiguous: slot of each row;
                              negative = padding
    ========================  ========================================================

    Each token: ``S = exp(dt·A)·S + (dt·x) ⊗ B`` in fp32, output from the unrounded ``S``,
    ``S`` rounded to nearest-even into ``intermediate[row, t]`` and the next token continuing
    from the stored value (T calls of :func:`qstate.selective_state_update` give the same
    bits). Stochastic formats are not supported. Returns ``out``.
    """
    consts = _common.resolve_format(state_format, state)
    if consts.stochastic:
        raise ValueError(f"state_format: the per-draft baseline rounds to nearest-even, got '{consts.fmt}'")
    _common.check_state(state, state_scale, consts)
    nslots, nheads, headdim, dstate = state.shape
    batch, T, _ = _check_draft_inputs(x, dt, A, B, C, D, z, dt_bias, nheads=nheads, headdim=headdim,
                                      dstate=dstate, ngroups=None, device=state.device)
    _common.check_intermediate(intermediate, intermediate_scale, state, consts, batch, T, _INTERMEDIATE, _SCALES)
    _common.contiguous_state(state, state_scale)
    _common.bool_flag("dt_softplus", dt_softplus)
    if state_batch_indices is not None:
        _common.check_slot_indices(state_batch_indices, batch, nslots, state.device)
        _common.check_slot_values(state_batch_indices, nslots)
    elif batch > nslots:
        raise ValueError(f"x: without state_batch_indices row i uses slot i, so batch must be <= nslots = {nslots}, "
                         f"got {batch}")
    out = _replay_checks.check_out(out, x, "(batch, T, nheads, headdim)")
    if batch == 0:
        return out
    dt, A, D, dt_bias = _common.unit_stride_params(dt, A, D, dt_bias)
    _drafts_op(state, state_scale, intermediate, intermediate_scale, x, dt, A, B, C, D, z, dt_bias,
               bool(dt_softplus), state_batch_indices, out, str(consts.fmt))
    return out


def commit_drafts(
    state: torch.Tensor, intermediate: torch.Tensor, num_accepted: torch.Tensor,
    state_batch_indices: Optional[torch.Tensor] = None, *, state_scale: Optional[torch.Tensor] = None,
    intermediate_scale: Optional[torch.Tensor] = None, state_format: Optional[str] = None,
) -> None:
    """Baseline commit: ``state[slot] ← intermediate[row, num_accepted − 1]`` (codes and scales)
    for each row with ``num_accepted > 0``; rows with 0 keep their state. Shapes as in
    :func:`selective_state_update_drafts`; ``num_accepted (batch,)`` int32/int64 in
    ``0 … T_max`` (checked on the host for CPU tensors; on a GPU a row outside is skipped)."""
    consts = _common.resolve_format(state_format, state)
    _common.check_state(state, state_scale, consts)
    batch = intermediate.shape[0] if isinstance(intermediate, torch.Tensor) and intermediate.dim() else 0
    _common.check_intermediate(intermediate, intermediate_scale, state, consts, batch, 1, _INTERMEDIATE, _SCALES)
    _check_num_accepted(num_accepted, batch, state.device)
    if state_batch_indices is not None:
        _common.check_slot_indices(state_batch_indices, batch, state.shape[0], state.device)
        _common.check_slot_values(state_batch_indices, state.shape[0])
    elif batch > state.shape[0]:
        raise ValueError(f"intermediate: without state_batch_indices row i uses slot i, so batch must be <= "
                         f"nslots = {state.shape[0]}, got {batch}")
    _common.contiguous_state(state, state_scale)
    _common.check_accepted_range(num_accepted, intermediate.shape[1])
    if batch == 0:
        return
    _commit_drafts_op(state, state_scale, intermediate, intermediate_scale, num_accepted, state_batch_indices)
