"""Replay decode kernels of the gated delta rule: the step kernel (normal rows' outputs and ring
appends) and the flush kernel (rows whose ring fills, and every row's cursor). Launched by
:mod:`.replay`, whose docstring says what each does."""

import triton
import triton.language as tl

from ..common import pdl
from ..common.constants import GRAN_NONE
from ..common.slot_flags import SLOT_BAD_CURSOR, cursor_outside, flag_nonfinite, flag_slot
from . import tile
from .ring import fold_operands, fold_rows, ring_token

# A row's step-time cursor when the row is padding, past the cache, or its cursor outside the ring.
NO_CURSOR = tl.constexpr(-1)


@triton.jit
def _sweep_token(T, P, c, b, positions, i, n, ring_k, ring_g, ring_beta, cols, K, L2NORM: tl.constexpr,
                 CHANNEL: tl.constexpr, KEEP_ROW: tl.constexpr):
    """``T`` carried back through the ring's ``i``-th newest token j (key as ``r k``, no quotient
    per element), its coefficient ``β_j k̂_j·T`` kept at its ring position in ``c``; with
    ``KEEP_ROW`` also ``B_nj = k̂_j·P`` in ``b`` and ``P`` decayed past j. Nothing past ``n``."""
    j = tl.maximum(n - 1 - i, 0)
    kj, rj, aj, bj = ring_token(ring_k, ring_g, ring_beta, j, cols, K, L2NORM, CHANNEL)
    c_j = bj * rj * tl.sum(kj * T, axis=0)  # β k̂·T, k̂ = r k
    live = (tl.zeros_like(cols) + i) < n
    T = tl.where(live, aj * (T - (c_j * rj) * kj), T)
    at_j = (positions == n - 1 - i) & (i < n)
    if KEEP_ROW:
        b = tl.where(at_j, rj * tl.sum(kj * P, axis=0), b)
        P = aj * P
    return T, P, tl.where(at_j, c_j, c), b


@triton.jit
def _sweep(q, k, alpha, beta, n, ring_k, ring_g, ring_beta, cols, K, L: tl.constexpr, L2NORM: tl.constexpr,
           CHANNEL: tl.constexpr, RING_PAD: tl.constexpr, KEEP_ROW: tl.constexpr):
    """The adjoint sweep of a normal row: ``T ← q̂`` carried back through the current token and
    the ring's ``n`` tokens, newest first, unrolled and masked past the cursor so every ring load
    issues up front. Returns ``T [BLOCK_K]``, each token's ``c [RING_PAD]`` by ring position
    (the current token's at ``n``) and, with ``KEEP_ROW``, the current token's row of ``B``
    (:func:`_inverse_row_terms`' ``b``, by ``P`` carried along the same tokens; else zeros)."""
    positions = tl.arange(0, RING_PAD)
    T = q
    c_now = beta * tl.sum(k * T, axis=0)
    T = alpha * (T - c_now * k)
    P = beta * alpha * k
    c = tl.where(positions == n, c_now, 0.0)
    b = tl.zeros([RING_PAD], tl.float32)
    for i in tl.static_range(L - 1):
        T, P, c, b = _sweep_token(T, P, c, b, positions, i, n, ring_k, ring_g, ring_beta, cols, K, L2NORM, CHANNEL,
                                  KEEP_ROW)
    return T, c, b


@triton.jit
def _inverse_row_terms(ring_k, ring_g, ring_beta, k, alpha, beta, n, positions, cols, K, L2NORM: tl.constexpr,
                       CHANNEL: tl.constexpr):
    """The current token's row of ``B`` by ring position: ``b_j = B_nj = k̂_j·P_j`` for j < n,
    ``P ← β_n α_n k̂_n`` decayed back token by token (``P_j = β_n e^{Γ_n − Γ_j} k̂_n``), in a
    loop that holds one key at a time."""
    P = beta * alpha * k
    b = tl.zeros_like(positions.to(tl.float32))
    for i in range(0, n):
        j = n - 1 - i
        kj, rj, aj, _ = ring_token(ring_k, ring_g, ring_beta, j, cols, K, L2NORM, CHANNEL)
        b = tl.where(positions == j, rj * tl.sum(kj * P, axis=0), b)
        P = aj * P
    return b


@triton.jit
def _keep_inverse_row(inverse_head, b, n, positions, L: tl.constexpr):
    """Row ``n`` of ``(I + B)⁻¹`` (the current token's) stored at ``inverse_head + n · L`` by
    forward substitution over the rows the earlier steps kept: ``e_n − Σ_{j<n} b_j row_j``."""
    kept = tl.load(inverse_head + positions[:, None] * L + positions[None, :],
                   mask=(positions < n)[:, None] & (positions < L)[None, :], other=0.0)  # [RING_PAD, RING_PAD]
    row = tl.where(positions == n, 1.0, 0.0) - tl.sum(b[:, None] * kept, axis=0)
    tl.store(inverse_head + n * L + positions, row, mask=positions < L)


@triton.jit
def _replay_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, out_ptr,
    ck_ptr, read_ptr, read_scale_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, ring_inverse_ptr, cursor_ptr,
    flags_ptr, row_cursor_ptr, qk_scale, num_slots, num_k_heads, num_v_heads, K, V, heads_per_group,
    s_q_batch, s_q_head, s_k_batch, s_k_head, s_v_batch, s_v_head, s_g_batch, s_g_head,
    s_beta_batch, s_beta_head, s_out_batch, s_out_head,
    L: tl.constexpr, RING_PAD: tl.constexpr, CK_DTYPE: tl.constexpr, HAS_READ: tl.constexpr,
    RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, HW: tl.constexpr, CHANNEL: tl.constexpr,
    L2NORM: tl.constexpr, HAS_SLOTS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, V_LOOP: tl.constexpr, PREFETCH: tl.constexpr, INVERSE_IN_SWEEP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.grid_dependency(PDL)
    v_part = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    lanes = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    out_row = out_ptr + b * s_out_batch + h * s_out_head
    slot = tile.slot_of(slot_ptr, b, HAS_SLOTS)
    in_cache = (slot >= 0) & (slot < num_slots)
    n = tl.load(cursor_ptr + slot, mask=in_cache, other=0)
    bad_cursor = in_cache & cursor_outside(n, L)
    if bad_cursor:
        # A cursor outside the ring (memory a caller wrote): flagged, and nothing of the slot written.
        flag_slot(flags_ptr, slot, SLOT_BAD_CURSOR)
    if (v_part == 0) & (h == 0):
        # The cursor as read, for the flush kernel (which moves it on); NO_CURSOR: leave the slot be.
        tl.store(row_cursor_ptr + b, tl.where(in_cache & ~bad_cursor, n, NO_CURSOR))
    if (~in_cache) | bad_cursor:
        # Padding outputs zeros; an index past the cache (unchecked on a GPU, to avoid a sync) and
        # a bad cursor output NaN. None touches any slot.
        bad = tl.where(slot < 0, 0.0, float("nan"))
        for chunk in range(V_LOOP):
            rows = (v_part * V_LOOP + chunk) * BLOCK_V + lanes
            tile.store_output(out_row, tl.zeros([BLOCK_V], tl.float32) + bad, rows, rows < V, OUT_BF16, HW)
    else:
        hk = h // heads_per_group
        k_raw = tl.load(k_ptr + b * s_k_batch + hk * s_k_head + cols, mask=cols < K, other=0.0)
        k = tile.l2_normalized(k_raw.to(tl.float32), L2NORM, HW)
        q = tile.load_key(q_ptr + b * s_q_batch + hk * s_q_head, cols, K, L2NORM, HW) * qk_scale
        g_row = g_ptr + b * s_g_batch + h * s_g_head
        alpha = tile.decay(g_row, cols, K, CHANNEL)
        beta = tl.load(beta_ptr + b * s_beta_batch + h * s_beta_head).to(tl.float32)
        v_row = v_ptr + b * s_v_batch + h * s_v_head
        ring_head = slot * num_v_heads + h
        ring_key = slot * num_k_heads + hk
        if CHANNEL:
            ring_g = ring_g_ptr + ring_head * L * K
        else:
            ring_g = ring_g_ptr + ring_head * L
        ring_v = ring_v_ptr + ring_head * L * V
        ring_beta = ring_beta_ptr + ring_head * L
        ring_k = ring_k_ptr + ring_key * L * K
        # Append the token: v by every program, g and β by the first, k by the group's first head.
        if v_part == 0:
            if CHANNEL:
                tl.store(ring_g + n * K + cols, tl.load(g_row + cols, mask=cols < K, other=0.0).to(tl.float32),
                         mask=cols < K)
            else:
                tl.store(ring_g + n, tl.load(g_row).to(tl.float32))
            tl.store(ring_beta + n, beta)
            if h % heads_per_group == 0:
                tl.store(ring_k + n * K + cols, k_raw.to(ring_k_ptr.dtype.element_ty), mask=cols < K)
        head = ring_head * V * K
        # A flushing row (n = L − 1) is the flush kernel's.
        if n < L - 1:
            # The adjoint sweep, once per program, gives T and each token's coefficient c; each
            # chunk of V then meets it with o = c·v summed over the ring plus the read copy's
            # (or checkpoint's) rows · T.
            base_codes, base_ptr, base_scale_ptr = tile.output_base(read_ptr, read_scale_ptr, ck_ptr, ring_head, V,
                                                                    HAS_READ)
            BASE_DTYPE: tl.constexpr = RD_DTYPE if HAS_READ else CK_DTYPE
            BASE_GRAN: tl.constexpr = RD_GRAN if HAS_READ else GRAN_NONE
            # PREFETCH: the first chunk's rows are loaded before the sweep, so they arrive while it
            # runs, and each chunk loads the next one's before its own sums.
            rows = v_part * V_LOOP * BLOCK_V + lanes
            codes, scale = tile.load_raw(base_codes + head, base_ptr, rows, cols, (rows < V) & PREFETCH, K, K,
                                         base_scale_ptr, BASE_GRAN, BLOCK_K)
            positions = tl.arange(0, RING_PAD)
            # KDA keeps the token's row of (I + B)⁻¹ for the flush (GDN's flush computes its inverse).
            KEEP_IN_SWEEP: tl.constexpr = CHANNEL and INVERSE_IN_SWEEP
            inverse_head = ring_inverse_ptr + ring_head * L * L
            if CHANNEL and (not INVERSE_IN_SWEEP):
                if v_part == 0:
                    b_row = _inverse_row_terms(ring_k, ring_g, ring_beta, k, alpha, beta, n, positions, cols, K,
                                               L2NORM, CHANNEL)
                    _keep_inverse_row(inverse_head, b_row, n, positions, L)
            T, c, b_row = _sweep(q, k, alpha, beta, n, ring_k, ring_g, ring_beta, cols, K, L, L2NORM, CHANNEL,
                                 RING_PAD, KEEP_IN_SWEEP)
            if KEEP_IN_SWEEP:
                if v_part == 0:
                    _keep_inverse_row(inverse_head, b_row, n, positions, L)
            c_now = tl.sum(tl.where(positions == n, c, 0.0), axis=0)
            for chunk in range(V_LOOP):
                rows = (v_part * V_LOOP + chunk) * BLOCK_V + lanes
                row_mask = rows < V
                base, codes, scale = tile.stream_chunk(codes, scale, base_codes + head, base_ptr, rows, cols, row_mask,
                                                       chunk + 1 < V_LOOP, K, V, base_scale_ptr, BASE_DTYPE, BASE_GRAN,
                                                       HW, PREFETCH, BLOCK_V, BLOCK_K)
                v_raw = tl.load(v_row + rows, mask=row_mask, other=0.0)
                tl.store(ring_v + n * V + rows, v_raw.to(ring_v_ptr.dtype.element_ty), mask=row_mask)
                ring_vs = tl.load(ring_v + positions[:, None] * V + rows[None, :],
                                  mask=(positions < n)[:, None] & row_mask[None, :], other=0.0)
                o = c_now * v_raw.to(tl.float32) + tl.sum(c[:, None] * ring_vs.to(tl.float32), axis=0)
                o = o + tl.sum(base * T[None, :], axis=1)
                flag_nonfinite(flags_ptr, slot, o, row_mask)
                tile.store_output(out_row, o, rows, row_mask, OUT_BF16, HW)


@triton.jit
def _flush_tile(b, slot, v_tile, h, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, ck_ptr, read_ptr, read_scale_ptr,
                ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, ring_inverse_ptr, flags_ptr, qk_scale, num_k_heads,
                num_v_heads, K, V, heads_per_group, s_q_batch, s_q_head, s_k_batch, s_k_head, s_v_batch, s_v_head,
                s_g_batch, s_g_head, s_beta_batch, s_beta_head, s_out_batch, s_out_head,
                L: tl.constexpr, M: tl.constexpr, CK_DTYPE: tl.constexpr, HAS_READ: tl.constexpr,
                RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr,
                CK_QMAX: tl.constexpr, HW: tl.constexpr, CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
                OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Batch row ``b`` (slot ``slot``, its ring full): ``BLOCK_V`` rows of value head ``h``
    folded, output, stored, the read copy rebuilt."""
    rows = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < V
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < K
    pos = tl.arange(0, M)
    in_ring = pos < L - 1
    now = pos == L - 1
    hk = h // heads_per_group
    ring_head = slot * num_v_heads + h
    ring_v = ring_v_ptr + ring_head * L * V
    # The tokens oldest first: the ring's L − 1, then the current one (as given, unrounded).
    k_now = tl.load(k_ptr + b * s_k_batch + hk * s_k_head + cols, mask=col_mask, other=0.0).to(tl.float32)
    keys = tl.load(ring_k_ptr + (slot * num_k_heads + hk) * L * K + pos[:, None] * K + cols[None, :],
                   mask=in_ring[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    keys = tl.where(now[:, None], k_now[None, :], keys)
    g_row = g_ptr + b * s_g_batch + h * s_g_head
    if CHANNEL:
        g_now = tl.load(g_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        g = tl.load(ring_g_ptr + ring_head * L * K + pos[:, None] * K + cols[None, :],
                    mask=in_ring[:, None] & col_mask[None, :], other=0.0)
        g = tl.where(now[:, None], g_now[None, :], g)
    else:
        g = tl.where(now, tl.load(g_row).to(tl.float32), tl.load(ring_g_ptr + ring_head * L + pos, mask=in_ring, other=0.0))
    beta_now = tl.load(beta_ptr + b * s_beta_batch + h * s_beta_head).to(tl.float32)
    beta = tl.where(now, beta_now, tl.load(ring_beta_ptr + ring_head * L + pos, mask=in_ring, other=0.0))
    v_now = tl.load(v_ptr + b * s_v_batch + h * s_v_head + rows, mask=row_mask, other=0.0)
    tl.store(ring_v + (L - 1) * V + rows, v_now.to(ring_v_ptr.dtype.element_ty), mask=row_mask)
    values = tl.load(ring_v + pos[None, :] * V + rows[:, None], mask=in_ring[None, :] & row_mask[:, None],
                     other=0.0).to(tl.float32)  # [BLOCK_V, M]
    values = tl.where(now[None, :], v_now.to(tl.float32)[:, None], values)
    if CHANNEL:
        # Rows 0 … L − 2 of (I + B)⁻¹, kept by the steps that appended their tokens.
        kept = tl.load(ring_inverse_ptr + ring_head * L * L + pos[:, None] * L + pos[None, :],
                       mask=in_ring[:, None] & (pos < L)[None, :], other=0.0)  # [M, M]
    else:
        kept = tl.zeros([M, M], tl.float32)
    key_in, key_out, inverse, beta, decay = fold_operands(keys, g, beta, kept, L, cols, K, L2NORM, CHANNEL, M,
                                                          PRECISION)
    head = ring_head * V * K
    S = tile.load_tile(ck_ptr + head, ck_ptr, rows, cols, row_mask, K, K, 0, CK_DTYPE, 0, HW, BLOCK_V, BLOCK_K)
    S = fold_rows(S, values, key_in, key_out, inverse, beta, decay, CHANNEL, PRECISION)
    q = tile.load_key(q_ptr + b * s_q_batch + hk * s_q_head, cols, K, L2NORM, HW) * qk_scale
    o = tl.sum(S * q[None, :], axis=1)
    # Every element of the new checkpoint reaches o (NaN·x and ±inf·0 are NaN).
    flag_nonfinite(flags_ptr, slot, o, row_mask)
    tile.store_output(out_ptr + b * s_out_batch + h * s_out_head, o, rows, row_mask, OUT_BF16, HW)
    stored = tile.store_tile(S, row_mask, ck_ptr + head, ck_ptr, rows, cols, K, 0, rows, 0, K, CK_DTYPE,
                             0, False, CK_QMAX, 0, HW, BLOCK_V, BLOCK_K)
    if HAS_READ:
        tile.store_tile(stored, row_mask, read_ptr + head, read_scale_ptr + ring_head * V, rows, cols, K,
                        1, rows, 0, K, RD_DTYPE, RD_GRAN, False, RD_QMAX, RD_EMAX, HW, BLOCK_V, BLOCK_K)


@triton.jit
def _replay_flush_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, out_ptr,
    ck_ptr, read_ptr, read_scale_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, ring_inverse_ptr, cursor_ptr,
    flags_ptr, row_cursor_ptr, qk_scale, num_slots, num_k_heads, num_v_heads, K, V, heads_per_group,
    s_q_batch, s_q_head, s_k_batch, s_k_head, s_v_batch, s_v_head, s_g_batch, s_g_head,
    s_beta_batch, s_beta_head, s_out_batch, s_out_head,
    L: tl.constexpr, M: tl.constexpr, CK_DTYPE: tl.constexpr, HAS_READ: tl.constexpr,
    RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr,
    CK_QMAX: tl.constexpr, HW: tl.constexpr, CHANNEL: tl.constexpr, L2NORM: tl.constexpr,
    HAS_SLOTS: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """The flushing rows (cursor ``L − 1``): the ring's ``L − 1`` tokens and the current one
    folded into ``BLOCK_V`` rows of the checkpoint, from the checkpoint itself, in matrix form
    (``ring.fold_rows``); the output of the new, unrounded state; the checkpoint stored and the
    read copy rebuilt from it. Every other row returns after two loads. The cursor comes from the
    step kernel's ``row_cursor``, so the row's first program can move the slot's cursor on to
    ``n + 1`` (0 after the flush) while the others still decide by it."""
    pdl.grid_dependency(PDL)
    b = tl.program_id(2)
    n = tl.load(row_cursor_ptr + b)
    slot = tile.slot_of(slot_ptr, b, HAS_SLOTS)
    if (n != NO_CURSOR) & (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(cursor_ptr + slot, tl.where(n + 1 == L, 0, n + 1))
    if n == L - 1:
        _flush_tile(b, slot, tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, ck_ptr,
                    read_ptr, read_scale_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, ring_inverse_ptr,
                    flags_ptr, qk_scale,
                    num_k_heads, num_v_heads, K, V, heads_per_group, s_q_batch, s_q_head, s_k_batch, s_k_head,
                    s_v_batch, s_v_head, s_g_batch, s_g_head, s_beta_batch, s_beta_head, s_out_batch, s_out_head,
                    L, M, CK_DTYPE, HAS_READ, RD_DTYPE, RD_GRAN, RD_QMAX, RD_EMAX, CK_QMAX, HW, CHANNEL, L2NORM,
                    OUT_BF16, BLOCK_V, BLOCK_K, PRECISION)
