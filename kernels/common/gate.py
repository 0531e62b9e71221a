"""The output gate ``y · z · σ(z)`` of Mamba-2 (the references' ``y · silu(z)``), shared by the
replay and speculative kernels.

``σ(z) = 1 / (1 + exp(−z))``, applied as one division ``(y · z) / (1 + exp(−z))``. On the GPU
(``HW``) the division is ``div.approx.f32`` (a reciprocal and a product; at most 2 ulp for
divisors up to 2**126, and 0 beyond, where the gate is below 1e-36): Triton's ``/`` is
``div.full.f32``, the same 2 ulp, plus six range checks and scalings per value, and an output
row's gate is computed by every thread that holds a piece of the row (32 of them in the replay
flush kernel's tile), so those checks were 5 % of that kernel's loop. Under the interpreter
(no inline assembly) it is ``/``. The conventional kernel keeps ``y · z · (1 / (1 + exp(−z)))``:
there the inline division made its sm_90 listing longer (fp32 state: 632 → 664 instructions
per thread; not examined further).
"""

import triton
import triton.language as tl


@triton.jit
def gate(y, z, HW: tl.constexpr):
    z = z.to(tl.float32)
    denominator = 1.0 + tl.exp(-z)
    if HW:
        gated = tl.inline_asm_elementwise("div.approx.f32 $0, $1, $2;", "=r,r,r", [y * z, denominator],
                                          dtype=tl.float32, is_pure=True, pack=1)
    else:
        gated = y * z / denominator
    return gated
