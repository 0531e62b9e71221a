"""Speculative decoding on replay (DESIGN.md §3.2): verify T draft tokens per row without writing
state, commit by moving the cursor; and the per-draft-state baseline serving engines use today.
Derivations and traffic: kernels/README.md, "Speculative decoding".

Verify, four launches that keep every decision on the device:

* ``_group_BC_kernel``, grid ``(batch, ngroups)``: ``B_j · C_i`` for every position j of the
  row's joint sequence and every draft i, once per group (16 heads × P-tiles used to recompute
  it), into a small fp32 buffer.
* ``_verify_kernel``, grid ``(nheads × P-tiles, batch)``: reads the slot's cursor ``n``. A row
  whose ring could not hold the next round's drafts (``n > 0`` and ``n + 2T > capacity``) goes
  on the flush list and waits. Every other row computes its T outputs from the read copy (or
  checkpoint), the ``n`` committed ring tokens and the drafts, causally, and appends the drafts
  at ``n … n+T−1``. ``S · C_i`` over a state whose codes are exact in bf16 is one tensor-core
  product for all drafts (``exact_dot.py``).
* ``_verify_flush_kernel``, grid ``(G, nheads × P-tiles)``: for each listed row folds the ``n``
  committed tokens into the checkpoint (fp32, from the stored checkpoint) and stores it and the
  read copy. It computes no outputs: their registers made it the slowest kernel of a round.
* ``_verify_flushed_rows_kernel``, grid ``(G, nheads × P-tiles)``: for each listed row, the
  verify kernel's work at cursor 0 over the new read copy (T outputs, drafts appended at
  ``0 … T−1``, after the fold has read the old tokens there); its last program sets the
  listed cursors to 0 and clears the list.

Every live row's ``drafts[slot]`` becomes T. ``_commit_kernel`` moves ``cursor += accepted``
and zeroes ``drafts``; a row with no pending drafts or ``accepted`` outside ``0 … drafts``
leaves its slot untouched and sets a bit of ``commit_errors`` (1: no verify, 2: out of range).

Baseline: ``_drafts_kernel`` updates the state over the T tokens in registers and stores the
state after every token into ``intermediate[row, t]`` (T state writes per row);
``_copy_accepted_kernel`` copies ``intermediate[row, accepted − 1]`` into the slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import codec, exact_dot, gpu, sizes
from .conventional import tile_config
from ..common.launch import CompiledLaunch, register_cap
from .replay import _fold_ring, _head_tile, _load_scaled_codes, _load_state, _process_dt, _slot_of, _store_state
from ..common.gate import gate
from ..common.softplus import softplus

ERROR_NO_VERIFY = 1
ERROR_ACCEPTED_RANGE = 2

# Programs per multiprocessor of the kernels that walk the flush list (each for one head and
# P-tile): the fold, and the flushed rows' drafts. More (64/16, 256/64) were no faster on the H200
# (batch 256, T = 4: fold 183–291 µs against 177–246). The fold's count is rounded down
# (flush_programs: 8 × 256 programs, fold 97.3 / 121.9 µs without / with an fp8 read
# copy, against 98.9 / 124.2 rounded up to 9 × 256); the drafts' is rounded up (3 × 256: 88.1 µs
# without a read copy; 2 × 256 took 146.0).
FLUSH_PROGRAMS_PER_SM = 16
FLUSHED_ROWS_PROGRAMS_PER_SM = 4
# (rows of headdim, warps) of each kernel's tile, by the state it reads (fp32; "tensor": codes
# exact in bf16, with the tensor-core S · C_i; other 8/16-bit states "narrow"), from the H200
# sweeps at batch 256, T = 4 (bench/README.md, "Speculative tiles"). The tensor-core product
# took the fp8 verify from 168 to 92 registers at 16 rows, so larger tiles pay: 64 rows × 2 warps
# 169.6 µs, 32 × 1 172.5, 32 × 2 174.1, 16 × 1 202.4.
VERIFY_TILE = {"fp32": (8, 1), "narrow": (16, 1), "tensor": (64, 2)}
# Register caps (ptxas .maxnreg; None: its choice): more programs per multiprocessor against a
# few spills. H200, batch 256, T = 4, fp8 read copy (bench/README.md, "Speculative tiles"):
# verify at 96 registers 158.7–160.6 µs against 169.1 uncapped (80: 174.7); fold at 128 123.5
# against 133.6 (96: 136.8); the flushed rows' drafts were no faster capped (96: 55.8 against 53.0).
VERIFY_MAXNREG = 96
FLUSH_MAXNREG = 128
FLUSHED_ROWS_MAXNREG = None
FLUSH_TILE = (32, 4)
FLUSHED_ROWS_TILE = (16, 1)
# S · C_i of states whose codes are exact in bf16 as one tensor-core product (exact_dot.py);
# False: one FMA dot per draft (the only way for fp32, fp16 and block32 states).
TENSOR_DOT = True


@triton.jit
def _store_unserved(y_row_ptr, stride_y_t, slot, mask_p, T: tl.constexpr, BLOCK_P: tl.constexpr):
    """The T outputs of a row the kernel does not serve: padding (slot < 0) outputs zeros, an
    index past the cache (unchecked on a GPU, to avoid a sync) NaN."""
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
    p_tile, nheads, heads_per_group,
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
    state, row_scale = _load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols,
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
    slot = _slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot >= 0) & (slot < num_slots):
        n = tl.load(cursor_ptr + slot)
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
    drafts_ptr, flush_rows_ptr, flush_counters_ptr,
    stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
    stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t, stride_y_h,
    num_slots, nheads, headdim, dstate, heads_per_group,
    CAP: tl.constexpr, T: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, C_PARTS: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    h, p_tile, g, rows, cols, mask_p, mask_n = _head_tile(tl.program_id(0), heads_per_group, headdim, dstate,
                                                          NUM_P_TILES, BLOCK_P, BLOCK_N)
    b = tl.program_id(1)
    slot = _slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        _store_unserved(y_ptr + b * stride_y_b + h * stride_y_h + rows, stride_y_t, slot, mask_p, T, BLOCK_P)
    else:
        n = tl.load(cursor_ptr + slot)
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
                x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr,
                p_tile, nheads, heads_per_group,
                stride_x_b, stride_x_t, stride_x_h, stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
                stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t, stride_z_h, stride_y_b, stride_y_t,
                stride_y_h, headdim, dstate, CAP, T, DTYPE, GRAN, HW, HAS_D, HAS_Z, HAS_BIAS, SOFTPLUS, BLOCK_J,
                C_PARTS, BLOCK_J, BLOCK_P, BLOCK_N, BLOCK_T,
            )


@triton.jit
def _verify_flush_kernel(
    A_ptr, slot_ptr, ck_ptr, ck_scale_ptr, read_ptr, read_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr,
    cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr, seed,
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
    h, p_tile, g, rows, cols, mask_p, mask_n = _head_tile(tl.program_id(1), heads_per_group, headdim, dstate,
                                                          NUM_P_TILES, BLOCK_P, BLOCK_N)
    programs = tl.num_programs(0)
    mask = mask_p[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + h).to(tl.float32)
    count = tl.load(flush_counters_ptr)
    for r in range(pid, count, programs):
        b = tl.load(flush_rows_ptr + r)
        slot = _slot_of(slot_ptr, b, HAS_SLOTS)
        n = tl.load(cursor_ptr + slot)  # committed tokens; the drafts kernel zeroes it later
        ring_head = slot.to(tl.int64) * nheads + h
        ring_group = slot.to(tl.int64) * (nheads // heads_per_group) + g
        ring, total = _fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, n, A, rows, cols, mask_p,
                                 mask_n, headdim, dstate, CAP, BLOCK_J, BLOCK_P, BLOCK_N)
        checkpoint = _load_state(ck_ptr, ck_scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                                 CK_DTYPE, CK_GRAN, HW, BLOCK_P, BLOCK_N)
        # Stochastic rounding: one Philox stream per (slot, flush), as the replay flush draws it.
        stream = seed + (slot.to(tl.int64) << 32) + tl.load(generation_ptr + slot).to(tl.int64) * 2
        stored = _store_state(tl.exp(A * total) * checkpoint + ring, mask, ck_ptr, ck_scale_ptr, stream, slot, h,
                              rows, cols, nheads, headdim, dstate, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX, CK_EMAX, HW,
                              BLOCK_P, BLOCK_N)
        if HAS_READ:
            _store_state(stored, mask, read_ptr, read_scale_ptr, stream + 1, slot, h, rows, cols,
                         nheads, headdim, dstate, RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX, HW, BLOCK_P, BLOCK_N)


@triton.jit
def _verify_flushed_rows_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr, cursor_ptr,
    flush_rows_ptr, flush_counters_ptr,
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
    h, p_tile, g, rows, cols, mask_p, mask_n = _head_tile(tl.program_id(1), heads_per_group, headdim, dstate,
                                                          NUM_P_TILES, BLOCK_P, BLOCK_N)
    programs = tl.num_programs(0)
    A = tl.load(A_ptr + h).to(tl.float32)
    count = tl.load(flush_counters_ptr)
    for r in range(pid, count, programs):
        b = tl.load(flush_rows_ptr + r)
        slot = _slot_of(slot_ptr, b, HAS_SLOTS)
        # The flush kernel has stored the new read copy (or checkpoint): the drafts are the
        # ring's only tokens, so they are verified and appended as at cursor 0.
        _draft_outputs(
            state_ptr, state_scale_ptr, slot, 0, b, h, g, rows, cols, mask_p, mask_n, A,
            x_ptr, dt_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, y_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, BC_ptr,
            p_tile, nheads, heads_per_group,
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
def _commit_kernel(accepted_ptr, slot_ptr, cursor_ptr, drafts_ptr, errors_ptr, batch, num_slots,
                   HAS_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr):
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
    ok = live & (pending > 0) & (accepted >= 0) & (accepted <= pending)
    n = tl.load(cursor_ptr + slots, mask=ok, other=0)
    tl.store(cursor_ptr + slots, n + accepted, mask=ok)
    tl.store(drafts_ptr + slots, tl.zeros([BLOCK_R], tl.int32), mask=ok)
    bits = tl.max(no_verify.to(tl.int32), axis=0) * 1 + tl.max(out_of_range.to(tl.int32), axis=0) * 2
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
    h, p_tile, g, rows, cols, mask_p, mask_n = _head_tile(tl.program_id(0), heads_per_group, headdim, dstate,
                                                          NUM_P_TILES, BLOCK_P, BLOCK_N)
    b = tl.program_id(1)
    mask = mask_p[:, None] & mask_n[None, :]
    slot = _slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        _store_unserved(y_ptr + b * stride_y_b + h * stride_y_h + rows, stride_y_t, slot, mask_p, T, BLOCK_P)
    else:
        state = _load_state(state_ptr, state_scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                            DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)  # [BLOCK_P, BLOCK_N]
        A = tl.load(A_ptr + h).to(tl.float32)
        for i in tl.static_range(T):
            dt = _process_dt(dt_ptr + b * stride_dt_b + i * stride_dt_t + h, dt_bias_ptr, h, HAS_BIAS, SOFTPLUS)
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
            state = _store_state(state, mask, inter_ptr, inter_scale_ptr, 0, b * T_MAX + i, h, rows, cols,
                                 nheads, headdim, dstate, DTYPE, GRAN, False, QMAX, EMAX, HW, BLOCK_P, BLOCK_N)


@triton.jit
def _copy_accepted_kernel(src_ptr, dst_ptr, accepted_ptr, slot_ptr, per_slot, num_slots,
                          T_MAX: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(1)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + b).to(tl.int64)
    else:
        slot = b.to(tl.int64)
    accepted = tl.load(accepted_ptr + b).to(tl.int64)
    if (slot >= 0) & (slot < num_slots) & (accepted > 0) & (accepted <= T_MAX):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < per_slot
        source = (b.to(tl.int64) * T_MAX + accepted - 1) * per_slot
        tl.store(dst_ptr + slot * per_slot + offsets, tl.load(src_ptr + source + offsets, mask=inside), mask=inside)


# ------------------------------------------------------------------------------------ launchers

# Eager GPU launches through the compiled kernels (kernels/launch.py).
_launch_group_BC = CompiledLaunch(_group_BC_kernel)
_launch_verify = CompiledLaunch(_verify_kernel)
_launch_verify_flush = CompiledLaunch(_verify_flush_kernel)
_launch_flushed_rows = CompiledLaunch(_verify_flushed_rows_kernel)
_launch_commit = CompiledLaunch(_commit_kernel)
_launch_drafts = CompiledLaunch(_drafts_kernel)
_launch_copy_accepted = CompiledLaunch(_copy_accepted_kernel)


def _strides(x, dt, B, C, z, out):
    """Row, token and head/group strides of the (batch, T, ...) inputs, in the kernels' order."""
    z_strides = (z.stride(0), z.stride(1), z.stride(2)) if z is not None else (0, 0, 0)
    return (x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2),
            C.stride(0), C.stride(1), C.stride(2), *z_strides, out.stride(0), out.stride(1), out.stride(2))


def _format_constants(fmt, prefix):
    present = fmt is not None
    return {
        f"{prefix}DTYPE": codec.dtype_code(fmt) if present else 0,
        f"{prefix}GRAN": codec.granularity_code(fmt) if present else 0,
        f"{prefix}SR": fmt.stochastic if present else False,
        f"{prefix}QMAX": codec.qmax(fmt) if present else 1.0,
        f"{prefix}EMAX": codec.emax(fmt) if present else 0,
    }


def _tensor_dot(state_fmt) -> bool:
    """Whether the draft kernels take ``S · C_i`` as a tensor-core product for this state."""
    return TENSOR_DOT and exact_dot.exact_in_bf16(state_fmt)


def draft_c_parts(state_fmt, c_dtype: torch.dtype, block_p: int) -> int:
    """``C_PARTS`` of the draft kernels: the bf16 parts of C for a tensor-core ``S · C_i``, or 0
    (FMA dots) for states whose codes are not exact in bf16 and tiles of fewer than 16 rows."""
    return exact_dot.input_parts(c_dtype) if _tensor_dot(state_fmt) and block_p >= 16 else 0


def flush_programs(batch: int, columns: int, per_sm: int, device: torch.device) -> int:
    """Programs per (head, P-tile) column of a kernel that walks the flush list: at most
    ``per_sm`` per multiprocessor over all ``columns``, rounded down (a whole number of waves
    when the resident programs per multiprocessor divide ``per_sm``), and at most ``batch``."""
    return max(1, min(batch, per_sm * gpu.sm_count(device) // columns))


@dataclasses.dataclass(frozen=True)
class _VerifyPlan:
    """What a verify's four launches take besides the tensors and the input strides."""

    bc_shape: tuple  # the B_j · C_i buffer's (batch, ngroups, positions, drafts)
    bc_grid: tuple
    bc_constexprs: dict
    verify_grid: tuple
    verify_constexprs: dict
    flush_grid: tuple
    flush_constexprs: dict
    rows_grid: tuple
    rows_constexprs: dict


@functools.lru_cache(maxsize=1024)
def _verify_plan(batch, T, nheads, headdim, dstate, ngroups, cap, device, checkpoint_format, read_format, c_dtype,
                 has_d, has_z, has_bias, dt_softplus, has_slots, block_p, num_warps) -> _VerifyPlan:
    """Tiles, grids and constexprs of a verify: a function of the call's metadata, so an eager
    caller computes them once per signature."""
    hw = codec.hardware_casts(device)
    has_read = read_format is not None
    state_fmt = read_format if has_read else checkpoint_format
    block_n = max(32, sizes.next_power_of_2(dstate))
    block_j = max(16, sizes.next_power_of_2(cap))
    block_t = max(2, sizes.next_power_of_2(T))
    whole_p = sizes.next_power_of_2(headdim)  # a tile over the whole head
    # Joint-sequence positions a verify can use: a row that does not flush has n = 0 or
    # n ≤ cap − 2T committed tokens, so n + T ≤ max(cap − T, T); the flushed rows have n = 0.
    # Tiles no longer than that (16 instead of 32 positions at T = 4, L = 16) keep the ring part
    # of the verify, which is bound by instruction issue, to the positions in use.
    bc_rows = max(4, sizes.next_power_of_2(max(cap - T, T)))
    flushed_rows_j = max(4, sizes.next_power_of_2(T))
    whole_state_head = state_fmt.granularity == "head"
    # A per-head scale needs the whole head in one tile.
    tile_kind = "fp32" if state_fmt.dtype == "fp32" else "tensor" if _tensor_dot(state_fmt) else "narrow"
    verify_p, verify_warps = VERIFY_TILE[tile_kind]
    if whole_state_head:
        verify_p, verify_warps = whole_p, 4
    block_p = block_p or min(whole_p, verify_p)
    num_p_tiles = sizes.cdiv(headdim, block_p)
    flags = dict(HAS_D=has_d, HAS_Z=has_z, HAS_BIAS=has_bias, SOFTPLUS=dt_softplus, HAS_SLOTS=has_slots)
    state_constants = dict(CAP=cap, T=T, DTYPE=codec.dtype_code(state_fmt), GRAN=codec.granularity_code(state_fmt),
                           HW=hw)
    verify = dict(**state_constants, NUM_P_TILES=num_p_tiles, C_PARTS=draft_c_parts(state_fmt, c_dtype, block_p),
                  BLOCK_J=bc_rows, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_T=block_t,
                  num_warps=num_warps or verify_warps, **register_cap(VERIFY_MAXNREG, device), **flags)
    # The flush walks the list in a few programs per multiprocessor.
    whole_head = "head" in (checkpoint_format.granularity, read_format.granularity if has_read else None)
    flush_block_p = whole_p if whole_head else min(FLUSH_TILE[0], whole_p)
    flush_p_tiles = sizes.cdiv(headdim, flush_block_p)
    programs = flush_programs(batch, nheads * flush_p_tiles, FLUSH_PROGRAMS_PER_SM, device)
    flush = dict(CAP=cap, **_format_constants(checkpoint_format, "CK_"), HAS_READ=has_read,
                 **_format_constants(read_format, "RD_"), HW=hw, HAS_SLOTS=has_slots, NUM_P_TILES=flush_p_tiles,
                 BLOCK_J=block_j, BLOCK_P=flush_block_p, BLOCK_N=block_n,
                 num_warps=8 if whole_head else FLUSH_TILE[1], **register_cap(FLUSH_MAXNREG, device))
    # The flushed rows' drafts over the new state.
    rows_p, rows_warps = FLUSHED_ROWS_TILE
    if whole_state_head:
        rows_p, rows_warps = whole_p, 4
    rows_p = min(rows_p, whole_p)
    rows_p_tiles = sizes.cdiv(headdim, rows_p)
    rows_programs = max(1, min(batch, sizes.cdiv(FLUSHED_ROWS_PROGRAMS_PER_SM * gpu.sm_count(device),
                                                  nheads * rows_p_tiles)))
    rows = dict(**state_constants, NUM_P_TILES=rows_p_tiles, BC_ROWS=bc_rows,
                C_PARTS=draft_c_parts(state_fmt, c_dtype, rows_p), BLOCK_J=flushed_rows_j, BLOCK_P=rows_p,
                BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_R=max(16, min(1024, sizes.next_power_of_2(batch))),
                num_warps=rows_warps, **register_cap(FLUSHED_ROWS_MAXNREG, device), **flags)
    return _VerifyPlan(
        (batch, ngroups, bc_rows, block_t), (batch, ngroups),
        dict(CAP=cap, T=T, HAS_SLOTS=has_slots, BLOCK_J=bc_rows, BLOCK_N=block_n, BLOCK_T=block_t, num_warps=4),
        (nheads * num_p_tiles, batch), verify, (programs, nheads * flush_p_tiles), flush,
        (rows_programs, nheads * rows_p_tiles), rows)


def launch_replay_verify(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, slot_indices: Optional[torch.Tensor], out,
    checkpoint, checkpoint_scale, read, read_scale, ring_x, ring_dt, ring_B, cursor, generation, drafts,
    flush_rows, flush_counters, *, checkpoint_format, read_format, seed: int,
    block_p: Optional[int] = None, num_warps: Optional[int] = None,
):
    """Launch one verify. Arguments are validated (``qstate.ops.speculative``): x, z, out
    ``(batch, T, nheads, headdim)``, dt ``(batch, T, nheads)``, B, C ``(batch, T, ngroups,
    dstate)``, unit stride in the last dimension; cache tensors contiguous, ring capacity
    ``ring_x.shape[2] ≥ T``. ``block_p`` / ``num_warps`` override the verify kernel's tile."""
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    has_read = read is not None
    plan = _verify_plan(batch, T, nheads, headdim, dstate, ngroups, ring_x.shape[2], x.device, checkpoint_format,
                        read_format if has_read else None, C.dtype, D is not None, z is not None,
                        dt_bias is not None, bool(dt_softplus), slot_indices is not None, block_p, num_warps)
    state_fmt = read_format if has_read else checkpoint_format
    state, state_scale = (read, read_scale) if has_read else (checkpoint, checkpoint_scale)
    dummy = x  # stands for absent optional pointers; never read (constexpr flags)
    z_arg = z if z is not None else dummy
    slots_arg = slot_indices if slot_indices is not None else dummy
    D_arg = D if D is not None else dummy
    bias_arg = dt_bias if dt_bias is not None else dummy
    state_scale_arg = state_scale if state_scale is not None else dummy
    strides = _strides(x, dt, B, C, z, out)
    num_slots = checkpoint.shape[0]
    on_gpu = x.is_cuda
    # B_j · C_i once per row and group (every head and tile of the group reads it).
    BC = torch.empty(plan.bc_shape, dtype=torch.float32, device=x.device)
    _launch_group_BC(plan.bc_grid, (
        B, C, slots_arg, ring_B, cursor, BC, B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1),
        C.stride(2), num_slots, dstate), plan.bc_constexprs, on_gpu)
    _launch_verify(plan.verify_grid, (
        x, dt, A, B, C, D_arg, z_arg, bias_arg, slots_arg, out, codec.storage_view(state, state_fmt), state_scale_arg,
        ring_x, ring_dt, ring_B, BC, cursor, generation, drafts, flush_rows, flush_counters,
        *strides, num_slots, nheads, headdim, dstate, nheads // ngroups), plan.verify_constexprs, on_gpu)
    _launch_verify_flush(plan.flush_grid, (
        A, slots_arg, codec.storage_view(checkpoint, checkpoint_format),
        checkpoint_scale if checkpoint_scale is not None else dummy,
        codec.storage_view(read, read_format) if has_read else dummy, read_scale if read_scale is not None else dummy,
        ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, seed,
        nheads, headdim, dstate, nheads // ngroups), plan.flush_constexprs, on_gpu)
    _launch_flushed_rows(plan.rows_grid, (
        x, dt, A, B, C, D_arg, z_arg, bias_arg, slots_arg, out, codec.storage_view(state, state_fmt), state_scale_arg,
        ring_x, ring_dt, ring_B, BC, cursor, flush_rows, flush_counters,
        *strides, nheads, headdim, dstate, nheads // ngroups), plan.rows_constexprs, on_gpu)


@functools.lru_cache(maxsize=1024)
def _commit_plan(batch, has_slots) -> tuple:
    """Grid and constexprs of a commit."""
    block_r = max(16, min(1024, sizes.next_power_of_2(batch)))
    return (sizes.cdiv(batch, block_r),), dict(HAS_SLOTS=has_slots, BLOCK_R=block_r, num_warps=4)


def launch_replay_commit(num_accepted, slot_indices, cursor, drafts, commit_errors, num_slots: int):
    """Launch one commit: ``num_accepted (batch,)`` int32/int64, ``slot_indices (batch,)`` or None."""
    batch = num_accepted.shape[0]
    grid, constexprs = _commit_plan(batch, slot_indices is not None)
    _launch_commit(grid, (
        num_accepted, slot_indices if slot_indices is not None else num_accepted, cursor, drafts, commit_errors,
        batch, num_slots), constexprs, num_accepted.is_cuda)


@functools.lru_cache(maxsize=1024)
def _drafts_plan(batch, T, t_max, nheads, headdim, dstate, state_bytes, device, state_format, has_d, has_z,
                 has_bias, dt_softplus, has_slots, block_p, num_warps) -> tuple:
    """Grid and constexprs of the per-draft-state baseline."""
    config_p, _, config_warps = tile_config(state_bytes, headdim, dstate, codec.granularity_code(state_format),
                                            batch, nheads, device.type == "cuda")
    block_p = block_p or config_p
    num_p_tiles = sizes.cdiv(headdim, block_p)
    return (nheads * num_p_tiles, batch), dict(
        T=T, T_MAX=t_max, DTYPE=codec.dtype_code(state_format), GRAN=codec.granularity_code(state_format),
        QMAX=codec.qmax(state_format), EMAX=codec.emax(state_format), HW=codec.hardware_casts(device),
        HAS_D=has_d, HAS_Z=has_z, HAS_BIAS=has_bias, SOFTPLUS=dt_softplus, HAS_SLOTS=has_slots,
        NUM_P_TILES=num_p_tiles, BLOCK_P=block_p, BLOCK_N=max(32, sizes.next_power_of_2(dstate)),
        num_warps=num_warps or config_warps)


def launch_drafts(
    state, state_scale, intermediate, intermediate_scale, x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool,
    slot_indices, out, *, state_format, block_p: Optional[int] = None, num_warps: Optional[int] = None,
):
    """Launch the per-draft-state baseline on validated arguments: ``state (slots, nheads,
    headdim, dstate)`` and ``intermediate (batch, T_max, nheads, headdim, dstate)`` in the
    format's storage dtype (contiguous), inputs as in :func:`launch_replay_verify`."""
    batch, T, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2], B.shape[3]
    grid, constexprs = _drafts_plan(batch, T, intermediate.shape[1], nheads, headdim, dstate, state.element_size(),
                                    x.device, state_format, D is not None, z is not None, dt_bias is not None,
                                    bool(dt_softplus), slot_indices is not None, block_p, num_warps)
    dummy = x
    _launch_drafts(grid, (
        codec.storage_view(state, state_format), state_scale if state_scale is not None else dummy,
        codec.storage_view(intermediate, state_format), intermediate_scale if intermediate_scale is not None else dummy,
        x, dt, A, B, C, D if D is not None else dummy, z if z is not None else dummy,
        dt_bias if dt_bias is not None else dummy, slot_indices if slot_indices is not None else dummy, out,
        *_strides(x, dt, B, C, z, out), state.shape[0], nheads, headdim, dstate, nheads // ngroups),
        constexprs, x.is_cuda)


@functools.lru_cache(maxsize=1024)
def _copy_plan(t_max, has_slots, block) -> dict:
    """Constexprs of a copy of accepted states."""
    return dict(T_MAX=t_max, HAS_SLOTS=has_slots, BLOCK=block, num_warps=4)


def launch_copy_accepted(src, dst, num_accepted, slot_indices, *, block: int = 4096):
    """Copy ``src[row, accepted − 1]`` (``src (batch, T_max, ...)``) into ``dst[slot]``
    (``dst (slots, ...)``), bit for bit, for the rows with ``accepted > 0``."""
    batch, t_max = src.shape[0], src.shape[1]
    per_slot = dst[0].numel()
    if dst.element_size() < 4 and dst.shape[-1] * dst.element_size() % 4 == 0:
        # Move whole 32-bit words: the copy is bit for bit anyway.
        src, dst = src.view(torch.int32), dst.view(torch.int32)
        per_slot = dst[0].numel()
    _launch_copy_accepted((sizes.cdiv(per_slot, block), batch), (
        src, dst, num_accepted, slot_indices if slot_indices is not None else num_accepted, per_slot, dst.shape[0]),
        _copy_plan(t_max, slot_indices is not None, block), dst.is_cuda)
