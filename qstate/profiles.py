"""Model shapes, decay distributions and realistic decode inputs (DESIGN.md §6).

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
import json
import math
import numbers
import operator
import os
from collections.abc import Iterable
from typing import Optional, Sequence, Union

import torch

from . import _validate

__all__ = ["DecayDistribution", "Profile", "DecodeInputs", "get", "names", "from_hf_config", "calibrate",
           "CalibratedProfile"]


def _bounded(name: str, value, low: float, *, strict: bool, low_name: str = "") -> None:
    """Check that ``value`` is a finite real number ``> low`` (``strict``) or ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (strict and value == low):
        bound = f"{low_name} = {low}" if low_name else f"{low}"
        raise ValueError(f"{name}: expected a finite number {'>' if strict else '>='} {bound}, got {value}")


def _index(value) -> Optional[int]:
    """``value`` as an int if it is an integer (Python, numpy or torch), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _generator(seed) -> torch.Generator:
    index = _index(seed)
    if index is None:
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not -2**63 <= index < 2**64:
        raise ValueError(f"seed: expected an int in [-2**63, 2**64), got {index}")
    return torch.Generator().manual_seed(index)


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
        _bounded("a_min", self.a_min, 0, strict=True)
        _bounded("a_max", self.a_max, self.a_min, strict=False, low_name="a_min")
        _bounded("dt_min", self.dt_min, 0, strict=True)
        _bounded("dt_max", self.dt_max, self.dt_min, strict=False, low_name="dt_min")
        _bounded("dt_floor", self.dt_floor, 0, strict=False)

    def sample(self, nheads: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, dt0)`` fp64 ``(nheads,)``: A from log U[a_min, a_max], dt0 log-uniform, both
        each stratified (one draw per 1/nheads quantile, in an order set by ``generator``)."""
        def stratified():
            u = (torch.arange(nheads, dtype=torch.float64) + torch.rand(nheads, generator=generator, dtype=torch.float64)) / nheads
            return u[torch.randperm(nheads, generator=generator)]

        A = -torch.exp(math.log(self.a_min) + stratified() * math.log(self.a_max / self.a_min))
        dt0 = torch.exp(math.log(self.dt_min) + stratified() * math.log(self.dt_max / self.dt_min))
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
        A, dt0 = self.decay.sample(self.nheads, _generator(seed))
        return torch.exp(dt0 * A)

    def spread_heads(self, count: int, seed: int = 0) -> list[int]:
        """``count`` heads whose decays are evenly spaced in rank over all heads (slowest last)."""
        _validate.positive_int("heads", count)
        if count > self.nheads:
            raise ValueError(f"heads: expected at most nheads = {self.nheads} heads, got {count}")
        order = torch.argsort(self.head_decays(seed))
        picks = torch.linspace(0, self.nheads - 1, count).round().long()
        return sorted(order[picks].tolist())

    def _resolve_heads(self, heads, seed: int) -> list[int]:
        if heads is None:
            return list(range(self.nheads))
        count = _index(heads)
        if count is not None:
            return self.spread_heads(count, seed)
        if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
            raise TypeError(f"heads: expected None, an int or a sequence of head indices, got {type(heads).__name__}")
        given = list(heads)
        indices = [_index(h) for h in given]
        if None in indices:
            raise TypeError(f"heads: expected int head indices, got {[h for h, i in zip(given, indices) if i is None]}")
        bad = [h for h in indices if not 0 <= h < self.nheads]
        if bad or not indices:
            raise ValueError(f"heads: expected indices in [0, {self.nheads}), got {bad or indices}")
        return indices

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
        _validate.positive_int("steps", steps)
        _validate.positive_int("batch", batch)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype}")
        chosen = self._resolve_heads(heads, seed)
        gen = _generator(seed)
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


_PROFILES = {
    p.name: p
    for p in (
        Profile("mamba2-2.7b", 80, 64, 128, 1, 64),
        Profile("nemotron-h-8b", 128, 64, 128, 8, 24),
        Profile("nemotron-nano-9b-v2", 128, 80, 128, 8, 27),
        Profile("nemotron-3-nano-30b-a3b", 64, 64, 128, 8, 23),
        Profile("nemotron-3-super-120b-a12b", 128, 64, 128, 8, 40),
    )
}


def names() -> list[str]:
    """Names of the built-in profiles."""
    return sorted(_PROFILES)


def get(name: Union[str, Profile]) -> Profile:
    """The built-in profile called ``name`` (see :func:`names`)."""
    if isinstance(name, Profile):
        return name
    if not isinstance(name, str):
        raise TypeError(f"profile: expected a model name (str) or a Profile, got {type(name).__name__}")
    if name not in _PROFILES:
        raise ValueError(f"profile: unknown model {name!r}; expected one of {names()}")
    return _PROFILES[name]


# One sequence's state of one layer; larger does not fit the kernels' 32-bit offsets.
MAX_STATE_ELEMENTS = 2**31

_ALIASES = {
    "nheads": ("mamba_num_heads", "num_heads"),
    "headdim": ("mamba_head_dim", "head_dim"),
    "dstate": ("ssm_state_size", "state_size"),
    "ngroups": ("mamba_n_groups", "n_groups"),
    "dt_min": ("mamba_dt_min", "time_step_min"),
    "dt_max": ("mamba_dt_max", "time_step_max"),
    "dt_floor": ("mamba_dt_init_floor", "time_step_floor"),
}


def _first(cfg: dict, key: str) -> Optional[tuple[str, object]]:
    """``(config key, value)`` of the first alias of ``key`` set in ``cfg``; None when none is."""
    return next(((k, cfg[k]) for k in _ALIASES[key] if cfg.get(k) is not None), None)


def _config_count(key: str, value) -> int:
    count = _index(value)
    if count is None:
        raise TypeError(f"config: {key}: expected an int, got {value!r}")
    if count < 1:
        raise ValueError(f"config: {key}: expected an int >= 1, got {count}")
    return count


def _ssm_layers(cfg: dict) -> int:
    # A pattern or block list without Mamba layers describes a model with none: counting all
    # its layers instead would be wrong.
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        if "M" not in pattern:
            raise ValueError(f"config: hybrid_override_pattern {pattern!r} has no Mamba-2 layer ('M')")
        return pattern.count("M")
    for key in ("layers_block_type", "layer_types"):
        block_types = cfg.get(key)
        if isinstance(block_types, list):
            count = sum(1 for b in block_types if str(b).lower() in ("mamba", "m"))
            if not count:
                raise ValueError(f"config: {key} {block_types!r} has no Mamba-2 layer ('mamba')")
            return count
    if cfg.get("num_hidden_layers") is None:
        raise ValueError("config: cannot count the SSM layers (no hybrid_override_pattern, layers_block_type, "
                         "layer_types or num_hidden_layers)")
    return _config_count("num_hidden_layers", cfg["num_hidden_layers"])


def from_hf_config(config: Union[str, os.PathLike, dict]) -> Profile:
    """A profile from a transformers ``config.json`` (Mamba2 or NemotronH), a path or a dict."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as fh:
            try:
                cfg = json.load(fh)
            except json.JSONDecodeError as err:
                raise ValueError(f"config: expected JSON in {path}, got a syntax error: {err}") from None
            except UnicodeDecodeError as err:
                raise ValueError(f"config: expected UTF-8 JSON in {path}, got {err.reason} at byte {err.start}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"config: expected a JSON object in {path}, got a {type(cfg).__name__}")
        name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-config"
    elif isinstance(config, dict):
        cfg, name = config, config.get("_name_or_path", "hf-config")
    else:
        raise TypeError(f"config: expected a path or a dict, got {type(config).__name__}")
    fields = {k: _first(cfg, k) for k in ("nheads", "headdim", "dstate", "ngroups")}
    missing = [f"{k} ({' or '.join(_ALIASES[k])})" for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"config: not a Mamba-2 config; missing {', '.join(missing)}")
    shape = [_config_count(*found) for found in fields.values()]
    if math.prod(shape[:3]) > MAX_STATE_ELEMENTS:
        raise ValueError(f"config: nheads × headdim × dstate = {' × '.join(map(str, shape[:3]))} state elements "
                         f"per sequence, expected at most 2**31 (the kernels' 32-bit offsets)")
    layers = _ssm_layers(cfg)
    steps = {k: found for k in ("dt_min", "dt_max", "dt_floor") if (found := _first(cfg, k)) is not None}
    try:
        decay = DecayDistribution(**{k: value for k, (_, value) in steps.items()})
    except (TypeError, ValueError) as err:
        given = ", ".join(f"{key} = {value!r}" for key, value in steps.values())
        raise type(err)(f"config: time steps ({given}): {err}") from None
    return Profile(str(name), *shape, layers, decay)


# Calibration builds on Profile, so it is defined in its own module and re-exported here.
from .calibration import CalibratedProfile, calibrate  # noqa: E402
