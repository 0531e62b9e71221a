"""Helpers of the gated delta rule kernels' tests (``tests/gated_delta/test_*.py``): random
token inputs in the ops' compact shapes, stored states, and comparisons."""

import torch

from qstate import formats

from helpers.codes import bits_of  # noqa: F401 (the tests import it from here)


def token(batch, HK, HV, K, V, *, channel=False, seed=0, dtype=torch.float32, g_scale=0.5):
    """One token's ``q, k (batch, HK, K)``, ``v (batch, HV, V)``, ``g``, ``beta (batch, HV)``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    gate_shape = (batch, HV, K) if channel else (batch, HV)
    return dict(q=r(batch, HK, K).to(dtype), k=r(batch, HK, K).to(dtype), v=r(batch, HV, V).to(dtype),
                g=-g_scale * torch.rand(*gate_shape, generator=g), beta=torch.rand(batch, HV, generator=g))


def tokens(T, batch, HK, HV, K, V, *, channel=False, seed=0, dtype=torch.float32):
    """``T`` tokens stacked time-major (the references' layout)."""
    steps = [token(batch, HK, HV, K, V, channel=channel, seed=seed + t, dtype=dtype) for t in range(T)]
    return {name: torch.stack([s[name] for s in steps]) for name in steps[0]}


def stored_state(fmt, shape, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return formats.quantize(torch.randn(shape, generator=g), fmt)


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
