"""qstate.profiles.calibrate on delta-rule models: the observed steps, their statistics, the profile."""

import dataclasses
import math
import sys

import pytest
import torch

from helpers import hf_tiny_delta
from qstate import profiles
from qstate.calibration_delta import CalibratedDeltaProfile, EmpiricalGates
from qstate.integrations import delta_observe
from qstate.integrations.transformers import decode_logits
from qstate.reference import gated_delta

NEW_TOKENS = 3


@pytest.fixture(scope="module", params=sorted(hf_tiny_delta.MODELS))
def model(request):
    return request.param, hf_tiny_delta.MODELS[request.param](seed=3)


def test_observed_steps_match_the_reference(model):
    kind, m = model
    steps = []

    def record(layer, step):  # the step's tensors are transformers' own: the cache reuses them
        steps.append((layer, delta_observe.DeltaStep(*(t.clone() for t in dataclasses.astuple(step)))))

    with delta_observe.observe(m, record) as layers:
        decode_logits(m, hf_tiny_delta.prompt(batch=2, length=5), NEW_TOKENS)
    assert [name for name, _ in steps] == [layers[0][0]] * NEW_TOKENS
    for _, s in steps:
        o, new_state = gated_delta.step(s.state, s.q, s.k, s.v, s.g, s.beta)
        # transformers' fp32 step against the fp64 reference: a few fp32 roundings per element
        scale = s.state.double().norm() + s.v.double().norm()
        assert (new_state - s.new_state.double()).norm() <= 1e-5 * scale
    assert (steps[0][1].g.dim() == 3) == (kind == "kimi_linear")
    # leaving the context puts transformers' functions and the layers' forwards back
    for _, layer in layers:
        assert "forward" not in layer.__dict__
        function = delta_observe.SUPPORTED_LAYERS[type(layer).__name__]
        assert not hasattr(getattr(sys.modules[type(layer).__module__], function), "__wrapped__")


def test_calibrate_returns_the_model_shape_and_measured_heads(model):
    kind, m = model
    # one sequence: an odd number of samples per head, so the medians are samples (monotone maps keep them)
    p = profiles.calibrate(m, hf_tiny_delta.prompt(batch=1, length=5, seed=1), NEW_TOKENS, name=kind)
    assert isinstance(p, CalibratedDeltaProfile) and p.family == "gated_delta" and p.name == kind
    channel = kind == "kimi_linear"
    assert (p.num_k_heads, p.num_v_heads, p.head_k_dim, p.head_v_dim, p.n_layers) == ((4 if channel else 2), 4, 8, 8, 1)
    assert (p.gate, p.gate_form, p.tokens) == ("channel" if channel else "scalar", "softplus", NEW_TOKENS)
    (stats,), layer = p.layers, delta_observe.find_delta_layers(m)[0][1]
    A_log = layer.forget_gate.A_log if channel else layer.A_log
    assert list(stats.A) == pytest.approx(A_log.detach().double().exp().flatten().tolist(), rel=1e-12)
    for h in range(4):
        assert stats.gate_min[h] <= stats.gate_median[h] <= stats.gate_max[h] <= 0
        assert stats.decay_median[h] == pytest.approx(math.exp(stats.gate_median[h]))
        assert 0 < stats.beta_min[h] <= stats.beta_median[h] <= stats.beta_max[h] < 1
        assert 0 < stats.state_rms[h] <= stats.state_amax[h] < math.inf
        assert len(stats.channel_bias[h]) == (8 if channel else 1)
    # the gate at the measured median pre-activation is the median gate (one channel)
    if not channel:
        g0 = -torch.tensor(stats.A) * torch.nn.functional.softplus(torch.tensor(stats.channel_bias)[:, 0])
        assert g0.tolist() == pytest.approx(list(stats.gate_median), rel=1e-4)
    gates = p.gates
    assert isinstance(gates, EmpiricalGates) and len(gates.A) == 4
    inp = p.sample_inputs(NEW_TOKENS, 1, heads=2, seed=0)
    measured = torch.tensor(gates.A, dtype=torch.float64)
    bias = torch.tensor(gates.channel_bias, dtype=torch.float64)
    for a, b in zip(inp.A.double(), inp.dt_bias.double()):  # each sampled head is a measured one (fp32)
        j = torch.argmin((measured - a).abs())
        assert abs(measured[j] - a) <= 1e-6 * a and torch.allclose(bias[j], b, rtol=1e-6, atol=1e-6)
    o, _ = gated_delta.decode_exact(**inp.kwargs())
    assert torch.isfinite(o).all()


def test_calibrate_refuses_models_without_recurrent_layers():
    with pytest.raises(TypeError, match="^model: expected a torch.nn.Module"):
        profiles.calibrate("qwen", hf_tiny_delta.prompt())
    with pytest.raises(ValueError, match="^model: expected a transformers"):
        profiles.calibrate(torch.nn.Linear(2, 2), hf_tiny_delta.prompt())


def test_observer_sees_the_steps_of_a_layer_holding_fla_step_function():
    """Releases that bind the step to the layer at construction (fla's function with fla
    installed) decode through that attribute, never the module-level name: the observer wraps
    the attribute too, sees every step, and puts the very same function back on exit.
    Simulated (``hf_tiny_delta.FlaBindingRelease``; see there why)."""
    m = hf_tiny_delta.qwen3_5(seed=3)
    release = hf_tiny_delta.FlaBindingRelease(m)
    steps = []
    with delta_observe.observe(m, lambda layer, step: steps.append(layer)) as layers:
        decode_logits(m, hf_tiny_delta.prompt(batch=2, length=5), NEW_TOKENS)
    assert steps == [layers[0][0]] * NEW_TOKENS
    assert release.calls == len(release.layers) * NEW_TOKENS  # fla's function computed every step
    assert all(vars(layer)[release.ATTRIBUTE] is release.fla_function for layer in release.layers)
    calibrated = profiles.calibrate(m, hf_tiny_delta.prompt(batch=1, length=5, seed=1), NEW_TOKENS)
    assert calibrated.tokens == NEW_TOKENS
