"""Drift of storage schemes on gated delta rule layers (GDN and KDA): :func:`simulate_delta`.

:func:`analysis.drift.simulate` hands delta-rule profiles here; the result is a
:class:`DeltaDriftResult`, a :class:`analysis.drift.DriftResult` (same summary, report, plots and
JSON) with one more measure: the checkpoint error of replay schemes, ``‖S_c − S‖ / ‖S‖`` of the
last stored checkpoint against the exact state of the step it was stored at (per recorded step
and head; NaN for naive schemes). It shows what a corrected-value ring leaks into the checkpoint.

Measures otherwise as :mod:`analysis.drift`: output error ``‖o − o_ref‖ / ‖o_ref‖`` over batch × V
per head, at the recorded steps and as each head's RMS over every step of each measurement cycle
(whole ring cycles); state error over batch × V × K (replay: the state checkpoint and ring stand for);
stalled fraction of the stored codes (naive) or checkpoint codes at a flush (replay).

The inputs are drawn in one piece, ``profile.sample_inputs(steps, batch, heads=, seed=)``, so a
run sees exactly the inputs the reference functions get from that call.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import numpy as np
import torch

from qstate import _validate
from qstate import profiles as _profiles

from .drift import DriftResult, OutputErrors, measurement_cycle, progress_bar, recorded_steps, scheme_generator
from .engine_delta import CorrectedRingGroup, DeltaExact, DeltaNaive, DeltaStepInputs, InputRingGroup, ring_kind
from .schemes import parse_schemes

__all__ = ["simulate_delta", "DeltaDriftResult", "MAX_DRAW_BYTES"]

# The fp64 draw of q, k, v (all heads of the model, before the chosen ones are kept) of one run.
MAX_DRAW_BYTES = 6 << 30
_CHUNK_STEPS = 512  # steps preprocessed (normalised, cast, per value head) at a time


@dataclasses.dataclass
class DeltaDriftResult(DriftResult):
    """:class:`DriftResult` of a delta-rule profile, with ``checkpoint_error [scheme, recorded step, head]``."""

    checkpoint_error: Optional[np.ndarray] = None

    def checkpoint_curve(self, j: int) -> np.ndarray:
        """Checkpoint error of scheme ``j`` at each recorded step, rms over heads (NaN: naive)."""
        return np.sqrt(np.mean(self.checkpoint_error[j] ** 2, axis=1))

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["checkpoint_error"] = [[[None if not np.isfinite(v) else float(v) for v in row] for row in m]
                                   for m in self.checkpoint_error]
        return out


def _check_draw(profile, steps: int, batch: int) -> None:
    per_step = batch * (2 * profile.num_k_heads * profile.head_k_dim + profile.num_v_heads * profile.head_v_dim)
    if 8 * per_step * steps > MAX_DRAW_BYTES:
        raise ValueError(f"steps: {steps} steps of batch {batch} draw {8 * per_step * steps / 2**30:.1f} GiB of fp64 "
                         f"inputs for {profile.name}, expected at most {MAX_DRAW_BYTES / 2**30:.0f} GiB; "
                         f"give fewer steps or a smaller batch")


def simulate_delta(
    profile,
    schemes,
    steps: int,
    *,
    batch: int = 4,
    heads: Union[None, int, Sequence[int]] = None,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    every: int = 1,
    inputs: Optional[_profiles.DeltaRuleInputs] = None,
    progress: Optional[bool] = None,
) -> DeltaDriftResult:
    """Every scheme and the exact fp64 recurrence on identical inputs for ``steps`` tokens, on a
    :class:`qstate.profiles.DeltaRuleProfile`; arguments as :func:`analysis.drift.simulate`
    (``inputs``: explicit :class:`DeltaRuleInputs` with at least ``steps`` steps)."""
    profile = _profiles.get(profile)
    if profile.family != "gated_delta":
        raise ValueError(f"profile: expected a delta-rule profile (family 'gated_delta'), got {profile.name!r} "
                         f"(family {profile.family!r})")
    scheme_list = parse_schemes(schemes)
    _validate.positive_int("steps", steps)
    _validate.positive_int("every", every)
    cycle = measurement_cycle(scheme_list, steps)
    device = torch.device(device)
    if inputs is not None:
        if not isinstance(inputs, _profiles.DeltaRuleInputs):
            raise TypeError(f"inputs: expected a DeltaRuleInputs, got {type(inputs).__name__}")
        if inputs.q.shape[0] < steps:
            raise ValueError(f"steps: expected at most the {inputs.q.shape[0]} steps of inputs, got {steps}")
        if inputs.v.shape[-1] != profile.head_v_dim or inputs.k.shape[-1] != profile.head_k_dim:
            raise ValueError(f"inputs: expected K = {profile.head_k_dim}, V = {profile.head_v_dim} ({profile.name}), "
                             f"got K = {inputs.k.shape[-1]}, V = {inputs.v.shape[-1]}")
        batch = inputs.v.shape[1]
    else:
        _validate.positive_int("batch", batch)
        _check_draw(profile, steps, batch)
        inputs = profile.sample_inputs(steps, batch, heads=heads, seed=seed)
    head_list = [int(h) for h in inputs.heads]
    decay = inputs.decay()

    recorded = recorded_steps(steps, every)
    record_index = {t: r for r, t in enumerate(recorded)}
    nrec, nh, ns = len(recorded), len(head_list), len(scheme_list)
    out_err, state_err, stalled, ck_err = (np.full((ns, nrec, nh), np.nan) for _ in range(4))
    errors = OutputErrors(ns, nh, steps, cycle, device)

    def generator(j):
        return scheme_generator(scheme_list[j], seed + j, device)

    naive_idx = [j for j, s in enumerate(scheme_list) if not s.is_replay]
    keys = sorted({(s.ring_len, ring_kind(s)) for s in scheme_list if s.is_replay})
    group_idx = {key: [j for j, s in enumerate(scheme_list) if s.is_replay and (s.ring_len, ring_kind(s)) == key]
                 for key in keys}
    state0 = inputs.state0.to(device)
    exact = DeltaExact(state0)
    naive = DeltaNaive([scheme_list[j] for j in naive_idx], state0, [generator(j) for j in naive_idx]) \
        if naive_idx else None
    groups = {(L, ring): (InputRingGroup if ring == "inputs" else CorrectedRingGroup)(
        [scheme_list[j] for j in idx], state0, [generator(j) for j in idx]) for (L, ring), idx in group_idx.items()}

    bar = progress_bar(steps, progress)
    start_time = time.perf_counter()
    for start in range(0, steps, _CHUNK_STEPS):
        sl = slice(start, min(steps, start + _CHUNK_STEPS))
        s = DeltaStepInputs.build(dataclasses.replace(inputs, q=inputs.q[sl], k=inputs.k[sl], v=inputs.v[sl],
                                                      g=inputs.g[sl], beta=inputs.beta[sl]), device)
        for i in range(sl.stop - start):
            t = start + i + 1
            r = record_index.get(t)
            y_ref = exact.step(s, i)
            outputs = {}
            if naive is not None:
                keep_codes = r is not None or t + 1 in record_index  # a stall compares two steps' codes
                ys = naive.step(s, i, keep_codes)
                for k, j in enumerate(naive_idx):
                    outputs[j] = ys[k]
            for key, g in groups.items():
                ys = g.step(s, i, exact.state)
                for k, j in enumerate(group_idx[key]):
                    outputs[j] = ys[k]
            err_sq = errors.measure(t, outputs, y_ref)
            if r is not None:
                out_err[:, r] = err_sq.sqrt().cpu().numpy()
                exact_norm = exact.state.square().sum(dim=(0, 2, 3)).sqrt()
                if naive is not None:
                    se = (naive.state_error_sq(exact.state).sqrt() / exact_norm).cpu().numpy()
                    st = naive.stalled().cpu().numpy()
                    for k, j in enumerate(naive_idx):
                        state_err[j, r], stalled[j, r] = se[k], st[k]
                for key, g in groups.items():
                    se = ((g.state() - exact.state).square().sum(dim=(1, 3, 4)).sqrt() / exact_norm).cpu().numpy()
                    ce, st = g.checkpoint_error().cpu().numpy(), g.stall.cpu().numpy()
                    for k, j in enumerate(group_idx[key]):
                        state_err[j, r], stalled[j, r], ck_err[j, r] = se[k], st[k], ce[k]
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start_time
    for j in errors.failed_at:
        out_err[j], state_err[j], stalled[j], ck_err[j] = np.nan, np.nan, np.nan, np.nan
    cycle_err, peak = errors.finish()
    elements = batch * nh * profile.head_v_dim * profile.head_k_dim
    return DeltaDriftResult(
        profile=profile, schemes=scheme_list, heads=head_list, decay=[float(d) for d in decay],
        steps=steps, batch=batch, seed=seed, every=every, recorded_steps=np.array(recorded),
        output_error=out_err, state_error=state_err, stalled=stalled, cycle=cycle, cycle_error=cycle_err,
        peak_error=peak, failed_at={str(scheme_list[j]): step for j, step in errors.failed_at.items()},
        elapsed_s=elapsed, element_steps=float(elements) * steps, checkpoint_error=ck_err,
    )
