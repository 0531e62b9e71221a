"""Conventional gated delta rule decode step over any state format: what a program of the kernel
(:mod:`.conventional_kernel`) does, and its launcher.

A tile is ``[BLOCK_V, BLOCK_K]`` of one (row of the batch, value head): ``BLOCK_V`` rows of V by
the whole (padded) K, so each V-row's dot with the key, and its row or block32 scales, stay
inside one program; ``head`` scales need the whole head, so that granularity takes ``BLOCK_V ≥
V``. Grid ``(cdiv(V, BLOCK_V · V_LOOP), HV, batch)``: a program takes ``V_LOOP`` tiles of its
head one after the other, reading and writing each once.

Per program: normalize q and k of the head's key head (``h // (HV / HK)``) in fp32, ``α =
exp(g)`` (one per head or per key channel). Per tile: load codes and scales, dequantize
(``code · scale``), then in fp32 and the references' order ``S ← S·diag(α)``, ``d = β (v − S
k̂)``, ``S ← S + d k̂ᵀ``; output ``S q̂`` from the unrounded state, re-quantize with the codec
(``tile.store_tile``) and store in place. ``FUSED`` (8-bit row and head scales, round to
nearest) takes fewer, slightly less exact steps: GDN's decay joins the old scale, codes come
from one product with an approximate reciprocal (``tile.store_tile_fused``;
README.md#fused-path). A row whose slot index is negative or ``pad_slot_id`` outputs zeros and
touches no slot; an index ``≥ nslots`` (rejected on the host for CPU tensors) outputs NaN and
touches no slot.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..common import codec, sizes
from ..common.launch import CompiledLaunch, PreparedLaunch, register_cap
from .conventional_kernel import _conventional_kernel

# Rows of V per tile at K = 128, and warps, by state bytes per element: head and block32 scales.
_TILE_ROWS = {4: (16, 4), 2: (32, 4), 1: (32, 4)}
# The same for GPU launches of unscaled and row-scaled formats, by dtype code: one warp keeps a
# row's K-sums inside it (no shared-memory round); 16 rows timed fastest for 8-bit too on the H200.
TILE_ROWS_BY_DTYPE = {codec.FP32: (16, 1), codec.BF16: (16, 1), codec.FP16: (16, 1), codec.INT8: (16, 1),
                      codec.FP8_E4M3: (16, 1), codec.FP8_E5M2: (16, 1)}
# Fused arithmetic of 8-bit row and head scales on GPU launches (README.md#fused-path): sm_90
# listing int8:row 1456 vs 1872, fp8_e4m3:row 1280 vs 1648 instructions in the references' order.
FUSED_ON_GPU = True
# Tiles a program takes on a GPU, one after the other, sharing q̂, k̂ and the gates, by (per-channel
# gate, dtype code) of unscaled and row-scaled round-to-nearest formats; absent: 1. H100 A/B, batch 256.
V_LOOP_BY_FORMAT = {(False, codec.INT8): 8, (False, codec.FP8_E4M3): 2, (False, codec.BF16): 4,
                    (True, codec.INT8): 8}
# A tile count for every format instead (sweeps and checks); None: V_LOOP_BY_FORMAT.
V_LOOP = None
# Register cap (ptxas .maxnreg) of GPU launches; None: ptxas's choice (int8:row takes 157 at
# V_LOOP 4-8, so 12 one-warp programs a multiprocessor against 16 at 128).
REGISTER_CAP = None
# (BLOCK_V, V_LOOP) of interpreter launches; None: the whole V in one tile (the interpreter pays
# per program). Tests set it to run a GPU-like split.
INTERPRETER_SPLIT = None
# Programs below which a launch takes fewer tiles per program, then splits V finer.
MIN_PROGRAMS = 1024
_MIN_BLOCK_V = 4

_launch = CompiledLaunch(_conventional_kernel, volatile=("seed",))


def tile_config(element_bytes: int, K: int, V: int, granularity: int, programs_per_tile: int, on_gpu: bool,
                dtype_code=None):
    """``(BLOCK_V, BLOCK_K, num_warps)``; ``programs_per_tile``: batch · HV; ``dtype_code``: the
    format's, for ``TILE_ROWS_BY_DTYPE`` (None: by bytes only)."""
    block_k = max(32, sizes.next_power_of_2(K))
    rows, warps = _TILE_ROWS[element_bytes]
    if dtype_code in TILE_ROWS_BY_DTYPE and granularity in (codec.GRAN_NONE, codec.GRAN_ROW):
        rows, warps = TILE_ROWS_BY_DTYPE[dtype_code]
    whole = sizes.next_power_of_2(V)
    if granularity == codec.GRAN_HEAD or not on_gpu:
        # Head scales need the whole head; the interpreter pays per program, not per byte.
        return whole, block_k, (8 if whole * block_k >= 8192 else 4)
    block_v = min(max(1, rows * 128 // block_k), whole)
    while block_v > _MIN_BLOCK_V and programs_per_tile * sizes.cdiv(V, block_v) < MIN_PROGRAMS:
        block_v //= 2
    return block_v, block_k, warps


@functools.lru_cache(maxsize=1024)
def _plan(element_bytes, K, V, num_v_heads, batch, device, dtype_code, granularity, stochastic, qmax, emax, channel,
          l2norm, has_slots, seed_from_ptr, out_bf16, has_flags, fused):
    """``(grid, constexprs)`` of a launch, a function of the call's metadata."""
    on_gpu = device.type == "cuda"
    block_v, block_k, warps = tile_config(element_bytes, K, V, granularity, batch * num_v_heads, on_gpu, dtype_code)
    v_loop = 1
    if on_gpu:
        v_loop = V_LOOP
        if v_loop is None:
            by_format = not stochastic and granularity in (codec.GRAN_NONE, codec.GRAN_ROW)
            v_loop = V_LOOP_BY_FORMAT.get((channel, dtype_code), 1) if by_format else 1
        v_loop = min(v_loop, sizes.cdiv(V, block_v))
        while v_loop > 1 and batch * num_v_heads * sizes.cdiv(V, block_v * v_loop) < MIN_PROGRAMS:
            v_loop //= 2
    elif INTERPRETER_SPLIT is not None and granularity != codec.GRAN_HEAD:
        block_v, v_loop = INTERPRETER_SPLIT
    constexprs = dict(DTYPE=dtype_code, GRAN=granularity, STOCHASTIC=stochastic, QMAX=qmax, EMAX=emax,
                      HW=codec.hardware_casts(device), CHANNEL=channel, L2NORM=l2norm, HAS_SLOTS=has_slots,
                      SEED_FROM_PTR=seed_from_ptr, OUT_BF16=out_bf16, HAS_FLAGS=has_flags,
                      FUSED=FUSED_ON_GPU and on_gpu if fused is None else fused, BLOCK_V=block_v, BLOCK_K=block_k,
                      V_LOOP=v_loop, num_warps=warps, **register_cap(REGISTER_CAP, device))
    return (sizes.cdiv(V, block_v * v_loop), num_v_heads, batch), constexprs


def launch(state, state_scale, q, k, v, g, beta, slot_indices, out, seed, seed_tensor, *, qk_scale: float,
           dtype_code: int, granularity: int, stochastic: bool, qmax: float, emax: int, use_qk_l2norm: bool,
           pad_slot_id: int, slot_flags=None, fused=None) -> None:
    """Launch the kernel on validated arguments.

    ``state``: the storage view (:func:`codec.storage_view`) ``(nslots, HV, V, K)``, unit K
    stride; ``state_scale`` fp32 shaped for the granularity (any tensor when unscaled);
    ``q, k (batch, HK, K)``, ``v, out (batch, HV, V)`` with unit inner stride; ``g (batch, HV)``
    or ``(batch, HV, K)`` (unit inner stride); ``beta (batch, HV)``; ``slot_indices (batch,)``
    int or None; ``seed_tensor``: a one-element device tensor read instead of ``seed``, or None;
    ``slot_flags``: int32 ``(nslots,)`` the kernel ORs ``SLOT_NONFINITE`` into, or None;
    ``fused``: the fused arithmetic of row and head scales (None: ``FUSED_ON_GPU`` on a GPU, off
    under the interpreter).
    """
    grid, args, constexprs = _arguments(state, state_scale, q, k, v, g, beta, slot_indices, out, seed, seed_tensor,
                                        qk_scale=qk_scale, dtype_code=dtype_code, granularity=granularity,
                                        stochastic=stochastic, qmax=qmax, emax=emax, use_qk_l2norm=use_qk_l2norm,
                                        pad_slot_id=pad_slot_id, slot_flags=slot_flags, fused=fused)
    _launch(grid, args, constexprs, state.is_cuda)


def prepare(leading, *args, **kwargs) -> Optional[PreparedLaunch]:
    """After ``launch(*args, **kwargs)``: that launch prepared for the op's dispatch entry
    (``kernels/common/launch.py``), or None where it cannot be (``CompiledLaunch.prepare``).
    ``leading``: what the op's repeat calls pass first, ``(state, state_scale or state, q, k, v,
    g, beta, slot_indices, out, slot_flags, seed_tensor, seed)``, each tensor the one given to
    the launcher or one it is a view of at the same address."""
    grid, launch_args, constexprs = _arguments(*args, **kwargs)
    return _launch.prepare(grid, launch_args, constexprs, leading, args[0].is_cuda)


def _arguments(state, state_scale, q, k, v, g, beta, slot_indices, out, seed, seed_tensor, *, qk_scale: float,
               dtype_code: int, granularity: int, stochastic: bool, qmax: float, emax: int, use_qk_l2norm: bool,
               pad_slot_id: int, slot_flags=None, fused=None) -> tuple:
    """``(grid, args, constexprs)`` of :func:`launch`."""
    batch, num_v_heads, V = v.shape
    nslots, _, _, K = state.shape
    channel = g.dim() == 3
    out_bf16 = out.dtype == torch.bfloat16
    grid, constexprs = _plan(state.element_size(), K, V, num_v_heads, batch, state.device, dtype_code, granularity,
                             stochastic, qmax, emax, channel, use_qk_l2norm, slot_indices is not None,
                             seed_tensor is not None, out_bf16, slot_flags is not None, fused)
    if granularity == codec.GRAN_HEAD:
        scale_strides = (*state_scale.stride()[:2], 0)
    elif granularity != codec.GRAN_NONE:
        scale_strides = state_scale.stride()[:3]
    else:
        scale_strides = (0, 0, 0)
    args = (state, state if state_scale is None else state_scale, q, k, v, g, beta, slot_indices,
            out.view(torch.int16) if out_bf16 else out, slot_flags, seed_tensor, seed, float(qk_scale), nslots,
            num_v_heads, K, V, num_v_heads // k.shape[1], pad_slot_id, *state.stride()[:3], *scale_strides,
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *g.stride()[:2], *beta.stride()[:2],
            *out.stride()[:2])
    return grid, args, constexprs
