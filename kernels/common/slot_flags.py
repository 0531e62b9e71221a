"""Per-slot flags the kernels set on the device: bits ORed into one int32 per slot
(``ReplayCache.slot_flags``, ``selective_state_update(..., slot_flags=...)``). No kernel
clears them; the caller reads them when it likes (no sync in the ops) and clears them
(``ReplayCache.reset`` clears a slot's). kernels/README.md, "Cursor safety and slot flags"."""

import triton
import triton.language as tl

# The slot's cursor (or a commit's new cursor) lay outside its ring: the call wrote nothing to the slot.
SLOT_BAD_CURSOR = tl.constexpr(1)
# A non-finite value (NaN, ±inf) met in the slot's outputs, which every input and state element reaches.
SLOT_NONFINITE = tl.constexpr(2)


@triton.jit
def flag_slot(flags_ptr, slot, bits):
    """OR ``bits`` into ``slot``'s flags."""
    tl.atomic_or(flags_ptr + slot, bits)


@triton.jit
def flag_nonfinite(flags_ptr, slot, values, mask):
    """OR ``SLOT_NONFINITE`` into ``slot``'s flags if an fp32 element of ``values`` under ``mask``
    is NaN or ±inf: one integer max over the tile (exact, so every lane holds the same answer)
    and at most one atomic, predicated off on a finite tile (one atomic per element cost the
    replay flush step 15 % on the H200)."""
    bad = tl.max(tl.where(mask & ~(tl.abs(values) < float("inf")), 1, 0))
    tl.atomic_or(flags_ptr + slot, SLOT_NONFINITE, mask=bad > 0)


@triton.jit
def cursor_outside(n, capacity):
    """Whether a cursor ``n`` lies outside a ring of ``capacity`` tokens."""
    return (n < 0) | (n >= capacity)
