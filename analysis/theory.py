"""Predicted drift of a scheme on one head, from its decay and input scale (derivations in
``analysis/README.md``).

Model of a head: ``S_t = a·S_{t−1} + d_t`` elementwise with ``E[d²] = u²`` (``u`` the rms
increment, ``dt`` for unit-variance ``x`` and ``B``), from ``S_0 = 0``, so the exact state has
variance ``σ_S²(t) = u²·(1 − a^{2t}) / (1 − a²)``. A format rounds a state element with error
variance ``r²·σ²`` (``r``: :func:`rounding_rms`, relative, from the format's grid at Gaussian state
rows; round-to-nearest ``E[step²]/12``, stochastic ``E[step²]/6``).

* conventional, unbiased rounding: ``e_t = a·e_{t−1} + δ_t`` gives
  ``σ_e²(t) = Σ_k a^{2(t−k)}·r²·σ_S²(k)``: ``r·σ_S / sqrt(1 − a²)``-like steady state,
  ``sqrt(t)`` growth while ``t ≪ 1 / (1 − a)``;
* round to nearest, small increments: an update below half a step is lost (the dead band,
  :func:`dead_band`); a head stagnates when one step at the exact steady state leaves most stored
  codes unchanged (:func:`predicted_stalled_fraction` above the drift measure's threshold,
  :func:`stagnation_predicted`). Half steps differ element by element (float grids: with the
  binade; scales: with the row or head maximum) and so do increments (``x_p·B_n``), so it is the
  median element, not the rms one, that decides: ``fp8_e4m3:row`` stalls most codes from
  ``a ≈ 0.9975``, where ``sqrt(1 − a²)`` is still 1.6 times ``sqrt(3)·r``;
* replay read copy: one quantization of the checkpoint, decayed: ``a^k·r_read·σ_S(c)`` ``k`` steps
  after the flush at step ``c`` (none at ``k = L``: that token outputs from the fold);
* quantized checkpoint: one rounding per flush, carried: ``ε_m = a^L·ε_{m−1} + δ_m``.

Output error: ``y = S·C + D·x``; an error ``e`` in the state gives ``e·C`` (``dstate`` terms), so
``‖Δy‖/‖y‖ = σ_e·sqrt(N) / sqrt(N·σ_S² + D²)`` (a gate ``z·σ(z)`` scales both alike).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Optional

import numpy as np
import torch

from qstate import _validate
from qstate import profiles as _profiles
from qstate.formats import BLOCK, StateFormat, as_format, dequantize, quantize

from .drift import STAGNATION_THRESHOLD
from .schemes import Scheme

__all__ = ["Prediction", "rounding_rms", "dead_band", "predicted_stalled_fraction", "stagnation_predicted",
           "predict", "head_parameters", "synthetic_inputs", "DT_NOISE", "UNBIASED_MARGIN"]

DT_NOISE = 0.5  # std of dt_raw per token around dt_bias, as profiles.Profile.sample_inputs draws it
UNBIASED_MARGIN = 2.0 * math.sqrt(12.0)  # increments this many rounding rms above: RNE acts unbiased
_MONTE_CARLO_VALUES = 1 << 20  # state elements of the fixed-seed samples below


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return float(value)


def _decay(name: str, value) -> float:
    """A head's decay ``a = exp(dt·A)`` with ``dt > 0`` and ``A < 0`` lies in (0, 1)."""
    value = _real(name, value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name}: expected a decay in (0, 1) (a = exp(dt·A), dt > 0, A < 0), got {value}")
    return value


def _positive(name: str, value) -> float:
    value = _real(name, value)
    if value <= 0.0:
        raise ValueError(f"{name}: expected a value > 0, got {value}")
    return value


def _dims(dstate, headdim, *fmts) -> None:
    _validate.positive_int("dstate", dstate)
    _validate.positive_int("headdim", headdim)
    if dstate % BLOCK and any(f is not None and f.granularity == "block32" for f in fmts):
        raise ValueError(f"dstate: block32 needs dstate % 32 == 0, got {dstate}")


@functools.lru_cache(maxsize=None)
def rounding_rms(fmt, dstate: int = 128, headdim: int = 64) -> float:
    """Relative rms rounding error ``r = sqrt(E|Q(v) − v|² / E|v|²)`` of ``fmt`` for state blocks
    ``(headdim, dstate)`` of i.i.d. Gaussians (the format's grid, scales and stochastic noise as
    :func:`qstate.formats.quantize` applies them; fixed-seed Monte Carlo, 2**20 values)."""
    fmt = as_format(fmt)
    _dims(dstate, headdim, fmt)
    gen = torch.Generator().manual_seed(0)
    blocks = max(1, _MONTE_CARLO_VALUES // (headdim * dstate))
    if fmt.dtype == "fp32":
        # fp32 stores values computed in fp64 (the replay engine's fold). The ulp is 2**-23 of the
        # value's binade, not of the value, so r is about 0.74 of (2**-23)/sqrt(12).
        v = torch.randn(blocks, headdim, dstate, generator=gen, dtype=torch.float64)
        q = v.float()
    else:
        v = torch.randn(blocks, headdim, dstate, generator=gen)
        q = dequantize(quantize(v, fmt, generator=gen))
    return float(((q - v).double().square().mean() / v.double().square().mean()).sqrt())


def _grid_neighbours(fmt: StateFormat, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distance from each grid value to its neighbour below and above (unscaled formats: values; scaled:
    codes)."""
    from qstate.formats import round_to_grid

    v = value.float()
    tiny = torch.finfo(torch.float32).tiny
    up = round_to_grid(torch.nextafter(v, torch.full_like(v, math.inf)).clamp(-fmt.qmax, fmt.qmax), fmt,
                       noise=torch.full_like(v, 1.0 - 2.0**-24))
    down = round_to_grid(torch.nextafter(v, torch.full_like(v, -math.inf)).clamp(-fmt.qmax, fmt.qmax), fmt,
                         noise=torch.zeros_like(v))
    return (v - down).double().clamp(min=tiny), (up - v).double().clamp(min=tiny)


def dead_band(fmt, value, decay, increment) -> torch.Tensor:
    """True where round-to-nearest leaves a stored ``value`` (a grid value of ``fmt``, unscaled
    formats) unchanged by ``value ← a·value + increment``: the change ``(a − 1)·value + increment``
    is less than half the grid step on the side it moves toward (ties keep the value: it is even
    only if its last mantissa bit is 0, so this is a conservative strict inequality)."""
    fmt = as_format(fmt)
    if fmt.scaled:
        raise ValueError(f"fmt: dead_band takes an unscaled format (fp32, bf16, fp16), got {fmt}")
    value = torch.as_tensor(value, dtype=torch.float64)
    change = (torch.as_tensor(decay, dtype=torch.float64) - 1.0) * value + torch.as_tensor(increment,
                                                                                            dtype=torch.float64)
    below, above = _grid_neighbours(fmt, value)
    return torch.where(change >= 0, change < above / 2, -change < below / 2)


@functools.lru_cache(maxsize=2)
def _steady_state_sample(fmt: StateFormat, dstate: int, headdim: int):
    """Fixed-seed sample of the exact steady state, relative to its rms: ``S ~ N(0, 1)`` in
    ``(headdim, dstate)`` blocks, stored (codes and dequantized values), and unit-rms increments
    ``x ⊗ B`` with ``x, B ~ N(0, 1)`` per block. Kept for the next decay (a report asks per head)."""
    gen = torch.Generator().manual_seed(0)
    blocks = max(1, _MONTE_CARLO_VALUES // (headdim * dstate))
    state = torch.randn(blocks, headdim, dstate, generator=gen)
    outer = torch.randn(blocks, headdim, 1, generator=gen) * torch.randn(blocks, 1, dstate, generator=gen)
    stored = quantize(state, fmt, generator=gen)
    return stored.data.float(), dequantize(stored), outer


@functools.lru_cache(maxsize=None)
def predicted_stalled_fraction(fmt, decay: float, dstate: int = 128, headdim: int = 64) -> float:
    """Share of stored codes that one step ``S̃ ← Q(a·S̃ + d)`` leaves unchanged at the exact steady
    state (fixed-seed Monte Carlo over 2**20 elements): ``S̃ = Q(S)`` with ``S ~ N(0, 1)``, increments
    ``d = sqrt(1 − a²)·x ⊗ B`` (the steady state's increment relative to ``σ_S``), codes compared as
    :func:`qstate.formats.quantize` gives them. The drift measure's stalled fraction, predicted."""
    fmt = as_format(fmt)
    decay = _decay("decay", decay)
    _dims(dstate, headdim, fmt)
    codes, stored, outer = _steady_state_sample(fmt, dstate, headdim)
    increment = math.sqrt(max(0.0, 1.0 - decay * decay))
    step = quantize(decay * stored + increment * outer, fmt, generator=torch.Generator().manual_seed(1))
    return float((step.data.float() == codes).double().mean())


def stagnation_predicted(fmt, decay: float, dstate: int = 128, headdim: int = 64) -> bool:
    """Round to nearest: most stored codes stop moving at the exact steady state
    (:func:`predicted_stalled_fraction` above the threshold the drift measure uses). Stochastic
    rounding is unbiased, so its state follows the exact one however small the increments; fp32
    is the reference."""
    fmt = as_format(fmt)
    _decay("decay", decay)
    _dims(dstate, headdim, fmt)
    if fmt.stochastic or fmt.dtype == "fp32":
        return False
    return predicted_stalled_fraction(fmt, decay, dstate, headdim) > STAGNATION_THRESHOLD


@dataclasses.dataclass
class Prediction:
    """Predicted relative errors at steps ``1..T`` for one head.

    ``applies``: the regime is one the formula describes (unbiased or stochastic rounding, read
    copies) and the storage rounding it models is the only rounding that matters. The drift
    engine updates and outputs conventional states in fp32 arithmetic, which the formula leaves
    out; its rounding is of the order of an fp32 state's storage rounding (measured 4–12× the
    prediction on fixed-decay heads), so a conventional ``fp32`` scheme never applies. Replay is
    computed in fp64 (as :func:`qstate.reference.decode_replay`), so an fp32 checkpoint's storage
    rounding is what it measures (a GPU fold in fp32 would add rounding of the same order).
    """

    output_error: np.ndarray  # [T]
    state_error: np.ndarray  # [T]
    stagnates: bool  # the dead band predicts stagnation (then the unbiased formula does not hold)
    applies: bool
    regime: str


def _state_variance(decay: float, u: float, steps: int) -> np.ndarray:
    """``σ_S²(t)`` for t = 0..steps (t = 0: zero state)."""
    t = np.arange(steps + 1)
    return u * u * (1.0 - decay ** (2 * t)) / (1.0 - decay * decay)


def _accumulate(decay2: float, source: np.ndarray) -> np.ndarray:
    """``v_t = decay2·v_{t−1} + source_t`` with ``v_0 = 0``; returns v_1..v_n."""
    out = np.empty_like(source)
    acc = 0.0
    for i, s in enumerate(source):
        acc = decay2 * acc + s
        out[i] = acc
    return out


def _relative_output(err_var: np.ndarray, state_var: np.ndarray, dstate: int, D: float) -> np.ndarray:
    return np.sqrt(err_var * dstate) / np.sqrt(state_var * dstate + D * D)


def predict(scheme, decay: float, steps: int, *, increment: float = 1.0, dstate: int = 128, headdim: int = 64,
            D: float = 1.0) -> Prediction:
    """Predicted relative output and state errors of ``scheme`` on a head with decay ``decay`` and
    rms increment ``increment`` (``u``), at every step ``1..steps`` from a zero state."""
    scheme = Scheme.parse(scheme)
    a = _decay("decay", decay)
    _validate.positive_int("steps", steps)
    u = _positive("increment", increment)
    _dims(dstate, headdim, scheme.fmt, scheme.checkpoint, scheme.read)
    D = _real("D", D)
    var = _state_variance(a, u, steps)  # [T+1]
    t = np.arange(1, steps + 1)
    if not scheme.is_replay:
        fmt = scheme.fmt
        r = rounding_rms(fmt, dstate, headdim)
        err_var = _accumulate(a * a, r * r * var[1:])  # e_t after storing step t
        prev = np.concatenate([[0.0], err_var[:-1]])  # the output of step t reads e_{t−1}, decayed
        out = _relative_output(a * a * prev, var[1:], dstate, D)
        stagnates = stagnation_predicted(fmt, a, dstate, headdim)
        # Head scales: rows of one head differ in size, which the i.i.d. model of r leaves out.
        unbiased = fmt.granularity != "head" and (
            fmt.stochastic or math.sqrt(max(0.0, 1 - a * a)) >= UNBIASED_MARGIN * r)
        if fmt.dtype == "fp32":  # rounds no more than the fp32 update and output do (Prediction.applies)
            regime = "fp32 arithmetic"
        else:
            regime = "stochastic" if fmt.stochastic else ("dead band" if stagnates else
                                                          ("unbiased" if unbiased else "near the dead band"))
        applies = unbiased and not stagnates and fmt.dtype != "fp32"
        return Prediction(out, np.sqrt(err_var / var[1:]), stagnates, applies, regime)

    L = scheme.ring_len
    r_ck = rounding_rms(scheme.checkpoint, dstate, headdim)
    r_rd = 0.0 if scheme.read is None else rounding_rms(scheme.read, dstate, headdim)
    flushes = np.arange(L, steps + 1, L)  # steps after which a checkpoint is written
    ck_var = _accumulate(a ** (2 * L), r_ck * r_ck * var[flushes]) if len(flushes) else np.zeros(0)
    last = (t - 1) // L  # flushes before the output of step t
    ck = np.concatenate([[0.0], ck_var])[last]  # error variance of the checkpoint read at step t
    c = last * L
    k = t - c
    # The token that fills the ring (k = L) outputs from the fold, not the read copy.
    read = np.where(k == L, 0.0, r_rd * r_rd * var[c])
    out = _relative_output(a ** (2 * k) * (ck + read), var[1:], dstate, D)
    state = np.sqrt(a ** (2 * k) * ck / var[1:])
    ck_fmt = scheme.checkpoint
    flush_increment = math.sqrt(max(0.0, 1 - a ** (2 * L)))
    unbiased = (ck_fmt.stochastic or ck_fmt.dtype == "fp32" or flush_increment >= UNBIASED_MARGIN * r_ck) and (
        "head" not in (ck_fmt.granularity, getattr(scheme.read, "granularity", None)))
    regime = "read copy" if scheme.read is not None else "checkpoint"
    return Prediction(out, state, False, unbiased, regime)


def head_parameters(inputs: _profiles.DecodeInputs, samples: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Effective ``(decay, increment)`` per head of sampled profile inputs, whose dt wanders by
    ``dt_raw ~ N(0, DT_NOISE²)``: ``a_eff² = E[a_t²]``, ``u² = E[dt²]`` (unit-variance x and B), so
    the steady states ``u² / (1 − a_eff²)`` match (fixed-seed Monte Carlo over dt)."""
    if not isinstance(inputs, _profiles.DecodeInputs):
        raise TypeError(f"inputs: expected a DecodeInputs, got {type(inputs).__name__}")
    _validate.positive_int("samples", samples)
    gen = torch.Generator().manual_seed(0)
    raw = DT_NOISE * torch.randn(samples, 1, generator=gen, dtype=torch.float64)
    dt = raw + inputs.dt_bias.double()
    if inputs.dt_softplus:
        dt = torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt)
    a2 = torch.exp(2 * dt * inputs.A.double()).mean(0)
    return a2.sqrt().numpy(), dt.square().mean(0).sqrt().numpy()


def synthetic_inputs(decays, steps: int, *, batch: int = 2, headdim: int = 16, dstate: int = 64, dt: float = 0.05,
                     seed: int = 0, D: float = 1.0) -> tuple[_profiles.Profile, _profiles.DecodeInputs]:
    """Heads with fixed decay (one per entry of ``decays``) and constant ``dt``: x, B, C ~ N(0, 1),
    no gate; ``dt`` enters through softplus so that ``DecodeInputs.decay()`` reports the decay.
    Decays lie in (0, 1) and ``dt`` (softplus's output) is positive, as ``a = exp(dt·A)`` needs."""
    decays = torch.as_tensor(decays, dtype=torch.float64)
    if decays.dim() != 1 or decays.numel() < 1:
        raise ValueError(f"decays: expected a non-empty sequence of decays, got shape {tuple(decays.shape)}")
    if not bool(((decays > 0) & (decays < 1)).all()):
        raise ValueError(f"decays: expected values in (0, 1), got {decays.tolist()}")
    for name, value in (("steps", steps), ("batch", batch), ("headdim", headdim), ("dstate", dstate)):
        _validate.positive_int(name, value)
    _positive("dt", dt)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    D = _real("D", D)
    n = decays.numel()
    gen = torch.Generator().manual_seed(seed)
    dt0 = torch.full((n,), float(dt), dtype=torch.float64)
    dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).float()  # inverse softplus
    dt_eff = torch.nn.functional.softplus(dt_bias.double())
    A = (torch.log(decays) / dt_eff).float()
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"dt: {dt} is too small: A = log(decay) / dt overflows fp32")
    profile = _profiles.Profile("synthetic", n, headdim, dstate, n, 1)
    inputs = _profiles.DecodeInputs(
        state0=torch.zeros(batch, n, headdim, dstate),
        x=torch.randn(steps, batch, n, headdim, generator=gen),
        dt=torch.zeros(steps, batch, n),
        A=A, B=torch.randn(steps, batch, n, dstate, generator=gen), C=torch.randn(steps, batch, n, dstate, generator=gen),
        D=torch.full((n,), float(D)), z=None, dt_bias=dt_bias, heads=torch.arange(n),
    )
    return profile, inputs


def measured_vs_predicted(result, j: int, increments: Optional[np.ndarray] = None,
                          decays: Optional[np.ndarray] = None, D: float = 1.0):
    """Per head of a :class:`DriftResult`: (measured, predicted) rms output error over every step of the
    whole measurement cycles in the second half of the run (``result.second_half_cycles()``: a
    replay scheme's error depends on where a step stands in its ring's cycle), and the
    :class:`Prediction` of each head."""
    p = result.profile
    decays = np.asarray(result.decay if decays is None else decays, dtype=float)
    increments = np.ones_like(decays) if increments is None else np.asarray(increments, dtype=float)
    chosen = result.second_half_cycles()
    measured = np.sqrt(np.mean(result.cycle_error[j][chosen] ** 2, axis=0))
    steps = np.concatenate([np.arange(end - result.cycle + 1, end + 1) for end in result.cycle_steps[chosen]])
    preds = [predict(result.schemes[j], float(a), result.steps, increment=float(u), dstate=p.dstate,
                     headdim=p.headdim, D=D) for a, u in zip(decays, increments)]
    predicted = np.array([np.sqrt(np.mean(pr.output_error[steps - 1] ** 2)) for pr in preds])
    return measured, predicted, preds
