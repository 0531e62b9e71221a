"""Helpers of the replay tests (``tests/mamba2/test_replay*.py``): time-major decode inputs,
one step's arguments, and a cache."""

import torch

from qstate.cache import ReplayCache


def make_inputs(T, batch, nheads, headdim, dstate, ngroups, *, seed=0, dtype=torch.float32):
    """Time-major decode inputs with decays in [0.2, 0.99] per step (softplus dt ≈ 0.05–0.4)."""
    g = torch.Generator().manual_seed(seed)
    A = -(0.5 + 3.5 * torch.rand(nheads, generator=g))
    return dict(
        x=torch.randn(T, batch, nheads, headdim, generator=g).to(dtype),
        dt=0.5 * torch.randn(T, batch, nheads, generator=g),
        A=A,
        B=torch.randn(T, batch, ngroups, dstate, generator=g).to(dtype),
        C=torch.randn(T, batch, ngroups, dstate, generator=g),
        D=torch.randn(nheads, generator=g),
        z=torch.randn(T, batch, nheads, headdim, generator=g),
        dt_bias=-2.0 + 0.5 * torch.randn(nheads, generator=g),
    )


def step_args(inp, t, rows=slice(None)):
    return dict(x=inp["x"][t, rows], dt=inp["dt"][t, rows], A=inp["A"], B=inp["B"][t, rows],
                C=inp["C"][t, rows], D=inp["D"], z=inp["z"][t, rows], dt_bias=inp["dt_bias"])


def new_cache(batch, nheads, headdim, dstate, ngroups, *, ring_len, checkpoint="fp32", read=None,
              dtype=torch.float32, slots=None):
    return ReplayCache.allocate(slots or batch, nheads, headdim, dstate, ngroups, ring_len=ring_len,
                                checkpoint=checkpoint, read=read, input_dtype=dtype)
