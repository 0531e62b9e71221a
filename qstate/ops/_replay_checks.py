"""Checks shared by the ops over a :class:`~qstate.ReplayCache` (replay decode and speculative
decoding): ``out``, slot indices, the ring's inputs, and the once-per-signature wrapper of a
decode or verify call (its dispatch entry). Errors name the argument, the expected and the
actual value."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validate
from ..cache import ReplayCache
from ..kernels.common.launch import Dispatch
from . import _common
from ._register import host_values


def inner_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dimension, got strides {t.stride()}")


def check_out(out: Optional[torch.Tensor], x: torch.Tensor, layout: str) -> torch.Tensor:
    """``out`` (allocated when None): x's shape (``layout`` names it), dtype and device, unit
    inner stride."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _validate.tensor("out", out, ndim=x.dim())
    _validate.shape("out", out, tuple(x.shape), layout)
    if out.dtype != x.dtype:
        raise TypeError(f"out: expected dtype {x.dtype} (x's), got {out.dtype}")
    if out.device != x.device:
        raise ValueError(f"out: expected device {x.device} (x's), got {out.device}")
    inner_contiguous("out", out)
    return out


def check_slot_indices(slot_indices, batch: int, cache: ReplayCache, rows: str = "x") -> None:
    """``slot_indices (batch,)`` or None (row i uses slot i; ``rows`` names the batch argument):
    :func:`check_slot_layout` and :func:`check_slot_values`."""
    check_slot_layout(slot_indices, batch, cache, rows)
    if slot_indices is not None:
        check_slot_values(slot_indices, cache)


def check_slot_layout(slot_indices, batch: int, cache: ReplayCache, rows: str = "x") -> None:
    """Type, dtype, shape and device of ``slot_indices``; without them, batch ≤ num_slots."""
    if slot_indices is None:
        if batch > cache.num_slots:
            raise ValueError(f"{rows}: without slot_indices row i uses slot i, so batch must be <= num_slots = "
                             f"{cache.num_slots}, got {batch}")
        return
    if not isinstance(slot_indices, torch.Tensor):
        raise TypeError(f"slot_indices: expected a torch.Tensor or None, got {type(slot_indices).__name__}")
    if slot_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_indices: expected dtype torch.int32 or torch.int64, got {slot_indices.dtype}")
    _validate.shape("slot_indices", slot_indices, (batch,), "(batch,)")
    if slot_indices.device != cache.device:
        raise ValueError(f"slot_indices: expected device {cache.device} (the cache's), got {slot_indices.device}")
    _common.unit_stride_indices("slot_indices", slot_indices)


def check_slot_values(slot_indices: torch.Tensor, cache: ReplayCache) -> None:
    """Values of CPU slot indices: below num_slots, none repeated (padding aside). A value
    check, so it runs on every call; a GPU tensor is not read (that would sync the host)."""
    if not host_values(slot_indices.device):
        return
    live = slot_indices[slot_indices >= 0]
    if live.numel():
        top = int(live.max())
        if top >= cache.num_slots:
            raise ValueError(f"slot_indices: expected values < num_slots = {cache.num_slots} "
                             f"(negative = padding), got {top}")
        if torch.unique(live).numel() != live.numel():
            raise ValueError(f"slot_indices: expected no slot to repeat within one call, got {slot_indices.tolist()}")


def cache_layout(cache, launched: bool = False) -> tuple:
    """``(plain, tensors)``: what the checks read of a cache (a fresh object, equal to nothing,
    for a non-cache); with ``launched``, what the launches read of it besides its tensors'
    addresses: its formats and seed, and its tensors (whose metadata holds the sizes, device and
    input dtype: the checkpoint's, ring_B's and ring_x's)."""
    if not isinstance(cache, ReplayCache):
        return object(), ()
    if launched:
        return (cache.max_draft, cache.checkpoint_format, cache.read_format, cache.seed), ring_state(cache)
    return (cache.num_slots, cache.nheads, cache.headdim, cache.dstate, cache.ngroups, cache.device,
            cache.input_dtype, cache.max_draft), ()


def ring_state(cache: ReplayCache) -> tuple:
    """The cache's tensors a replay step reads and writes, in the launchers' order."""
    return (cache.checkpoint, cache.checkpoint_scale, cache.read, cache.read_scale, cache.ring_x, cache.ring_dt,
            cache.ring_B, cache.cursor, cache.generation, cache.flush_rows, cache.flush_counters, cache.slot_flags)


def check_ring_inputs(cache: ReplayCache, x: torch.Tensor, B: torch.Tensor, dt_softplus) -> None:
    """x and B in the ring's dtype, and the flag a bool."""
    for name, t in (("x", x), ("B", B)):
        if t.dtype != cache.input_dtype:
            raise TypeError(f"{name}: expected the cache's input dtype {cache.input_dtype} (it joins the ring), "
                            f"got {t.dtype}")
    _common.bool_flag("dt_softplus", dt_softplus)


def checked_ring_call(dispatch: Dispatch, check, cache, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices,
                      out, launched: bool = False):
    """What a decode or verify call does before its launch: its entry in ``dispatch`` (``check``,
    the call's metadata checks with the same arguments, runs once per signature;
    :func:`cache_layout` with ``launched`` says what of the cache the signature holds), the slot
    values every call; returns ``out`` (allocated like x when None) and the entry."""
    layout, cache_tensors = cache_layout(cache, launched)
    entry = dispatch.entry((layout, type(dt_softplus), dt_softplus),
                           (x, dt, A, B, C, D, z, dt_bias, slot_indices, out, *cache_tensors), check, cache, x, dt,
                           A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out)
    if slot_indices is not None:
        check_slot_values(slot_indices, cache)
    return (out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)), entry
