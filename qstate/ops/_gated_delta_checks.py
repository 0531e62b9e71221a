"""Checks shared by the gated delta rule ops (:mod:`.gated_delta`, :mod:`.gated_delta_replay`):
the token's inputs against the sizes of the state or cache. Metadata checks read shapes,
dtypes, devices and strides only; the value checks (gates ``<= 0``, ``beta`` in ``[0, 1]``)
read CPU tensors only: on a GPU they would sync, so there the ranges are the caller's contract."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

from .. import _validate
from ..gated_delta_cache import GatedDeltaReplayCache
from . import _common
from ._register import host_values


@dataclasses.dataclass(frozen=True)
class TokenDims:
    batch: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    channel_gate: bool


def check_token(q, k, v, g, beta, *, num_v_heads: int, head_k_dim: int, head_v_dim: int, device: torch.device,
                owner: str) -> TokenDims:
    """``q, k (batch, HK, K)``, ``v (batch, HV, V)``, ``g (batch, HV)`` or ``(batch, HV, K)``,
    ``beta (batch, HV)`` against ``owner``'s (the state's or cache's) HV, K, V and device."""
    (batch,), HK, channel = check_inputs(q, k, v, g, beta, drafts=False, num_v_heads=num_v_heads,
                                         head_k_dim=head_k_dim, head_v_dim=head_v_dim, device=device, owner=owner)
    return TokenDims(batch, HK, num_v_heads, head_k_dim, head_v_dim, channel)


def check_inputs(q, k, v, g, beta, *, drafts: bool, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 device: torch.device, owner: str) -> tuple:
    """One token's inputs (``drafts`` False: leading dimension ``batch``) or T drafts' (``batch,
    T``, T ≥ 1): ``q, k (…, HK, K)``, ``v (…, HV, V)``, ``g (…, HV)`` or ``(…, HV, K)``, ``beta
    (…, HV)`` against ``owner``'s HV, K, V and device. Returns ``(leading sizes, HK, channel)``."""
    lead_names = "batch, T" if drafts else "batch"
    nlead = 2 if drafts else 1
    for name, t, ndim in (("q", q, nlead + 2), ("k", k, nlead + 2), ("v", v, nlead + 2), ("beta", beta, nlead + 1)):
        _validate.tensor(name, t, ndim=ndim)
    _validate.tensor("g", g)
    lead, (HK, K) = tuple(k.shape[:nlead]), k.shape[nlead:]
    _validate.shape("q", q, k.shape, f"({lead_names}, HK, K) as k")
    if K != head_k_dim:
        raise ValueError(f"k: expected head_k_dim K = {head_k_dim} ({owner}'s), got shape {tuple(k.shape)}")
    if drafts and lead[1] < 1:
        raise ValueError(f"k: expected at least one draft (T >= 1), got shape {tuple(k.shape)}")
    _validate.shape("v", v, (*lead, num_v_heads, head_v_dim), f"({lead_names}, HV, V) with {owner}'s HV and V")
    if HK < 1 or num_v_heads % HK:
        raise ValueError(f"k: the number of value heads HV = {num_v_heads} must be a multiple of the key heads "
                         f"HK, got HK = {HK}")
    if g.dim() not in (nlead + 1, nlead + 2):
        raise ValueError(f"g: expected {nlead + 1} dimensions ({lead_names}, HV) for a per-head gate or {nlead + 2} "
                         f"({lead_names}, HV, K) for a per-channel gate, got shape {tuple(g.shape)}")
    channel = g.dim() == nlead + 2
    _validate.shape("g", g, (*lead, num_v_heads) + ((K,) if channel else ()),
                    f"({lead_names}, HV, K)" if channel else f"({lead_names}, HV)")
    _validate.shape("beta", beta, (*lead, num_v_heads), f"({lead_names}, HV)")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _common.float_input(name, t)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        _common.unit_inner_stride(name, t)
    _common.same_device(device, q=q, k=k, v=v, g=g, beta=beta)
    return lead, HK, channel


def check_scale(scale) -> Optional[float]:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected None or a real number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite number > 0, got {scale}")
    return float(scale)


def check_values(g: torch.Tensor, beta: torch.Tensor) -> None:
    """Gates in log space ``<= 0`` and ``beta`` in ``[0, 1]``, for CPU tensors (every call)."""
    if not host_values(g.device):
        return
    if g.numel() and not bool((g <= 0).all()):
        bad = g[~(g <= 0)]
        raise ValueError(f"g: expected log-space gates <= 0 (decay exp(g) <= 1), got {bad.flatten()[0].item()}")
    if beta.numel() and not bool(((beta >= 0) & (beta <= 1)).all()):
        bad = beta[~((beta >= 0) & (beta <= 1))]
        raise ValueError(f"beta: expected values in [0, 1] (after the sigmoid), got {bad.flatten()[0].item()}")


def check_out(out: torch.Tensor, v: torch.Tensor) -> None:
    _common.check_out(out, v)


def check_slot_flags(slot_flags, nslots: int, device: torch.device) -> None:
    """``slot_flags``: an int32 ``(nslots,)`` contiguous tensor on ``device``."""
    _validate.tensor("slot_flags", slot_flags, ndim=1, floating=False)
    _validate.shape("slot_flags", slot_flags, (nslots,), "(nslots,)")
    if slot_flags.dtype != torch.int32:
        raise TypeError(f"slot_flags: expected dtype torch.int32, got {slot_flags.dtype}")
    _common.same_device(device, slot_flags=slot_flags)
    if not slot_flags.is_contiguous():
        raise ValueError(f"slot_flags: expected a contiguous tensor, got strides {slot_flags.stride()}")


def check_cache_inputs(cache, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, num_k_heads: int,
                       channel_gate: bool, lead: str) -> None:
    """Inputs against a replay cache: its key heads, its gate kind and its ring's input dtype
    (the ring keeps ``k`` and ``v`` as given). ``lead`` names the leading dimensions of ``g``
    in the error (``"batch"`` or ``"batch, T"``)."""
    if num_k_heads != cache.num_k_heads:
        raise ValueError(f"k: expected HK = {cache.num_k_heads} key heads (the cache's), got shape {tuple(k.shape)}")
    if channel_gate != (cache.gate == "channel"):
        want = f"({lead}, HV, K): the cache holds per-channel gates" if cache.gate == "channel" else \
            f"({lead}, HV): the cache holds one gate per head"
        raise ValueError(f"g: expected shape {want}, got {tuple(g.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != cache.input_dtype:
            raise TypeError(f"{name}: expected the cache's input dtype {cache.input_dtype} (the ring keeps the inputs "
                            f"as given), got {t.dtype}")


def check_slots(slot_indices, batch: int, num_slots: int, device, rows: str) -> None:
    """Slot indices' metadata: None (then one row per slot; ``rows`` names the argument whose
    batch is blamed), or as :func:`check_index_tensor` requires."""
    if slot_indices is None:
        if num_slots != batch:
            raise ValueError(f"{rows}: without slot_indices expected {num_slots} rows (one per slot), got {batch}")
        return
    check_index_tensor("slot_indices", slot_indices, batch, device)


def check_index_tensor(name: str, indices, batch: int, device) -> None:
    """An int32/int64 ``(batch,)`` tensor of slot indices on ``device`` with unit stride."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected int32 or int64, got {indices.dtype}")
    if tuple(indices.shape) != (batch,):
        raise ValueError(f"{name}: expected shape (batch,) = ({batch},), got {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {indices.device}")
    _common.unit_stride_indices(name, indices)


def cache_signature(cache, scale, use_qk_l2norm) -> tuple:
    """``(plain, cache tensors)`` of a replay step's or verify's dispatch signature
    (``kernels/README.md#dispatch``): the cache's formats and ring room, the scale and the l2 flag
    with their types, and the cache's tensors, whose layouts the signature holds. Not a cache: a
    key that matches no call (the checks then run and name it) and no tensors."""
    is_cache = isinstance(cache, GatedDeltaReplayCache)
    plain = ((cache.checkpoint_format, cache.read_format, cache.max_draft) if is_cache else object(), type(scale),
             scale, type(use_qk_l2norm), use_qk_l2norm)
    return plain, tuple(cache.tensors().values()) if is_cache else ()
