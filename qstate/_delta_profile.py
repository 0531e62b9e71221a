"""Gated delta rule profiles: layer shape, gate distributions and realistic decode inputs.

A delta-rule layer (see :mod:`qstate.reference.gated_delta`) has ``HK`` key heads of width ``K``
shared by ``HV`` value heads of width ``V`` and a log-space gate ``g``, one per value head
(``gate="scalar"``, GDN) or one per value head and key channel (``gate="channel"``, KDA).
``A = exp(A_log)`` is one number per value head; ``dt_bias`` one per head (GDN) or per channel
(KDA). The gate of a token with raw gate input ``f`` is, by ``gate_form``:

* ``softplus`` (Qwen3-Next, Qwen3.5, Kimi Linear): ``g = −A · softplus(f + dt_bias)``;
* ``bounded`` (GLM-5.3-Flash, Kimi-K3): ``g = lower_bound · sigmoid(A · (f + dt_bias))``, so
  ``lower_bound < g < 0`` (``lower_bound = −5``).

Distributions of :meth:`DeltaRuleProfile.sample_inputs`, from the models' initialisation
(transformers' ``_init_weights``) and parametrisation:

* ``A`` uniform in ``[a_min, a_max]``: ``[0.01, 16]`` for GDN (``A_log = log U[0.01, 16]``),
  ``[1, 16]`` for Kimi Linear (``A_log = log U[1, 16]``); the bounded gate initialises
  ``A_log = 0``, so ``A = 1``. Drawn stratified (one head per ``1/HV`` quantile, shuffled by seed)
  so that any subset of heads spans the range.
* ``dt_bias``: GDN initialises it to 1 for every head; KDA (both forms) draws per channel
  ``dt`` log-uniform in ``[1e-3, 1e-1]`` (floored at ``1e-4``) and stores its inverse softplus,
  stratified over the channels of each head.
* per token ``f``: GDN ``f ~ N(0, f_std²)`` per head; KDA ``f = W z`` from a low-rank projection
  as the models compute it (``f_a_proj`` to ``K`` dimensions, then ``f_b_proj``): ``z ~ N(0, I_K)``
  per token and ``W`` drawn once, ``N(0, f_std² / K)``, so every channel has standard deviation
  ``f_std`` (0.5) and the channels of a token move together.
* ``β = sigmoid(b)`` with ``b ~ N(beta_logit_mean, beta_logit_std²)`` = ``N(0, 1)`` per token
  and head (``2·sigmoid(b)`` for a model that allows β up to 2).
* ``q, k ~ N(0, 1)`` (the op normalises them), ``v ~ N(0, 1)``; the state starts at zero.

Built-in profiles (:data:`PROFILES`): the Qwen3.5 models and Kimi-Linear-48B-A3B take their shapes
from their released ``config.json``; Qwen3-Next-80B-A3B from transformers' ``Qwen3NextConfig``
defaults and GLM-5.3-Flash from transformers' ``Glm5NextTextConfig`` defaults (no released config
read). Trained models' gates differ from their initialisation: :func:`qstate.profiles.calibrate`
measures them.

Everything is drawn in fp64 on the CPU from one ``torch.Generator`` seeded with ``seed`` and then
cast and moved, so the same seed gives the same inputs on any machine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional, Sequence, Union

import torch

from . import _validate
from ._profile_common import bounded, check_sampling, resolve_heads, seeded_generator, spread, stratified

__all__ = ["GateDistribution", "DeltaRuleInputs", "DeltaRuleProfile", "GATES", "GATE_FORMS"]

GATES = ("scalar", "channel")
GATE_FORMS = ("softplus", "bounded")


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    """``y`` with ``softplus(y) = x`` for ``x > 0``, stably."""
    return x + torch.log(-torch.expm1(-x))


@dataclasses.dataclass(frozen=True)
class GateDistribution:
    """Initial gate parameters and per-token spread.

    ``A`` uniform in ``[a_min, a_max]``; ``dt_bias`` the constant ``dt_bias`` when given, else the
    inverse softplus of ``dt`` log-uniform in ``[dt_min, dt_max]`` floored at ``dt_floor``; the
    raw gate input ``f`` of a token has standard deviation ``f_std``; ``β``'s logit is
    ``N(beta_logit_mean, beta_logit_std²)``.
    """

    a_min: float = 0.01
    a_max: float = 16.0
    dt_bias: Optional[float] = 1.0
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_floor: float = 1e-4
    f_std: float = 0.5
    beta_logit_mean: float = 0.0
    beta_logit_std: float = 1.0

    def __post_init__(self):
        bounded("a_min", self.a_min, 0, strict=False)
        bounded("a_max", self.a_max, self.a_min, strict=False, low_name="a_min")
        if self.dt_bias is not None:
            bounded("dt_bias", self.dt_bias, -math.inf, strict=True)
        bounded("dt_min", self.dt_min, 0, strict=True)
        bounded("dt_max", self.dt_max, self.dt_min, strict=False, low_name="dt_min")
        bounded("dt_floor", self.dt_floor, 0, strict=False)
        bounded("f_std", self.f_std, 0, strict=False)
        bounded("beta_logit_mean", self.beta_logit_mean, -math.inf, strict=True)
        bounded("beta_logit_std", self.beta_logit_std, 0, strict=False)

    def sample(self, num_v_heads: int, channels: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A (HV,), dt_bias (HV, channels))`` fp64, ``A`` stratified over the heads and a
        drawn ``dt_bias`` stratified over each head's channels."""
        A = self.a_min + stratified(num_v_heads, generator) * (self.a_max - self.a_min)
        if self.dt_bias is not None:
            return A, torch.full((num_v_heads, channels), float(self.dt_bias), dtype=torch.float64)
        u = torch.stack([stratified(channels, generator) for _ in range(num_v_heads)])
        dt = torch.exp(math.log(self.dt_min) + u * math.log(self.dt_max / self.dt_min)).clamp(min=self.dt_floor)
        return A, inverse_softplus(dt)


GDN_INIT = GateDistribution()
KIMI_INIT = GateDistribution(a_min=1.0, a_max=16.0, dt_bias=None)
BOUNDED_INIT = GateDistribution(a_min=1.0, a_max=1.0, dt_bias=None)


def gate_values(f: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, gate_form: str,
                lower_bound: float) -> torch.Tensor:
    """Log-space gates from raw inputs ``f [..., HV, C]``, ``A [HV]``, ``dt_bias [HV, C]``."""
    x = f + dt_bias
    if gate_form == "softplus":
        return -A[:, None] * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(A[:, None] * x)


@dataclasses.dataclass
class DeltaRuleInputs:
    """Time-major decode inputs for :mod:`qstate.reference.gated_delta` (its shapes)."""

    state0: torch.Tensor  # [batch, HV, V, K]
    q: torch.Tensor  # [T, batch, HK, K]
    k: torch.Tensor  # [T, batch, HK, K]
    v: torch.Tensor  # [T, batch, HV, V]
    g: torch.Tensor  # [T, batch, HV] or [T, batch, HV, K], log space
    beta: torch.Tensor  # [T, batch, HV]
    A: torch.Tensor  # [HV]: exp(A_log) of each head
    dt_bias: torch.Tensor  # [HV, 1] (scalar gate) or [HV, K]
    heads: torch.Tensor  # [HV]: which value heads of the model these are
    key_heads: torch.Tensor  # [HK]: which key heads of the model q and k come from
    gate_form: str = "softplus"
    lower_bound: float = -5.0
    allow_neg_eigval: bool = False

    def kwargs(self) -> dict:
        """Arguments for ``decode_exact`` / ``decode_naive`` / ``decode_replay`` of
        :mod:`qstate.reference.gated_delta` (``allow_neg_eigval`` only when it is True)."""
        out = dict(state0=self.state0, q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta)
        if self.allow_neg_eigval:
            out["allow_neg_eigval"] = True
        return out

    def channel_decay(self) -> torch.Tensor:
        """Typical decay ``exp(g)`` at ``f = 0`` of every head and gate channel, fp64 ``(HV, C)``."""
        g0 = gate_values(torch.zeros((), dtype=torch.float64), self.A.double(), self.dt_bias.double(),
                         self.gate_form, self.lower_bound)
        return torch.exp(g0)

    def decay(self) -> torch.Tensor:
        """Typical decay per head, fp64 ``(HV,)``: the geometric mean of :meth:`channel_decay`."""
        return torch.exp(torch.log(self.channel_decay()).mean(-1))


@dataclasses.dataclass(frozen=True)
class DeltaRuleProfile:
    """One model's delta-rule layer shape and the distribution of its gates.

    ``n_layers`` counts the delta-rule layers. ``gate``: ``"scalar"`` (GDN) or ``"channel"``
    (KDA); ``gate_form``: ``"softplus"`` or ``"bounded"`` (with ``lower_bound``);
    ``allow_neg_eigval``: β in [0, 2] instead of [0, 1].
    """

    family: ClassVar[str] = "gated_delta"
    name: str
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    n_layers: int
    gate: str = "scalar"
    gate_form: str = "softplus"
    gates: GateDistribution = GDN_INIT
    lower_bound: float = -5.0
    allow_neg_eigval: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {type(self.name).__name__}")
        for field in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "n_layers"):
            _validate.positive_int(field, getattr(self, field))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads: expected a multiple of num_k_heads = {self.num_k_heads}, "
                             f"got {self.num_v_heads}")
        if self.gate not in GATES:
            raise ValueError(f"gate: expected one of {list(GATES)}, got {self.gate!r}")
        if self.gate_form not in GATE_FORMS:
            raise ValueError(f"gate_form: expected one of {list(GATE_FORMS)}, got {self.gate_form!r}")
        if not isinstance(self.gates, GateDistribution):
            raise TypeError(f"gates: expected a GateDistribution, got {type(self.gates).__name__}")
        bounded("lower_bound", -self.lower_bound, 0, strict=True)
        if not isinstance(self.allow_neg_eigval, bool):
            raise TypeError(f"allow_neg_eigval: expected a bool, got {type(self.allow_neg_eigval).__name__}")

    @property
    def beta_range(self) -> tuple[float, float]:
        """The range of β the model allows: (0, 1), or (0, 2) with ``allow_neg_eigval``."""
        return (0.0, 2.0 if self.allow_neg_eigval else 1.0)

    @property
    def gate_channels(self) -> int:
        """Gates per value head: 1 (scalar) or ``head_k_dim`` (channel)."""
        return self.head_k_dim if self.gate == "channel" else 1

    def _parameters(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gates.sample(self.num_v_heads, self.gate_channels, gen)

    def head_decays(self, seed: int = 0) -> torch.Tensor:
        """Typical decay of every value head (geometric mean over its gate channels at ``f = 0``),
        fp64 ``(num_v_heads,)``."""
        A, dt_bias = self._parameters(seeded_generator(seed))
        g0 = gate_values(torch.zeros((), dtype=torch.float64), A, dt_bias, self.gate_form, self.lower_bound)
        return torch.exp(g0.mean(-1))

    def spread_heads(self, count: int, seed: int = 0) -> list[int]:
        """``count`` value heads whose decays are evenly spaced in rank over all heads (slowest last)."""
        _validate.positive_int("heads", count)
        if count > self.num_v_heads:
            raise ValueError(f"heads: expected at most num_v_heads = {self.num_v_heads} heads, got {count}")
        return spread(self.head_decays(seed), count)

    def _resolve_heads(self, heads, seed: int) -> list[int]:
        return resolve_heads(heads, self.num_v_heads, lambda count: self.spread_heads(count, seed))

    def sample_inputs(
        self,
        steps: int,
        batch: int,
        *,
        heads: Union[None, int, Sequence[int]] = None,
        seed: int = 0,
        device: Union[str, torch.device] = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> DeltaRuleInputs:
        """Realistic decode inputs for ``steps`` tokens of ``batch`` sequences from a zero state.

        ``heads``: None (all value heads), an int ``k`` (k value heads spanning the decay range,
        see :meth:`spread_heads`), or explicit value-head indices. With a subset, every chosen
        value head keeps the q and k of its key head, given as a key head of its own
        (``HK = HV = len(heads)``). ``A`` and ``dt_bias`` are fp32 whatever ``dtype`` is;
        q, k, v, g and β are in ``dtype``, a floating-point type.
        """
        check_sampling(steps, batch, dtype)
        chosen = self._resolve_heads(heads, seed)
        gen = seeded_generator(seed)
        A, dt_bias = self._parameters(gen)
        f64 = torch.float64
        T, HK, HV, K, V = steps, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        dist = self.gates
        q = torch.randn(T, batch, HK, K, generator=gen, dtype=f64)
        k = torch.randn(T, batch, HK, K, generator=gen, dtype=f64)
        v = torch.randn(T, batch, HV, V, generator=gen, dtype=f64)
        b = dist.beta_logit_mean + dist.beta_logit_std * torch.randn(T, batch, HV, generator=gen, dtype=f64)
        idx = torch.tensor(chosen)
        if self.gate == "channel":
            W = torch.randn(HV, K, K, generator=gen, dtype=f64) * (dist.f_std / math.sqrt(K))  # [HV, C, rank]
            z = torch.randn(T, batch, K, generator=gen, dtype=f64)
            f = torch.einsum("hcr,tbr->tbhc", W[idx], z)
        else:
            f = dist.f_std * torch.randn(T, batch, HV, 1, generator=gen, dtype=f64)[:, :, idx]
        g = gate_values(f, A[idx], dt_bias[idx], self.gate_form, self.lower_bound)
        if self.gate == "scalar":
            g = g[..., 0]
        beta = torch.sigmoid(b[:, :, idx]) * (2.0 if self.allow_neg_eigval else 1.0)
        key_heads = idx // (HV // HK) if heads is not None else torch.arange(HK)
        if heads is not None:
            q, k = q[:, :, key_heads], k[:, :, key_heads]

        def cast(t, to=dtype):
            return t.to(to).to(device)

        return DeltaRuleInputs(
            state0=torch.zeros(batch, len(chosen), V, K, dtype=dtype, device=device),
            q=cast(q), k=cast(k), v=cast(v[:, :, idx]), g=cast(g), beta=cast(beta),
            A=cast(A[idx], torch.float32), dt_bias=cast(dt_bias[idx], torch.float32),
            heads=idx.to(device), key_heads=key_heads.to(device), gate_form=self.gate_form,
            lower_bound=self.lower_bound, allow_neg_eigval=self.allow_neg_eigval,
        )


def _kimi(name, heads, layers):
    return DeltaRuleProfile(name, heads, heads, 128, 128, layers, gate="channel", gate_form="softplus",
                            gates=KIMI_INIT)


PROFILES = (
    DeltaRuleProfile("qwen3.5-0.8b", 16, 16, 128, 128, 18),
    DeltaRuleProfile("qwen3.5-9b", 16, 32, 128, 128, 24),
    DeltaRuleProfile("qwen3.5-27b", 16, 48, 128, 128, 48),
    DeltaRuleProfile("qwen3.5-35b-a3b", 16, 32, 128, 128, 30),
    DeltaRuleProfile("qwen3.5-122b-a10b", 16, 64, 128, 128, 36),
    DeltaRuleProfile("qwen3.5-397b-a17b", 16, 64, 128, 128, 45),
    DeltaRuleProfile("qwen3-next-80b-a3b", 16, 32, 128, 128, 36),
    _kimi("kimi-linear-48b-a3b", 32, 20),
    DeltaRuleProfile("glm-5.3-flash", 64, 64, 128, 128, 34, gate="channel", gate_form="bounded",
                     gates=BOUNDED_INIT),
)
