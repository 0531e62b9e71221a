"""Codes the kernels branch on, as ``tl.constexpr`` globals: a ``@triton.jit`` function may read
a module-level name only if it is a constexpr, so kernels compare ``DTYPE == INT8`` against these
instead of raw numbers. The host takes the same names as plain ints from :mod:`.codec` (table
keys, plan caches), derived from these, so each code is written once."""

import triton.language as tl

# Storage formats (constexpr ``DTYPE`` of every kernel).
FP32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
FP16 = tl.constexpr(2)
FP8_E4M3 = tl.constexpr(3)
FP8_E5M2 = tl.constexpr(4)
INT8 = tl.constexpr(5)

# Scale granularity (constexpr ``GRAN``).
GRAN_NONE = tl.constexpr(0)
GRAN_ROW = tl.constexpr(1)
GRAN_HEAD = tl.constexpr(2)
GRAN_BLOCK32 = tl.constexpr(3)

# Noise streams of stochastic rounding (constexpr ``SR_STREAM``): one Philox draw per element
# (``codec.uniform``), one per four (``codec.uniform4``), one per eight 16-bit draws
# (``codec.noise8``).
SR_UNIFORM = tl.constexpr(0)
SR_UNIFORM4 = tl.constexpr(1)
SR_NOISE8 = tl.constexpr(2)
