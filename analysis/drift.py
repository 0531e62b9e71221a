"""Drift of storage schemes against the exact recurrence: :func:`simulate` and :class:`DriftResult`.

Measures (per scheme, recorded step and head; definitions in ``analysis/README.md``):

* output error ``‖y − y_ref‖ / ‖y_ref‖`` (norms over batch × headdim), at the recorded steps;
* cycle error: each head's RMS output error over every step of a measurement cycle (``cycle``
  steps, whole ring cycles of every replay scheme: :func:`measurement_cycle`). A replay output's
  error depends on where the step stands in its ring's cycle (the flushing token reads no read
  copy), so every summary figure and curve of the run covers whole cycles;
* state error ``‖S − S_ref‖ / ‖S_ref‖`` (over batch × headdim × dstate; for replay the state the
  checkpoint and ring stand for);
* stalled fraction: the share of stored elements whose code (the grid value before the scale
  multiply; for unscaled formats the value) a step left unchanged (conventional), or a flush left
  unchanged in the checkpoint (replay). A head is *stagnated* when its mean stalled fraction over
  the second half of the recorded steps exceeds one half (round to nearest only: stochastic
  rounding leaves codes in place without bias).

A scheme whose outputs turn NaN or infinite is marked failed at the first step where that is
seen (every step is checked); its numbers are then NaN and its summary row says ``failed``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Optional, Sequence, Union

import numpy as np
import torch

from qstate import _validate
from qstate import profiles as _profiles
from qstate.reference import process_dt

from .engine import Conventional, Exact, ReplayGroup, StepInputs
from .schemes import parse_schemes

__all__ = ["simulate", "measurement_cycle", "OutputErrors", "DriftResult", "Summary", "STAGNATION_THRESHOLD",
           "DEFAULT_CYCLE"]

STAGNATION_THRESHOLD = 0.5
DEFAULT_CYCLE = 16  # the measurement cycle of a run without replay schemes: the default ring length
_CHUNK_ELEMENTS = 1 << 22  # doubles of x drawn per input chunk (all heads of the model)


def _chunk_seed(seed: int, k: int) -> int:
    return (seed * 1_000_003 + k * 7_919) % (2**63)


def _input_chunks(profile, steps, batch, heads, seed, inputs):
    """Time slices of the decode inputs. Sampled chunk by chunk so memory stays bounded: chunk 0
    is ``profile.sample_inputs(..., seed=seed)`` (so short runs see exactly those inputs), later
    chunks use derived seeds and the head parameters (A, D, dt_bias) of chunk 0."""
    if inputs is not None:
        chunk = max(1, _CHUNK_ELEMENTS // max(1, inputs.x[0].numel()))
        for start in range(0, steps, chunk):
            sl = slice(start, min(steps, start + chunk))
            yield dataclasses.replace(inputs, x=inputs.x[sl], dt=inputs.dt[sl], B=inputs.B[sl], C=inputs.C[sl],
                                      z=None if inputs.z is None else inputs.z[sl])
        return
    chunk = max(1, _CHUNK_ELEMENTS // (batch * profile.nheads * profile.headdim))
    first = None
    for k, start in enumerate(range(0, steps, chunk)):
        n = min(chunk, steps - start)
        part = profile.sample_inputs(n, batch, heads=heads, seed=seed if k == 0 else _chunk_seed(seed, k))
        if first is None:
            first = part
        else:
            part = dataclasses.replace(part, A=first.A, D=first.D, dt_bias=first.dt_bias, heads=first.heads)
        yield part


def recorded_steps(steps: int, every: int) -> list[int]:
    """About every ``every``-th step and the last: the k-th record (k = 1, 2, …) is at step
    ``k·every − (k − 1) mod every``, so successive records fall on every residue modulo
    ``every``. Every k-th step exactly would meet a replay ring of a length dividing ``every`` at
    the same position of its cycle each time (the flushing token, whose output reads no read
    copy), and hide the read copy's error."""
    recorded = [k * every - (k - 1) % every for k in range(1, steps // every + 1)]
    if not recorded or recorded[-1] != steps:
        recorded.append(steps)
    return recorded


def measurement_cycle(schemes, steps: int) -> int:
    """Steps in one measurement cycle of a run: the least common multiple of its replay schemes'
    ring lengths, so that any ``cycle`` consecutive steps hold every position of every ring's cycle
    equally often; every scheme of the run, conventional ones included, is measured over the same
    cycles. A run without replay schemes uses ``min(DEFAULT_CYCLE, steps)``."""
    _validate.positive_int("steps", steps)
    rings = sorted({s.ring_len for s in parse_schemes(schemes) if s.is_replay})
    if not rings:
        return min(DEFAULT_CYCLE, steps)
    cycle = math.lcm(*rings)
    if cycle > steps:
        whole = (f"one whole cycle of the ring of {cycle}" if len(rings) == 1 else
                 f"one whole cycle of every ring length: the least common multiple of {', '.join(map(str, rings))}")
        raise ValueError(f"steps: expected at least {cycle} ({whole}), got {steps}")
    return cycle


class OutputErrors:
    """The per-step measures every step feeds: each head's RMS output error over each measurement
    cycle (cycles end at the last step: steps ``skip+1 … skip+cycle``, … with ``skip = steps mod
    cycle``; the first ``skip`` steps fall in none) and its largest output error over every step."""

    def __init__(self, nschemes: int, nheads: int, steps: int, cycle: int, device) -> None:
        self.cycle, self.skip = cycle, steps % cycle
        self.failed_at: dict[int, int] = {}  # scheme index: first step whose output was not finite
        self.cycle_error = np.full((nschemes, steps // cycle, nheads), np.nan)
        self._cycle_sq = torch.zeros((nschemes, nheads), dtype=torch.float64, device=device)
        self._peak_sq = torch.zeros((nschemes, nheads), dtype=torch.float64, device=device)

    def measure(self, t: int, outputs: dict, y_ref: torch.Tensor) -> torch.Tensor:
        """Step ``t`` (1-based) of every scheme: ``outputs`` maps each scheme's index to its
        output ``[batch, heads, rows]``, ``y_ref`` is the exact fp64 one. Notes the schemes whose
        output is not finite, adds the step and returns ``err_sq [schemes, heads]``."""
        y_all = torch.stack([outputs[j] for j in range(len(outputs))]).double()  # [schemes, batch, heads, rows]
        bad = ~torch.isfinite(y_all).flatten(1).all(dim=1)
        if bool(bad.any()):
            for j in bad.nonzero().flatten().tolist():
                self.failed_at.setdefault(j, t)
        err_sq = (y_all - y_ref).square().sum(dim=(1, 3)) / y_ref.square().sum(dim=(0, 2))
        self.add(t, err_sq)
        return err_sq

    def add(self, t: int, err_sq: torch.Tensor) -> None:
        """Step ``t`` (1-based): ``err_sq [schemes, heads]``, the squared relative output error."""
        torch.maximum(self._peak_sq, err_sq, out=self._peak_sq)
        if t > self.skip:
            self._cycle_sq += err_sq
            if (t - self.skip) % self.cycle == 0:
                rms = (self._cycle_sq / self.cycle).sqrt()
                self.cycle_error[:, (t - self.skip) // self.cycle - 1] = rms.cpu().numpy()
                self._cycle_sq.zero_()

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """``(cycle_error [schemes, cycles, heads], peak_error [schemes, heads])``, NaN for the
        schemes in ``failed_at``."""
        peak = self._peak_sq.sqrt().cpu().numpy()
        for j in self.failed_at:
            self.cycle_error[j], peak[j] = np.nan, np.nan
        return self.cycle_error, peak


def progress_bar(total: int, enabled: Optional[bool]):
    """A tqdm bar over ``total`` steps, or None (``enabled`` None: long runs on a terminal)."""
    if enabled is None:
        enabled = total >= 2048 and sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="step", desc="drift", leave=False)


def scheme_generator(scheme, seed: int, device) -> Optional[torch.Generator]:
    """A generator seeded with ``seed`` for a scheme that rounds stochastically (its state, or a
    replay scheme's checkpoint or read copy), None for one that does not."""
    needs = scheme.fmt.stochastic if not scheme.is_replay else (
        scheme.checkpoint.stochastic or (scheme.read is not None and scheme.read.stochastic))
    return torch.Generator(device=device).manual_seed(seed) if needs else None


def _observed_parameters(inputs: _profiles.DecodeInputs, steps: int) -> tuple[list, list]:
    """Effective ``(decay, increment)`` per head over the dt a run took, as
    :func:`qstate.analysis.theory.head_parameters` defines them for the profile's sampling model:
    ``a_eff² = E[a_t²]``, ``u² = E[dt²]``."""
    dt = process_dt(inputs.dt[:steps].double(), inputs.dt_bias, inputs.dt_softplus)  # [T, batch, heads]
    a2 = torch.exp(2 * dt * inputs.A.double()).mean(dim=(0, 1))
    return a2.sqrt().tolist(), dt.square().mean(dim=(0, 1)).sqrt().tolist()


def simulate(
    profile,
    schemes,
    steps: int,
    *,
    batch: int = 4,
    heads: Union[None, int, Sequence[int]] = None,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    every: int = 1,
    inputs: Optional[_profiles.DecodeInputs] = None,
    progress: Optional[bool] = None,
) -> "DriftResult":
    """Run every scheme and the exact fp64 recurrence on identical inputs for ``steps`` tokens.

    ``profile``: a :class:`qstate.profiles.Profile` or its name. ``schemes``: Schemes or their
    strings (a comma-separated string works). ``heads``: None (all heads), an int k (k heads
    spanning the decay range) or head indices. ``every``: record about every ``every``-th step,
    staggered over the residues modulo ``every`` (:func:`recorded_steps`), and the last.
    ``inputs``: explicit :class:`DecodeInputs` (time length ≥ ``steps``) instead of sampling
    from the profile (``batch``, ``heads`` and ``seed`` then only name the run).
    Stochastic schemes draw their noise from generators seeded with ``seed`` (one per scheme).
    A delta-rule profile (family ``gated_delta``) runs :func:`analysis.drift_delta.simulate_delta`.
    """
    profile = _profiles.get(profile)
    if profile.family == "gated_delta":
        from .drift_delta import simulate_delta

        return simulate_delta(profile, schemes, steps, batch=batch, heads=heads, seed=seed, device=device,
                              every=every, inputs=inputs, progress=progress)
    scheme_list = parse_schemes(schemes)
    corrected = [str(s) for s in scheme_list if s.is_replay and s.ring == "corrected"]
    if corrected:
        raise ValueError(f"schemes: a corrected-value ring exists for delta-rule layers only; a Mamba-2 ring holds "
                         f"the inputs, got {corrected[0]!r} for {profile.name}")
    _validate.positive_int("steps", steps)
    _validate.positive_int("every", every)
    cycle = measurement_cycle(scheme_list, steps)
    device = torch.device(device)
    if inputs is not None:
        if not isinstance(inputs, _profiles.DecodeInputs):
            raise TypeError(f"inputs: expected a DecodeInputs, got {type(inputs).__name__}")
        if inputs.x.shape[0] < steps:
            raise ValueError(f"steps: expected at most the {inputs.x.shape[0]} steps of inputs, got {steps}")
        batch, head_list = inputs.x.shape[1], [int(h) for h in inputs.heads]
        state0 = inputs.state0
        decay = inputs.decay()
    else:
        _validate.positive_int("batch", batch)
        head_list = profile._resolve_heads(heads, seed)
        state0 = None
        decay = None

    recorded = recorded_steps(steps, every)
    record_index = {t: r for r, t in enumerate(recorded)}
    nrec, nh, ns = len(recorded), len(head_list), len(scheme_list)
    out_err = np.full((ns, nrec, nh), np.nan)
    state_err = np.full((ns, nrec, nh), np.nan)
    stalled = np.full((ns, nrec, nh), np.nan)
    errors = OutputErrors(ns, nh, steps, cycle, device)

    conv_idx = [j for j, s in enumerate(scheme_list) if not s.is_replay]
    ring_lens = sorted({s.ring_len for s in scheme_list if s.is_replay})
    group_idx = {L: [j for j, s in enumerate(scheme_list) if s.is_replay and s.ring_len == L] for L in ring_lens}

    def generator(j):
        return scheme_generator(scheme_list[j], seed + j, device)

    exact = conv = groups = None
    bar = progress_bar(steps, progress)
    start_time = time.perf_counter()
    t = 0
    for chunk in _input_chunks(profile, steps, batch, head_list, seed, inputs):
        if exact is None:
            if decay is None:
                decay = chunk.decay()
            s0 = (chunk.state0 if state0 is None else state0).to(device)
            exact = Exact(s0)
            conv = {j: Conventional(scheme_list[j], s0, generator(j)) for j in conv_idx}
            groups = {L: ReplayGroup([scheme_list[j] for j in idx], s0, [generator(j) for j in idx])
                      for L, idx in group_idx.items()}
            outer32 = torch.empty(s0.shape, dtype=torch.float32, device=device)
        s = StepInputs.build(chunk, device)
        for i in range(chunk.x.shape[0]):
            t += 1
            r = record_index.get(t)
            y_ref = exact.step(s, i)
            outputs = {}
            if conv:
                torch.mul(s.dx32[i][..., None], s.B32[i][..., None, :], out=outer32)
                keep_codes = r is not None or t + 1 in record_index  # a stall compares two steps' codes
                for j, c in conv.items():
                    outputs[j] = c.step(s, i, outer32, keep_codes)
            for L, g in groups.items():
                ys = g.step(s, i, exact.state)
                for k, j in enumerate(group_idx[L]):
                    outputs[j] = ys[k]
            err_sq = errors.measure(t, outputs, y_ref)
            if r is not None:
                out_err[:, r] = err_sq.sqrt().cpu().numpy()
                exact_norm = exact.state.square().sum(dim=(0, 2, 3)).sqrt()
                for j, c in conv.items():
                    state_err[j, r] = (c.state_error_sq(exact.state).sqrt() / exact_norm).cpu().numpy()
                    stalled[j, r] = c.stalled().cpu().numpy()
                for L, g in groups.items():
                    se = (g.state_error_sq().sqrt() / exact_norm).cpu().numpy()
                    st = g.stall.cpu().numpy()
                    for k, j in enumerate(group_idx[L]):
                        state_err[j, r], stalled[j, r] = se[k], st[k]
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start_time
    for j in errors.failed_at:
        out_err[j], state_err[j], stalled[j] = np.nan, np.nan, np.nan
    cycle_err, peak = errors.finish()
    elements = batch * nh * profile.headdim * profile.dstate
    return DriftResult(
        profile=profile, schemes=scheme_list, heads=head_list, decay=[float(d) for d in decay],
        steps=steps, batch=batch, seed=seed, every=every, recorded_steps=np.array(recorded),
        output_error=out_err, state_error=state_err, stalled=stalled, cycle=cycle, cycle_error=cycle_err,
        peak_error=peak,
        failed_at={str(scheme_list[j]): step for j, step in errors.failed_at.items()},
        elapsed_s=elapsed, element_steps=float(elements) * steps,
        observed_parameters=None if inputs is None else _observed_parameters(inputs, steps),
    )


class Summary(list):
    """Rows (dicts) of :meth:`DriftResult.summary`; ``str()`` gives a markdown table."""

    columns = ("scheme", "bytes_per_step", "bytes_resident", "final_error", "max_error", "p99_error",
               "growth_exponent", "stagnated_fraction", "failed_at")

    def markdown(self, columns: Optional[Sequence[str]] = None) -> str:
        columns = list(columns or self.columns)

        def cell(v):
            if v is None:
                return "—"
            if isinstance(v, float):
                if math.isnan(v):
                    return "—"
                return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"
            return str(v)

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in self]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.markdown()

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return Summary(item) if isinstance(index, slice) else item


def profile_shape(profile) -> dict:
    """The profile's name, family and layer shape, as the JSON of a drift run gives them."""
    if profile.family == "gated_delta":
        return {"name": profile.name, "family": profile.family, "num_k_heads": profile.num_k_heads,
                "num_v_heads": profile.num_v_heads, "head_k_dim": profile.head_k_dim,
                "head_v_dim": profile.head_v_dim, "gate": profile.gate, "gate_form": profile.gate_form}
    return {"name": profile.name, "family": profile.family, "nheads": profile.nheads, "headdim": profile.headdim,
            "dstate": profile.dstate, "ngroups": profile.ngroups}


def _rounds_stochastically(scheme) -> bool:
    """Whether the stored state the stalled fraction looks at (the state, or the checkpoint) uses
    stochastic rounding."""
    return (scheme.checkpoint if scheme.is_replay else scheme.fmt).stochastic


def _growth_exponent(steps: np.ndarray, err: np.ndarray, total: int) -> float:
    """Slope of log(error) against log(step) over the points at steps ≥ total/2 (scipy linregress)."""
    from scipy import stats

    half = steps >= total / 2
    x, y = np.log(steps[half]), err[half]
    ok = np.isfinite(y) & (y > 0)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0:
        return float("nan")
    return float(stats.linregress(x[ok], np.log(y[ok])).slope)


@dataclasses.dataclass
class DriftResult:
    """What :func:`simulate` measured. ``output_error``, ``state_error``, ``stalled``:
    ``[scheme, recorded step, head]``; ``cycle_error``: ``[scheme, cycle, head]``, each head's RMS
    output error over the ``cycle`` steps of each measurement cycle (the last ends at the last step);
    ``peak_error``: ``[scheme, head]``, each head's largest output error over every step."""

    profile: _profiles.Profile
    schemes: list
    heads: list
    decay: list  # typical decay exp(softplus(dt_bias)·A) per head
    steps: int
    batch: int
    seed: int
    every: int
    recorded_steps: np.ndarray
    output_error: np.ndarray
    state_error: np.ndarray
    stalled: np.ndarray
    cycle: int
    cycle_error: np.ndarray
    peak_error: np.ndarray  # [scheme, head]: the largest output error over every step
    failed_at: dict
    elapsed_s: float
    element_steps: float  # state elements × steps, per scheme
    # (decay, increment) per head of explicit inputs, as the theory takes them; None for inputs
    # sampled from the profile, whose parameters the profile's sampling model gives
    observed_parameters: Optional[tuple] = None

    @property
    def cycle_steps(self) -> np.ndarray:
        """The last step of each measurement cycle; cycle ``c`` covers ``cycle_steps[c] − cycle + 1 …
        cycle_steps[c]``."""
        n = self.cycle_error.shape[1]
        return self.steps - self.cycle * np.arange(n - 1, -1, -1)

    @property
    def cycle_middles(self) -> np.ndarray:
        """The middle step of each measurement cycle (where curves plot it)."""
        return self.cycle_steps - (self.cycle - 1) / 2

    def cycle_curve(self, j: int) -> np.ndarray:
        """Output error of scheme ``j`` per measurement cycle: RMS over the cycle's steps and the heads."""
        return np.sqrt(np.mean(self.cycle_error[j] ** 2, axis=1))

    def second_half_cycles(self) -> np.ndarray:
        """Mask of the measurement cycles that start at step ≥ T/2 (the last cycle when none does):
        what the theory table compares (:func:`qstate.analysis.theory.measured_vs_predicted`)."""
        chosen = self.cycle_steps - self.cycle + 1 >= self.steps / 2
        if not chosen.any():
            chosen[-1] = True
        return chosen

    def final_window(self) -> tuple[int, int]:
        """First and last step of the last measurement cycle, which ``final_error`` covers."""
        return self.steps - self.cycle + 1, self.steps

    def stagnated(self, j: int) -> np.ndarray:
        """Per head: mean stalled fraction over the second half of the recorded steps > 1/2, for
        round to nearest. A code that stochastic rounding leaves in place moves on a later step
        with the probability that keeps the state unbiased, so it never counts as stagnation."""
        if _rounds_stochastically(self.schemes[j]):
            return np.zeros(len(self.heads), dtype=bool)
        half = self.recorded_steps >= self.recorded_steps[-1] / 2
        return np.nanmean(self.stalled[j][half], axis=0) > STAGNATION_THRESHOLD

    def row(self, j: int) -> dict:
        scheme = self.schemes[j]
        row = {
            "scheme": str(scheme),
            "bytes_per_step": scheme.bytes_per_step(self.profile),
            "bytes_resident": scheme.bytes_resident(self.profile),
            "failed_at": self.failed_at.get(str(scheme)),
        }
        if row["failed_at"] is not None:
            row.update(final_error=None, max_error=None, p99_error=None, growth_exponent=None,
                       stagnated_fraction=None)
            return row
        per_head_max = self.peak_error[j]
        row.update(
            final_error=float(np.quantile(self.cycle_error[j][-1], 0.99)),
            max_error=float(np.max(per_head_max)),
            p99_error=float(np.quantile(per_head_max, 0.99)),
            growth_exponent=_growth_exponent(self.cycle_middles, self.cycle_curve(j), self.steps),
            stagnated_fraction=float(np.mean(self.stagnated(j))),
        )
        return row

    def summary(self) -> Summary:
        """One row per scheme: ``scheme``, ``bytes_per_step``, ``bytes_resident``, ``final_error``,
        ``max_error``, ``p99_error``, ``growth_exponent``, ``stagnated_fraction``, ``failed_at``
        (step, or None); :meth:`measures` says what each covers."""
        return Summary(self.row(j) for j in range(len(self.schemes)))

    def measures(self) -> dict:
        """What each summary figure and array of this run covers, field → sentence (the report's
        text and the ``measures`` entry of the JSON)."""
        first, last = self.final_window()
        rings = sorted({s.ring_len for s in self.schemes if s.is_replay})
        if len(rings) > 1:
            cycle = (f"{self.cycle} steps (whole cycles of every ring length: the least common multiple of "
                     f"{', '.join(map(str, rings))})")
        else:
            cycle = f"{self.cycle} steps (" + (f"one cycle of the ring of {rings[0]}" if rings else
                                               "no replay scheme in the run") + ")"
        skip = self.steps - self.cycle * self.cycle_error.shape[1]
        return {
            "output_error": "relative output error ‖y − y_ref‖/‖y_ref‖ (norms over batch × headdim) of one step, "
                            f"per head, at recorded_steps: about every {self.every}th step, staggered so that the "
                            "records visit every position of a ring's cycle, and the last step",
            "cycle": f"a measurement cycle is {cycle}; every scheme is measured over the same cycles",
            "cycle_error": "per head, the RMS of the output error over every step of a measurement cycle (recorded "
                           "or not); cycle c covers steps cycle_steps[c] − cycle + 1 … cycle_steps[c], the last "
                           f"ending at step {self.steps}" + (f"; steps 1–{skip} fall in no cycle" if skip else ""),
            "final_error": f"p99 over heads of each head's RMS output error over the last cycle, steps "
                           f"{first}–{last}",
            "peak_error": "per head, the largest output error over every step of the run (recorded or not)",
            "max_error": "the largest output error over heads and every step of the run",
            "p99_error": "p99 over heads of each head's largest output error over every step of the run (the "
                         "chooser's test against the tolerance)",
            "growth_exponent": "slope of log(per-cycle RMS error, RMS over heads) against log(middle step of the "
                               f"cycle) over the cycles whose middle is at step ≥ {self.steps / 2:g}",
            "stagnated_fraction": "share of heads whose mean stalled fraction over the recorded steps of the second "
                                  f"half exceeds {STAGNATION_THRESHOLD:g} (round to nearest only)",
            "bytes_per_step": "HBM bytes of one decode step per state element (ring and scales included)",
            "bytes_resident": "bytes held per state element",
        }

    def element_steps_per_second(self) -> float:
        """State element-steps per second of the whole run, summed over schemes."""
        return self.element_steps * len(self.schemes) / max(self.elapsed_s, 1e-12)

    def to_dict(self) -> dict:
        def clean(a):
            return [[[None if not np.isfinite(v) else float(v) for v in row] for row in m] for m in a]

        return {
            "profile": profile_shape(self.profile),
            "schemes": [str(s) for s in self.schemes],
            "heads": self.heads, "decay": self.decay, "steps": self.steps, "batch": self.batch,
            "seed": self.seed, "every": self.every, "recorded_steps": self.recorded_steps.tolist(),
            "cycle": self.cycle, "cycle_steps": self.cycle_steps.tolist(),
            "measures": self.measures(),
            "summary": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                        for row in self.summary()],
            "output_error": clean(self.output_error), "state_error": clean(self.state_error),
            "stalled": clean(self.stalled), "cycle_error": clean(self.cycle_error),
            "peak_error": [[None if not np.isfinite(v) else float(v) for v in row] for row in self.peak_error],
            "failed_at": self.failed_at,
            "elapsed_s": self.elapsed_s, "element_steps": self.element_steps,
        }

    def to_json(self, path: Union[str, os.PathLike]) -> None:
        """Write everything (summary, what each figure covers, the per step and per cycle arrays) as JSON;
        fields in ``analysis/README.md``."""
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh)

    def plot(self, path: Union[str, os.PathLike]) -> None:
        """Per-cycle RMS error against step (log–log, RMS over heads) per scheme, and the RMS error over
        the last cycle by decay class."""
        from .plots import plot_drift

        plot_drift(self, path)
