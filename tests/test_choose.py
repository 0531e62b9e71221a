"""The precision chooser: keeps schemes within tolerance, ranks by the objective, explains rejections."""

import math

import pytest

from qstate import profiles
from qstate.analysis.choose import recommend

TINY = profiles.Profile("tiny", 6, 16, 64, 2, 1)
CANDIDATES = ["fp32", "bf16", "fp8_e4m3:row", "int8:row", "replay/fp32/8", "replay/fp32/fp8_e4m3:row/8",
              "replay/bf16/int8:row/8"]



@pytest.fixture(scope="module")
def traffic():
    return recommend(TINY, 2e-2, steps=96, candidates=CANDIDATES, heads=4, batch=2, every=2)


def test_recommends_the_cheapest_scheme_within_tolerance(traffic):
    rows = {r["scheme"]: r for r in traffic.table}
    accepted = [r for r in traffic.table if r["accepted"]]
    assert traffic.best == accepted[0]
    assert traffic.best["p99_error"] < 2e-2
    assert all(r["bytes_per_step"] >= traffic.best["bytes_per_step"] for r in accepted)
    assert [r["bytes_per_step"] for r in accepted] == sorted(r["bytes_per_step"] for r in accepted)
    assert set(traffic.rejected) == {r["scheme"] for r in traffic.table if not r["accepted"]}
    assert rows["fp32"]["accepted"] and not rows["fp8_e4m3:row"]["accepted"]
    assert "tolerance" in traffic.rejected["fp8_e4m3:row"]
    text = str(traffic)
    assert text.startswith("Recommended (traffic, tolerance 0.02): " + traffic.best["scheme"])


def test_memory_objective_ranks_by_bytes_held():
    rec = recommend(TINY, 2e-2, steps=96, candidates=CANDIDATES, heads=4, batch=2, every=2, objective="memory")
    accepted = [r for r in rec.table if r["accepted"]]
    assert [r["bytes_resident"] for r in accepted] == sorted(r["bytes_resident"] for r in accepted)
    assert rec.best["bytes_resident"] == min(r["bytes_resident"] for r in accepted)


def test_nothing_passes_a_tiny_tolerance():
    rec = recommend(TINY, 1e-12, steps=16, candidates=["bf16", "int8:row"], heads=2, batch=1)
    assert rec.best is None and set(rec.rejected) == {"bf16", "int8:row"}
    assert "none of the candidates" in str(rec)


@pytest.mark.parametrize("tolerance, error", [(0.0, ValueError), (-1e-2, ValueError), (math.nan, ValueError),
                                              ("1e-2", TypeError)])
def test_bad_tolerance(tolerance, error):
    with pytest.raises(error, match="tolerance"):
        recommend(TINY, tolerance, steps=4, candidates=["fp32"], heads=2)


def test_bad_objective_steps_and_heads():
    with pytest.raises(ValueError, match="objective"):
        recommend(TINY, 1e-2, steps=4, candidates=["fp32"], heads=2, objective="speed")
    with pytest.raises(ValueError, match="steps"):
        recommend(TINY, 1e-2, steps=0, candidates=["fp32"], heads=2)
    with pytest.raises(ValueError, match="heads"):
        recommend(TINY, 1e-2, steps=4, candidates=["fp32"], heads=[7])
