"""The qstate command loses no work: --out is checked before simulating, an existing report is
kept unless --force, the report and the summary come before the optional plot, and missing
extras or unreadable configs are one-line errors naming the argument."""

import json
import os
import sys

import pytest

from qstate.cli import main

TINY = ["--model", "nemotron-h-8b", "--schemes", "fp32,bf16", "--steps", "4", "--heads", "2", "--batch", "1"]


@pytest.fixture
def no_simulation(monkeypatch):
    from qstate.analysis import drift

    def simulate(*args, **kwargs):
        raise AssertionError("the simulation ran before the input was checked")

    monkeypatch.setattr(drift, "simulate", simulate)


def _refused(argv, capsys, *words):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert err.strip().count("\n") == 0, err
    return err


def test_out_under_a_file_is_refused_before_simulating(tmp_path, no_simulation, capsys):
    (tmp_path / "afile").write_text("")
    _refused(["drift", *TINY, "--out", str(tmp_path / "afile" / "sub")], capsys, "argument --out:")


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs a Linux sysfs")
def test_out_that_cannot_be_created_is_refused_before_simulating(no_simulation, capsys):
    _refused(["drift", *TINY, "--out", "/sys/qstate-report"], capsys, "argument --out:")


def test_an_existing_report_is_kept_unless_forced(tmp_path, capsys):
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("earlier work")
    _refused(["drift", *TINY, "--out", str(out)], capsys, "argument --out:", "--force")
    assert (out / "report.md").read_text() == "earlier work"
    assert main(["drift", *TINY, "--out", str(out), "--force"]) == 0
    assert (out / "report.md").read_text() != "earlier work"


def test_report_and_summary_without_matplotlib(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "rep"
    assert main(["drift", *TINY, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fp32 |" in printed and "plot skipped" in printed and "matplotlib" in printed
    assert json.loads((out / "drift.json").read_text())["steps"] == 4
    assert "plot skipped" in (out / "report.md").read_text()
    assert not (out / "drift.png").exists()


def test_hf_model_without_transformers_names_the_argument(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    _refused(["drift", "--hf-model", str(tmp_path), "--out", str(tmp_path / "r")], capsys,
             "argument --hf-model:", "transformers")
    assert not (tmp_path / "r").exists()


def test_config_that_is_not_utf8_names_the_argument(tmp_path, no_simulation, capsys):
    (tmp_path / "config.json").write_bytes(b'{"num_heads": "\xff\xfe"}')
    _refused(["drift", "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "r")], capsys,
             "argument --config:", "UTF-8")


def test_config_with_an_impossible_size_names_the_argument(tmp_path, no_simulation, capsys):
    cfg = {"num_heads": 10**12, "head_dim": 64, "state_size": 128, "n_groups": 1, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _refused(["drift", "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "r")], capsys,
             "argument --config:", "nheads")
