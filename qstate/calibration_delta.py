"""Calibration of gated delta rule layers: a profile measured on a model's own decode.

:func:`calibrate_delta` runs a greedy decode of a transformers model with delta-rule layers
(Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi Linear; GLM-5.x-next's layers are recognised too), watches
every layer's one-token step (:mod:`qstate.integrations.delta_observe`; transformers' computation
runs unchanged) and records per layer and value head the log-gate ``g``, ``β`` and the magnitude
of the new state. From ``g`` and the layer's ``A = exp(A_log)`` it recovers each token's gate
pre-activation ``x = f + dt_bias`` (``softplus⁻¹(−g / A)`` for the softplus gate,
``logit(g / lower_bound) / A`` for the bounded one), per gate channel. It returns a
:class:`CalibratedDeltaProfile`: the model's layer shape with an :class:`EmpiricalGates` whose
heads are the measured ``(A, median x per channel)`` of all layers, the spread of ``x`` around
those medians as ``f_std``, and the mean and spread of β's logit, so ``sample_inputs`` draws gates
and betas from what the model does rather than from its initialisation.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ._delta_profile import DeltaRuleProfile, GateDistribution, gate_values, inverse_softplus
from ._profile_common import stratified

__all__ = ["EmpiricalGates", "DeltaLayerStats", "CalibratedDeltaProfile", "calibrate_delta"]

_TINY = 1e-30  # keeps softplus⁻¹ and logit finite where fp32 gates reach 0 or the bound
_BETA_CLAMP = 1e-6


@dataclasses.dataclass(frozen=True)
class EmpiricalGates(GateDistribution):
    """Measured heads: ``A`` and the median gate pre-activation per channel (``channel_bias``, a
    tuple per head) of every (layer, value head), pooled, with ``decay`` their typical decays.

    ``sample(num_v_heads, channels)`` draws heads stratified over the measured decays (one per
    ``1/num_v_heads`` quantile, in an order set by the generator); the range fields hold the
    measured extremes of ``A``.
    """

    A: tuple = ()
    channel_bias: tuple = ()
    decay: tuple = ()

    def sample(self, num_v_heads: int, channels: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if any(len(b) != channels for b in self.channel_bias):
            raise ValueError(f"channels: the measured heads have {len(self.channel_bias[0])} gate channels, "
                             f"got {channels}")
        A = torch.tensor(self.A, dtype=torch.float64)
        bias = torch.tensor(self.channel_bias, dtype=torch.float64)  # [heads, channels]
        order = torch.argsort(torch.tensor(self.decay, dtype=torch.float64))
        u = stratified(num_v_heads, generator)
        picks = order[(u * len(order)).long().clamp(max=len(order) - 1)]
        return A[picks], bias[picks]


@dataclasses.dataclass(frozen=True)
class DeltaLayerStats:
    """What one layer's value heads did over the calibration decode; every field is a tuple per
    head. ``gate_*`` are over the per-token log-gate (the mean over channels for a channel gate),
    ``decay_* = exp(gate_*)``, ``beta_*`` over β; ``state_rms`` is the median and ``state_amax``
    the maximum over steps and sequences of the head state's rms and max |S|; ``channel_bias``
    holds the median gate pre-activation of each channel (a tuple per head)."""

    name: str
    A: tuple
    gate_median: tuple
    gate_min: tuple
    gate_max: tuple
    decay_median: tuple
    decay_min: tuple
    decay_max: tuple
    beta_median: tuple
    beta_min: tuple
    beta_max: tuple
    state_rms: tuple
    state_amax: tuple
    channel_bias: tuple


@dataclasses.dataclass(frozen=True)
class CalibratedDeltaProfile(DeltaRuleProfile):
    """A :class:`DeltaRuleProfile` measured on a model; ``layers`` holds the per-layer statistics."""

    layers: tuple = ()
    tokens: int = 0


def _layer_shape(layer) -> tuple:
    """``(HK, HV, K, V, gate, gate_form, lower_bound)`` and ``A (HV,)`` of a transformers layer."""
    if hasattr(layer, "num_v_heads"):  # Qwen3-Next / Qwen3.5 GatedDeltaNet
        shape = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, "scalar", "softplus", None)
        return shape, layer.A_log.detach().double().exp().reshape(-1).cpu()
    bound = getattr(layer.forget_gate, "safe_gate_lower_bound", None)
    form = "softplus" if bound is None else "bounded"
    shape = (layer.num_heads, layer.num_heads, layer.head_dim, layer.head_dim, "channel", form,
             None if bound is None else float(bound))
    return shape, layer.forget_gate.A_log.detach().double().exp().reshape(-1).cpu()


class _Recorder:
    def __init__(self, A: torch.Tensor, gate_form: str, lower_bound: Optional[float]):
        self.A, self.gate_form, self.lower_bound = A, gate_form, lower_bound
        self.x, self.gate, self.beta, self.rms, self.amax = [], [], [], [], []

    @property
    def steps(self) -> int:
        return len(self.gate)

    def __call__(self, step) -> None:
        g = step.g.detach().double().cpu()
        g = g[..., None] if g.dim() == 2 else g  # [batch, HV, C]
        if self.gate_form == "softplus":
            x = inverse_softplus((-g / self.A[:, None]).clamp(min=_TINY))
        else:
            r = (g / self.lower_bound).clamp(_TINY, 1 - _BETA_CLAMP)
            x = torch.log(r / (1 - r)) / self.A[:, None]
        self.x.append(x)
        self.gate.append(g.mean(-1))  # [batch, HV]
        self.beta.append(step.beta.detach().double().cpu())
        s = step.new_state.detach().double()
        self.rms.append(s.square().mean(dim=(-2, -1)).sqrt().cpu())
        self.amax.append(s.abs().amax(dim=(-2, -1)).cpu())

    def stats(self, name: str) -> DeltaLayerStats:
        gate, beta, rms, amax = (torch.cat(t, dim=0) for t in (self.gate, self.beta, self.rms, self.amax))
        x = torch.cat(self.x, dim=0)  # [steps · batch, HV, C]

        def per_head(t):
            return tuple(float(v) for v in t)

        return DeltaLayerStats(
            name=name, A=per_head(self.A),
            gate_median=per_head(gate.median(0).values), gate_min=per_head(gate.amin(0)),
            gate_max=per_head(gate.amax(0)), decay_median=per_head(gate.median(0).values.exp()),
            decay_min=per_head(gate.amin(0).exp()), decay_max=per_head(gate.amax(0).exp()),
            beta_median=per_head(beta.median(0).values), beta_min=per_head(beta.amin(0)),
            beta_max=per_head(beta.amax(0)), state_rms=per_head(rms.median(0).values),
            state_amax=per_head(amax.amax(0)),
            channel_bias=tuple(per_head(h) for h in x.median(0).values),
        )

    def spread(self) -> torch.Tensor:
        """The gate pre-activations' deviations from their channel medians, flattened."""
        x = torch.cat(self.x, dim=0)
        return (x - x.median(0).values).flatten()


def calibrate_delta(model, input_ids: torch.Tensor, new_tokens: int = 64, *,
                    name: Optional[str] = None) -> CalibratedDeltaProfile:
    """Measure ``model``'s delta-rule heads during a greedy decode of ``new_tokens`` tokens.

    ``model``: a transformers model with gated delta rule layers (see
    :data:`qstate.integrations.delta_observe.SUPPORTED_LAYERS`); ``input_ids (batch, prompt_len)``,
    at least one token, on the model's device. Returns a :class:`CalibratedDeltaProfile` named
    ``name`` (default: the model's ``name_or_path`` or class name). Raises ``ValueError`` for a
    model without such layers or whose layers differ in shape, ``RuntimeError`` when a layer's
    decode steps did not all reach the observer.
    """
    from .integrations.delta_observe import find_delta_layers, observe
    from .integrations.transformers import decode_logits

    layers = find_delta_layers(model)
    if not layers:
        raise ValueError(f"model: expected a transformers model with gated delta rule layers, found none in "
                         f"{type(model).__name__}")
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.numel():
        raise ValueError(f"input_ids: expected at least one sequence of at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    measured = {layer_name: _layer_shape(layer) for layer_name, layer in layers}
    shapes = {shape for shape, _ in measured.values()}
    if len(shapes) != 1:
        raise ValueError(f"model: expected every delta-rule layer to have one shape, got {sorted(shapes, key=str)}")
    (HK, HV, K, V, gate, gate_form, bound), = shapes
    recorders = {n: _Recorder(A, gate_form, bound) for n, (_, A) in measured.items()}
    with observe(model, lambda layer_name, step: recorders[layer_name](step)):
        decode_logits(model, input_ids, new_tokens)
    missing = {n: r.steps for n, r in recorders.items() if r.steps != new_tokens}
    if missing:
        raise RuntimeError(f"calibrate: the decode steps of layers {missing} did not all reach qstate's observer "
                           f"(expected {new_tokens} each)")
    stats = tuple(rec.stats(n) for n, rec in recorders.items())
    A = tuple(a for s in stats for a in s.A)
    bias = tuple(b for s in stats for b in s.channel_bias)
    if not all(0 < a < float("inf") for a in A):
        raise ValueError("model: calibration measured A = exp(A_log) outside (0, inf); check the model's weights")
    lower_bound = -5.0 if bound is None else bound
    decay = torch.exp(gate_values(torch.zeros((), dtype=torch.float64), torch.tensor(A, dtype=torch.float64),
                                  torch.tensor(bias, dtype=torch.float64), gate_form, lower_bound).mean(-1))
    betas = torch.cat([torch.cat(r.beta).flatten() for r in recorders.values()])
    logits = torch.logit(betas.clamp(_BETA_CLAMP, 1 - _BETA_CLAMP))
    spread = torch.cat([r.spread() for r in recorders.values()])
    gates = EmpiricalGates(
        a_min=min(A), a_max=max(A), dt_bias=None, f_std=float(spread.std()) if spread.numel() > 1 else 0.0,
        beta_logit_mean=float(logits.mean()), beta_logit_std=float(logits.std()) if logits.numel() > 1 else 0.0,
        A=A, channel_bias=bias, decay=tuple(float(d) for d in decay))
    if name is None:
        name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
    return CalibratedDeltaProfile(str(name), HK, HV, K, V, len(layers), gate=gate, gate_form=gate_form,
                                  gates=gates, lower_bound=lower_bound, layers=stats,
                                  tokens=new_tokens * int(input_ids.shape[0]))
