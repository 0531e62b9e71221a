"""The conventional gated delta rule kernel (qstate.gated_delta_update) under the interpreter,
against qstate.reference.gated_delta and qstate.formats.

Codes and scales are compared bit for bit with ``formats.quantize`` of the new fp32 state the
kernel computes, which the same kernel stores as it is with an fp32 state: ``d = β(v − S k̂)`` is
a sum over K whose order differs between the kernel and torch, so the references' fp32 state
can differ from the kernel's in last bits and move a code at a rounding boundary. Outputs and
fp32 states are compared with the references by relative RMS: each output or corrected value is
a sum of K fp32 products, whose rounding is below ``K · 2**-24`` relative to the sum of
magnitudes; the bound ``K · 2**-24 · 8`` per step covers that ratio for random data (below 4
here) and the fp32 evaluation of the norms and the gate.
"""

import pytest
import torch

import qstate
from qstate import formats
from qstate.reference import gated_delta as reference

from helpers.conventional import kernel_noise
from helpers.gated_delta import bits_of, rel_rms, stored_state, token, tokens
from helpers.launches import assert_launched_as_computed

SCALED_FORMATS = [f"{d}:{g}" for d in ("int8", "fp8_e4m3", "fp8_e5m2") for g in ("row", "head", "block32")]
ALL_FORMATS = ["fp32", "bf16", "fp16", "bf16+sr", "fp16+sr", *SCALED_FORMATS, "int8:row+sr", "fp8_e4m3:block32+sr"]


def bound(K, steps=1):
    return steps * K * 2.0**-24 * 8


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("HK,HV,K,V", [(1, 1, 16, 24), (1, 2, 24, 16), (2, 4, 32, 32), (1, 2, 96, 8)])
def test_fp32_steps_against_exact(channel, HK, HV, K, V):
    batch, T = 2, 2
    inp = tokens(T, batch, HK, HV, K, V, channel=channel)
    state0 = torch.randn(batch, HV, V, K, generator=torch.Generator().manual_seed(7))
    state = state0.clone()
    outs = []
    for t in range(T):
        out = torch.full((batch, HV, V), float("nan"))
        qstate.gated_delta_update(state, *(inp[n][t] for n in ("q", "k", "v", "g", "beta")), out=out)
        outs.append(out)
    o_ref, S_ref = reference.decode_exact(state0, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    assert rel_rms(torch.stack(outs), o_ref) < bound(K, T)
    assert rel_rms(state, S_ref) < bound(K, T)


@pytest.mark.parametrize("text", ALL_FORMATS)
def test_codes_and_scales_bit_exact(text):
    """Two steps (one with +sr; KDA, HV/HK 2): codes and scales equal ``quantize`` of the kernel's fp32 state
    (with the kernel's noise for +sr), outputs equal the fp32 run's bit for bit and one fp64
    step's within fp32 rounding."""
    fmt = formats.StateFormat.parse(text)
    shape = (3, 2, 24, 32)
    q = stored_state(fmt, shape)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    indices = torch.tensor([2, 0], dtype=torch.int32)
    for step in range(1 if fmt.stochastic else 2):
        inp = token(2, 1, 2, 32, 24, channel=True, seed=step)
        values = formats.dequantize(formats.QuantizedState(state.clone(), None if scale is None else scale.clone(),
                                                           fmt))
        fp32 = values.clone()
        out32 = torch.full((2, 2, 24), float("nan"))
        qstate.gated_delta_update(fp32, **inp, state_indices=indices, out=out32)
        out = torch.full((2, 2, 24), float("nan"))
        qstate.gated_delta_update(state, **inp, state_indices=indices, state_scale=scale, state_format=text, out=out,
                                  seed=11 + step)
        noise = kernel_noise(fmt, shape, 11 + step) if fmt.stochastic else None
        expected = formats.quantize(fp32, fmt, noise=noise)
        for slot in (0, 2):
            assert torch.equal(bits_of(state[slot]), bits_of(expected.data[slot])), f"step {step} slot {slot}"
            if fmt.scaled:
                assert torch.equal(bits_of(scale[slot]), bits_of(expected.scale[slot])), f"step {step} slot {slot}"
        assert torch.equal(bits_of(state[1]), bits_of(q.data[1]))
        assert torch.equal(out, out32)
        o_ref, _ = reference.step(values[indices.long()], **inp)
        assert rel_rms(out, o_ref) < bound(32)


def test_slot_indices_padding_and_untouched_slots():
    """Rows 1 (negative index) and 3 (pad_slot_id) output zero; the other slots stay bit for bit."""
    fmt = formats.StateFormat.parse("int8:row")
    q = stored_state(fmt, (6, 2, 16, 32))
    state, scale = q.data.clone(), q.scale.clone()
    inp = token(4, 2, 2, 32, 16)
    out = torch.full((4, 2, 16), float("nan"))
    qstate.gated_delta_update(state, **inp, state_indices=torch.tensor([3, -1, 0, 5]), state_scale=scale,
                              state_format="int8:row", out=out, pad_slot_id=5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    assert not out[[0, 2]].isnan().any()
    for untouched in (1, 2, 4, 5):
        assert torch.equal(state[untouched], q.data[untouched]) and torch.equal(scale[untouched], q.scale[untouched])
    for slot in (0, 3):
        assert not torch.equal(state[slot], q.data[slot])


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("text", ["fp32", "bf16+sr", "int8:row", "fp8_e4m3:block32", "int8:head"])
def test_several_tiles_a_program_as_on_a_gpu(monkeypatch, channel, text):
    """``V_LOOP`` tiles a program (here V = 24 in tiles of 8 rows, 2 a program: the second
    program's second tile past V): states, scales and outputs bit for bit those of one tile
    over the whole head, with a padding row and slot indices. Head scales keep one tile."""
    from qstate.kernels import clear_launch_plans
    from qstate.kernels.gated_delta import conventional
    fmt = formats.StateFormat.parse(text)
    q = stored_state(fmt, (4, 2, 24, 32))
    inp = token(3, 1, 2, 32, 24, channel=channel, seed=3)
    runs = []
    for split in (None, (8, 2)):
        monkeypatch.setattr(conventional, "INTERPRETER_SPLIT", split)
        clear_launch_plans()
        state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
        out = torch.full((3, 2, 24), float("nan"))
        qstate.gated_delta_update(state, **inp, state_indices=torch.tensor([2, -1, 0]), state_scale=scale,
                                  state_format=text, out=out, seed=4)
        runs.append([bits_of(t) for t in (state, out, scale) if t is not None])
    for whole, split in zip(*runs):
        assert torch.equal(whole, split)
    assert torch.equal(runs[1][1][1], bits_of(torch.zeros(2, 24)))


@pytest.mark.parametrize("channel, text, batch, tiles", [
    (False, "int8:row", 256, 8), (False, "fp8_e4m3:row", 256, 2), (False, "bf16", 256, 4), (False, "fp32", 256, 1),
    (True, "int8:row", 256, 8), (True, "fp8_e4m3:row", 256, 1), (False, "int8:row+sr", 256, 1),
    (False, "fp8_e4m3:block32", 256, 1), (False, "int8:row", 4, 2), (False, "int8:row", 1, 1)])
def test_gpu_plan_takes_tiles_a_program_by_format(channel, text, batch, tiles):
    """The GPU launch plan (V = K = 128, 64 value heads): ``V_LOOP_BY_FORMAT``'s tiles a program,
    one for ``+sr`` and block32, fewer when the grid would drop below ``MIN_PROGRAMS``."""
    from qstate.kernels import clear_launch_plans
    from qstate.kernels.common import codec
    from qstate.kernels.gated_delta import conventional
    fmt = formats.StateFormat.parse(text)
    clear_launch_plans()
    grid, constexprs = conventional._plan(fmt.storage_dtype.itemsize, 128, 128, 64, batch, torch.device("cuda"),
                                          codec.dtype_code(fmt), codec.granularity_code(fmt), fmt.stochastic,
                                          codec.qmax(fmt), codec.emax(fmt), channel, True, True, False, False, True,
                                          None)
    assert constexprs["V_LOOP"] == tiles
    assert grid == (128 // (constexprs["BLOCK_V"] * tiles), 64, batch)
    assert grid[0] * grid[1] * grid[2] >= conventional.MIN_PROGRAMS or constexprs["BLOCK_V"] == 4
    clear_launch_plans()


def test_bf16_inputs_and_output_without_l2norm_and_given_scale():
    inp = token(2, 2, 4, 32, 16, dtype=torch.bfloat16)
    state0 = torch.randn(2, 4, 16, 32)
    state = state0.clone()
    out = qstate.gated_delta_update(state, **inp, scale=0.3, use_qk_l2norm=False)
    assert out.dtype == torch.bfloat16
    o_ref, S_ref = reference.step(state0, **inp, scale=0.3, use_qk_l2norm=False)
    # bf16 output: one rounding of 2**-9 relative on top of the fp32 step.
    assert rel_rms(out, o_ref) < 2.0**-8
    assert rel_rms(state, S_ref) < bound(32)


def test_nan_in_one_row_stays_in_its_slot():
    state0 = torch.randn(3, 2, 16, 32)
    state = state0.clone()
    inp = token(3, 1, 2, 32, 16)
    inp["v"][1, 0, 3] = float("nan")
    out = qstate.gated_delta_update(state, **inp)
    assert out[1, 0].isnan().any() and not out[[0, 2]].isnan().any()
    assert not state[[0, 2]].isnan().any()


def _good():
    return dict(state=torch.zeros(2, 4, 16, 32), **token(2, 2, 4, 32, 16))


def _bad(**overrides):
    args = _good()
    args.update(overrides)
    return args


BAD = [
    (dict(k=torch.zeros(2, 3, 32), q=torch.zeros(2, 3, 32)), ValueError, "k"),
    (dict(k=torch.zeros(2, 2, 24), q=torch.zeros(2, 2, 24)), ValueError, "k"),
    (dict(v=torch.zeros(2, 4, 8)), ValueError, "v"),
    (dict(g=torch.zeros(2, 4, 16)), ValueError, "g"),
    (dict(g=torch.zeros(2, 4, 32, 1)), ValueError, "g"),
    (dict(g=torch.full((2, 4), 0.5)), ValueError, "g"),
    (dict(beta=torch.full((2, 4), 1.5)), ValueError, "beta"),
    (dict(beta=torch.zeros(2, 4, dtype=torch.int32)), TypeError, "beta"),
    (dict(q=torch.zeros(2, 2, 32, dtype=torch.float64)), TypeError, "q"),
    (dict(v=torch.zeros(2, 4, 32)[..., ::2]), ValueError, "v"),
    (dict(state=torch.zeros(3, 4, 16, 32)), ValueError, "state"),
    (dict(state=torch.zeros(2, 4, 16, 32, dtype=torch.int8)), ValueError, "state_format"),
    (dict(state_indices=torch.tensor([0, 2])), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([1, 1])), ValueError, "state_indices"),
    (dict(state_indices=torch.tensor([0.0, 1.0])), TypeError, "state_indices"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(use_qk_l2norm="yes"), TypeError, "use_qk_l2norm"),
    (dict(out=torch.zeros(2, 4, 8)), ValueError, "out"),
]


@pytest.mark.parametrize("overrides,exc,name", BAD)
def test_bad_input_names_the_argument_and_changes_nothing(overrides, exc, name):
    args = _bad(**overrides)
    before = args["state"].clone()
    with pytest.raises(exc, match=f"^{name}:"):
        qstate.gated_delta_update(**args)
    assert torch.equal(args["state"], before)


# ---------------------------------------------------------------------------- prepared eager launches


def _eager_call(seed, state):
    """One step over an fp8_e4m3:row state with bf16 inputs and output, slot indices with a
    padding row and a seed given."""
    args = token(3, 1, 2, 32, 16, seed=seed, dtype=torch.bfloat16)
    return dict(args, state_indices=torch.tensor([2, -1, 0]), state_scale=state.scale, state_format=state.fmt,
                out=torch.empty(3, 2, 16, dtype=torch.bfloat16), seed=seed)


def _launched_as(entry):
    """"bind", "compiled" (the launcher's uint8 view of the fp8 state) or "prepared" (the op's
    fp8 tensor itself)."""
    kind, _, args = entry[:3]
    return "prepared" if kind == "compiled" and args[0].dtype == torch.float8_e4m3fn else kind


def test_an_eager_repeat_launches_what_the_full_path_would(stand_in_kernels):
    """Second call of a signature, other inputs, state and seed: the compiled launcher, no bind,
    with exactly the arguments the launcher computes for that call (tensors by address)."""
    from qstate.kernels.common import codec
    from qstate.kernels.gated_delta import conventional

    log = stand_in_kernels(conventional)
    fmt = formats.StateFormat.parse("fp8_e4m3:row")
    states = [stored_state(fmt, (4, 2, 16, 32), seed) for seed in range(2)]
    qstate.gated_delta_update(states[0].data, **_eager_call(0, states[0]))
    second = _eager_call(1, states[1])
    qstate.gated_delta_update(states[1].data, **second)
    assert [(_launched_as(entry), entry[1]) for entry in log] == [("bind", "_conventional_kernel"),
                                                                  ("prepared", "_conventional_kernel")]
    s = second
    grid, args, constexprs = conventional._arguments(
        states[1].data.view(torch.uint8), states[1].scale, s["q"], s["k"], s["v"], s["g"], s["beta"],
        s["state_indices"], s["out"], 1, None, qk_scale=32 ** -0.5, dtype_code=codec.dtype_code(fmt),
        granularity=codec.granularity_code(fmt), stochastic=False, qmax=codec.qmax(fmt), emax=codec.emax(fmt),
        use_qk_l2norm=True, pad_slot_id=-1)
    assert log[0][3] == constexprs
    assert_launched_as_computed(log[1][2], args, constexprs, conventional._launch.kernel.signature.parameters)
