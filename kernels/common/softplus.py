"""``softplus`` of Mamba-2's dt, shared by every decode kernel (identity above 20, as the
references)."""

import triton
import triton.language as tl


@triton.jit
def softplus(v):
    # log1p(e) with log1p(w) = log(1 + w) · w / ((1 + w) − 1), accurate to a few ulp where
    # log(1 + w) alone loses every digit (small w).
    e = tl.exp(v)
    one_plus = 1.0 + e
    log1p = tl.where(one_plus == 1.0, e, tl.log(one_plus) * e / (one_plus - 1.0))
    return tl.where(v <= 20.0, log1p, v)
