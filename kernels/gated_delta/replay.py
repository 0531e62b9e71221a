"""Replay decode of the gated delta rule (``docs/design.md#gdn-replay``): what the kernels of
:mod:`.replay_kernels` do, and their launcher.

A cache (``qstate.GatedDeltaReplayCache``) holds per slot an fp32/bf16/fp16 checkpoint ``S_c``,
an optional read copy ``R_c = Q_read(S_c)`` (bf16 or 8-bit with row scales over K), a ring of
the last ``ring_len`` tokens' inputs (raw ``k`` per key head, ``v``, ``g`` and ``β`` per value
head: never the corrected value) and a cursor (tokens in the ring).

Step kernel, grid ``(cdiv(V, BLOCK_V · V_LOOP), HV, batch)``; each program owns ``V_LOOP``
chunks of ``BLOCK_V`` rows of V of one head of one row, K whole. It reads the slot's cursor
``n``: one outside ``[0, L)`` (memory a caller wrote) sets ``SLOT_BAD_CURSOR`` in the slot's
flags, the row outputs NaN and nothing of the slot is written
(``kernels/README.md#cursor-safety``). Else it appends the token at ``n`` (v by every V-tile; g
and β by V-tile 0; k by V-tile 0 of the key head's first value head), then:

* ``n < L − 1`` (a normal row): the adjoint sweep. ``T ← q̂``, ``o ← 0``; for the current token
  and then the ring's tokens newest first, ``c = β k̂·T``, ``o += c v``, ``T = α ⊙ (T − c k̂)``;
  finally ``o += R_c T`` (the read copy's tile, or the checkpoint's). The sweep runs once per
  program, then each chunk streams its rows. The state is read once, in the read copy's format,
  and nothing but the ring entry and, KDA, by V-tile 0, the token's row of ``(I + B)⁻¹``
  (below) is written.
* ``n = L − 1`` (the row whose ring fills): the flush kernel's (the step kernel only appends
  its g, β and k). Flush kernel, grid ``(cdiv(V, BLOCK_V''), HV, batch)``, every other row
  returning at once: it loads the ring's ``L − 1`` tokens and the current one and folds them
  into the checkpoint's tile, from the checkpoint itself, in matrix form (the products in
  ``FOLD_PRECISION`` on a GPU). With ``Γ_j`` the summed log-gates up to token j (per key
  channel for KDA), the reads ``W = S (k̂_j e^{Γ_j})_jᵀ``, the corrections
  ``D = β (V_ring − W)(I + B)⁻ᵀ`` (``B_ji = β_j k̂_j·k̂_i e^{Γ_j − Γ_i}`` for ``i < j``: how an
  earlier correction reaches a later read; GDN: from the Gram product; KDA, whose decays
  differ per channel: row j kept in ``ring_inverse`` by the step that appended token j, the last
  row computed here) and ``S ← S e^{Γ_L} + D (k̂_j e^{Γ_L − Γ_j})_j``
  equal the token-by-token fold (``S ← S diag(α)``, ``d = β (v − S k̂)``, ``S ← S + d k̂ᵀ``)
  up to the order of the sums, in three matrix products instead of ``L`` serial rank-1
  updates. It appends v, outputs ``S q̂`` from the unrounded result, stores it in the
  checkpoint's format and rebuilds the read copy from the stored checkpoint.

The flush decision is each program's own (from the cursor on the device): no host sync, so a
step can be captured in a CUDA graph. The step kernel's first program of each row writes the
cursor it read (or ``NO_CURSOR``: padding, past the cache, outside the ring) into a per-call
``row_cursor``; the flush kernel decides by it, so its first program of each row can move the
slot's cursor on to ``n + 1`` (0 after a flush) in the same launch: two launches a step, with
programmatic dependent launch (``kernels/common/pdl.py``) on sm_90 below ``PDL_BELOW_BATCH``
rows. A non-finite output sets ``SLOT_NONFINITE`` in its slot's flags.

Deterministic (each value is computed by one program in a fixed order). A row whose slot
is negative outputs zeros and touches nothing; an index ``≥ num_slots`` (rejected on the host
for CPU tensors) outputs NaN and touches nothing. The keys are stored raw and normalized where
they are read, so the ring keeps exactly what the caller gave (in the cache's input dtype).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..common import codec, pdl, sizes
from ..common.launch import CompiledLaunch, PreparedLaunches
from . import tile
from .replay_kernels import _replay_flush_kernel, _replay_step_kernel

# Rows of V per chunk at K = 128, warps, and chunks per program: a program sweeps the ring once
# and streams V_LOOP chunks; one warp keeps the sweep's K-sums free of shared-memory rounds.
TILE_ROWS = 16
WARPS = 1
V_LOOP = 8
# Load each chunk of the read copy (or checkpoint) one chunk ahead, the first during the sweep.
PREFETCH = False
# KDA's token row of (I + B)⁻¹ from K-sums inside the unrolled sweep, or a loop before it: H100
# Kimi-Linear staggered, no read / fp8 read, 297.4 / 212.3 µs against 312.0 / 218.5.
INVERSE_IN_SWEEP = True
# (BLOCK_V, V_LOOP) of interpreter launches; None: the whole V in one chunk (the interpreter pays
# per program). Tests set it to run the GPU's V tiles and chunks.
INTERPRETER_SPLIT = None
# Flush programs: rows of V at K = 128 and warps (a whole head computes the fold's operands once);
# its products on tensor cores in three TF32 parts ("ieee": fp32 FMAs).
FLUSH_ROWS = 128
FLUSH_WARPS = 8
FOLD_PRECISION = "tf32x3"
# Batches below which both kernels launch with PDL: above, the flush programs it starts early hold
# registers the step's tail needs (H100 b256 no read +1.6 %; b1 -13 %).
PDL_BELOW_BATCH = 128
# Programs below which a launch takes fewer chunks per program, then splits V finer.
MIN_PROGRAMS = 1024
_MIN_BLOCK_V = 4

_step = CompiledLaunch(_replay_step_kernel)
_flush = CompiledLaunch(_replay_flush_kernel)


@functools.lru_cache(maxsize=1024)
def _plan(K, V, num_v_heads, batch, device, ring_len, ck_code, ck_qmax, has_read, rd_code, rd_gran, rd_qmax, rd_emax,
          channel, l2norm, has_slots, out_bf16):
    """``(step grid, step constexprs, flush grid, flush constexprs)`` of a call's metadata."""
    block_k = max(32, sizes.next_power_of_2(K))
    whole = sizes.next_power_of_2(V)
    v_loop, warps = 1, 4
    if device.type == "cuda":
        block_v = min(max(1, TILE_ROWS * 128 // block_k), whole)
        v_loop, warps = min(V_LOOP, sizes.cdiv(V, block_v)), WARPS
        while v_loop > 1 and batch * num_v_heads * sizes.cdiv(V, block_v * v_loop) < MIN_PROGRAMS:
            v_loop //= 2
        while block_v > _MIN_BLOCK_V and batch * num_v_heads * sizes.cdiv(V, block_v) < MIN_PROGRAMS:
            block_v //= 2
    else:
        block_v, v_loop = INTERPRETER_SPLIT or (whole, 1)
    hw = codec.hardware_casts(device)
    use_pdl = pdl.enabled(device) and batch < PDL_BELOW_BATCH
    step = dict(L=ring_len, RING_PAD=max(16, sizes.next_power_of_2(ring_len)), CK_DTYPE=ck_code, HAS_READ=has_read,
                RD_DTYPE=rd_code, RD_GRAN=rd_gran, HW=hw, CHANNEL=channel, L2NORM=l2norm, HAS_SLOTS=has_slots,
                OUT_BF16=out_bf16, BLOCK_V=block_v, BLOCK_K=block_k, V_LOOP=v_loop, PREFETCH=PREFETCH,
                INVERSE_IN_SWEEP=INVERSE_IN_SWEEP, PDL=use_pdl,
                num_warps=warps, **pdl.launch_options(use_pdl))
    flush_v, flush_warps, precision = tile.fold_tile(block_k, V, FLUSH_ROWS, FLUSH_WARPS, FOLD_PRECISION,
                                                     device.type == "cuda",
                                                     INTERPRETER_SPLIT[0] if INTERPRETER_SPLIT else None)
    flush = dict(L=ring_len, M=max(16, sizes.next_power_of_2(ring_len)), CK_DTYPE=ck_code, HAS_READ=has_read,
                 RD_DTYPE=rd_code, RD_GRAN=rd_gran, RD_QMAX=rd_qmax, RD_EMAX=rd_emax, CK_QMAX=ck_qmax, HW=hw,
                 CHANNEL=channel, L2NORM=l2norm, HAS_SLOTS=has_slots, OUT_BF16=out_bf16, BLOCK_V=flush_v,
                 BLOCK_K=block_k, PRECISION=precision, PDL=use_pdl, num_warps=flush_warps,
                 **pdl.launch_options(use_pdl))
    return ((sizes.cdiv(V, block_v * v_loop), num_v_heads, batch), step, (sizes.cdiv(V, flush_v), num_v_heads, batch),
            flush)


def launch(cache, q, k, v, g, beta, slot_indices, out, row_cursor, *, qk_scale: float, use_qk_l2norm: bool) -> None:
    """Launch the step and flush kernels on validated arguments: ``cache`` a
    ``GatedDeltaReplayCache`` (contiguous tensors), ``q, k (batch, HK, K)``, ``v, out (batch,
    HV, V)`` and ``g`` with unit inner stride, ``beta (batch, HV)``, ``slot_indices (batch,)``
    int or None, ``row_cursor`` an int32 ``(batch,)`` scratch through which the step kernel
    hands each row's cursor to the flush kernel (the op allocates one per call, so a CUDA graph
    captures its own)."""
    on_gpu = cache.device.type == "cuda"
    for compiled, grid, args, constexprs in _launches(cache, q, k, v, g, beta, slot_indices, out, row_cursor,
                                                      qk_scale=qk_scale, use_qk_l2norm=use_qk_l2norm):
        compiled(grid, args, constexprs, on_gpu)


def prepare(tensors, *args, **kwargs) -> Optional[PreparedLaunches]:
    """After ``launch(*args, **kwargs)``: its two launches prepared as one for the op's dispatch
    entry (``kernels/common/launch.py``), or None where they cannot be
    (``CompiledLaunch.prepare``). ``tensors``: what the op's repeat calls pass, ``(q, k, v, g,
    beta, slot_indices, out, checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta,
    ring_inverse, cursor, slot_flags, row_cursor)``, each the tensor given to the launcher or one it is a view
    of at the same address."""
    on_gpu = args[0].device.type == "cuda"
    leading = _leading(*tensors)
    launches = [compiled.prepare(grid, launch_args, constexprs, leading, on_gpu)
                for compiled, grid, launch_args, constexprs in _launches(*args, **kwargs)]
    if any(prepared is None for prepared in launches):
        return None
    return PreparedLaunches(launches, lambda *given: (_leading(*given),) * 2, tensors)


def _leading(q, k, v, g, beta, slot_indices, out, checkpoint, read, read_scale, ring_k, ring_v, ring_g, ring_beta,
             ring_inverse, cursor, slot_flags, row_cursor) -> tuple:
    """The tensors that open both kernels' argument lists, in order; the checkpoint stands for an
    absent read copy, its scales and GDN's absent ``ring_inverse`` (never read: constexpr flags)."""
    return (q, k, v, g, beta, slot_indices, out, checkpoint, read if read is not None else checkpoint,
            read_scale if read_scale is not None else checkpoint, ring_k, ring_v, ring_g, ring_beta,
            ring_inverse if ring_inverse is not None else checkpoint, cursor, slot_flags, row_cursor)


def _launches(cache, q, k, v, g, beta, slot_indices, out, row_cursor, *, qk_scale: float, use_qk_l2norm: bool):
    """``(compiled launch, grid, args, constexprs)`` of the step kernel, then of the flush kernel
    (the same arguments)."""
    batch, num_v_heads, V = v.shape
    K = k.shape[2]
    ck_fmt, rd_fmt = cache.checkpoint_format, cache.read_format
    has_read = rd_fmt is not None
    out_bf16 = out.dtype == torch.bfloat16
    grid, step, flush_grid, flush = _plan(
        K, V, num_v_heads, batch, cache.device, cache.ring_len, codec.dtype_code(ck_fmt), codec.qmax(ck_fmt),
        has_read, codec.dtype_code(rd_fmt) if has_read else 0, codec.granularity_code(rd_fmt) if has_read else 0,
        codec.qmax(rd_fmt) if has_read else 0.0, codec.emax(rd_fmt) if has_read else 0, g.dim() == 3, use_qk_l2norm,
        slot_indices is not None, out_bf16)
    checkpoint = codec.storage_view(cache.checkpoint, ck_fmt)
    read = codec.storage_view(cache.read, rd_fmt) if has_read else None
    out_view = out.view(torch.int16) if out_bf16 else out
    args = (*_leading(q, k, v, g, beta, slot_indices, out_view, checkpoint, read, cache.read_scale, cache.ring_k,
                      cache.ring_v, cache.ring_g, cache.ring_beta, cache.ring_inverse, cache.cursor, cache.slot_flags,
                      row_cursor),
            float(qk_scale), cache.num_slots, k.shape[1], num_v_heads, K, V, num_v_heads // k.shape[1],
            *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *g.stride()[:2], *beta.stride()[:2],
            *out.stride()[:2])
    return (_step, grid, args, step), (_flush, flush_grid, args, flush)
