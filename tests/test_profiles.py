"""Model profiles, decay distributions, input sampling and config.json reading."""

import json

import numpy as np
import pytest
import torch

from qstate import profiles
from qstate.reference import decode_exact

SHAPES = {
    "mamba2-2.7b": (80, 64, 128, 1, 64),
    "nemotron-h-8b": (128, 64, 128, 8, 24),
    "nemotron-nano-9b-v2": (128, 80, 128, 8, 27),
    "nemotron-3-nano-30b-a3b": (64, 64, 128, 8, 23),
    "nemotron-3-super-120b-a12b": (128, 64, 128, 8, 40),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_design_model_has_a_profile(name):
    p = profiles.get(name)
    assert (p.nheads, p.headdim, p.dstate, p.ngroups, p.n_ssm_layers) == SHAPES[name]
    assert name in profiles.names()


def test_unknown_profile_lists_choices():
    with pytest.raises(ValueError, match="nemotron-h-8b"):
        profiles.get("mamba3")


def test_decays_span_the_initialisation_range():
    d = profiles.get("nemotron-h-8b").head_decays()
    # a = exp(-dt·|A|), dt ∈ [1e-3, 1e-1], |A| ∈ [1, 16]
    assert d.min() >= torch.exp(torch.tensor(-1.6, dtype=torch.float64)) and d.max() <= torch.exp(torch.tensor(-1e-3, dtype=torch.float64))
    assert d.min() < 0.5 and d.max() > 0.99


def test_same_seed_same_inputs():
    p = profiles.get("nemotron-3-nano-30b-a3b")
    a, b = p.sample_inputs(5, 2, heads=4, seed=3), p.sample_inputs(5, 2, heads=4, seed=3)
    c = p.sample_inputs(5, 2, heads=4, seed=4)
    for k, v in a.kwargs().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b.kwargs()[k]), k
    assert not torch.equal(a.x, c.x)
    assert a.x.dtype == torch.float32 and a.x.shape == (5, 2, 4, 64)


def test_sample_inputs_shapes_and_subset():
    p = profiles.get("nemotron-h-8b")
    full = p.sample_inputs(3, 2, seed=1)
    assert full.x.shape == (3, 2, 128, 64) and full.B.shape == (3, 2, 8, 128) and full.state0.shape == (2, 128, 64, 128)
    sub = p.sample_inputs(3, 2, heads=[0, 17, 127], seed=1)
    assert sub.B.shape == (3, 2, 3, 128) and sub.A.shape == (3,)
    # a subset keeps each head's own parameters and its group's B
    assert torch.equal(sub.A, full.A[[0, 17, 127]])
    assert torch.equal(sub.x, full.x[:, :, [0, 17, 127]])
    assert torch.equal(sub.B[:, :, 1], full.B[:, :, 17 // 16])
    y, _ = decode_exact(**sub.kwargs())
    assert torch.isfinite(y).all()


def test_spread_heads_cover_slow_and_fast():
    p = profiles.get("nemotron-h-8b")
    heads = p.spread_heads(8)
    d = p.head_decays()
    assert len(set(heads)) == 8
    assert d[heads].max() == d.max() and d[heads].min() == d.min()


@pytest.mark.parametrize("heads", [[128], [-1], []])
def test_heads_out_of_range(heads):
    with pytest.raises(ValueError, match="heads"):
        profiles.get("nemotron-h-8b").sample_inputs(2, 1, heads=heads)


def test_sample_inputs_device_and_dtype():
    inp = profiles.get("mamba2-2.7b").sample_inputs(2, 1, heads=2, dtype=torch.bfloat16)
    assert inp.x.dtype == torch.bfloat16 and inp.A.dtype == torch.float32


NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 52,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "time_step_min": 0.001, "time_step_max": 0.1,
}
MAMBA2 = {
    "architectures": ["Mamba2ForCausalLM"], "num_heads": 80, "head_dim": 64, "state_size": 128,
    "n_groups": 1, "num_hidden_layers": 64, "time_step_min": 0.002, "time_step_max": 0.05,
}


def test_from_hf_config_nemotron_h(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NEMOTRON_H))
    p = profiles.from_hf_config(path)
    assert (p.nheads, p.headdim, p.dstate, p.ngroups, p.n_ssm_layers) == (128, 64, 128, 8, 24)
    assert profiles.from_hf_config(tmp_path) == p  # a folder holding config.json


def test_from_hf_config_mamba2_dict():
    p = profiles.from_hf_config(MAMBA2)
    assert (p.nheads, p.headdim, p.dstate, p.ngroups, p.n_ssm_layers) == (80, 64, 128, 1, 64)
    assert (p.decay.dt_min, p.decay.dt_max) == (0.002, 0.05)


def test_from_hf_config_without_mamba_fields():
    with pytest.raises(ValueError, match="Mamba-2"):
        profiles.from_hf_config({"hidden_size": 4096, "num_attention_heads": 32})
    with pytest.raises(ValueError, match="ngroups"):
        profiles.from_hf_config({**MAMBA2, "n_groups": 3})
    with pytest.raises(TypeError, match="config"):
        profiles.from_hf_config(3)


@pytest.mark.parametrize("fields, error, words", [
    ({"num_heads": "eight"}, TypeError, "num_heads: expected an int"),
    ({"num_heads": 8.7}, TypeError, "num_heads: expected an int"),
    ({"num_hidden_layers": 0}, ValueError, "num_hidden_layers: expected an int >= 1"),
    # dt is log-uniform in [time_step_min, time_step_max], so the minimum must be > 0
    ({"time_step_min": -0.01}, ValueError, "time_step_min = -0.01"),
    ({"time_step_min": 0.0}, ValueError, "time_step_min = 0.0"),
    ({"time_step_min": 0.5, "time_step_max": 0.001}, ValueError, "dt_max: expected a finite number >= dt_min"),
    ({"time_step_floor": -1e-4}, ValueError, "time_step_floor = -0.0001"),
    ({"hybrid_override_pattern": "*-"}, ValueError, "hybrid_override_pattern '[*]-' has no Mamba-2 layer"),
    ({"layers_block_type": ["attention", "mlp"]}, ValueError, "layers_block_type .* has no Mamba-2 layer"),
])
def test_from_hf_config_names_the_bad_field(fields, error, words):
    with pytest.raises(error, match=f"^config: .*{words}"):
        profiles.from_hf_config({**MAMBA2, **fields})


def test_from_hf_config_keeps_a_zero_floor():
    assert profiles.from_hf_config({**MAMBA2, "time_step_floor": 0.0}).decay.dt_floor == 0.0


def test_from_hf_config_needs_a_json_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config: expected a JSON object"):
        profiles.from_hf_config(tmp_path)


@pytest.mark.parametrize("fields, error, name", [
    (dict(a_min=0), ValueError, "a_min"),
    (dict(a_min=-1), ValueError, "a_min"),
    (dict(a_max=0.5), ValueError, "a_max"),
    (dict(dt_min=0), ValueError, "dt_min"),
    (dict(dt_max=float("nan")), ValueError, "dt_max"),
    (dict(dt_max=float("inf")), ValueError, "dt_max"),
    (dict(dt_floor=-1e-4), ValueError, "dt_floor"),
    (dict(a_min="1"), TypeError, "a_min"),
])
def test_decay_distribution_rejects_bad_ranges(fields, error, name):
    with pytest.raises(error, match=f"^{name}: "):
        profiles.DecayDistribution(**fields)


def test_profile_and_get_reject_bad_types():
    with pytest.raises(TypeError, match="^decay: expected a DecayDistribution, got str"):
        profiles.Profile("t", 4, 4, 32, 1, 1, "x")
    with pytest.raises(TypeError, match="^profile: expected a model name"):
        profiles.get(["a"])


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(heads="12"), TypeError, "heads"),
    (dict(heads=[1.7]), TypeError, "heads"),
    (dict(heads=2.0), TypeError, "heads"),
    (dict(seed=2.5), TypeError, "seed"),
    (dict(seed=None), TypeError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
])
def test_sample_inputs_rejects_bad_arguments(kwargs, error, name):
    with pytest.raises(error, match=f"^{name}: "):
        profiles.get("mamba2-2.7b").sample_inputs(2, 1, **{"heads": 2, **kwargs})


def test_sample_inputs_takes_numpy_and_torch_integers():
    p = profiles.get("mamba2-2.7b")
    expected = p.sample_inputs(2, 1, heads=2, seed=3)
    for heads, seed in ((np.int64(2), np.int64(3)), (torch.tensor(2), 3)):
        assert torch.equal(p.sample_inputs(2, 1, heads=heads, seed=seed).x, expected.x)
    chosen = [int(h) for h in expected.heads]
    assert torch.equal(p.sample_inputs(2, 1, heads=np.array(chosen), seed=3).x, expected.x)
