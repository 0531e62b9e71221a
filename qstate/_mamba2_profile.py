"""Mamba-2 profiles: layer shape, decay distributions and realistic decode inputs.

Decay of a head: ``a = exp(dt · A)``. Mamba-2 initialises ``A = −exp(A_log)`` with
``A_log = log U[1, 16]`` and ``dt = softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]``
(floored at ``dt_floor``), so ``a`` at the typical dt spans about ``[0.2, 0.999]``.

:meth:`Profile.sample_inputs` draws per head ``A`` and ``dt_bias`` from those ranges with a
stratified (evenly spaced, then shuffled by seed) design, so that any subset of heads spans
the range; per token and head ``dt_raw ~ N(0, 0.5²)`` (so dt wanders around its head's
``softplus(dt_bias)`` by a factor of about 1.5); ``x, z ~ N(0, 1)``; ``B, C ~ N(0, 1)``; ``D = 1``.
Everything is drawn in fp64 on the CPU from one ``torch.Generator`` seeded with ``seed`` and
then cast and moved, so the same seed gives the same inputs on any machine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Sequence, Union

import torch

from . import _validate
from ._profile_common import bounded, check_sampling, resolve_heads, seeded_generator, spread, stratified

__all__ = ["DecayDistribution", "DecodeInputs", "Profile"]


@dataclasses.dataclass(frozen=True)
class DecayDistribution:
    """Initialisation ranges of Mamba-2: ``-A ∈ [a_min, a_max]``, ``dt ∈ [dt_min, dt_max]``, with
    ``0 < a_min <= a_max``, ``0 < dt_min <= dt_max`` and ``dt_floor >= 0``, all finite."""

    a_min: float = 1.0
    a_max: float = 16.0
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_floor: float = 1e-4

    def __post_init__(self):
        # The draws are log-uniform, so both lower ends must be > 0; the floor only clamps dt.
        bounded("a_min", self.a_min, 0, strict=True)
        bounded("a_max", self.a_max, self.a_min, strict=False, low_name="a_min")
        bounded("dt_min", self.dt_min, 0, strict=True)
        bounded("dt_max", self.dt_max, self.dt_min, strict=False, low_name="dt_min")
        bounded("dt_floor", self.dt_floor, 0, strict=False)

    def sample(self, nheads: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, dt0)`` fp64 ``(nheads,)``: A from log U[a_min, a_max], dt0 log-uniform, both
        each stratified (one draw per 1/nheads quantile, in an order set by ``generator``)."""
        A = -torch.exp(math.log(self.a_min) + stratified(nheads, generator) * math.log(self.a_max / self.a_min))
        dt0 = torch.exp(math.log(self.dt_min) + stratified(nheads, generator) * math.log(self.dt_max / self.dt_min))
        return A, dt0.clamp(min=self.dt_floor)


@dataclasses.dataclass
class DecodeInputs:
    """Time-major decode inputs for the references (shapes as in :mod:`qstate.reference`)."""

    state0: torch.Tensor  # [batch, nheads, headdim, dstate]
    x: torch.Tensor  # [T, batch, nheads, headdim]
    dt: torch.Tensor  # [T, batch, nheads], before dt_bias and softplus
    A: torch.Tensor  # [nheads]
    B: torch.Tensor  # [T, batch, ngroups, dstate]
    C: torch.Tensor  # [T, batch, ngroups, dstate]
    D: torch.Tensor  # [nheads]
    z: torch.Tensor  # [T, batch, nheads, headdim]
    dt_bias: torch.Tensor  # [nheads]
    heads: torch.Tensor  # [nheads]: which heads of the model these are
    dt_softplus: bool = True

    def kwargs(self) -> dict:
        """Arguments for ``decode_exact`` / ``decode_naive`` / ``decode_replay``."""
        return dict(
            state0=self.state0, x=self.x, dt=self.dt, A=self.A, B=self.B, C=self.C, D=self.D,
            z=self.z, dt_bias=self.dt_bias, dt_softplus=self.dt_softplus,
        )

    def decay(self) -> torch.Tensor:
        """Typical decay per head, ``exp(softplus(dt_bias) · A)``, fp64 ``(nheads,)``."""
        dt0 = torch.nn.functional.softplus(self.dt_bias.double())
        return torch.exp(dt0 * self.A.double())


@dataclasses.dataclass(frozen=True)
class Profile:
    """One model's SSM layer shape and the decay distribution of its heads."""

    family: ClassVar[str] = "mamba2"
    name: str
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    n_ssm_layers: int
    decay: DecayDistribution = DecayDistribution()

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {type(self.name).__name__}")
        if not isinstance(self.decay, DecayDistribution):
            raise TypeError(f"decay: expected a DecayDistribution, got {type(self.decay).__name__}")
        for field in ("nheads", "headdim", "dstate", "ngroups", "n_ssm_layers"):
            _validate.positive_int(field, getattr(self, field))
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups: nheads ({self.nheads}) must be a multiple of ngroups, got {self.ngroups}")

    def head_decays(self, seed: int = 0) -> torch.Tensor:
        """Typical decay ``exp(dt0 · A)`` of every head, fp64 ``(nheads,)``."""
        A, dt0 = self.decay.sample(self.nheads, seeded_generator(seed))
        return torch.exp(dt0 * A)

    def spread_heads(self, count: int, seed: int = 0) -> list[int]:
        """``count`` heads whose decays are evenly spaced in rank over all heads (slowest last)."""
        _validate.positive_int("heads", count)
        if count > self.nheads:
            raise ValueError(f"heads: expected at most nheads = {self.nheads} heads, got {count}")
        return spread(self.head_decays(seed), count)

    def _resolve_heads(self, heads, seed: int) -> list[int]:
        return resolve_heads(heads, self.nheads, lambda count: self.spread_heads(count, seed))

    def sample_inputs(
        self,
        steps: int,
        batch: int,
        *,
        heads: Union[None, int, Sequence[int]] = None,
        seed: int = 0,
        device: Union[str, torch.device] = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> DecodeInputs:
        """Realistic decode inputs for ``steps`` tokens of ``batch`` sequences from a zero state.

        ``heads``: None (all), an int ``k`` (k heads spanning the decay range, see
        :meth:`spread_heads`), or explicit head indices. With a subset, every chosen head keeps
        the B and C of its group, given as a group of its own (``ngroups = len(heads)``).
        Parameters (A, D, dt_bias) are fp32 whatever ``dtype`` is; inputs are in ``dtype``, a
        floating-point type.
        """
        check_sampling(steps, batch, dtype)
        chosen = self._resolve_heads(heads, seed)
        gen = seeded_generator(seed)
        A, dt0 = self.decay.sample(self.nheads, gen)
        dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus
        f64 = torch.float64
        T, H, P, N, G = steps, self.nheads, self.headdim, self.dstate, self.ngroups
        x = torch.randn(T, batch, H, P, generator=gen, dtype=f64)
        z = torch.randn(T, batch, H, P, generator=gen, dtype=f64)
        dt = 0.5 * torch.randn(T, batch, H, generator=gen, dtype=f64)
        B = torch.randn(T, batch, G, N, generator=gen, dtype=f64)
        C = torch.randn(T, batch, G, N, generator=gen, dtype=f64)
        idx = torch.tensor(chosen)
        if heads is not None:
            group = idx // (H // G)
            B, C = B[:, :, group], C[:, :, group]
        x, z, dt = x[:, :, idx], z[:, :, idx], dt[:, :, idx]

        def cast(t, dt_=dtype):
            return t.to(dt_).to(device)

        n = len(chosen)
        return DecodeInputs(
            state0=torch.zeros(batch, n, P, N, dtype=dtype, device=device),
            x=cast(x), dt=cast(dt), A=cast(A[idx], torch.float32), B=cast(B), C=cast(C),
            D=torch.ones(n, dtype=torch.float32, device=device), z=cast(z),
            dt_bias=cast(dt_bias[idx], torch.float32), heads=idx.to(device),
        )
