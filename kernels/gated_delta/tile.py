"""Jit pieces shared by the gated delta rule kernels: a program's normalized query and key, its
gate, one head's ``[BLOCK_V, BLOCK_K]`` state tile loaded and stored through the codec, and a
row of outputs in the output's dtype.

A state is ``(slots, HV, V, K)`` with K contiguous: a tile is ``BLOCK_V`` rows of V by the whole
(padded) K, so row and block32 scales (over K) live inside one program; ``head`` scales need
``BLOCK_V >= V``."""

import triton
import triton.language as tl

from ..common import codec
from ..common.constants import BF16, FP32, GRAN_BLOCK32, GRAN_HEAD, GRAN_NONE, GRAN_ROW, INT8

# transformers' and fla's l2-norm epsilon (qstate.reference.gated_delta.L2_EPS).
L2_EPS: tl.constexpr = tl.constexpr(1e-6)
# Rounds of the Philox stream of +sr stores (the Mamba-2 kernels' 16-bit noise stream).
SR_ROUNDS: tl.constexpr = tl.constexpr(7)


def fold_tile(block_k: int, V: int, rows: int, warps: int, precision: str, on_gpu: bool,
              interpreter_rows) -> tuple:
    """``(BLOCK_V, num_warps, precision)`` of a program folding a ring into state rows (the replay
    flush and the speculative commit): on a GPU ``rows`` rows at K = 128 (at least 16, at most
    the padded V) on warps in proportion to the tile (a 64 × 128 tile on 8 warps faulted with an
    illegal address on an H100); under the interpreter the whole V (or ``interpreter_rows``) on
    4 warps in fp32."""
    whole = triton.next_power_of_2(V)
    if not on_gpu:
        return interpreter_rows or whole, 4, "ieee"
    block_v = max(16, min(rows * 128 // block_k, whole))
    return block_v, max(1, min(warps, block_v * block_k * warps // (rows * 128))), precision


@triton.jit
def slot_of(slot_ptr, b, HAS_SLOTS: tl.constexpr):
    """Batch row ``b``'s slot (int64): ``slot_indices[b]``, or ``b`` itself without them."""
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    return slot


@triton.jit
def slots_of(slot_ptr, batch_rows, batch, HAS_SLOTS: tl.constexpr):
    """A block of batch rows' slots (int64), as :func:`slot_of`; -1 (padding) past the batch."""
    in_batch = batch_rows < batch
    if HAS_SLOTS:
        slots = tl.load(slot_ptr + batch_rows, mask=in_batch, other=-1).to(tl.int64)
    else:
        slots = tl.where(in_batch, batch_rows, -1).to(tl.int64)
    return slots


@triton.jit
def l2_normalized(x, L2NORM: tl.constexpr, HW: tl.constexpr):
    """``x / sqrt(Σx² + eps)`` in fp32 with a correctly rounded root and quotient, as the
    reference computes it (``x`` fp32, padded with zeros). The quotient through one reciprocal
    (``codec.divide_rn``): a vector a tile broadcasts can hold 16 elements a thread."""
    if L2NORM:
        norm = tl.sqrt_rn(tl.sum(x * x, axis=0) + L2_EPS)
        x = codec.divide_rn(x, norm, codec.reciprocal_rn(norm), HW)
    return x


@triton.jit
def load_key_unnormalized(ptr, cols, K, L2NORM: tl.constexpr):
    """``(k [BLOCK_K], r)``: one key-head vector in fp32 as given and ``r = 1 / sqrt(Σk² + eps)``
    (1 without ``L2NORM``), so that ``k̂ = r k`` costs no quotient per element, for sums that take
    ``k̂`` only through products (one rounding more than :func:`load_key`'s)."""
    k = tl.load(ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    if L2NORM:
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(k * k, axis=0) + L2_EPS))
    else:
        r = 1.0
    return k, r


@triton.jit
def load_key(ptr, cols, K, L2NORM: tl.constexpr, HW: tl.constexpr):
    """One key-head vector ``[BLOCK_K]`` in fp32, normalized when ``L2NORM``; zero past K."""
    return l2_normalized(tl.load(ptr + cols, mask=cols < K, other=0.0).to(tl.float32), L2NORM, HW)


@triton.jit
def decay(g_ptr, cols, K, CHANNEL: tl.constexpr):
    """``α = exp(g)``: ``[BLOCK_K]`` per channel (KDA) or a scalar (GDN); 1 past K."""
    if CHANNEL:
        alpha = tl.exp(tl.load(g_ptr + cols, mask=cols < K, other=0.0).to(tl.float32))
    else:
        alpha = tl.exp(tl.load(g_ptr).to(tl.float32))
    return alpha


@triton.jit
def apply_decay(S, alpha, CHANNEL: tl.constexpr):
    if CHANNEL:
        S = S * alpha[None, :]
    else:
        S = S * alpha
    return S


@triton.jit
def load_tile(codes_ptr, scale_ptr, rows, cols, row_mask, K, s_row, s_scale_row,
              DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr, BLOCK_V: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """fp32 ``code · scale`` of one head's tile, zero outside ``row_mask`` and K (``codes_ptr``,
    ``scale_ptr``: the head's first element and scale; block32 scales are contiguous over K)."""
    codes, scale = load_raw(codes_ptr, scale_ptr, rows, cols, row_mask, K, s_row, s_scale_row, GRAN, BLOCK_K)
    return dequantize(codes, scale, DTYPE, GRAN, HW, BLOCK_V, BLOCK_K)


@triton.jit
def load_raw(codes_ptr, scale_ptr, rows, cols, row_mask, K, s_row, s_scale_row, GRAN: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """:func:`load_tile`'s loads alone, ``(codes, scales)``: nothing waits on them, so a caller
    can issue them ahead of other work (scales: ``[BLOCK_V]`` row, scalar head, ``[BLOCK_V,
    BLOCK_K // 32]`` block32, 1.0 unscaled)."""
    mask = row_mask[:, None] & (cols[None, :] < K)
    codes = tl.load(codes_ptr + rows[:, None] * s_row + cols[None, :], mask=mask, other=0)
    if GRAN == GRAN_ROW:
        scale = tl.load(scale_ptr + rows * s_scale_row, mask=row_mask, other=1.0)
    elif GRAN == GRAN_HEAD:
        scale = tl.load(scale_ptr)
    elif GRAN == GRAN_BLOCK32:
        blocks = tl.arange(0, BLOCK_K // 32)
        scale = tl.load(scale_ptr + rows[:, None] * s_scale_row + blocks[None, :],
                        mask=row_mask[:, None] & (blocks[None, :] < K // 32), other=1.0)
    else:
        scale = 1.0
    return codes, scale


@triton.jit
def output_base(read_ptr, read_scale_ptr, ck_ptr, ring_head, V, HAS_READ: tl.constexpr):
    """``(codes, scales, scale row stride)`` of the state a head's outputs read: its read copy's
    rows, or the checkpoint's (unscaled: the scale pointer is a placeholder)."""
    if HAS_READ:
        return read_ptr, read_scale_ptr + ring_head * V, 1
    else:
        return ck_ptr, ck_ptr, 0


@triton.jit
def stream_chunk(codes, scale, codes_ptr, scale_ptr, rows, cols, row_mask, more, K, V, s_scale_row,
                 DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr, PREFETCH: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """One chunk of a state stream over ``BLOCK_V`` rows: ``(rows dequantized, codes, scales)``.
    Without ``PREFETCH`` it loads the chunk's codes; with it, ``codes, scale`` are the chunk's
    (loaded a chunk ahead) and, while ``more`` chunks follow, the next chunk's come back."""
    if not PREFETCH:
        codes, scale = load_raw(codes_ptr, scale_ptr, rows, cols, row_mask, K, K, s_scale_row, GRAN, BLOCK_K)
    values = dequantize(codes, scale, DTYPE, GRAN, HW, BLOCK_V, BLOCK_K)
    if PREFETCH and more:
        next_rows = rows + BLOCK_V
        codes, scale = load_raw(codes_ptr, scale_ptr, next_rows, cols, next_rows < V, K, K, s_scale_row, GRAN,
                                BLOCK_K)
    return values, codes, scale


@triton.jit
def dequantize(codes, scale, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """fp32 ``code · scale`` of :func:`load_raw`'s codes and scales."""
    values = codec.decode(codes, DTYPE, HW)
    if GRAN == GRAN_ROW:
        values = values * scale[:, None]
    elif GRAN == GRAN_HEAD:
        values = values * scale
    elif GRAN == GRAN_BLOCK32:
        NB: tl.constexpr = BLOCK_K // 32
        values = tl.reshape(tl.reshape(values, [BLOCK_V, NB, 32]) * scale[:, :, None], [BLOCK_V, BLOCK_K])
    return values


@triton.jit
def _grid_values(v, DTYPE: tl.constexpr):
    """The values of the codes ``codec.encode(v, 0, ...)`` gives, in fp32 (v saturated and scaled)."""
    g = codec.round_rne(v, DTYPE)
    if DTYPE == INT8:
        g = tl.where(g == 0.0, 0.0, g)  # int8 has no −0: a code 0 decodes to +0
    return g


@triton.jit
def _store_scales(scale_ptr, scale, rows, row_mask, s_scale_row, GRAN: tl.constexpr, BLOCK_V: tl.constexpr):
    """A tile's row scales (``scale`` [BLOCK_V]) or its head's one scale (a scalar, stored by row 0)."""
    if GRAN == GRAN_ROW:
        tl.store(scale_ptr + rows * s_scale_row, scale, mask=row_mask)
    else:
        tl.store(scale_ptr + rows * 0, tl.zeros([BLOCK_V], tl.float32) + scale, mask=row_mask & (rows == 0))


@triton.jit
def store_tile(values, row_mask, codes_ptr, scale_ptr, rows, cols, s_row, s_scale_row, noise_rows, seed, K,
               DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr,
               EMAX: tl.constexpr, HW: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantize one head's fp32 tile in the references' order (``formats.quantize``), store codes
    and fresh scales, and return the stored values (``code · scale``, computed in fp32; the
    stochastic formats return nothing of use). ``noise_rows``: each row's index in the whole
    state (``(slot·HV + head)·V + row``), the counter of the +sr noise with the column's octet."""
    mask = row_mask[:, None] & (cols[None, :] < K)
    if STOCHASTIC:
        u = codec.uniform16(codec.row_noise8(seed, noise_rows, K, BLOCK_K, SR_ROUNDS))
    else:
        u = 0.0
    if DTYPE == FP32:
        codes = values
        stored = values
    elif GRAN == GRAN_NONE:
        codes = codec.encode_saturating(values, u, QMAX, DTYPE, STOCHASTIC, HW)
        stored = _grid_values(codec.saturate(values, QMAX), DTYPE)
    else:
        magnitude = tl.where(mask, tl.abs(values), 0.0)
        if GRAN == GRAN_ROW:
            scale = codec.scale_from_amax(tl.max(magnitude, axis=1), QMAX, EMAX, GRAN)  # [BLOCK_V]
            _store_scales(scale_ptr, scale, rows, row_mask, s_scale_row, GRAN, BLOCK_V)
            scale_tile = tl.broadcast_to(scale[:, None], [BLOCK_V, BLOCK_K])
        elif GRAN == GRAN_HEAD:
            scale = codec.scale_from_amax(tl.max(tl.max(magnitude, axis=1), axis=0), QMAX, EMAX, GRAN)
            _store_scales(scale_ptr, scale, rows, row_mask, s_scale_row, GRAN, BLOCK_V)
            scale_tile = tl.zeros([BLOCK_V, BLOCK_K], tl.float32) + scale
        else:
            NB: tl.constexpr = BLOCK_K // 32
            scale = codec.scale_from_amax(tl.max(tl.reshape(magnitude, [BLOCK_V, NB, 32]), axis=2), QMAX, EMAX, GRAN)
            blocks = tl.arange(0, NB)
            tl.store(scale_ptr + rows[:, None] * s_scale_row + blocks[None, :], scale,
                     mask=row_mask[:, None] & (blocks[None, :] < K // 32))
            scale_tile = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_V, NB, 32]), [BLOCK_V, BLOCK_K])
        scaled = codec.divide_rn(values, scale_tile, codec.reciprocal_rn(scale_tile), HW)
        codes = codec.encode_saturating(scaled, u, QMAX, DTYPE, STOCHASTIC, HW)
        stored = _grid_values(codec.saturate(scaled, QMAX), DTYPE) * scale_tile
    tl.store(codes_ptr + rows[:, None] * s_row + cols[None, :], codes, mask=mask)
    return stored


@triton.jit
def store_tile_fused(values, row_mask, codes_ptr, scale_ptr, rows, cols, s_row, s_scale_row, K,
                     DTYPE: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr, EMAX: tl.constexpr,
                     HW: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`store_tile` for 8-bit row or head scales with round to nearest, in fewer steps:
    ``scale = amax · RN(1/QMAX)``, its approximate reciprocal, codes from ``values · recip``
    rounded once (``codec.encode_product``; int8 skips the clamp where no scale of the tile
    reached its upper bound). A code can land one grid step from :func:`store_tile`'s where the
    quotient lies within an ulp of a rounding boundary. ``values`` must be zero outside
    ``row_mask`` and K (the conventional step's are: codes load as 0 there, q̂ and k̂ are 0 past K)."""
    mask = row_mask[:, None] & (cols[None, :] < K)
    magnitude = tl.abs(values)
    if GRAN == GRAN_ROW:
        amax = tl.max(magnitude, axis=1)  # [BLOCK_V]
    else:
        amax = tl.max(tl.max(magnitude, axis=1), axis=0)
    scale, recip, unclamped = codec.scale_from_amax_fused(amax, QMAX, EMAX, HW)
    _store_scales(scale_ptr, scale, rows, row_mask, s_scale_row, GRAN, BLOCK_V)
    if GRAN == GRAN_ROW:
        recip = recip[:, None]
        unclamped = tl.min(unclamped.to(tl.int32), axis=0) == 1
    if DTYPE == INT8:
        # Below the scales' upper bound every |values · recip| rounds to at most QMAX.
        if unclamped:
            codes = codec.encode_product(values, recip, 0.0, QMAX, DTYPE, False, HW, False)
        else:
            codes = codec.encode_product(values, recip, 0.0, QMAX, DTYPE, False, HW, True)
    else:
        codes = codec.encode_product(values, recip, 0.0, QMAX, DTYPE, False, HW, True)
    tl.store(codes_ptr + rows[:, None] * s_row + cols[None, :], codes, mask=mask)


@triton.jit
def store_output(out_ptr, o, rows, mask, OUT_BF16: tl.constexpr, HW: tl.constexpr):
    """A row of outputs; bf16 goes through the codec as bits (``out_ptr`` an int16 view): the
    interpreter's own fp32 → bf16 cast does not round to nearest."""
    if OUT_BF16:
        tl.store(out_ptr + rows, codec.encode(o, 0.0, BF16, False, HW), mask=mask)
    else:
        tl.store(out_ptr + rows, o.to(out_ptr.dtype.element_ty), mask=mask)
