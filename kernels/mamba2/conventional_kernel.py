"""The conventional Mamba-2 decode kernel and its jit helpers; launched by :mod:`.conventional`,
whose docstring says what a program does."""

import triton
import triton.language as tl

from ..common import codec, pdl
from ..common.constants import (BF16, FP32, FP8_E4M3, GRAN_BLOCK32, GRAN_HEAD, GRAN_NONE, GRAN_ROW, INT8,
                                SR_NOISE8, SR_UNIFORM, SR_UNIFORM4)
from ..common.softplus import softplus
from ..common.slot_flags import flag_nonfinite

# Output dtypes (constexpr ``OUT_DTYPE``): bf16 is stored as its bits (int16).
OUT_FP32 = tl.constexpr(0)
OUT_BF16 = tl.constexpr(1)
OUT_FP16 = tl.constexpr(2)


@triton.jit
def _load(pointers, mask, other):
    # mask None: an unmasked access (EVEN tiles), so nothing per element limits the vector width.
    if mask is None:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=mask, other=other)
    return values


@triton.jit
def _store(pointers, values, mask):
    if mask is None:
        tl.store(pointers, values)
    else:
        tl.store(pointers, values, mask=mask)


@triton.jit
def _and(mask, extra):
    if mask is None:
        combined = extra
    else:
        combined = mask & extra
    return combined


@triton.jit
def _store_output(out_ptr, y, batch_row, head, rows, mask, s_out_batch, s_out_head,
                  OUT_DTYPE: tl.constexpr, HW: tl.constexpr):
    out_rows = out_ptr + batch_row * s_out_batch + head * s_out_head + rows
    if OUT_DTYPE == OUT_BF16:
        tl.store(out_rows, codec.encode(y, 0.0, BF16, False, HW), mask=mask)
    else:
        tl.store(out_rows, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_head(
    state_ptr, scale_ptr, x_ptr, dt_ptr, z_ptr, slot, head, batch_row, rows, cols, row_mask,
    tile_mask, scale_mask, block_mask,
    s_state_slot, s_state_head, s_state_row, s_scale_slot, s_scale_head, s_scale_row,
    s_x_batch, s_x_head, s_dt_batch, s_dt_head, s_z_batch, s_z_head,
    GRAN: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The loads of one head, raw (codes, old scales, dt, x, z): nothing waits on them here, so
    loading the next head before updating this one overlaps the two."""
    state_tile = state_ptr + slot * s_state_slot + head * s_state_head + rows[:, None] * s_state_row + cols[None, :]
    codes = _load(state_tile, tile_mask, 0)  # [BLOCK_P, BLOCK_N]
    if GRAN != GRAN_NONE:
        scale_base = scale_ptr + slot * s_scale_slot + head * s_scale_head
    if GRAN == GRAN_ROW:
        old_scale = _load(scale_base + rows * s_scale_row, scale_mask, 0.0)  # [BLOCK_P]
    elif GRAN == GRAN_HEAD:
        old_scale = _load(scale_base + rows * 0, scale_mask, 0.0)  # [BLOCK_P], one value
    elif GRAN == GRAN_BLOCK32:
        block_ids = tl.arange(0, BLOCK_N // 32)
        old_scale = _load(scale_base + rows[:, None] * s_scale_row + block_ids[None, :], block_mask, 0.0)  # [BLOCK_P, NB]
    else:
        old_scale = tl.zeros([BLOCK_P], tl.float32)
    dt = tl.load(dt_ptr + batch_row * s_dt_batch + head * s_dt_head)
    x = tl.load(x_ptr + batch_row * s_x_batch + head * s_x_head + rows, mask=row_mask, other=0.0)
    if HAS_Z:
        z = tl.load(z_ptr + batch_row * s_z_batch + head * s_z_head + rows, mask=row_mask, other=0.0)
    else:
        z = tl.zeros([BLOCK_P], tl.float32)
    return codes, old_scale, dt, x, z


@triton.jit
def _update_head(
    codes, old_scale, dt, x, z, B, C, seed,
    state_ptr, scale_ptr, A_ptr, D_ptr, dt_bias_ptr, out_ptr, flags_ptr,
    slot, head, nheads, batch_row, headdim, dstate, rows, cols, row_mask, live_rows, is_padding,
    tile_mask, scale_mask, block_mask,
    s_state_slot, s_state_head, s_state_row, s_scale_slot, s_scale_head, s_scale_row, s_out_batch, s_out_head,
    DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr,
    EMAX: tl.constexpr, HW: tl.constexpr, FUSED: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, OUT_DTYPE: tl.constexpr, SR_STREAM: tl.constexpr, SR_ROUNDS: tl.constexpr,
    HAS_FLAGS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Dequantize, update, output, re-quantize and store one head's tile (loaded by _load_head)."""
    NB: tl.constexpr = BLOCK_N // 32
    # FUSED row and head scales: the old scale joins the decay in one factor per row (one
    # rounding fewer than the references' order, kernels/mamba2/README.md).
    FOLD_SCALE: tl.constexpr = FUSED and (GRAN == GRAN_ROW or GRAN == GRAN_HEAD)
    values = codec.decode(codes, DTYPE, HW)  # [BLOCK_P, BLOCK_N]
    if not FOLD_SCALE:
        if GRAN == GRAN_ROW or GRAN == GRAN_HEAD:
            values = values * old_scale[:, None]
        elif GRAN == GRAN_BLOCK32:
            values = values * tl.reshape(tl.broadcast_to(old_scale[:, :, None], [BLOCK_P, NB, 32]), [BLOCK_P, BLOCK_N])

    dt = dt.to(tl.float32)
    if HAS_BIAS:
        dt = dt + tl.load(dt_bias_ptr + head).to(tl.float32)
    if DT_SOFTPLUS:
        dt = softplus(dt)
    decay = tl.exp(dt * tl.load(A_ptr + head).to(tl.float32))
    x = x.to(tl.float32)

    if FOLD_SCALE:
        new_state = values * (decay * old_scale)[:, None] + (dt * x)[:, None] * B[None, :]  # [BLOCK_P, BLOCK_N]
    else:
        new_state = decay * values + (dt * x)[:, None] * B[None, :]  # [BLOCK_P, BLOCK_N]

    y = tl.sum(new_state * C[None, :], axis=1)  # [BLOCK_P]
    if HAS_D:
        y = y + tl.load(D_ptr + head).to(tl.float32) * x
    if HAS_Z:
        z = z.to(tl.float32)
        y = y * z * (1.0 / (1.0 + tl.exp(-z)))
    if HAS_FLAGS:
        # Every element of the new state reaches y (a NaN or ±inf times any C is non-finite).
        flag_nonfinite(flags_ptr, slot, y, live_rows)
    y = tl.where(live_rows, y, tl.where(is_padding, 0.0, float("nan")))
    _store_output(out_ptr, y, batch_row, head, rows, row_mask, s_out_batch, s_out_head, OUT_DTYPE, HW)

    if STOCHASTIC:
        element_rows = (slot * nheads + head) * headdim + rows  # [BLOCK_P]
        if SR_STREAM == SR_UNIFORM:
            u = codec.uniform(seed, (element_rows[:, None] * dstate + cols[None, :]).to(tl.int32))
        elif SR_STREAM == SR_UNIFORM4:
            quads = tl.arange(0, BLOCK_N // 4)
            counter = (element_rows[:, None] * ((dstate + 3) // 4) + quads[None, :]).to(tl.int32)
            u = codec.uniform4(seed, counter, SR_ROUNDS)  # [BLOCK_P, BLOCK_N]
        else:
            noise = codec.row_noise8(seed, element_rows, dstate, BLOCK_N, SR_ROUNDS)  # [BLOCK_P, BLOCK_N]
            u = codec.uniform16(noise)
    else:
        u = 0.0
    # 16-bit noise (codec.encode_sr16): bf16 on the bits exactly as the reference, int8 and fp8
    # within the FUSED path's license to differ in last bits.
    SR16: tl.constexpr = STOCHASTIC and SR_STREAM == SR_NOISE8 and (DTYPE == BF16 or (FOLD_SCALE and DTYPE >= FP8_E4M3))
    if GRAN != GRAN_NONE:
        scale_base = scale_ptr + slot * s_scale_slot + head * s_scale_head
    if DTYPE == FP32:
        codes = new_state
    elif SR16 and GRAN == GRAN_NONE:
        codes = codec.encode_sr16(new_state, 1.0, noise, QMAX, DTYPE, HW)
    elif GRAN == GRAN_NONE:
        codes = codec.encode_saturating(new_state, u, QMAX, DTYPE, STOCHASTIC, HW)
    else:
        magnitude = tl.abs(new_state)
        if FUSED and GRAN != GRAN_BLOCK32:
            if GRAN == GRAN_ROW:
                amax = tl.max(magnitude, axis=1)  # [BLOCK_P]
            else:
                amax = tl.max(tl.max(magnitude, axis=1), axis=0)
            scale, recip, unclamped = codec.scale_from_amax_fused(amax, QMAX, EMAX, HW)
            if GRAN == GRAN_ROW:
                _store(scale_base + rows * s_scale_row, scale, scale_mask)
                recip = recip[:, None]
            else:
                tl.store(scale_base + rows * 0, tl.zeros([BLOCK_P], tl.float32) + scale,
                         mask=_and(scale_mask, rows == 0))
            if SR16:
                codes = codec.encode_sr16(new_state, recip, noise, QMAX, DTYPE, HW)
            elif DTYPE == INT8 and not STOCHASTIC:
                # Below the scales' upper clamp every |S·recip| rounds to at most QMAX, so a tile
                # whose scales are all unclamped skips the per-element saturation.
                if GRAN == GRAN_ROW:
                    unclamped = tl.min(unclamped.to(tl.int32), axis=0) == 1
                if unclamped:
                    codes = codec.encode_product(new_state, recip, u, QMAX, DTYPE, STOCHASTIC, HW, False)
                else:
                    codes = codec.encode_product(new_state, recip, u, QMAX, DTYPE, STOCHASTIC, HW, True)
            else:
                codes = codec.encode_product(new_state, recip, u, QMAX, DTYPE, STOCHASTIC, HW, True)
        else:
            if GRAN == GRAN_ROW:
                scale = codec.scale_from_amax(tl.max(magnitude, axis=1), QMAX, EMAX, GRAN)  # [BLOCK_P]
                _store(scale_base + rows * s_scale_row, scale, scale_mask)
                scale_tile = scale[:, None]
            elif GRAN == GRAN_HEAD:
                scale = codec.scale_from_amax(tl.max(tl.max(magnitude, axis=1), axis=0), QMAX, EMAX, GRAN)
                tl.store(scale_base + rows * 0, tl.zeros([BLOCK_P], tl.float32) + scale,
                         mask=_and(scale_mask, rows == 0))
                scale_tile = scale
            else:
                scale = codec.scale_from_amax(tl.max(tl.reshape(magnitude, [BLOCK_P, NB, 32]), axis=2), QMAX, EMAX,
                                              GRAN)
                block_ids = tl.arange(0, NB)
                _store(scale_base + rows[:, None] * s_scale_row + block_ids[None, :], scale, block_mask)
                scale_tile = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_P, NB, 32]), [BLOCK_P, BLOCK_N])
            scaled = codec.divide_rn(new_state, scale_tile, codec.reciprocal_rn(scale_tile), HW)
            codes = codec.encode_saturating(scaled, u, QMAX, DTYPE, STOCHASTIC, HW)
    state_tile = state_ptr + slot * s_state_slot + head * s_state_head + rows[:, None] * s_state_row + cols[None, :]
    _store(state_tile, codes, tile_mask)


# seed: not specialized on its value, so that a fresh seed per call reuses the compiled kernel.
@triton.jit(do_not_specialize=["seed"])
def _conventional_kernel(
    state_ptr, scale_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr,
    slot_ptr, out_ptr, flags_ptr, seed_ptr, seed,
    nslots, headdim, dstate, heads_per_group, pad_slot_id,
    s_state_slot, s_state_head, s_state_row,
    s_scale_slot, s_scale_head, s_scale_row,
    s_x_batch, s_x_head, s_dt_batch, s_dt_head, s_B_batch, s_B_group, s_C_batch, s_C_group,
    s_z_batch, s_z_head, s_out_batch, s_out_head,
    DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr,
    EMAX: tl.constexpr, HW: tl.constexpr, FUSED: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SLOTS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, SEED_FROM_PTR: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr, HEADS_PER_PROG: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    SR_STREAM: tl.constexpr, SR_ROUNDS: tl.constexpr, HAS_FLAGS: tl.constexpr, PDL: tl.constexpr,
):
    pdl.grid_dependency(PDL)
    p_block = tl.program_id(0)
    head0 = tl.program_id(1) * HEADS_PER_PROG
    batch_row = tl.program_id(2)
    nheads = tl.num_programs(1) * HEADS_PER_PROG

    if HAS_SLOTS:
        slot = tl.load(slot_ptr + batch_row).to(tl.int64)
    else:
        slot = batch_row.to(tl.int64)
    rows = p_block * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    # The slot as a [BLOCK_P] vector: the interpreter rejects masks built from scalar compares.
    slot_rows = tl.zeros([BLOCK_P], tl.int64) + slot
    is_padding = (slot_rows < 0) | (slot_rows == pad_slot_id)  # [BLOCK_P]
    row_mask = rows < headdim
    live_rows = row_mask & (slot_rows >= 0) & (slot_rows != pad_slot_id) & (slot_rows < nslots)
    col_mask = cols < dstate

    # Heads of one program share a group (the launcher makes HEADS_PER_PROG divide heads_per_group).
    group = head0 // heads_per_group
    B = tl.load(B_ptr + batch_row * s_B_batch + group * s_B_group + cols, mask=col_mask, other=0.0).to(tl.float32)
    C = tl.load(C_ptr + batch_row * s_C_batch + group * s_C_group + cols, mask=col_mask, other=0.0).to(tl.float32)
    if STOCHASTIC and SEED_FROM_PTR:
        seed = tl.load(seed_ptr)

    if EVEN:
        # Whole tiles: no per-element masks. A padded or out-of-range row writes its output here
        # and skips the state work at program level instead.
        tile_mask = None
        scale_mask = None
        block_mask = None
        dead_rows = row_mask & ((slot_rows < 0) | (slot_rows == pad_slot_id) | (slot_rows >= nslots))
        for offset in tl.static_range(HEADS_PER_PROG):
            _store_output(out_ptr, tl.where(is_padding, 0.0, float("nan")), batch_row, head0 + offset, rows, dead_rows,
                          s_out_batch, s_out_head, OUT_DTYPE, HW)
        run = (slot >= 0) & (slot != pad_slot_id) & (slot < nslots)
    else:
        tile_mask = live_rows[:, None] & col_mask[None, :]  # [BLOCK_P, BLOCK_N]
        scale_mask = live_rows
        block_mask = live_rows[:, None] & (tl.arange(0, BLOCK_N // 32)[None, :] < dstate // 32)
        run = True

    if run:
        if HEADS_PER_PROG == 1 or not PREFETCH:
            for i in tl.range(0, HEADS_PER_PROG, num_stages=NUM_STAGES):
                head = head0 + i
                codes, old_scale, dt, x, z = _load_head(
                    state_ptr, scale_ptr, x_ptr, dt_ptr, z_ptr, slot, head, batch_row, rows, cols, row_mask,
                    tile_mask, scale_mask, block_mask, s_state_slot, s_state_head, s_state_row,
                    s_scale_slot, s_scale_head, s_scale_row, s_x_batch, s_x_head, s_dt_batch, s_dt_head,
                    s_z_batch, s_z_head, GRAN, HAS_Z, BLOCK_P, BLOCK_N)
                _update_head(
                    codes, old_scale, dt, x, z, B, C, seed, state_ptr, scale_ptr, A_ptr, D_ptr, dt_bias_ptr, out_ptr,
                    flags_ptr,
                    slot, head, nheads, batch_row, headdim, dstate, rows, cols, row_mask, live_rows, is_padding,
                    tile_mask, scale_mask, block_mask, s_state_slot, s_state_head, s_state_row,
                    s_scale_slot, s_scale_head, s_scale_row, s_out_batch, s_out_head,
                    DTYPE, GRAN, STOCHASTIC, QMAX, EMAX, HW, FUSED, HAS_D, HAS_Z, HAS_BIAS, DT_SOFTPLUS, OUT_DTYPE,
                    SR_STREAM, SR_ROUNDS, HAS_FLAGS, BLOCK_P, BLOCK_N)
        else:
            codes, old_scale, dt, x, z = _load_head(
                state_ptr, scale_ptr, x_ptr, dt_ptr, z_ptr, slot, head0, batch_row, rows, cols, row_mask,
                tile_mask, scale_mask, block_mask, s_state_slot, s_state_head, s_state_row,
                s_scale_slot, s_scale_head, s_scale_row, s_x_batch, s_x_head, s_dt_batch, s_dt_head,
                s_z_batch, s_z_head, GRAN, HAS_Z, BLOCK_P, BLOCK_N)
            for i in tl.range(0, HEADS_PER_PROG, num_stages=NUM_STAGES):
                # Issue the next head's loads before this head's update; after the last head the
                # state loads are masked off (the small loads re-read head0, in bounds).
                ahead = (tl.zeros([BLOCK_P], tl.int32) + i + 1) < HEADS_PER_PROG  # [BLOCK_P]
                next_codes, next_scale, next_dt, next_x, next_z = _load_head(
                    state_ptr, scale_ptr, x_ptr, dt_ptr, z_ptr, slot, head0 + (i + 1) % HEADS_PER_PROG, batch_row,
                    rows, cols, row_mask, _and(tile_mask, ahead[:, None]), _and(scale_mask, ahead),
                    _and(block_mask, ahead[:, None]), s_state_slot, s_state_head, s_state_row,
                    s_scale_slot, s_scale_head, s_scale_row, s_x_batch, s_x_head, s_dt_batch, s_dt_head,
                    s_z_batch, s_z_head, GRAN, HAS_Z, BLOCK_P, BLOCK_N)
                _update_head(
                    codes, old_scale, dt, x, z, B, C, seed, state_ptr, scale_ptr, A_ptr, D_ptr, dt_bias_ptr, out_ptr,
                    flags_ptr,
                    slot, head0 + i, nheads, batch_row, headdim, dstate, rows, cols, row_mask, live_rows, is_padding,
                    tile_mask, scale_mask, block_mask, s_state_slot, s_state_head, s_state_row,
                    s_scale_slot, s_scale_head, s_scale_row, s_out_batch, s_out_head,
                    DTYPE, GRAN, STOCHASTIC, QMAX, EMAX, HW, FUSED, HAS_D, HAS_Z, HAS_BIAS, DT_SOFTPLUS, OUT_DTYPE,
                    SR_STREAM, SR_ROUNDS, HAS_FLAGS, BLOCK_P, BLOCK_N)
                codes, old_scale, dt, x, z = next_codes, next_scale, next_dt, next_x, next_z
