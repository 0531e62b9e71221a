"""Calibration: a profile measured on a real model's decode instead of initialisation ranges.

:func:`calibrate` runs a greedy decode of a transformers Mamba-2 / Nemotron-H model, watches
every Mamba-2 layer's decode step (transformers' own computation, unchanged) and records per
layer and head: the processed ``dt``, the decay ``a = exp(dt·A)`` and the magnitude of the new
state (rms and max |S| over ``headdim × dstate``). It returns a :class:`CalibratedProfile`:
the model's layer shape, with an :class:`EmpiricalDecay` whose heads are the measured
``(A, median dt)`` pairs of all layers, so ``sample_inputs``, the drift engine and the chooser
draw decays from what the model does rather than from ``A ∈ −[1, 16]``, ``dt ∈ [1e-3, 1e-1]``.
The per-token spread of ``dt`` around a head's median stays the profile's usual one.
Models with gated delta rule layers are measured by :mod:`qstate.calibration_delta`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from ._mamba2_profile import DecayDistribution, Profile
from .calibration_delta import CalibratedDeltaProfile, DeltaLayerStats, EmpiricalGates, calibrate_delta

__all__ = ["EmpiricalDecay", "LayerStats", "CalibratedProfile", "calibrate", "CalibratedDeltaProfile",
           "DeltaLayerStats", "EmpiricalGates"]


@dataclasses.dataclass(frozen=True)
class EmpiricalDecay(DecayDistribution):
    """Measured heads: ``A`` and ``dt0`` (median processed dt) of every (layer, head), pooled.

    ``sample(nheads)`` draws heads stratified over the measured decays ``exp(dt0·A)`` (one per
    1/nheads quantile, in an order set by the generator), as :class:`DecayDistribution` does
    over its ranges; the range fields hold the measured extremes.
    """

    A: tuple = ()
    dt0: tuple = ()

    def sample(self, nheads: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        A = torch.tensor(self.A, dtype=torch.float64)
        dt0 = torch.tensor(self.dt0, dtype=torch.float64)
        order = torch.argsort(torch.exp(dt0 * A))
        u = (torch.arange(nheads, dtype=torch.float64) + torch.rand(nheads, generator=generator, dtype=torch.float64)) / nheads
        picks = order[(u * len(order)).long().clamp(max=len(order) - 1)]
        picks = picks[torch.randperm(nheads, generator=generator)]
        return A[picks], dt0[picks]


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """What one layer's heads did over the calibration decode; every field is a tuple per head.

    ``dt_*`` and ``decay_*`` are over all decode steps and sequences; ``state_rms`` is the
    median and ``state_amax`` the maximum over steps and sequences of the per-head state's rms
    and max |S|.
    """

    name: str
    A: tuple
    dt_median: tuple
    dt_min: tuple
    dt_max: tuple
    decay_median: tuple
    decay_min: tuple
    decay_max: tuple
    state_rms: tuple
    state_amax: tuple


@dataclasses.dataclass(frozen=True)
class CalibratedProfile(Profile):
    """A :class:`Profile` measured on a model; ``layers`` holds the per-layer statistics."""

    layers: tuple = ()
    tokens: int = 0


class _Recorder:
    def __init__(self):
        self.dt, self.decay, self.rms, self.amax, self.A = [], [], [], [], None

    def __call__(self, step, dt, decay, state) -> None:
        self.A = step.A.detach().double().cpu()
        self.dt.append(dt.detach().double().cpu())  # [batch, nheads]
        self.decay.append(decay.detach().double().cpu())
        s = state.detach().double()
        self.rms.append(s.square().mean(dim=(-2, -1)).sqrt().cpu())  # [batch, nheads]
        self.amax.append(s.abs().amax(dim=(-2, -1)).cpu())

    def stats(self, name: str) -> LayerStats:
        def cat(xs):
            return torch.cat(xs, dim=0)  # [steps · batch, nheads]

        dt, decay, rms, amax = cat(self.dt), cat(self.decay), cat(self.rms), cat(self.amax)

        def per_head(t):
            return tuple(float(v) for v in t)

        return LayerStats(
            name=name, A=per_head(self.A),
            dt_median=per_head(dt.median(0).values), dt_min=per_head(dt.amin(0)), dt_max=per_head(dt.amax(0)),
            decay_median=per_head(decay.median(0).values), decay_min=per_head(decay.amin(0)),
            decay_max=per_head(decay.amax(0)),
            state_rms=per_head(rms.median(0).values), state_amax=per_head(amax.amax(0)),
        )


def calibrate(model, input_ids: torch.Tensor, new_tokens: int = 64, *,
              name: Optional[str] = None) -> Union[CalibratedProfile, CalibratedDeltaProfile]:
    """Measure ``model``'s heads during a greedy decode of ``new_tokens`` tokens after ``input_ids``.

    ``model``: a transformers ``Mamba2ForCausalLM`` / ``NemotronHForCausalLM`` (not patched), or
    a model with gated delta rule layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi Linear: see
    :func:`qstate.calibration_delta.calibrate_delta`, which returns a :class:`CalibratedDeltaProfile`);
    ``input_ids (batch, prompt_len)``, at least one token, on the model's device (real text gives
    real statistics).
    Returns a :class:`CalibratedProfile` named ``name`` (default: the model's ``name_or_path``
    or class name). Raises ``ValueError`` for a model without Mamba-2 mixers or whose mixers
    differ in shape.
    """
    from .integrations.decode_routes import ObserverRoute
    from .integrations.delta_observe import find_delta_layers
    from .integrations.transformers import attach_routes, decode_logits, find_mixers

    if find_delta_layers(model):
        return calibrate_delta(model, input_ids, new_tokens, name=name)
    mixers = find_mixers(model)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.numel():
        raise ValueError(f"input_ids: expected at least one sequence of at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    shapes = {(m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups) for _, m in mixers}
    if len(shapes) != 1:
        raise ValueError(f"model: expected every Mamba-2 layer to have one shape, got {sorted(shapes)}")
    (nheads, headdim, dstate, ngroups), = shapes
    recorders = {layer: _Recorder() for layer, _ in mixers}
    with attach_routes(model, lambda layer, mixer: ObserverRoute(layer, recorders[layer])) as observed:
        decode_logits(model, input_ids, new_tokens)
    missing = list(observed.missed_steps(new_tokens))
    if missing:
        raise RuntimeError(f"calibrate: the decode steps of layers {missing} did not reach qstate's observer")
    layers = tuple(rec.stats(layer) for layer, rec in recorders.items())
    A = tuple(a for s in layers for a in s.A)
    dt0 = tuple(d for s in layers for d in s.dt_median)
    # Checked before EmpiricalDecay, whose range checks would blame its fields rather than the model.
    if not (all(-math.inf < a < 0 for a in A) and all(0 < d < math.inf for d in dt0)):
        raise ValueError("model: calibration measured A or dt outside -inf < A < 0 < dt < inf; "
                         "check the model's weights")
    default = DecayDistribution()
    decay = EmpiricalDecay(
        a_min=min(-a for a in A), a_max=max(-a for a in A), dt_min=min(dt0), dt_max=max(dt0),
        dt_floor=min(default.dt_floor, min(dt0)), A=A, dt0=dt0)
    if name is None:
        name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    return CalibratedProfile(str(name), nheads, headdim, dstate, ngroups, len(mixers), decay,
                             layers=layers, tokens=new_tokens * int(input_ids.shape[0]))
