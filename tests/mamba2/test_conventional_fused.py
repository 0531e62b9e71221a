"""The conventional kernel's FUSED arithmetic (what it runs on a GPU) under the interpreter.

On a GPU, row and head scales take ``amax · RN(1/QMAX)`` and an approximate reciprocal, the old
scale joins the decay in one factor, and codes come from ``S · recip`` rounded once (int8:
inside one FMA) instead of a correctly rounded quotient (kernels/README.md). So the state
differs from the references' in last bits, and a code can move to its neighbour where the
quotient lies within an ulp of a rounding boundary. The bounds below follow from counting
roundings (``u = 2**-24``):

* state before quantization: the references round ``code·scale``, ``a·(…)`` and the sum, the
  fused path ``a·scale`` and one FMA, so ``|ΔS| ≤ 5u·(|a·S_old| + |dt·x·B|)`` per element;
* scale: ``amax/QMAX`` moves by that over QMAX, plus ``2u`` relative for ``RN(1/QMAX)`` and
  the product's rounding (against one rounding of the quotient);
* codes: at most 0.1 % differ (the GPU check's bound), each by one grid step;
* outputs: the sum over dstate of the exact tests plus the state's ``5u``.
"""

import pytest
import torch

from qstate import formats
from qstate.kernels.common import codec
from qstate.kernels.mamba2 import conventional

from helpers.codes import assert_padding_and_untouched_slots, assert_poison_stays_in_its_slot, grid_steps_apart
from helpers.conventional import kernel_noise, mirror_step, numpy_exp, random_inputs, rel_rms, stored_state

U = 2.0**-24
FUSED_FORMATS = ["int8:row", "fp8_e4m3:row", "fp8_e5m2:row", "int8:head", "fp8_e4m3:head", "fp8_e5m2:head",
                 "int8:row+sr", "fp8_e4m3:row+sr"]


def _launch(state, scale, fmt, inp, slot_indices=None, seed=0, pad_slot_id=-1):
    out = torch.full_like(inp["x"], float("nan"))
    nheads, ngroups = inp["x"].shape[1], inp["B"].shape[1]
    conventional.launch(
        codec.storage_view(state, fmt), scale, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
        inp["z"], None, slot_indices, out, seed, None, dtype_code=codec.dtype_code(fmt),
        granularity=codec.granularity_code(fmt), stochastic=fmt.stochastic, qmax=codec.qmax(fmt),
        emax=codec.emax(fmt), dt_softplus=False, pad_slot_id=pad_slot_id, heads_per_group=nheads // ngroups,
        fused=True)
    return out


def _magnitudes(values, inp):
    """``|a·S_old| + |dt·x·B|`` per element: what the state's roundings are relative to."""
    nheads = inp["x"].shape[1]
    Bh = inp["B"].float().repeat_interleave(nheads // inp["B"].shape[1], dim=1)
    a = torch.exp(inp["dt"] * inp["A"])
    return (a[..., None, None] * values).abs() + ((inp["dt"][..., None] * inp["x"].float())[..., None]
                                                  * Bh[..., None, :]).abs()


def _check_step(state, scale, out, expected, y_ref, magnitudes, fmt):
    steps = grid_steps_apart(state, expected.data, fmt)
    assert steps.max() <= 1
    assert (steps > 0).double().mean() <= 1e-3
    # The scale's argument is a max over the row (head): bound it by the row's largest magnitude.
    reduce_dims = (-1,) if fmt.granularity == "row" else (-2, -1)
    bound = 5 * U * magnitudes.amax(dim=reduce_dims) / fmt.qmax + 2 * U * expected.scale
    assert ((scale - expected.scale).abs() <= bound).all()
    assert rel_rms(out, y_ref) < (magnitudes.shape[-1] + 5) * U * 4


@pytest.mark.parametrize("text", FUSED_FORMATS)
def test_fused_steps_within_a_grid_step_of_the_references(text):
    fmt = formats.StateFormat.parse(text)
    shape = (2, 6, 80, 96)
    q = stored_state(fmt, shape)
    state, scale = q.data.clone(), q.scale.clone()
    values = formats.dequantize(q)
    for step in range(2):
        inp = random_inputs(2, 6, 80, 96, 2, seed=step)
        out = _launch(state, scale, fmt, inp, seed=11 + step)
        y_ref, S_ref = mirror_step(values, **inp, exp=numpy_exp)
        noise = kernel_noise(fmt, shape, 11 + step) if fmt.stochastic else None
        expected = formats.quantize(S_ref, fmt, noise=noise)
        _check_step(state, scale, out, expected, y_ref, _magnitudes(values, inp), fmt)
        # The next step starts from what the kernel stored (its codes may differ by a step).
        values = formats.dequantize(formats.QuantizedState(state.clone(), scale.clone(), fmt))


@pytest.mark.parametrize("text", ["int8:row", "fp8_e5m2:row", "int8:head"])
def test_fused_saturation_where_a_scale_is_clamped(text):
    """A stored scale beyond what quantize produces makes one row (head) hold about 2.3e38, so
    after a decay close to 1 its new scale is clamped to ``2**(126 − EMAX)`` and its largest codes
    saturate; its tile takes the saturating path."""
    fmt = formats.StateFormat.parse(text)
    q = stored_state(fmt, (2, 2, 8, 32))
    codes = formats.dequantize(formats.QuantizedState(q.data, torch.ones_like(q.scale), fmt))
    where = (0, 1, 3) if fmt.granularity == "row" else (0, 1)
    q.scale[where] = 2.3e38 / codes[where].abs().max()
    state, scale = q.data.clone(), q.scale.clone()
    inp = random_inputs(2, 2, 8, 32, 1)
    out = _launch(state, scale, fmt, inp)
    y_ref, S_ref = mirror_step(formats.dequantize(q), **inp, exp=numpy_exp)
    expected = formats.quantize(S_ref, fmt)
    assert torch.isfinite(S_ref).all() and S_ref[where].abs().max() > fmt.qmax * 2.0 ** (126 - fmt.emax)
    assert (grid_steps_apart(state, expected.data, fmt) <= 1).all()
    assert expected.data[where].float().abs().max().item() == fmt.qmax
    assert not out[1].isnan().any()


def test_fused_inf_and_nan_stay_in_their_slot():
    """Slots 0 and 2 (outputs, codes, scales) equal a clean run bit for bit."""
    fmt = formats.StateFormat.parse("int8:row")
    inp = random_inputs(3, 2, 8, 32, 1)
    assert_poison_stays_in_its_slot(stored_state(fmt, (3, 2, 8, 32)),
                                    lambda state, scale: _launch(state, scale, fmt, inp))


def test_fused_padding_and_untouched_slots():
    """Rows 1 (negative index) and 3 (pad_slot_id) output zero; slots 1, 2, 4, 5 stay bit for bit."""
    fmt = formats.StateFormat.parse("int8:row")
    q = stored_state(fmt, (6, 4, 16, 32))
    state, scale = q.data.clone(), q.scale.clone()
    out = _launch(state, scale, fmt, random_inputs(4, 4, 16, 32, 2),
                  slot_indices=torch.tensor([3, -1, 0, 5], dtype=torch.int32), pad_slot_id=5)
    assert_padding_and_untouched_slots(out, state, scale, q)
