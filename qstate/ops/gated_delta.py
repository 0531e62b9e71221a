"""``gated_delta_update``: the conventional gated delta rule decode step over any state format,
as the custom op ``qstate::gated_delta_update`` (fake impl included, so it works under
``torch.compile`` and CUDA-graph capture)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..kernels.common import codec
from ..kernels.gated_delta import conventional as _kernel
from ..kernels.common.launch import Dispatch
from . import _common, _gated_delta_checks
from ._register import eager, mutating_op

_OP_NAME = "qstate::gated_delta_update"


def _gated_delta_update_impl(
    state: torch.Tensor, state_scale: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, qk_scale: float, use_qk_l2norm: bool,
    state_indices: Optional[torch.Tensor], out: torch.Tensor, state_format: str, pad_slot_id: int, seed: int,
    seed_tensor: Optional[torch.Tensor], slot_flags: Optional[torch.Tensor],
) -> None:
    args, kwargs = _launch_arguments(state, state_scale, q, k, v, g, beta, qk_scale, use_qk_l2norm, state_indices,
                                     out, state_format, pad_slot_id, seed, seed_tensor, slot_flags)
    _kernel.launch(*args, **kwargs)


def _launch_arguments(state, state_scale, q, k, v, g, beta, qk_scale, use_qk_l2norm, state_indices, out,
                      state_format, pad_slot_id, seed, seed_tensor, slot_flags) -> tuple[tuple, dict]:
    """The launcher's arguments for the op's: the state's storage view and the format's constants."""
    consts = _common.format_constants(state_format)
    return ((codec.storage_view(state, consts.fmt), state_scale, q, k, v, g, beta, state_indices, out, seed,
             seed_tensor),
            dict(qk_scale=qk_scale, dtype_code=consts.dtype_code, granularity=consts.granularity,
                 stochastic=consts.stochastic, qmax=consts.qmax, emax=consts.emax, use_qk_l2norm=use_qk_l2norm,
                 pad_slot_id=pad_slot_id, slot_flags=slot_flags))


_gated_delta_update_op = mutating_op(_OP_NAME, _gated_delta_update_impl, ("state", "state_scale", "out", "slot_flags"))
# Checks once per signature; an eager GPU repeat launches what its first call prepared.
_DISPATCH = Dispatch(_OP_NAME)


def _check_args(state, q, k, v, g, beta, scale, use_qk_l2norm, state_indices, state_scale, state_format,
                pad_slot_id, out, slot_flags) -> None:
    """Every check of :func:`gated_delta_update` that reads only metadata (its signature)."""
    consts = _common.resolve_format(state_format, state)
    _common.check_state(state, state_scale, consts)
    nslots, num_v_heads, V, K = state.shape
    dims = _gated_delta_checks.check_token(q, k, v, g, beta, num_v_heads=num_v_heads, head_k_dim=K, head_v_dim=V,
                                           device=state.device, owner="state")
    _gated_delta_checks.check_scale(scale)
    _common.bool_flag("use_qk_l2norm", use_qk_l2norm)
    if state_indices is None and nslots != dims.batch:
        raise ValueError(f"state: without state_indices expected {dims.batch} slots (one per batch row), got {nslots}")
    if state_indices is not None:
        _gated_delta_checks.check_index_tensor("state_indices", state_indices, dims.batch, state.device)
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise TypeError(f"pad_slot_id: expected an int, got {type(pad_slot_id).__name__}")
    if out is not None:
        _gated_delta_checks.check_out(out, v)
    if slot_flags is not None:
        _gated_delta_checks.check_slot_flags(slot_flags, nslots, state.device)


def gated_delta_update(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: Optional[float] = None, use_qk_l2norm: bool = True, state_indices: Optional[torch.Tensor] = None,
    state_scale: Optional[torch.Tensor] = None, state_format: Optional[str] = None, pad_slot_id: int = -1,
    out: Optional[torch.Tensor] = None, seed: Union[None, int, torch.Tensor] = None,
    slot_flags: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One gated delta rule decode token (GDN or KDA), the state stored in any format and updated
    in place (``docs/design.md#gdn-recurrence``).

    ======================  ==============================================================
    ``state``               ``(nslots, HV, V, K)`` (V-first, K contiguous: the serving
                            layout), in ``state_format``'s storage dtype (fp32, bf16, fp16,
                            float8_e4m3fn, float8_e5m2, int8)
    ``q``, ``k``            ``(batch, HK, K)``, fp32/bf16/fp16, unit inner stride; HV must be
                            a multiple of HK (value head ``h`` reads key head ``h // (HV/HK)``)
    ``v``, ``out``          ``(batch, HV, V)``, unit inner stride
    ``g``                   ``(batch, HV)`` (GDN: one log-space gate per head) or
                            ``(batch, HV, K)`` (KDA: one per key channel), values ``<= 0``
    ``beta``                ``(batch, HV)``, after the sigmoid: in ``[0, 1]``
    ``state_indices``       ``(batch,)`` int32/int64, contiguous: the slot of each row;
                            negative or ``pad_slot_id`` = padding (output zero, nothing written)
    ``state_scale``         fp32 ``StateFormat.scale_shape(state.shape)`` for 8-bit formats
                            (scale groups over K): row ``(nslots, HV, V)``, head
                            ``(nslots, HV)``, block32 ``(nslots, HV, V, K // 32)``
    ======================  ==============================================================

    The kernel computes ``q̂ = l2(q)·scale``, ``k̂ = l2(k)`` in fp32 (``l2(x) = x / sqrt(Σx² +
    1e-6)``; without ``use_qk_l2norm`` q and k as given; ``scale`` defaults to ``K**-0.5``),
    ``α = exp(g)``, dequantizes the slot's state and updates it in fp32 in the order of
    ``qstate.reference.decode_naive``: ``S ← S·diag(α)``, ``d = β (v − S k̂)``, ``S ← S + d k̂ᵀ``;
    it outputs ``o = S q̂`` from the unrounded ``S`` and stores ``S`` re-quantized (round to
    nearest even, or with ``+sr`` stochastic rounding with 16-bit noise from a Philox4x32-7 stream
    keyed by ``seed`` and the element's position) with fresh scales. ``state_format`` None means
    the unscaled format of the state's dtype. ``seed``: an int in ``[0, 2**31)``, a one-element
    int32/int64 device tensor (read by the kernel), or None (drawn from torch's CPU generator).
    On CPU tensors an index ``≥ nslots``, a slot named twice (padding aside), a gate ``> 0`` or a
    ``beta`` outside ``[0, 1]`` raise; on a GPU (no sync) they are the caller's contract: a row
    ``≥ nslots`` outputs NaN and writes nothing. A NaN in a row's inputs stays in that row and its
    slot (what each format stores for it: ``qstate/ops/__init__.py``). ``slot_flags``: None, or
    an int32 ``(nslots,)`` contiguous tensor on the state's device into which the kernel ORs
    ``qstate.SLOT_NONFINITE`` (2) for the slot of every row whose output meets a NaN or ±inf
    (every element of the row's new state reaches it); nothing else writes or clears it and no
    sync reads it. Returns ``out`` (allocated like ``v`` when None).
    """
    # The signature (a tensor seed by its dtype: another kernel) fixes every argument of the launch
    # but the tensors' addresses and the seed (kernels/README.md#dispatch).
    plain = (state_format, type(scale), scale, type(use_qk_l2norm), use_qk_l2norm, type(pad_slot_id), pad_slot_id,
             seed.dtype if isinstance(seed, torch.Tensor) else None)
    entry = _DISPATCH.entry(plain, (state, state_scale, q, k, v, g, beta, state_indices, out, slot_flags),
                            _check_args, state, q, k, v, g, beta, scale, use_qk_l2norm, state_indices, state_scale,
                            state_format, pad_slot_id, out, slot_flags)
    consts = _common.resolve_format(state_format, state)
    _common.check_slot_values(state_indices, state.shape[0], pad_slot_id, "state_indices")
    _gated_delta_checks.check_values(g, beta)
    seed_value, seed_tensor = _common.resolve_seed(seed, consts.stochastic, state.device)
    if out is None:
        out = torch.empty_like(v)
    qk_scale = state.shape[3] ** -0.5 if scale is None else float(scale)
    if v.shape[0] == 0:
        return out
    # In the kernel's order: the flags and the seed tensor before the seed.
    leading = (state, state if state_scale is None else state_scale, q, k, v, g, beta, state_indices, out, slot_flags,
               seed_tensor, seed_value)
    run_eagerly = eager(state)
    if run_eagerly and entry.launch(*leading):
        return out
    args = (state, state_scale, q, k, v, g, beta, qk_scale, use_qk_l2norm, state_indices, out, str(consts.fmt),
            pad_slot_id, seed_value, seed_tensor, slot_flags)
    _gated_delta_update_op(*args)
    if run_eagerly and entry.unprepared:
        launch_args, launch_kwargs = _launch_arguments(*args)
        entry.keep(_kernel.prepare(leading, *launch_args, **launch_kwargs))
    return out
