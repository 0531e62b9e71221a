"""qstate.analysis.model_drift on a tiny random Nemotron-H (kernels under the Triton interpreter).

fp32 schemes reproduce the unpatched model within fp32 rounding (see the bound in
test_integration_transformers.py), so their KL is at the level of that rounding: the logits
differ by ~1e-6 relative, and KL is second order in the difference, far below 1e-9.
"""

import json
import math

import pytest
import torch

from helpers import hf_tiny
from qstate.analysis import model_drift
from qstate.analysis.model_drift import SUMMARY_FIELDS, SchemeDrift
from qstate.analysis.schemes import Scheme
from qstate.integrations import transformers as qt

SCHEMES = ["fp32", "replay/fp32/4", "fp8_e4m3:row", "replay/fp32/fp8_e4m3:row/4"]


@pytest.fixture(scope="module")
def drift():
    model = hf_tiny.nemotron_h(seed=5)
    return model_drift(model, hf_tiny.prompt(batch=2, length=6, seed=6), SCHEMES, 10)


def test_every_scheme_is_reported_per_token(drift):
    assert drift.tokens.shape == (2, 10)
    assert [str(e.scheme) for e in drift.schemes] == SCHEMES
    for entry in drift.schemes:
        assert entry.failed_at is None
        for metric in (entry.kl, entry.top1, entry.max_abs_logit):
            assert metric.shape == (2, 10)
        assert torch.isfinite(entry.kl).all() and (entry.kl >= 0).all()


def test_fp32_schemes_agree_with_the_reference(drift):
    for scheme in ("fp32", "replay/fp32/4"):
        entry = drift[scheme]
        assert entry.kl.max() < 1e-9
        assert entry.top1.all()


def test_quantized_schemes_drift_measurably_but_finitely(drift):
    for scheme in ("fp8_e4m3:row", "replay/fp32/fp8_e4m3:row/4"):
        entry = drift[scheme]
        assert entry.max_abs_logit.max() > drift["fp32"].max_abs_logit.max()
        assert entry.kl.max() > 0


def test_summary_markdown_and_json(drift, tmp_path):
    rows = drift.summary()
    assert [row["scheme"] for row in rows] == SCHEMES
    for row in rows:
        assert set(row) == set(SUMMARY_FIELDS)
        assert 0.0 <= row["top1_agreement"] <= 1.0 and row["failed_at"] is None
    assert rows[0]["bytes_per_step"] == 8.0  # conventional fp32: read and write 4 bytes
    table = drift.to_markdown()
    assert table.count("\n") == len(SCHEMES) + 1 and "fp8_e4m3:row" in table
    path = tmp_path / "drift.json"
    drift.to_json(path)
    payload = json.loads(path.read_text())
    assert payload["new_tokens"] == 10 and len(payload["per_step"]["fp8_e4m3:row"]["kl"]) == 10
    with pytest.raises(KeyError, match="bf16"):
        drift["bf16"]


def test_a_non_finite_scheme_is_reported_as_failed_with_its_step():
    reference = torch.randn(2, 5, 7)
    logits = reference.clone()
    logits[1, 3, 2] = math.nan
    entry = SchemeDrift.compare(Scheme.parse("fp8_e4m3:row"), reference, logits)
    assert entry.failed_at == 4
    assert torch.isnan(entry.kl[:, 3:]).all() and (entry.kl[:, :3] == 0).all()
    row = entry.summary()
    assert row["failed_at"] == 4 and row["mean_kl"] is None and row["top1_agreement"] is None


def test_a_decode_that_bypasses_qstate_is_an_error_not_a_free_scheme(monkeypatch):
    """A model whose decode never calls the patched step function (kernelize(), a hub kernel)
    would give the reference's logits under every scheme's name."""
    model = hf_tiny.nemotron_h(seed=5)
    monkeypatch.setattr(qt, "_dispatcher", lambda original: original)
    with pytest.raises(RuntimeError, match=r"model_drift: expected qstate to run all 3 decode steps .* got \{"):
        model_drift(model, hf_tiny.prompt(batch=1, length=4, seed=6), ["fp8_e4m3:row"], 3)


def test_bad_input_is_rejected():
    model = hf_tiny.mamba2(seed=7)
    ids = hf_tiny.prompt(batch=1, length=3)
    with pytest.raises(ValueError, match="scheme: cannot parse"):
        model_drift(model, ids, ["fp32", "fp9"], 2)
    with pytest.raises(ValueError, match="Mamba2ForCausalLM or NemotronHForCausalLM"):
        model_drift(torch.nn.Linear(2, 2), ids, ["fp32"], 2)
    with pytest.raises(ValueError, match="new_tokens"):
        model_drift(model, ids, ["fp32"], 0)
    with qt.patch(model, "fp32"):
        with pytest.raises(ValueError, match="unpatched model"):
            model_drift(model, ids, ["fp32"], 2)


def test_cli_drift_hf_model_writes_a_report(tmp_path, capsys):
    from qstate import cli

    hf_tiny.mamba2(seed=10).save_pretrained(tmp_path / "weights")
    out = tmp_path / "report"
    code = cli.main(["drift", "--hf-model", str(tmp_path / "weights"), "--schemes", "fp32,fp8_e4m3:row",
                     "--new-tokens", "3", "--prompt-tokens", "4", "--batch", "1", "--out", str(out)])
    assert code == 0
    assert "| fp8_e4m3:row |" in capsys.readouterr().out
    assert {"model_drift.md", "model_drift.json", "model_drift.png"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "model_drift.json").read_text())["new_tokens"] == 3
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["drift", "--hf-model", str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert "hf-model: expected a folder with config.json" in capsys.readouterr().err
