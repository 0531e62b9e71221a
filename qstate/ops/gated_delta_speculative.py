"""Speculative decoding on gated delta rule layers (GDN and KDA; kernels/gated_delta/README.md#speculative)
as ``torch.library`` custom ops with fake impls:

* :func:`gated_delta_replay_verify` / :func:`gated_delta_replay_commit` on a
  :class:`qstate.GatedDeltaReplayCache` allocated with ``max_draft``: the verify writes ring
  entries only, the commit moves the cursor on the device and folds the ring into the
  checkpoint when it holds ``ring_len`` committed tokens;
* the baseline serving engines use today, :func:`gated_delta_update_drafts` (one state written
  per draft into intermediate slots) and :func:`gated_delta_commit_drafts` (the accepted state
  copied into the slot).

How a bad commit is reported without a host sync: on CPU tensors
:func:`gated_delta_replay_commit` checks the values on the host and raises. On a GPU the commit
kernels leave a row's slot untouched when it has no pending verify or ``num_accepted`` is
outside ``0 … T``, and set a bit in ``cache.commit_errors``;
:func:`gated_delta_replay_check_commits` reads that word (one sync, where the caller chooses).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validate
from ..gated_delta_cache import GatedDeltaReplayCache
from ..kernels.common.launch import Dispatch
from . import _common, _gated_delta_checks
from ._register import host_values, mutating_op

__all__ = ["gated_delta_replay_verify", "gated_delta_replay_commit", "gated_delta_replay_check_commits",
           "gated_delta_update_drafts", "gated_delta_commit_drafts"]

def _verify_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    slot_indices: Optional[torch.Tensor], out: torch.Tensor, checkpoint: torch.Tensor, read: Optional[torch.Tensor],
    read_scale: Optional[torch.Tensor], ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
    ring_beta: torch.Tensor, cursor: torch.Tensor, drafts: torch.Tensor, slot_flags: torch.Tensor,
    checkpoint_format: str, read_format: str, max_draft: int, qk_scale: float, use_qk_l2norm: bool,
) -> None:
    from ..kernels.gated_delta.speculative import launch_verify

    launch_verify(q, k, v, g, beta, slot_indices, out, checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta,
                  cursor, drafts, slot_flags, checkpoint_format=_common.format_constants(checkpoint_format).fmt,
                  read_format=_common.format_constants(read_format).fmt if read_format else None,
                  max_draft=max_draft, qk_scale=qk_scale, use_qk_l2norm=use_qk_l2norm)


_verify_op = mutating_op("qstate::gated_delta_replay_verify", _verify_impl,
                         ("out", "ring_k", "ring_v", "ring_g", "ring_beta", "drafts", "slot_flags"))


def _commit_impl(
    num_accepted: torch.Tensor, slot_indices: Optional[torch.Tensor], checkpoint: torch.Tensor,
    read: Optional[torch.Tensor], read_scale: Optional[torch.Tensor], ring_k: torch.Tensor, ring_v: torch.Tensor,
    ring_g: torch.Tensor, ring_beta: torch.Tensor, cursor: torch.Tensor, drafts: torch.Tensor,
    commit_errors: torch.Tensor, slot_flags: torch.Tensor, checkpoint_format: str, read_format: str, max_draft: int,
    use_qk_l2norm: bool,
) -> None:
    from ..kernels.gated_delta.speculative import launch_commit

    launch_commit(num_accepted, slot_indices, checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta, cursor,
                  drafts, commit_errors, slot_flags,
                  checkpoint_format=_common.format_constants(checkpoint_format).fmt,
                  read_format=_common.format_constants(read_format).fmt if read_format else None,
                  max_draft=max_draft, use_qk_l2norm=use_qk_l2norm)


_commit_op = mutating_op("qstate::gated_delta_replay_commit", _commit_impl,
                         ("checkpoint", "read", "read_scale", "cursor", "drafts", "commit_errors", "slot_flags"))


def _drafts_impl(
    state: torch.Tensor, state_scale: Optional[torch.Tensor], intermediate: torch.Tensor,
    intermediate_scale: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, slot_indices: Optional[torch.Tensor], out: torch.Tensor, state_format: str, qk_scale: float,
    use_qk_l2norm: bool,
) -> None:
    from ..kernels.gated_delta.speculative import launch_drafts

    launch_drafts(state, state_scale, intermediate, intermediate_scale, q, k, v, g, beta, slot_indices, out,
                  state_format=_common.format_constants(state_format).fmt, qk_scale=qk_scale,
                  use_qk_l2norm=use_qk_l2norm)


_drafts_op = mutating_op("qstate::gated_delta_update_drafts", _drafts_impl,
                         ("intermediate", "intermediate_scale", "out"))


def _commit_drafts_impl(state: torch.Tensor, state_scale: Optional[torch.Tensor], intermediate: torch.Tensor,
                        intermediate_scale: Optional[torch.Tensor], num_accepted: torch.Tensor,
                        slot_indices: Optional[torch.Tensor]) -> None:
    from ..kernels.gated_delta.speculative import launch_commit_drafts

    launch_commit_drafts(state, state_scale, intermediate, intermediate_scale, num_accepted, slot_indices)


_commit_drafts_op = mutating_op("qstate::gated_delta_commit_drafts", _commit_drafts_impl, ("state", "state_scale"))


# ------------------------------------------------------------------------------------ validation


def _check_cache(cache) -> None:
    if not isinstance(cache, GatedDeltaReplayCache):
        raise TypeError(f"cache: expected a qstate.GatedDeltaReplayCache, got {type(cache).__name__}")
    cache.validate()
    if cache.max_draft < 1:
        raise ValueError("cache: expected a cache allocated with max_draft >= 1 (ring room for the drafts), got "
                         "max_draft = 0")


def _check_verify_args(cache, q, k, v, g, beta, scale, use_qk_l2norm, slot_indices, out) -> None:
    """Every check of :func:`gated_delta_replay_verify` that reads only metadata (its signature)."""
    _check_cache(cache)
    (batch, T), HK, channel = _gated_delta_checks.check_inputs(
        q, k, v, g, beta, drafts=True, num_v_heads=cache.num_v_heads, head_k_dim=cache.head_k_dim,
        head_v_dim=cache.head_v_dim, device=cache.device, owner="the cache")
    if T > cache.max_draft:
        raise ValueError(f"k: expected T <= cache.max_draft = {cache.max_draft} drafts, got T = {T}")
    _gated_delta_checks.check_cache_inputs(cache, k, v, g, HK, channel, "batch, T")
    _gated_delta_checks.check_scale(scale)
    _common.bool_flag("use_qk_l2norm", use_qk_l2norm)
    _gated_delta_checks.check_slots(slot_indices, batch, cache.num_slots, cache.device, "v")
    if out is not None:
        _gated_delta_checks.check_out(out, v)


def _check_num_accepted(num_accepted, device) -> int:
    if not isinstance(num_accepted, torch.Tensor):
        raise TypeError(f"num_accepted: expected a torch.Tensor, got {type(num_accepted).__name__}")
    if num_accepted.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"num_accepted: expected dtype torch.int32 or torch.int64, got {num_accepted.dtype}")
    if num_accepted.dim() != 1:
        raise ValueError(f"num_accepted: expected shape (batch,), got {tuple(num_accepted.shape)}")
    if num_accepted.device != device:
        raise ValueError(f"num_accepted: expected device {device}, got {num_accepted.device}")
    _common.unit_stride_indices("num_accepted", num_accepted)
    return num_accepted.shape[0]


def _format_names(cache) -> tuple:
    return str(cache.checkpoint_format), "" if cache.read_format is None else str(cache.read_format)


# ------------------------------------------------------------------------------------ public ops

# The per-draft baseline's states and their scales, as errors name their dimensions.
_INTERMEDIATE = "(batch, T_max, HV, V, K)"
_SCALES = "(batch, T_max, HV, V)"

_VERIFY_DISPATCH = Dispatch("qstate::gated_delta_replay_verify")


def gated_delta_replay_verify(
    cache: GatedDeltaReplayCache, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, *, scale: Optional[float] = None, use_qk_l2norm: bool = True,
    slot_indices: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Outputs of T draft tokens per row from replay state, writing no state.

    ======================  ==============================================================
    ``cache``               a :class:`qstate.GatedDeltaReplayCache` allocated with
                            ``max_draft >= T``
    ``q``, ``k``            ``(batch, T, HK, K)``, unit inner stride; ``k`` (and ``v``) in
                            the cache's ``input_dtype`` (they join the ring)
    ``v``, ``out``          ``(batch, T, HV, V)``, unit inner stride
    ``g``                   ``(batch, T, HV)`` (``gate="scalar"``, GDN) or ``(batch, T, HV,
                            K)`` (``gate="channel"``, KDA): log-space, ``<= 0``
    ``beta``                ``(batch, T, HV)`` in ``[0, 1]``
    ``slot_indices``        ``(batch,)`` int32/int64, contiguous (None: row i uses slot i);
                            negative = padding (zero outputs, nothing written)
    ======================  ==============================================================

    Draft t of a row outputs what decoding its slot's committed tokens and drafts ``0 … t`` one
    by one would, by the adjoint sweep from the read copy (or the checkpoint without one)
    through drafts ``t … 0`` and the ring's committed tokens: ``out[:, t]`` reads no later
    draft, so a NaN there never reaches it. The drafts are appended to the ring past the
    cursor, tentatively, and ``cache.drafts[slot]`` becomes T; nothing else is written. Each
    verify must be followed by a :func:`gated_delta_replay_commit` of the same slots (a second
    verify replaces the pending drafts). ``scale`` and ``use_qk_l2norm`` as in
    :func:`qstate.gated_delta_update`, the same for every call between resets. A non-finite
    output sets ``SLOT_NONFINITE`` in its slot's ``cache.slot_flags``; a cursor outside
    ``[0, ring_len)`` sets ``SLOT_BAD_CURSOR`` and the row outputs NaN and writes nothing. On
    CPU tensors an index ``≥ num_slots``, a repeated slot, a gate ``> 0`` or a ``beta`` outside
    ``[0, 1]`` raise. Returns ``out`` (allocated like ``v`` when None).
    """
    plain, cache_tensors = _gated_delta_checks.cache_signature(cache, scale, use_qk_l2norm)
    _VERIFY_DISPATCH.entry(plain, (q, k, v, g, beta, slot_indices, out, *cache_tensors), _check_verify_args, cache,
                           q, k, v, g, beta, scale, use_qk_l2norm, slot_indices, out)
    _common.check_slot_values(slot_indices, cache.num_slots, name="slot_indices")
    _gated_delta_checks.check_values(g, beta)
    if out is None:
        out = torch.empty_like(v)
    if v.shape[0] == 0:
        return out
    qk_scale = cache.head_k_dim ** -0.5 if scale is None else float(scale)
    _verify_op(q, k, v, g, beta, slot_indices, out, cache.checkpoint, cache.read, cache.read_scale, cache.ring_k,
               cache.ring_v, cache.ring_g, cache.ring_beta, cache.cursor, cache.drafts, cache.slot_flags,
               *_format_names(cache), cache.max_draft, qk_scale, use_qk_l2norm)
    return out


def gated_delta_replay_commit(cache: GatedDeltaReplayCache, num_accepted: torch.Tensor, *,
                              slot_indices: Optional[torch.Tensor] = None, use_qk_l2norm: bool = True) -> None:
    """Keep the first ``num_accepted[i]`` drafts of row i's last :func:`gated_delta_replay_verify`.

    ``num_accepted (batch,)`` int32/int64, contiguous, in ``0 … T``; ``slot_indices (batch,)``
    as in the verify (negative = padding, untouched); ``use_qk_l2norm`` as in the verify (a
    flush normalizes the ring's raw keys). The slot's cursor moves past the accepted drafts; the
    others vanish (the next verify overwrites them). A slot whose committed tokens reach
    ``ring_len`` is flushed: its ring is folded into the checkpoint in fp32, from the stored
    checkpoint, the read copy is rebuilt from the stored checkpoint and the cursor becomes 0.
    Three kernel launches, no host sync: it records into CUDA graphs. A row whose slot has no
    pending verify, or whose ``num_accepted`` is outside ``0 … T``, is an error: on CPU tensors it
    raises ``ValueError`` here (nothing is changed); on a GPU that row's slot is left untouched
    and :func:`gated_delta_replay_check_commits` raises. A slot whose cursor lies, or would land,
    outside its ring is left untouched and gets ``SLOT_BAD_CURSOR`` in
    ``cache.slot_flags``.
    """
    _check_cache(cache)
    batch = _check_num_accepted(num_accepted, cache.device)
    _gated_delta_checks.check_slots(slot_indices, batch, cache.num_slots, cache.device, "num_accepted")
    _common.bool_flag("use_qk_l2norm", use_qk_l2norm)
    _common.check_slot_values(slot_indices, cache.num_slots, name="slot_indices")
    if batch == 0:
        return
    if host_values(cache.device):
        _common.check_commit_counts(cache.drafts, num_accepted, slot_indices, "gated_delta_replay_verify")
    _commit_op(num_accepted, slot_indices, cache.checkpoint, cache.read, cache.read_scale, cache.ring_k, cache.ring_v,
               cache.ring_g, cache.ring_beta, cache.cursor, cache.drafts, cache.commit_errors, cache.slot_flags,
               *_format_names(cache), cache.max_draft, use_qk_l2norm)


def gated_delta_replay_check_commits(cache: GatedDeltaReplayCache) -> None:
    """Raise ``ValueError`` if a commit on the device was refused since the last check (reads
    ``cache.commit_errors``: one host sync), and clear the record."""
    if not isinstance(cache, GatedDeltaReplayCache):
        raise TypeError(f"cache: expected a qstate.GatedDeltaReplayCache, got {type(cache).__name__}")
    from ..kernels.gated_delta.speculative import ERROR_ACCEPTED_RANGE, ERROR_NO_VERIFY

    _common.raise_commit_errors(cache.commit_errors, ERROR_NO_VERIFY, ERROR_ACCEPTED_RANGE,
                                "gated_delta_replay_verify", "gated_delta_replay_commit")


def _baseline_format(state_format, state):
    consts = _common.resolve_format(state_format, state)
    if consts.stochastic or consts.fmt.granularity not in (None, "row"):
        raise ValueError(f"state_format: the per-draft baseline takes fp32, bf16, fp16 or a ':row' 8-bit format "
                         f"rounded to nearest, got '{consts.fmt}'")
    return consts


def _check_state(state, state_scale, consts) -> None:
    _common.check_state(state, state_scale, consts)
    _common.contiguous_state(state, state_scale)


def gated_delta_update_drafts(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    intermediate: torch.Tensor, state_scale: Optional[torch.Tensor] = None,
    intermediate_scale: Optional[torch.Tensor] = None, state_format: Optional[str] = None,
    slot_indices: Optional[torch.Tensor] = None, scale: Optional[float] = None, use_qk_l2norm: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Baseline verify: T conventional steps per row, one stored state per draft.

    ========================  ========================================================
    ``state``                 ``(nslots, HV, V, K)``, ``state_format``'s storage dtype,
                              contiguous; read, never written
    ``intermediate``          ``(batch, T_max, HV, V, K)``, same dtype, contiguous:
                              ``[row, t]`` gets the state after draft t
    ``state_scale``,          fp32 row scales of the two (``:row`` formats):
    ``intermediate_scale``    ``(nslots, HV, V)`` / ``(batch, T_max, HV, V)``
    ``q``, ``k``              ``(batch, T, HK, K)``
    ``v``, ``out``            ``(batch, T, HV, V)``
    ``g``                     ``(batch, T, HV)`` or ``(batch, T, HV, K)``
    ``beta``                  ``(batch, T, HV)``
    ``slot_indices``          ``(batch,)`` int32/int64, contiguous: slot of each row;
                              negative = padding
    ========================  ========================================================

    Each draft runs :func:`qstate.gated_delta_update`'s arithmetic: the output from the
    unrounded state, the state rounded to nearest into ``intermediate[row, t]`` and the next
    draft continuing from the stored value (T calls of :func:`qstate.gated_delta_update` give
    the same bits). Formats: fp32, bf16, fp16 and ``:row`` 8-bit. Returns ``out``.
    """
    consts = _baseline_format(state_format, state)
    _check_state(state, state_scale, consts)
    nslots, HV, V, K = state.shape
    (batch, T), _, _ = _gated_delta_checks.check_inputs(q, k, v, g, beta, drafts=True, num_v_heads=HV, head_k_dim=K,
                                                        head_v_dim=V, device=state.device, owner="the state")
    _common.check_intermediate(intermediate, intermediate_scale, state, consts, batch, T, _INTERMEDIATE, _SCALES)
    _gated_delta_checks.check_scale(scale)
    _common.bool_flag("use_qk_l2norm", use_qk_l2norm)
    if slot_indices is not None:
        _gated_delta_checks.check_slots(slot_indices, batch, nslots, state.device, "v")
    elif batch > nslots:
        raise ValueError(f"v: without slot_indices row i uses slot i, so batch must be <= nslots = {nslots}, got "
                         f"{batch}")
    if out is not None:
        _gated_delta_checks.check_out(out, v)
    _common.check_slot_values(slot_indices, nslots, name="slot_indices")
    _gated_delta_checks.check_values(g, beta)
    if out is None:
        out = torch.empty_like(v)
    if batch == 0:
        return out
    qk_scale = K ** -0.5 if scale is None else float(scale)
    _drafts_op(state, state_scale, intermediate, intermediate_scale, q, k, v, g, beta, slot_indices, out,
               str(consts.fmt), qk_scale, use_qk_l2norm)
    return out


def gated_delta_commit_drafts(
    state: torch.Tensor, intermediate: torch.Tensor, num_accepted: torch.Tensor, *,
    slot_indices: Optional[torch.Tensor] = None, state_scale: Optional[torch.Tensor] = None,
    intermediate_scale: Optional[torch.Tensor] = None, state_format: Optional[str] = None,
) -> None:
    """Baseline commit: ``state[slot] ← intermediate[row, num_accepted − 1]`` (codes and scales)
    for each row with ``num_accepted > 0``; rows with 0 keep their state. Shapes as in
    :func:`gated_delta_update_drafts`; ``num_accepted (batch,)`` int32/int64 in ``0 … T_max``
    (checked on the host for CPU tensors; on a GPU a row outside is skipped)."""
    consts = _baseline_format(state_format, state)
    _check_state(state, state_scale, consts)
    batch = _check_num_accepted(num_accepted, state.device)
    _common.check_intermediate(intermediate, intermediate_scale, state, consts, batch, 1, _INTERMEDIATE, _SCALES)
    if slot_indices is not None:
        _gated_delta_checks.check_slots(slot_indices, batch, state.shape[0], state.device, "num_accepted")
    elif batch > state.shape[0]:
        raise ValueError(f"num_accepted: without slot_indices row i uses slot i, so batch must be <= nslots = "
                         f"{state.shape[0]}, got {batch}")
    _common.check_slot_values(slot_indices, state.shape[0], name="slot_indices")
    _common.check_accepted_range(num_accepted, intermediate.shape[1])
    if batch == 0:
        return
    _commit_drafts_op(state, state_scale, intermediate, intermediate_scale, num_accepted, slot_indices)
