"""``selective_state_update``: the conventional decode step over any state format, as the
custom op ``qstate::selective_state_update`` (fake impl included, so it works under
``torch.compile`` and CUDA-graph capture)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _validate
from ..kernels.common.launch import Dispatch
from ..kernels.mamba2 import conventional as _kernel
from . import _common
from ._register import eager, mutating_op

_OP_NAME = "qstate::selective_state_update"


def _launch_arguments(state, state_scale, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, out,
                      state_format, pad_slot_id, seed, seed_tensor, slot_flags):
    """``(args, kwargs)`` of the kernel launcher for the op's arguments."""
    consts = _common.format_constants(state_format)
    return ((_kernel.codec.storage_view(state, consts.fmt), state_scale, x, dt, A, B, C, D, z, dt_bias,
             state_batch_indices, out, seed, seed_tensor),
            dict(dtype_code=consts.dtype_code, granularity=consts.granularity, stochastic=consts.stochastic,
                 qmax=consts.qmax, emax=consts.emax, dt_softplus=dt_softplus, pad_slot_id=pad_slot_id,
                 heads_per_group=x.shape[1] // B.shape[1], slot_flags=slot_flags))


def _selective_state_update_impl(
    state: torch.Tensor, state_scale: Optional[torch.Tensor], x: torch.Tensor, dt: torch.Tensor,
    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor], dt_softplus: bool, state_batch_indices: Optional[torch.Tensor],
    out: torch.Tensor, state_format: str, pad_slot_id: int, seed: int, seed_tensor: Optional[torch.Tensor],
    slot_flags: Optional[torch.Tensor],
) -> None:
    args, kwargs = _launch_arguments(state, state_scale, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                     state_batch_indices, out, state_format, pad_slot_id, seed, seed_tensor,
                                     slot_flags)
    _kernel.launch(*args, **kwargs)


_selective_state_update_op = mutating_op(_OP_NAME, _selective_state_update_impl,
                                         ("state", "state_scale", "out", "slot_flags"))
_DISPATCH = Dispatch(_OP_NAME)


def _check_args(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, state_scale,
                state_format, pad_slot_id, out, slot_flags) -> None:
    """Every check of :func:`selective_state_update` that reads only metadata (its signature)."""
    consts = _common.resolve_format(state_format, state)
    _common.check_state(state, state_scale, consts)
    nslots, nheads, headdim, dstate = state.shape
    _validate.tensor("x", x, ndim=3)
    batch = x.shape[0]
    _common.check_tied_shapes(batch, nheads, headdim, dstate, dt, A, D, dt_bias)
    dt, A, D, dt_bias = _common.compact_decode_args(x, dt, A, D, dt_bias)
    for name, t, ndim in (("dt", dt, 2), ("A", A, 1), ("B", B, 3), ("C", C, 3)):
        _validate.tensor(name, t, ndim=ndim)
    _validate.shape("x", x, (batch, nheads, headdim), "(batch, nheads, headdim)")
    _validate.shape("dt", dt, (batch, nheads), "(batch, nheads)")
    _validate.shape("A", A, (nheads,), "(nheads,)")
    ngroups = B.shape[1]
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"B: nheads ({nheads}) must be a multiple of ngroups, got ngroups {ngroups}")
    _validate.shape("B", B, (batch, ngroups, dstate), "(batch, ngroups, dstate)")
    _validate.shape("C", C, (batch, ngroups, dstate), "(batch, ngroups, dstate)")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _validate.tensor(name, t, ndim=1)
            _validate.shape(name, t, (nheads,), "(nheads,)")
    if z is not None:
        _validate.tensor("z", z, ndim=3)
        _validate.shape("z", z, x.shape, "x.shape")
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias)):
        _common.float_input(name, t)
    for name, t in (("x", x), ("B", B), ("C", C), ("z", z)):
        _common.unit_inner_stride(name, t)
    _common.same_device(state.device, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    _common.check_slot_indices(state_batch_indices, batch, nslots, state.device)
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise TypeError(f"pad_slot_id: expected an int, got {type(pad_slot_id).__name__}")
    _common.bool_flag("dt_softplus", dt_softplus)
    if out is not None:
        _common.check_out(out, x)
    if slot_flags is not None:
        _validate.tensor("slot_flags", slot_flags, ndim=1, floating=False)
        _validate.shape("slot_flags", slot_flags, (nslots,), "(nslots,)")
        if slot_flags.dtype != torch.int32:
            raise TypeError(f"slot_flags: expected dtype torch.int32, got {slot_flags.dtype}")
        _common.same_device(state.device, slot_flags=slot_flags)
        if not slot_flags.is_contiguous():
            raise ValueError(f"slot_flags: expected a contiguous tensor, got strides {slot_flags.stride()}")


def selective_state_update(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: Optional[torch.Tensor] = None, z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    dt_softplus: bool = False, state_batch_indices: Optional[torch.Tensor] = None, *,
    state_scale: Optional[torch.Tensor] = None, state_format: Optional[str] = None, pad_slot_id: int = -1,
    out: Optional[torch.Tensor] = None, seed: Union[None, int, torch.Tensor] = None,
    slot_flags: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One Mamba-2 decode token, the state stored in any format and updated in place.

    Same first eleven parameters and behaviour as mamba_ssm's function of this name:

    ======================  ==============================================================
    ``state``               ``(nslots, nheads, headdim, dstate)``, in ``state_format``'s storage
                            dtype (fp32, bf16, fp16, float8_e4m3fn, float8_e5m2, int8);
                            dstate stride 1
    ``x``, ``z``, ``out``   ``(batch, nheads, headdim)``, fp32/bf16/fp16, unit inner stride
    ``dt``                  ``(batch, nheads)`` or tied ``(batch, nheads, headdim)`` (stride 0)
    ``A``                   ``(nheads,)`` or tied ``(nheads, headdim, dstate)`` (stride 0)
    ``B``, ``C``            ``(batch, ngroups, dstate)``, unit inner stride
    ``D``, ``dt_bias``      ``(nheads,)`` or tied ``(nheads, headdim)`` (stride 0)
    ``state_batch_indices`` ``(batch,)`` int32/int64, contiguous: the slot of each row; negative or
                            ``pad_slot_id`` = padding (output zero, nothing written)
    ``state_scale``         fp32 ``StateFormat.scale_shape(state.shape)`` for 8-bit formats:
                            row ``(nslots, nheads, headdim)``, head ``(nslots, nheads)``,
                            block32 ``(nslots, nheads, headdim, dstate // 32)``
    ======================  ==============================================================

    The kernel dequantizes the slot's state, computes ``dt = softplus(dt + dt_bias)`` (when
    asked), ``S = exp(dt·A)·S + (dt·x) ⊗ B`` in fp32, ``y = S·C + D·x`` (times ``z·sigmoid(z)``)
    from the unrounded ``S``, and stores ``S`` re-quantized (round-to-nearest-even, or with
    ``+sr`` stochastic rounding with 16-bit uniform noise from a Philox4x32-7 stream keyed by
    ``seed`` and the element's position in the state) with fresh scales. On a GPU, row and head scales are computed with
    the scale's reciprocal and the old scale folded into the decay (fewer instructions), so a
    code can differ by one grid step from ``decode_naive``'s where the quotient lies within an
    ulp of a rounding boundary (at most 7 codes in 10⁶ in the H200 check; on CPU tensors the
    codes are bit-identical). ``state_format`` None means the unscaled format of the state's
    dtype (mamba_ssm's behaviour). ``seed``: an int in ``[0, 2**31)`` (others raise; nothing is
    masked), a one-element int32/int64 device tensor (read by the kernel; refill it between
    CUDA-graph replays) holding a value in the same range, which gives the same noise as that
    int (the value is not checked: that would sync), or None (drawn from torch's CPU
    generator). An index ``≥ nslots`` or a slot named twice (padding aside) raises on CPU; on a
    GPU (no sync) such rows are the caller's contract: a row ``≥ nslots`` outputs NaN and
    writes nothing, two rows of one slot race. A state whose slot stride is 0 raises. A NaN or inf in a row's inputs stays in that row: its output and its
    slot's state may become NaN, inf or saturated codes (with scales of no use); no other slot
    is read or written. ``slot_flags``: None, or an int32 ``(nslots,)`` tensor on the state's
    device into which the kernel ORs ``qstate.SLOT_NONFINITE`` (2) for the slot of every row
    whose output meets a NaN or ±inf (every element of the row's new state reaches it); nothing
    else writes or clears it and no sync reads it. Returns ``out`` (allocated like ``x`` when None).
    """
    # The signature (a tensor seed by its dtype: another kernel) fixes every argument of the launch
    # but the tensors' addresses and the seed (kernels/README.md#dispatch).
    plain = (state_format, type(dt_softplus), dt_softplus, type(pad_slot_id), pad_slot_id,
             seed.dtype if isinstance(seed, torch.Tensor) else None)
    entry = _DISPATCH.entry(plain, (state, state_scale, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out,
                                    slot_flags), _check_args, state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                            state_batch_indices, state_scale, state_format, pad_slot_id, out, slot_flags)
    consts = _common.resolve_format(state_format, state)
    if state_batch_indices is not None:
        _common.check_slot_values(state_batch_indices, state.shape[0], pad_slot_id)
    if out is None:
        out = torch.empty_like(x)
    seed_value, seed_tensor = _common.resolve_seed(seed, consts.stochastic, state.device)
    # In the kernel's order: the flags and the seed tensor before the seed.
    given = (state, state_scale, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out, slot_flags, seed_tensor,
             seed_value)
    run_eagerly = eager(state)
    if run_eagerly and entry.launch(*given):
        return out
    compact_dt, compact_A, compact_D, compact_dt_bias = _common.compact_decode_args(x, dt, A, D, dt_bias)
    compact_A, compact_D, compact_dt_bias = (_common.per_head_vector(n, t) for n, t in
                                             (("A", compact_A), ("D", compact_D), ("dt_bias", compact_dt_bias)))
    args = (state, state_scale, x, compact_dt, compact_A, B, C, compact_D, z, compact_dt_bias, dt_softplus,
            state_batch_indices, out, str(consts.fmt), pad_slot_id, seed_value, seed_tensor, slot_flags)
    _selective_state_update_op(*args)
    if run_eagerly and entry.unprepared:
        launch_args, launch_kwargs = _launch_arguments(*args)
        entry.keep(_kernel.prepare(given, *launch_args, **launch_kwargs))
    return out
