"""``qstate.analysis.model_drift`` and ``qstate drift --hf-model`` on gated delta rule models
(tiny random configs of transformers' classes; the Triton interpreter)."""

import json

import pytest

from helpers import hf_tiny_delta as tiny
from qstate.analysis.model_drift import model_drift


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
def test_model_drift_measures_a_delta_model(name):
    """fp32 reproduces the unpatched logits to fp32 rounding; a read copy costs more than that but
    keeps the greedy tokens of a random model; the profile is the model's own layer shape."""
    model = getattr(tiny, name)()
    result = model_drift(model, tiny.prompt(), "fp32,replay/fp32/fp8_e4m3:row/4", new_tokens=8)
    rows = {row["scheme"]: row for row in result.summary()}
    fp32, replay = rows["fp32"], rows["replay/fp32/fp8_e4m3:row/4"]
    assert fp32["mean_kl"] < 1e-12 and fp32["max_abs_logit"] < 1e-5
    assert replay["max_abs_logit"] > 10 * fp32["max_abs_logit"]
    assert replay["top1_agreement"] == 1.0
    assert result.profile.num_v_heads == 4  # hf_tiny_delta's configs
    assert fp32["bytes_per_step"] == 8


def test_cli_drift_hf_model_on_a_delta_model(tmp_path, capsys):
    from qstate import cli

    tiny.qwen3_5(seed=3).save_pretrained(tmp_path / "weights")
    out = tmp_path / "report"
    code = cli.main(["drift", "--hf-model", str(tmp_path / "weights"), "--schemes", "fp32,int8:row",
                     "--new-tokens", "4", "--prompt-tokens", "4", "--batch", "1", "--out", str(out)])
    assert code == 0
    assert "| int8:row |" in capsys.readouterr().out
    assert json.loads((out / "model_drift.json").read_text())["new_tokens"] == 4
