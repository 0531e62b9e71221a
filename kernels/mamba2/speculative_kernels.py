"""Speculative decoding kernels: the verify's four (``_group_BC_kernel``, ``_verify_kernel``,
``_verify_flush_kernel``, ``_verify_flushed_rows_kernel``), the commit's, and the per-draft-state
baseline's (``_drafts_kernel``; its commit is ``kernels/common/copy_accepted.py``). Launched by
:mod:`.speculative`, whose docstring says what each does."""

import triton
import triton.language as tl

from ..common import exact_dot
from ..common.gate import gate
from ..common.softplus import softplus
from .ring import fold_ring, head_tile, load_scaled_codes, load_state, process_dt, slot_of, store_state
from ..common.slot_flags import SLOT_BAD_CURSOR, cursor_outside, flag_nonfinite, flag_slot


# Bits of ``commit_errors`` the commit kernel sets.
ERROR_NO_VERIFY = tl.constexpr(1)
ERROR_ACCEPTED_RANGE = tl.constexpr(2)

@triton.jit
def _store_unserved(y_row_ptr, stride_y_t, slot, mask_p, T: tl.constexpr, BLOCK_P: tl.constexpr):
    """The T outputs of a row the kernel does not serve: padding (slot < 0) outputs zeros, an
    index past the cache (unchecked on a GPU, to avoid a sync) or a live slot whose cursor lies
    outside its ring NaN."""
    bad = (tl.zeros([BLOCK_P], tl.float32) + tl.where(slot < 0, 0.0, float("nan"))).to(y_row_ptr.dtype.element_ty)
    for i in tl.static_range(T):
        tl.store(y_row_ptr + i * stride_y_t, bad, mask=mask_p)


@triton.jit
def _flushes(n, T: tl.constexpr, CAP: tl.constexpr):
    """Whether a row with ``n`` committed ring tokens flushes before this round's T drafts: the
    next round's drafts would not fit after them."""
    return (n > 0) & (n + 2 * T > CAP)


@triton.jit
def _draft_outputs(
    state_ptr, state_scale_ptr, slot, n, b, h, g, rows, cols, mask_p, mask_n, A,
    x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr,
    slot_flags_ptr, p_tile, nheads, heads_per_group,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
    stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t, stride_y_h,
    headdim, dstate,
    CAP: tl.constexpr, T: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    BC_ROWS: tl.constexpr, C_PARTS: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The T outputs of one (row, head, P-tile) of ``slot`` from its read copy (or checkpoint)
    ``state_ptr``, the ``n`` committed ring tokens and the drafts. Position j of the joint
    sequence is ring token j (j < n) or draft j − n; draft i sees positions ≤ n + i; ``BLOCK_J``
    covers positions up to ``n + T`` (the caller's bound on n), ``BC_ROWS`` is the row stride of
    ``BC_ptr``. The drafts are also stored into the ring at ``n + i``.

    ``S · C_i``: with ``C_PARTS > 0`` (``exact_dot.input_parts`` of C's dtype, for states whose
    codes are exact in bf16) one tensor-core product over all drafts, else one FMA dot per draft.
    All drafts are computed together as ``[BLOCK_P, BLOCK_T]`` tiles, and every global load is
    issued before the first reduction: a load behind a cross-warp reduction waits for its barrier,
    and one such round trip per draft made this the slowest kernel of a round. ``B_j · C_i``
    comes from ``BC_ptr`` (``_group_BC_kernel``); the state tile is reduced to S·C_i as soon as
    it is loaded, so it does not hold registers through the rest."""
    state, row_scale = load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols,
                                         mask_p[:, None] & mask_n[None, :], nheads, headdim, dstate, DTYPE, GRAN, HW,
                                         BLOCK_P, BLOCK_N, C_PARTS > 0)  # [BLOCK_P, BLOCK_N], [BLOCK_P]
    ring_head = slot.to(tl.int64) * nheads + h
    ngroups = nheads // heads_per_group
    ring_group = slot.to(tl.int64) * ngroups + g
    ts = tl.arange(0, BLOCK_T)
    is_t = ts < T
    js = tl.arange(0, BLOCK_J)
    committed = js < n
    is_draft = (js >= n) & (js < n + T)
    d = tl.where(is_draft, js - n, 0)  # [BLOCK_J] draft index of each position
    tile_t = mask_p[:, None] & is_t[None, :]  # [BLOCK_P, BLOCK_T]
    x_d = tl.load(x_ptr + b * stride_x_b + ts[None, :] * stride_x_t + h * stride_x_h + rows[:, None], mask=tile_t,
                  other=0.0)  # [BLOCK_P, BLOCK_T]
    if HAS_Z:
        z_d = tl.load(z_ptr + b * stride_z_b + ts[None, :] * stride_z_t + h * stride_z_h + rows[:, None], mask=tile_t,
                      other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_T]
    BC = tl.load(BC_ptr + ((b * ngroups + g) * BC_ROWS + js[:, None]) * BLOCK_T + ts[None, :])  # [BLOCK_J, BLOCK_T]
    dt_ring = tl.load(ring_dt_ptr + ring_head * CAP + js, mask=committed, other=0.0)
    dt_draft = tl.load(dt_ptr + b * stride_dt_b + d * stride_dt_t + h, mask=is_draft, other=0.0).to(tl.float32)
    x_ring = tl.load(ring_x_ptr + (ring_head * CAP + js[:, None]) * headdim + rows[None, :],
                     mask=committed[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
    x_new = tl.load(x_ptr + b * stride_x_b + d[:, None] * stride_x_t + h * stride_x_h + rows[None, :],
                    mask=is_draft[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
    if C_PARTS > 0:
        # A product takes at least 16 columns: the drafts' C, then zeros.
        BLOCK_C: tl.constexpr = 16 if BLOCK_T < 16 else BLOCK_T
        cs = tl.arange(0, BLOCK_C)
        C_all = tl.load(C_ptr + b * stride_C_b + cs[:, None] * stride_C_t + g * stride_C_g + cols[None, :],
                        mask=(cs < T)[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_C, BLOCK_N]
        SC = exact_dot.dot_columns(state, C_all, C_PARTS, HW)  # [BLOCK_P, BLOCK_C]
        if BLOCK_C > BLOCK_T:
            # Columns past BLOCK_T are zero: adding them keeps the first BLOCK_T exactly.
            SC = tl.sum(tl.reshape(SC, [BLOCK_P, BLOCK_C // BLOCK_T, BLOCK_T]), axis=1)
    else:
        SC = tl.zeros([BLOCK_P, BLOCK_T], tl.float32)  # S · C_i, column i
        for i in tl.static_range(T):
            C_i = tl.load(C_ptr + b * stride_C_b + i * stride_C_t + g * stride_C_g + cols, mask=mask_n,
                          other=0.0).to(tl.float32)
            SC = tl.where(ts[None, :] == i, tl.sum(state * C_i[None, :], axis=1)[:, None], SC)
    SC = SC * row_scale[:, None]
    if HAS_BIAS:
        dt_draft += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt_draft = softplus(dt_draft)
    dts = tl.where(committed, dt_ring, tl.where(is_draft, dt_draft, 0.0))  # [BLOCK_J]
    cum = tl.cumsum(dts, axis=0)  # Λ_j
    x_all = tl.where(committed[:, None], x_ring, x_new)  # [BLOCK_J, BLOCK_P]
    position = n + ts  # [BLOCK_T] of each draft
    at = js[:, None] == position[None, :]  # [BLOCK_J, BLOCK_T]
    lam = tl.sum(tl.where(at, cum[:, None], 0.0), axis=0)  # [BLOCK_T] Λ at each draft
    causal = js[:, None] <= position[None, :]  # [BLOCK_J, BLOCK_T]
    # Selected, not weighted by 0: a later draft's x, B or C may be NaN or inf (0 · NaN = NaN).
    coef = tl.where(causal, tl.exp(A * (lam[None, :] - cum[:, None])) * dts[:, None] * BC, 0.0)  # [BLOCK_J, BLOCK_T]
    y_ring = tl.sum(tl.where(causal[:, None, :], x_all[:, :, None] * coef[:, None, :], 0.0), axis=0)  # [BLOCK_P, BLOCK_T]
    y = tl.exp(A * lam)[None, :] * SC + y_ring
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x_d.to(tl.float32)
    if HAS_Z:
        y = gate(y, z_d, HW)
    flag_nonfinite(slot_flags_ptr, slot, y, tile_t)
    y_tile = y_ptr + b * stride_y_b + ts[None, :] * stride_y_t + h * stride_y_h + rows[:, None]
    tl.store(y_tile, y.to(y_tile.dtype.element_ty), mask=tile_t)
    tl.store(ring_x_ptr + (ring_head * CAP + position[None, :]) * headdim + rows[:, None], x_d, mask=tile_t)
    if p_tile == 0:
        tl.store(ring_dt_ptr + ring_head * CAP + position, tl.sum(tl.where(at, dts[:, None], 0.0), axis=0), mask=is_t)
        if h % heads_per_group == 0:
            B_d = tl.load(B_ptr + b * stride_B_b + ts[:, None] * stride_B_t + g * stride_B_g + cols[None, :],
                          mask=is_t[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_T, BLOCK_N]
            tl.store(ring_B_ptr + (ring_group * CAP + position[:, None]) * dstate + cols[None, :], B_d,
                     mask=is_t[:, None] & mask_n[None, :])


@triton.jit
def _group_BC_kernel(
    B_ptr, C_ptr, slot_ptr, ring_B_ptr, cursor_ptr, BC_ptr,
    stride_B_b, stride_B_t, stride_B_g, stride_C_b, stride_C_t, stride_C_g,
    num_slots, dstate,
    CAP: tl.constexpr, T: tl.constexpr, HAS_SLOTS: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """``BC[b, g, j, i] = B_j · C_i`` over the joint sequence of row b (its committed ring tokens,
    then the drafts; the drafts alone for a row that flushes this round), grid ``(batch, ngroups)``.
    Every head and tile of the group reads it instead of recomputing it."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    ngroups = tl.num_programs(1)
    slot = slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot >= 0) & (slot < num_slots):
        n = tl.load(cursor_ptr + slot)
        if not cursor_outside(n, CAP):  # a bad cursor: the verify reads no BC of the row
            n = tl.where(_flushes(n, T, CAP), 0, n)  # a flushing row's drafts start at 0
            cols = tl.arange(0, BLOCK_N)
            mask_n = cols < dstate
            js = tl.arange(0, BLOCK_J)
            ts = tl.arange(0, BLOCK_T)
            committed = js < n
            is_draft = (js >= n) & (js < n + T)
            d = tl.where(is_draft, js - n, 0)  # [BLOCK_J] draft index of each position
            ring_group = slot.to(tl.int64) * ngroups + g
            B_ring = tl.load(ring_B_ptr + (ring_group * CAP + js[:, None]) * dstate + cols[None, :],
                             mask=committed[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            B_new = tl.load(B_ptr + b * stride_B_b + d[:, None] * stride_B_t + g * stride_B_g + cols[None, :],
                            mask=is_draft[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            B_all = tl.where(committed[:, None], B_ring, B_new)  # [BLOCK_J, BLOCK_N]
            BC = tl.zeros([BLOCK_J, BLOCK_T], tl.float32)
            for i in tl.static_range(T):
                C_i = tl.load(C_ptr + b * stride_C_b + i * stride_C_t + g * stride_C_g + cols, mask=mask_n,
                              other=0.0).to(tl.float32)
                BC = tl.where(ts[None, :] == i, tl.sum(B_all * C_i[None, :], axis=1)[:, None], BC)
            tl.store(BC_ptr + ((b * ngroups + g) * BLOCK_J + js[:, None]) * BLOCK_T + ts[None, :], BC)


@triton.jit
def _verify_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr, cursor_ptr, generation_ptr,
    drafts_ptr, flush_rows_ptr, flush_counters_ptr, slot_flags_ptr,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
    stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t, stride_y_h,
    num_slots, nheads, headdim, dstate, heads_per_group,
    CAP: tl.constexpr, T: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, C_PARTS: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    h, p_tile, g, rows, cols, mask_p, mask_n = head_tile(tl.program_id(0), heads_per_group, headdim, dstate,
                                                         NUM_P_TILES, BLOCK_P, BLOCK_N)
    b = tl.program_id(1)
    slot = slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        _store_unserved(y_ptr + b * stride_y_b + h * stride_y_h + rows, stride_y_t, slot, mask_p, T, BLOCK_P)
    else:
        n = tl.load(cursor_ptr + slot)
        if cursor_outside(n, CAP):
            # A cursor outside the ring: NaN outputs, the slot flagged, nothing of it written.
            flag_slot(slot_flags_ptr, slot, SLOT_BAD_CURSOR)
            _store_unserved(y_ptr + b * stride_y_b + h * stride_y_h + rows, stride_y_t, slot, mask_p, T, BLOCK_P)
        else:
            flush = _flushes(n, T, CAP)
            if (h == 0) & (p_tile == 0):
                tl.store(drafts_ptr + slot, T)
                if flush:
                    position = tl.atomic_add(flush_counters_ptr, 1)
                    tl.store(flush_rows_ptr + position, b)
                    tl.store(generation_ptr + slot, tl.load(generation_ptr + slot) + 1)
            if not flush:
                _draft_outputs(
                    state_ptr, state_scale_ptr, slot, n, b, h, g, rows, cols, mask_p, mask_n,
                    tl.load(A_ptr + h).to(tl.float32),
                    x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr,
                    BC_ptr, slot_flags_ptr, p_tile, nheads, heads_per_group,
                    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
                    stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t,
                    stride_y_h, headdim, dstate, CAP, T, DTYPE, GRAN, HW, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, BLOCK_J,
                    C_PARTS, BLOCK_J, BLOCK_P, BLOCK_N, BLOCK_T,
                )


@triton.jit
def _verify_flush_kernel(
    A_ptr, slot_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr,
    cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr, slot_flags_ptr, seed,
    nheads, headdim, dstate, heads_per_group,
    CAP: tl.constexpr,
    CK_DTYPE: tl.constexpr, CK_GRAN: tl.constexpr, CK_SR: tl.constexpr, CK_QMAX: tl.constexpr,
    CK_EMAX: tl.constexpr,
    HAS_READ: tl.constexpr, RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_SR: tl.constexpr,
    RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr, HW: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    h, p_tile, g, rows, cols, mask_p, mask_n = head_tile(tl.program_id(1), heads_per_group, headdim, dstate,
                                                         NUM_P_TILES, BLOCK_P, BLOCK_N)
    programs = tl.num_programs(0)
    mask = mask_p[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + h).to(tl.float32)
    count = tl.load(flush_counters_ptr)
    for r in range(pid, count, programs):
        b = tl.load(flush_rows_ptr + r)
        slot = slot_of(slot_ptr, b, HAS_SLOTS)
        n = tl.load(cursor_ptr + slot)  # committed tokens; the drafts kernel zeroes it later
        ring_head = slot.to(tl.int64) * nheads + h
        ring_group = slot.to(tl.int64) * (nheads // heads_per_group) + g
        ring, total = fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, n, A, rows, cols, mask_p,
                                mask_n, headdim, dstate, CAP, BLOCK_J, BLOCK_P, BLOCK_N, False, False, 0.0, 0.0, 0.0)
        checkpoint = load_state(ck_ptr, ck_scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                                CK_DTYPE, CK_GRAN, HW, BLOCK_P, BLOCK_N)
        # Stochastic rounding: one Philox stream per (slot, flush), as the replay flush draws it.
        stream = seed + (slot.to(tl.int64) << 32) + tl.load(generation_ptr + slot).to(tl.int64) * 2
        new_state = tl.exp(A * total) * checkpoint + ring
        # This kernel computes no outputs: the new state's own elements are checked.
        flag_nonfinite(slot_flags_ptr, slot, new_state, mask)
        stored = store_state(new_state, mask, ck_ptr, ck_scale_ptr, stream, slot, h, rows, cols, nheads, headdim,
                             dstate, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX, CK_EMAX, HW, BLOCK_P, BLOCK_N)
        if HAS_READ:
            store_state(stored, mask, read_ptr, read_scale_ptr, stream + 1, slot, h, rows, cols,
                        nheads, headdim, dstate, RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX, HW, BLOCK_P, BLOCK_N)


@triton.jit
def _verify_flushed_rows_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr, cursor_ptr,
    flush_rows_ptr, flush_counters_ptr, slot_flags_ptr,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
    stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t, stride_y_h,
    nheads, headdim, dstate, heads_per_group,
    CAP: tl.constexpr, T: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, BC_ROWS: tl.constexpr, C_PARTS: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    h, p_tile, g, rows, cols, mask_p, mask_n = head_tile(tl.program_id(1), heads_per_group, headdim, dstate,
                                                         NUM_P_TILES, BLOCK_P, BLOCK_N)
    programs = tl.num_programs(0)
    A = tl.load(A_ptr + h).to(tl.float32)
    count = tl.load(flush_counters_ptr)
    for r in range(pid, count, programs):
        b = tl.load(flush_rows_ptr + r)
        slot = slot_of(slot_ptr, b, HAS_SLOTS)
        # The flush kernel has stored the new read copy (or checkpoint): the drafts are the
        # ring's only tokens, so they are verified and appended as at cursor 0.
        _draft_outputs(
            state_ptr, state_scale_ptr, slot, 0, b, h, g, rows, cols, mask_p, mask_n, A,
            x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr,
            slot_flags_ptr, p_tile, nheads, heads_per_group,
            stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
            stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t,
            stride_y_h, headdim, dstate, CAP, T, DTYPE, GRAN, HW, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, BC_ROWS, C_PARTS,
            BLOCK_J, BLOCK_P, BLOCK_N, BLOCK_T,
        )
    # The last program to finish zeroes the flushed rows' cursors (every fold has read them: the
    # flush kernel ran before this one) and empties the list for the next call.
    # With no row listed there is nothing to zero and no program takes a ticket.
    if count > 0:
        finished = tl.atomic_add(flush_counters_ptr + 1, 1)
        if finished == programs * nheads * NUM_P_TILES - 1:
            for start in range(0, count, BLOCK_R):
                entries = start + tl.arange(0, BLOCK_R)
                listed = entries < count
                bs = tl.load(flush_rows_ptr + entries, mask=listed, other=0)
                if HAS_SLOTS:
                    slots = tl.load(slot_ptr + bs, mask=listed, other=0).to(tl.int32)
                else:
                    slots = bs
                tl.store(cursor_ptr + slots, tl.zeros([BLOCK_R], tl.int32), mask=listed)
            tl.store(flush_counters_ptr, 0)
            tl.store(flush_counters_ptr + 1, 0)


@triton.jit
def _commit_kernel(accepted_ptr, slot_ptr, cursor_ptr, drafts_ptr, errors_ptr, slot_flags_ptr, batch, num_slots,
                   capacity, HAS_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr):
    batch_rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = batch_rows < batch
    if HAS_SLOTS:
        slots = tl.load(slot_ptr + batch_rows, mask=in_batch, other=-1).to(tl.int32)
    else:
        slots = tl.where(in_batch, batch_rows, -1)
    live = (slots >= 0) & (slots < num_slots)
    accepted = tl.load(accepted_ptr + batch_rows, mask=live, other=0).to(tl.int32)
    pending = tl.load(drafts_ptr + slots, mask=live, other=0)
    no_verify = live & (pending == 0)
    out_of_range = live & (pending > 0) & ((accepted < 0) | (accepted > pending))
    n = tl.load(cursor_ptr + slots, mask=live, other=0)
    ok = live & (pending > 0) & (accepted >= 0) & (accepted <= pending)
    # A cursor outside the ring, or a move out of it (garbage drafts): the slot is flagged and left as it is.
    outside = (live & cursor_outside(n, capacity)) | (ok & cursor_outside(n + accepted, capacity))
    ok = ok & ~outside
    tl.atomic_or(slot_flags_ptr + slots, tl.full([BLOCK_R], SLOT_BAD_CURSOR, tl.int32), mask=outside)
    tl.store(cursor_ptr + slots, n + accepted, mask=ok)
    tl.store(drafts_ptr + slots, tl.zeros([BLOCK_R], tl.int32), mask=ok)
    bits = (tl.max(no_verify.to(tl.int32), axis=0) * ERROR_NO_VERIFY
            + tl.max(out_of_range.to(tl.int32), axis=0) * ERROR_ACCEPTED_RANGE)
    if bits != 0:
        tl.atomic_or(errors_ptr, bits)


@triton.jit
def _drafts_kernel(
    state_ptr, state_scale_ptr, inter_ptr, inter_scale_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr,
    dt_bias_ptr, slot_ptr, y_ptr,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
    stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t, stride_y_h,
    num_slots, nheads, headdim, dstate, heads_per_group,
    T: tl.constexpr, T_MAX: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr,
    EMAX: tl.constexpr, HW: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr, HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    h, p_tile, g, rows, cols, mask_p, mask_n = head_tile(tl.program_id(0), heads_per_group, headdim, dstate,
                                                         NUM_P_TILES, BLOCK_P, BLOCK_N)
    b = tl.program_id(1)
    mask = mask_p[:, None] & mask_n[None, :]
    slot = slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        _store_unserved(y_ptr + b * stride_y_b + h * stride_y_h + rows, stride_y_t, slot, mask_p, T, BLOCK_P)
    else:
        state = load_state(state_ptr, state_scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                           DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)  # [BLOCK_P, BLOCK_N]
        A = tl.load(A_ptr + h).to(tl.float32)
        for i in tl.static_range(T):
            dt = process_dt(dt_ptr + b * stride_dt_b + i * stride_dt_t + h, dt_bias_ptr, h, HAS_BIAS, SOFTPLUS)
            x = tl.load(x_ptr + b * stride_x_b + i * stride_x_t + h * stride_x_h + rows, mask=mask_p,
                        other=0.0).to(tl.float32)
            B = tl.load(B_ptr + b * stride_B_b + i * stride_B_t + g * stride_B_g + cols, mask=mask_n,
                        other=0.0).to(tl.float32)
            C = tl.load(C_ptr + b * stride_C_b + i * stride_C_t + g * stride_C_g + cols, mask=mask_n,
                        other=0.0).to(tl.float32)
            # The conventional kernel's order: a·S + (dt·x) ⊗ B, output from the unrounded state.
            state = tl.exp(dt * A) * state + (dt * x)[:, None] * B[None, :]
            y = tl.sum(state * C[None, :], axis=1)
            if HAS_D:
                y = y + tl.load(D_ptr + h).to(tl.float32) * x
            if HAS_Z:
                z = tl.load(z_ptr + b * stride_z_b + i * stride_z_t + h * stride_z_h + rows, mask=mask_p,
                            other=0.0).to(tl.float32)
                y = gate(y, z, HW)
            tl.store(y_ptr + b * stride_y_b + i * stride_y_t + h * stride_y_h + rows, y.to(y_ptr.dtype.element_ty),
                     mask=mask_p)
            # The next token starts from the stored state, as T conventional steps would.
            state = store_state(state, mask, inter_ptr, inter_scale_ptr, 0, b * T_MAX + i, h, rows, cols,
                                nheads, headdim, dstate, DTYPE, GRAN, False, QMAX, EMAX, HW, BLOCK_P, BLOCK_N)
