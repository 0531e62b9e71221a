"""qstate.analysis.model_drift on a tiny random Nemotron-H (kernels under the Triton interpreter),
and its summary figures on made-up logits (whole ring cycles, no model needed).

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
from qstate.analysis.model_drift import SUMMARY_FIELDS, ModelDrift, SchemeDrift
from qstate.analysis.schemes import Scheme
from qstate.integrations import transformers as qt

SCHEMES = ["fp32", "replay/fp32/4", "fp8_e4m3:row", "replay/fp32/fp8_e4m3:row/4"]
NEW_TOKENS = 8  # two whole cycles of the ring of 4: the last step is a flushing token


@pytest.fixture(scope="module")
def drift():
    model = hf_tiny.nemotron_h(seed=5)
    return model_drift(model, hf_tiny.prompt(batch=2, length=6, seed=6), SCHEMES, NEW_TOKENS)


def test_every_scheme_is_reported_per_token(drift):
    assert drift.tokens.shape == (2, NEW_TOKENS)
    assert [str(e.scheme) for e in drift.schemes] == SCHEMES
    for entry in drift.schemes:
        assert entry.failed_at is None
        for metric in (entry.kl, entry.top1, entry.max_abs_logit):
            assert metric.shape == (2, NEW_TOKENS)
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
    table = drift.to_markdown().split("\n\n")[0]
    assert table.count("\n") == len(SCHEMES) + 1 and "fp8_e4m3:row" in table
    assert "- `final_kl`: mean KL over the sequences and the last cycle, decode steps 5–8" in drift.to_markdown()
    path = tmp_path / "drift.json"
    drift.to_json(path)
    payload = json.loads(path.read_text())
    assert payload["new_tokens"] == NEW_TOKENS and len(payload["per_step"]["fp8_e4m3:row"]["kl"]) == NEW_TOKENS
    assert (payload["cycle"], payload["cycle_steps"]) == (4, [4, 8])
    assert len(payload["per_cycle"]["fp8_e4m3:row"]["kl"]) == 2
    assert payload["measures"] == drift.measures() and set(SUMMARY_FIELDS[2:-1]) <= set(payload["measures"])


def test_final_kl_is_the_mean_over_the_last_ring_cycle_not_the_flushing_token(drift):
    """With the run a whole number of ring cycles, the last step is the flushing token; final_kl
    covers the last whole cycle (steps 5–8), computed here from the per-step KLs."""
    for entry, row in zip(drift.schemes, drift.summary()):
        assert row["final_kl"] == pytest.approx(float(entry.kl[:, 4:].double().mean()), rel=1e-12, abs=0)
        assert row["mean_kl"] == pytest.approx(float(entry.kl.double().mean()), rel=1e-12, abs=0)
    with pytest.raises(KeyError, match="bf16"):
        drift["bf16"]


def test_a_non_finite_scheme_is_reported_as_failed_with_its_step():
    reference = torch.randn(2, 5, 7)
    logits = reference.clone()
    logits[1, 3, 2] = math.nan
    entry = SchemeDrift.compare(Scheme.parse("fp8_e4m3:row"), reference, logits)
    assert entry.failed_at == 4
    assert torch.isnan(entry.kl[:, 3:]).all() and (entry.kl[:, :3] == 0).all()
    row = entry.summary(cycle=5)
    assert row["failed_at"] == 4 and row["mean_kl"] is None and row["top1_agreement"] is None
    assert row["max_kl"] is None and row["final_kl"] is None


def _made_up(schemes_noise: dict, steps: int, flush_exact: int = 0) -> ModelDrift:
    """A ModelDrift of random reference logits and, per scheme, the reference plus noise of the
    given size; with ``flush_exact`` = L the replay schemes' logits equal the reference's at every
    L-th step, as a read-copy scheme whose flushing token reads no read copy."""
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(2, steps, 11, generator=generator)
    entries = []
    for scheme, noise in schemes_noise.items():
        logits = reference + noise * torch.randn(reference.shape, generator=generator)
        if flush_exact and Scheme.parse(scheme).is_replay:
            logits[:, flush_exact - 1::flush_exact] = reference[:, flush_exact - 1::flush_exact]
        entries.append(SchemeDrift.compare(Scheme.parse(scheme), reference, logits))
    return ModelDrift(torch.zeros(2, steps, dtype=torch.long), entries)


def test_a_read_copy_does_not_look_better_than_fp32_by_ending_on_its_flush():
    """The read copy's error (1e-2 in the logits) is above conventional fp32's (1e-4) at every step
    but the flushing one, which ends the run: every figure of the read copy is above fp32's."""
    result = _made_up({"fp32": 1e-4, "replay/fp32/fp8_e4m3:row/4": 1e-2}, 12, flush_exact=4)
    fp32, replay = result.summary()
    assert float(result.schemes[1].kl[:, -1].max()) == 0.0  # the flushing token
    for field in ("mean_kl", "max_kl", "final_kl", "max_abs_logit"):
        assert replay[field] > 100 * fp32[field], field
    assert replay["final_kl"] == pytest.approx(float(result.schemes[1].kl[:, 8:].mean()), rel=1e-12)


def test_cycles_are_the_least_common_multiple_of_the_rings_and_end_at_the_last_step(tmp_path):
    result = _made_up({"fp8_e4m3:row": 1e-2, "replay/fp32/4": 1e-3, "replay/fp32/bf16/6": 1e-3}, 26)
    assert result.cycle == 12 and result.cycle_steps == [14, 26]
    for entry, row in zip(result.schemes, result.summary()):
        kl, top1 = entry.kl.double(), entry.top1.double()
        assert row["mean_kl"] == pytest.approx(float(kl[:, 2:].mean()), rel=1e-12)  # steps 3–26
        assert row["final_kl"] == pytest.approx(float(kl[:, 14:].mean()), rel=1e-12)  # steps 15–26
        assert row["top1_agreement"] == pytest.approx(float(top1[:, 2:].mean()), rel=1e-12)
        assert row["max_kl"] == float(kl.max())  # every step
        assert torch.allclose(entry.per_cycle(12)["kl"], kl[:, 2:].reshape(2, 2, 12).mean(dim=(0, 2)))
    measures = result.measures()
    assert "least common multiple of 4, 6" in measures["cycle"] and "steps 1–2 fall in none" in measures["cycle"]
    assert measures["final_kl"].endswith("decode steps 15–26") and "steps 3–26" in measures["mean_kl"]
    result.plot(tmp_path / "drift.png")
    assert (tmp_path / "drift.png").stat().st_size > 0


def test_a_run_shorter_than_one_cycle_gives_no_cycle_figures():
    result = _made_up({"fp32": 1e-4, "replay/fp32/fp8_e4m3:row/16": 1e-2}, 8)
    assert result.cycle is None and result.cycle_steps == []
    for row in result.summary():
        assert row["mean_kl"] is None and row["final_kl"] is None and row["top1_agreement"] is None
        assert row["max_kl"] > 0 and row["max_abs_logit"] > 0
    assert "fewer than one whole cycle" in result.measures()["cycle"]
    assert result.measures()["final_kl"] == "not given (no whole cycle)"


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
