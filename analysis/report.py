"""The drift report: ``report.md`` with the summary, theory beside measurement, and figures."""

from __future__ import annotations

import os
from typing import Union

import numpy as np

from . import theory
from .drift import DriftResult
from .plots import measured_vs_predicted_table

__all__ = ["theory_table", "write_report"]


def theory_table(result: DriftResult) -> str:
    """Markdown: per scheme and decay class, measured against predicted rms output error over every
    step of the whole measurement cycles in the second half of the run (heads of the class pooled,
    :func:`theory.measured_vs_predicted`); ``*`` marks classes where the theory's
    assumptions hold for every head (unbiased or stochastic rounding, read copies). Heads are
    predicted with the parameters of the dt the run took when it was given explicit inputs, else
    with the profile's sampling model. Delta-rule runs: :func:`analysis.report_delta.theory_table`."""
    if result.profile.family == "gated_delta":
        from .report_delta import theory_table as delta_table

        return delta_table(result)
    if result.observed_parameters is not None:
        decays, increments = (np.asarray(v) for v in result.observed_parameters)
    else:
        sample = result.profile.sample_inputs(1, 1, heads=result.heads, seed=result.seed)
        decays, increments = theory.head_parameters(sample)
    lines = measured_vs_predicted_table(
        result, lambda j: theory.measured_vs_predicted(result, j, increments, decays))
    return "\n".join(lines)


def _stagnation_lines(result: DriftResult) -> list[str]:
    lines = []
    for j, scheme in enumerate(result.schemes):
        if str(scheme) in result.failed_at:
            continue
        flags = result.stagnated(j)
        if flags.any():
            heads = ", ".join(f"{result.heads[h]} (a = {result.decay[h]:.4f})" for h in np.nonzero(flags)[0])
            lines.append(f"- `{scheme}`: {int(flags.sum())} of {len(flags)} heads stagnate: {heads}")
    return lines or ["- no scheme stagnates on these heads"]


def _shape_text(p) -> str:
    if p.family == "gated_delta":
        return (f"Delta-rule layer ({p.gate} gate, {p.gate_form}): {p.num_k_heads} key heads × {p.head_k_dim} K, "
                f"{p.num_v_heads} value heads × {p.head_v_dim} V.")
    return f"Layer shape {p.nheads} heads × {p.headdim} headdim × {p.dstate} dstate, {p.ngroups} groups."


def _family_sections(result: DriftResult) -> list[str]:
    if result.profile.family != "gated_delta":
        return []
    from .report_delta import checkpoint_section

    return checkpoint_section(result)


def _second_half_span(result: DriftResult) -> str:
    ends = result.cycle_steps[result.second_half_cycles()]
    return f"{ends[0] - result.cycle + 1}–{ends[-1]}"


def _measure_lines(result: DriftResult) -> list[str]:
    measures = result.measures()
    fields = ["cycle", *(c for c in result.summary().columns if c in measures)]
    return [f"- `{name}`: {measures[name]}." for name in fields]


def _figure_lines(result: DriftResult, plot: bool) -> list[str]:
    if not plot:
        return ["(plot skipped: matplotlib is not installed)"]
    first, last = result.final_window()
    return ["![per-cycle error against step and error over the last cycle by decay class](drift.png)", "",
            f"Left: per {result.cycle}-step measurement cycle, the RMS output error over the cycle's steps and "
            "the heads, plotted at the cycle's middle step. Right: per class of head decay, the RMS over the "
            f"class's heads of each head's RMS error over the last cycle (steps {first}–{last}), as in "
            "`final_error`."]


def write_report(result: DriftResult, out_dir: Union[str, os.PathLike], command: str = "", plot: bool = True) -> str:
    """Write ``report.md``, ``drift.json`` and (with ``plot``; it needs matplotlib) ``drift.png``
    into ``out_dir``, the figure last; returns the report path."""
    os.makedirs(out_dir, exist_ok=True)
    result.to_json(os.path.join(out_dir, "drift.json"))
    p = result.profile
    failed = [f"- `{s}` failed at step {t} (output overflowed or turned NaN)" for s, t in result.failed_at.items()]
    text = [
        f"# Drift report: {p.name}",
        "",
        f"{_shape_text(p)} Simulated {len(result.heads)} heads spanning the decay range (heads {result.heads}), batch "
        f"{result.batch}, {result.steps} decode steps from a zero state, seed {result.seed}, recorded every "
        f"{result.every} steps; {result.elapsed_s:.1f} s "
        f"({result.element_steps_per_second():.3g} state element-steps/s over all schemes).",
        "",
        f"Command: `{command}`" if command else "",
        "",
        "## Summary",
        "",
        "Errors are relative output errors ‖y − y_ref‖/‖y_ref‖ against the exact fp64 recurrence. A replay "
        "output's error depends on where its step stands in the ring's cycle (the flushing token reads no "
        "read copy), so the figures cover whole cycles. What each covers:",
        "",
        *_measure_lines(result),
        "",
        result.summary().markdown(),
        "",
        *failed,
        "",
        *_figure_lines(result, plot),
        "",
        "## Theory beside measurement",
        "",
        f"RMS relative output error over every step of steps {_second_half_span(result)} (whole measurement "
        "cycles), per class of head decay, measured and predicted over the same steps (derivations in "
        "`analysis/README.md`). `*`: the theory's assumptions hold for every head of the "
        "class; elsewhere round-to-nearest sits in or near its dead band and the formula is only a guide.",
        "",
        theory_table(result),
        "",
        "## Stagnation",
        "",
        *_stagnation_lines(result),
        "",
        *_family_sections(result),
    ]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as fh:
        fh.write("\n".join(text))
    if plot:
        result.plot(os.path.join(out_dir, "drift.png"))
    return path
