"""Public ops on device tensors: validation, ``torch.library`` registration, launch.

Each op lives in its own module; :mod:`._common` holds the checks they share.

Non-finite values. A NaN or ±inf in a row's inputs or state stays in that row's slot; the ops
make it visible through per-slot flags (``ReplayCache.slot_flags``,
``selective_state_update(..., slot_flags=...)``, bit ``qstate.SLOT_NONFINITE``), not by raising.
What a kernel then stores, by state format (the conventional kernel under the interpreter, a new
state holding one non-finite element in a row, or a whole non-finite row; ``qmax·s`` is the
largest code times the row's, head's or block's scale; the GPU's fused path was not measured):

================  ===================================  =====================================
format            NaN                                  ±inf
================  ===================================  =====================================
fp32              kept                                 kept
bf16, fp16        −max finite (−3.39e38, −65504)       ±max finite (saturated)
8-bit ``:row``    the element → −qmax·s, the scale     the scale → its largest value, the
                  from the row's finite elements; a    element ±qmax·s (≈ ±1.5e38), every
                  whole NaN row → zeros                other element of the row → 0
8-bit ``:head``   the element → −qmax·s, the scale     as ``:row``, over the whole head
                  from the head's finite elements; a
                  whole NaN row → −qmax·s (the other
                  rows' largest magnitude)
8-bit             the element → −qmax·s of its block;  as ``:row``, over the 32-element
``:block32``      a whole NaN block → −qmax·s at the   block
                  smallest scale (≈ −0.99 int8,
                  −0.875 fp8_e4m3)
================  ===================================  =====================================

The gated delta rule ops (``qstate.gated_delta_update``, ``GatedDeltaReplayCache.slot_flags``)
flag the same bits. There a non-finite element never stays alone: ``d = β (v − S k̂)`` sums the
whole V-row, so a NaN or ±inf in a row's state or ``v`` makes every element of that V-row
non-finite (a NaN in ``q``, ``k``, ``g`` or ``β`` every row of the head). What the conventional
kernel then stores for such a row, under the interpreter (+sr as its base format):

================  ===================================  =====================================
format            NaN row                              row of ±inf
================  ===================================  =====================================
fp32              kept                                 kept
bf16, fp16        −max finite                          ±max finite (saturated)
8-bit ``:row``    −qmax at the smallest scale          the scale → its largest value, the
                  (≈ −1.5e−36 int8, −5.3e−36 fp8)      elements ±qmax·s (≈ ±1.5e38)
8-bit ``:head``   −qmax·s, the head's scale from its   as ``:row``, and every other row of
                  finite rows                          the head → 0
8-bit             −qmax at the smallest scale (≈       as ``:row``, per 32-element block
``:block32``      −0.99 int8, −0.875 fp8_e4m3)
================  ===================================  =====================================

A replay cache's fp32 checkpoint keeps them; its read copy stores the ``:row`` column.

On the host, :func:`qstate.quantize` keeps NaN and ±inf in fp32 and NaN in bf16/fp16 (±inf
saturates), and a NaN in a ``:row`` or ``:head`` group makes its scale NaN (the whole group
dequantizes to NaN).
"""

from .conventional import selective_state_update

__all__ = ["selective_state_update"]
