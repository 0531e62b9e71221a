"""Quantize a ``(groups, headdim, dstate)`` fp32 tensor with the in-kernel codec alone.

It exists to check :mod:`qstate.kernels.codec` (its ``encode_saturating``, the encoder the
kernels use, and for bf16 with the 16-bit noise stream ``encode_sr16``) against
:mod:`qstate.formats` bit for bit
(tests under the interpreter, ``bench/run_gpu.py`` on the GPU, with and without the GPU's
conversion instructions). One program quantizes one group (head) as one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import codec, sizes
from .constants import BF16, FP32, GRAN_HEAD, GRAN_NONE, GRAN_ROW, SR_NOISE8, SR_UNIFORM, SR_UNIFORM4


@triton.jit
def _quantize_heads_kernel(
    x_ptr, codes_ptr, scale_ptr, noise_ptr, values_ptr, seed,
    headdim, dstate,
    DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr, EMAX: tl.constexpr,
    HW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SR_STREAM: tl.constexpr, SR_ROUNDS: tl.constexpr,
):
    head = tl.program_id(0)
    rows = tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < headdim) & (cols[None, :] < dstate)
    offsets = head * headdim * dstate + rows[:, None] * dstate + cols[None, :]  # [BLOCK_P, BLOCK_N]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if STOCHASTIC:
        if SR_STREAM == SR_UNIFORM:
            u = codec.uniform(seed, offsets)
        elif SR_STREAM == SR_UNIFORM4:
            quads = tl.arange(0, BLOCK_N // 4)
            counter = (head * headdim + rows[:, None]) * ((dstate + 3) // 4) + quads[None, :]  # [BLOCK_P, BLOCK_N // 4]
            u = codec.uniform4(seed, counter, SR_ROUNDS)
        else:
            noise = codec.row_noise8(seed, head * headdim + rows, dstate, BLOCK_N, SR_ROUNDS)
            u = codec.uniform16(noise)
        tl.store(noise_ptr + offsets, u, mask=mask)
    else:
        u = 0.0
    if DTYPE == FP32:
        codes = x
        values = x
    elif GRAN == GRAN_NONE:
        if STOCHASTIC and SR_STREAM == SR_NOISE8 and DTYPE == BF16:
            codes = codec.encode_sr16(x, 1.0, noise, QMAX, DTYPE, HW)  # as the conventional kernel does
        else:
            codes = codec.encode_saturating(x, u, QMAX, DTYPE, STOCHASTIC, HW)
        values = codec.decode(codes, DTYPE, HW)
    else:
        magnitude = tl.where(mask, tl.abs(x), 0.0)
        if GRAN == GRAN_ROW:
            scale = codec.scale_from_amax(tl.max(magnitude, axis=1), QMAX, EMAX, GRAN)  # [BLOCK_P]
            tl.store(scale_ptr + head * headdim + rows, scale, mask=rows < headdim)
            scale_tile = scale[:, None]
        elif GRAN == GRAN_HEAD:
            scale = codec.scale_from_amax(tl.max(tl.max(magnitude, axis=1), axis=0), QMAX, EMAX, GRAN)
            tl.store(scale_ptr + head, scale)
            scale_tile = scale
        else:
            NB: tl.constexpr = BLOCK_N // 32
            blocks = tl.reshape(magnitude, [BLOCK_P, NB, 32])
            scale = codec.scale_from_amax(tl.max(blocks, axis=2), QMAX, EMAX, GRAN)  # [BLOCK_P, NB]
            nblocks = dstate // 32
            block_ids = tl.arange(0, NB)
            block_offsets = head * headdim * nblocks + rows[:, None] * nblocks + block_ids[None, :]
            tl.store(scale_ptr + block_offsets, scale, mask=(rows[:, None] < headdim) & (block_ids[None, :] < nblocks))
            scale_tile = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_P, NB, 32]), [BLOCK_P, BLOCK_N])
        v = codec.divide_rn(x, scale_tile, codec.reciprocal_rn(scale_tile), HW)
        codes = codec.encode_saturating(v, u, QMAX, DTYPE, STOCHASTIC, HW)
        values = codec.decode(codes, DTYPE, HW) * scale_tile
    tl.store(codes_ptr + offsets, codes, mask=mask)
    tl.store(values_ptr + offsets, values, mask=mask)


def quantize_heads(x: torch.Tensor, fmt, *, seed: int = 0, hardware_casts=None, sr_stream: int = codec.SR_UNIFORM,
                   sr_rounds: int = 10):
    """Quantize fp32 ``x (groups, headdim, dstate)`` in ``fmt`` (a StateFormat) with the codec.

    Returns ``(codes, scale, noise, values)``: codes in ``fmt.storage_dtype``, scale shaped
    ``fmt.scale_shape(x.shape)`` (None if unscaled), the uniform noise used (None unless
    ``+sr``) and the dequantized values. ``hardware_casts`` defaults to the device's.
    ``sr_stream``/``sr_rounds``: the noise stream, as the conventional kernel's ``Variant`` names it
    (``SR_UNIFORM``: :func:`codec.uniform` keyed by the element's position; ``SR_UNIFORM4``:
    :func:`codec.uniform4` keyed by ``(group·headdim + row)·ceil(dstate/4) + col // 4``;
    ``SR_NOISE8``: :func:`codec.noise8` keyed by
    ``(group·headdim + row)·ceil(dstate/8) + col // 8``).
    """
    groups, headdim, dstate = x.shape
    x = x.contiguous().float()
    codes = torch.empty(x.shape, dtype=fmt.storage_dtype, device=x.device)
    scale_shape = fmt.scale_shape(x.shape)
    scale = torch.empty(scale_shape if scale_shape is not None else (1,), dtype=torch.float32, device=x.device)
    noise = torch.empty_like(x) if fmt.stochastic else torch.empty(1, device=x.device)
    values = torch.empty_like(x)
    hw = codec.hardware_casts(x.device) if hardware_casts is None else hardware_casts
    _quantize_heads_kernel[(groups,)](
        x, codec.storage_view(codes, fmt), scale, noise, values, seed, headdim, dstate,
        DTYPE=codec.dtype_code(fmt), GRAN=codec.granularity_code(fmt), STOCHASTIC=fmt.stochastic,
        QMAX=codec.qmax(fmt), EMAX=codec.emax(fmt), HW=hw, BLOCK_P=sizes.next_power_of_2(headdim),
        BLOCK_N=max(32, sizes.next_power_of_2(dstate)), SR_STREAM=sr_stream, SR_ROUNDS=sr_rounds,
    )
    return codes, (scale if scale_shape is not None else None), (noise if fmt.stochastic else None), values
