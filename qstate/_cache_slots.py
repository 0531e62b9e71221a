"""What the replay caches of both layer families share (``qstate.ReplayCache`` for Mamba-2
layers, ``qstate.GatedDeltaReplayCache`` for gated delta rule layers): selecting slots, admitting
a prefill state into a checkpoint and its read copy, reading stored states back, byte counts,
and the checks of what a cache built over an engine's tensors starts from.

Small functions over explicit tensors and formats, so that each cache keeps its own fields and
shapes (``(slots, heads, rows, columns)`` states in both) and calls them with its names.
"""

from __future__ import annotations

import numbers
from typing import Iterable, Optional, Sequence, Union

import torch

from . import _validate
from .formats import QuantizedState, StateFormat, dequantize, quantize

SlotsLike = Union[torch.Tensor, Sequence[int], int]
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def slot_index(slots: SlotsLike, num_slots: int, device: torch.device, name: str = "slots") -> torch.Tensor:
    """``slots`` (an int, a flat sequence of ints or a 1-D integer tensor) as an int64 tensor on
    ``device``; raises on a value outside ``[0, num_slots)`` or one named twice."""
    if isinstance(slots, int) and not isinstance(slots, bool):
        slots = [slots]
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
            raise TypeError(f"{name}: expected a 1-D integer tensor, got {slots.dtype} shape {tuple(slots.shape)}")
        idx = slots.to(device=device, dtype=torch.long)
    else:
        try:
            values = list(slots)
        except TypeError:
            raise TypeError(f"{name}: expected an int, a sequence of ints or an integer tensor, "
                            f"got {slots!r}") from None
        # torch.tensor(..., dtype=long) would truncate 1.5 to slot 1.
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
            raise TypeError(f"{name}: expected a flat sequence of ints, got {slots!r}")
        idx = torch.tensor(values, dtype=torch.long, device=device)
    if idx.numel() == 0:
        return idx
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"{name}: expected slot indices in [0, {num_slots}), got min {lo}, max {hi}")
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name}: expected distinct slot indices, got repeats in {idx.tolist()}")
    return idx


def admission_values(state: Optional[torch.Tensor], shape: tuple, device: torch.device, layout: str) -> torch.Tensor:
    """The fp32 states to admit: zeros of ``shape`` for None, else ``state`` checked to be a 4-D
    floating tensor of ``shape`` (``layout`` names its dimensions in the error) and moved to
    ``device``."""
    if state is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    _validate.tensor("state", state, ndim=4)
    _validate.shape("state", state, shape, layout)
    return state.to(device=device, dtype=torch.float32)


def admit(idx: torch.Tensor, values: torch.Tensor, checkpoint_format: StateFormat, checkpoint: torch.Tensor,
          checkpoint_scale: Optional[torch.Tensor], read_format: Optional[StateFormat], read: Optional[torch.Tensor],
          read_scale: Optional[torch.Tensor], generator: Optional[torch.Generator] = None) -> None:
    """``checkpoint[idx] ← quantize(values)`` and, with a read copy, ``read[idx] ←
    quantize(dequantize(checkpoint))``, each with its scales: the rounding the references
    apply at admission. Stochastic formats draw from ``generator``."""
    ck = quantize(values, checkpoint_format, generator=generator)
    checkpoint[idx] = ck.data
    if checkpoint_scale is not None:
        checkpoint_scale[idx] = ck.scale
    if read is not None:
        rd = quantize(dequantize(ck), read_format, generator=generator)
        read[idx] = rd.data
        if read_scale is not None:
            read_scale[idx] = rd.scale


def stored_values(data: torch.Tensor, scale: Optional[torch.Tensor], fmt: StateFormat,
                  idx: torch.Tensor) -> torch.Tensor:
    """fp32 values of the states stored in ``data`` (with ``scale``) at slots ``idx``."""
    return dequantize(QuantizedState(data[idx], None if scale is None else scale[idx], fmt))


def tensor_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes held by ``tensors`` (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def slot_state_bytes(data: torch.Tensor, scale: Optional[torch.Tensor]) -> int:
    """Bytes of one slot's stored state: its codes and scales."""
    return data[0].numel() * data.element_size() + (0 if scale is None else scale[0].numel() * scale.element_size())


def expect_optional(expected: dict, name: str, t: Optional[torch.Tensor], want: Optional[tuple], fmt) -> None:
    """A tensor a format decides on: ``want`` ``(shape, dtype)`` or None (the format has none);
    raises when presence differs, else adds the check to ``expected`` (as
    ``_validate.cache_tensors`` takes it)."""
    if want is None:
        if t is not None:
            raise ValueError(f"{name}: expected None for format {fmt}, got a tensor")
    elif t is None:
        raise ValueError(f"{name}: expected a tensor of shape {tuple(want[0])} for format {fmt}, got None")
    else:
        expected[name] = (t, tuple(want[0]), want[1])


def check_counter(name: str, values: torch.Tensor, top: int, bound: str) -> None:
    """Every value of ``values`` in ``[0, top)`` (read on the host: one sync); ``bound`` says
    what ``top`` is in the error."""
    n = values.long().cpu()
    bad = (n < 0) | (n >= top)
    if bool(bad.any()):
        raise ValueError(f"{name}: expected values in [0, {top}){bound}, got {n[bad].tolist()} at slots "
                         f"{bad.nonzero().flatten().tolist()}")


def check_max_draft(max_draft) -> None:
    if isinstance(max_draft, bool) or not isinstance(max_draft, int):
        raise TypeError(f"max_draft: expected an int, got {type(max_draft).__name__}")
    if max_draft < 0:
        raise ValueError(f"max_draft: expected an int >= 0, got {max_draft}")


def check_input_dtype(dtype, name: str = "input_dtype") -> None:
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
