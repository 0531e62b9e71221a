"""The chooser's measures recomputed from the recorded errors, and its accept rule on every row."""

import math

import pytest

from qstate import profiles
from qstate.analysis.choose import rank, recommend

TINY = profiles.Profile("tiny", 6, 16, 64, 2, 1)
CANDIDATES = ["fp32", "bf16", "fp8_e4m3:row", "int8:row", "replay/fp32/fp8_e4m3:row/8"]


def _quantile(values, q):
    """The q-quantile with linear interpolation between order statistics, written out."""
    v = sorted(values)
    pos = (len(v) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _rms(values):
    return math.sqrt(sum(v * v for v in values) / len(values))


@pytest.fixture(scope="module")
def recommendation():
    # Every step recorded (every=1), so the per-cycle figures can be recomputed from the records.
    return recommend(TINY, 1e-2, steps=48, candidates=CANDIDATES, heads=5, batch=2, every=1)


def test_measures_follow_from_the_recorded_errors(recommendation):
    recorded = recommendation.result.to_dict()
    rows = {r["scheme"]: r for r in recommendation.table}
    assert set(rows) == set(recorded["schemes"]) == set(CANDIDATES)
    assert recorded["recorded_steps"] == list(range(1, 49))
    cycle = recorded["cycle"]
    assert cycle == 8 and recorded["cycle_steps"] == [8, 16, 24, 32, 40, 48]  # whole cycles of the ring of 8
    for j, scheme in enumerate(recorded["schemes"]):
        errors = recorded["output_error"][j]  # [recorded steps][heads]
        heads = range(len(errors[0]))
        per_head_max = [max(step[h] for step in errors) for h in heads]
        row = rows[scheme]
        assert row["max_error"] == pytest.approx(max(per_head_max), rel=1e-12)
        assert row["p99_error"] == pytest.approx(_quantile(per_head_max, 0.99), rel=1e-12)
        for c, end in enumerate(recorded["cycle_steps"]):  # RMS over every step of the cycle, per head
            window = errors[end - cycle:end]
            assert recorded["cycle_error"][j][c] == pytest.approx(
                [_rms([step[h] for step in window]) for h in heads], rel=1e-12), (scheme, end)
        last_cycle = [_rms([step[h] for step in errors[-cycle:]]) for h in heads]
        assert row["final_error"] == pytest.approx(_quantile(last_cycle, 0.99), rel=1e-12)
        # growth: log of the per-cycle RMS over heads against log of the cycles' middle steps, second half
        points = [(math.log(end - (cycle - 1) / 2), math.log(_rms(recorded["cycle_error"][j][c])))
                  for c, end in enumerate(recorded["cycle_steps"]) if end - (cycle - 1) / 2 >= 24]
        mx, my = (sum(p[i] for p in points) / len(points) for i in (0, 1))
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        assert row["growth_exponent"] == pytest.approx(slope, rel=1e-9)
        assert row["final_error"] <= row["max_error"] and row["p99_error"] <= row["max_error"]


def _check_accept_rule(rec):
    cost = {"traffic": "bytes_per_step", "memory": "bytes_resident"}[rec.objective]
    for row in rec.table:
        ok = row["failed_at"] is None and row["p99_error"] < rec.tolerance
        assert row["accepted"] == ok, row
        assert (row["scheme"] in rec.rejected) == (not ok)
    accepted = [r for r in rec.table if r["accepted"]]
    assert rec.best == (min(accepted, key=lambda r: (r[cost], r["p99_error"])) if accepted else None)


@pytest.mark.parametrize("objective", ["traffic", "memory"])
def test_accept_rule_on_every_row_at_every_tolerance(recommendation, objective):
    errors = sorted(r["p99_error"] for r in recommendation.table)
    # Tolerances at, just above and between the measured errors: the rule is a strict "<".
    for tol in {*errors, *(e * (1 + 1e-9) for e in errors), errors[0] / 2, errors[-1] * 2}:
        if tol > 0:
            _check_accept_rule(rank(recommendation.result, tol, objective))


def test_a_failed_scheme_is_never_accepted(recommendation):
    result = recommendation.result
    failed_scheme = str(result.schemes[0])
    saved = dict(result.failed_at)
    try:
        result.failed_at[failed_scheme] = 7
        rec = rank(result, 1e9)
        row = next(r for r in rec.table if r["scheme"] == failed_scheme)
        assert not row["accepted"] and "failed at step 7" in rec.rejected[failed_scheme]
        _check_accept_rule(rec)
    finally:
        result.failed_at.clear()
        result.failed_at.update(saved)
