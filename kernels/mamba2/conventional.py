"""Conventional Mamba-2 decode step over any state format: what a program of the kernel
(:mod:`.conventional_kernel`) does, and its launcher.

One program owns a ``[BLOCK_P, BLOCK_N]`` tile of one (row of the batch, head): ``BLOCK_P``
rows of headdim by the whole (padded) dstate, so row and block32 scales are computed inside the
program; ``head`` scales need the whole head, so that granularity takes ``BLOCK_P ≥ headdim``.
Grid ``(cdiv(headdim, BLOCK_P), nheads, batch)``.

Per tile: load codes and scales, dequantize (``code · scale``), update in fp32
(``a·S + (dt·x) ⊗ B``, the references' order), output from the unrounded state, re-quantize
with :mod:`.codec` and store codes and scales in place. ``FUSED`` (the GPU's default) reorders
row and head scales' arithmetic for fewer instructions, within an ulp of that order
(kernels/mamba2/README.md). A row whose slot index is negative or
``pad_slot_id`` outputs zeros and touches no slot; an index ``≥ nslots`` (rejected on the host
for CPU tensors) outputs NaN and touches no slot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

from ..common import codec, pdl, sizes
from ..common.launch import CompiledLaunch, PreparedLaunch, register_cap
from . import conventional_kernel
from .conventional_kernel import _conventional_kernel

OUT_FP32 = conventional_kernel.OUT_FP32.value
OUT_BF16 = conventional_kernel.OUT_BF16.value
OUT_FP16 = conventional_kernel.OUT_FP16.value



@dataclasses.dataclass(frozen=True)
class Variant:
    """Code-path choices of the kernel (kernels/mamba2/README.md), timed by ``bench.run_gpu --sweep``.

    ``even``: unmasked state tiles when ``headdim % BLOCK_P == 0`` and ``dstate == BLOCK_N``
    (else ignored). ``heads_per_prog``: heads of one group per program, a loop (reduced to the
    largest power of two dividing heads_per_group). ``num_stages``: the compiler's software
    pipelining of that loop. ``prefetch``: load the next head before updating this one.
    ``sr_stream``: ``codec.SR_UNIFORM`` = one Philox draw per element (:func:`codec.uniform`),
    ``SR_UNIFORM4`` = one per four (:func:`codec.uniform4`), ``SR_NOISE8`` = one per eight
    (:func:`codec.noise8`, 16-bit noise); each a different noise stream, with ``sr_rounds``
    Philox rounds for the last two.
    """

    even: bool = False
    heads_per_prog: int = 1
    num_stages: int = 1
    prefetch: bool = False
    sr_stream: int = codec.SR_UNIFORM
    sr_rounds: int = 10


# Tuning constants below: the fastest in H200 sweeps (figures in kernels/mamba2/README.md).

# The variant the launcher runs, by (state bytes per element, stochastic rounding); the +sr
# formats draw the SR_NOISE8 stream.
_SR16 = dict(sr_stream=codec.SR_NOISE8, sr_rounds=7)
DEFAULT_VARIANTS = {
    (4, False): Variant(),
    (2, False): Variant(even=True, heads_per_prog=2, prefetch=True),
    (1, False): Variant(),
    (2, True): Variant(**_SR16),
    (1, True): Variant(**_SR16),
}


# (rows of headdim at dstate 128, warps) of a tile by state bytes per element: block32 and head
# scales, the interpreter and the drafts kernel.
_TILE_ROWS = {4: (16, 2), 2: (16, 2), 1: (32, 2)}
_TILE_ROWS_SR = {4: (16, 4), 2: (64, 8), 1: (32, 4)}
# The same for this kernel's GPU launches of unscaled and row-scaled formats, by (dtype code,
# stochastic): fewer instructions per element pay for more elements per thread.
_TILE_ROWS_BY_DTYPE = {
    (codec.INT8, False): (16, 1), (codec.FP8_E4M3, False): (32, 1), (codec.FP8_E5M2, False): (32, 1),
    (codec.INT8, True): (32, 2), (codec.FP8_E4M3, True): (16, 1),
    (codec.FP32, False): (16, 1), (codec.FP16, False): (16, 1), (codec.BF16, False): (16, 1),
    (codec.FP16, True): (16, 2), (codec.BF16, True): (8, 1),
}


# Register caps (ptxas .maxnreg) of those GPU launches; absent: ptxas's choice, which a cap can
# make slower (ptxas spends what it is allowed). HEAD_LOOP_CONFIGS carry their own.
REGISTER_CAPS = {(codec.BF16, True): 96}


def tile_config(element_bytes: int, headdim: int, dstate: int, granularity: int, batch: int, nheads: int,
                on_gpu: bool = True, stochastic: bool = False, dtype=None):
    """(BLOCK_P, BLOCK_N, num_warps) for a state of ``element_bytes`` per element; ``dtype``:
    the format's dtype code for this kernel's GPU launches (None: the tables by bytes)."""
    block_n = max(32, sizes.next_power_of_2(dstate))
    rows, warps = (_TILE_ROWS_SR if stochastic else _TILE_ROWS)[element_bytes]
    if (dtype, stochastic) in _TILE_ROWS_BY_DTYPE and granularity in (codec.GRAN_NONE, codec.GRAN_ROW):
        rows, warps = _TILE_ROWS_BY_DTYPE[(dtype, stochastic)]
    if granularity == codec.GRAN_HEAD:
        block_p = sizes.next_power_of_2(headdim)
        return block_p, block_n, (8 if block_p * block_n >= 8192 else 4)
    block_p = min(max(1, rows * 128 // block_n), sizes.next_power_of_2(headdim))
    if not on_gpu:
        # The interpreter pays per program, not per byte: one program per head.
        return sizes.next_power_of_2(headdim), block_n, warps
    # A small batch still needs a grid that fills the GPU: split headdim finer.
    while block_p > 4 and batch * nheads * sizes.cdiv(headdim, block_p) < 1024:
        block_p //= 2
    return block_p, block_n, warps


# GPU programs looping over heads of one group (B, C, slot loaded once), by (dtype code, stochastic):
# (rows, warps, Variant, register cap or None), from HEAD_LOOP_MIN_PROGRAMS programs up.
HEAD_LOOP_CONFIGS = {
    (codec.INT8, False): (32, 1, Variant(even=True, heads_per_prog=16, prefetch=True), None),
    (codec.INT8, True): (16, 1, Variant(even=True, heads_per_prog=4, **_SR16), 128),
    (codec.BF16, True): (8, 1, Variant(even=True, heads_per_prog=4, **_SR16), 128),
    (codec.FP16, True): (8, 1, Variant(even=True, heads_per_prog=4, prefetch=True, **_SR16), 128),
}
HEAD_LOOP_MIN_PROGRAMS = 1024


def launch_config(element_bytes: int, headdim: int, dstate: int, granularity: int, batch: int, nheads: int,
                  heads_per_group: int, on_gpu: bool = True, stochastic: bool = False, dtype=None):
    """(BLOCK_P, BLOCK_N, num_warps, Variant, register cap or None) the launcher runs:
    :func:`tile_config`'s tile, ``DEFAULT_VARIANTS``' variant and ``REGISTER_CAPS``' cap, or a
    ``HEAD_LOOP_CONFIGS`` entry where it applies."""
    block_p, block_n, num_warps = tile_config(element_bytes, headdim, dstate, granularity, batch, nheads, on_gpu,
                                              stochastic, dtype)
    variant = DEFAULT_VARIANTS[(element_bytes, stochastic)]
    by_dtype = on_gpu and granularity in (codec.GRAN_NONE, codec.GRAN_ROW)
    maxnreg = REGISTER_CAPS.get((dtype, stochastic)) if by_dtype else None
    loop = HEAD_LOOP_CONFIGS.get((dtype, stochastic))
    if by_dtype and loop is not None:
        rows, loop_warps, loop_variant, loop_maxnreg = loop
        loop_p = min(max(1, rows * 128 // block_n), sizes.next_power_of_2(headdim))
        heads_per_prog = math.gcd(loop_variant.heads_per_prog, heads_per_group)
        if batch * (nheads // heads_per_prog) * sizes.cdiv(headdim, loop_p) >= HEAD_LOOP_MIN_PROGRAMS:
            block_p, num_warps, variant, maxnreg = loop_p, loop_warps, loop_variant, loop_maxnreg
    return block_p, block_n, num_warps, variant, maxnreg


# Eager GPU launches through the compiled kernel (common/launch.py).
_launch = CompiledLaunch(_conventional_kernel, volatile=("seed",))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a launch takes besides the tensors and their strides: the grid and the constexprs."""

    grid: tuple
    constexprs: dict


@functools.lru_cache(maxsize=1024)
def _plan(element_bytes, nheads, headdim, dstate, batch, heads_per_group, device, dtype_code, granularity,
          stochastic, qmax, emax, dt_softplus, out_code, has_d, has_z, has_bias, has_slots, has_seed_tensor,
          block_p, num_warps, variant, fused, maxnreg, has_flags=False) -> _Plan:
    """Tile, variant, grid and constexprs of a launch: a function of the call's metadata, so an
    eager caller computes it once per signature."""
    on_gpu = device.type == "cuda"
    fused = on_gpu if fused is None else fused
    config_p, block_n, warps, config_variant, config_maxnreg = launch_config(
        element_bytes, headdim, dstate, granularity, batch, nheads, heads_per_group, on_gpu, stochastic,
        dtype_code if on_gpu else None)
    if maxnreg is None and block_p is None and num_warps is None and variant is None:
        maxnreg = config_maxnreg
    block_p = block_p or config_p
    if granularity == codec.GRAN_HEAD:
        # One scale per head: a tile must hold the whole head whatever a caller asks for (a
        # 16-row override gave wrong codes on the H200).
        block_p = max(block_p, sizes.next_power_of_2(headdim))
    variant = variant or config_variant
    heads_per_prog = math.gcd(variant.heads_per_prog, heads_per_group)
    use_pdl = pdl.enabled(device)
    constexprs = dict(
        DTYPE=dtype_code, GRAN=granularity, STOCHASTIC=stochastic, QMAX=qmax, EMAX=emax,
        HW=codec.hardware_casts(device), FUSED=fused, HAS_D=has_d, HAS_Z=has_z, HAS_BIAS=has_bias,
        HAS_SLOTS=has_slots, DT_SOFTPLUS=dt_softplus, SEED_FROM_PTR=has_seed_tensor, OUT_DTYPE=out_code,
        BLOCK_P=block_p, BLOCK_N=block_n, EVEN=variant.even and headdim % block_p == 0 and dstate == block_n,
        HEADS_PER_PROG=heads_per_prog, NUM_STAGES=variant.num_stages, PREFETCH=variant.prefetch,
        SR_STREAM=variant.sr_stream, SR_ROUNDS=variant.sr_rounds, HAS_FLAGS=has_flags, PDL=use_pdl, num_warps=num_warps or warps,
        **pdl.launch_options(use_pdl), **register_cap(maxnreg, device),
    )
    return _Plan((sizes.cdiv(headdim, block_p), nheads // heads_per_prog, batch), constexprs)


_OUT_CODES = {torch.bfloat16: OUT_BF16, torch.float16: OUT_FP16}


def launch(
    state, state_scale, x, dt, A, B, C, D, z, dt_bias, slot_indices, out, seed, seed_tensor, *,
    dtype_code: int, granularity: int, stochastic: bool, qmax: float, emax: int,
    dt_softplus: bool, pad_slot_id: int, heads_per_group: int, block_p=None, num_warps=None, variant=None,
    fused=None, maxnreg=None, slot_flags=None,
):
    """Launch the kernel on validated compact arguments.

    ``state`` is the storage view (:func:`codec.storage_view`) ``(nslots, nheads, headdim,
    dstate)`` with unit dstate stride; ``state_scale`` fp32 shaped for the granularity (or any
    tensor when unscaled); ``x, z, out (batch, nheads, headdim)`` with unit inner stride;
    ``dt (batch, nheads)``; ``B, C (batch, ngroups, dstate)`` with unit inner stride;
    ``A, D, dt_bias (nheads,)`` contiguous; ``slot_indices (batch,)`` int or None.
    ``block_p``, ``num_warps``, ``variant``: overrides of :func:`launch_config`'s choice;
    ``maxnreg``: of :func:`launch_config`'s register cap (0: no cap), which applies to the default
    tile only.
    ``fused``: the fused arithmetic of row and head scales (default: on a GPU only).
    ``slot_flags``: int32 ``(nslots,)`` the kernel ORs ``SLOT_NONFINITE`` into, or None.
    """
    grid, args, constexprs = _kernel_call(
        state, state_scale, x, dt, A, B, C, D, z, dt_bias, slot_indices, out, seed, seed_tensor,
        dtype_code=dtype_code, granularity=granularity, stochastic=stochastic, qmax=qmax, emax=emax,
        dt_softplus=dt_softplus, pad_slot_id=pad_slot_id, heads_per_group=heads_per_group, block_p=block_p,
        num_warps=num_warps, variant=variant, fused=fused, maxnreg=maxnreg, slot_flags=slot_flags)
    _launch(grid, args, constexprs, state.is_cuda)


def prepare(leading, *args, **kwargs) -> Optional[PreparedLaunch]:
    """After ``launch(*args, **kwargs)``: that launch prepared for the op's dispatch entry
    (common/launch.py), or None where it cannot be (``CompiledLaunch.prepare``). ``leading``:
    what the op's repeat calls pass as the kernel's first arguments, ``(state, state_scale, x,
    dt, A, B, C, D, z, dt_bias, slot_indices, out, slot_flags, seed_tensor, seed)``, each the
    tensor given to ``launch`` or one it is a view of at the same address."""
    grid, kernel_args, constexprs = _kernel_call(*args, **kwargs)
    return _launch.prepare(grid, kernel_args, constexprs, leading, args[0].is_cuda)


def _kernel_call(
    state, state_scale, x, dt, A, B, C, D, z, dt_bias, slot_indices, out, seed, seed_tensor, *,
    dtype_code, granularity, stochastic, qmax, emax, dt_softplus, pad_slot_id, heads_per_group, block_p=None,
    num_warps=None, variant=None, fused=None, maxnreg=None, slot_flags=None,
):
    """``(grid, kernel arguments, constexprs)`` of :func:`launch`'s call."""
    batch, nheads, headdim = x.shape
    nslots, _, _, dstate = state.shape
    out_code = _OUT_CODES.get(out.dtype, OUT_FP32)
    plan = _plan(state.element_size(), nheads, headdim, dstate, batch, heads_per_group, state.device, dtype_code,
                 granularity, stochastic, qmax, emax, dt_softplus, out_code, D is not None, z is not None,
                 dt_bias is not None, slot_indices is not None, seed_tensor is not None, block_p, num_warps, variant,
                 fused, maxnreg, slot_flags is not None)
    state_strides = state.stride()
    if granularity == codec.GRAN_HEAD:
        scale_strides = (*state_scale.stride()[:2], 0)
    elif granularity != codec.GRAN_NONE:
        scale_strides = state_scale.stride()[:3]
    else:
        scale_strides = (0, 0, 0)
    x_strides, dt_strides, B_strides, C_strides = x.stride(), dt.stride(), B.stride(), C.stride()
    z_strides = z.stride() if z is not None else (0, 0)
    out_strides = out.stride()
    args = (
        state, state_scale, x, dt, A, B, C, D, z, dt_bias, slot_indices,
        out.view(torch.int16) if out_code == OUT_BF16 else out, slot_flags, seed_tensor, seed,
        nslots, headdim, dstate, heads_per_group, pad_slot_id,
        state_strides[0], state_strides[1], state_strides[2], *scale_strides,
        x_strides[0], x_strides[1], dt_strides[0], dt_strides[1], B_strides[0], B_strides[1], C_strides[0],
        C_strides[1], z_strides[0], z_strides[1], out_strides[0], out_strides[1],
    )
    return plan.grid, args, plan.constexprs
