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


# ----------------------------------------------------------------------------- delta-rule profiles

DELTA_SHAPES = {  # HK, HV, K, V, delta-rule layers, gate, gate form
    "qwen3.5-0.8b": (16, 16, 128, 128, 18, "scalar", "softplus"),
    "qwen3.5-9b": (16, 32, 128, 128, 24, "scalar", "softplus"),
    "qwen3.5-27b": (16, 48, 128, 128, 48, "scalar", "softplus"),
    "qwen3.5-35b-a3b": (16, 32, 128, 128, 30, "scalar", "softplus"),
    "qwen3.5-122b-a10b": (16, 64, 128, 128, 36, "scalar", "softplus"),
    "qwen3.5-397b-a17b": (16, 64, 128, 128, 45, "scalar", "softplus"),
    "qwen3-next-80b-a3b": (16, 32, 128, 128, 36, "scalar", "softplus"),
    "kimi-linear-48b-a3b": (32, 32, 128, 128, 20, "channel", "softplus"),
    "glm-5.3-flash": (64, 64, 128, 128, 34, "channel", "bounded"),
}


@pytest.mark.parametrize("name", sorted(DELTA_SHAPES))
def test_every_delta_model_has_a_profile(name):
    p = profiles.get(name)
    assert isinstance(p, profiles.DeltaRuleProfile) and p.family == "gated_delta"
    assert (p.num_k_heads, p.num_v_heads, p.head_k_dim, p.head_v_dim, p.n_layers, p.gate, p.gate_form) \
        == DELTA_SHAPES[name]
    assert name in profiles.names() and name in profiles.names("gated_delta") and name not in profiles.names("mamba2")
    assert p.beta_range == (0.0, 1.0)


def test_names_by_family():
    assert set(profiles.names("mamba2")) == set(SHAPES) and profiles.get("nemotron-h-8b").family == "mamba2"
    assert sorted(profiles.names("mamba2") + profiles.names("gated_delta")) == profiles.names()
    with pytest.raises(ValueError, match=r"^family: expected None or one of \['mamba2', 'gated_delta'\], got 'ssm'"):
        profiles.names("ssm")


@pytest.mark.parametrize("name", ["qwen3.5-9b", "kimi-linear-48b-a3b", "glm-5.3-flash"])
def test_delta_sample_inputs_run_the_reference(name):
    from qstate.reference import gated_delta

    p = profiles.get(name)
    inp = p.sample_inputs(4, 2, heads=3, seed=1)
    channel = p.gate == "channel"
    assert inp.q.shape == inp.k.shape == (4, 2, 3, 128) and inp.v.shape == (4, 2, 3, 128)
    assert inp.g.shape == ((4, 2, 3, 128) if channel else (4, 2, 3)) and inp.beta.shape == (4, 2, 3)
    assert inp.state0.shape == (2, 3, 128, 128) and not inp.state0.any()
    assert (inp.g <= 0).all() and ((inp.beta > 0) & (inp.beta < 1)).all()
    o, _ = gated_delta.decode_exact(**inp.kwargs())
    assert o.shape == (4, 2, 3, 128) and torch.isfinite(o).all()


def test_delta_subset_keeps_each_heads_parameters_and_key_head():
    p = profiles.get("qwen3.5-9b")  # two value heads per key head
    full = p.sample_inputs(3, 2, seed=2)
    assert full.q.shape == (3, 2, 16, 128) and full.v.shape == (3, 2, 32, 128) and full.g.shape == (3, 2, 32)
    sub = p.sample_inputs(3, 2, heads=[0, 5, 31], seed=2)
    assert sub.key_heads.tolist() == [0, 2, 15]
    assert torch.equal(sub.q, full.q[:, :, [0, 2, 15]]) and torch.equal(sub.k, full.k[:, :, [0, 2, 15]])
    for name in ("v", "g", "beta"):
        assert torch.equal(getattr(sub, name), getattr(full, name)[:, :, [0, 5, 31]]), name
    assert torch.equal(sub.A, full.A[[0, 5, 31]]) and torch.equal(sub.decay(), full.decay()[[0, 5, 31]])


def test_delta_same_seed_same_inputs():
    p = profiles.get("kimi-linear-48b-a3b")
    a, b, c = (p.sample_inputs(3, 1, heads=2, seed=s) for s in (4, 4, 5))
    for key, value in a.kwargs().items():
        assert torch.equal(value, b.kwargs()[key]), key
    assert not torch.equal(a.g, c.g)


def test_gdn_gates_follow_the_initialisation():
    p = profiles.get("qwen3.5-27b")
    inp = p.sample_inputs(64, 4, seed=0)
    A = inp.A.double()
    # A = exp(A_log) ~ U[0.01, 16] (stratified: one head per 1/48 quantile), dt_bias = 1
    assert A.min() >= 0.01 and A.max() <= 16 and A.min() < 0.01 + 16 / 48 and A.max() > 16 - 16 / 48
    assert torch.equal(inp.dt_bias, torch.ones(48, 1))
    # g = -A·softplus(f + 1) with f ~ N(0, 0.5²): the per-token rate g / -A wanders around softplus(1)
    rate = (-inp.g.double() / A).flatten()
    assert abs(rate.log().median() - np.log(np.log1p(np.e))) < 0.05
    assert torch.allclose(p.head_decays(), inp.decay(), rtol=1e-5, atol=0)  # inputs hold A in fp32


def test_kda_gates_are_low_rank_and_bounded_gates_stay_in_bounds():
    kimi = profiles.get("kimi-linear-48b-a3b").sample_inputs(200, 1, heads=4, seed=0)
    dt = torch.nn.functional.softplus(kimi.dt_bias.double())
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001  # dt log-uniform in [1e-3, 1e-1]
    A = kimi.A.double()
    assert A.min() >= 1 and A.max() <= 16
    # f = W z with z of rank K = 128 shared by every head and channel of a token
    f = torch.log(torch.expm1(-kimi.g.double() / A[:, None])) - kimi.dt_bias.double()
    flat = f[:, 0].reshape(200, -1)
    assert abs(flat.std() - 0.5) < 0.05
    assert torch.linalg.matrix_rank(flat, rtol=1e-6) <= 128
    glm = profiles.get("glm-5.3-flash").sample_inputs(50, 1, heads=2, seed=0)
    assert (glm.g > -5).all() and (glm.g < 0).all() and torch.equal(glm.A, torch.ones(2))


QWEN3_5_9B = {  # the shape of a released Qwen3.5 config.json: the text model nested in text_config
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 32, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "layer_types": ["linear_attention"] * 3 * 8 + ["full_attention"] * 8},
}
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "num_hidden_layers": 27,
    "linear_attn_config": {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                           "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27][:20],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]},
}


def test_from_hf_config_delta_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_9B))
    p = profiles.from_hf_config(tmp_path)
    assert isinstance(p, profiles.DeltaRuleProfile)
    assert (p.num_k_heads, p.num_v_heads, p.head_k_dim, p.head_v_dim, p.n_layers, p.gate) == (16, 32, 128, 128, 24, "scalar")
    k = profiles.from_hf_config(KIMI_LINEAR)
    assert (k.num_k_heads, k.num_v_heads, k.head_k_dim, k.n_layers, k.gate, k.gate_form) == (32, 32, 128, 20, "channel", "softplus")
    # transformers' defaults where a config leaves fields out
    nxt = profiles.from_hf_config({"model_type": "qwen3_next"})
    assert (nxt.num_k_heads, nxt.num_v_heads, nxt.n_layers) == (16, 32, 36)
    glm = profiles.from_hf_config({"model_type": "glm5_next"})
    assert (glm.num_v_heads, glm.n_layers, glm.gate_form, glm.lower_bound) == (64, 34, "bounded", -5.0)
    moe = profiles.from_hf_config({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 40}})
    assert moe.n_layers == 30
    assert profiles.from_hf_config({**KIMI_LINEAR, "linear_allow_neg_eigval": True}).beta_range == (0.0, 2.0)


@pytest.mark.parametrize("config, error, words", [
    ({"model_type": "qwen3_next", "linear_num_value_heads": 24, "linear_num_key_heads": 16}, ValueError,
     "linear_num_value_heads: expected a multiple of linear_num_key_heads = 16, got 24"),
    ({"model_type": "qwen3_next", "layer_types": ["full_attention"]}, ValueError, "no delta-rule layer"),
    ({"model_type": "qwen3_next", "linear_key_head_dim": "128"}, TypeError, "linear_key_head_dim: expected an int"),
    ({"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": []}}, ValueError, "kda_layers is empty"),
    ({"model_type": "glm5_next", "linear_lower_bound": 5}, ValueError, "linear_lower_bound: expected None or a number < 0"),
    ({"model_type": "kimi_linear", "linear_allow_neg_eigval": "yes"}, ValueError, "linear_allow_neg_eigval"),
])
def test_from_hf_config_delta_names_the_bad_field(config, error, words):
    with pytest.raises(error, match=f"^config: .*{words}"):
        profiles.from_hf_config(config)


@pytest.mark.parametrize("fields, error, words", [
    (dict(num_v_heads=24), ValueError, "^num_v_heads: expected a multiple of num_k_heads = 16, got 24"),
    (dict(gate="vector"), ValueError, r"^gate: expected one of \['scalar', 'channel'\]"),
    (dict(gate_form="tanh"), ValueError, r"^gate_form: expected one of \['softplus', 'bounded'\]"),
    (dict(gates="x"), TypeError, "^gates: expected a GateDistribution"),
    (dict(lower_bound=1.0), ValueError, "^lower_bound"),
    (dict(head_k_dim=0), ValueError, "^head_k_dim: expected an int >= 1"),
])
def test_delta_profile_rejects_bad_fields(fields, error, words):
    base = dict(name="t", num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, n_layers=1)
    with pytest.raises(error, match=words):
        profiles.DeltaRuleProfile(**{**base, **fields})


def test_delta_sample_inputs_rejects_bad_heads():
    p = profiles.get("qwen3.5-9b")
    with pytest.raises(ValueError, match=r"^heads: expected indices in \[0, 32\)"):
        p.sample_inputs(2, 1, heads=[32])
    with pytest.raises(ValueError, match="^heads: expected at most num_v_heads = 32"):
        p.sample_inputs(2, 1, heads=33)
