"""Replay decode kernels: the step kernel (one head per program), the grouped step kernel
(several heads of one group per program), the flush kernel, and the single-launch step kernel
(the step kernel folding its flushing rows itself). Launched by :mod:`.replay`, whose docstring
says what each does."""

import triton
import triton.language as tl

from ..common import pdl
from ..common.gate import gate
from ..common.softplus import softplus
from .ring import (agree_cols, agree_rows, agree_scalar, fold_ring, head_tile, load_scaled_codes, load_state,
                   process_dt, slot_of, store_state)
from ..common.slot_flags import SLOT_BAD_CURSOR, cursor_outside, flag_nonfinite, flag_slot


@triton.jit
def _gate_and_store(y, x_t, y_ptrs, z_ptrs, mask_p, D_ptr, h, flags_ptr, slot, HAS_D: tl.constexpr,
                    HAS_Z: tl.constexpr, HW: tl.constexpr):
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x_t
    if HAS_Z:
        z = tl.load(z_ptrs, mask=mask_p, other=0.0).to(tl.float32)
        y = gate(y, z, HW)
    flag_nonfinite(flags_ptr, slot, y, mask_p)
    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=mask_p)


@triton.jit
def _replay_step_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr,
    flush_rows_ptr, flush_counters_ptr, slot_flags_ptr,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_y_b, stride_y_h,
    num_slots, nheads, headdim, dstate, heads_per_group,
    L: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, STATE_FIRST: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    AGREE: tl.constexpr = False,
):
    pdl.grid_dependency(PDL)
    _step_program(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
        state_ptr, state_scale_ptr, state_ptr, state_scale_ptr, state_ptr, state_scale_ptr, 0,
        ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr,
        slot_flags_ptr, stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
        stride_z_b, stride_z_h, stride_y_b, stride_y_h, num_slots, nheads, headdim, dstate, heads_per_group,
        L, DTYPE, GRAN, HW, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, HAS_SLOTS, NUM_P_TILES, STATE_FIRST,
        BLOCK_L, BLOCK_L, BLOCK_P, BLOCK_N, AGREE, False, 0, 0, False, 1.0, 0, False, 0, 0, False, 1.0, 0)


@triton.jit
def _replay_step_fused_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr,
    cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr, slot_flags_ptr, seed,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_y_b, stride_y_h,
    num_slots, nheads, headdim, dstate, heads_per_group,
    L: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, STATE_FIRST: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    CK_DTYPE: tl.constexpr, CK_GRAN: tl.constexpr, CK_SR: tl.constexpr, CK_QMAX: tl.constexpr,
    CK_EMAX: tl.constexpr,
    HAS_READ: tl.constexpr, RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_SR: tl.constexpr,
    RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr, BLOCK_J: tl.constexpr, AGREE: tl.constexpr = False,
):
    """The per-head step kernel that also flushes: a flushing row's programs fold their tiles
    (the flush kernel's arithmetic, the current token from registers) and write its output,
    checkpoint and read copy; the last program of each row to finish (a ticket per slot in
    ``flush_rows``, zeroed again by that program) moves the row's cursor and generation. One
    launch a step, no flush list (kernels/mamba2/README.md, "single launch")."""
    pdl.grid_dependency(PDL)
    _step_program(
        x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
        state_ptr, state_scale_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr, seed,
        ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr,
        slot_flags_ptr, stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
        stride_z_b, stride_z_h, stride_y_b, stride_y_h, num_slots, nheads, headdim, dstate, heads_per_group,
        L, DTYPE, GRAN, HW, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, HAS_SLOTS, NUM_P_TILES, STATE_FIRST,
        BLOCK_L, BLOCK_J, BLOCK_P, BLOCK_N, AGREE, True, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX, CK_EMAX,
        HAS_READ, RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX)


@triton.jit
def _step_program(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr, seed,
    ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr,
    slot_flags_ptr, stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_y_b, stride_y_h, num_slots, nheads, headdim, dstate, heads_per_group,
    L: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, STATE_FIRST: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    AGREE: tl.constexpr, FUSED: tl.constexpr, CK_DTYPE: tl.constexpr, CK_GRAN: tl.constexpr, CK_SR: tl.constexpr,
    CK_QMAX: tl.constexpr, CK_EMAX: tl.constexpr,
    HAS_READ: tl.constexpr, RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_SR: tl.constexpr,
    RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr,
):
    """One (head, P-tile, row) program of the per-head step kernel; ``FUSED``: of the single-launch one."""
    h, p_tile, g, rows, cols, mask_p, mask_n = head_tile(tl.program_id(0), heads_per_group, headdim, dstate,
                                                         NUM_P_TILES, BLOCK_P, BLOCK_N)
    b = tl.program_id(1)
    y_ptrs = y_ptr + b * stride_y_b + h * stride_y_h + rows
    slot = slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        # Padding outputs zeros; an index past the cache (unchecked on a GPU, to avoid a sync)
        # outputs NaN. Neither writes any slot.
        bad = tl.where(slot < 0, 0.0, float("nan"))
        tl.store(y_ptrs, (tl.zeros([BLOCK_P], tl.float32) + bad).to(y_ptrs.dtype.element_ty), mask=mask_p)
    else:
        # Loads that do not depend on the cursor go first, so their latency overlaps its load.
        # The state tile goes with them only where STATE_FIRST (kernels/mamba2/README.md, "the state and
        # the cursor"); else it waits for the cursor, and a flushing row (n = L − 1) reads none.
        # Either way it is reduced to S·C at once, so it holds no registers through the ring work.
        mask = mask_p[:, None] & mask_n[None, :]
        if STATE_FIRST:
            state, row_scale = load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols, mask, nheads,
                                                 headdim, dstate, DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
        C_t = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + cols, mask=mask_n, other=0.0).to(tl.float32)
        dt = process_dt(dt_ptr + b * stride_dt_b + h, dt_bias_ptr, h, HAS_BIAS, SOFTPLUS)
        x_t = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + rows, mask=mask_p, other=0.0)
        B_t = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + cols, mask=mask_n, other=0.0)
        n = tl.load(cursor_ptr + slot)
        if cursor_outside(n, L):
            # A cursor outside the ring (memory the caller wrote): the row outputs NaN, the slot is
            # flagged and nothing of it is written.
            flag_slot(slot_flags_ptr, slot, SLOT_BAD_CURSOR)
            tl.store(y_ptrs, tl.full([BLOCK_P], float("nan"), tl.float32).to(y_ptrs.dtype.element_ty), mask=mask_p)
        else:
            if STATE_FIRST:
                state_C = agree_rows(tl.sum(state * C_t[None, :], axis=1), BLOCK_N, AGREE) * row_scale  # [BLOCK_P]
            full = n == L - 1
            ring_head = slot.to(tl.int64) * nheads + h
            ring_group = slot.to(tl.int64) * (nheads // heads_per_group) + g
            tl.store(ring_x_ptr + (ring_head * L + n) * headdim + rows, x_t, mask=mask_p)
            if p_tile == 0:
                tl.store(ring_dt_ptr + ring_head * L + n, dt)
                if h % heads_per_group == 0:
                    tl.store(ring_B_ptr + (ring_group * L + n) * dstate + cols, B_t, mask=mask_n)
                if not FUSED:
                    if (h == 0) & full:
                        position = tl.atomic_add(flush_counters_ptr, 1)
                        tl.store(flush_rows_ptr + position, b)
                        tl.store(generation_ptr + slot, tl.load(generation_ptr + slot) + 1)
            if n != L - 1:
                if not STATE_FIRST:
                    state, row_scale = load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols, mask, nheads,
                                                         headdim, dstate, DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
                    state_C = agree_rows(tl.sum(state * C_t[None, :], axis=1), BLOCK_N, AGREE) * row_scale
                A = tl.load(A_ptr + h).to(tl.float32)
                js = tl.arange(0, BLOCK_L)
                older = js < n
                current = js == n
                dts = tl.load(ring_dt_ptr + ring_head * L + js, mask=older, other=0.0)
                dts = tl.where(current, dt, dts)  # [BLOCK_L]; zero after the current token
                total = agree_scalar(tl.sum(dts, axis=0), BLOCK_L, AGREE)
                since = total - tl.cumsum(dts, axis=0)  # Λ_t − Λ_j
                weights = tl.exp(A * since) * dts
                B_ring = tl.load(ring_B_ptr + (ring_group * L + js[:, None]) * dstate + cols[None, :],
                                 mask=older[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
                B_ring = tl.where(current[:, None], B_t.to(tl.float32)[None, :], B_ring)  # [BLOCK_L, BLOCK_N]
                BC = agree_rows(tl.sum(B_ring * C_t[None, :], axis=1), BLOCK_N, AGREE)  # [BLOCK_L]
                x_ring = tl.load(ring_x_ptr + (ring_head * L + js[:, None]) * headdim + rows[None, :],
                                 mask=older[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
                x_ring = tl.where(current[:, None], x_t.to(tl.float32)[None, :], x_ring)  # [BLOCK_L, BLOCK_P]
                y_ring = agree_cols(tl.sum((weights * BC)[:, None] * x_ring, axis=0), BLOCK_L, AGREE)  # [BLOCK_P]
                y = tl.exp(A * total) * state_C + y_ring
                _gate_and_store(y, x_t.to(tl.float32), y_ptrs, z_ptr + b * stride_z_b + h * stride_z_h + rows,
                                mask_p, D_ptr, h, slot_flags_ptr, slot, HAS_D, HAS_Z, HW)
                if FUSED:
                    _row_done(flush_rows_ptr, cursor_ptr, generation_ptr, slot, n + 1, 0, False)
            else:
                if FUSED:
                    # The flush kernel's item for this tile, the token just appended from registers.
                    generation = tl.load(generation_ptr + slot) + 1
                    A = tl.load(A_ptr + h).to(tl.float32)
                    ring, total = fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, L, A, rows,
                                            cols, mask_p, mask_n, headdim, dstate, L, BLOCK_J, BLOCK_P, BLOCK_N, AGREE,
                                            True, x_t.to(tl.float32), dt, B_t.to(tl.float32))
                    _flush_tile(ring, total, A, x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, ck_ptr, ck_scale_ptr, read_ptr,
                                read_scale_ptr, slot_flags_ptr, seed, generation, b, slot, h, g, rows, cols, mask_p,
                                mask_n, mask, stride_x_b, stride_x_h, stride_C_b, stride_C_g, stride_z_b, stride_z_h,
                                stride_y_b, stride_y_h, nheads, headdim, dstate, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX,
                                CK_EMAX, HAS_READ, RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX, HW, HAS_D, HAS_Z,
                                BLOCK_P, BLOCK_N, AGREE)
                    _row_done(flush_rows_ptr, cursor_ptr, generation_ptr, slot, 0, generation, True)


@triton.jit
def _row_done(tickets_ptr, cursor_ptr, generation_ptr, slot, next_cursor, generation, FLUSHED: tl.constexpr):
    """A single-launch program's share of its row's bookkeeping, after its last read of the
    cursor: a ticket; the row's last program moves the cursor (and a flushed row's generation)
    and zeroes the ticket, so the next call, or graph replay, starts from zero."""
    if tl.atomic_add(tickets_ptr + slot, 1) == tl.num_programs(0) - 1:
        tl.store(cursor_ptr + slot, next_cursor)
        if FLUSHED:
            tl.store(generation_ptr + slot, generation)
        tl.store(tickets_ptr + slot, 0)


@triton.jit
def _flush_tile(ring, total, A, x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr,
                slot_flags_ptr, seed, generation, b, slot, h, g, rows, cols, mask_p, mask_n, mask,
                stride_x_b, stride_x_h, stride_C_b, stride_C_g, stride_z_b, stride_z_h, stride_y_b, stride_y_h,
                nheads, headdim, dstate,
                CK_DTYPE: tl.constexpr, CK_GRAN: tl.constexpr, CK_SR: tl.constexpr, CK_QMAX: tl.constexpr,
                CK_EMAX: tl.constexpr, HAS_READ: tl.constexpr, RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr,
                RD_SR: tl.constexpr, RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr, HW: tl.constexpr,
                HAS_D: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                AGREE: tl.constexpr):
    """A flushing tile after its fold (``ring``, ``total``): the new state from the stored
    checkpoint, the row's output from it, the checkpoint and read copy stored. ``generation``:
    the slot's flush count after this flush (its noise stream)."""
    # The state loads after the fold: loaded first, the state tiles held their registers
    # through the product (flush step 1221 µs against 928 on the H200).
    checkpoint = load_state(ck_ptr, ck_scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                            CK_DTYPE, CK_GRAN, HW, BLOCK_P, BLOCK_N)
    # The new state, unrounded: the row's output reads it (not the old read copy, which a
    # flush never loads), and the checkpoint and read copy store it.
    # Written twice on purpose: one tensor feeding both the output's sum and the stores took
    # the fp8 read-copy kernel past its 128-register cap (spills: 2760 against 1856
    # instructions per thread, bench.sass_count); both compile to the same FMA.
    decay = tl.exp(A * total)
    C_t = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + cols, mask=mask_n, other=0.0).to(tl.float32)
    y = agree_rows(tl.sum((ring + decay * checkpoint) * C_t[None, :], axis=1), BLOCK_N, AGREE)
    new_state = decay * checkpoint + ring  # [BLOCK_P, BLOCK_N]
    x_t = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + rows, mask=mask_p, other=0.0).to(tl.float32)
    _gate_and_store(y, x_t, y_ptr + b * stride_y_b + h * stride_y_h + rows,
                    z_ptr + b * stride_z_b + h * stride_z_h + rows, mask_p, D_ptr, h, slot_flags_ptr, slot,
                    HAS_D, HAS_Z, HW)
    # Stochastic rounding: one Philox stream per (slot, flush), the element's row and octet as counter.
    stream = seed + (slot.to(tl.int64) << 32) + generation.to(tl.int64) * 2
    stored = store_state(new_state, mask, ck_ptr, ck_scale_ptr, stream, slot, h, rows, cols,
                         nheads, headdim, dstate, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX, CK_EMAX, HW, BLOCK_P, BLOCK_N)
    if HAS_READ:
        store_state(stored, mask, read_ptr, read_scale_ptr, stream + 1, slot, h, rows, cols,
                    nheads, headdim, dstate, RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX, HW, BLOCK_P, BLOCK_N)


@triton.jit
def _replay_step_grouped_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr,
    flush_rows_ptr, flush_counters_ptr, slot_flags_ptr,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_y_b, stride_y_h,
    num_slots, nheads,
    HEADDIM: tl.constexpr, DSTATE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    L: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr, AGREE: tl.constexpr = False,
):
    """The step kernel's work for ``HEADS_PER_PROG`` heads of one group per program, grid
    ``(nheads / HEADS_PER_PROG × P-tiles, batch)``: slot, cursor, the ring's dts and B, and
    ``B_j · C`` are loaded or computed once for all the program's heads, and a pipelined loop
    over the heads streams their state tiles and x rings (kernels/mamba2/README.md, "grouped step")."""
    pdl.grid_dependency(PDL)
    chunk = tl.program_id(0) // NUM_P_TILES
    p_tile = tl.program_id(0) % NUM_P_TILES
    b = tl.program_id(1)
    h0 = chunk * HEADS_PER_PROG
    g = h0 // HEADS_PER_GROUP
    lanes = tl.arange(0, BLOCK_H)
    heads = h0 + lanes  # [BLOCK_H]
    mask_h = lanes < HEADS_PER_PROG
    rows = p_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    mask_p = rows < HEADDIM
    mask_n = cols < DSTATE
    slot = slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        # Padding outputs zeros; an index past the cache outputs NaN. Neither writes any slot.
        bad = tl.where(slot < 0, 0.0, float("nan"))
        y_tile = y_ptr + b * stride_y_b + heads[:, None] * stride_y_h + rows[None, :]  # [BLOCK_H, BLOCK_P]
        tl.store(y_tile, (tl.zeros([BLOCK_H, BLOCK_P], tl.float32) + bad).to(y_tile.dtype.element_ty),
                 mask=mask_h[:, None] & mask_p[None, :])
    else:
        n = tl.load(cursor_ptr + slot)
        if cursor_outside(n, L):
            # A cursor outside the ring: NaN outputs, the slot flagged, nothing of it written.
            flag_slot(slot_flags_ptr, slot, SLOT_BAD_CURSOR)
            y_tile = y_ptr + b * stride_y_b + heads[:, None] * stride_y_h + rows[None, :]  # [BLOCK_H, BLOCK_P]
            tl.store(y_tile, tl.full([BLOCK_H, BLOCK_P], float("nan"), tl.float32).to(y_tile.dtype.element_ty),
                     mask=mask_h[:, None] & mask_p[None, :])
        else:
            full = n == L - 1
            js = tl.arange(0, BLOCK_L)
            older = js < n
            current = js == n
            dt = tl.load(dt_ptr + b * stride_dt_b + heads, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
            if HAS_BIAS:
                dt += tl.load(dt_bias_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)
            if SOFTPLUS:
                dt = softplus(dt)
            B_t = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + cols, mask=mask_n, other=0.0)
            ring_heads = slot.to(tl.int64) * nheads + heads  # [BLOCK_H]
            ring_group = slot.to(tl.int64) * (nheads // HEADS_PER_GROUP) + g
            if p_tile == 0:
                # Appends: the program's dts, the group's B once (by the group's first program).
                tl.store(ring_dt_ptr + ring_heads * L + n, dt, mask=mask_h)
                if h0 % HEADS_PER_GROUP == 0:
                    tl.store(ring_B_ptr + (ring_group * L + n) * DSTATE + cols, B_t, mask=mask_n)
                if (h0 == 0) & full:
                    position = tl.atomic_add(flush_counters_ptr, 1)
                    tl.store(flush_rows_ptr + position, b)
                    tl.store(generation_ptr + slot, tl.load(generation_ptr + slot) + 1)
            if n != L - 1:
                A = tl.load(A_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
                C_t = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + cols, mask=mask_n, other=0.0).to(tl.float32)
                # Ring weights of every head of the program, and B_j · C shared by all of them.
                dts = tl.load(ring_dt_ptr + ring_heads[:, None] * L + js[None, :],
                              mask=mask_h[:, None] & older[None, :], other=0.0)
                dts = tl.where(current[None, :], dt[:, None], dts)  # [BLOCK_H, BLOCK_L]; zero after the current token
                total = agree_rows(tl.sum(dts, axis=1), BLOCK_L, AGREE)  # [BLOCK_H]
                weights = tl.exp(A[:, None] * (total[:, None] - tl.cumsum(dts, axis=1))) * dts  # [BLOCK_H, BLOCK_L]
                decay = tl.exp(A * total)  # [BLOCK_H]
                B_ring = tl.load(ring_B_ptr + (ring_group * L + js[:, None]) * DSTATE + cols[None, :],
                                 mask=older[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
                B_ring = tl.where(current[:, None], B_t.to(tl.float32)[None, :], B_ring)  # [BLOCK_L, BLOCK_N]
                BC = agree_rows(tl.sum(B_ring * C_t[None, :], axis=1), BLOCK_N, AGREE)  # [BLOCK_L]
                ring_coef = weights * BC[None, :]  # [BLOCK_H, BLOCK_L]
                if HAS_D:
                    D = tl.load(D_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
                tile_mask = mask_p[:, None] & mask_n[None, :]
                for i in tl.range(0, HEADS_PER_PROG, num_stages=LOOP_STAGES):
                    h = h0 + i
                    pick = lanes == i
                    ring_head = slot.to(tl.int64) * nheads + h
                    state, row_scale = load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols, tile_mask,
                                                         nheads, HEADDIM, DSTATE, DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
                    x_t = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + rows, mask=mask_p, other=0.0)
                    # [BLOCK_P]; frees the tile's registers
                    state_C = agree_rows(tl.sum(state * C_t[None, :], axis=1), BLOCK_N, AGREE) * row_scale
                    tl.store(ring_x_ptr + (ring_head * L + n) * HEADDIM + rows, x_t, mask=mask_p)
                    x_ring = tl.load(ring_x_ptr + (ring_head * L + js[:, None]) * HEADDIM + rows[None, :],
                                     mask=older[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
                    x_t = x_t.to(tl.float32)
                    x_ring = tl.where(current[:, None], x_t[None, :], x_ring)  # [BLOCK_L, BLOCK_P]
                    coef = tl.sum(tl.where(pick[:, None], ring_coef, 0.0), axis=0)  # [BLOCK_L]: this head's row
                    y_ring = agree_cols(tl.sum(coef[:, None] * x_ring, axis=0), BLOCK_L, AGREE)  # [BLOCK_P]
                    y = tl.sum(tl.where(pick, decay, 0.0), axis=0) * state_C + y_ring
                    if HAS_D:
                        y += tl.sum(tl.where(pick, D, 0.0), axis=0) * x_t
                    if HAS_Z:
                        z = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + rows, mask=mask_p, other=0.0).to(tl.float32)
                        y = gate(y, z, HW)
                    flag_nonfinite(slot_flags_ptr, slot, y, mask_p)
                    y_ptrs = y_ptr + b * stride_y_b + h * stride_y_h + rows
                    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=mask_p)
            else:
                # A full row's output comes from the flush kernel: only its tokens join the ring, all
                # the program's heads in one load and one store (a loop over heads made the step
                # kernel of a flush step a chain of round trips: 27.5 µs at batch 256 on the H200).
                mask_hp = mask_h[:, None] & mask_p[None, :]
                x_heads = tl.load(x_ptr + b * stride_x_b + heads[:, None] * stride_x_h + rows[None, :], mask=mask_hp,
                                  other=0.0)  # [BLOCK_H, BLOCK_P]
                tl.store(ring_x_ptr + (ring_heads[:, None] * L + n) * HEADDIM + rows[None, :], x_heads, mask=mask_hp)


@triton.jit
def _replay_flush_kernel(
    x_ptr, A_ptr, C_ptr, D_ptr, z_ptr, slot_ptr, y_ptr,
    ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr,
    cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr, slot_flags_ptr, seed,
    stride_x_b, stride_x_h, stride_C_b, stride_C_g, stride_z_b, stride_z_h, stride_y_b, stride_y_h,
    batch, num_slots, headdim, dstate,
    NHEADS: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    L: tl.constexpr,
    CK_DTYPE: tl.constexpr, CK_GRAN: tl.constexpr, CK_SR: tl.constexpr, CK_QMAX: tl.constexpr,
    CK_EMAX: tl.constexpr,
    HAS_READ: tl.constexpr, RD_DTYPE: tl.constexpr, RD_GRAN: tl.constexpr, RD_SR: tl.constexpr,
    RD_QMAX: tl.constexpr, RD_EMAX: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr,
    LOOP_STAGES: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr, AGREE: tl.constexpr = False,
):
    pdl.grid_dependency(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    columns = NHEADS * NUM_P_TILES
    count = tl.load(flush_counters_ptr)
    # One work item per (listed row, head, P-tile), the column fastest, dealt round-robin: any
    # grid size then gives every program the same work to within one item.
    for item in tl.range(pid, count * columns, programs, num_stages=LOOP_STAGES):
        r = item // columns
        h, p_tile, g, rows, cols, mask_p, mask_n = head_tile(item % columns, HEADS_PER_GROUP, headdim, dstate,
                                                             NUM_P_TILES, BLOCK_P, BLOCK_N)
        mask = mask_p[:, None] & mask_n[None, :]
        A = tl.load(A_ptr + h).to(tl.float32)
        b = tl.load(flush_rows_ptr + r)
        slot = slot_of(slot_ptr, b, HAS_SLOTS)
        ring_head = slot.to(tl.int64) * NHEADS + h
        ring_group = slot.to(tl.int64) * (NHEADS // HEADS_PER_GROUP) + g
        ring, total = fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, L, A, rows, cols, mask_p,
                                mask_n, headdim, dstate, L, BLOCK_L, BLOCK_P, BLOCK_N, AGREE, False, 0.0, 0.0,
                                0.0)
        _flush_tile(ring, total, A, x_ptr, C_ptr, D_ptr, z_ptr, y_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr,
                    slot_flags_ptr, seed, tl.load(generation_ptr + slot), b, slot, h, g, rows, cols, mask_p, mask_n,
                    mask, stride_x_b, stride_x_h, stride_C_b, stride_C_g, stride_z_b, stride_z_h, stride_y_b,
                    stride_y_h, NHEADS, headdim, dstate, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX, CK_EMAX, HAS_READ,
                    RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX, HW, HAS_D, HAS_Z, BLOCK_P, BLOCK_N, AGREE)
    # Every row's cursor inside its ring moves on by one token (to 0 after a flush; one outside
    # stays, its slot flagged by the step kernel); the step kernel of this call has finished,
    # so no program reads a cursor while it changes.
    batch_rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = batch_rows < batch
    if HAS_SLOTS:
        slots = tl.load(slot_ptr + batch_rows, mask=in_batch, other=-1).to(tl.int32)
    else:
        slots = tl.where(in_batch, batch_rows, -1)
    live = (slots >= 0) & (slots < num_slots)
    n = tl.load(cursor_ptr + slots, mask=live, other=0)
    tl.store(cursor_ptr + slots, tl.where(n + 1 == L, 0, n + 1), mask=live & ~cursor_outside(n, L))
    # The last program to finish empties the flush list: every program has read `count` by then.
    # An empty list needs no emptying, so then no program takes a ticket: on most steps of a
    # cycle the one atomic per program on one address was most of this kernel's time.
    if count > 0:
        finished = tl.atomic_add(flush_counters_ptr + 1, 1)
        if finished == programs - 1:
            tl.store(flush_counters_ptr, 0)
            tl.store(flush_counters_ptr + 1, 0)
            # And zeroes the list's entries: the single-launch step counts tickets in them.
            for first in range(0, count, BLOCK_R):
                tl.store(flush_rows_ptr + first + tl.arange(0, BLOCK_R), tl.zeros([BLOCK_R], tl.int32),
                         mask=first + tl.arange(0, BLOCK_R) < count)
