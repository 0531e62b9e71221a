"""Speculative decoding's launchers (the kernels: :mod:`.speculative_kernels`): verify T draft
tokens per row on replay state without writing state, commit by moving the cursor; and the
per-draft-state baseline of serving engines. Derivations and traffic: kernels/mamba2/README.md,
"Speculative decoding".

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
leaves its slot untouched and sets a bit of ``commit_errors`` (1: no verify, 2: out of range);
a row whose cursor lies, or would land, outside the ring leaves its slot untouched and sets
its ``slot_flags`` bit ``SLOT_BAD_CURSOR`` (so does the verify, whose row then outputs NaN).

Baseline: ``_drafts_kernel`` updates the state over the T tokens in registers and stores the
state after every token into ``intermediate[row, t]`` (T state writes per row);
the commit copies ``intermediate[row, accepted − 1]`` into the slot
(:func:`..common.copy_accepted.launch_copy_accepted`, shared with the gated delta baseline).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..common import codec, exact_dot, gpu, sizes
from ..common.launch import CompiledLaunch, register_cap
from . import speculative_kernels
from .conventional import tile_config
from .speculative_kernels import (_commit_kernel, _drafts_kernel, _group_BC_kernel, _verify_flush_kernel,
                                  _verify_flushed_rows_kernel, _verify_kernel)

ERROR_NO_VERIFY = speculative_kernels.ERROR_NO_VERIFY.value
ERROR_ACCEPTED_RANGE = speculative_kernels.ERROR_ACCEPTED_RANGE.value

# Tuning constants below: the fastest in H200 sweeps (figures in kernels/mamba2/README.md).

# Programs per multiprocessor of the kernels walking the flush list: the fold (rounded down to
# whole waves by flush_programs) and the flushed rows' drafts (rounded up).
FLUSH_PROGRAMS_PER_SM = 16
FLUSHED_ROWS_PROGRAMS_PER_SM = 4
# (rows of headdim, warps) of the verify tile by the state it reads: "tensor" (codes exact in bf16,
# tensor-core S · C_i), other 8/16-bit states "narrow".
VERIFY_TILE = {"fp32": (8, 1), "narrow": (16, 1), "tensor": (64, 2)}
# Register caps (ptxas .maxnreg; None: its choice): more programs per multiprocessor against a
# few spills.
VERIFY_MAXNREG = 96
FLUSH_MAXNREG = 128
FLUSHED_ROWS_MAXNREG = None
# (rows of headdim, warps) of the fold's and the flushed rows' drafts' tiles.
FLUSH_TILE = (32, 4)
FLUSHED_ROWS_TILE = (16, 1)
# S · C_i of states whose codes are exact in bf16 as one tensor-core product (common/exact_dot.py);
# False: one FMA dot per draft (the only way for fp32, fp16 and block32 states).
TENSOR_DOT = True

# ------------------------------------------------------------------------------------ launchers

# Eager GPU launches through the compiled kernels (common/launch.py).
_launch_group_BC = CompiledLaunch(_group_BC_kernel)
_launch_verify = CompiledLaunch(_verify_kernel)
_launch_verify_flush = CompiledLaunch(_verify_flush_kernel)
_launch_flushed_rows = CompiledLaunch(_verify_flushed_rows_kernel)
_launch_commit = CompiledLaunch(_commit_kernel)
_launch_drafts = CompiledLaunch(_drafts_kernel)


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
    flush_rows, flush_counters, slot_flags, *, checkpoint_format, read_format, seed: int,
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
        ring_x, ring_dt, ring_B, BC, cursor, generation, drafts, flush_rows, flush_counters, slot_flags,
        *strides, num_slots, nheads, headdim, dstate, nheads // ngroups), plan.verify_constexprs, on_gpu)
    _launch_verify_flush(plan.flush_grid, (
        A, slots_arg, codec.storage_view(checkpoint, checkpoint_format),
        checkpoint_scale if checkpoint_scale is not None else dummy,
        codec.storage_view(read, read_format) if has_read else dummy, read_scale if read_scale is not None else dummy,
        ring_x, ring_dt, ring_B, cursor, generation, flush_rows, flush_counters, slot_flags, seed,
        nheads, headdim, dstate, nheads // ngroups), plan.flush_constexprs, on_gpu)
    _launch_flushed_rows(plan.rows_grid, (
        x, dt, A, B, C, D_arg, z_arg, bias_arg, slots_arg, out, codec.storage_view(state, state_fmt), state_scale_arg,
        ring_x, ring_dt, ring_B, BC, cursor, flush_rows, flush_counters, slot_flags,
        *strides, nheads, headdim, dstate, nheads // ngroups), plan.rows_constexprs, on_gpu)


@functools.lru_cache(maxsize=1024)
def _commit_plan(batch, has_slots) -> tuple:
    """Grid and constexprs of a commit."""
    block_r = max(16, min(1024, sizes.next_power_of_2(batch)))
    return (sizes.cdiv(batch, block_r),), dict(HAS_SLOTS=has_slots, BLOCK_R=block_r, num_warps=4)


def launch_replay_commit(num_accepted, slot_indices, cursor, drafts, commit_errors, slot_flags, num_slots: int,
                         capacity: int):
    """Launch one commit: ``num_accepted (batch,)`` int32/int64, ``slot_indices (batch,)`` or
    None, ``capacity`` the ring's tokens (a new cursor must lie below it)."""
    batch = num_accepted.shape[0]
    grid, constexprs = _commit_plan(batch, slot_indices is not None)
    _launch_commit(grid, (
        num_accepted, slot_indices if slot_indices is not None else num_accepted, cursor, drafts, commit_errors,
        slot_flags, batch, num_slots, capacity), constexprs, num_accepted.is_cuda)


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
