"""Speculative decoding kernels of the gated delta rule: the verify's (``_verify_kernel``), the
commit's three (``_commit_list_kernel``,
``_commit_fold_kernel``, ``_commit_cursor_kernel``) and the per-draft-state baseline's
(``_drafts_kernel``). Launched by :mod:`.speculative`, whose docstring says what each does."""

import triton
import triton.language as tl

from ..common.constants import GRAN_NONE
from ..common.slot_flags import SLOT_BAD_CURSOR, cursor_outside, flag_nonfinite, flag_slot
from . import tile
from .ring import apply_token, fold_rows_streamed, ring_token, stage_fold_operands

# Bits of ``commit_errors`` the commit sets.
ERROR_NO_VERIFY = tl.constexpr(1)
ERROR_ACCEPTED_RANGE = tl.constexpr(2)


@triton.jit
def _store_unserved(out_row, offsets, mask, slot, OUT_BF16: tl.constexpr, HW: tl.constexpr):
    """Outputs of a row the kernel does not serve: zeros for padding (slot < 0), NaN for an index
    past the cache (unchecked on a GPU, to avoid a sync) or a cursor outside the ring."""
    bad = tl.where(slot < 0, 0.0, float("nan"))
    tile.store_output(out_row, tl.zeros(offsets.shape, tl.float32) + bad, offsets, mask, OUT_BF16, HW)


@triton.jit
def commit_decision(n, pending, accepted, ring_len, capacity):
    """A commit of ``accepted`` drafts on a slot with cursor ``n`` and ``pending`` drafts:
    ``(ok, flush, no_verify, out_of_range, bad_cursor)``. ``ok``: the commit moves the cursor;
    ``flush``: it also folds the ``n + accepted`` committed tokens (``ring_len`` or more)."""
    no_verify = pending == 0
    in_range = (accepted >= 0) & (accepted <= pending)
    out_of_range = ~no_verify & ~in_range
    bad_cursor = cursor_outside(n, ring_len) | (~no_verify & in_range & cursor_outside(n + accepted, capacity))
    ok = ~no_verify & in_range & ~bad_cursor
    return ok, ok & (n + accepted >= ring_len), no_verify, out_of_range, bad_cursor


@triton.jit
def _sweep_ring_token(Q, c_ring, ring_slots, i, n, ring_k, ring_g, ring_beta, cols, K, L2NORM: tl.constexpr,
                      CHANNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The adjoint sweeps ``Q [BLOCK_T, BLOCK_K]`` carried back through the ring's ``i``-th newest
    committed token, its coefficients kept in column ``i`` of ``c_ring``; nothing past ``n``."""
    j = tl.maximum(n - 1 - i, 0)
    kj, rj, aj, bj = ring_token(ring_k, ring_g, ring_beta, j, cols, K, L2NORM, CHANNEL)
    c = bj * rj * tl.sum(Q * kj[None, :], axis=1)  # β k̂·T, k̂ = r k
    used = (tl.zeros([BLOCK_T, BLOCK_K], tl.int32) + i) < n
    Q = tl.where(used, tile.apply_decay(Q - (c * rj)[:, None] * kj[None, :], aj, CHANNEL), Q)
    c_ring = tl.where((ring_slots[None, :] == i) & (ring_slots[None, :] < n), c[:, None], c_ring)
    return Q, c_ring


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, out_ptr,
    ck_ptr, read_ptr, read_scale_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr, ring_beta_ptr, cursor_ptr, drafts_ptr,
    slot_flags_ptr, qk_scale, num_slots, num_k_heads, num_v_heads, K, V, heads_per_group,
    s_q_b, s_q_t, s_q_h, s_k_b, s_k_t, s_k_h, s_v_b, s_v_t, s_v_h, s_g_b, s_g_t, s_g_h,
    s_beta_b, s_beta_t, s_beta_h, s_out_b, s_out_t, s_out_h,
    L: tl.constexpr, CAP: tl.constexpr, T: tl.constexpr, RING_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    CK_DTYPE: tl.constexpr, HAS_READ: tl.constexpr, RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr,
    HW: tl.constexpr, CHANNEL: tl.constexpr, L2NORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
    OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, V_LOOP: tl.constexpr,
    PREFETCH: tl.constexpr, SWEEP_GROUP: tl.constexpr,
):
    v_part = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    lanes = tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    ts = tl.arange(0, BLOCK_T)
    is_t = ts < T
    out_row = out_ptr + b * s_out_b + h * s_out_h
    slot = tile.slot_of(slot_ptr, b, HAS_SLOTS)
    live = (slot >= 0) & (slot < num_slots)
    n = tl.load(cursor_ptr + slot, mask=live, other=0)
    # Between rounds a cursor lies in [0, L): a commit flushes at L committed tokens.
    bad_cursor = live & cursor_outside(n, L)
    if (slot < 0) | (slot >= num_slots) | bad_cursor:
        if bad_cursor & (v_part == 0) & (h == 0):
            flag_slot(slot_flags_ptr, slot, SLOT_BAD_CURSOR)
        for chunk in range(V_LOOP):
            rows = (v_part * V_LOOP + chunk) * BLOCK_V + lanes
            _store_unserved(out_row, ts[:, None] * s_out_t + rows[None, :], is_t[:, None] & (rows < V)[None, :],
                            tl.where(bad_cursor, num_slots, slot), OUT_BF16, HW)
    else:
        hk = h // heads_per_group
        ring_head = slot * num_v_heads + h
        if CHANNEL:
            ring_g = ring_g_ptr + ring_head * CAP * K
        else:
            ring_g = ring_g_ptr + ring_head * CAP
        ring_v = ring_v_ptr + ring_head * CAP * V
        ring_beta = ring_beta_ptr + ring_head * CAP
        ring_k = ring_k_ptr + (slot * num_k_heads + hk) * CAP * K
        q_row = q_ptr + b * s_q_b + hk * s_q_h
        k_row = k_ptr + b * s_k_b + hk * s_k_h
        g_row = g_ptr + b * s_g_b + h * s_g_h
        beta_row = beta_ptr + b * s_beta_b + h * s_beta_h
        v_row = v_ptr + b * s_v_b + h * s_v_h
        head = ring_head * V * K
        base_codes, base_scale, base_scaled = tile.output_base(read_ptr, read_scale_ptr, ck_ptr, ring_head, V, HAS_READ)
        BASE_DTYPE: tl.constexpr = RD_DTYPE if HAS_READ else CK_DTYPE
        BASE_GRAN: tl.constexpr = RD_GRAN if HAS_READ else GRAN_NONE
        # PREFETCH: the first chunk's rows are loaded before the sweeps, so they arrive meanwhile.
        rows = v_part * V_LOOP * BLOCK_V + lanes
        codes, scale = tile.load_raw(base_codes + head, base_scale, rows, cols, (rows < V) & PREFETCH, K, K,
                                     base_scaled, BASE_GRAN, BLOCK_K)
        # The drafts join the ring past the committed tokens (positions n + t; no program of this
        # call reads them there): g and β by the head's first program, k by the key group's.
        if v_part == 0:
            key_tile = is_t[:, None] & (cols[None, :] < K)
            if CHANNEL:
                g_d = tl.load(g_row + ts[:, None] * s_g_t + cols[None, :], mask=key_tile, other=0.0)
                tl.store(ring_g + (n + ts[:, None]) * K + cols[None, :], g_d.to(tl.float32), mask=key_tile)
            else:
                g_d = tl.load(g_row + ts * s_g_t, mask=is_t, other=0.0)
                tl.store(ring_g + n + ts, g_d.to(tl.float32), mask=is_t)
            tl.store(ring_beta + n + ts, tl.load(beta_row + ts * s_beta_t, mask=is_t, other=0.0).to(tl.float32),
                     mask=is_t)
            if h % heads_per_group == 0:
                k_d = tl.load(k_row + ts[:, None] * s_k_t + cols[None, :], mask=key_tile, other=0.0)
                tl.store(ring_k + (n + ts[:, None]) * K + cols[None, :], k_d.to(ring_k_ptr.dtype.element_ty),
                         mask=key_tile)
            if h == 0:
                tl.store(drafts_ptr + slot, T)
        # The adjoint sweeps of all drafts at once: chain t (row t of Q) starts at q̂_t and is
        # carried back through drafts t … 0, then the ring newest first; c_draft[t, p] and
        # c_ring[t, i] keep each token's coefficient. A draft after t is selected away, not
        # weighted by 0: its inputs may be NaN or inf.
        Q = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for t in tl.static_range(T):
            q_t = tile.load_key(q_row + t * s_q_t, cols, K, L2NORM, HW) * qk_scale
            Q = tl.where(ts[:, None] == t, q_t[None, :], Q)
        c_draft = tl.zeros([BLOCK_T, BLOCK_T], tl.float32)
        for i in tl.static_range(T):
            p = T - 1 - i
            k_p, r_p = tile.load_key_unnormalized(k_row + p * s_k_t, cols, K, L2NORM)
            alpha_p = tile.decay(g_row + p * s_g_t, cols, K, CHANNEL)
            beta_p = tl.load(beta_row + p * s_beta_t).to(tl.float32)
            c = beta_p * r_p * tl.sum(Q * k_p[None, :], axis=1)  # β k̂·T, k̂ = r k
            sees = ts >= p
            Q = tl.where(sees[:, None], tile.apply_decay(Q - (c * r_p)[:, None] * k_p[None, :], alpha_p, CHANNEL), Q)
            c_draft = tl.where(sees[:, None] & (ts[None, :] == p), c[:, None], c_draft)
        # The ring's n committed tokens, SWEEP_GROUP at a time (a group's loads and key norms do not
        # wait on Q; masked past n); SWEEP_GROUP = 0 unrolls all L − 1 positions.
        ring_slots = tl.arange(0, RING_PAD)
        c_ring = tl.zeros([BLOCK_T, RING_PAD], tl.float32)
        if SWEEP_GROUP == 0:
            for i in tl.static_range(L - 1):
                Q, c_ring = _sweep_ring_token(Q, c_ring, ring_slots, i, n, ring_k, ring_g, ring_beta, cols, K,
                                              L2NORM, CHANNEL, BLOCK_T, BLOCK_K)
        else:
            for first in range(0, n, SWEEP_GROUP):
                for u in tl.static_range(SWEEP_GROUP):
                    Q, c_ring = _sweep_ring_token(Q, c_ring, ring_slots, first + u, n, ring_k, ring_g, ring_beta,
                                                  cols, K, L2NORM, CHANNEL, BLOCK_T, BLOCK_K)
        newest_first = n - 1 - ring_slots
        causal = ts[None, :] <= ts[:, None]  # [chain, draft position]
        for chunk in range(V_LOOP):
            rows = (v_part * V_LOOP + chunk) * BLOCK_V + lanes
            row_mask = rows < V
            base, codes, scale = tile.stream_chunk(codes, scale, base_codes + head, base_scale, rows, cols,
                                                   row_mask, chunk + 1 < V_LOOP, K, V, base_scaled, BASE_DTYPE,
                                                   BASE_GRAN, HW, PREFETCH, BLOCK_V, BLOCK_K)
            ring_vs = tl.load(ring_v + newest_first[:, None] * V + rows[None, :],
                              mask=(ring_slots < n)[:, None] & row_mask[None, :], other=0.0).to(tl.float32)
            out_tile = is_t[:, None] & row_mask[None, :]
            v_d = tl.load(v_row + ts[:, None] * s_v_t + rows[None, :], mask=out_tile, other=0.0)
            tl.store(ring_v + (n + ts[:, None]) * V + rows[None, :], v_d.to(ring_v_ptr.dtype.element_ty),
                     mask=out_tile)
            o = tl.sum(c_ring[:, :, None] * ring_vs[None, :, :], axis=1)  # [BLOCK_T, BLOCK_V]
            o += tl.sum(tl.where(causal[:, :, None], c_draft[:, :, None] * v_d.to(tl.float32)[None, :, :],
                                 0.0), axis=1)
            for t in tl.static_range(T):
                Q_t = tl.sum(tl.where(ts[:, None] == t, Q, 0.0), axis=0)
                o = tl.where(ts[:, None] == t, o + tl.sum(base * Q_t[None, :], axis=1)[None, :], o)
            flag_nonfinite(slot_flags_ptr, slot, o, out_tile)
            tile.store_output(out_row, o, ts[:, None] * s_out_t + rows[None, :], out_tile, OUT_BF16, HW)


@triton.jit
def _commit_rows(accepted_ptr, slot_ptr, cursor_ptr, batch_rows, batch, num_slots, HAS_SLOTS: tl.constexpr):
    """A block of batch rows' ``(slots, live, accepted, cursor)``, as both commit kernels read
    them (rows past the batch and padding not live)."""
    slots = tile.slots_of(slot_ptr, batch_rows, batch, HAS_SLOTS)
    live = (slots >= 0) & (slots < num_slots)
    accepted = tl.load(accepted_ptr + batch_rows, mask=live, other=0).to(tl.int32)
    return slots, live, accepted, tl.load(cursor_ptr + slots, mask=live, other=0)


@triton.jit
def _commit_list_kernel(accepted_ptr, slot_ptr, cursor_ptr, drafts_ptr, fold_list_ptr, batch, num_slots, ring_len,
                        capacity, HAS_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program: the batch rows whose commit folds (:func:`commit_decision`), in order, into
    ``fold_list[0 … count)``, and ``count`` into ``fold_list[batch]``."""
    count = 0
    for start in range(0, batch, BLOCK_R):
        batch_rows = start + tl.arange(0, BLOCK_R)
        slots, live, accepted, n = _commit_rows(accepted_ptr, slot_ptr, cursor_ptr, batch_rows, batch, num_slots,
                                                HAS_SLOTS)
        pending = tl.load(drafts_ptr + slots, mask=live, other=0)
        _, flush, _, _, _ = commit_decision(n, pending, accepted, ring_len, capacity)
        folds = (live & flush).to(tl.int32)
        tl.store(fold_list_ptr + count + tl.cumsum(folds, axis=0) - 1, batch_rows, mask=folds != 0)
        count += tl.sum(folds, axis=0)
    tl.store(fold_list_ptr + batch, count)


@triton.jit
def _commit_fold_kernel(
    accepted_ptr, slot_ptr, fold_list_ptr, ck_ptr, read_ptr, read_scale_ptr, ring_k_ptr, ring_v_ptr, ring_g_ptr,
    ring_beta_ptr, cursor_ptr, slot_flags_ptr, scratch_ptr, batch, num_k_heads, num_v_heads, K, V, heads_per_group,
    capacity, M: tl.constexpr, CK_DTYPE: tl.constexpr, CK_QMAX: tl.constexpr, HAS_READ: tl.constexpr,
    RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr, HW: tl.constexpr,
    CHANNEL: tl.constexpr, L2NORM: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_V_TILES: tl.constexpr, PRECISION: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_K)
    # The program's scratch [2 M + 1, BLOCK_K]: the current head's key_in and update rows (and
    # KDA's decay), read back per V tile instead of held in registers across the tiles.
    scratch = scratch_ptr + tl.program_id(0) * ((2 * M + 1) * BLOCK_K)
    # Items (listed row, value head) in turn: only the rows whose ring fills cost a program.
    for item in range(tl.program_id(0), tl.load(fold_list_ptr + batch) * num_v_heads, tl.num_programs(0)):
        b = tl.load(fold_list_ptr + item // num_v_heads)
        h = item % num_v_heads
        slot = tile.slot_of(slot_ptr, b, HAS_SLOTS)
        # The ring's committed tokens (M ≥ capacity positions, masked past them) folded into the
        # checkpoint in fp32 from the checkpoint itself (not the read copy), four tokens a step; then
        # the read copy is rebuilt from the stored checkpoint. The cursor kernel, launched next,
        # moves the cursor to 0.
        count = tl.load(cursor_ptr + slot) + tl.load(accepted_ptr + b).to(tl.int32)
        ring_head = slot * num_v_heads + h
        ring_k = ring_k_ptr + (slot * num_k_heads + h // heads_per_group) * capacity * K
        if CHANNEL:
            ring_g = ring_g_ptr + ring_head * capacity * K
        else:
            ring_g = ring_g_ptr + ring_head * capacity
        decay = stage_fold_operands(scratch, ring_k, ring_g, ring_beta_ptr + ring_head * capacity, count, K, L2NORM,
                                    CHANNEL, M, BLOCK_K, PRECISION)
        tl.debug_barrier()
        if CHANNEL:
            decay = tl.load(scratch + 2 * M * BLOCK_K + cols)
        head = ring_head * V * K
        for v_tile in range(NUM_V_TILES):
            rows = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
            row_mask = rows < V
            S = tile.load_tile(ck_ptr + head, ck_ptr, rows, cols, row_mask, K, K, 0, CK_DTYPE, 0, HW, BLOCK_V,
                               BLOCK_K)
            S = fold_rows_streamed(S, decay, scratch, ring_v_ptr + ring_head * capacity * V, V, rows, row_mask, cols,
                                   count, M, BLOCK_K, CHANNEL)
            # A row's sum is non-finite where one of its elements is (the fold computes no outputs).
            flag_nonfinite(slot_flags_ptr, slot, tl.sum(S, axis=1), row_mask)
            stored = tile.store_tile(S, row_mask, ck_ptr + head, ck_ptr, rows, cols, K, 0, rows, 0, K, CK_DTYPE, 0,
                                     False, CK_QMAX, 0, HW, BLOCK_V, BLOCK_K)
            if HAS_READ:
                tile.store_tile(stored, row_mask, read_ptr + head, read_scale_ptr + ring_head * V, rows, cols, K, 1,
                                rows, 0, K, RD_DTYPE, RD_GRAN, False, RD_QMAX, RD_EMAX, HW, BLOCK_V, BLOCK_K)
        # The next item's operands overwrite the scratch only once every tile has read it.
        tl.debug_barrier()


@triton.jit
def _commit_cursor_kernel(accepted_ptr, slot_ptr, cursor_ptr, drafts_ptr, errors_ptr, slot_flags_ptr, batch,
                          num_slots, ring_len, capacity, HAS_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Every live row's cursor moves past its accepted drafts (to 0 where the fold kernel, which
    ran before, flushed), and its pending drafts are cleared; a refused row leaves its slot as
    it is and records why."""
    batch_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots, live, accepted, n = _commit_rows(accepted_ptr, slot_ptr, cursor_ptr, batch_rows, batch, num_slots,
                                            HAS_SLOTS)
    pending = tl.load(drafts_ptr + slots, mask=live, other=0)
    ok, flush, no_verify, out_of_range, bad_cursor = commit_decision(n, pending, accepted, ring_len, capacity)
    ok = live & ok
    tl.atomic_or(slot_flags_ptr + slots, tl.full([BLOCK_R], SLOT_BAD_CURSOR, tl.int32), mask=live & bad_cursor)
    tl.store(cursor_ptr + slots, tl.where(flush, 0, n + accepted), mask=ok)
    tl.store(drafts_ptr + slots, tl.zeros([BLOCK_R], tl.int32), mask=ok)
    bits = (tl.max((live & no_verify).to(tl.int32), axis=0) * ERROR_NO_VERIFY
            + tl.max((live & out_of_range).to(tl.int32), axis=0) * ERROR_ACCEPTED_RANGE)
    if bits != 0:
        tl.atomic_or(errors_ptr, bits)


@triton.jit
def _drafts_kernel(
    state_ptr, scale_ptr, inter_ptr, inter_scale_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, slot_ptr, out_ptr,
    qk_scale, num_slots, num_v_heads, K, V, heads_per_group,
    s_q_b, s_q_t, s_q_h, s_k_b, s_k_t, s_k_h, s_v_b, s_v_t, s_v_h, s_g_b, s_g_t, s_g_h,
    s_beta_b, s_beta_t, s_beta_h, s_out_b, s_out_t, s_out_h,
    T: tl.constexpr, T_MAX: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr,
    EMAX: tl.constexpr, HW: tl.constexpr, CHANNEL: tl.constexpr, L2NORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
    OUT_BF16: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    v_tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < V
    out_row = out_ptr + b * s_out_b + h * s_out_h
    slot = tile.slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        for t in tl.static_range(T):
            _store_unserved(out_row + t * s_out_t, rows, row_mask, slot, OUT_BF16, HW)
    else:
        hk = h // heads_per_group
        S = tile.load_tile(state_ptr + (slot * num_v_heads + h) * V * K, scale_ptr + (slot * num_v_heads + h) * V,
                           rows, cols, row_mask, K, K, 1, DTYPE, GRAN, HW, BLOCK_V, BLOCK_K)
        for t in tl.static_range(T):
            q = tile.load_key(q_ptr + b * s_q_b + t * s_q_t + hk * s_q_h, cols, K, L2NORM, HW) * qk_scale
            k = tile.load_key(k_ptr + b * s_k_b + t * s_k_t + hk * s_k_h, cols, K, L2NORM, HW)
            alpha = tile.decay(g_ptr + b * s_g_b + t * s_g_t + h * s_g_h, cols, K, CHANNEL)
            beta = tl.load(beta_ptr + b * s_beta_b + t * s_beta_t + h * s_beta_h).to(tl.float32)
            v = tl.load(v_ptr + b * s_v_b + t * s_v_t + h * s_v_h + rows, mask=row_mask, other=0.0).to(tl.float32)
            # The conventional kernel's order; output from the unrounded state.
            S = apply_token(S, k, v, alpha, beta, CHANNEL)
            tile.store_output(out_row + t * s_out_t, tl.sum(S * q[None, :], axis=1), rows, row_mask, OUT_BF16, HW)
            # The next draft starts from the stored state, as T conventional steps would.
            inter_head = ((b.to(tl.int64) * T_MAX + t) * num_v_heads + h)
            S = tile.store_tile(S, row_mask, inter_ptr + inter_head * V * K, inter_scale_ptr + inter_head * V, rows,
                                cols, K, 1, rows, 0, K, DTYPE, GRAN, False, QMAX, EMAX, HW, BLOCK_V, BLOCK_K)
