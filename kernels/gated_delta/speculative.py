"""Speculative decoding of the gated delta rule (kernels/gated_delta/README.md#speculative): the
launchers of :mod:`.speculative_kernels`. Verify T drafts per row on replay state writing only
ring entries; commit by moving the cursor, folding the ring when it holds ``ring_len`` committed
tokens; and the per-draft-state baseline of serving engines.

* ``_verify_kernel``, grid ``(cdiv(V, BLOCK_V · V_LOOP), HV, batch)``: a program owns ``V_LOOP``
  chunks of ``BLOCK_V`` rows of one value head of a row. It reads the slot's cursor ``n`` (a
  cursor outside ``[0, ring_len)`` flags ``SLOT_BAD_CURSOR``, outputs NaN and writes nothing),
  appends the drafts' k, g and β at ``n … n+T−1`` and sets ``drafts[slot] = T``. Then the
  adjoint sweeps of the T drafts run together as a ``[T, K]`` tile: chain t starts at ``q̂_t``
  and is carried back through drafts ``t … 0`` and the ring newest first, keeping each token's
  coefficient. Each chunk then takes ``o_t = Σ c v + R Q_t`` over its rows of the read copy (the
  checkpoint without one), read once for all drafts, and appends the drafts' v.
* ``_commit_list_kernel``, one program: the rows whose commit brings their committed tokens to
  ``ring_len`` or more, listed with their count.
* ``_commit_fold_kernel``, ``FOLD_PROGRAMS_PER_SM`` programs per multiprocessor walking the
  listed rows' value heads: per head, the fold's operands once (``key_in`` and ``update =
  diag(β) (I + B)⁻ᵀ key_out``, built 32 key columns at a time so only ``[M, M]`` and ``[M, 32]``
  pieces hold registers, products at ``FOLD_PRECISION`` on a GPU) into the program's scratch, then per ``BLOCK_V'`` rows of V the checkpoint folded from
  the stored checkpoint four committed tokens a step in fp32 FMAs (``S e^{Γ} + Σ_j (v_j − S
  key_in_j) update_j``), stored, and the read copy rebuilt.
* ``_commit_cursor_kernel``, grid ``(cdiv(batch, BLOCK_R),)``, after the fold: ``cursor ← n +
  accepted`` (0 after a fold), ``drafts ← 0``. A row whose slot has no pending drafts, or whose
  ``accepted`` lies outside ``0 … drafts``, leaves the slot untouched and ORs
  ``ERROR_NO_VERIFY`` / ``ERROR_ACCEPTED_RANGE`` into ``commit_errors``; a cursor outside the
  ring leaves it untouched and flags ``SLOT_BAD_CURSOR`` (the list kernel takes the same
  decision, :func:`.speculative_kernels.commit_decision`).

Baseline: ``_drafts_kernel`` (the conventional kernel's tile and order) updates the state over
the T drafts in registers and stores the state after every draft into ``intermediate[row, t]``;
its commit copies ``intermediate[row, accepted − 1]`` into the slot
(:func:`..common.copy_accepted.launch_copy_accepted`, a byte copy shared with the Mamba-2 baseline).
"""

from __future__ import annotations

import functools

import torch

from ..common import codec, gpu, sizes
from ..common.copy_accepted import launch_copy_accepted
from ..common.launch import CompiledLaunch, register_cap
from . import speculative_kernels
from .conventional import tile_config
from .speculative_kernels import (_commit_cursor_kernel, _commit_fold_kernel, _commit_list_kernel, _drafts_kernel,
                                  _verify_kernel)

ERROR_NO_VERIFY = speculative_kernels.ERROR_NO_VERIFY.value
ERROR_ACCEPTED_RANGE = speculative_kernels.ERROR_ACCEPTED_RANGE.value

# Fused verify: rows of V per chunk at K = 128, warps, chunks per program (H200, batch 256, T = 4:
# 849 / 751 µs against 1485 / 1501 at 16 rows × 8 chunks; one warp keeps the K-sums in shuffles).
VERIFY_TILE_ROWS = 8
VERIFY_WARPS = 1
VERIFY_V_LOOP = 16
# The verify's sweep walks the committed ring tokens this many at a time (0: all ring_len − 1
# positions unrolled; H100 batch-256 T = 4 round: 1020 / 969 µs against 1247 / 1165 at 0).
SWEEP_GROUP = 4
# Load each chunk of the read copy (or checkpoint) one chunk ahead, the first during the sweeps.
PREFETCH = True
# Commit fold: rows of V per tile at K = 128, warps, programs per multiprocessor (H100, batch 256,
# T = 4 round, Kimi-Linear: 978 / 932 µs against 1094 / 1018 at two uncapped); TF32x3 operands.
FOLD_ROWS = 32
FOLD_WARPS = 4
FOLD_PRECISION = "tf32x3"
FOLD_PROGRAMS_PER_SM = 4
# A register cap for the fold (None: the compiler's 255): 128 lets FOLD_PROGRAMS_PER_SM = 4 fit.
FOLD_MAXNREG = 128
# (BLOCK_V, V_LOOP) of interpreter launches (BLOCK_V also the fold's rows); None: the
# whole V in one chunk (the interpreter pays per program). Tests set it to run the GPU's shapes.
INTERPRETER_SPLIT = None
# Programs below which a verify takes fewer chunks per program, then splits V finer.
MIN_PROGRAMS = 1024
_MIN_BLOCK_V = 4
# Batch rows per program of the cursor kernel.
BLOCK_R = 256

_verify = CompiledLaunch(_verify_kernel)
_list = CompiledLaunch(_commit_list_kernel)
_fold = CompiledLaunch(_commit_fold_kernel)
_cursor = CompiledLaunch(_commit_cursor_kernel)
_drafts = CompiledLaunch(_drafts_kernel)


def _verify_tiling(K, V, heads, batch, device, tile_rows, v_loop):
    """``(BLOCK_K, BLOCK_V, V_LOOP)`` of a launch over ``(V-parts, heads, batch)``."""
    block_k = max(32, sizes.next_power_of_2(K))
    whole = sizes.next_power_of_2(V)
    if device.type != "cuda":
        block_v, v_loop = INTERPRETER_SPLIT or (whole, 1)
        return block_k, block_v, v_loop
    block_v = min(max(1, tile_rows * 128 // block_k), whole)
    v_loop = min(v_loop, sizes.cdiv(V, block_v))
    while v_loop > 1 and batch * heads * sizes.cdiv(V, block_v * v_loop) < MIN_PROGRAMS:
        v_loop //= 2
    while block_v > _MIN_BLOCK_V and batch * heads * sizes.cdiv(V, block_v) < MIN_PROGRAMS:
        block_v //= 2
    return block_k, block_v, v_loop


def _formats(ck_fmt, rd_fmt) -> dict:
    has_read = rd_fmt is not None
    return dict(CK_DTYPE=codec.dtype_code(ck_fmt), HAS_READ=has_read,
                RD_DTYPE=codec.dtype_code(rd_fmt) if has_read else 0,
                RD_GRAN=codec.granularity_code(rd_fmt) if has_read else 0)


@functools.lru_cache(maxsize=1024)
def _verify_plan(K, V, num_v_heads, batch, T, ring_len, capacity, device, ck_fmt, rd_fmt, channel, l2norm,
                 has_slots, out_bf16):
    """``(grid, constexprs)`` of a verify."""
    block_k, block_v, v_loop = _verify_tiling(K, V, num_v_heads, batch, device, VERIFY_TILE_ROWS, VERIFY_V_LOOP)
    formats = _formats(ck_fmt, rd_fmt)
    ring_pad, block_t = max(2, sizes.next_power_of_2(ring_len - 1)), max(2, sizes.next_power_of_2(T))
    constexprs = dict(L=ring_len, CAP=capacity, T=T, RING_PAD=ring_pad, BLOCK_T=block_t, **formats,
                      HW=codec.hardware_casts(device), CHANNEL=channel, L2NORM=l2norm, HAS_SLOTS=has_slots,
                      OUT_BF16=out_bf16, BLOCK_V=block_v, BLOCK_K=block_k, V_LOOP=v_loop,
                      PREFETCH=PREFETCH, SWEEP_GROUP=SWEEP_GROUP,
                      num_warps=VERIFY_WARPS if device.type == "cuda" else 4)
    return (sizes.cdiv(V, block_v * v_loop), num_v_heads, batch), constexprs


def _draft_strides(q, k, v, g, beta, out):
    """Row, draft and head strides of the ``(batch, T, …)`` tensors, in the kernels' order."""
    return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3], *beta.stride()[:3],
            *out.stride()[:3])


def launch_verify(q, k, v, g, beta, slot_indices, out, checkpoint, read, read_scale, ring_k, ring_v, ring_g,
                  ring_beta, cursor, drafts, slot_flags, *, checkpoint_format, read_format, max_draft: int,
                  qk_scale: float, use_qk_l2norm: bool) -> None:
    """Launch one verify on validated arguments: ``q, k (batch, T, HK, K)``, ``v, out (batch, T,
    HV, V)``, ``g (batch, T, HV[, K])``, ``beta (batch, T, HV)``, unit inner stride; the cache's
    tensors contiguous (ring of ``ring_len + max_draft`` tokens), ``T ≤ max_draft``."""
    batch, T, num_v_heads, V = v.shape
    K = k.shape[3]
    capacity = ring_k.shape[2]
    out_bf16 = out.dtype == torch.bfloat16
    grid, constexprs = _verify_plan(
        K, V, num_v_heads, batch, T, capacity - max_draft, capacity, v.device, checkpoint_format, read_format,
        g.dim() == 4, use_qk_l2norm, slot_indices is not None, out_bf16)
    ck = codec.storage_view(checkpoint, checkpoint_format)
    rd = codec.storage_view(read, read_format) if read is not None else ck
    rd_scale = read_scale if read_scale is not None else ck
    out_view = out.view(torch.int16) if out_bf16 else out
    _verify(grid, (q, k, v, g, beta, slot_indices, out_view, ck, rd, rd_scale, ring_k, ring_v, ring_g, ring_beta,
                   cursor, drafts, slot_flags, float(qk_scale), checkpoint.shape[0], k.shape[2],
                   num_v_heads, K, V, num_v_heads // k.shape[2], *_draft_strides(q, k, v, g, beta, out)),
            constexprs, v.is_cuda)


@functools.lru_cache(maxsize=1024)
def _commit_plan(K, V, num_v_heads, batch, capacity, device, ck_fmt, rd_fmt, channel, l2norm, has_slots):
    """``(fold grid, fold constexprs, cursor grid, list and cursor constexprs)``."""
    block_k = max(32, sizes.next_power_of_2(K))
    whole = sizes.next_power_of_2(V)
    if device.type == "cuda":
        block_v, warps, precision = max(16, min(FOLD_ROWS * 128 // block_k, whole)), FOLD_WARPS, FOLD_PRECISION
    else:
        block_v, warps, precision = (INTERPRETER_SPLIT[0] if INTERPRETER_SPLIT else whole), 4, "ieee"
    has_read = rd_fmt is not None
    v_tiles = sizes.cdiv(V, block_v)
    fold = dict(M=max(16, sizes.next_power_of_2(capacity)), CK_DTYPE=codec.dtype_code(ck_fmt),
                CK_QMAX=codec.qmax(ck_fmt), HAS_READ=has_read, RD_DTYPE=codec.dtype_code(rd_fmt) if has_read else 0,
                RD_GRAN=codec.granularity_code(rd_fmt) if has_read else 0,
                RD_QMAX=codec.qmax(rd_fmt) if has_read else 0.0, RD_EMAX=codec.emax(rd_fmt) if has_read else 0,
                HW=codec.hardware_casts(device), CHANNEL=channel, L2NORM=l2norm, HAS_SLOTS=has_slots,
                BLOCK_V=block_v, BLOCK_K=block_k, NUM_V_TILES=v_tiles, PRECISION=precision, num_warps=warps,
                **register_cap(FOLD_MAXNREG, device))
    programs = max(1, min(batch * num_v_heads, FOLD_PROGRAMS_PER_SM * gpu.sm_count(device)))
    cursor = dict(HAS_SLOTS=has_slots, BLOCK_R=BLOCK_R, num_warps=4)
    return (programs,), fold, (sizes.cdiv(batch, BLOCK_R),), cursor


def launch_commit(num_accepted, slot_indices, checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta,
                  cursor, drafts, commit_errors, slot_flags, *, checkpoint_format, read_format, max_draft: int,
                  use_qk_l2norm: bool) -> None:
    """Launch one commit (fold list, fold, then cursors) on validated arguments: ``num_accepted (batch,)``
    int32/int64, ``slot_indices (batch,)`` or None, the cache's tensors contiguous."""
    batch = num_accepted.shape[0]
    num_slots, num_v_heads, V, K = checkpoint.shape
    capacity = ring_k.shape[2]
    grid, fold, cursor_grid, cursor_constexprs = _commit_plan(
        K, V, num_v_heads, batch, capacity, checkpoint.device, checkpoint_format, read_format, ring_g.dim() == 4,
        use_qk_l2norm, slot_indices is not None)
    ck = codec.storage_view(checkpoint, checkpoint_format)
    on_gpu = checkpoint.is_cuda
    # Per call, as the verify's scratch: the rows that fold, then their count.
    fold_list = torch.empty(batch + 1, dtype=torch.int32, device=checkpoint.device)
    _list((1,), (num_accepted, slot_indices, cursor, drafts, fold_list, batch, num_slots, capacity - max_draft,
                 capacity), cursor_constexprs, on_gpu)
    # Per call as well: each fold program's operands, [programs, 2 M + 1, BLOCK_K] fp32.
    scratch = torch.empty(grid[0] * (2 * fold["M"] + 1) * fold["BLOCK_K"], dtype=torch.float32, device=checkpoint.device)
    _fold(grid, (num_accepted, slot_indices, fold_list, ck,
                 codec.storage_view(read, read_format) if read is not None else ck,
                 read_scale if read_scale is not None else ck, ring_k, ring_v, ring_g, ring_beta, cursor, slot_flags,
                 scratch, batch, ring_k.shape[1], num_v_heads, K, V, num_v_heads // ring_k.shape[1], capacity), fold,
          on_gpu)
    _cursor(cursor_grid, (num_accepted, slot_indices, cursor, drafts, commit_errors, slot_flags, batch, num_slots,
                          capacity - max_draft, capacity), cursor_constexprs, on_gpu)


@functools.lru_cache(maxsize=1024)
def _drafts_plan(element_bytes, K, V, num_v_heads, batch, T, t_max, device, fmt, channel, l2norm, has_slots,
                 out_bf16):
    dtype_code, granularity = codec.dtype_code(fmt), codec.granularity_code(fmt)
    block_v, block_k, warps = tile_config(element_bytes, K, V, granularity, batch * num_v_heads,
                                          device.type == "cuda", dtype_code)
    constexprs = dict(T=T, T_MAX=t_max, DTYPE=dtype_code, GRAN=granularity, QMAX=codec.qmax(fmt),
                      EMAX=codec.emax(fmt), HW=codec.hardware_casts(device), CHANNEL=channel, L2NORM=l2norm,
                      HAS_SLOTS=has_slots, OUT_BF16=out_bf16, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps)
    return (sizes.cdiv(V, block_v), num_v_heads, batch), constexprs


def launch_drafts(state, state_scale, intermediate, intermediate_scale, q, k, v, g, beta, slot_indices, out, *,
                  state_format, qk_scale: float, use_qk_l2norm: bool) -> None:
    """Launch the per-draft-state baseline on validated arguments: ``state (slots, HV, V, K)`` and
    ``intermediate (batch, T_max, HV, V, K)`` contiguous in the format's storage dtype (row
    scales ``(…, V)`` fp32, contiguous), inputs as in :func:`launch_verify`."""
    batch, T, num_v_heads, V = v.shape
    K = k.shape[3]
    out_bf16 = out.dtype == torch.bfloat16
    grid, constexprs = _drafts_plan(state.element_size(), K, V, num_v_heads, batch, T, intermediate.shape[1],
                                    state.device, state_format, g.dim() == 4, use_qk_l2norm,
                                    slot_indices is not None, out_bf16)
    codes = codec.storage_view(state, state_format)
    _drafts(grid, (codes, state_scale if state_scale is not None else codes,
                   codec.storage_view(intermediate, state_format),
                   intermediate_scale if intermediate_scale is not None else codes, q, k, v, g, beta, slot_indices,
                   out.view(torch.int16) if out_bf16 else out, float(qk_scale), state.shape[0], num_v_heads, K, V,
                   num_v_heads // k.shape[2], *_draft_strides(q, k, v, g, beta, out)), constexprs, state.is_cuda)


def launch_commit_drafts(state, state_scale, intermediate, intermediate_scale, num_accepted, slot_indices) -> None:
    """``state[slot] ← intermediate[row, accepted − 1]`` (codes and scales, bit for bit) for the
    rows with ``accepted > 0``."""
    launch_copy_accepted(intermediate, state, num_accepted, slot_indices)
    if state_scale is not None:
        launch_copy_accepted(intermediate_scale, state_scale, num_accepted, slot_indices)
