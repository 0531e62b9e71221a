"""Replay decode (DESIGN.md §3, §3.1): a step kernel for every row and a flush kernel for the
rows whose ring became full, plus their launcher. Derivations and traffic: kernels/README.md,
"Replay".

Step kernel, grid ``(nheads × P-tiles, batch)``: reads the slot's cursor ``n`` (tokens in the
ring), appends the token at ``n``, and, unless the ring is now full, writes the output from the
read copy (or the checkpoint) and the ring. A row whose ring is full is put on the step's
flush list (an atomic counter) and gets its output from the flush kernel.

Grouped step kernel (``launch_replay_decode(heads_per_program=k)``, ``k ≥ 1``), grid
``(nheads / k × P-tiles, batch)``: the same work and bookkeeping for ``k`` heads of one group
per program, with what the heads share (slot, cursor, the ring's B and ``B_j · C``) loaded or
computed once. Which kernel runs by default: ``default_heads_per_program``.

Flush kernel, grid ``(G,)`` with ``G`` the programs that fit on the GPU at once (a few per
multiprocessor, not one per row): the flush list's work is dealt round-robin as (row, head,
P-tile) items; each item folds the ring into the checkpoint (from the stored checkpoint, in
fp32) and writes the output, the new checkpoint and the read copy.
It also advances every row's cursor, and the last program to finish clears the list, so the
next step starts clean without the host looking.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common import codec, exact_dot, gpu, pdl, sizes
from ..common.launch import CompiledLaunch, register_cap
from ..common.gate import gate
from ..common.softplus import softplus


@triton.jit
def _head_tile(program, heads_per_group, headdim, dstate, NUM_P_TILES: tl.constexpr, BLOCK_P: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Head, P-tile, group, rows, columns and their masks of a program numbered over
    (head × P-tile)."""
    h = program // NUM_P_TILES
    p_tile = program % NUM_P_TILES
    rows = p_tile * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    return h, p_tile, h // heads_per_group, rows, cols, rows < headdim, cols < dstate


@triton.jit
def _slot_of(slot_ptr, b, HAS_SLOTS: tl.constexpr):
    """The cache slot of batch row ``b`` (the row itself without slot indices)."""
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + b).to(tl.int32)
    else:
        slot = b
    return slot


@triton.jit
def _process_dt(dt_ptr, dt_bias_ptr, h, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    dt = tl.load(dt_ptr).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    return dt


@triton.jit
def _load_scaled_codes(codes_ptr, scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
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
        tl.static_assert(GRAN != 3)
        values = exact_dot.bf16_codes(codes, DTYPE, HW)
    else:
        values = codec.decode(codes, DTYPE, HW)
    if GRAN == 1:
        row_scale = tl.load(scale_ptr + head * headdim + rows, mask=rows < headdim, other=1.0)
    elif GRAN == 2:
        row_scale = tl.zeros([BLOCK_P], tl.float32) + tl.load(scale_ptr + head)
    else:
        row_scale = tl.full([BLOCK_P], 1.0, tl.float32)
    if GRAN == 3:
        NB: tl.constexpr = BLOCK_N // 32
        blocks = tl.arange(0, NB)
        scale = tl.load(scale_ptr + (head * headdim + rows[:, None]) * (dstate // 32) + blocks[None, :],
                        mask=(rows[:, None] < headdim) & (blocks[None, :] < dstate // 32), other=1.0)
        values = tl.reshape(tl.reshape(values, [BLOCK_P, NB, 32]) * scale[:, :, None], [BLOCK_P, BLOCK_N])
    return values, row_scale


@triton.jit
def _load_state(codes_ptr, scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 values ``code · scale`` of one head's ``[BLOCK_P, BLOCK_N]`` tile."""
    values, row_scale = _load_scaled_codes(codes_ptr, scale_ptr, slot, h, rows, cols, mask, nheads, headdim, dstate,
                                           DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
    if GRAN == 1 or GRAN == 2:
        values = values * row_scale[:, None]
    return values


@triton.jit
def _grid_values(v, u, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The values of the codes ``codec.encode(v, u, ...)`` gives, in fp32 (v saturated and scaled)."""
    if STOCHASTIC:
        g = codec.round_sr(v, u, DTYPE)
    else:
        g = codec.round_rne(v, DTYPE)
    if DTYPE == 5:
        g = tl.where(g == 0.0, 0.0, g)  # int8 has no −0: a code 0 decodes to +0
    return g


@triton.jit
def _store_state(values, mask, codes_ptr, scale_ptr, seed, slot, h, rows, cols, nheads, headdim, dstate,
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
    if DTYPE == 0:
        # fp32 stores the values as they are, as the reference does (formats.quantize): no
        # clamp to ±FLT_MAX, which was two instructions per element of the flush loop.
        codes = values
        stored = values
    elif GRAN == 0 and STOCHASTIC and DTYPE == 1:
        # bf16 rounds on the bits (codec.encode_sr16), and its codes are the top halves of fp32s.
        codes = codec.encode_sr16(values, 1.0, noise, QMAX, DTYPE, HW)
        stored = (codes.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif GRAN == 0:
        saturated = codec.saturate(values, QMAX)
        codes = codec.encode(saturated, u, DTYPE, STOCHASTIC, HW)
        stored = _grid_values(saturated, u, DTYPE, STOCHASTIC)
    else:
        head = slot.to(tl.int64) * nheads + h
        magnitude = tl.where(mask, tl.abs(values), 0.0)
        if GRAN == 1:
            scale = codec.scale_from_amax(tl.max(magnitude, axis=1), QMAX, EMAX, GRAN)  # [BLOCK_P]
            tl.store(scale_ptr + head * headdim + rows, scale, mask=rows < headdim)
            scale_tile = tl.broadcast_to(scale[:, None], [BLOCK_P, BLOCK_N])
        elif GRAN == 2:
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
def _fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, count, A, rows, cols, mask_p, mask_n,
               headdim, dstate, CAP: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The ring's first ``count`` tokens folded over a zero state, ``Σ_j exp(A·(Λ − Λ_j))·dt_j ·
    x_j ⊗ B_j`` ([BLOCK_P, BLOCK_N] fp32), and ``Λ = Σ_j dt_j``.

    One ``[BLOCK_P, 16] × [16, BLOCK_N]`` product per 16 tokens ("ieee": fp32 products): a
    single product over a 32-token ring took every register and spilled, and one rank-1 update
    per token was slower on the H200 (replay flush step 1360 µs against 1221, batch 256). Only
    the chunks that hold tokens are multiplied (the products are FMAs, most of the kernel's
    instructions): a verify flush folds 13–20 tokens of a 32-token tile."""
    CHUNK: tl.constexpr = 16
    js = tl.arange(0, BLOCK_J)
    total = tl.sum(tl.load(ring_dt_ptr + ring_head * CAP + js, mask=js < count, other=0.0), axis=0)
    ring = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    before = total * 0.0  # Σ dt of the earlier chunks (an fp32 tensor, as the loop carries it)
    for c in range(0, tl.cdiv(count, CHUNK)):
        jc = c * CHUNK + tl.arange(0, CHUNK)
        live = jc < count
        dts = tl.load(ring_dt_ptr + ring_head * CAP + jc, mask=live, other=0.0)  # [CHUNK]
        weights = tl.exp(A * (total - (before + tl.cumsum(dts, axis=0)))) * dts
        before += tl.sum(dts, axis=0)
        x_ring = tl.load(ring_x_ptr + (ring_head * CAP + jc[:, None]) * headdim + rows[None, :],
                         mask=live[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # [CHUNK, BLOCK_P]
        B_ring = tl.load(ring_B_ptr + (ring_group * CAP + jc[:, None]) * dstate + cols[None, :],
                         mask=live[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [CHUNK, BLOCK_N]
        ring += tl.dot(tl.trans(weights[:, None] * x_ring), B_ring, input_precision="ieee")
    return ring, total


@triton.jit
def _gate_and_store(y, x_t, y_ptrs, z_ptrs, mask_p, D_ptr, h, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                    HW: tl.constexpr):
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x_t
    if HAS_Z:
        z = tl.load(z_ptrs, mask=mask_p, other=0.0).to(tl.float32)
        y = gate(y, z, HW)
    tl.store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask=mask_p)


@triton.jit
def _replay_step_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr,
    flush_rows_ptr, flush_counters_ptr,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_y_b, stride_y_h,
    num_slots, nheads, headdim, dstate, heads_per_group,
    L: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, STATE_FIRST: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl.grid_dependency(PDL)
    h, p_tile, g, rows, cols, mask_p, mask_n = _head_tile(tl.program_id(0), heads_per_group, headdim, dstate,
                                                          NUM_P_TILES, BLOCK_P, BLOCK_N)
    b = tl.program_id(1)
    y_ptrs = y_ptr + b * stride_y_b + h * stride_y_h + rows
    slot = _slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        # Padding outputs zeros; an index past the cache (unchecked on a GPU, to avoid a sync)
        # outputs NaN. Neither writes any slot.
        bad = tl.where(slot < 0, 0.0, float("nan"))
        tl.store(y_ptrs, (tl.zeros([BLOCK_P], tl.float32) + bad).to(y_ptrs.dtype.element_ty), mask=mask_p)
    else:
        # Loads that do not depend on the cursor go first, so their latency overlaps its load.
        # The state tile goes with them only where STATE_FIRST (kernels/README.md, "the state and
        # the cursor"); else it waits for the cursor, and a flushing row (n = L − 1) reads none.
        # Either way it is reduced to S·C at once, so it holds no registers through the ring work.
        mask = mask_p[:, None] & mask_n[None, :]
        if STATE_FIRST:
            state, row_scale = _load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols, mask, nheads,
                                                  headdim, dstate, DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
        C_t = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + cols, mask=mask_n, other=0.0).to(tl.float32)
        dt = _process_dt(dt_ptr + b * stride_dt_b + h, dt_bias_ptr, h, HAS_BIAS, SOFTPLUS)
        x_t = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + rows, mask=mask_p, other=0.0)
        B_t = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + cols, mask=mask_n, other=0.0)
        n = tl.load(cursor_ptr + slot)
        if STATE_FIRST:
            state_C = tl.sum(state * C_t[None, :], axis=1) * row_scale  # [BLOCK_P]
        full = n == L - 1
        ring_head = slot.to(tl.int64) * nheads + h
        ring_group = slot.to(tl.int64) * (nheads // heads_per_group) + g
        tl.store(ring_x_ptr + (ring_head * L + n) * headdim + rows, x_t, mask=mask_p)
        if p_tile == 0:
            tl.store(ring_dt_ptr + ring_head * L + n, dt)
            if h % heads_per_group == 0:
                tl.store(ring_B_ptr + (ring_group * L + n) * dstate + cols, B_t, mask=mask_n)
            if (h == 0) & full:
                position = tl.atomic_add(flush_counters_ptr, 1)
                tl.store(flush_rows_ptr + position, b)
                tl.store(generation_ptr + slot, tl.load(generation_ptr + slot) + 1)
        if n != L - 1:
            if not STATE_FIRST:
                state, row_scale = _load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols, mask, nheads,
                                                      headdim, dstate, DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
                state_C = tl.sum(state * C_t[None, :], axis=1) * row_scale  # [BLOCK_P]
            A = tl.load(A_ptr + h).to(tl.float32)
            js = tl.arange(0, BLOCK_L)
            older = js < n
            current = js == n
            dts = tl.load(ring_dt_ptr + ring_head * L + js, mask=older, other=0.0)
            dts = tl.where(current, dt, dts)  # [BLOCK_L]; zero after the current token
            total = tl.sum(dts, axis=0)
            since = total - tl.cumsum(dts, axis=0)  # Λ_t − Λ_j
            weights = tl.exp(A * since) * dts
            B_ring = tl.load(ring_B_ptr + (ring_group * L + js[:, None]) * dstate + cols[None, :],
                             mask=older[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            B_ring = tl.where(current[:, None], B_t.to(tl.float32)[None, :], B_ring)  # [BLOCK_L, BLOCK_N]
            BC = tl.sum(B_ring * C_t[None, :], axis=1)  # [BLOCK_L]
            x_ring = tl.load(ring_x_ptr + (ring_head * L + js[:, None]) * headdim + rows[None, :],
                             mask=older[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
            x_ring = tl.where(current[:, None], x_t.to(tl.float32)[None, :], x_ring)  # [BLOCK_L, BLOCK_P]
            y_ring = tl.sum((weights * BC)[:, None] * x_ring, axis=0)  # [BLOCK_P]
            y = tl.exp(A * total) * state_C + y_ring
            _gate_and_store(y, x_t.to(tl.float32), y_ptrs, z_ptr + b * stride_z_b + h * stride_z_h + rows,
                            mask_p, D_ptr, h, HAS_D, HAS_Z, HW)


@triton.jit
def _replay_step_grouped_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    state_ptr, state_scale_ptr, ring_x_ptr, ring_dt_ptr, ring_B_ptr, cursor_ptr, generation_ptr,
    flush_rows_ptr, flush_counters_ptr,
    stride_x_b, stride_x_h, stride_dt_b, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_y_b, stride_y_h,
    num_slots, nheads,
    HEADDIM: tl.constexpr, DSTATE: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    L: tl.constexpr, DTYPE: tl.constexpr, GRAN: tl.constexpr, HW: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, NUM_P_TILES: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """The step kernel's work for ``HEADS_PER_PROG`` heads of one group per program, grid
    ``(nheads / HEADS_PER_PROG × P-tiles, batch)``: slot, cursor, the ring's dts and B, and
    ``B_j · C`` are loaded or computed once for all the program's heads, and a pipelined loop
    over the heads streams their state tiles and x rings (kernels/README.md, "grouped step")."""
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
    slot = _slot_of(slot_ptr, b, HAS_SLOTS)
    if (slot < 0) | (slot >= num_slots):
        # Padding outputs zeros; an index past the cache outputs NaN. Neither writes any slot.
        bad = tl.where(slot < 0, 0.0, float("nan"))
        y_tile = y_ptr + b * stride_y_b + heads[:, None] * stride_y_h + rows[None, :]  # [BLOCK_H, BLOCK_P]
        tl.store(y_tile, (tl.zeros([BLOCK_H, BLOCK_P], tl.float32) + bad).to(y_tile.dtype.element_ty),
                 mask=mask_h[:, None] & mask_p[None, :])
    else:
        n = tl.load(cursor_ptr + slot)
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
            total = tl.sum(dts, axis=1)  # [BLOCK_H]
            weights = tl.exp(A[:, None] * (total[:, None] - tl.cumsum(dts, axis=1))) * dts  # [BLOCK_H, BLOCK_L]
            decay = tl.exp(A * total)  # [BLOCK_H]
            B_ring = tl.load(ring_B_ptr + (ring_group * L + js[:, None]) * DSTATE + cols[None, :],
                             mask=older[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
            B_ring = tl.where(current[:, None], B_t.to(tl.float32)[None, :], B_ring)  # [BLOCK_L, BLOCK_N]
            BC = tl.sum(B_ring * C_t[None, :], axis=1)  # [BLOCK_L]
            ring_coef = weights * BC[None, :]  # [BLOCK_H, BLOCK_L]
            if HAS_D:
                D = tl.load(D_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
            tile_mask = mask_p[:, None] & mask_n[None, :]
            for i in tl.range(0, HEADS_PER_PROG, num_stages=LOOP_STAGES):
                h = h0 + i
                pick = lanes == i
                ring_head = slot.to(tl.int64) * nheads + h
                state, row_scale = _load_scaled_codes(state_ptr, state_scale_ptr, slot, h, rows, cols, tile_mask,
                                                      nheads, HEADDIM, DSTATE, DTYPE, GRAN, HW, BLOCK_P, BLOCK_N)
                x_t = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + rows, mask=mask_p, other=0.0)
                state_C = tl.sum(state * C_t[None, :], axis=1) * row_scale  # [BLOCK_P]; frees the tile's registers
                tl.store(ring_x_ptr + (ring_head * L + n) * HEADDIM + rows, x_t, mask=mask_p)
                x_ring = tl.load(ring_x_ptr + (ring_head * L + js[:, None]) * HEADDIM + rows[None, :],
                                 mask=older[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
                x_t = x_t.to(tl.float32)
                x_ring = tl.where(current[:, None], x_t[None, :], x_ring)  # [BLOCK_L, BLOCK_P]
                coef = tl.sum(tl.where(pick[:, None], ring_coef, 0.0), axis=0)  # [BLOCK_L]: this head's row
                y_ring = tl.sum(coef[:, None] * x_ring, axis=0)  # [BLOCK_P]
                y = tl.sum(tl.where(pick, decay, 0.0), axis=0) * state_C + y_ring
                if HAS_D:
                    y += tl.sum(tl.where(pick, D, 0.0), axis=0) * x_t
                if HAS_Z:
                    z = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + rows, mask=mask_p, other=0.0).to(tl.float32)
                    y = gate(y, z, HW)
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
    cursor_ptr, generation_ptr, flush_rows_ptr, flush_counters_ptr, seed,
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
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
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
        h, p_tile, g, rows, cols, mask_p, mask_n = _head_tile(item % columns, HEADS_PER_GROUP, headdim, dstate,
                                                              NUM_P_TILES, BLOCK_P, BLOCK_N)
        mask = mask_p[:, None] & mask_n[None, :]
        A = tl.load(A_ptr + h).to(tl.float32)
        b = tl.load(flush_rows_ptr + r)
        slot = _slot_of(slot_ptr, b, HAS_SLOTS)
        ring_head = slot.to(tl.int64) * NHEADS + h
        ring_group = slot.to(tl.int64) * (NHEADS // HEADS_PER_GROUP) + g
        # The fold before the state loads: loaded first, the state tiles held their registers
        # through the product (flush step 1221 µs against 928 on the H200).
        ring, total = _fold_ring(ring_x_ptr, ring_dt_ptr, ring_B_ptr, ring_head, ring_group, L, A, rows, cols, mask_p,
                                 mask_n, headdim, dstate, L, BLOCK_L, BLOCK_P, BLOCK_N)
        checkpoint = _load_state(ck_ptr, ck_scale_ptr, slot, h, rows, cols, mask, NHEADS, headdim, dstate,
                                 CK_DTYPE, CK_GRAN, HW, BLOCK_P, BLOCK_N)
        # The new state, unrounded: the row's output reads it (not the old read copy, which a
        # flush never loads), and the checkpoint and read copy store it.
        # Written twice on purpose: one tensor feeding both the output's sum and the stores took
        # the fp8 read-copy kernel past its 128-register cap (spills: 2760 against 1856
        # instructions per thread, bench.sass_count); both compile to the same FMA.
        decay = tl.exp(A * total)
        C_t = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + cols, mask=mask_n, other=0.0).to(tl.float32)
        y = tl.sum((ring + decay * checkpoint) * C_t[None, :], axis=1)
        new_state = decay * checkpoint + ring  # [BLOCK_P, BLOCK_N]
        x_t = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + rows, mask=mask_p, other=0.0).to(tl.float32)
        _gate_and_store(y, x_t, y_ptr + b * stride_y_b + h * stride_y_h + rows,
                        z_ptr + b * stride_z_b + h * stride_z_h + rows, mask_p, D_ptr, h, HAS_D, HAS_Z, HW)
        # Stochastic rounding: one Philox stream per (slot, flush), the element's row and octet as counter.
        stream = seed + (slot.to(tl.int64) << 32) + tl.load(generation_ptr + slot).to(tl.int64) * 2
        stored = _store_state(new_state, mask, ck_ptr, ck_scale_ptr, stream, slot, h, rows, cols,
                              NHEADS, headdim, dstate, CK_DTYPE, CK_GRAN, CK_SR, CK_QMAX, CK_EMAX, HW, BLOCK_P, BLOCK_N)
        if HAS_READ:
            _store_state(stored, mask, read_ptr, read_scale_ptr, stream + 1, slot, h, rows, cols,
                         NHEADS, headdim, dstate, RD_DTYPE, RD_GRAN, RD_SR, RD_QMAX, RD_EMAX, HW, BLOCK_P, BLOCK_N)
    # Every row's cursor moves on by one token (to 0 after a flush); the step kernel of this
    # call has finished, so no program reads a cursor while it changes.
    batch_rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    in_batch = batch_rows < batch
    if HAS_SLOTS:
        slots = tl.load(slot_ptr + batch_rows, mask=in_batch, other=-1).to(tl.int32)
    else:
        slots = tl.where(in_batch, batch_rows, -1)
    live = (slots >= 0) & (slots < num_slots)
    n = tl.load(cursor_ptr + slots, mask=live, other=0)
    tl.store(cursor_ptr + slots, tl.where(n + 1 == L, 0, n + 1), mask=live)
    # The last program to finish empties the flush list: every program has read `count` by then.
    # An empty list needs no emptying, so then no program takes a ticket: on most steps of a
    # cycle the one atomic per program on one address was most of this kernel's time.
    if count > 0:
        finished = tl.atomic_add(flush_counters_ptr + 1, 1)
        if finished == programs - 1:
            tl.store(flush_counters_ptr, 0)
            tl.store(flush_counters_ptr + 1, 0)


# (rows of headdim, warps) of the per-head step kernel's tile, by bytes per element of the state
# it reads. The rows were chosen when this kernel also served batch 256, where the step is bound
# by instruction issue (ncu on the H200: 0.84 warps issued per scheduler per cycle, DRAM 25 %),
# so a tile is as fast as its instructions per state element: with an fp8 read copy 64 rows
# took the normal step from 173.6 to 103.3 µs (32 × 1: 122.2; 64 × 4: 182.0); with an fp32
# checkpoint 32 rows stayed fastest (265.9 against 300.4 and 279.0). It now serves fewer than
# GROUPED_MIN_BATCH rows, where one warp per program beat two in every case measured (H200,
# whole flush cycles, bench/results/sweeps-2026-12-02-e.log run 3: fp8 read copy batch 1 / 16 /
# 32 4.8 / 13.9 / 22.9 µs against 5.0 / 14.4 / 25.1, int8 5.1 / 14.8 / 24.9 against
# 5.2 / 14.7 / 26.4, no read copy 5.9 / 31.1 / 54.4 against 6.5 / 33.3 / 57.7; bf16 read copy,
# run 5, batch 1 / 16: 5.0 / 16.8 against 5.2 / 18.7). Below STEP_MIN_PROGRAMS programs the
# tile is split down to 32 rows, so a small batch still spreads over the GPU (batch 1, fp8: 6.2
# µs with 64-row tiles against 5.6–5.9 with 32).
STEP_TILE = {4: (32, 1), 2: (32, 1), 1: (64, 1)}
STEP_MIN_PROGRAMS = 1024
# Whether the per-head step kernel loads the state tile before the cursor arrives (True) or
# after it, skipping it for a flushing row (False), by bytes per element of the state it reads;
# below STATE_FIRST_BELOW_BATCH rows always before. H200, batch 256, one run: an fp8 read copy's
# whole cycle took 166.5 µs after against 175.8 before (flush step 934.1 / 1018.4, normal step
# 114.3 / 112.8); an fp32 checkpoint's normal step 305.5 after against 274.7 before, where the
# flush step saves only what the state read costs once per cycle. 16-bit read copies were not
# measured and keep the earlier order. fp8, one run of f003e92: batch 16 17.2 µs after against
# 18.2 before, batch 1 6.2 against 5.8 (a lone program waits for each round trip).
STATE_FIRST = {4: True, 2: True, 1: False}
STATE_FIRST_BELOW_BATCH = 16
# Step kernel choice (launch_replay_decode's heads_per_program): 0 = one head per program;
# k >= 1 = the grouped kernel with up to k heads per program. In the H200 run of a64908d (whole
# flush cycles, batch 256) the per-head kernel won with every read copy (fp8 176.5 µs against
# 256.9 grouped, int8 185.3 / 264.4, bf16 checkpoint + fp8 199.5 / 280.1; rings of 8 and 32
# tokens 228.5 / 259.6 and 185.0 / 250.5) and the grouped kernel without one (342.9 against
# 373.6; batch 64: 98.2 against 105.8; batch 16: 39.6 against 36.4; batch 1: 19.2 against 6.4).
# The grouped kernel's programs then had 4 warps. With one warp (below) it won with a read copy
# too (run of 9528325, batch 256, 8 heads: fp8 143.4 µs against 183.3 per-head, bf16 checkpoint
# + fp8 149.1 / 188.3, int8 162.0 / 187.1, rings of 8 and 32 tokens 194.4 / 222.7 and
# 139.5 / 180.6; no read copy 302.6 / 360.3; batch 16: fp8 21.2 / 17.4, no read copy 35.4 / 35.9;
# batch 1: 14.3 / 6.1 and 19.3 / 6.5). So the grouped kernel is the default from
# GROUPED_MIN_BATCH rows up, whatever the read copy, and the per-head kernel below.
# Its warps, heads per program and head-loop stages (kernel time of a whole cycle at batch 256,
# no read copy, bench.breakdown, one session of 5e58c00 runs): 1 warp, 4 heads, 2 stages 303.1 µs
# per step; 1 warp with 8 heads 305.9 (1 / 3 stages 306.8 / 309.8), 16 heads 309.8; 2 warps
# 315.5 (4 heads 308.6); 4 warps 328.3; 8 warps 411.3. Batch 64, 8 heads: 1 warp 94.6 µs, 2
# warps 98.3, per-head kernel 104.9; batch 16: 34.8 against 35.3 for the per-head kernel.
DEFAULT_HEADS_PER_PROGRAM = 4
GROUPED_MIN_BATCH = 64
GROUPED_WARPS = 1
GROUPED_STAGES = 2
# The flush kernel's tile, (rows of headdim, warps), and its programs per multiprocessor, by
# whether it writes a read copy. Its work is dealt as (listed row, head, P-tile) items over a
# grid of that many programs per multiprocessor, set to what fits at once (registers and shared
# memory of the tile as the H200's triton 3.6 compiles it: 149 registers × 64 threads, 6 per
# multiprocessor; 113 × 128 threads, 4), so the grid is one wave of equal programs. H200, batch
# 256, flush step (bench/results/sweeps-2026-12-02-e.log run 4): without a read copy 32 × 2 with
# 6 programs took 648.9 µs against 683.6 for 32 × 4 with 4 (16 × 2 with 8: 758.4; 16 × 4 with 7:
# 785.3; 16 × 1 with 13: 857.6; 32 × 2 with 8, more than fit: 857.7); with an fp8 read copy 32 × 4
# with 4 took 840.3 against 926.9–1618.9 for the others (32 × 2 spilled 110 registers).
# Before items, each program walked the list for one (head, P-tile), so programs came in
# multiples of the 256 columns: 512, the fp8 flush step 922.9 µs and its whole cycle 140.4
# against 135.4 with items (no read copy 297.9 against 296.5, same tile). A per-head scale's
# whole-head tile (8 warps; not timed with items) keeps the 4 programs per multiprocessor it had
# before. The kernel also runs on every normal step, to move the cursors on, where its cost
# grows with its programs (16 per multiprocessor took fp8 cycles from 141.4 to 143.3 µs against
# 4, sweeps-2026-12-01-c.log). The counts hold for the registers named above: a compiler that
# gives a tile more registers fits fewer programs, and a grid past one wave is slower.
FLUSH_TILE = {False: (32, 2), True: (32, 4)}
FLUSH_PROGRAMS_PER_SM = {False: 6, True: 4}
WHOLE_HEAD_FLUSH_PROGRAMS_PER_SM = 4
# Register caps that keep FLUSH_PROGRAMS_PER_SM resident whatever the formats and ring length
# (65536 registers per multiprocessor: 6 × 64 threads × 168, 4 × 128 × 128): the fp32 + fp8 L16
# kernels need less (149, and 113 since a flush loads no read copy: ncu, bench/README.md run of
# 0628dd4), but a 32-token ring, a bf16 checkpoint or a bf16 read copy
# take 135–168 (sm_90 listings, `bench.sass_count`), and one program fewer per multiprocessor
# makes the one-wave grid 1.33 waves.
FLUSH_MAXNREG = {False: 168, True: 128}
# Software-pipeline stages of the flush kernel's loop over items, by whether it writes a read
# copy (None: the compiler's default). H200, batch 256, every row flushing: without a read copy
# 3 stages took 729 µs against 914 (2: 785; bench/README.md, runs of 2026-12-01); with an fp8
# read copy they were slower, with items 1318.8 (2: 1280.7) against 840.3 (run 4), and at the
# no-read shape too (32 × 2, 6 per multiprocessor, 168 registers without spills: 909–911
# against 797–804, run 5 of bench/results/sweeps-2026-12-02-i.log; again in run 2 of
# sweeps-2026-12-03-q.log).
FLUSH_STAGES = {False: 3, True: None}


# Eager GPU launches through the compiled kernels (kernels/launch.py).
_launch_step = CompiledLaunch(_replay_step_kernel)
_launch_step_grouped = CompiledLaunch(_replay_step_grouped_kernel)
_launch_flush = CompiledLaunch(_replay_flush_kernel)


def default_heads_per_program(batch: int) -> int:
    """The step kernel the launcher picks when not told: the grouped kernel's
    ``DEFAULT_HEADS_PER_PROGRAM`` from ``GROUPED_MIN_BATCH`` rows up, else 0 (one head per program)."""
    return DEFAULT_HEADS_PER_PROGRAM if batch >= GROUPED_MIN_BATCH else 0


def grouped_heads_per_program(requested: int, heads_per_group: int) -> int:
    """Heads per program of the grouped step kernel: the largest divisor of ``heads_per_group``
    that is at most ``requested``, so that every program's heads share one group."""
    if requested < 1:
        raise ValueError(f"heads_per_program: expected an int >= 1 for the grouped kernel, got {requested}")
    return max(d for d in range(1, min(requested, heads_per_group) + 1) if heads_per_group % d == 0)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a replay step's two launches take besides the tensors and the input strides."""

    grouped: bool
    step_grid: tuple
    step_constexprs: dict
    flush_grid: tuple
    flush_constexprs: dict


@functools.lru_cache(maxsize=1024)
def _plan(batch, nheads, headdim, dstate, ngroups, L, device, state_bytes, checkpoint_format, read_format,
          has_d, has_z, has_bias, has_slots, dt_softplus, step_block_p, step_warps, heads_per_program,
          step_stages) -> _Plan:
    """Kernels, tiles, grids and constexprs of a replay step: a function of the call's metadata,
    so an eager caller computes it once per signature."""
    hw = codec.hardware_casts(device)
    has_read = read_format is not None
    state_fmt = read_format if has_read else checkpoint_format
    block_n = max(32, sizes.next_power_of_2(dstate))
    block_l = max(2, sizes.next_power_of_2(L))
    whole_p = sizes.next_power_of_2(headdim)  # a tile over the whole head
    use_pdl = pdl.enabled(device)
    common = dict(HAS_D=has_d, HAS_Z=has_z, HAS_SLOTS=has_slots, HW=hw, PDL=use_pdl, **pdl.launch_options(use_pdl))
    step = dict(L=L, DTYPE=codec.dtype_code(state_fmt), GRAN=codec.granularity_code(state_fmt),
                HAS_BIAS=has_bias, SOFTPLUS=dt_softplus, BLOCK_L=block_l, **common)
    heads_per_group = nheads // ngroups
    if heads_per_program is None:
        heads_per_program = default_heads_per_program(batch)
    if heads_per_program:
        per_program = grouped_heads_per_program(heads_per_program, heads_per_group)
        block_p = step_block_p or whole_p
        num_p_tiles = sizes.cdiv(headdim, block_p)
        step_grid = (nheads // per_program * num_p_tiles, batch)
        step.update(HEADDIM=headdim, DSTATE=dstate, HEADS_PER_GROUP=heads_per_group, NUM_P_TILES=num_p_tiles,
                    HEADS_PER_PROG=per_program, LOOP_STAGES=step_stages or GROUPED_STAGES,
                    BLOCK_H=max(2, sizes.next_power_of_2(per_program)), BLOCK_P=block_p, BLOCK_N=block_n,
                    num_warps=step_warps or GROUPED_WARPS)
    else:
        tile_rows, tile_warps = STEP_TILE[state_bytes]
        block_p = min(whole_p, tile_rows)
        while block_p > 32 and batch * nheads * sizes.cdiv(headdim, block_p) < STEP_MIN_PROGRAMS:
            block_p //= 2
        block_p = step_block_p or block_p
        num_p_tiles = sizes.cdiv(headdim, block_p)
        step_grid = (nheads * num_p_tiles, batch)
        step.update(NUM_P_TILES=num_p_tiles, STATE_FIRST=STATE_FIRST[state_bytes] or batch < STATE_FIRST_BELOW_BATCH,
                    BLOCK_P=block_p, BLOCK_N=block_n, num_warps=step_warps or tile_warps)
    # A per-head scale needs the whole head in one flush tile.
    whole_head = "head" in (checkpoint_format.granularity, read_format.granularity if has_read else None)
    flush_tile_rows, flush_warps = FLUSH_TILE[has_read]
    flush_block_p = whole_p if whole_head else min(flush_tile_rows, whole_p)
    flush_p_tiles = sizes.cdiv(headdim, flush_block_p)
    per_sm = WHOLE_HEAD_FLUSH_PROGRAMS_PER_SM if whole_head else FLUSH_PROGRAMS_PER_SM[has_read]
    programs = max(1, min(batch * nheads * flush_p_tiles, per_sm * gpu.sm_count(device)))
    flush = dict(
        NHEADS=nheads, HEADS_PER_GROUP=heads_per_group, L=L,
        CK_DTYPE=codec.dtype_code(checkpoint_format), CK_GRAN=codec.granularity_code(checkpoint_format),
        CK_SR=checkpoint_format.stochastic, CK_QMAX=codec.qmax(checkpoint_format),
        CK_EMAX=codec.emax(checkpoint_format), HAS_READ=has_read,
        RD_DTYPE=codec.dtype_code(read_format) if has_read else 0,
        RD_GRAN=codec.granularity_code(read_format) if has_read else 0,
        RD_SR=read_format.stochastic if has_read else False,
        RD_QMAX=codec.qmax(read_format) if has_read else 1.0,
        RD_EMAX=codec.emax(read_format) if has_read else 0,
        NUM_P_TILES=flush_p_tiles, LOOP_STAGES=FLUSH_STAGES[has_read], BLOCK_L=max(16, block_l),
        BLOCK_P=flush_block_p, BLOCK_N=block_n, BLOCK_R=max(16, sizes.next_power_of_2(sizes.cdiv(batch, programs))),
        num_warps=8 if whole_head else flush_warps,
        **register_cap(None if whole_head else FLUSH_MAXNREG[has_read], device), **common,
    )
    return _Plan(bool(heads_per_program), step_grid, step, (programs,), flush)


def launch_replay_decode(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, slot_indices: Optional[torch.Tensor], out,
    checkpoint, checkpoint_scale, read, read_scale, ring_x, ring_dt, ring_B, cursor, generation,
    flush_rows, flush_counters, *, checkpoint_format, read_format, seed: int,
    step_block_p: Optional[int] = None, step_warps: Optional[int] = None,
    heads_per_program: Optional[int] = None, step_stages: Optional[int] = None,
):
    """Launch one replay decode step. Arguments are already validated (``qstate.ops.replay``):
    x, z, out ``(batch, nheads, headdim)`` and B, C ``(batch, ngroups, dstate)`` with unit
    stride in the last dimension, cache tensors contiguous; formats are ``StateFormat``s.
    ``heads_per_program`` picks the step kernel (None: :func:`default_heads_per_program`; 0: one
    head per program; k ≥ 1: the grouped kernel with the largest divisor of the heads per group
    that is ≤ k). ``step_block_p`` / ``step_warps`` / ``step_stages`` override the step
    kernel's tile height, warps and (grouped) head-loop pipeline stages (tuning)."""
    on_gpu = x.is_cuda
    for launch, grid, args, constexprs in _decode_launches(
            x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out, checkpoint, checkpoint_scale, read,
            read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters,
            checkpoint_format=checkpoint_format, read_format=read_format, seed=seed, step_block_p=step_block_p,
            step_warps=step_warps, heads_per_program=heads_per_program, step_stages=step_stages):
        launch(grid, args, constexprs, on_gpu)


def knows_decode(key) -> bool:
    """Whether :func:`prepare_decode` has seen ``key`` (prepared, or not preparable)."""
    return _launch_flush.knows(key)


def prepare_decode(key, tensors, *args, **kwargs) -> None:
    """After ``launch_replay_decode(*args, **kwargs)``: keep its two launches under ``key`` for
    :func:`launch_decode_prepared`. ``tensors``: the caller's ``(x, dt, A, B, C, D, z, dt_bias,
    slot_indices, out, checkpoint, checkpoint_scale, read, read_scale, ring_x, ring_dt, ring_B,
    cursor, generation, flush_rows, flush_counters)``, each the tensor given to the launcher or
    one it is a view of at the same address (``launch.CompiledLaunch.prepare``). ``key`` must
    hold everything the launcher reads besides those tensors' addresses: their shapes, strides,
    dtypes and device, the formats, the flag and the seed."""
    on_gpu = args[0].is_cuda
    for (launch, grid, launch_args, constexprs), leading in zip(_decode_launches(*args, **kwargs),
                                                                 _decode_leading(*tensors)):
        launch.prepare(key, grid, launch_args, constexprs, leading, on_gpu)


def launch_decode_prepared(key, *tensors) -> bool:
    """The two launches kept under ``key`` by :func:`prepare_decode`, with these tensors (the
    order of ``prepare_decode``'s); False, and nothing launched, unless both fit them."""
    flush = _launch_flush.prepared(key)
    if flush is None:
        return False
    step = _launch_step_grouped.prepared(key) or _launch_step.prepared(key)
    if step is None:
        return False
    step_leading, flush_leading = _decode_leading(*tensors)
    if not (step.fits(*step_leading) and flush.fits(*flush_leading)):
        return False
    step.launch(*step_leading)
    flush.launch(*flush_leading)
    return True


def _decode_leading(x, dt, A, B, C, D, z, dt_bias, slot_indices, out, checkpoint, checkpoint_scale, read,
                    read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters):
    """The tensor arguments that open the step and the flush kernels' argument lists, in order;
    ``x`` stands for absent optional pointers (never read: constexpr flags)."""
    has_read = read is not None
    z_arg = z if z is not None else x
    D_arg = D if D is not None else x
    slots_arg = slot_indices if slot_indices is not None else x
    ring = (ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters)
    state, state_scale = (read, read_scale) if has_read else (checkpoint, checkpoint_scale)
    step = (x, dt, A, B, C, D_arg, z_arg, dt_bias if dt_bias is not None else x, slots_arg, out, state,
            state_scale if state_scale is not None else x, *ring)
    flush = (x, A, C, D_arg, z_arg, slots_arg, out, checkpoint,
             checkpoint_scale if checkpoint_scale is not None else x, read if has_read else x,
             read_scale if read_scale is not None else x, *ring)
    return step, flush


def _decode_launches(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out, checkpoint, checkpoint_scale, read, read_scale,
    ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, *, checkpoint_format, read_format, seed,
    step_block_p=None, step_warps=None, heads_per_program=None, step_stages=None,
):
    """``(CompiledLaunch, grid, args, constexprs)`` of :func:`launch_replay_decode`'s step and
    flush kernels, in launch order."""
    batch, nheads, headdim = x.shape
    has_read = read is not None
    state = read if has_read else checkpoint
    plan = _plan(batch, nheads, headdim, B.shape[2], B.shape[1], ring_x.shape[2], x.device, state.element_size(),
                 checkpoint_format, read_format if has_read else None, D is not None, z is not None,
                 dt_bias is not None, slot_indices is not None, bool(dt_softplus), step_block_p, step_warps,
                 heads_per_program, step_stages)
    step_leading, flush_leading = _decode_leading(
        x, dt, A, B, C, D, z, dt_bias, slot_indices, out, codec.storage_view(checkpoint, checkpoint_format),
        checkpoint_scale, codec.storage_view(read, read_format) if has_read else None, read_scale, ring_x, ring_dt,
        ring_B, cursor, generation, flush_rows, flush_counters)
    z_arg = z if z is not None else x
    x_strides, C_strides, z_strides, out_strides = x.stride(), C.stride(), z_arg.stride(), out.stride()
    B_strides = B.stride()
    num_slots = checkpoint.shape[0]
    step_args = (
        *step_leading,
        x_strides[0], x_strides[1], dt.stride(0), B_strides[0], B_strides[1], C_strides[0], C_strides[1],
        z_strides[0], z_strides[1], out_strides[0], out_strides[1],
    )
    if plan.grouped:
        step = (_launch_step_grouped, plan.step_grid, (*step_args, num_slots, nheads), plan.step_constexprs)
    else:
        step = (_launch_step, plan.step_grid,
                (*step_args, num_slots, nheads, headdim, B.shape[2], nheads // B.shape[1]), plan.step_constexprs)
    flush = (_launch_flush, plan.flush_grid, (
        *flush_leading, seed,
        x_strides[0], x_strides[1], C_strides[0], C_strides[1], z_strides[0], z_strides[1],
        out_strides[0], out_strides[1], batch, num_slots, headdim, B.shape[2],
    ), plan.flush_constexprs)
    return step, flush
