"""Helpers of the conventional kernel's tests (``tests/mamba2/test_conventional*.py``): random
inputs and stored states, a mirror of ``decode_naive``'s fp32 step, the kernel's noise, and the
padding check several launch variants must pass."""

import numpy as np
import torch

import qstate
from qstate import formats
from qstate.kernels.common import codec_probe
from qstate.kernels.mamba2 import conventional

from helpers.codes import bits_of  # noqa: F401 (the tests import it from here)


def random_inputs(batch, nheads, headdim, dstate, ngroups, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(batch, nheads, headdim).to(dtype),
        dt=torch.exp(torch.empty(batch, nheads).uniform_(-7, -2.3, generator=g)),
        A=-torch.exp(torch.empty(nheads).uniform_(0, 2.8, generator=g)),
        B=r(batch, ngroups, dstate).to(dtype), C=r(batch, ngroups, dstate).to(dtype),
        D=r(nheads), z=r(batch, nheads, headdim).to(dtype),
    )


def mirror_step(values, x, dt, A, B, C, D, z, exp):
    """decode_naive's fp32 step with ``a = exp(dt·A)`` from ``exp``; returns (y, new state)."""
    nheads = x.shape[1]
    Bh = B.float().repeat_interleave(nheads // B.shape[1], dim=1)
    Ch = C.float().repeat_interleave(nheads // C.shape[1], dim=1)
    a = exp(dt * A)
    S = a[..., None, None] * values + (dt[..., None] * x.float())[..., None] * Bh[..., None, :]
    y = (S * Ch[..., None, :]).sum(-1) + D[:, None] * x.float()
    return y * z.float() * torch.sigmoid(z.float()), S


def numpy_exp(t):
    return torch.from_numpy(np.exp(t.numpy()))


def kernel_noise(fmt, shape, seed, variant=None):
    """The kernel's uniform noise for every element of a state of ``shape`` (the stream of
    ``variant``, by default the one the launcher runs for this format)."""
    variant = variant or conventional.DEFAULT_VARIANTS[(fmt.storage_dtype.itemsize, fmt.stochastic)]
    nslots, nheads, headdim, dstate = shape
    zeros = torch.zeros(nslots * nheads, headdim, dstate)
    return codec_probe.quantize_heads(zeros, fmt, seed=seed, hardware_casts=False, sr_stream=variant.sr_stream,
                                      sr_rounds=variant.sr_rounds)[2].reshape(shape)


def stored_state(fmt, shape, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return formats.quantize(torch.randn(shape, generator=g) * 3, fmt)


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_padding_and_untouched_slots(text, nheads):
    """Rows 1 (negative index) and 3 (pad_slot_id) output zero; slots 1, 2, 4, 5 stay bit for bit;
    slots 3 and 0 hold one mirrored step of rows 0 and 2."""
    fmt = formats.StateFormat.parse(text)
    shape = (6, nheads, 16, 32)
    q = stored_state(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    inp = random_inputs(4, nheads, 16, 32, 2)
    indices = torch.tensor([3, -1, 0, 5], dtype=torch.int32)  # 5 is pad_slot_id below
    out = torch.full_like(inp["x"], float("nan"))
    qstate.selective_state_update(state, **inp, state_batch_indices=indices, state_scale=scale, state_format=text,
                                  out=out, pad_slot_id=5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    for untouched in (1, 2, 4, 5):
        assert torch.equal(bits_of(state[untouched]), bits_of(q.data[untouched]))
        if scale is not None:
            assert torch.equal(scale[untouched], q.scale[untouched])
    values = formats.dequantize(q)
    for row, slot in ((0, 3), (2, 0)):
        one = {k: (v[row:row + 1] if k not in ("A", "D") else v) for k, v in inp.items()}
        y_ref, S_ref = mirror_step(values[slot:slot + 1], **one, exp=numpy_exp)
        expected = formats.quantize(S_ref, fmt)
        assert torch.equal(bits_of(state[slot:slot + 1]), bits_of(expected.data))
        assert rel_rms(out[row:row + 1], y_ref) < 32 * 2**-24 * 4
