"""Figures of a drift run (matplotlib, headless)."""

from __future__ import annotations

import numpy as np

__all__ = ["DECAY_CLASSES", "decay_class", "final_by_class", "measured_vs_predicted_table", "plot_drift"]

# Edges of the decay classes (typical a = exp(dt·A) of a head): short memory … long memory.
DECAY_CLASSES = ((0.0, 0.9, "a < 0.9"), (0.9, 0.99, "0.9 ≤ a < 0.99"), (0.99, 0.999, "0.99 ≤ a < 0.999"),
                 (0.999, 1.0, "a ≥ 0.999"))


def decay_class(decay) -> np.ndarray:
    """Index into :data:`DECAY_CLASSES` of each decay."""
    decay = np.asarray(decay)
    return np.searchsorted([hi for _, hi, _ in DECAY_CLASSES[:-1]], decay, side="right")


def measured_vs_predicted_table(result, measure) -> list[str]:
    """Markdown rows: per scheme and decay class present, the rms over the class's heads of the
    measured and the predicted output error. ``measure(j)`` gives scheme j's ``(measured,
    predicted, predictions)`` per head: ``*`` marks a class where every head's prediction
    ``applies``; a prediction that ``stagnates`` (where it has the field) is counted as a
    dead-band head. A failed scheme's cells read "failed"."""
    classes = decay_class(result.decay)
    present = [c for c in range(len(DECAY_CLASSES)) if np.any(classes == c)]
    header = "| scheme | " + " | ".join(f"{DECAY_CLASSES[c][2]}: measured / predicted" for c in present) + " |"
    lines = [header, "|" + "---|" * (len(present) + 1)]
    for j, scheme in enumerate(result.schemes):
        if str(scheme) in result.failed_at:
            lines.append(f"| {scheme} | " + " | ".join("failed" for _ in present) + " |")
            continue
        measured, predicted, preds = measure(j)
        cells = []
        for c in present:
            sel = classes == c
            members = np.nonzero(sel)[0]
            m, p = np.sqrt(np.mean(measured[sel] ** 2)), np.sqrt(np.mean(predicted[sel] ** 2))
            mark = "*" if all(preds[h].applies for h in members) else ""
            stag = sum(getattr(preds[h], "stagnates", False) for h in members)
            note = f" (dead band: {stag}/{len(members)} heads)" if stag else ""
            cells.append(f"{m:.2e} / {p:.2e}{mark}{note}")
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return lines


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def final_by_class(result, j: int) -> np.ndarray:
    """Per class of :data:`DECAY_CLASSES`: RMS over the class's heads of each head's RMS output error
    over the last measurement cycle (NaN for a class without heads)."""
    final = result.cycle_error[j][-1]
    classes = decay_class(result.decay)
    return np.array([np.sqrt(np.mean(final[classes == c] ** 2)) if np.any(classes == c) else np.nan
                     for c in range(len(DECAY_CLASSES))])


def plot_drift(result, path) -> None:
    """Left: per measurement cycle, the RMS output error over the cycle's steps and the heads, at the
    cycle's middle step. Right: :func:`final_by_class`. Both cover whole ring cycles."""
    plt = _pyplot()
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(13, 5))
    steps = result.cycle_middles
    width = 0.8 / max(1, len(result.schemes))
    for j, scheme in enumerate(result.schemes):
        if str(scheme) in result.failed_at:
            continue
        curve = result.cycle_curve(j)
        ok = np.isfinite(curve) & (curve > 0)
        ax_t.loglog(steps[ok], curve[ok], label=str(scheme))
        ax_h.bar(np.arange(len(DECAY_CLASSES)) + j * width, final_by_class(result, j), width=width,
                 label=str(scheme))
    first, last = result.final_window()
    ax_t.set_xlabel(f"decode step (middle of each {result.cycle}-step cycle)")
    ax_t.set_ylabel(f"relative output error (RMS over each {result.cycle}-step cycle and the heads)")
    ax_t.set_title(f"{result.profile.name}: error against step")
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_h.set_yscale("log")
    ax_h.set_xticks(np.arange(len(DECAY_CLASSES)) + 0.4 - width / 2)
    ax_h.set_xticklabels([label for _, _, label in DECAY_CLASSES])
    ax_h.set_ylabel(f"relative output error (RMS over steps {first}–{last}, heads of the class)")
    ax_h.set_title("error over the last cycle by head decay class")
    ax_h.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
