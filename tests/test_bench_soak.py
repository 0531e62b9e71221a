"""The GPU soak's loop (``bench/soak.py``) run eagerly under the interpreter at a tiny shape: two
checks of one step each against the fp32 conventional reference, and a check that fails when
the bound is broken (so a soak can fail)."""

from __future__ import annotations

import json

from bench import soak

TINY = ["--device", "cpu", "--shape", "2,4,32,1", "--batch", "3", "--ref-rows", "2", "--steps", "2",
        "--check-every", "1", "--graph-steps", "1"]


def test_the_bound_is_half_an_e4m3_step_plus_two_bf16_output_roundings():
    assert soak.bound() == 2.0 ** -4 + 2 * 2.0 ** -8


def test_a_tiny_soak_passes_its_checks_and_a_broken_bound_fails_them(tmp_path, monkeypatch):
    out = tmp_path / "soak.json"
    assert soak.main([*TINY, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert [c["step"] for c in summary["checks"]] == [1, 2]
    assert all(c["finite"] and c["flagged_slots"] == 0 for c in summary["checks"])
    # The read copy's rounding is visible, and within the bound.
    assert 1e-4 < summary["max_rel_rms"] <= summary["bound"] and not summary["failures"]

    monkeypatch.setattr(soak, "bound", lambda *args, **kwargs: 1e-6)
    assert soak.main([*TINY, "--out", str(out)]) == 1
    assert len(json.loads(out.read_text())["failures"]) == 2
