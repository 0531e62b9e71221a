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

import inspect

import numpy as np
import pytest
import torch

import qstate
from qstate import formats, reference
from qstate.kernels.common import codec, codec_probe, launch
from qstate.kernels.mamba2 import conventional

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


def _kernel_noise(fmt, shape, seed, variant=None):
    """The kernel's uniform noise for every element of a state of ``shape`` (the stream of
    ``variant``, by default the one the launcher runs for this format)."""
    variant = variant or conventional.DEFAULT_VARIANTS[(fmt.storage_dtype.itemsize, fmt.stochastic)]
    nslots, nheads, headdim, dstate = shape
    zeros = torch.zeros(nslots * nheads, headdim, dstate)
    return codec_probe.quantize_heads(zeros, fmt, seed=seed, hardware_casts=False, sr_stream=variant.sr_stream,
                                      sr_rounds=variant.sr_rounds)[2].reshape(shape)


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


def _check_padding_and_untouched_slots(text, nheads):
    """Rows 1 (negative index) and 3 (pad_slot_id) output zero; slots 1, 2, 4, 5 stay bit for bit;
    slots 3 and 0 hold one mirrored step of rows 0 and 2."""
    fmt = formats.StateFormat.parse(text)
    shape = (6, nheads, 16, 32)
    q = _stored(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    inp = _inputs(4, nheads, 16, 32, 2)
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


@pytest.mark.parametrize("text", ["fp32", "int8:row", "fp8_e4m3:head"])
def test_slot_indices_padding_and_untouched_slots(text):
    _check_padding_and_untouched_slots(text, nheads=4)


def test_pad_slot_id_past_the_slots_is_padding():
    """An index equal to ``pad_slot_id`` is padding even when it is not a valid slot (vLLM pads
    with such ids): its row outputs zero and no slot changes, as a negative index does."""
    inp = _inputs(2, 4, 8, 32, 2)
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
    q = _stored(fmt, (3, 2, 8, 32))
    inp = _inputs(3, 2, 8, 32, 1)
    runs = []
    for poison in (False, True):
        state, scale = q.data.clone(), q.scale.clone()
        if poison:
            scale[1, 0] = float("nan")
        out = qstate.selective_state_update(state, **inp, state_scale=scale, state_format="int8:head")
        runs.append((_bits(out), _bits(state), _bits(scale)))
    (out0, state0, scale0), (out1, state1, scale1) = runs
    assert torch.equal(out1[[0, 2]], out0[[0, 2]]) and torch.equal(out1[1, 1], out0[1, 1])
    assert torch.equal(state1[[0, 2]], state0[[0, 2]]) and torch.equal(state1[1, 1], state0[1, 1])
    assert torch.equal(scale1[[0, 2]], scale0[[0, 2]]) and torch.equal(scale1[1, 1], scale0[1, 1])


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


# Kernel variants (kernels/conventional.Variant): each must give the default path's bits.
VARIANTS = {
    "even": conventional.Variant(even=True),
    "even-hpp2-prefetch": conventional.Variant(even=True, heads_per_prog=2, prefetch=True),
    "hpp4-stages2": conventional.Variant(heads_per_prog=4, num_stages=2),
    "even-hpp8-prefetch-sr4": conventional.Variant(even=True, heads_per_prog=8, prefetch=True, sr_stream=1),
    "sr4-rounds7": conventional.Variant(sr_stream=1, sr_rounds=7),
}
# The GPU's head-loop launches (conventional.HEAD_LOOP_CONFIGS), each with the format it serves.
_LOOP_FORMATS = {(codec.INT8, False): "int8:row", (codec.INT8, True): "int8:row+sr", (codec.BF16, True): "bf16+sr",
                 (codec.FP16, True): "fp16+sr"}
VARIANTS.update({f"loop-{_LOOP_FORMATS[key]}": config[2] for key, config in conventional.HEAD_LOOP_CONFIGS.items()})
VARIANT_FORMATS = {
    "even": ["fp16", "int8:row", "fp8_e4m3:row", "fp8_e5m2:block32", "int8:head", "int8:row+sr"],
    "even-hpp2-prefetch": ["fp16", "int8:row", "fp8_e4m3:row", "fp8_e5m2:block32", "int8:head", "fp8_e4m3:row+sr"],
    "hpp4-stages2": ["bf16", "int8:row", "fp8_e5m2:block32", "int8:head"],
    "even-hpp8-prefetch-sr4": ["fp16+sr", "bf16+sr", "int8:row+sr", "fp8_e4m3:row+sr", "fp8_e5m2:block32+sr",
                               "int8:head+sr"],
    "sr4-rounds7": ["int8:row+sr", "fp16+sr"],
    **{f"loop-{text}": [text] for text in _LOOP_FORMATS.values()},
}
# (nheads, headdim, dstate, ngroups, BLOCK_P): "even" splits headdim in tiles that divide it
# (EVEN applies, 4 heads per group); "odd" is 6 × 80 × 96 with one group (EVEN cannot apply,
# heads_per_prog 4 and 8 fall back to 2).
VARIANT_SHAPES = {"even": (8, 16, 32, 2, 8), "odd": (6, 80, 96, 1, None)}


@pytest.fixture
def use_variant(monkeypatch):
    """Run the public op with ``variant`` for every state width (and BLOCK_P forced when given)."""
    def apply(variant, block_p=None):
        monkeypatch.setattr(conventional, "DEFAULT_VARIANTS", {key: variant for key in conventional.DEFAULT_VARIANTS})
        if block_p is not None:
            config = conventional.tile_config
            monkeypatch.setattr(conventional, "tile_config", lambda *a, **k: (block_p,) + config(*a, **k)[1:])
    return apply


@pytest.mark.parametrize("shape_name", list(VARIANT_SHAPES))
@pytest.mark.parametrize("name,text", [(n, t) for n, ts in VARIANT_FORMATS.items() for t in ts])
def test_variant_steps_codes_and_scales_bit_exact(use_variant, name, text, shape_name):
    variant = VARIANTS[name]
    nheads, headdim, dstate, ngroups, block_p = VARIANT_SHAPES[shape_name]
    fmt = formats.StateFormat.parse(text)
    if fmt.granularity == "block32":
        dstate = 64 if shape_name == "odd" else dstate
    use_variant(variant, block_p)  # the launcher must widen a head-granularity tile to the whole head
    shape = (2, nheads, headdim, dstate)
    q = _stored(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    values = formats.dequantize(q)
    for step in range(2):
        inp = _inputs(2, nheads, headdim, dstate, ngroups, seed=step)
        out = torch.full_like(inp["x"], float("nan"))
        qstate.selective_state_update(state, **inp, state_scale=scale, state_format=text, out=out, seed=11 + step)
        y_ref, S_ref = _mirror_step(values, **inp, exp=_numpy_exp)
        noise = _kernel_noise(fmt, shape, 11 + step, variant) if fmt.stochastic else None
        expected = formats.quantize(S_ref, fmt, noise=noise)
        assert torch.equal(_bits(state), _bits(expected.data)), f"step {step}"
        if fmt.scaled:
            assert torch.equal(_bits(scale), _bits(expected.scale)), f"step {step}"
        assert _rel_rms(out, y_ref) < dstate * 2**-24 * 4
        values = formats.dequantize(expected)


@pytest.mark.parametrize("name", ["even", "even-hpp2-prefetch", "hpp4-stages2"])
@pytest.mark.parametrize("text", ["int8:row", "fp8_e4m3:head"])
def test_variant_padding_and_untouched_slots(use_variant, name, text):
    use_variant(VARIANTS[name], 8 if text != "fp8_e4m3:head" else None)
    _check_padding_and_untouched_slots(text, nheads=8)


def test_launch_config_loops_over_heads_on_a_gpu_from_enough_programs():
    """The GPU launch of int8 row codes with round to nearest takes HEAD_LOOP_CONFIGS' 16-head
    prefetching one-warp tile once its grid has HEAD_LOOP_MIN_PROGRAMS programs, and so do the
    other formats with an entry (bf16+sr, fp16+sr, int8:row+sr); other formats, smaller grids and
    the interpreter keep tile_config's tile and DEFAULT_VARIANTS' variant."""
    rows, warps, variant, maxnreg = conventional.HEAD_LOOP_CONFIGS[(codec.INT8, False)]

    def config(text, batch, nheads=128, per_group=16, on_gpu=True):
        fmt = formats.StateFormat.parse(text)
        return conventional.launch_config(
            fmt.storage_dtype.itemsize, 64, 128, codec.granularity_code(fmt), batch, nheads, per_group, on_gpu,
            fmt.stochastic, codec.dtype_code(fmt) if on_gpu else None)

    assert config("int8:row", 256) == (rows, 128, warps, variant, maxnreg)
    assert config("int8:row", 64) == (rows, 128, warps, variant, maxnreg)  # 64 rows × 8 groups × 2 tiles = 1024
    assert config("int8:row", 64, nheads=64, per_group=8)[3] == variant
    for text in ("bf16+sr", "fp16+sr", "int8:row+sr"):
        fmt = formats.StateFormat.parse(text)
        assert config(text, 256)[:1] + config(text, 256)[2:] == conventional.HEAD_LOOP_CONFIGS[
            (codec.dtype_code(fmt), True)]
    for text, batch, on_gpu in (("int8:row", 32, True), ("int8:row", 256, False), ("int8:head", 256, True),
                                ("int8:row+sr", 1, True), ("bf16+sr", 256, False), ("bf16+sr", 1, True),
                                ("fp8_e4m3:row", 256, True), ("fp8_e4m3:row+sr", 256, True)):
        fmt = formats.StateFormat.parse(text)
        nbytes = fmt.storage_dtype.itemsize
        tile = conventional.tile_config(nbytes, 64, 128, codec.granularity_code(fmt), batch, 128, on_gpu,
                                        fmt.stochastic, codec.dtype_code(fmt) if on_gpu else None)
        cap = conventional.REGISTER_CAPS.get((codec.dtype_code(fmt), fmt.stochastic)) if on_gpu else None
        cap = cap if fmt.granularity in (None, "row") else None
        assert config(text, batch, on_gpu=on_gpu) == tile + (conventional.DEFAULT_VARIANTS[(nbytes, fmt.stochastic)],
                                                             cap)


def test_register_caps_apply_to_default_gpu_launches_of_their_formats(monkeypatch):
    """launch_config's register cap (REGISTER_CAPS at the tables' tiles, HEAD_LOOP_CONFIGS' own on
    head loops) reaches a GPU launch's options only for the default launch of an unscaled or
    row-scaled format; an explicit maxnreg (0: none) or tile wins, and the interpreter takes none."""
    def plan(text, batch=256, device="cuda", **overrides):
        fmt = formats.StateFormat.parse(text)
        args = dict(block_p=None, num_warps=None, variant=None, fused=None, maxnreg=None)
        args.update(overrides)
        conventional._plan.cache_clear()
        return conventional._plan(
            fmt.storage_dtype.itemsize, 128, 64, 128, batch, 16, torch.device(device), codec.dtype_code(fmt),
            codec.granularity_code(fmt), fmt.stochastic, codec.qmax(fmt), codec.emax(fmt), True, 0, True, True,
            True, True, False, *args.values()).constexprs

    monkeypatch.setattr(conventional.pdl, "enabled", lambda device: False)  # no GPU to ask
    loop_caps = {key: config[3] for key, config in conventional.HEAD_LOOP_CONFIGS.items()}
    assert plan("bf16+sr")["maxnreg"] == loop_caps[(codec.BF16, True)]
    assert plan("fp16+sr")["maxnreg"] == loop_caps[(codec.FP16, True)]
    assert plan("int8:row+sr")["maxnreg"] == loop_caps[(codec.INT8, True)]
    assert plan("bf16+sr", batch=1)["maxnreg"] == conventional.REGISTER_CAPS[(codec.BF16, True)]  # the table tile
    assert "maxnreg" not in plan("fp16+sr", batch=1)
    assert "maxnreg" not in plan("bf16+sr", maxnreg=0)
    assert "maxnreg" not in plan("bf16+sr", block_p=16)
    assert plan("bf16+sr", block_p=16, maxnreg=80)["maxnreg"] == 80
    assert "maxnreg" not in plan("int8:head+sr")
    assert "maxnreg" not in plan("fp8_e4m3:row+sr")
    assert "maxnreg" not in plan("bf16+sr", device="cpu")
    conventional._plan.cache_clear()


def test_prefetch_config_steps_bit_exact_with_padding():
    """HEAD_LOOP_CONFIGS' int8 configuration as a GPU launches it (16 heads of a group per
    program, the next head prefetched, 32-row one-warp tiles), forced under the interpreter: two
    steps over padded and out-of-order slot indices equal the mirrored fp32 step's codes and
    scales bit for bit, padded rows output zero and untouched slots keep every bit."""
    rows, warps, variant, _ = conventional.HEAD_LOOP_CONFIGS[(codec.INT8, False)]
    fmt = formats.StateFormat.parse("int8:row")
    nslots, nheads, headdim, dstate = 5, 16, 64, 128
    q = _stored(fmt, (nslots, nheads, headdim, dstate))
    state, scale = q.data.clone(), q.scale.clone()
    indices = torch.tensor([3, -1, 0], dtype=torch.int32)
    values = formats.dequantize(q)
    for step in range(2):
        inp = _inputs(3, nheads, headdim, dstate, 1, seed=step)
        out = torch.full_like(inp["x"], float("nan"))
        conventional.launch(
            state, scale, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], None, indices, out,
            0, None, dtype_code=codec.INT8, granularity=codec.GRAN_ROW, stochastic=False, qmax=127.0, emax=6,
            dt_softplus=False, pad_slot_id=-1, heads_per_group=nheads, block_p=rows, num_warps=warps, variant=variant)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        for row, slot in ((0, 3), (2, 0)):
            one = {k: (v[row:row + 1] if k not in ("A", "D") else v) for k, v in inp.items()}
            y_ref, S_ref = _mirror_step(values[slot:slot + 1], **one, exp=_numpy_exp)
            expected = formats.quantize(S_ref, fmt)
            assert torch.equal(state[slot:slot + 1], expected.data), f"step {step} slot {slot}"
            assert torch.equal(_bits(scale[slot:slot + 1]), _bits(expected.scale)), f"step {step} slot {slot}"
            assert _rel_rms(out[row:row + 1], y_ref) < dstate * 2**-24 * 4
            values[slot:slot + 1] = formats.dequantize(expected)
        for untouched in (1, 2, 4):
            assert torch.equal(state[untouched], q.data[untouched])
            assert torch.equal(_bits(scale[untouched]), _bits(q.scale[untouched]))


@pytest.mark.parametrize("name", ["default", "even-hpp2-prefetch"])
def test_out_of_range_row_outputs_nan_and_writes_nothing(name):
    """An index ≥ nslots reaches the kernel only on a GPU (no host check there): launch directly."""
    variant = VARIANTS.get(name, conventional.Variant())
    fmt = formats.StateFormat.parse("int8:row")
    q = _stored(fmt, (2, 4, 16, 32))
    state, scale = q.data.clone(), q.scale.clone()
    inp = _inputs(2, 4, 16, 32, 2)
    out = torch.full_like(inp["x"], 7.0)
    conventional.launch(
        state, scale, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], None,
        torch.tensor([1, 2], dtype=torch.int32), out, 0, None, dtype_code=codec.INT8, granularity=codec.GRAN_ROW,
        stochastic=False, qmax=127.0, emax=6, dt_softplus=False, pad_slot_id=-1, heads_per_group=2, block_p=8,
        variant=variant)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert torch.equal(state[0], q.data[0]) and torch.equal(_bits(scale[0]), _bits(q.scale[0]))
    assert not torch.equal(state[1], q.data[1])


@pytest.mark.parametrize("name", ["default", "sr4-rounds7", "even-hpp8-prefetch-sr4"])
def test_variant_stochastic_rounding_is_unbiased(use_variant, name):
    """Mean over 64 seeds of (stored − unrounded)/step per element: each term lies in (−1, 1)
    with sd ≤ 1/2, so the mean over 64 × 128 draws has sd ≤ 0.0055; we allow 0.03."""
    variant = VARIANTS.get(name, conventional.Variant())
    use_variant(variant)
    fmt = formats.StateFormat.parse("int8:row")
    q = _stored(fmt, (1, 1, 4, 32))
    inp = _inputs(1, 1, 4, 32, 1)
    _, S_ref = _mirror_step(formats.dequantize(q), **inp, exp=_numpy_exp)
    errors = []
    for seed in range(64):
        state, scale = q.data.clone(), q.scale.clone()
        qstate.selective_state_update(state, **inp, state_scale=scale, state_format="int8:row+sr", seed=seed)
        errors.append((state.float() * scale[..., None] - S_ref) / scale[..., None])
    errors = torch.stack(errors)
    assert errors.abs().max() < 1
    assert abs(errors.mean().item()) < 0.03


def test_bench_variant_cases_run_on_tiny_buffers():
    """bench/cases_conventional's variant sweep (timed on the GPU): every case builds and one
    call of each runs (tiny shapes, CPU) with finite outputs, so the GPU run meets no Python error."""
    from bench import cases_conventional

    cases = cases_conventional.variant_cases(torch.device("cpu"))
    assert len(cases) <= 40 and len({c.name for c in cases}) == len(cases)
    for case in cases:
        fmt = formats.StateFormat.parse(case.params["format"].split(" ")[0])
        q = _stored(fmt, (2, 8, 16, 32))
        inp = _inputs(2, 8, 16, 32, 2, dtype=torch.bfloat16)
        buffers = dict(inp, state=q.data.clone(), state_scale=None if q.scale is None else q.scale.clone(),
                       dt_bias=torch.zeros(8), out=torch.full_like(inp["x"], float("nan")),
                       state_batch_indices=torch.arange(2, dtype=torch.int32))
        case.run(buffers)
        assert torch.isfinite(buffers["out"].float()).all(), case.name


def test_fake_impl_traces_without_running():
    """Under ``FakeTensorMode`` (and on meta tensors) the call goes through the custom op's fake
    implementation: shapes come back, no kernel runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        inp = _inputs(2, 4, 8, 32, 2)
        out = qstate.selective_state_update(torch.zeros(2, 4, 8, 32), **inp)
    assert out.shape == (2, 4, 8)
    meta = {k: v.to("meta") for k, v in _inputs(2, 4, 8, 32, 2).items()}
    out = qstate.selective_state_update(torch.zeros(2, 4, 8, 32, device="meta"), **meta)
    assert out.shape == (2, 4, 8) and out.device.type == "meta"


def _eager_call_inputs(seed, nheads=6, headdim=8, dstate=32, ngroups=2):
    """A batch-2 call in the tied (mamba_ssm) form with every optional argument, bf16 x/z/out
    and an int8:row state: each view the launcher makes (storage view, compact dt and A, the
    bf16 output as int16) must stand for the caller's tensor."""
    fmt = formats.StateFormat.parse("int8:row")
    inp = _inputs(2, nheads, headdim, dstate, ngroups, seed=seed, dtype=torch.bfloat16)
    stored = _stored(fmt, (3, nheads, headdim, dstate), seed=seed)
    return dict(
        state=stored.data, x=inp["x"], dt=inp["dt"][..., None].expand(2, nheads, headdim),
        A=inp["A"][:, None, None].expand(nheads, headdim, dstate), B=inp["B"], C=inp["C"], D=inp["D"],
        z=inp["z"], dt_bias=torch.zeros(nheads), dt_softplus=True,
        state_batch_indices=torch.tensor([2, -1]), state_scale=stored.scale, state_format="int8:row",
        out=torch.empty(2, nheads, headdim, dtype=torch.bfloat16), seed=7,
    )


def test_an_eager_repeat_launches_what_the_full_path_would(stand_in_kernels):
    """Second call, same signature, other tensors: one compiled launch, no bind, with exactly
    the arguments the launcher computes for that call (tensors by address)."""
    log = stand_in_kernels(conventional)
    qstate.selective_state_update(**_eager_call_inputs(0))
    second = _eager_call_inputs(1)
    qstate.selective_state_update(**second)
    assert [entry[0] for entry in log] == ["bind", "compiled"]
    constexprs = log[0][3]
    launched = log[1][2]
    s, fmt = second, formats.StateFormat.parse("int8:row")
    grid, expected, expected_constexprs = conventional._kernel_call(
        codec.storage_view(s["state"], fmt), s["state_scale"], s["x"], s["dt"][..., 0], s["A"][:, 0, 0], s["B"],
        s["C"], s["D"], s["z"], s["dt_bias"], s["state_batch_indices"], s["out"], 7, None,
        dtype_code=codec.dtype_code(fmt), granularity=codec.granularity_code(fmt), stochastic=False,
        qmax=codec.qmax(fmt), emax=codec.emax(fmt), dt_softplus=True, pad_slot_id=-1, heads_per_group=3)
    assert expected_constexprs == constexprs
    parameters = inspect.signature(conventional._conventional_kernel.fn).parameters
    assert len(launched) == len(parameters)
    for got, want in zip(launched, expected):
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.data_ptr() == want.data_ptr()
        else:
            assert got == want
    trailing = launched[len(expected):]
    names = list(parameters)[len(expected):]
    assert trailing == tuple(constexprs.get(name, parameters[name].default) for name in names)


def test_an_eager_repeat_takes_the_full_path_where_it_must(stand_in_kernels):
    """A strided A is copied for the launch (never prepared); a tensor at another 16-byte
    alignment and a tensor seed are other kernels (bind again)."""
    log = stand_in_kernels(conventional)

    def call(inputs_seed, **overrides):
        """How the call launched: "bind", "compiled" (CompiledLaunch's table: the launcher's
        int16 view of the bf16 output) or "prepared" (the caller's bf16 output itself)."""
        args = _eager_call_inputs(inputs_seed)
        args.update(overrides)
        qstate.selective_state_update(**args)
        kind, _, launched = log[-1][:3]
        return "prepared" if kind == "compiled" and launched[11].dtype == torch.bfloat16 else kind

    strided_A = lambda: (-torch.rand(12))[::2]  # noqa: E731
    assert [call(0, A=strided_A()), call(1, A=strided_A())] == ["bind", "compiled"]
    assert [call(0), call(1)] == ["compiled", "prepared"]
    x = _eager_call_inputs(2)["x"]
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)  # 2 bytes off
    assert call(2, x=shifted) == "bind"
    assert call(3, seed=torch.tensor([5], dtype=torch.int32)) == "bind"
    assert call(4, seed=torch.tensor([6], dtype=torch.int32)) == "prepared"
