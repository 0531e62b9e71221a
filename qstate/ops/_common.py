"""Argument plumbing shared by the ops: format constants, the compact/tied-stride forms of the
Mamba-2 decode arguments, and checks whose errors name the argument, the expected and the actual
value (house rule). Checks read shapes, dtypes, devices and strides only: they never look at
device data, so they cost no synchronisation (slot indices on CPU tensors excepted)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from .. import _validate
from ..cache import SEED_LIMIT
from ..formats import StateFormat, as_format
from ..kernels.common import codec
from ._register import host_values

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class FormatConstants:
    """The constexprs a kernel needs for one state format."""

    fmt: StateFormat
    dtype_code: int
    granularity: int
    stochastic: bool
    qmax: float
    emax: int


@functools.lru_cache(maxsize=None)
def format_constants(text: str) -> FormatConstants:
    fmt = as_format(text, "state_format")
    return FormatConstants(fmt, codec.dtype_code(fmt), codec.granularity_code(fmt), fmt.stochastic,
                           codec.qmax(fmt), codec.emax(fmt))


_FORMAT_OF_STATE_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_format(state_format, state: torch.Tensor) -> FormatConstants:
    """``state_format`` or, when None, the unscaled format of the state's dtype."""
    if state_format is None:
        text = _FORMAT_OF_STATE_DTYPE.get(state.dtype)
        if text is None:
            raise ValueError(
                f"state_format: needed for a state of dtype {state.dtype} (give e.g. 'int8:row' or "
                f"'fp8_e4m3:row'), got None"
            )
        return format_constants(text)
    if not isinstance(state_format, (str, StateFormat)):
        raise TypeError(f"state_format: expected a str, a StateFormat or None, got {type(state_format).__name__}")
    return format_constants(str(state_format))


def _untie(name: str, t: Optional[torch.Tensor], compact_dim: int, tied_dims: int) -> Optional[torch.Tensor]:
    """mamba_ssm's expanded form (``tied_dims`` trailing dims of stride 0) → the compact tensor."""
    if t is None:
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() == compact_dim:
        return t
    if t.dim() != compact_dim + tied_dims:
        raise ValueError(f"{name}: expected {compact_dim} dimensions (or {compact_dim + tied_dims} with stride 0 "
                         f"over the trailing ones), got shape {tuple(t.shape)}")
    if any(t.stride(d) != 0 for d in range(compact_dim, t.dim()) if t.shape[d] > 1):
        raise ValueError(f"{name}: the expanded form must have stride 0 over its trailing {tied_dims} dims "
                         f"(one value per head), got strides {t.stride()}")
    return t[(Ellipsis,) + (0,) * tied_dims]


def check_tied_shapes(batch: int, nheads: int, headdim: int, dstate: int, dt, A, D, dt_bias) -> None:
    """Sizes of mamba_ssm's expanded forms (:func:`compact_decode_args`): ``dt (batch, nheads,
    headdim)``, ``A (nheads, headdim, dstate)``, ``D`` and ``dt_bias (nheads, headdim)``; the
    compact forms are checked where they are used."""
    expanded = (("dt", dt, 3, (batch, nheads, headdim), "(batch, nheads, headdim)"),
                ("A", A, 3, (nheads, headdim, dstate), "(nheads, headdim, dstate)"),
                ("D", D, 2, (nheads, headdim), "(nheads, headdim)"),
                ("dt_bias", dt_bias, 2, (nheads, headdim), "(nheads, headdim)"))
    for name, t, ndim, shape, layout in expanded:
        if isinstance(t, torch.Tensor) and t.dim() == ndim:
            _validate.shape(name, t, shape, f"{layout} in the expanded form")


def compact_decode_args(x, dt, A, D, dt_bias):
    """``(dt, A, D, dt_bias)`` in compact form: ``dt (batch, nheads)``, the rest ``(nheads,)``.

    Accepts mamba_ssm's tied-stride expanded form: ``A (nheads, headdim, dstate)``,
    ``dt (batch, nheads, headdim)``, ``D, dt_bias (nheads, headdim)``, all stride 0 beyond nheads.
    """
    _validate.tensor("x", x, ndim=3)
    return _untie("dt", dt, 2, 1), _untie("A", A, 1, 2), _untie("D", D, 1, 1), _untie("dt_bias", dt_bias, 1, 1)


def unit_inner_stride(name: str, t: Optional[torch.Tensor]) -> None:
    if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a unit stride in the last dimension, got strides {t.stride()}")


def per_head_vector(name: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A ``(nheads,)`` parameter with unit stride (copied if strided: a few bytes)."""
    return t if t is None or t.stride(0) == 1 else t.contiguous()


def unit_stride_params(dt: torch.Tensor, A, D, dt_bias):
    """``(dt, A, D, dt_bias)`` as the replay and speculative kernels index them: ``dt`` with a unit
    stride in its last dimension, the ``(nheads,)`` parameters with unit stride (copies, if any,
    are a few bytes)."""
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    return dt, per_head_vector("A", A), per_head_vector("D", D), per_head_vector("dt_bias", dt_bias)


def bool_flag(name: str, value) -> None:
    """A flag that must be a bool (a truthy string such as "False" would run as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def same_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the state's device), got {t.device}")


def float_input(name: str, t: Optional[torch.Tensor]) -> None:
    if t is not None and t.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"{name}: expected one of {list(_FLOAT_INPUTS)}, got {t.dtype}")


def check_state(state: torch.Tensor, state_scale: Optional[torch.Tensor], consts: FormatConstants,
                name: str = "state", scale_name: str = "state_scale") -> None:
    """State ``(nslots, nheads, headdim, dstate)`` in the format's storage dtype, and its scale."""
    fmt = consts.fmt
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(state).__name__}")
    if state.dim() != 4:
        raise ValueError(f"{name}: expected shape (nslots, nheads, headdim, dstate), got {tuple(state.shape)}")
    if state.dtype != fmt.storage_dtype:
        raise TypeError(f"{name}: expected dtype {fmt.storage_dtype} for state_format '{fmt}', got {state.dtype}")
    if min(state.shape[2:]) < 1:
        raise ValueError(f"{name}: expected headdim, dstate >= 1, got shape {tuple(state.shape)}")
    unit_inner_stride(name, state)
    distinct_slots(name, state)
    if fmt.granularity == "block32" and state.shape[-1] % 32:
        raise ValueError(f"{name}: block32 needs dstate % 32 == 0, got dstate {state.shape[-1]}")
    expected = fmt.scale_shape(state.shape)
    if expected is None:
        if state_scale is not None:
            raise ValueError(f"{scale_name}: state_format '{fmt}' has no scale, so expected None, got a tensor")
        return
    if state_scale is None:
        raise ValueError(f"{scale_name}: state_format '{fmt}' needs an fp32 scale of shape {tuple(expected)}, got None")
    _validate.tensor(scale_name, state_scale)
    if state_scale.dtype != torch.float32:
        raise TypeError(f"{scale_name}: expected dtype torch.float32, got {state_scale.dtype}")
    _validate.shape(scale_name, state_scale, expected, f"the scale shape of '{fmt}'")
    if fmt.granularity == "block32":
        unit_inner_stride(scale_name, state_scale)
    distinct_slots(scale_name, state_scale)
    if state_scale.device != state.device:
        raise ValueError(f"{scale_name}: expected a tensor on {state.device}, got {state_scale.device}")


def distinct_slots(name: str, t: torch.Tensor) -> None:
    """Slots in distinct memory: with a slot stride of 0 two rows would update one state."""
    if t.dim() and t.shape[0] > 1 and t.stride(0) == 0 and t[0].numel():
        raise ValueError(f"{name}: expected a nonzero stride between slots (each slot its own memory), "
                         f"got strides {t.stride()}")


def check_slot_indices(indices: Optional[torch.Tensor], batch: int, nslots: int, device: torch.device) -> None:
    """``(batch,)`` int32/int64 on ``device``; negative = padding. Values: :func:`check_slot_values`
    (CPU tensors only; on a GPU a row ``≥ nslots`` outputs NaN and writes nothing, without a sync)."""
    if indices is None:
        if nslots != batch:
            raise ValueError(f"state: without state_batch_indices expected {batch} slots (one per batch row), "
                             f"got {nslots}")
        return
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"state_batch_indices: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"state_batch_indices: expected int32 or int64, got {indices.dtype}")
    if tuple(indices.shape) != (batch,):
        raise ValueError(f"state_batch_indices: expected shape (batch,) = ({batch},), got {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"state_batch_indices: expected a tensor on {device}, got {indices.device}")
    unit_stride_indices("state_batch_indices", indices)


def unit_stride_indices(name: str, indices: torch.Tensor) -> None:
    """The kernels read a row's index at ``base + row``: a strided view would hand them other
    memory than the values the host checks see."""
    if indices.numel() > 1 and indices.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor (stride 1), got strides {indices.stride()}")


def check_intermediate(intermediate: torch.Tensor, intermediate_scale: Optional[torch.Tensor], state: torch.Tensor,
                       consts: FormatConstants, batch: int, T: int, layout: str, scale_layout: str) -> None:
    """The per-draft states of a speculative baseline: ``(batch, T_max) + state.shape[1:]``
    with ``T_max >= T``, the state's dtype and device, contiguous, and scales for the drafts as
    the state format gives them (``layout`` and ``scale_layout`` name the dimensions in errors)."""
    _validate.tensor("intermediate", intermediate, ndim=5, floating=False)
    t_max = intermediate.shape[1]
    _validate.shape("intermediate", intermediate, (batch, t_max) + tuple(state.shape[1:]), layout)
    if t_max < T:
        raise ValueError(f"intermediate: expected T_max >= T = {T}, got {t_max}")
    if intermediate.dtype != state.dtype:
        raise TypeError(f"intermediate: expected the state's dtype {state.dtype}, got {intermediate.dtype}")
    if intermediate.device != state.device:
        raise ValueError(f"intermediate: expected device {state.device} (the state's), got {intermediate.device}")
    if not intermediate.is_contiguous():
        raise ValueError(f"intermediate: expected a contiguous tensor, got strides {intermediate.stride()}")
    expected = consts.fmt.scale_shape((batch * t_max,) + tuple(state.shape[1:]))
    if expected is None:
        if intermediate_scale is not None:
            raise ValueError(f"intermediate_scale: state_format '{consts.fmt}' has no scale, expected None")
        return
    expected = (batch, t_max) + tuple(expected[1:])
    if not isinstance(intermediate_scale, torch.Tensor):
        raise ValueError(f"intermediate_scale: expected an fp32 tensor of shape {expected}, got "
                         f"{type(intermediate_scale).__name__}")
    if intermediate_scale.dtype != torch.float32:
        raise TypeError(f"intermediate_scale: expected dtype torch.float32, got {intermediate_scale.dtype}")
    _validate.shape("intermediate_scale", intermediate_scale, expected, scale_layout)
    if not intermediate_scale.is_contiguous():
        raise ValueError(f"intermediate_scale: expected a contiguous tensor, got strides {intermediate_scale.stride()}")


def contiguous_state(state: torch.Tensor, state_scale: Optional[torch.Tensor]) -> None:
    """The kernels index a slot's codes and scales as one contiguous block."""
    for name, t in (("state", state), ("state_scale", state_scale)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def check_slot_values(indices: Optional[torch.Tensor], nslots: int, pad_slot_id: int = -1,
                      name: str = "state_batch_indices") -> None:
    """Indices ``< nslots`` and no slot twice (two rows would race on one state), padding
    (negative or ``pad_slot_id``) aside, for a CPU tensor (a value check: it runs on every call,
    not once per signature); ``name`` is the argument's in errors. None, or a GPU tensor, is not
    read (that would sync): there both rules are the caller's contract."""
    if indices is None or not indices.numel() or not host_values(indices.device):
        return
    live = indices[(indices >= 0) & (indices != pad_slot_id)]
    past = live[live >= nslots]
    if past.numel():
        raise ValueError(f"{name}: expected indices < nslots = {nslots} (negative or pad_slot_id = "
                         f"{pad_slot_id}: padding), got {int(past.max())}")
    if torch.unique(live).numel() != live.numel():
        raise ValueError(f"{name}: expected no slot to repeat within one call, got {indices.tolist()}")


def check_out(out: torch.Tensor, x: torch.Tensor) -> None:
    _validate.tensor("out", out)
    _validate.shape("out", out, x.shape, "x.shape")
    float_input("out", out)
    unit_inner_stride("out", out)
    if out.device != x.device:
        raise ValueError(f"out: expected a tensor on {x.device}, got {out.device}")


def resolve_seed(seed, stochastic: bool, device):
    """(int seed, seed tensor or None) of a conventional op's ``seed``. A tensor seed is read on
    the device, so a captured CUDA graph can draw new noise each replay by refilling it; an int is
    baked into the graph; None draws from torch's CPU generator (no device sync), for stochastic
    formats only."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype not in (torch.int32, torch.int64) or seed.device != device:
            raise ValueError(f"seed: expected one int32/int64 element on {device}, got shape {tuple(seed.shape)} "
                             f"{seed.dtype} on {seed.device}")
        return 0, seed
    if seed is None:
        return (int(torch.randint(0, 2**31 - 1, ())) if stochastic else 0), None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, a device tensor or None, got {type(seed).__name__}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed: expected an int in [0, 2**31), got {seed}")
    return seed, None


def check_commit_counts(drafts: torch.Tensor, num_accepted: torch.Tensor, slot_indices: Optional[torch.Tensor],
                        verify_name: str) -> None:
    """On CPU tensors: every live row's slot holds drafts of a ``verify_name`` call, and
    ``0 <= num_accepted <= `` their count (a GPU commit checks the same on the device, no sync)."""
    slots = torch.arange(num_accepted.shape[0]) if slot_indices is None else slot_indices.long()
    live = slots >= 0
    pending = drafts[slots[live]].long()
    accepted = num_accepted[live].long()
    if bool((pending == 0).any()):
        raise ValueError(f"num_accepted: slots {slots[live][pending == 0].tolist()} have no pending {verify_name} "
                         f"to commit")
    wrong = (accepted < 0) | (accepted > pending)
    if bool(wrong.any()):
        raise ValueError(f"num_accepted: expected values in 0 … T = {pending[wrong].tolist()} (drafts verified), "
                         f"got {accepted[wrong].tolist()}")


def check_accepted_range(num_accepted: torch.Tensor, t_max: int) -> None:
    """On CPU tensors (:func:`host_values`): the per-draft baselines' ``num_accepted`` within
    ``0 … t_max`` (on a GPU the commit kernel skips a row outside, no sync)."""
    if host_values(num_accepted.device) and num_accepted.numel():
        lo, hi = int(num_accepted.min()), int(num_accepted.max())
        if lo < 0 or hi > t_max:
            raise ValueError(f"num_accepted: expected values in 0 … T_max = {t_max}, got min {lo}, max {hi}")


def raise_commit_errors(commit_errors: torch.Tensor, no_verify_bit: int, range_bit: int, verify_name: str,
                        commit_name: str) -> None:
    """Raise ``ValueError`` for the bits a device-side commit left in ``commit_errors`` (one host
    sync), and clear them."""
    bits = int(commit_errors[0])
    commit_errors.zero_()
    reasons = []
    if bits & no_verify_bit:
        reasons.append(f"a commit on a slot without a pending {verify_name}")
    if bits & range_bit:
        reasons.append("num_accepted outside 0 … T")
    if reasons:
        raise ValueError(f"{commit_name}: {' and '.join(reasons)}; those rows' slots were left untouched")
