"""The conventional gated delta kernel's FUSED arithmetic (what it runs on a GPU for 8-bit row and
head scales) under the interpreter, against the same kernel in the references' order.

On a GPU the old scale joins the decay (GDN: one factor per row, ``code · (α · scale)``), the
dot ``S k̂`` is taken over the codes and scaled once, the new scale is ``amax · RN(1/QMAX)``
with an approximate reciprocal, and codes come from ``S · recip`` rounded once instead of a
correctly rounded quotient (kernels/gated_delta/README.md#fused-path). Bounds from counting
roundings (``u = 2**-24``), against the references' order run by the same kernel:

* state before quantization: ``code·scale``, ``·α``, ``S k̂`` and the update round against
  ``α·scale``, ``code·factor``, the scaled dot and the update: ``|ΔS| ≤ 8u·(|α S_old| + |d k̂|)``
  element-wise plus ``K·u`` of the row's dot, relative;
* scale: ``amax/QMAX`` moves by that over QMAX, plus ``2u`` relative for ``RN(1/QMAX)`` and the
  product's rounding;
* codes: at most 0.1 % differ (the GPU check's bound), each by one grid step;
* outputs: ``(K + 8)·u`` of the sum of magnitudes, times 4 in RMS for random data.
"""

import pytest
import torch

from qstate import formats
from qstate.kernels.common import codec
from qstate.kernels.gated_delta import conventional

from helpers.codes import assert_padding_and_untouched_slots, assert_poison_stays_in_its_slot, grid_steps_apart
from helpers.gated_delta import rel_rms, stored_state, token

U = 2.0**-24
FUSED_FORMATS = ["int8:row", "fp8_e4m3:row", "fp8_e5m2:row", "int8:head", "fp8_e4m3:head", "fp8_e5m2:head"]


def _launch(state, scale, fmt, inp, *, fused, slot_indices=None, pad_slot_id=-1):
    out = torch.full_like(inp["v"], float("nan"))
    K = inp["k"].shape[-1]
    conventional.launch(codec.storage_view(state, fmt), scale, inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                        slot_indices, out, 0, None, qk_scale=K**-0.5, dtype_code=codec.dtype_code(fmt),
                        granularity=codec.granularity_code(fmt), stochastic=False, qmax=codec.qmax(fmt),
                        emax=codec.emax(fmt), use_qk_l2norm=True, pad_slot_id=pad_slot_id, fused=fused)
    return out


def _magnitudes(values, inp):
    """``|α S_old| + |d k̂|``-sized per element: ``|α S_old| + |α S_old| |k̂| |k̂|ᵀ + |v| |k̂|``
    (β ≤ 1), what the state's roundings are relative to; ``values (batch, HV, V, K)``."""
    group = values.shape[1] // inp["k"].shape[1]
    k = torch.nn.functional.normalize(inp["k"].double(), dim=-1).repeat_interleave(group, 1)  # [batch, HV, K]
    g = inp["g"].double()
    alpha = torch.exp(g)[..., None, :] if g.dim() == 3 else torch.exp(g)[..., None, None]
    decayed = (alpha * values.double()).abs()
    dot = (decayed * k.abs()[:, :, None, :]).sum(-1, keepdim=True)  # [batch, HV, V, 1]
    return decayed + (dot + inp["v"].double().abs()[..., None]) * k.abs()[:, :, None, :]


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("text", FUSED_FORMATS)
def test_fused_steps_within_a_grid_step_of_the_references_order(text, channel):
    fmt = formats.StateFormat.parse(text)
    HK, HV, K, V = 1, 2, 96, 24
    q = stored_state(fmt, (2, HV, V, K))
    state = {fused: (q.data.clone(), q.scale.clone()) for fused in (False, True)}
    for step in range(2):
        inp = token(2, HK, HV, K, V, channel=channel, seed=step)
        values = formats.dequantize(formats.QuantizedState(*state[True], fmt))
        # Both orders from the fused run's stored state, so each step compares one step.
        state[False] = (state[True][0].clone(), state[True][1].clone())
        ref_out = _launch(*state[False], fmt, inp, fused=False)
        out = _launch(*state[True], fmt, inp, fused=True)
        steps = grid_steps_apart(state[True][0], state[False][0], fmt)
        assert steps.max() <= 1, f"step {step}"
        assert (steps > 0).double().mean() <= 1e-3, f"step {step}"
        magnitudes = _magnitudes(values, inp)
        reduce_dims = (-1,) if fmt.granularity == "row" else (-2, -1)
        scale_bound = (8 + K) * U * magnitudes.amax(dim=reduce_dims) / fmt.qmax + 2 * U * state[False][1].double()
        assert ((state[True][1].double() - state[False][1].double()).abs() <= scale_bound).all(), f"step {step}"
        assert rel_rms(out, ref_out) < (K + 8) * U * 4, f"step {step}"


@pytest.mark.parametrize("text", ["int8:row", "fp8_e5m2:row", "int8:head"])
def test_fused_saturation_where_a_scale_is_clamped(text):
    """A stored scale beyond what quantize produces makes one row (head) hold about 2.3e38, so
    after a decay close to 1 its new scale is clamped to ``2**(126 − EMAX)`` and its largest codes
    saturate; its tile takes the saturating path, codes within a grid step of the references'."""
    fmt = formats.StateFormat.parse(text)
    q = stored_state(fmt, (2, 2, 8, 32))
    codes = formats.dequantize(formats.QuantizedState(q.data, torch.ones_like(q.scale), fmt))
    where = (0, 1, 3) if fmt.granularity == "row" else (0, 1)
    q.scale[where] = 2.3e38 / codes[where].abs().max()
    inp = token(2, 1, 2, 32, 8, seed=3, g_scale=1e-3)
    runs = {}
    for fused in (False, True):
        state, scale = q.data.clone(), q.scale.clone()
        out = _launch(state, scale, fmt, inp, fused=fused)
        runs[fused] = (state, scale, out)
    assert (grid_steps_apart(runs[True][0], runs[False][0], fmt) <= 1).all()
    largest = formats.dequantize(formats.QuantizedState(runs[True][0], torch.ones_like(q.scale), fmt))[where]
    assert largest.abs().max().item() == fmt.qmax
    assert runs[True][1][where].item() == 2.0 ** (126 - fmt.emax)
    assert not runs[True][2][1].isnan().any()


def test_fused_inf_and_nan_stay_in_their_slot():
    """Slots 0 and 2 (outputs, codes, scales) equal a clean run bit for bit; slot 1 outputs NaN."""
    fmt = formats.StateFormat.parse("int8:row")
    inp = token(3, 1, 2, 32, 8, seed=4)
    out = assert_poison_stays_in_its_slot(stored_state(fmt, (3, 2, 8, 32)),
                                          lambda state, scale: _launch(state, scale, fmt, inp, fused=True))
    assert out[1].isnan().any()


def test_fused_padding_and_untouched_slots():
    """Rows 1 (negative index) and 3 (pad_slot_id) output zero; slots 1, 2, 4, 5 stay bit for bit."""
    fmt = formats.StateFormat.parse("fp8_e4m3:row")
    q = stored_state(fmt, (6, 4, 16, 32))
    state, scale = q.data.clone(), q.scale.clone()
    out = _launch(state, scale, fmt, token(4, 2, 4, 32, 16, seed=5), fused=True,
                  slot_indices=torch.tensor([3, -1, 0, 5], dtype=torch.int32), pad_slot_id=5)
    assert_padding_and_untouched_slots(out, state, scale, q)
