"""The conventional kernel's launch variants (``conventional.Variant``) and launch choices
(tiles, head loops, register caps) under the interpreter: every variant gives the default
path's codes and scales bit for bit, and the launcher picks what its tables say; also the fake
implementation and the eager path's prepared launches. The comparisons are those of
``test_conventional.py``.
"""

import inspect

import pytest
import torch

import qstate
from qstate import formats
from qstate.kernels.common import codec
from qstate.kernels.mamba2 import conventional

from helpers.conventional import (bits_of, check_padding_and_untouched_slots, kernel_noise, mirror_step, numpy_exp,
                                  random_inputs, rel_rms, stored_state)
from helpers.launches import assert_launched_as_computed

# Kernel variants (kernels/mamba2/conventional.py, Variant): each must give the default path's bits.
VARIANTS = {
    "even": conventional.Variant(even=True),
    "even-hpp2-prefetch": conventional.Variant(even=True, heads_per_prog=2, prefetch=True),
    "hpp4-stages2": conventional.Variant(heads_per_prog=4, num_stages=2),
    "even-hpp8-prefetch-sr4": conventional.Variant(even=True, heads_per_prog=8, prefetch=True,
                                                   sr_stream=codec.SR_UNIFORM4),
    "sr4-rounds7": conventional.Variant(sr_stream=codec.SR_UNIFORM4, sr_rounds=7),
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
    q = stored_state(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    values = formats.dequantize(q)
    for step in range(2):
        inp = random_inputs(2, nheads, headdim, dstate, ngroups, seed=step)
        out = torch.full_like(inp["x"], float("nan"))
        qstate.selective_state_update(state, **inp, state_scale=scale, state_format=text, out=out, seed=11 + step)
        y_ref, S_ref = mirror_step(values, **inp, exp=numpy_exp)
        noise = kernel_noise(fmt, shape, 11 + step, variant) if fmt.stochastic else None
        expected = formats.quantize(S_ref, fmt, noise=noise)
        assert torch.equal(bits_of(state), bits_of(expected.data)), f"step {step}"
        if fmt.scaled:
            assert torch.equal(bits_of(scale), bits_of(expected.scale)), f"step {step}"
        assert rel_rms(out, y_ref) < dstate * 2**-24 * 4
        values = formats.dequantize(expected)


@pytest.mark.parametrize("name", ["even", "even-hpp2-prefetch", "hpp4-stages2"])
@pytest.mark.parametrize("text", ["int8:row", "fp8_e4m3:head"])
def test_variant_padding_and_untouched_slots(use_variant, name, text):
    use_variant(VARIANTS[name], 8 if text != "fp8_e4m3:head" else None)
    check_padding_and_untouched_slots(text, nheads=8)


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
    q = stored_state(fmt, (nslots, nheads, headdim, dstate))
    state, scale = q.data.clone(), q.scale.clone()
    indices = torch.tensor([3, -1, 0], dtype=torch.int32)
    values = formats.dequantize(q)
    for step in range(2):
        inp = random_inputs(3, nheads, headdim, dstate, 1, seed=step)
        out = torch.full_like(inp["x"], float("nan"))
        conventional.launch(
            state, scale, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], None, indices, out,
            0, None, dtype_code=codec.INT8, granularity=codec.GRAN_ROW, stochastic=False, qmax=127.0, emax=6,
            dt_softplus=False, pad_slot_id=-1, heads_per_group=nheads, block_p=rows, num_warps=warps, variant=variant)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        for row, slot in ((0, 3), (2, 0)):
            one = {k: (v[row:row + 1] if k not in ("A", "D") else v) for k, v in inp.items()}
            y_ref, S_ref = mirror_step(values[slot:slot + 1], **one, exp=numpy_exp)
            expected = formats.quantize(S_ref, fmt)
            assert torch.equal(state[slot:slot + 1], expected.data), f"step {step} slot {slot}"
            assert torch.equal(bits_of(scale[slot:slot + 1]), bits_of(expected.scale)), f"step {step} slot {slot}"
            assert rel_rms(out[row:row + 1], y_ref) < dstate * 2**-24 * 4
            values[slot:slot + 1] = formats.dequantize(expected)
        for untouched in (1, 2, 4):
            assert torch.equal(state[untouched], q.data[untouched])
            assert torch.equal(bits_of(scale[untouched]), bits_of(q.scale[untouched]))


@pytest.mark.parametrize("name", ["default", "even-hpp2-prefetch"])
def test_out_of_range_row_outputs_nan_and_writes_nothing(name):
    """An index ≥ nslots reaches the kernel only on a GPU (no host check there): launch directly."""
    variant = VARIANTS.get(name, conventional.Variant())
    fmt = formats.StateFormat.parse("int8:row")
    q = stored_state(fmt, (2, 4, 16, 32))
    state, scale = q.data.clone(), q.scale.clone()
    inp = random_inputs(2, 4, 16, 32, 2)
    out = torch.full_like(inp["x"], 7.0)
    conventional.launch(
        state, scale, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], None,
        torch.tensor([1, 2], dtype=torch.int32), out, 0, None, dtype_code=codec.INT8, granularity=codec.GRAN_ROW,
        stochastic=False, qmax=127.0, emax=6, dt_softplus=False, pad_slot_id=-1, heads_per_group=2, block_p=8,
        variant=variant)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert torch.equal(state[0], q.data[0]) and torch.equal(bits_of(scale[0]), bits_of(q.scale[0]))
    assert not torch.equal(state[1], q.data[1])


@pytest.mark.parametrize("name", ["default", "sr4-rounds7", "even-hpp8-prefetch-sr4"])
def test_variant_stochastic_rounding_is_unbiased(use_variant, name):
    """Mean over 64 seeds of (stored − unrounded)/step per element: each term lies in (−1, 1)
    with sd ≤ 1/2, so the mean over 64 × 128 draws has sd ≤ 0.0055; we allow 0.03."""
    variant = VARIANTS.get(name, conventional.Variant())
    use_variant(variant)
    fmt = formats.StateFormat.parse("int8:row")
    q = stored_state(fmt, (1, 1, 4, 32))
    inp = random_inputs(1, 1, 4, 32, 1)
    _, S_ref = mirror_step(formats.dequantize(q), **inp, exp=numpy_exp)
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
        q = stored_state(fmt, (2, 8, 16, 32))
        inp = random_inputs(2, 8, 16, 32, 2, dtype=torch.bfloat16)
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
        inp = random_inputs(2, 4, 8, 32, 2)
        out = qstate.selective_state_update(torch.zeros(2, 4, 8, 32), **inp)
    assert out.shape == (2, 4, 8)
    meta = {k: v.to("meta") for k, v in random_inputs(2, 4, 8, 32, 2).items()}
    out = qstate.selective_state_update(torch.zeros(2, 4, 8, 32, device="meta"), **meta)
    assert out.shape == (2, 4, 8) and out.device.type == "meta"


def _eager_call_inputs(seed, nheads=6, headdim=8, dstate=32, ngroups=2):
    """A batch-2 call in the tied (mamba_ssm) form with every optional argument, bf16 x/z/out
    and an int8:row state: each view the launcher makes (storage view, compact dt and A, the
    bf16 output as int16) must stand for the caller's tensor."""
    fmt = formats.StateFormat.parse("int8:row")
    inp = random_inputs(2, nheads, headdim, dstate, ngroups, seed=seed, dtype=torch.bfloat16)
    stored = stored_state(fmt, (3, nheads, headdim, dstate), seed=seed)
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
    assert_launched_as_computed(launched, expected, constexprs,
                                inspect.signature(conventional._conventional_kernel.fn).parameters)


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
