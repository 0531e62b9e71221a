"""Argument checks shared by the public functions: each error names the argument, what was
expected and what came."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


def tensor(name: str, t, *, ndim: Optional[int] = None, floating: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    return t


def shape(name: str, t: torch.Tensor, expected: Sequence[int], names: str) -> None:
    """Check ``t.shape == expected``; ``names`` spells the dimensions, e.g. '(batch, nheads)'."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {names} = {tuple(expected)}, got {tuple(t.shape)}")


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Dims:
    batch: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int


def decode_inputs(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, *, time_major: bool = False) -> Dims:
    """Check the Mamba-2 decode arguments in compact form (docs/design.md#recurrence).

    One token: ``x (batch, nheads, headdim)``; with ``time_major`` the inputs carry a leading
    ``T`` dimension.
    """
    lead = int(time_major)
    tensor("state", state, ndim=4)
    tensor("x", x, ndim=3 + lead)
    tlead = tuple(x.shape[:lead])
    tname = "T, " if time_major else ""
    tensor("dt", dt, ndim=2 + lead)
    tensor("A", A, ndim=1)
    tensor("B", B, ndim=3 + lead)
    tensor("C", C, ndim=3 + lead)
    slots, nheads, headdim, dstate = state.shape
    batch = x.shape[lead]
    ngroups = B.shape[-2]
    shape("x", x, tlead + (batch, nheads, headdim), f"({tname}batch, nheads, headdim)")
    if time_major and x.shape[0] < 1:
        raise ValueError(f"x: expected at least one step, got T = {x.shape[0]}")
    if slots != batch:
        raise ValueError(f"state: expected {batch} rows (one per batch row of x), got shape {tuple(state.shape)}")
    shape("dt", dt, tlead + (batch, nheads), f"({tname}batch, nheads)")
    shape("A", A, (nheads,), "(nheads,)")
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"B: nheads ({nheads}) must be a multiple of ngroups, got ngroups {ngroups}")
    shape("B", B, tlead + (batch, ngroups, dstate), f"({tname}batch, ngroups, dstate)")
    shape("C", C, tlead + (batch, ngroups, dstate), f"({tname}batch, ngroups, dstate)")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            tensor(name, t, ndim=1)
            shape(name, t, (nheads,), "(nheads,)")
    if z is not None:
        tensor("z", z, ndim=3 + lead)
        shape("z", z, tuple(x.shape), f"({tname}batch, nheads, headdim)")
    return Dims(batch, nheads, headdim, dstate, ngroups)


def cache_tensors(expected: dict, device) -> None:
    """Check a cache's tensors: ``expected`` maps each name to ``(tensor, shape, dtype)``; each
    must be a contiguous tensor of that shape and dtype on ``device`` (the checkpoint's)."""
    for name, (t, shp, dtype) in expected.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shp):
            raise ValueError(f"{name}: expected shape {tuple(shp)}, got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}: expected device {device} (the checkpoint's), got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
