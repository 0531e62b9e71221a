"""The parts of the drift report that are particular to delta-rule layers: theory beside measurement
(:mod:`analysis.theory_delta`) and the checkpoint error of replay schemes."""

from __future__ import annotations

import numpy as np

from . import theory_delta
from .drift import DriftResult
from .plots import measured_vs_predicted_table

__all__ = ["theory_table", "checkpoint_section"]


def theory_table(result: DriftResult) -> str:
    """Markdown: per scheme and decay class, measured against predicted rms output error over every
    step of the whole measurement cycles in the second half of the run (heads of the class pooled,
    :func:`theory_delta.measured_vs_predicted`); ``*`` marks classes where the theory's assumptions
    hold for every head."""
    heads = theory_delta.head_parameters(result.profile, result.heads, result.seed)
    lines = measured_vs_predicted_table(result, lambda j: theory_delta.measured_vs_predicted(result, j, heads))
    rho = ", ".join(f"{h.effective_decay():.3f}" for h in heads)
    return "\n".join(lines) + f"\n\nKey contraction ρ of the simulated heads (theory): {rho}."


def _record_at(result: DriftResult, step: int) -> int:
    """Index of the first recorded step at or after ``step`` (the last one if none is)."""
    return min(int(np.searchsorted(result.recorded_steps, step)), len(result.recorded_steps) - 1)


def checkpoint_section(result: DriftResult) -> list[str]:
    """Markdown lines: checkpoint error of each replay scheme after its first flush, at a quarter of
    the run and at the end, measured (rms over heads) beside the theory."""
    replay = [j for j, s in enumerate(result.schemes) if s.is_replay and str(s) not in result.failed_at]
    if not replay:
        return []
    heads = theory_delta.head_parameters(result.profile, result.heads, result.seed)
    lines = ["## Checkpoint error", "",
             "‖S_c − S‖/‖S‖ of the last stored checkpoint against the exact state of the step it was stored at "
             "(rms over heads), measured / predicted, after the first flush, at a quarter of the run and at the "
             "end. A `corrected` ring writes part of each read-copy error into the checkpoint at every flush; "
             "an `inputs` ring keeps the checkpoint within its storage rounding.", "",
             "| scheme | flushes | first flush | quarter | end |", "|---|---|---|---|---|"]
    for j in replay:
        scheme = result.schemes[j]
        L = scheme.ring_len
        marks = [L, max(L, (result.steps // 4) // L * L), result.steps // L * L]
        if marks[-1] < L:
            continue
        curve = result.checkpoint_curve(j)
        preds = [theory_delta.predict(scheme, h, result.steps, V=result.profile.head_v_dim) for h in heads]
        cells = []
        for step in marks:
            r = _record_at(result, step)
            predicted = np.sqrt(np.mean([p.checkpoint_error[result.recorded_steps[r] - 1] ** 2 for p in preds]))
            cells.append(f"{curve[r]:.2e} / {predicted:.2e}")
        lines.append(f"| {scheme} | {result.steps // L} | " + " | ".join(cells) + " |")
    return lines + [""]
