"""Choose a state precision: simulate candidate schemes, keep those within tolerance, rank by cost."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

from qstate import profiles as _profiles

from .drift import DriftResult, Summary, simulate
from .schemes import candidate_schemes, parse_schemes

__all__ = ["Recommendation", "recommend", "rank", "OBJECTIVES"]

OBJECTIVES = {"traffic": "bytes_per_step", "memory": "bytes_resident"}


@dataclasses.dataclass
class Recommendation:
    """``best``: the cheapest accepted summary row (None if none passed); ``table``: every row, accepted
    ones first by cost, then rejected ones by error, each with ``accepted`` and ``reason``;
    ``rejected``: scheme string → why it failed; ``result``: the underlying :class:`DriftResult`."""

    best: Optional[dict]
    table: Summary
    rejected: dict
    tolerance: float
    objective: str
    result: DriftResult

    def __str__(self) -> str:
        cost = OBJECTIVES[self.objective]
        cols = ["scheme", cost, "p99_error", "growth_exponent", "stagnated_fraction", "accepted", "reason"]
        head = (f"Recommended ({self.objective}, tolerance {self.tolerance:g}): "
                + (f"{self.best['scheme']} — {self.best[cost]:.3g} bytes per state element, "
                   f"p99 error {self.best['p99_error']:.3g}" if self.best else "none of the candidates"))
        return head + "\n\n" + self.table.markdown(cols)


def _check_tolerance(tolerance) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance: expected a number > 0, got {type(tolerance).__name__}")
    if math.isnan(tolerance) or tolerance <= 0:
        raise ValueError(f"tolerance: expected a number > 0, got {tolerance}")
    return float(tolerance)


def _reason(row: dict, result: DriftResult, j: int, tolerance: float) -> str:
    if row["failed_at"] is not None:
        return f"failed at step {row['failed_at']} (output overflowed or turned NaN)"
    errors = result.output_error[j]
    over = (errors >= tolerance).any(axis=1).nonzero()[0]
    step = int(result.recorded_steps[over[0]]) if len(over) else None
    text = f"p99 error {row['p99_error']:.3g} ≥ tolerance {tolerance:g}"
    if step is not None:
        text += f" (first recorded step with a head over: {step})"
    if row["stagnated_fraction"]:
        text += f"; {row['stagnated_fraction']:.0%} of heads stagnate"
    return text


def recommend(
    profile,
    tolerance: float,
    *,
    steps: int = 4096,
    objective: str = "traffic",
    candidates: Union[None, str, Sequence] = None,
    device: str = "cpu",
    heads: Union[int, Sequence[int]] = 8,
    batch: int = 1,
    seed: int = 0,
    every: Optional[int] = None,
    progress: Optional[bool] = None,
) -> Recommendation:
    """Simulate ``candidates`` (default :func:`candidate_schemes`, 72 schemes) for ``steps`` tokens on
    ``heads`` heads spanning the decay range, keep those whose ``p99_error`` (the p99 over heads of
    each head's largest output error over every step, so every position of a replay ring's cycle
    counts) is under ``tolerance``, and return the cheapest by ``objective`` ("traffic": bytes per
    step; "memory": bytes held). ``steps`` must hold one whole cycle of every ring length
    (:func:`qstate.analysis.drift.measurement_cycle`: 32 for the default candidates)."""
    tolerance = _check_tolerance(tolerance)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {sorted(OBJECTIVES)}, got {objective!r}")
    profile = _profiles.get(profile)
    schemes = candidate_schemes() if candidates is None else parse_schemes(candidates)
    every = max(1, steps // 256) if every is None else every
    result = simulate(profile, schemes, steps, batch=batch, heads=heads, seed=seed, device=device, every=every,
                      progress=progress)
    return rank(result, tolerance, objective)


def rank(result: DriftResult, tolerance: float, objective: str = "traffic") -> Recommendation:
    """Rank the schemes of a finished drift run (what :func:`recommend` does after simulating): another
    tolerance or objective needs no new simulation."""
    tolerance = _check_tolerance(tolerance)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {sorted(OBJECTIVES)}, got {objective!r}")
    cost = OBJECTIVES[objective]
    accepted, rejected_rows, rejected = [], [], {}
    for j, row in enumerate(result.summary()):
        ok = row["failed_at"] is None and row["p99_error"] < tolerance
        row["accepted"] = ok
        row["reason"] = "within tolerance" if ok else _reason(row, result, j, tolerance)
        (accepted if ok else rejected_rows).append(row)
        if not ok:
            rejected[row["scheme"]] = row["reason"]
    accepted.sort(key=lambda r: (r[cost], r["p99_error"]))
    rejected_rows.sort(key=lambda r: (r["failed_at"] is not None, r["p99_error"] or math.inf))
    return Recommendation(accepted[0] if accepted else None, Summary(accepted + rejected_rows), rejected,
                          tolerance, objective, result)
