"""Replay decode's launcher: a step kernel for every row and a flush kernel for the rows whose
ring became full (the kernels: :mod:`.replay_kernels`). Derivations and traffic:
kernels/mamba2/README.md, "Replay".

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

Single-launch step kernel (``launch_replay_decode(fused=True)``; by default on a GPU below
``FUSED_BELOW_BATCH`` rows), grid ``(nheads × P-tiles, batch)`` at the flush kernel's tile: the
per-head step kernel whose flushing rows' programs also do the flush kernel's work for their
tile, so a step is one launch and normal rows never wait for a second kernel. The last program
of each row to finish (a ticket per slot in ``flush_rows``) moves its cursor and generation.
Outputs and checkpoints are bit-identical to the two-launch path's per-head kernel.

Every kernel takes ``agree`` (constexpr ``AGREE``, on by default): each fp32 sum that feeds an
output is made bit-identical across the lanes holding it before any layout conversion
(``ring.agree_rows``), so no conversion writes differently rounded replicas to one shared
address (racecheck's WAW reports; ``agree=False`` is the plain form, kept for comparison).
``fp_fusion=False`` compiles every kernel without FMA contraction (a diagnostic: it changes
roundings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..common import codec, gpu, pdl, sizes
from ..common.launch import CompiledLaunch, PreparedLaunches, register_cap
from .replay_kernels import (_replay_flush_kernel, _replay_step_fused_kernel, _replay_step_grouped_kernel,
                             _replay_step_kernel)


# Tuning constants below: the fastest in H200 sweeps (figures in kernels/mamba2/README.md).

# (rows of headdim, warps) of the per-head step kernel's tile by state bytes per element; below
# STEP_MIN_PROGRAMS programs the tile is split down to 32 rows, to spread a small batch.
STEP_TILE = {4: (32, 1), 2: (32, 1), 1: (64, 1)}
STEP_MIN_PROGRAMS = 1024
# Whether the per-head step kernel loads the state tile before the cursor (True) or after it,
# skipping it for a flushing row, by state bytes per element; before below STATE_FIRST_BELOW_BATCH rows.
STATE_FIRST = {4: True, 2: True, 1: False}
STATE_FIRST_BELOW_BATCH = 16
# Default step kernel: the grouped one (DEFAULT_HEADS_PER_PROGRAM heads, GROUPED_WARPS warps,
# GROUPED_STAGES head-loop stages) from GROUPED_MIN_BATCH rows up, the per-head one below.
DEFAULT_HEADS_PER_PROGRAM = 4
GROUPED_MIN_BATCH = 64
GROUPED_WARPS = 1
GROUPED_STAGES = 2
# The flush kernel's tile (rows, warps) and programs per multiprocessor, by whether it writes a
# read copy: one wave of as many programs as fit (a per-head scale's whole-head tile: its own count).
FLUSH_TILE = {False: (32, 2), True: (32, 4)}
FLUSH_PROGRAMS_PER_SM = {False: 6, True: 4}
WHOLE_HEAD_FLUSH_PROGRAMS_PER_SM = 4
# Register caps keeping FLUSH_PROGRAMS_PER_SM resident whatever the formats and ring length
# (65536 registers per multiprocessor: 6 × 64 threads × 168, 4 × 128 × 128).
FLUSH_MAXNREG = {False: 168, True: 128}
# Software-pipeline stages of the flush kernel's loop over items, by whether it writes a read copy
# (None: the compiler's default).
FLUSH_STAGES = {False: 3, True: None}
# The single-launch step kernel by default below this many rows: H200 cycles at batch 1 5.1 against
# 6.7 µs (fp32), 4.7 against 5.1 (fp8 read); slower from batch 16 (34.1 against 15.1 µs, fp8 read).
FUSED_BELOW_BATCH = 2
# The single-launch kernel's warps, by whether it writes a read copy (flushing programs carry the flush tile).
FUSED_WARPS = {False: 2, True: 4}


# Eager GPU launches through the compiled kernels (common/launch.py).
_launch_step = CompiledLaunch(_replay_step_kernel)
_launch_step_grouped = CompiledLaunch(_replay_step_grouped_kernel)
_launch_flush = CompiledLaunch(_replay_flush_kernel)
_launch_fused = CompiledLaunch(_replay_step_fused_kernel)


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
    fused: bool
    step_grid: tuple
    step_constexprs: dict
    flush_grid: tuple
    flush_constexprs: dict


@functools.lru_cache(maxsize=1024)
def _plan(batch, nheads, headdim, dstate, ngroups, L, device, state_bytes, checkpoint_format, read_format,
          has_d, has_z, has_bias, has_slots, dt_softplus, step_block_p, step_warps, heads_per_program,
          step_stages, fused, agree, fp_fusion) -> _Plan:
    """Kernels, tiles, grids and constexprs of a replay step: a function of the call's metadata,
    so an eager caller computes it once per signature."""
    hw = codec.hardware_casts(device)
    has_read = read_format is not None
    state_fmt = read_format if has_read else checkpoint_format
    block_n = max(32, sizes.next_power_of_2(dstate))
    block_l = max(2, sizes.next_power_of_2(L))
    whole_p = sizes.next_power_of_2(headdim)  # a tile over the whole head
    use_pdl = pdl.enabled(device)
    common = dict(HAS_D=has_d, HAS_Z=has_z, HAS_SLOTS=has_slots, HW=hw, PDL=use_pdl, AGREE=bool(agree),
                  **pdl.launch_options(use_pdl), **_fp_fusion_option(fp_fusion, device))
    step = dict(L=L, DTYPE=codec.dtype_code(state_fmt), GRAN=codec.granularity_code(state_fmt),
                HAS_BIAS=has_bias, SOFTPLUS=dt_softplus, BLOCK_L=block_l, **common)
    heads_per_group = nheads // ngroups
    # A per-head scale needs the whole head in one flush tile.
    whole_head = "head" in (checkpoint_format.granularity, read_format.granularity if has_read else None)
    flush_tile_rows, flush_warps = FLUSH_TILE[has_read]
    flush_block_p = whole_p if whole_head else min(flush_tile_rows, whole_p)
    flush_p_tiles = sizes.cdiv(headdim, flush_block_p)
    formats = dict(
        CK_DTYPE=codec.dtype_code(checkpoint_format), CK_GRAN=codec.granularity_code(checkpoint_format),
        CK_SR=checkpoint_format.stochastic, CK_QMAX=codec.qmax(checkpoint_format),
        CK_EMAX=codec.emax(checkpoint_format), HAS_READ=has_read,
        RD_DTYPE=codec.dtype_code(read_format) if has_read else 0,
        RD_GRAN=codec.granularity_code(read_format) if has_read else 0,
        RD_SR=read_format.stochastic if has_read else False,
        RD_QMAX=codec.qmax(read_format) if has_read else 1.0,
        RD_EMAX=codec.emax(read_format) if has_read else 0,
    )
    if fused is None:
        # A GPU timing choice; the interpreter keeps two launches (the single launch equals them bit for bit).
        fused = device.type == "cuda" and batch < FUSED_BELOW_BATCH
    if fused:
        # The flush kernel's tile, so that a flushing program folds exactly as the flush kernel does.
        block_p = step_block_p or flush_block_p
        num_p_tiles = sizes.cdiv(headdim, block_p)
        step.update(NUM_P_TILES=num_p_tiles, STATE_FIRST=STATE_FIRST[state_bytes] or batch < STATE_FIRST_BELOW_BATCH,
                    BLOCK_P=block_p, BLOCK_N=block_n, num_warps=step_warps or (8 if whole_head else FUSED_WARPS[has_read]),
                    **formats)
        step["BLOCK_J"] = max(16, block_l)  # the flush kernel's, for the fold's sums
        return _Plan(False, True, (nheads * num_p_tiles, batch), step, (), {})
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
    per_sm = WHOLE_HEAD_FLUSH_PROGRAMS_PER_SM if whole_head else FLUSH_PROGRAMS_PER_SM[has_read]
    programs = max(1, min(batch * nheads * flush_p_tiles, per_sm * gpu.sm_count(device)))
    flush = dict(
        NHEADS=nheads, HEADS_PER_GROUP=heads_per_group, L=L, **formats,
        NUM_P_TILES=flush_p_tiles, LOOP_STAGES=FLUSH_STAGES[has_read], BLOCK_L=max(16, block_l),
        BLOCK_P=flush_block_p, BLOCK_N=block_n, BLOCK_R=max(16, sizes.next_power_of_2(sizes.cdiv(batch, programs))),
        num_warps=8 if whole_head else flush_warps,
        **register_cap(None if whole_head else FLUSH_MAXNREG[has_read], device), **common,
    )
    return _Plan(bool(heads_per_program), False, step_grid, step, (programs,), flush)


def _fp_fusion_option(fp_fusion: Optional[bool], device) -> dict:
    """Launch option compiling without FMA contraction (``fp_fusion=False``, on a GPU only)."""
    return {"enable_fp_fusion": False} if fp_fusion is False and device.type == "cuda" else {}


def launch_replay_decode(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus: bool, slot_indices: Optional[torch.Tensor], out,
    checkpoint, checkpoint_scale, read, read_scale, ring_x, ring_dt, ring_B, cursor, generation,
    flush_rows, flush_counters, slot_flags, *, checkpoint_format, read_format, seed: int,
    step_block_p: Optional[int] = None, step_warps: Optional[int] = None,
    heads_per_program: Optional[int] = None, step_stages: Optional[int] = None,
    fused: Optional[bool] = None, agree: bool = True, fp_fusion: Optional[bool] = None,
):
    """Launch one replay decode step. Arguments are already validated (``qstate.ops.replay``):
    x, z, out ``(batch, nheads, headdim)`` and B, C ``(batch, ngroups, dstate)`` with unit
    stride in the last dimension, cache tensors contiguous; formats are ``StateFormat``s.
    ``heads_per_program`` picks the step kernel (None: :func:`default_heads_per_program`; 0: one
    head per program; k ≥ 1: the grouped kernel with the largest divisor of the heads per group
    that is ≤ k). ``step_block_p`` / ``step_warps`` / ``step_stages`` override the step
    kernel's tile height, warps and (grouped) head-loop pipeline stages (tuning). ``fused``: the
    single-launch step kernel (None: on a GPU below ``FUSED_BELOW_BATCH`` rows; it ignores
    ``heads_per_program``). ``agree`` / ``fp_fusion``: the module docstring's candidates against
    racecheck's reports."""
    on_gpu = x.is_cuda
    for launch, grid, args, constexprs in _decode_launches(
            x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out, checkpoint, checkpoint_scale, read,
            read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags,
            checkpoint_format=checkpoint_format, read_format=read_format, seed=seed, step_block_p=step_block_p,
            step_warps=step_warps, heads_per_program=heads_per_program, step_stages=step_stages, fused=fused,
            agree=agree, fp_fusion=fp_fusion):
        launch(grid, args, constexprs, on_gpu)


def prepare_decode(tensors, *args, **kwargs) -> Optional[PreparedLaunches]:
    """After ``launch_replay_decode(*args, **kwargs)``: its two launches prepared as one for the
    op's dispatch entry (common/launch.py), or None where they cannot be
    (``CompiledLaunch.prepare``). ``tensors``: what the op's repeat calls pass, ``(x, dt, A, B,
    C, D, z, dt_bias, slot_indices, out, checkpoint, checkpoint_scale, read, read_scale, ring_x,
    ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags)``, each the
    tensor given to the launcher or one it is a view of at the same address."""
    on_gpu = args[0].is_cuda
    planned = _decode_launches(*args, **kwargs)
    split = _decode_leading_fused if len(planned) == 1 else _decode_leading
    launches = [launch.prepare(grid, launch_args, constexprs, leading, on_gpu)
                for (launch, grid, launch_args, constexprs), leading in zip(planned, split(*tensors))]
    if any(launch is None for launch in launches):
        return None
    return PreparedLaunches(launches, split, tensors)


def _decode_leading(x, dt, A, B, C, D, z, dt_bias, slot_indices, out, checkpoint, checkpoint_scale, read,
                    read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags):
    """The tensor arguments that open the step and the flush kernels' argument lists, in order;
    ``x`` stands for absent optional pointers (never read: constexpr flags)."""
    has_read = read is not None
    z_arg = z if z is not None else x
    D_arg = D if D is not None else x
    slots_arg = slot_indices if slot_indices is not None else x
    ring = (ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags)
    state, state_scale = (read, read_scale) if has_read else (checkpoint, checkpoint_scale)
    step = (x, dt, A, B, C, D_arg, z_arg, dt_bias if dt_bias is not None else x, slots_arg, out, state,
            state_scale if state_scale is not None else x, *ring)
    flush = (x, A, C, D_arg, z_arg, slots_arg, out, checkpoint,
             checkpoint_scale if checkpoint_scale is not None else x, read if has_read else x,
             read_scale if read_scale is not None else x, *ring)
    return step, flush


def _decode_leading_fused(x, dt, A, B, C, D, z, dt_bias, slot_indices, out, checkpoint, checkpoint_scale, read,
                          read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters,
                          slot_flags):
    """:func:`_decode_leading` for the single-launch step kernel: one launch's leading tensors."""
    step, _ = _decode_leading(x, dt, A, B, C, D, z, dt_bias, slot_indices, out, checkpoint, checkpoint_scale, read,
                              read_scale, ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters,
                              slot_flags)
    extra = (checkpoint, checkpoint_scale if checkpoint_scale is not None else x, read if read is not None else x,
             read_scale if read_scale is not None else x)
    return ((*step[:12], *extra, *step[12:]),)


def _decode_launches(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_indices, out, checkpoint, checkpoint_scale, read, read_scale,
    ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags, *, checkpoint_format,
    read_format, seed, step_block_p=None, step_warps=None, heads_per_program=None, step_stages=None, fused=None,
    agree=True, fp_fusion=None,
):
    """``(CompiledLaunch, grid, args, constexprs)`` of :func:`launch_replay_decode`'s step and
    flush kernels in launch order, or of the single-launch step kernel alone."""
    batch, nheads, headdim = x.shape
    has_read = read is not None
    state = read if has_read else checkpoint
    plan = _plan(batch, nheads, headdim, B.shape[2], B.shape[1], ring_x.shape[2], x.device, state.element_size(),
                 checkpoint_format, read_format if has_read else None, D is not None, z is not None,
                 dt_bias is not None, slot_indices is not None, bool(dt_softplus), step_block_p, step_warps,
                 heads_per_program, step_stages, fused, agree, fp_fusion)
    views = (x, dt, A, B, C, D, z, dt_bias, slot_indices, out, codec.storage_view(checkpoint, checkpoint_format),
             checkpoint_scale, codec.storage_view(read, read_format) if has_read else None, read_scale, ring_x, ring_dt,
             ring_B, cursor, generation, flush_rows, flush_counters, slot_flags)
    step_leading, flush_leading = _decode_leading(*views)
    z_arg = z if z is not None else x
    x_strides, C_strides, z_strides, out_strides = x.stride(), C.stride(), z_arg.stride(), out.stride()
    B_strides = B.stride()
    num_slots = checkpoint.shape[0]
    step_args = (
        *step_leading,
        x_strides[0], x_strides[1], dt.stride(0), B_strides[0], B_strides[1], C_strides[0], C_strides[1],
        z_strides[0], z_strides[1], out_strides[0], out_strides[1],
    )
    per_head_sizes = (num_slots, nheads, headdim, B.shape[2], nheads // B.shape[1])
    if plan.fused:
        (fused_leading,) = _decode_leading_fused(*views)
        return [(_launch_fused, plan.step_grid, (*fused_leading, seed, *step_args[len(step_leading):], *per_head_sizes),
                 plan.step_constexprs)]
    if plan.grouped:
        step = (_launch_step_grouped, plan.step_grid, (*step_args, num_slots, nheads), plan.step_constexprs)
    else:
        step = (_launch_step, plan.step_grid, (*step_args, *per_head_sizes), plan.step_constexprs)
    flush = (_launch_flush, plan.flush_grid, (
        *flush_leading, seed,
        x_strides[0], x_strides[1], C_strides[0], C_strides[1], z_strides[0], z_strides[1],
        out_strides[0], out_strides[1], batch, num_slots, headdim, B.shape[2],
    ), plan.flush_constexprs)
    return step, flush
