"""The qstate command: drift writes its report, choose prints a recommendation, errors name the input."""

import json

import pytest

from qstate.cli import main



def test_models_lists_profiles(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "nemotron-h-8b" in out and "| 128 | 64 | 128 | 8 |" in out


def test_drift_writes_report_figure_and_json(tmp_path, capsys):
    out = tmp_path / "rep"
    code = main(["drift", "--model", "nemotron-h-8b", "--schemes", "fp32,fp8_e4m3:row,replay/fp32/fp8_e4m3:row/4",
                 "--steps", "12", "--heads", "2", "--batch", "1", "--out", str(out)])
    assert code == 0
    report = (out / "report.md").read_text()
    assert "| replay/fp32/fp8_e4m3:row/4 |" in report and "Theory beside measurement" in report
    assert (out / "drift.png").stat().st_size > 0
    assert json.loads((out / "drift.json").read_text())["steps"] == 12
    assert "wrote" in capsys.readouterr().out


def test_choose_prints_the_ranked_table(capsys):
    code = main(["choose", "--model", "mamba2-2.7b", "--tolerance", "1e-2", "--steps", "16", "--heads", "2",
                 "--candidates", "fp32,bf16,replay/fp32/int8:row/8", "--objective", "memory"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("Recommended (memory, tolerance 0.01): ")
    assert "| scheme | bytes_resident |" in out


def test_config_json_is_read(tmp_path, capsys):
    cfg = {"num_heads": 4, "head_dim": 16, "state_size": 32, "n_groups": 1, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["drift", "--config", str(tmp_path / "config.json"), "--schemes", "bf16", "--steps", "4",
                 "--heads", "all", "--batch", "1", "--out", str(tmp_path / "r")]) == 0


@pytest.mark.parametrize("argv, words", [
    (["drift", "--model", "nemotron-h-9b"], ["unknown model", "nemotron-h-8b"]),
    (["drift", "--model", "nemotron-h-8b", "--schemes", "fp9"], ["scheme", "fp9"]),
    (["drift", "--model", "nemotron-h-8b", "--steps", "0"], ["steps"]),
    (["drift", "--model", "nemotron-h-8b", "--heads", "0,200"], ["heads"]),
    (["choose", "--model", "nemotron-h-8b", "--tolerance", "nan"], ["tolerance"]),
    (["choose", "--model", "nemotron-h-8b", "--tolerance", "0"], ["tolerance"]),
])
def test_bad_input_is_a_clear_error(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_config_without_mamba2_fields(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(SystemExit):
        main(["drift", "--config", str(tmp_path / "config.json")])
    assert "config" in capsys.readouterr().err
