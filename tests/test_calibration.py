"""qstate.profiles.calibrate: per-head statistics of a real decode, and a profile drawn from them."""

import math

import pytest
import torch

from helpers import hf_tiny
from qstate import profiles
from qstate.calibration import CalibratedProfile, EmpiricalDecay
from qstate.integrations import transformers as qt


@pytest.fixture(scope="module")
def model():
    return hf_tiny.nemotron_h(seed=8)


@pytest.fixture(scope="module")
def calibrated(model):
    return profiles.calibrate(model, hf_tiny.prompt(batch=2, length=6, seed=9), 12, name="tiny-nemotron-h")


def test_profile_has_the_model_shape(calibrated):
    assert isinstance(calibrated, CalibratedProfile)
    assert (calibrated.nheads, calibrated.headdim, calibrated.dstate, calibrated.ngroups) == (4, 16, 16, 2)
    assert calibrated.n_ssm_layers == 2 and len(calibrated.layers) == 2
    assert calibrated.name == "tiny-nemotron-h" and calibrated.tokens == 24


def test_layer_statistics_match_the_weights(model, calibrated):
    for (name, mixer), stats in zip(qt.find_mixers(model), calibrated.layers):
        assert stats.name == name
        A = (-torch.exp(mixer.A_log.float())).tolist()
        assert list(stats.A) == pytest.approx(A, rel=1e-6)
        for h in range(4):
            assert 0 < stats.dt_min[h] <= stats.dt_median[h] <= stats.dt_max[h]
            assert 0 < stats.decay_min[h] <= stats.decay_median[h] <= stats.decay_max[h] < 1
            # decay = exp(dt·A) is decreasing in dt, so the extremes pair up
            assert stats.decay_min[h] == pytest.approx(math.exp(stats.dt_max[h] * A[h]), rel=1e-5)
            assert stats.decay_max[h] == pytest.approx(math.exp(stats.dt_min[h] * A[h]), rel=1e-5)
            assert 0 < stats.state_rms[h] <= stats.state_amax[h] < math.inf


def test_sampled_heads_come_from_the_measurements(calibrated):
    decay = calibrated.decay
    assert isinstance(decay, EmpiricalDecay) and len(decay.A) == 8
    pairs = set(zip(decay.A, decay.dt0))
    A, dt0 = decay.sample(4, torch.Generator().manual_seed(0))
    assert {(a, d) for a, d in zip(A.tolist(), dt0.tolist())} <= pairs
    # stratified: 4 draws from the 8 measured heads take one from each quarter of the decay order
    measured = sorted(math.exp(a * d) for a, d in pairs)
    drawn = sorted(torch.exp(A * dt0).tolist())
    for q, value in enumerate(drawn):
        assert measured[2 * q] <= value + 1e-12 and value <= measured[2 * q + 1] + 1e-12
    inputs = calibrated.sample_inputs(3, 1, seed=1)
    assert inputs.x.shape == (3, 1, 4, 16)
    assert min(measured) - 1e-6 <= float(inputs.decay().min()) and float(inputs.decay().max()) <= max(measured) + 1e-6


def test_the_model_is_left_unpatched(model, calibrated):
    for _, mixer in qt.find_mixers(model):
        assert "forward" not in mixer.__dict__
    assert not hasattr(model, "_qstate_patch")


def test_bad_input_is_rejected(model):
    with pytest.raises(ValueError, match="Mamba2ForCausalLM or NemotronHForCausalLM"):
        profiles.calibrate(torch.nn.Linear(2, 2), hf_tiny.prompt())
    with pytest.raises(ValueError, match="input_ids"):
        profiles.calibrate(model, torch.zeros(3))


@pytest.mark.parametrize("rows, length", [(2, 0), (0, 6)])
def test_empty_prompt_is_rejected(model, rows, length):
    with pytest.raises(ValueError, match="^input_ids: .*got shape"):
        profiles.calibrate(model, hf_tiny.prompt(batch=2, length=6)[:rows, :length], 2)


def test_non_finite_weights_are_blamed_on_the_model():
    broken = hf_tiny.nemotron_h(seed=8)
    with torch.no_grad():
        qt.find_mixers(broken)[0][1].A_log.fill_(math.nan)
    with pytest.raises(ValueError, match="^model: calibration measured"):
        profiles.calibrate(broken, hf_tiny.prompt(batch=1, length=4), 2)
