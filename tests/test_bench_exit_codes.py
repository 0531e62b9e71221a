"""Benchmark scripts report failure through their exit status: a missed drift-speed target and a
GPU case module that does not import are failures, not lines in a log."""

import pytest

from bench import drift_speed, run_gpu


@pytest.mark.parametrize("rate, code", [(drift_speed.TARGET / 10, 1), (drift_speed.TARGET * 10, 0)])
def test_drift_speed_exit_status_follows_the_target(rate, code, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(drift_speed, "measure", lambda schemes, steps, heads, batch, model=drift_speed.MAMBA2_MODEL: dict(
        model=model, schemes=[str(s) for s in schemes], steps=steps, heads=heads, batch=batch, seconds=1.0,
        element_steps_per_s=rate))
    assert drift_speed.main(["--out", str(tmp_path)]) == code
    if code:
        assert "missed" in capsys.readouterr().err


def test_run_gpu_counts_a_case_module_that_does_not_import(monkeypatch):
    monkeypatch.setattr(run_gpu, "CASE_MODULES", ("bench.no_such_case_module", "bench.cases_exact_dot"))
    modules, failures = run_gpu._load_case_modules()
    assert [m.__name__ for m in modules] == ["bench.cases_exact_dot"]
    assert len(failures) == 1 and "bench.no_such_case_module" in failures[0]
