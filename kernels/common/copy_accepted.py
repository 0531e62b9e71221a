"""The per-draft-state baselines' commit, shared by every family: copy the state each row kept
after its last accepted draft into the row's slot, as bytes (kernels/common/README.md#copy-accepted).

``_copy_accepted_kernel``, grid ``(cdiv(per_slot, BLOCK), batch)``: a program moves ``BLOCK``
consecutive elements of ``src[row, accepted − 1]`` to ``dst[slot]``; a row with a negative slot
(padding), a slot outside ``dst`` or ``accepted`` outside ``1 … T_max`` copies nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import sizes
from .launch import CompiledLaunch

# Elements a program copies (int32 words where the launcher views the tensors as such).
COPY_BLOCK = 4096
COPY_WARPS = 4


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


# Eager GPU launches through the compiled kernel (launch.py).
_launch_copy_accepted = CompiledLaunch(_copy_accepted_kernel)


@functools.lru_cache(maxsize=1024)
def _copy_plan(t_max, has_slots, block) -> dict:
    """Constexprs of a copy of accepted states."""
    return dict(T_MAX=t_max, HAS_SLOTS=has_slots, BLOCK=block, num_warps=COPY_WARPS)


def launch_copy_accepted(src, dst, num_accepted, slot_indices, *, block: int = COPY_BLOCK):
    """Copy ``src[row, accepted − 1]`` (``src (batch, T_max, ...)``) into ``dst[slot]``
    (``dst (slots, ...)``, the same trailing shape and dtype, both contiguous), bit for bit, for
    the rows with ``accepted > 0``; ``num_accepted (batch,)`` and ``slot_indices (batch,)`` or
    None (row ``b`` is slot ``b``) are integer tensors on ``dst``'s device. Validation is the
    caller's."""
    batch, t_max = src.shape[0], src.shape[1]
    per_slot = dst[0].numel()
    if dst.element_size() < 4 and dst.shape[-1] * dst.element_size() % 4 == 0:
        # Move whole 32-bit words: the copy is bit for bit anyway.
        src, dst = src.view(torch.int32), dst.view(torch.int32)
        per_slot = dst[0].numel()
    _launch_copy_accepted((sizes.cdiv(per_slot, block), batch), (
        src, dst, num_accepted, slot_indices if slot_indices is not None else num_accepted, per_slot, dst.shape[0]),
        _copy_plan(t_max, slot_indices is not None, block), dst.is_cuda)
