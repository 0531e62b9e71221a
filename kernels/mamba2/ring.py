"""Jit pieces of the Mamba-2 kernels over replay state, shared by replay decode
(``replay_kernels``) and speculative decoding (``speculative_kernels``): a program's head and
P-tile, a row's slot, ``dt``, one head's state tile loaded and stored through the codec, and the
fold of a ring of tokens."""

import triton
import triton.language as tl

from ..common import codec, exact_dot
from ..common.constants import BF16, FP32, GRAN_BLOCK32, GRAN_HEAD, GRAN_NONE, GRAN_ROW, INT8
from ..common.softplus import softplus


@triton.jit
def agree_rows(sums, BLOCK_K: tl.constexpr, AGREE: tl.constexpr):
    """``sums`` ([R], a reduction over axis 1 of an [R, BLOCK_K] tile) as it is, or, with ``AGREE``,
    bit-identical in every lane that holds a row: the exact max over the row's replicas, in the
    reduction's own layout, before any layout conversion writes them to shared memory. A
    shuffle reduction may leave replicas rounded differently (triton-lang/triton#7264), which a
    conversion then writes to one shared address (a racecheck WAW). The max is one of the
    replicas' values: one summation order, as valid as any; under the interpreter a no-op."""
    if AGREE:
        sums = tl.max(tl.broadcast_to(sums[:, None], [sums.shape[0], BLOCK_K]), axis=1)
    return sums


@triton.jit
def agree_cols(sums, BLOCK_K: tl.constexpr, AGREE: tl.constexpr):
    """:func:`agree_rows` for ``sums`` [C] reduced over axis 0 of a [BLOCK_K, C] tile."""
    if AGREE:
        sums = tl.max(tl.broadcast_to(sums[None, :], [BLOCK_K, sums.shape[0]]), axis=0)
    return sums


@triton.jit
def agree_scalar(total, BLOCK_K: tl.constexpr, AGREE: tl.constexpr):
    """:func:`agree_rows` for a scalar reduced from a [BLOCK_K] tensor."""
    if AGREE:
        total = tl.max(tl.broadcast_to(total, [BLOCK_K]), axis=0)
    return total


@triton.jit
def head_tile(program, heads_per_group, headdim, dstate, NUM_P_TILES: tl.constexpr, BLOCK_P: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """Head, P-tile, group, rows, columns and their masks of a program numbered over
    (head × P-tile)."""
    h = program // NUM_P_TILES
    p_tile = program % NUM_P_TILES
    rows = p_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    return h, p_tile, h // heads_per_group, rows, cols, rows < headdim, cols < dstate


@triton.jit
def slot_of(slot_ptr, b, HAS_SLOTS: tl.constexpr):
    """The cache slot of batch row ``b`` (the row itself without slot indices)."""
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + b).to(tl.int32)
    else:
        slot = b
    return slot


@triton.jit
def process_dt(dt_ptr, dt_bias_ptr, h, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    dt = tl.load(dt_ptr).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    return dt


@triton.jit
def load_scaled_codes(codes_ptr, scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                      DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, AS_BF16: tl.constexpr = False):
    """One head's ``[BLOCK_P, BLOCK_N]`` tile as ``(values, row_scale)`` with ``code · scale =
    values · row_scale[:, None]``: a row or head scale is returned apart (``[BLOCK_P]``), so a
    dot over dstate multiplies by it once per row instead of once per element (the step and
    verify kernels are bound by instruction issue); block32 scales are applied to ``values``.
    Scales are loaded at their own granularity (a per-element gather costs as much as the codes).
    ``AS_BF16``: the values as :func:`exact_dot.bf16_codes` gives them (formats with
    ``exact_dot.exact_in_bf16``), for a tensor-core product."""
    head = slot.to(tl.int64) * nheads + h
    codes = tl.load(codes_ptr + head * headdim * dstate + rows[:, None] * dstate + cols[None, :], mask=mask, other=0)
    if AS_BF16:
        tl.static_assert(GRAN != GRAN_BLOCK32)
        values = exact_dot.bf16_codes(codes, DTYPE, HW)
    else:
        values = codec.decode(codes, DTYPE, HW)
    if GRAN == GRAN_ROW:
        row_scale = tl.load(scale_ptr + head * headdim + rows, mask=rows < headdim, other=1.0)
    elif GRAN == GRAN_HEAD:
        row_scale = tl.zeros([BLOCK_P], tl.float32) + tl.load(scale_ptr + head)
    else:
        row_scale = tl.full([BLOCK_P], 1.0, tl.float32)
    if GRAN == GRAN_BLOCK32:
        NB: tl.constexpr = BLOCK_N // 32
        blocks = tl.arange(0, NB)
        scale = tl.load(scale_ptr + (head * headdim + rows[:, None]) * (dstate // 32) + blocks[None, :],
                        mask=(rows[:, None] < headdim) & (blocks[None, :] < dstate // 32), other=1.0)
        values = tl.reshape(tl.reshape(values, [BLOCK_P, NB, 32]) * scale[:, :, None], [BLOCK_P, BLOCK_N])
    return values, row_scale


@triton.jit
def load_state(codes_ptr, scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
               DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
               BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 values ``code · scale`` of one head's ``[BLOCK_P, BLOCK_N]`` tile."""
    values, row_scale = load_scaled_codes(codes_ptr, scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                                          DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
    if GRAN == GRAN_ROW or GRAN == GRAN_HEAD:
        values = values * row_scale[:, None]
    return values


@triton.jit
def _grid_values(v, u, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The values of the codes ``codec.encode(v, u, ...)`` gives, in fp32 (v saturated and scaled)."""
    if STOCHASTIC:
        g = codec.round_sr(v, u, DTYPE)
    else:
        g = codec.round_rne(v, DTYPE)
    if DTYPE == INT8:
        g = tl.where(g == 0.0, 0.0, g)  # int8 has no −0: a code 0 decodes to +0
    return g


@triton.jit
def store_state(values, mask, codes_ptr, scale_ptr, seed, slot, h, rows, cols, nheads, headdim, dstate,
                DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr,
                EMAX: tl.constexpr, HW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Quantize one head's fp32 tile with the codec, store codes and scales, return ``code · scale``.

    The returned values are the grid values computed in fp32 (equal to the codes' values), not
    the codes decoded back: in the verify flush kernel the 8-bit code tensor read back in
    registers gave NaN or wrong values on the H200 (triton 3.6), though the same rounding in
    fp32 is exact on both the GPU and the interpreter (kernels/README.md, codec)."""
    base = (slot.to(tl.int64) * nheads + h) * headdim * dstate
    inner = rows[:, None] * dstate + cols[None, :]  # [BLOCK_P, BLOCK_N]
    if STOCHASTIC:
        # The conventional kernel's +sr noise (16 bits per element), keyed by the element's row
        # and octet; the slot and its generation are in the seed.
        noise = codec.row_noise8(seed, h * headdim + rows, dstate, BLOCK_N)  # [BLOCK_P, BLOCK_N]
        u = codec.uniform16(noise)
    else:
        u = 0.0
    if DTYPE == FP32:
        # fp32 stores the values as they are, as the reference does (formats.quantize): no
        # clamp to ±FLT_MAX, which was two instructions per element of the flush loop.
        codes = values
        stored = values
    elif GRAN == GRAN_NONE and STOCHASTIC and DTYPE == BF16:
        # bf16 rounds on the bits (codec.encode_sr16), and its codes are the top halves of fp32s.
        codes = codec.encode_sr16(values, 1.0, noise, QMAX, DTYPE, HW)
        stored = (codes.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif GRAN == GRAN_NONE:
        saturated = codec.saturate(values, QMAX)
        codes = codec.encode(saturated, u, DTYPE, STOCHASTIC, HW)
        stored = _grid_values(saturated, u, DTYPE, STOCHASTIC)
    else:
        head = slot.to(tl.int64) * nheads + h
        magnitude = tl.where(mask, tl.abs(values), 0.0)
        if GRAN == GRAN_ROW:
            scale = codec.scale_from_amax(tl.max(magnitude, axis=1), QMAX, EMAX, GRAN)  # [BLOCK_P]
            tl.store(scale_ptr + head * headdim + rows, scale, mask=rows < headdim)
            scale_tile = tl.broadcast_to(scale[:, None], [BLOCK_P, BLOCK_N])
        elif GRAN == GRAN_HEAD:
            scale = codec.scale_from_amax(tl.max(tl.max(magnitude, axis=1), axis=0), QMAX, EMAX, GRAN)
            tl.store(scale_ptr + head, scale)
            scale_tile = tl.full([BLOCK_P, BLOCK_N], 0.0, tl.float32) + scale
        else:
            NB: tl.constexpr = BLOCK_N // 32
            scale = codec.scale_from_amax(tl.max(tl.reshape(magnitude, [BLOCK_P, NB, 32]), axis=2), QMAX, EMAX, GRAN)
            blocks = tl.arange(0, NB)
            tl.store(scale_ptr + (head * headdim + rows[:, None]) * (dstate // 32) + blocks[None, :], scale,
                     mask=(rows[:, None] < headdim) & (blocks[None, :] < dstate // 32))
            scale_tile = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_P, NB, 32]), [BLOCK_P, BLOCK_N])
        v = codec.divide_rn(values, scale_tile, codec.reciprocal_rn(scale_tile), HW)
        codes = codec.encode_saturating(v, u, QMAX, DTYPE, STOCHASTIC, HW)
        # Where the caller drops the grid values (a read copy), this clamp compiles away.
        stored = _grid_values(codec.saturate(v, QMAX), u, DTYPE, STOCHASTIC) * scale_tile
    tl.store(codes_ptr + base + inner, codes, mask=mask)
    return stored


@triton.jit
def fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, count, A, rows, cols, mask_p, mask_n,
              headdim, dstate, CAP: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr,
              BLOCK_N: tl.constexpr, AGREE: tl.constexpr, CURRENT: tl.constexpr, x_cur, dt_cur, B_cur):
    """The ring's first ``count`` tokens folded over a zero state, ``Σ_j exp(A·(Λ − Λ_j))·dt_j ·
    x_j ⊗ B_j`` ([BLOCK_P, BLOCK_N] fp32), and ``Λ = Σ_j dt_j``. With ``CURRENT`` the last one,
    at ``count − 1``, is taken from registers (``x_cur`` [BLOCK_P], ``dt_cur``, ``B_cur``
    [BLOCK_N], fp32 of the values the ring holds) and not read: other programs of the same
    launch may be appending it. Same values, same order: the same bits as reading it.

    One ``[BLOCK_P, 16] × [16, BLOCK_N]`` product per 16 tokens ("ieee": fp32 products): a
    single product over a 32-token ring took every register and spilled, and one rank-1 update
    per token was slower on the H200 (replay flush step 1360 µs against 1221, batch 256). Only
    the chunks that hold tokens are multiplied (the products are FMAs, most of the kernel's
    instructions): a verify flush folds 13–20 tokens of a 32-token tile."""
    CHUNK: tl.constexpr = 16
    stored = count - 1 if CURRENT else count  # tokens read from the ring
    js = tl.arange(0, BLOCK_J)
    dts = tl.load(ring_dt_ptr + ring_head * CAP + js, mask=js < stored, other=0.0)
    if CURRENT:
        dts = tl.where(js == stored, dt_cur, dts)
    total = agree_scalar(tl.sum(dts, axis=0), BLOCK_J, AGREE)
    ring = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    before = total * 0.0  # Σ dt of the earlier chunks (an fp32 tensor, as the loop carries it)
    for c in range(0, tl.cdiv(count, CHUNK)):
        jc = c * CHUNK + tl.arange(0, CHUNK)
        live = jc < stored
        chunk_dts = tl.load(ring_dt_ptr + ring_head * CAP + jc, mask=live, other=0.0)  # [CHUNK]
        if CURRENT:
            chunk_dts = tl.where(jc == stored, dt_cur, chunk_dts)
        weights = tl.exp(A * (total - (before + tl.cumsum(chunk_dts, axis=0)))) * chunk_dts
        before += agree_scalar(tl.sum(chunk_dts, axis=0), CHUNK, AGREE)
        x_ring = tl.load(ring_x_ptr + (ring_head * CAP + jc[:, None]) * headdim + rows[None, :],
                         mask=live[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # [CHUNK, BLOCK_P]
        B_ring = tl.load(ring_B_ptr + (ring_group * CAP + jc[:, None]) * dstate + cols[None, :],
                         mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [CHUNK, BLOCK_N]
        if CURRENT:
            x_ring = tl.where((jc == stored)[:, None], x_cur[None, :], x_ring)
            B_ring = tl.where((jc == stored)[:, None], B_cur[None, :], B_ring)
        ring += tl.dot(tl.trans(weights[:, None] * x_ring), B_ring, input_precision="ieee")
    return ring, total
