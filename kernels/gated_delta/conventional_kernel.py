"""The conventional gated delta rule decode kernel; launched by :mod:`.conventional`, whose
docstring says what a program does."""

import triton
import triton.language as tl

from ..common import codec
from ..common.constants import GRAN_HEAD, GRAN_ROW
from ..common.slot_flags import flag_nonfinite
from . import tile


# seed: not specialized on its value, so that a fresh seed per call reuses the compiled kernel.
@triton.jit(do_not_specialize=["seed"])
def _conventional_kernel(
    state_ptr, scale_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, out_ptr, flags_ptr, seed_ptr, seed,
    qk_scale, nslots, num_v_heads, K, V, heads_per_group, pad_slot_id,
    s_state_slot, s_state_head, s_state_row, s_scale_slot, s_scale_head, s_scale_row,
    s_q_batch, s_q_head, s_k_batch, s_k_head, s_v_batch, s_v_head, s_g_batch, s_g_head,
    s_beta_batch, s_beta_head, s_out_batch, s_out_head,
    DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr, QMAX: tl.constexpr,
    EMAX: tl.constexpr, HW: tl.constexpr, CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
    HAS_SLOTS: tl.constexpr, SEED_FROM_PTR: tl.constexpr, OUT_BF16: tl.constexpr, HAS_FLAGS: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, V_LOOP: tl.constexpr,
):
    # FUSED (row and head scales, round to nearest): fewer, slightly less exact steps
    # (kernels/gated_delta/README.md#fused-path); GDN's decay joins the old scale.
    FUSED_CODEC: tl.constexpr = FUSED and (GRAN == GRAN_ROW or GRAN == GRAN_HEAD) and not STOCHASTIC
    FOLD_SCALE: tl.constexpr = FUSED_CODEC and not CHANNEL
    v_part = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    lanes = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    out_row = out_ptr + b * s_out_batch + h * s_out_head
    slot = tile.slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot == pad_slot_id) | (slot >= nslots):
        # Padding outputs zeros; an index past the state (unchecked on a GPU, to avoid a sync)
        # outputs NaN. Neither touches any slot.
        bad = tl.where((slot < 0) | (slot == pad_slot_id), 0.0, float("nan"))
        for chunk in range(V_LOOP):
            rows = (v_part * V_LOOP + chunk) * BLOCK_V + lanes
            tile.store_output(out_row, tl.zeros([BLOCK_V], tl.float32) + bad, rows, rows < V, OUT_BF16, HW)
    else:
        # What every tile of the program shares: the head's q̂, k̂ and gates.
        hk = h // heads_per_group
        q = tile.load_key(q_ptr + b * s_q_batch + hk * s_q_head, cols, K, L2NORM, HW) * qk_scale
        k = tile.load_key(k_ptr + b * s_k_batch + hk * s_k_head, cols, K, L2NORM, HW)
        alpha = tile.decay(g_ptr + b * s_g_batch + h * s_g_head, cols, K, CHANNEL)
        beta = tl.load(beta_ptr + b * s_beta_batch + h * s_beta_head).to(tl.float32)
        for chunk in range(V_LOOP):
            rows = (v_part * V_LOOP + chunk) * BLOCK_V + lanes
            _step_tile(state_ptr, scale_ptr, v_ptr, out_row, flags_ptr, seed_ptr, seed, rows, cols, q, k, alpha, beta,
                       b, h, slot, num_v_heads, K, V, s_state_slot, s_state_head, s_state_row, s_scale_slot,
                       s_scale_head, s_scale_row, s_v_batch, s_v_head, DTYPE, GRAN, STOCHASTIC, QMAX, EMAX, HW,
                       CHANNEL, SEED_FROM_PTR, OUT_BF16, HAS_FLAGS, FUSED_CODEC, FOLD_SCALE, BLOCK_V, BLOCK_K)


@triton.jit
def _step_tile(state_ptr, scale_ptr, v_ptr, out_row, flags_ptr, seed_ptr, seed, rows, cols, q, k, alpha, beta, b, h,
               slot, num_v_heads, K, V, s_state_slot, s_state_head, s_state_row, s_scale_slot, s_scale_head,
               s_scale_row, s_v_batch, s_v_head, DTYPE: tl.constexpr, GRAN: tl.constexpr, STOCHASTIC: tl.constexpr,
               QMAX: tl.constexpr, EMAX: tl.constexpr, HW: tl.constexpr, CHANNEL: tl.constexpr,
               SEED_FROM_PTR: tl.constexpr, OUT_BF16: tl.constexpr, HAS_FLAGS: tl.constexpr,
               FUSED_CODEC: tl.constexpr, FOLD_SCALE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_V, BLOCK_K]`` tile of the head: load, update, output, store."""
    row_mask = rows < V
    v = tl.load(v_ptr + b * s_v_batch + h * s_v_head + rows, mask=row_mask, other=0.0).to(tl.float32)
    head = slot * s_state_slot + h * s_state_head
    scale_head = slot * s_scale_slot + h * s_scale_head
    if FOLD_SCALE:
        codes, old_scale = tile.load_raw(state_ptr + head, scale_ptr + scale_head, rows, cols, row_mask, K,
                                         s_state_row, s_scale_row, GRAN, BLOCK_K)
        values = codec.decode(codes, DTYPE, HW)  # [BLOCK_V, BLOCK_K]
        factor = alpha * old_scale  # [BLOCK_V] row scales, a scalar head scale
        d = beta * (v - factor * tl.sum(values * k[None, :], axis=1))  # [BLOCK_V]
        if GRAN == GRAN_ROW:
            factor = factor[:, None]
        S = tl.fma(values, factor, d[:, None] * k[None, :])
    else:
        S = tile.load_tile(state_ptr + head, scale_ptr + scale_head, rows, cols, row_mask, K, s_state_row,
                           s_scale_row, DTYPE, GRAN, HW, BLOCK_V, BLOCK_K)  # [BLOCK_V, BLOCK_K]
        # The references' order: S·diag(α), then d = β(v − S k̂), then S + d k̂ᵀ.
        S = tile.apply_decay(S, alpha, CHANNEL)
        d = beta * (v - tl.sum(S * k[None, :], axis=1))  # [BLOCK_V]
        S = S + d[:, None] * k[None, :]
    o = tl.sum(S * q[None, :], axis=1)
    if HAS_FLAGS:
        # Every element of the new state reaches o (NaN·x and ±inf·0 are NaN).
        flag_nonfinite(flags_ptr, slot, o, row_mask)
    tile.store_output(out_row, o, rows, row_mask, OUT_BF16, HW)
    if FUSED_CODEC:
        tile.store_tile_fused(S, row_mask, state_ptr + head, scale_ptr + scale_head, rows, cols, s_state_row,
                              s_scale_row, K, DTYPE, GRAN, QMAX, EMAX, HW, BLOCK_V, BLOCK_K)
    else:
        if STOCHASTIC and SEED_FROM_PTR:
            seed = tl.load(seed_ptr)
        noise_rows = (slot * num_v_heads + h) * V + rows
        tile.store_tile(S, row_mask, state_ptr + head, scale_ptr + scale_head, rows, cols, s_state_row, s_scale_row,
                        noise_rows, seed, K, DTYPE, GRAN, STOCHASTIC, QMAX, EMAX, HW, BLOCK_V, BLOCK_K)
