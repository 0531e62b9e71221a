"""The vectorized drift engine of the gated delta rule (GDN and KDA): every scheme and the exact
fp64 recurrence on the same inputs, one Python iteration per time step, tensors over
``(batch, heads, V, K)``.

Number rules (those of :mod:`qstate.reference.gated_delta`, so the engine reproduces it; see
``tests/gated_delta/test_drift_delta.py``):

* exact: fp64, ``S ← S diag(α) + d k̂ᵀ`` with ``d = β (v − S diag(α) k̂)``, ``o = S q̂``;
* naive: fp32 arithmetic on the stored values, output from the unrounded state, then stored with
  :func:`roundtrip_` (scale groups over K); all naive schemes are stacked and updated together;
* replay, ``ring="inputs"``: one ring per ring length serves every scheme of that length. The
  adjoint sweep of the reference is kept in closed form: ``P = M_1 ⋯ M_n`` (``M_j = diag(α_j)
  (I − β_j k̂_j k̂_jᵀ)``, ``K × K``) and the ring's own state ``R`` (the recurrence from zero), so
  ``o = base · (P q̂) + R q̂`` and the flush stores ``S_c P + R``; one matvec per scheme and step;
* replay, ``ring="corrected"``: each scheme keeps ``W``, the recurrence from its read copy with
  the ring's corrected values (what the reference's fold of the read copy gives); the flushing
  token starts from ``W + (S_c − R_c) diag(Πα)`` (the fold of the checkpoint with the same
  corrected values), so a read copy's error reaches the checkpoint once per flush.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from qstate.reference.gated_delta import l2norm

from .roundtrip import roundtrip_
from .schemes import Scheme

__all__ = ["DeltaStepInputs", "DeltaExact", "DeltaNaive", "InputRingGroup", "CorrectedRingGroup", "ring_kind"]


def ring_kind(scheme: Scheme) -> str:
    """The ring a delta-rule replay scheme keeps: its own, or ``"inputs"`` when it names none."""
    return scheme.ring or "inputs"


@dataclasses.dataclass
class DeltaStepInputs:
    """Per value head, preprocessed once for all schemes (``Tc`` steps): ``q̂`` (scaled), ``k̂``
    ``[Tc, batch, HV, K]``, ``v [Tc, batch, HV, V]``, ``α [Tc, batch, HV, 1 or K]``, ``β [Tc, batch, HV]``."""

    q64: torch.Tensor
    k64: torch.Tensor
    v64: torch.Tensor
    alpha64: torch.Tensor
    beta64: torch.Tensor
    q32: torch.Tensor
    k32: torch.Tensor
    v32: torch.Tensor
    alpha32: torch.Tensor
    beta32: torch.Tensor

    @classmethod
    def build(cls, inp, device) -> "DeltaStepInputs":
        """From a :class:`qstate.profiles.DeltaRuleInputs` with the models' defaults (``l2`` norm of
        q and k in fp32, scale ``K^-1/2``), as :mod:`qstate.reference.gated_delta` computes them."""
        HV, K = inp.v.shape[2], inp.k.shape[-1]
        group = HV // inp.k.shape[2]
        qn, kn = l2norm(inp.q.to(device)), l2norm(inp.k.to(device))
        g = inp.g.to(device)
        if g.dim() == 3:  # one gate per head (GDN): broadcast over K
            g = g[..., None]
        out = {}
        for tag, f in (("64", torch.float64), ("32", torch.float32)):
            out["q" + tag] = qn.to(f).repeat_interleave(group, dim=-2) * K ** -0.5
            out["k" + tag] = kn.to(f).repeat_interleave(group, dim=-2)
            out["v" + tag] = inp.v.to(device=device, dtype=f)
            out["alpha" + tag] = torch.exp(g.to(f))
            out["beta" + tag] = inp.beta.to(device=device, dtype=f)
        return cls(**out)


def _update_(S: torch.Tensor, k, v, alpha, beta) -> None:
    """In place ``S ← S diag(α) + d k̂ᵀ``, ``d = β (v − S diag(α) k̂)``; ``S [..., batch, HV, V, K]``,
    the inputs without the leading dims (they broadcast)."""
    S.mul_(alpha[..., None, :])
    d = beta[..., None] * (v - torch.matmul(S, k[..., None])[..., 0])
    if S.dtype == torch.float64:
        S.addcmul_(d[..., None], k[..., None, :])  # one pass, no [..., V, K] temporary
    else:  # the naive schemes: the reference's two fp32 roundings (addcmul_ may fuse them)
        S.add_(d[..., None] * k[..., None, :])


def _read(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.matmul(S, q[..., None])[..., 0]


class DeltaExact:
    """The exact recurrence in fp64; ``state [batch, HV, V, K]``."""

    def __init__(self, state0: torch.Tensor):
        self.state = state0.to(torch.float64).clone()

    def step(self, s: DeltaStepInputs, i: int) -> torch.Tensor:
        _update_(self.state, s.k64[i], s.v64[i], s.alpha64[i], s.beta64[i])
        return _read(self.state, s.q64[i])


class DeltaNaive:
    """All naive schemes stacked: stored fp32 values ``[k, batch, HV, V, K]`` and, on request, the
    codes of the current and the previous step (for the stalled fraction)."""

    def __init__(self, schemes: list[Scheme], state0: torch.Tensor, generators: list[Optional[torch.Generator]]):
        self.schemes, self.generators = schemes, generators
        self.state = state0.to(torch.float32).expand(len(schemes), *state0.shape).clone()
        self.codes = torch.empty_like(self.state)
        self.previous_codes = torch.empty_like(self.state)
        for j in range(len(schemes)):
            self._store(j, self.codes[j])

    def _store(self, j: int, codes: Optional[torch.Tensor]) -> None:
        roundtrip_(self.state[j], self.schemes[j].fmt, self.generators[j], codes_out=codes)  # in place

    def step(self, s: DeltaStepInputs, i: int, keep_codes: bool) -> torch.Tensor:
        """Outputs ``[k, batch, HV, V]``; ``keep_codes`` as :class:`analysis.engine.Conventional`."""
        _update_(self.state, s.k32[i], s.v32[i], s.alpha32[i], s.beta32[i])
        y = _read(self.state, s.q32[i])
        if keep_codes:
            self.previous_codes, self.codes = self.codes, self.previous_codes
        for j in range(len(self.schemes)):
            self._store(j, self.codes[j] if keep_codes else None)
        return y

    def stalled(self) -> torch.Tensor:
        """``[k, HV]``: fraction of stored codes this step left unchanged."""
        return (self.codes == self.previous_codes).to(torch.float64).mean(dim=(1, 3, 4))

    def state_error_sq(self, exact: torch.Tensor) -> torch.Tensor:
        """``[k, HV]``: ``Σ (S̃ − S)²`` over batch, V and K."""
        return (self.state.double() - exact).square().sum(dim=(1, 3, 4))


class _ReplayGroup:
    """Stacked checkpoints and read copies of the replay schemes of one ring length and kind."""

    def __init__(self, schemes: list[Scheme], state0: torch.Tensor, generators: list[Optional[torch.Generator]]):
        self.schemes, self.generators = schemes, generators
        self.L = schemes[0].ring_len
        k = len(schemes)
        f = torch.float64
        self.checkpoint = torch.empty(k, *state0.shape, dtype=f, device=state0.device)
        self.checkpoint_codes = torch.empty(self.checkpoint.shape, dtype=torch.float32, device=state0.device)
        self.read = torch.empty_like(self.checkpoint)
        exact0 = state0.to(f)
        self._store(exact0.expand(k, *exact0.shape))
        self.ck_error_sq = (self.checkpoint - exact0).square().sum(dim=(1, 3, 4))  # [k, HV]
        self.ck_norm_sq = exact0.square().sum(dim=(0, 2, 3))  # [HV]
        self.stall = torch.zeros(k, state0.shape[1], dtype=f, device=state0.device)
        self.count = 0
        self.flushes = 0

    def _store(self, folded: torch.Tensor) -> None:
        """Round the folds to fp32, store the checkpoints (values and codes), rebuild the read
        copies (per scheme: checkpoint then read copy, the reference's order of noise draws)."""
        for j, (scheme, gen) in enumerate(zip(self.schemes, self.generators)):
            ck = roundtrip_(folded[j].to(torch.float32), scheme.checkpoint, gen, codes_out=self.checkpoint_codes[j])
            self.checkpoint[j].copy_(ck)
            self.read[j].copy_(ck if scheme.read is None else roundtrip_(ck.clone(), scheme.read, gen))

    def _flushed(self, folded: torch.Tensor, exact_state: torch.Tensor) -> None:
        previous_codes = self.checkpoint_codes.clone()
        self._store(folded)
        self.stall = (self.checkpoint_codes == previous_codes).to(torch.float64).mean(dim=(1, 3, 4))
        self.ck_error_sq = (self.checkpoint - exact_state).square().sum(dim=(1, 3, 4))
        self.ck_norm_sq = exact_state.square().sum(dim=(0, 2, 3))
        self.count = 0
        self.flushes += 1

    def checkpoint_error(self) -> torch.Tensor:
        """``[k, HV]``: relative error of the last stored checkpoint against the exact state of its step."""
        return (self.ck_error_sq / self.ck_norm_sq.clamp(min=1e-300)).sqrt()


class InputRingGroup(_ReplayGroup):
    """Replay schemes of one ring length whose ring holds the layer's inputs (``ring="inputs"``)."""

    def __init__(self, schemes, state0, generators):
        super().__init__(schemes, state0, generators)
        batch, HV, V, K = state0.shape
        f, dev = torch.float64, state0.device
        self.eye = torch.eye(K, dtype=f, device=dev).expand(batch, HV, K, K)
        self.P = self.eye.clone()  # M_1 ⋯ M_n
        self.R = torch.zeros(batch, HV, V, K, dtype=f, device=dev)  # the ring's state from zero

    def step(self, s: DeltaStepInputs, i: int, exact_state: torch.Tensor) -> torch.Tensor:
        """Outputs ``[k, batch, HV, V]`` of every scheme of the group for step ``i``."""
        k, q = s.k64[i], s.q64[i]
        self.P.mul_(s.alpha64[i][..., None, :])
        Pk = torch.matmul(self.P, k[..., None])  # [batch, HV, K, 1]
        self.P.addcmul_(s.beta64[i][..., None, None] * Pk, k[..., None, :], value=-1)
        _update_(self.R, k, s.v64[i], s.alpha64[i], s.beta64[i])
        self.count += 1
        flush = self.count == self.L
        # The token that fills the ring reads the checkpoint, not the read copy (decode_replay).
        base = self.checkpoint if flush else self.read
        y = torch.matmul(base, torch.matmul(self.P, q[..., None]))[..., 0] + _read(self.R, q)
        if flush:
            self._flushed(torch.matmul(self.checkpoint, self.P) + self.R, exact_state)
            self.P.copy_(self.eye)
            self.R.zero_()
        return y

    def state(self) -> torch.Tensor:
        """``[k, batch, HV, V, K]``: the states the checkpoints and the ring stand for."""
        return torch.matmul(self.checkpoint, self.P) + self.R


class CorrectedRingGroup(_ReplayGroup):
    """Replay schemes of one ring length whose ring holds corrected values (``ring="corrected"``)."""

    def __init__(self, schemes, state0, generators):
        super().__init__(schemes, state0, generators)
        batch, HV, V, K = state0.shape
        self.W = self.read.clone()  # the read copy with the ring folded in
        self.decay = torch.ones(batch, HV, K, dtype=torch.float64, device=state0.device)  # Πα since the flush

    def step(self, s: DeltaStepInputs, i: int, exact_state: torch.Tensor) -> torch.Tensor:
        k, v, alpha, beta = s.k64[i], s.v64[i], s.alpha64[i], s.beta64[i]
        self.count += 1
        if self.count < self.L:
            _update_(self.W, k, v, alpha, beta)
            self.decay.mul_(alpha)
            return _read(self.W, s.q64[i])
        # The flushing token reads the checkpoint: its fold uses the same corrected values.
        folded = self.W + (self.checkpoint - self.read) * self.decay[..., None, :]
        _update_(folded, k, v, alpha, beta)
        y = _read(folded, s.q64[i])
        self._flushed(folded, exact_state)
        self.W.copy_(self.read)
        self.decay.fill_(1.0)
        return y

    def state(self) -> torch.Tensor:
        """``[k, batch, HV, V, K]``: the fold of each checkpoint with the ring's corrected values."""
        return self.W + (self.checkpoint - self.read) * self.decay[..., None, :]
