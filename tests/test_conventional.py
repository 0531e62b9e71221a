"""The conventional decode kernel (qstate.selective_state_update) under the interpreter,
against qstate.reference and qstate.formats.

Codes and scales are compared bit for bit. The kernel's ``exp`` is numpy's under the
interpreter and may differ from torch's by one ulp, which can flip a code at a rounding tie; so
the bit-exact tests feed an already processed ``dt`` and compare with a mirror of
``decode_naive``'s arithmetic that takes ``a = exp(dt·A)`` from numpy (the mirror itself is
checked to equal ``decode_naive`` bit for bit when given torch's ``exp``). Outputs are sums
over dstate in another order, so they are compared by relative error: each output is a sum of
``dstate`` fp32 products, whose rounding error is below ``dstate · 2**-24`` relative to
``Σ|S·C|``; we bound the relative RMS error by ``dstate · 2**-24 · 4`` (the factor covers
``Σ|S·C| / |Σ S·C|`` of random data, measured below 3 here).
"""

import numpy as np
import pytest
import torch

import qstate
from qstate import formats, reference
from qstate.kernels import codec_probe

SCALED_FORMATS = [f"{d}:{g}" for d in ("int8", "fp8_e4m3", "fp8_e5m2") for g in ("row", "head", "block32")]
ALL_FORMATS = ["fp32", "bf16", "fp16", "bf16+sr", "fp16+sr", *SCALED_FORMATS, "int8:row+sr", "fp8_e4m3:block32+sr"]


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _inputs(batch, nheads, headdim, dstate, ngroups, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(batch, nheads, headdim).to(dtype),
        dt=torch.exp(torch.empty(batch, nheads).uniform_(-7, -2.3, generator=g)),
        A=-torch.exp(torch.empty(nheads).uniform_(0, 2.8, generator=g)),
        B=r(batch, ngroups, dstate).to(dtype), C=r(batch, ngroups, dstate).to(dtype),
        D=r(nheads), z=r(batch, nheads, headdim).to(dtype),
    )


def _mirror_step(values, x, dt, A, B, C, D, z, exp):
    """decode_naive's fp32 step with ``a = exp(dt·A)`` from ``exp``; returns (y, new state)."""
    nheads = x.shape[1]
    Bh = B.float().repeat_interleave(nheads // B.shape[1], dim=1)
    Ch = C.float().repeat_interleave(nheads // C.shape[1], dim=1)
    a = exp(dt * A)
    S = a[..., None, None] * values + (dt[..., None] * x.float())[..., None] * Bh[..., None, :]
    y = (S * Ch[..., None, :]).sum(-1) + D[:, None] * x.float()
    return y * z.float() * torch.sigmoid(z.float()), S


def _numpy_exp(t):
    return torch.from_numpy(np.exp(t.numpy()))


def _kernel_noise(fmt, shape, seed):
    """The kernel's uniform noise for every element of a state of ``shape`` (same Philox stream)."""
    nslots, nheads, headdim, dstate = shape
    zeros = torch.zeros(nslots * nheads, headdim, dstate)
    return codec_probe.quantize_heads(zeros, fmt, seed=seed, hardware_casts=False)[2].reshape(shape)


def _stored(fmt, shape, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    return formats.quantize(torch.randn(shape, generator=g) * 3, fmt)


def _rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_mirror_equals_decode_naive():
    fmt = formats.StateFormat.parse("int8:row")
    inp = _inputs(2, 4, 8, 32, 2)
    q = _stored(fmt, (2, 4, 8, 32))
    y_ref, S_ref = reference.decode_naive(
        formats.dequantize(q), *(inp[k][None] if k not in ("A", "D") else inp[k] for k in ("x", "dt", "A", "B", "C", "D", "z")),
        fmt=fmt)
    y, S = _mirror_step(formats.dequantize(q), **inp, exp=torch.exp)
    assert torch.equal(y, y_ref[0])
    assert torch.equal(_bits(formats.quantize(S, fmt).data), _bits(formats.quantize(S_ref, fmt).data))


@pytest.mark.parametrize("text", ALL_FORMATS)
def test_steps_codes_and_scales_bit_exact(text):
    fmt = formats.StateFormat.parse(text)
    shape = (2, 6, 80, 96) if fmt.granularity != "block32" else (2, 6, 80, 64)
    q = _stored(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    values = formats.dequantize(q)
    for step in range(2):
        inp = _inputs(2, 6, shape[2], shape[3], 2, seed=step)
        out = torch.full_like(inp["x"], float("nan"))
        qstate.selective_state_update(state, **inp, state_scale=scale, state_format=text, out=out, seed=11 + step)
        y_ref, S_ref = _mirror_step(values, **inp, exp=_numpy_exp)
        noise = _kernel_noise(fmt, shape, 11 + step) if fmt.stochastic else None
        expected = formats.quantize(S_ref, fmt, noise=noise)
        assert torch.equal(_bits(state), _bits(expected.data)), f"step {step}"
        if fmt.scaled:
            assert torch.equal(_bits(scale), _bits(expected.scale)), f"step {step}"
        assert _rel_rms(out, y_ref) < shape[3] * 2**-24 * 4
        values = formats.dequantize(expected)


@pytest.mark.parametrize("ngroups,nheads", [(1, 6), (2, 6), (8, 8)])
def test_odd_shapes_and_softplus_path_against_fp64(ngroups, nheads):
    """Full path (dt_bias, softplus, D, z) on odd shapes, fp32 state: the only error is fp32
    rounding of one step, relative RMS ~ 1e-7; we allow 1e-5 (softplus evaluated differently)."""
    batch, headdim, dstate = 3, 80, 96
    inp = _inputs(batch, nheads, headdim, dstate, ngroups)
    dt_raw = torch.randn(batch, nheads) * 0.5
    dt_bias = torch.randn(nheads) - 4
    state0 = torch.randn(batch, nheads, headdim, dstate)
    state = state0.clone()
    out = torch.full_like(inp["x"], float("nan"))
    kw = {k: v for k, v in inp.items() if k != "dt"}
    qstate.selective_state_update(state, dt=dt_raw, dt_bias=dt_bias, dt_softplus=True, out=out, **kw)
    y_ref, S_ref = reference.mamba2_step(state0, inp["x"], dt_raw, inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
                                         dt_bias, True)
    assert not out.isnan().any()
    assert _rel_rms(out, y_ref) < 1e-5
    assert _rel_rms(state, S_ref) < 1e-5


def test_bf16_inputs_and_output():
    inp = _inputs(2, 4, 16, 32, 2, dtype=torch.bfloat16)
    state0 = torch.randn(2, 4, 16, 32)
    state = state0.clone()
    out = qstate.selective_state_update(state, **inp)
    y_ref, S_ref = _mirror_step(state0, **inp, exp=_numpy_exp)
    assert out.dtype == torch.bfloat16
    assert torch.equal(state, S_ref)
    # One bf16 rounding of the output: relative error at most 2**-9 per element.
    assert ((out.double() - y_ref.double()).abs() <= y_ref.double().abs() * 2**-8 + 1e-6).all()


def test_tied_stride_form_equals_compact_form():
    inp = _inputs(2, 4, 16, 32, 2)
    state_a, state_b = torch.randn(2, 4, 16, 32), None
    state_b = state_a.clone()
    y_a = qstate.selective_state_update(state_a, **inp, dt_bias=torch.zeros(4))
    tied = dict(inp)
    tied["A"] = inp["A"][:, None, None].expand(4, 16, 32)
    tied["dt"] = inp["dt"][..., None].expand(2, 4, 16)
    tied["D"] = inp["D"][:, None].expand(4, 16)
    y_b = qstate.selective_state_update(state_b, **tied, dt_bias=torch.zeros(4, 1).expand(4, 16))
    assert torch.equal(y_a, y_b) and torch.equal(state_a, state_b)


@pytest.mark.parametrize("text", ["fp32", "int8:row", "fp8_e4m3:head"])
def test_slot_indices_padding_and_untouched_slots(text):
    fmt = formats.StateFormat.parse(text)
    shape = (6, 4, 16, 32)
    q = _stored(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    inp = _inputs(4, 4, 16, 32, 2)
    indices = torch.tensor([3, -1, 0, 5], dtype=torch.int32)  # 5 is pad_slot_id below
    out = torch.full_like(inp["x"], float("nan"))
    qstate.selective_state_update(state, **inp, state_batch_indices=indices, state_scale=scale, state_format=text,
                                  out=out, pad_slot_id=5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    for untouched in (1, 2, 4, 5):
        assert torch.equal(_bits(state[untouched]), _bits(q.data[untouched]))
        if scale is not None:
            assert torch.equal(scale[untouched], q.scale[untouched])
    values = formats.dequantize(q)
    for row, slot in ((0, 3), (2, 0)):
        one = {k: (v[row:row + 1] if k not in ("A", "D") else v) for k, v in inp.items()}
        y_ref, S_ref = _mirror_step(values[slot:slot + 1], **one, exp=_numpy_exp)
        expected = formats.quantize(S_ref, fmt)
        assert torch.equal(_bits(state[slot:slot + 1]), _bits(expected.data))
        assert _rel_rms(out[row:row + 1], y_ref) < 32 * 2**-24 * 4


def test_nan_in_one_slot_stays_there():
    fmt = formats.StateFormat.parse("int8:head")
    q = _stored(fmt, (3, 2, 8, 32))
    state, scale = q.data.clone(), q.scale.clone()
    scale[1, 0] = float("nan")
    inp = _inputs(3, 2, 8, 32, 1)
    out = qstate.selective_state_update(state, **inp, state_scale=scale, state_format="int8:head")
    assert not out[0].isnan().any() and not out[2].isnan().any()
    assert not scale[0].isnan().any() and not scale[2].isnan().any() and not scale[1, 1].isnan().any()


def test_stochastic_rounding_depends_on_seed_and_is_unbiased():
    fmt = "int8:row+sr"
    q = _stored(formats.StateFormat.parse("int8:row"), (1, 1, 4, 32))
    inp = _inputs(1, 1, 4, 32, 1)
    states = []
    for seed in (1, 1, 2):
        state, scale = q.data.clone(), q.scale.clone()
        qstate.selective_state_update(state, **inp, state_scale=scale, state_format=fmt, seed=seed)
        states.append(state)
    assert torch.equal(states[0], states[1]) and not torch.equal(states[0], states[2])
    seed_tensor = torch.tensor([1])
    state, scale = q.data.clone(), q.scale.clone()
    qstate.selective_state_update(state, **inp, state_scale=scale, state_format=fmt, seed=seed_tensor)
    assert torch.equal(state, states[0])


def test_torch_compile_through_the_custom_op():
    inp = _inputs(2, 4, 8, 32, 2)
    state = torch.randn(2, 4, 8, 32)
    expected_state = state.clone()
    expected = qstate.selective_state_update(expected_state, **inp)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(state, x, dt, A, B, C, D, z):
        return qstate.selective_state_update(state, x, dt, A, B, C, D, z)

    out = step(state, **inp)
    assert torch.equal(out, expected) and torch.equal(state, expected_state)


def _bad(**overrides):
    inp = _inputs(2, 4, 8, 32, 2)
    args = dict(state=torch.zeros(2, 4, 8, 32, dtype=torch.int8), state_scale=torch.ones(2, 4, 8),
                state_format="int8:row", **inp)
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,exc,name", [
    (dict(state_scale=None), ValueError, "state_scale"),
    (dict(state_scale=torch.ones(2, 4)), ValueError, "state_scale"),
    (dict(state_scale=torch.ones(2, 4, 8, dtype=torch.float16)), TypeError, "state_scale"),
    (dict(state=torch.zeros(2, 4, 8, 32)), TypeError, "state"),
    (dict(state_format="int9"), ValueError, "state_format"),
    (dict(x=torch.zeros(2, 4, 7)), ValueError, "x"),
    (dict(x=torch.zeros(2, 4, 16)[..., ::2]), ValueError, "x"),
    (dict(B=torch.zeros(2, 3, 32)), ValueError, "B"),
    (dict(dt=torch.zeros(2, 4, 8)), ValueError, "dt"),
    (dict(A=torch.zeros(4, 8, 32)), ValueError, "A"),
    (dict(z=torch.zeros(2, 4, 8, dtype=torch.int32)), TypeError, "z"),
    (dict(state_batch_indices=torch.tensor([0, 2])), ValueError, "state_batch_indices"),
    (dict(state_batch_indices=torch.tensor([0.0, 1.0])), TypeError, "state_batch_indices"),
    (dict(seed="x"), TypeError, "seed"),
])
def test_bad_input_names_the_argument(overrides, exc, name):
    args = _bad(**overrides)
    state = args.pop("state")
    with pytest.raises(exc, match=rf"^{name}:"):
        qstate.selective_state_update(state, **args)
