"""The qstate command: drift writes its report, choose prints a recommendation, errors name the input."""

import importlib
import json

import pytest
import torch

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


def test_drift_defaults_reach_the_simulation(monkeypatch, tmp_path):
    """--steps, --heads and --every are absent unless given (so --hf-model can refuse them); the
    simulation still gets their documented defaults."""
    from qstate.analysis import drift

    calls = []

    class Stop(Exception):
        pass

    def simulate(profile, schemes, steps, **kwargs):
        calls.append((steps, kwargs))
        raise Stop

    monkeypatch.setattr(drift, "simulate", simulate)
    with pytest.raises(Stop):
        main(["drift", "--model", "nemotron-h-8b", "--out", str(tmp_path / "r")])
    with pytest.raises(Stop):
        main(["drift", "--model", "nemotron-h-8b", "--steps", "1024", "--heads", "all", "--out", str(tmp_path / "r")])
    (steps, kwargs), (steps2, kwargs2) = calls
    assert (steps, kwargs["heads"], kwargs["every"]) == (8192, 16, 16)
    assert (steps2, kwargs2["heads"], kwargs2["every"]) == (1024, None, 2)


@pytest.fixture
def no_simulation(monkeypatch):
    from qstate.analysis import drift

    def simulate(*args, **kwargs):
        raise AssertionError("the simulation ran before the input was checked")

    monkeypatch.setattr(drift, "simulate", simulate)


@pytest.mark.parametrize("extra, words", [
    (["--threads", "-1"], ["--threads", "got -1"]),
    (["--threads", "0"], ["--threads", "got 0"]),
    (["--device", "bogus"], ["--device", "bogus"]),
    (["--device", f"cuda:{torch.cuda.device_count()}"], ["--device", "CUDA device"]),
    (["--every", "0"], ["--every", "got 0"]),
    (["--steps", "-3"], ["--steps", "got -3"]),
    (["--schemes", ""], ["schemes", "got none"]),
    (["--new-tokens", "-5", "--prompt", "hi"], ["--new-tokens", "got -5"]),
    (["--new-tokens", "5"], ["--new-tokens", "--hf-model"]),
    (["--prompt", "hi"], ["--prompt", "--hf-model"]),
    (["--prompt-tokens", "4"], ["--prompt-tokens", "--hf-model"]),
])
def test_bad_drift_options_are_refused_before_simulating(extra, words, tmp_path, no_simulation, capsys):
    out = tmp_path / "r"
    with pytest.raises(SystemExit) as exit_info:
        main(["drift", "--model", "nemotron-h-8b", "--steps", "8", "--heads", "2", "--out", str(out), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not out.exists()


def test_out_that_is_a_file_is_refused_before_simulating(tmp_path, no_simulation, capsys):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["drift", "--model", "nemotron-h-8b", "--steps", "8", "--heads", "2", "--out", str(tmp_path / "afile")])
    assert exit_info.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_config_that_is_not_a_json_object(tmp_path, capsys):
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SystemExit) as exit_info:
        main(["choose", "--config", str(tmp_path / "list.json"), "--tolerance", "1e-2", "--steps", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "config: expected a JSON object" in err and "list" in err


@pytest.fixture
def hf_folder(tmp_path):
    """A folder with a word-level tokenizer that encodes "hi" and nothing for blank text."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "w")
    return tmp_path / "w"


@pytest.fixture
def hf_calls(monkeypatch):
    """Stands in for hf_model_report (no model is loaded); records the arguments it was given."""
    # qstate.analysis exports the function model_drift under its module's name
    model_drift = importlib.import_module("qstate.analysis.model_drift")
    calls = []

    class Result:
        def to_markdown(self):
            return "| result |"

    def report(*args, **kwargs):
        calls.append((args, kwargs))
        return Result()

    monkeypatch.setattr(model_drift, "hf_model_report", report)
    return calls


@pytest.mark.parametrize("extra, words", [
    (["--prompt-tokens", "0"], ["--prompt-tokens", "got 0"]),
    (["--batch", "0"], ["--batch", "got 0"]),
    (["--new-tokens", "0"], ["--new-tokens", "got 0"]),
    (["--prompt", ""], ["--prompt", "at least one token"]),
    (["--prompt", "  "], ["--prompt", "at least one token"]),
    (["--prompt", "hi", "--prompt-tokens", "4"], ["--prompt-tokens", "without --prompt"]),
    (["--schemes", ""], ["schemes", "got none"]),
    (["--steps", "100"], ["--steps", "only without --hf-model"]),
    (["--heads", "all"], ["--heads", "only without --hf-model"]),
    (["--every", "4"], ["--every", "only without --hf-model"]),
])
def test_bad_hf_model_options_are_refused_before_loading(extra, words, hf_folder, hf_calls, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["drift", "--hf-model", str(hf_folder), "--out", str(tmp_path / "r"), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not hf_calls


def test_hf_model_options_keep_their_defaults(hf_folder, hf_calls, tmp_path):
    assert main(["drift", "--hf-model", str(hf_folder), "--out", str(tmp_path / "r")]) == 0
    assert main(["drift", "--hf-model", str(hf_folder), "--prompt", "hi", "--out", str(tmp_path / "r")]) == 0
    args, kwargs = hf_calls[0]
    assert args[2] == 64 and kwargs["prompt_tokens"] == 32 and kwargs["prompt"] is None  # new_tokens is args[2]
    assert hf_calls[1][1]["prompt"] == "hi"
