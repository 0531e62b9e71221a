"""Predicted drift of a scheme on one gated delta rule head (derivations in ``analysis/README.md``,
section "Delta rule"; the recurrence in ``docs/design.md#gdn-recurrence``).

One token maps the state ``S`` (``V × K``) to ``S M_t + β v k̂ᵀ`` with ``M_t = diag(α_t) (I − β_t k̂_t
k̂_tᵀ)``. An error ``E`` in the state (a rounding, a read copy) is carried by the same ``M_t``: it
shrinks by ``1 − β`` along the token's key and by ``α`` alone in every direction no key touches.
With keys spread over all ``K`` directions (the profiles draw them isotropic), one step contracts
an error's mean square in key channel ``c`` by

    ρ_c² = E[α_c²] · (1 − E[β (2 − β)] / K),

and the state's mean square grows by ``E[β²]`` per row and step, so its steady state per element
is ``σ_S² = u² / (1 − ρ²)`` with ``u² = E[β²] / K``. These are the Mamba-2 head model's decay and
increment (:mod:`analysis.theory`) with ``a = ρ``: a slow head (``α → 1``) is still held to
``1 / (1 − ρ²) ≈ K / E[β(2 − β)]`` steps of memory by its keys, and behaves like a Mamba-2 head of
that decay; a fast head (``α`` well below 1) behaves like a Mamba-2 head of decay ``α``.

* naive, state stored in a format of relative rounding rms ``r``: ``σ_e²(t) = ρ² σ_e²(t−1) + r² σ_S²(t)``,
  closed form ``r² u² / (1 − ρ²) · [(1 − ρ^{2t}) / (1 − ρ²) − t ρ^{2t}]``; the output of step ``t``
  reads ``σ_e(t − 1)`` carried by one step;
* replay, ``inputs`` ring: the output ``k`` steps after a flush at ``c`` reads one read-copy error
  ``r_read σ_S(c)`` and the checkpoint's error carried through ``M_1 ⋯ M_k``: variance
  ``ρ^{2k} (ε_ck² + r_read² σ_S²(c))`` (no read term at ``k = L``, the flushing token reads the
  checkpoint); the checkpoint takes one storage rounding per flush, ``ε_m² = ρ^{2L} ε_{m−1}² +
  r_ck² σ_S²(mL)``;
* replay, ``corrected`` ring: the corrected values computed from the read copy carry its error
  ``E_r``, and the flush writes ``E_r (M_1 ⋯ M_L − diag(Πα))`` into the checkpoint, the part of the
  read-copy error the ring's keys touched: mean square ``c_L r_read² σ_S²`` with
  ``c_L = Πα² · [1 + (1 − E[β(2−β)]/K)^L − 2 (1 − E[β]/K)^L]`` (about ``L E[β²] / K`` times
  ``Πα²``). So ``ε_m² = ρ^{2L} ε_{m−1}² + r_ck² σ_S² + c_L r_read² σ_S²``: the checkpoint error grows
  with the flushes until the contraction balances it, at about ``r_read σ_S sqrt(c_L / (1 − ρ^{2L}))``
  (of the order of one read-copy error on slow heads).

Output error: ``o = S q̂`` with ``q̂`` independent of the error, so the relative output error is the
relative state error, pooled over key channels (KDA's channels each with their own ``ρ_c``).

Where the theory does not hold:

* keys that do not spread over all ``K`` directions (trained models' keys sit in a subspace): an
  error in a direction no key reaches decays by ``α`` alone, so slow heads keep it much longer than
  ``ρ`` says (a calibrated profile's keys are not modelled; the built-in profiles' are isotropic);
* round to nearest whose per-step change ``sqrt(1 − ρ²)`` is within a few rounding steps of the
  format: its errors are not independent of the state (the dead band of :mod:`analysis.theory`);
  the ``applies`` flag is off there, and for naive fp32, whose fp32 arithmetic rounds as much as
  its storage;
* KDA: ``k̂ k̂ᵀ`` couples the key channels, which the per-channel ``ρ_c`` treats as independent;
* the corrected ring's injection assumes the read-copy error is independent of the ring's keys;
* fast heads: their state is close to the last token's rank-one ``β v k̂ᵀ``, so ``‖o_ref‖`` swings
  with ``(k̂·q̂)²`` from step to step, and the rms of the relative error (a ratio) exceeds the ratio
  of the rms the theory gives: measured 1.2× the prediction at ``ρ = 0.5``, about 1.5× on
  Qwen3.5-9B's initial heads (``ρ ≤ 0.53``), within 2 % at ``ρ ≥ 0.93``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch

from .schemes import Scheme
from .theory import UNBIASED_MARGIN, rounding_rms

__all__ = ["DeltaHead", "DeltaPrediction", "head_parameters", "predict", "measured_vs_predicted"]

_PARAMETER_STEPS = 2048  # tokens sampled to estimate E[α²], E[β], E[β²] of each head


@dataclasses.dataclass(frozen=True)
class DeltaHead:
    """What the theory needs of one value head: ``alpha2`` ``E[α_c²]`` per gate channel (one for
    GDN), ``beta_mean`` ``E[β]``, ``beta_sq`` ``E[β²]``, and the key width ``K``."""

    alpha2: np.ndarray
    beta_mean: float
    beta_sq: float
    K: int

    @property
    def touched(self) -> float:
        """``E[β (2 − β)] / K``: the mean-square share of an error one key removes."""
        return (2.0 * self.beta_mean - self.beta_sq) / self.K

    @property
    def rho2(self) -> np.ndarray:
        """``ρ_c²`` per gate channel."""
        return self.alpha2 * (1.0 - self.touched)

    @property
    def increment2(self) -> float:
        """``u² = E[β²] / K``: the state's mean-square growth per element and step."""
        return self.beta_sq / self.K

    def effective_decay(self) -> float:
        """``sqrt(mean_c ρ_c²)``: one decay for the head, as a Mamba-2 head's ``a``."""
        return float(np.sqrt(np.mean(self.rho2)))


@dataclasses.dataclass
class DeltaPrediction:
    """Predicted relative errors at steps ``1..T`` of one head; ``checkpoint_error`` at the same
    steps for replay (the last stored checkpoint; None for naive); ``applies`` and ``regime`` as
    :class:`analysis.theory.Prediction`."""

    output_error: np.ndarray
    state_error: np.ndarray
    checkpoint_error: Optional[np.ndarray]
    applies: bool
    regime: str


def head_parameters(profile, heads, seed: int = 0) -> list[DeltaHead]:
    """:class:`DeltaHead` of each of ``heads`` of a delta-rule profile, from a fixed-seed sample of
    its gates and betas (:data:`_PARAMETER_STEPS` tokens)."""
    inp = profile.sample_inputs(_PARAMETER_STEPS, 1, heads=list(heads), seed=seed)
    g = inp.g.double()
    if g.dim() == 3:
        g = g[..., None]
    alpha2 = torch.exp(2.0 * g).mean(dim=(0, 1)).numpy()  # [heads, channels]
    beta = inp.beta.double()
    b1, b2 = beta.mean(dim=(0, 1)).numpy(), beta.square().mean(dim=(0, 1)).numpy()
    return [DeltaHead(alpha2[h], float(b1[h]), float(b2[h]), profile.head_k_dim) for h in range(len(heads))]


def _state_var(rho2: np.ndarray, u2: float, t: np.ndarray) -> np.ndarray:
    """``σ_S²(t)`` per channel: ``[C, len(t)]``."""
    r = rho2[:, None]
    return u2 * (1.0 - r ** t) / (1.0 - r)


def _pool(err_var: np.ndarray, state_var: np.ndarray) -> np.ndarray:
    """Relative error pooled over channels."""
    return np.sqrt(err_var.sum(0) / np.maximum(state_var.sum(0), 1e-300))


def _naive(head: DeltaHead, fmt, steps: int, K: int, V: int) -> DeltaPrediction:
    r2 = rounding_rms(fmt, K, V) ** 2
    rho2, u2 = np.minimum(head.rho2, 1 - 1e-15), head.increment2
    t = np.arange(1, steps + 1, dtype=float)
    r = rho2[:, None]
    err = r2 * u2 / (1.0 - r) * ((1.0 - r ** t) / (1.0 - r) - t * r ** t)  # after storing step t
    prev = np.concatenate([np.zeros((len(rho2), 1)), err[:, :-1]], axis=1)
    var = _state_var(rho2, u2, t)
    out = _pool(r * prev, var)
    change = math.sqrt(max(0.0, 1.0 - float(np.mean(rho2))))
    unbiased = fmt.granularity != "head" and (fmt.stochastic or change >= UNBIASED_MARGIN * math.sqrt(r2))
    if fmt.dtype == "fp32":
        regime = "fp32 arithmetic"
    else:
        regime = "stochastic" if fmt.stochastic else ("unbiased" if unbiased else "near the dead band")
    return DeltaPrediction(out, _pool(err, var), None, unbiased and fmt.dtype != "fp32", regime)


def _replay(head: DeltaHead, scheme: Scheme, steps: int, K: int, V: int) -> DeltaPrediction:
    L = scheme.ring_len
    r_ck2 = rounding_rms(scheme.checkpoint, K, V) ** 2
    r_rd2 = 0.0 if scheme.read is None else rounding_rms(scheme.read, K, V) ** 2
    rho2, u2 = np.minimum(head.rho2, 1 - 1e-15), head.increment2
    C = len(rho2)
    t = np.arange(1, steps + 1)
    var = _state_var(rho2, u2, t.astype(float))
    flushes = np.arange(L, steps + 1, L)
    leak = np.zeros(C)  # c_L · r_read² per channel: what a flush writes of the read copy's error
    if scheme.ring == "corrected":
        c_L = head.alpha2 ** L * (1.0 + (1.0 - head.touched) ** L - 2.0 * (1.0 - head.beta_mean / K) ** L)
        leak = np.maximum(c_L, 0.0) * r_rd2
    ck = np.zeros((C, len(flushes) + 1))  # before any flush, then after each
    for m, step in enumerate(flushes):
        # The leak comes from the read copy of the previous flush (the first reads Q(state0) = 0).
        read_var = var[:, step - L - 1] if m else np.zeros(C)
        ck[:, m + 1] = rho2 ** L * ck[:, m] + r_ck2 * var[:, step - 1] + leak * read_var
    last = (t - 1) // L  # flushes before the output of step t
    k = t - last * L
    c = last * L
    var_c = np.where(c > 0, var[:, np.maximum(c, 1) - 1], 0.0)
    read = np.where(k == L, 0.0, r_rd2 * var_c)
    read = read + np.where(k == L, leak[:, None] * var_c, 0.0)  # the flushing token's fold carries the leak
    carry = rho2[:, None] ** k  # [C, T]
    out = _pool(carry * (ck[:, last] + read), var)
    state = _pool(carry * ck[:, last], var)
    stored = t // L  # flushes up to and including step t
    var_ck = np.where(stored > 0, var[:, np.maximum(stored * L, 1) - 1], 1.0)
    ck_rel = _pool(ck[:, stored], var_ck)
    fmts = (scheme.checkpoint, scheme.read)
    unbiased = all(f is None or f.granularity != "head" for f in fmts)
    return DeltaPrediction(out, state, ck_rel, unbiased, "read copy" if scheme.read is not None else "checkpoint")


def predict(scheme, head: DeltaHead, steps: int, *, V: int = 128) -> DeltaPrediction:
    """Predicted relative output, state and (replay) checkpoint errors of ``scheme`` on ``head``
    at every step ``1..steps`` from a zero state (``V``: the head's value width)."""
    scheme = Scheme.parse(scheme)
    if not isinstance(head, DeltaHead):
        raise TypeError(f"head: expected a DeltaHead, got {type(head).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    if not scheme.is_replay:
        return _naive(head, scheme.fmt, steps, head.K, V)
    return _replay(head, scheme, steps, head.K, V)


def measured_vs_predicted(result, j: int, heads: Optional[list[DeltaHead]] = None):
    """Per head of a delta-rule :class:`DriftResult`: (measured, predicted) rms output error over every
    step of the whole measurement cycles in the second half of the run (``result.second_half_cycles()``),
    and the :class:`DeltaPrediction` of each head."""
    p = result.profile
    heads = head_parameters(p, result.heads, result.seed) if heads is None else heads
    chosen = result.second_half_cycles()
    measured = np.sqrt(np.mean(result.cycle_error[j][chosen] ** 2, axis=0))
    steps = np.concatenate([np.arange(end - result.cycle + 1, end + 1) for end in result.cycle_steps[chosen]])
    preds = [predict(result.schemes[j], h, result.steps, V=p.head_v_dim) for h in heads]
    predicted = np.array([np.sqrt(np.mean(pr.output_error[steps - 1] ** 2)) for pr in preds])
    return measured, predicted, preds
