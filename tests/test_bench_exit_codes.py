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


def _stand_in_gpu(monkeypatch, cases, time_case, copy_ceiling=lambda device: 100.0):
    """run_gpu over ``cases`` with no case modules and no GPU: ``time_case`` and ``copy_ceiling``
    stand in for the harness's timings."""
    import torch

    from bench import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run_gpu, "CASE_MODULES", ())
    monkeypatch.setattr(harness, "environment", lambda: dict(gpu="probe", commit="probe"))
    monkeypatch.setattr(harness, "copy_ceiling_gbs", copy_ceiling)
    monkeypatch.setattr(harness, "read_ceiling_gbs", lambda device: 100.0)
    monkeypatch.setattr(harness, "cases", lambda device, groups: cases)
    monkeypatch.setattr(harness, "time_case", time_case)
    monkeypatch.setattr(harness, "markdown_table", lambda payload: "")


def test_run_gpu_writes_the_timed_rows_when_the_ceiling_after_them_fails(monkeypatch, tmp_path):
    """A case that breaks the CUDA context (an illegal address) makes every later GPU call raise:
    the rows timed before it are still written, and the run reports the failure."""
    from bench import harness

    case = harness.Case("probe", "probe/one", {}, 1000, lambda: None, lambda buffers: None)
    ceilings = iter([100.0])

    def ceiling(device):
        value = next(ceilings, None)
        if value is None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return value

    _stand_in_gpu(monkeypatch, [case], lambda c: 10.0, ceiling)
    assert run_gpu.main(["--out", str(tmp_path), "--skip-checks"]) == 1
    import json

    payload = json.loads((tmp_path / "probe.json").read_text())
    assert [r["name"] for r in payload["results"]] == ["probe/one"]
    assert any("illegal memory access" in f for f in payload["failures"])


def test_run_gpu_times_peer_cases_after_every_qstate_case(monkeypatch, tmp_path):
    """A peer kernel that faults breaks the CUDA context for every later case, so peers go last."""
    from bench import harness

    order = []
    peer = harness.Case("probe", "probe/peer", {}, 1000, lambda: None, lambda buffers: None, peer=True)
    ours = [harness.Case("probe", f"probe/ours{i}", {}, 1000, lambda: None, lambda buffers: None) for i in range(2)]
    _stand_in_gpu(monkeypatch, [ours[0], peer, ours[1]], lambda c: order.append(c.name) or 10.0)
    assert run_gpu.main(["--out", str(tmp_path), "--skip-checks"]) == 0
    assert order == ["probe/ours0", "probe/ours1", "probe/peer"]


def _probe_modules(monkeypatch, calls):
    """Two case modules whose checks record their calls, in place of the real ones."""
    import sys
    import types

    names = []
    for name in ("probe_cases_alpha", "probe_cases_beta"):
        module = types.ModuleType(name)
        module.check_kernel = lambda device, name=name: calls.append(name) or []
        monkeypatch.setitem(sys.modules, name, module)
        names.append(name)
    monkeypatch.setattr(run_gpu, "CASE_MODULES", tuple(names))


def _no_timing(monkeypatch):
    import torch

    from bench import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "environment", lambda: dict(gpu="probe", commit="probe"))
    monkeypatch.setattr(harness, "copy_ceiling_gbs", lambda device: 100.0)
    monkeypatch.setattr(harness, "read_ceiling_gbs", lambda device: 100.0)
    monkeypatch.setattr(harness, "cases", lambda device, groups: [])


def test_run_gpu_checks_only_the_named_case_modules(monkeypatch, tmp_path):
    calls = []
    _probe_modules(monkeypatch, calls)
    _no_timing(monkeypatch)
    assert run_gpu.main(["--out", str(tmp_path), "--checks", "beta"]) == 0
    assert calls == ["probe_cases_beta"]
    assert run_gpu.main(["--out", str(tmp_path)]) == 0
    assert calls == ["probe_cases_beta", "probe_cases_alpha", "probe_cases_beta"]


def test_run_gpu_refuses_checks_that_name_no_module_before_any_work(monkeypatch, tmp_path, capsys):
    calls = []
    _probe_modules(monkeypatch, calls)
    _no_timing(monkeypatch)
    assert run_gpu.main(["--out", str(tmp_path), "--checks", "gamma"]) == 2
    assert calls == [] and "--checks" in capsys.readouterr().err and not any(tmp_path.iterdir())


def _two_cases(monkeypatch, time_case):
    from bench import harness

    cases = [harness.Case("probe", f"probe/{i}", {}, 1000, lambda: None, lambda buffers: None) for i in range(2)]
    _stand_in_gpu(monkeypatch, cases, time_case)


def test_run_gpu_killed_part_way_keeps_the_rows_it_timed(monkeypatch, tmp_path):
    """A run cut off (a timeout, ^C) after its first case: that row is on disk, marked incomplete,
    and no ``<group>.json`` pretends the run finished."""
    import json

    def time_case(case):
        if case.name == "probe/1":
            raise KeyboardInterrupt
        return 10.0

    _two_cases(monkeypatch, time_case)
    with pytest.raises(KeyboardInterrupt):
        run_gpu.main(["--out", str(tmp_path), "--skip-checks"])
    payload = json.loads((tmp_path / "probe.partial.json").read_text())
    assert payload["complete"] is False and [r["name"] for r in payload["results"]] == ["probe/0"]
    assert not (tmp_path / "probe.json").exists()


def test_run_gpu_finished_writes_the_group_and_removes_its_partial_file(monkeypatch, tmp_path):
    import json

    _two_cases(monkeypatch, lambda case: 10.0)
    assert run_gpu.main(["--out", str(tmp_path), "--skip-checks"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]
    payload = json.loads((tmp_path / "probe.json").read_text())
    assert [r["name"] for r in payload["results"]] == ["probe/0", "probe/1"] and "complete" not in payload


def test_run_gpu_refuses_an_unwritable_out_before_any_work(monkeypatch, tmp_path, capsys):
    timed = []
    _two_cases(monkeypatch, lambda case: timed.append(case) or 10.0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert run_gpu.main(["--out", str(blocker / "results"), "--skip-checks"]) == 2
    assert timed == [] and "--out" in capsys.readouterr().err
