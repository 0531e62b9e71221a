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

import pytest
import torch

import qstate
from qstate import formats, reference

from helpers.conventional import (bits_of, check_padding_and_untouched_slots, kernel_noise, mirror_step, numpy_exp,
                                  random_inputs, rel_rms, stored_state)

SCALED_FORMATS = [f"{d}:{g}" for d in ("int8", "fp8_e4m3", "fp8_e5m2") for g in ("row", "head", "block32")]
ALL_FORMATS = ["fp32", "bf16", "fp16", "bf16+sr", "fp16+sr", *SCALED_FORMATS, "int8:row+sr", "fp8_e4m3:block32+sr"]


def test_mirror_equals_decode_naive():
    fmt = formats.StateFormat.parse("int8:row")
    inp = random_inputs(2, 4, 8, 32, 2)
    q = stored_state(fmt, (2, 4, 8, 32))
    y_ref, S_ref = reference.decode_naive(
        formats.dequantize(q), *(inp[k][None] if k not in ("A", "D") else inp[k] for k in ("x", "dt", "A", "B", "C", "D", "z")),
        fmt=fmt)
    y, S = mirror_step(formats.dequantize(q), **inp, exp=torch.exp)
    assert torch.equal(y, y_ref[0])
    assert torch.equal(bits_of(formats.quantize(S, fmt).data), bits_of(formats.quantize(S_ref, fmt).data))


@pytest.mark.parametrize("text", ALL_FORMATS)
def test_steps_codes_and_scales_bit_exact(text):
    fmt = formats.StateFormat.parse(text)
    shape = (2, 6, 80, 96) if fmt.granularity != "block32" else (2, 6, 80, 64)
    q = stored_state(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    values = formats.dequantize(q)
    for step in range(2):
        inp = random_inputs(2, 6, shape[2], shape[3], 2, seed=step)
        out = torch.full_like(inp["x"], float("nan"))
        qstate.selective_state_update(state, **inp, state_scale=scale, state_format=text, out=out, seed=11 + step)
        y_ref, S_ref = mirror_step(values, **inp, exp=numpy_exp)
        noise = kernel_noise(fmt, shape, 11 + step) if fmt.stochastic else None
        expected = formats.quantize(S_ref, fmt, noise=noise)
        assert torch.equal(bits_of(state), bits_of(expected.data)), f"step {step}"
        if fmt.scaled:
            assert torch.equal(bits_of(scale), bits_of(expected.scale)), f"step {step}"
        assert rel_rms(out, y_ref) < shape[3] * 2**-24 * 4
        values = formats.dequantize(expected)


@pytest.mark.parametrize("ngroups,nheads", [(1, 6), (2, 6), (8, 8)])
def test_odd_shapes_and_softplus_path_against_fp64(ngroups, nheads):
    """Full path (dt_bias, softplus, D, z) on odd shapes, fp32 state: the only error is fp32
    rounding of one step, relative RMS ~ 1e-7; we allow 1e-5 (softplus evaluated differently)."""
    batch, headdim, dstate = 3, 80, 96
    inp = random_inputs(batch, nheads, headdim, dstate, ngroups)
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
    assert rel_rms(out, y_ref) < 1e-5
    assert rel_rms(state, S_ref) < 1e-5


def test_bf16_inputs_and_output():
    inp = random_inputs(2, 4, 16, 32, 2, dtype=torch.bfloat16)
    state0 = torch.randn(2, 4, 16, 32)
    state = state0.clone()
    out = qstate.selective_state_update(state, **inp)
    y_ref, S_ref = mirror_step(state0, **inp, exp=numpy_exp)
    assert out.dtype == torch.bfloat16
    assert torch.equal(state, S_ref)
    # One bf16 rounding of the output: relative error at most 2**-9 per element.
    assert ((out.double() - y_ref.double()).abs() <= y_ref.double().abs() * 2**-8 + 1e-6).all()


def test_tied_stride_form_equals_compact_form():
    inp = random_inputs(2, 4, 16, 32, 2)
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
    check_padding_and_untouched_slots(text, nheads=4)


def test_pad_slot_id_past_the_slots_is_padding():
    """An index equal to ``pad_slot_id`` is padding even when it is not a valid slot (vLLM pads
    with such ids): its row outputs zero and no slot changes, as a negative index does."""
    inp = random_inputs(2, 4, 8, 32, 2)
    state = torch.randn(3, 4, 8, 32)
    results = []
    for indices, pad in ((torch.tensor([7, 1]), 7), (torch.tensor([-1, 1]), -1)):
        s = state.clone()
        out = torch.full((2, 4, 8), float("nan"))
        qstate.selective_state_update(s, **inp, state_batch_indices=indices, pad_slot_id=pad, out=out)
        results.append((s, out))
    (s7, out7), (s_neg, out_neg) = results
    assert torch.equal(out7[0], torch.zeros(4, 8)) and torch.equal(out7, out_neg)
    assert torch.equal(s7, s_neg)
    assert torch.equal(s7[[0, 2]], state[[0, 2]]) and not torch.equal(s7[1], state[1])
    with pytest.raises(ValueError, match=r"^state_batch_indices: expected indices < nslots = 3"):
        qstate.selective_state_update(state.clone(), **inp, state_batch_indices=torch.tensor([7, 1]), pad_slot_id=6)


def test_nan_in_one_slot_stays_there():
    """Slots 0 and 2 (outputs, codes, scales) and slot 1's other head equal a clean run bit for bit."""
    fmt = formats.StateFormat.parse("int8:head")
    q = stored_state(fmt, (3, 2, 8, 32))
    inp = random_inputs(3, 2, 8, 32, 1)
    runs = []
    for poison in (False, True):
        state, scale = q.data.clone(), q.scale.clone()
        if poison:
            scale[1, 0] = float("nan")
        out = qstate.selective_state_update(state, **inp, state_scale=scale, state_format="int8:head")
        runs.append((bits_of(out), bits_of(state), bits_of(scale)))
    (out0, state0, scale0), (out1, state1, scale1) = runs
    assert torch.equal(out1[[0, 2]], out0[[0, 2]]) and torch.equal(out1[1, 1], out0[1, 1])
    assert torch.equal(state1[[0, 2]], state0[[0, 2]]) and torch.equal(state1[1, 1], state0[1, 1])
    assert torch.equal(scale1[[0, 2]], scale0[[0, 2]]) and torch.equal(scale1[1, 1], scale0[1, 1])


def test_stochastic_rounding_depends_on_seed_and_is_unbiased():
    fmt = "int8:row+sr"
    q = stored_state(formats.StateFormat.parse("int8:row"), (1, 1, 4, 32))
    inp = random_inputs(1, 1, 4, 32, 1)
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
    inp = random_inputs(2, 4, 8, 32, 2)
    state = torch.randn(2, 4, 8, 32)
    expected_state = state.clone()
    expected = qstate.selective_state_update(expected_state, **inp)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(state, x, dt, A, B, C, D, z):
        return qstate.selective_state_update(state, x, dt, A, B, C, D, z)

    out = step(state, **inp)
    assert torch.equal(out, expected) and torch.equal(state, expected_state)


def _bad(**overrides):
    inp = random_inputs(2, 4, 8, 32, 2)
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
    # A strided view: the kernel would read [1, 9], not the [1, 0] the host checks see.
    (dict(state_batch_indices=torch.tensor([1, 9, 0, 9])[::2]), ValueError, "state_batch_indices"),
    (dict(A=torch.zeros(4, 1, 1).expand(4, 7, 9)), ValueError, "A"),
    (dict(dt=torch.zeros(2, 4, 1).expand(2, 4, 5)), ValueError, "dt"),
    (dict(D=torch.zeros(4, 1).expand(4, 3)), ValueError, "D"),
    (dict(dt_bias=torch.zeros(4, 1).expand(4, 3)), ValueError, "dt_bias"),
    (dict(dt_softplus="False"), TypeError, "dt_softplus"),
    (dict(seed="x"), TypeError, "seed"),
])
@pytest.mark.parametrize("after_a_good_call", [False, True])
def test_bad_input_names_the_argument(overrides, exc, name, after_a_good_call):
    """Also after a good call with the other arguments the same: the op runs its checks once per
    signature, so a signature that left out what makes an argument bad would pass it."""
    if after_a_good_call:
        good = _bad(state_batch_indices=torch.tensor([1, 0]))
        qstate.selective_state_update(good.pop("state"), **good)
    args = _bad(**overrides)
    state = args.pop("state")
    with pytest.raises(exc, match=rf"^{name}:"):
        qstate.selective_state_update(state, **args)


@pytest.mark.parametrize("overrides,exc,name", [
    (dict(pad_slot_id=True), TypeError, "pad_slot_id"),
    (dict(state_format=["int8:row"]), TypeError, "state_format"),
    (dict(x=torch.zeros(2, 4, 8, 2)[..., 0]), ValueError, "x"),
    (dict(out=torch.zeros(2, 4, 8, dtype=torch.float64)), TypeError, "out"),
])
def test_a_known_signature_does_not_pass_a_lookalike(overrides, exc, name):
    """Arguments equal to an accepted call's under ``==`` or hashing (True and 1) or only by
    shape (strides differ), or unhashable, still meet the checks."""
    good = _bad(pad_slot_id=1, out=torch.zeros(2, 4, 8))
    qstate.selective_state_update(good.pop("state"), **good)
    args = _bad(**{"pad_slot_id": 1, "out": torch.zeros(2, 4, 8), **overrides})
    with pytest.raises(exc, match=rf"^{name}:"):
        qstate.selective_state_update(args.pop("state"), **args)
