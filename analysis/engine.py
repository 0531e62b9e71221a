"""The vectorized drift engine: every scheme and the exact fp64 recurrence on the same inputs,
one Python iteration per time step, tensors over ``(batch, heads, headdim, dstate)``.

Number rules (the same as :mod:`qstate.reference`, so the engine reproduces it; see
``tests/test_drift.py``):

* exact: fp64, ``S ← a·S + (dt·x) ⊗ B``;
* conventional: fp32 arithmetic on the stored values, output from the unrounded state, then
  stored with :func:`roundtrip_` (same ops, in place, as :func:`decode_naive`);
* replay: fp64 ring algebra exactly as :func:`decode_replay` (the ring holds inputs only, so one
  ring per ring length serves every scheme of that length; the read copies of all of them are
  stacked and read by one matmul per step).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from qstate.reference import process_dt

from .roundtrip import roundtrip_
from .schemes import Scheme

__all__ = ["StepInputs", "Exact", "Conventional", "ReplayGroup"]


@dataclasses.dataclass
class StepInputs:
    """One chunk of time steps, preprocessed once for all schemes (``Tc`` steps)."""

    a64: torch.Tensor  # [Tc, batch, heads] decay exp(dt·A)
    dt64: torch.Tensor  # [Tc, batch, heads] processed dt
    x64: torch.Tensor  # [Tc, batch, heads, headdim]
    B64: torch.Tensor  # [Tc, batch, heads, dstate] per head
    C64: torch.Tensor  # [Tc, batch, heads, dstate] per head
    dx64: torch.Tensor  # [Tc, batch, heads, headdim] dt·x
    Dx64: torch.Tensor  # [Tc, batch, heads, headdim] D·x
    gate64: Optional[torch.Tensor]  # [Tc, batch, heads, headdim] z·sigmoid(z)
    a32: torch.Tensor
    x32: torch.Tensor
    B32: torch.Tensor
    C32: torch.Tensor
    dx32: torch.Tensor
    Dx32: torch.Tensor
    gate32: Optional[torch.Tensor]
    A64: torch.Tensor  # [heads]

    @classmethod
    def build(cls, inp, device) -> "StepInputs":
        """From a :class:`qstate.profiles.DecodeInputs` (or a time slice of one)."""
        nheads = inp.x.shape[2]

        def per_head(t, dtype):
            return t.to(device=device, dtype=dtype).repeat_interleave(nheads // t.shape[-2], dim=-2)

        out = {}
        for tag, f in (("64", torch.float64), ("32", torch.float32)):
            A = inp.A.to(device=device, dtype=f)
            dtp = process_dt(inp.dt.to(device=device, dtype=f), inp.dt_bias.to(device=device, dtype=f),
                             inp.dt_softplus)
            x = inp.x.to(device=device, dtype=f)
            D = inp.D.to(device=device, dtype=f)
            out["a" + tag] = torch.exp(dtp * A)
            out["x" + tag] = x
            out["B" + tag] = per_head(inp.B, f)
            out["C" + tag] = per_head(inp.C, f)
            out["dx" + tag] = dtp[..., None] * x
            out["Dx" + tag] = D[:, None] * x
            z = None if inp.z is None else inp.z.to(device=device, dtype=f)
            out["gate" + tag] = None if z is None else z * torch.sigmoid(z)
            if tag == "64":
                out["dt64"], out["A64"] = dtp, A
        return cls(**out)


def _gated(y, Dx, gate):
    y = y + Dx
    return y if gate is None else y * gate


class Exact:
    """The exact recurrence in fp64; ``state`` ``[batch, heads, headdim, dstate]``."""

    def __init__(self, state0: torch.Tensor):
        self.state = state0.to(torch.float64).clone()
        self._outer = torch.empty_like(self.state)

    def step(self, s: StepInputs, i: int) -> torch.Tensor:
        torch.mul(s.dx64[i][..., None], s.B64[i][..., None, :], out=self._outer)
        self.state.mul_(s.a64[i][..., None, None]).add_(self._outer)
        y = torch.matmul(self.state, s.C64[i][..., None])[..., 0]
        return _gated(y, s.Dx64[i], s.gate64[i] if s.gate64 is not None else None)


class Conventional:
    """One conventional scheme: the stored state's fp32 values ``[batch, heads, headdim, dstate]``,
    and its codes (grid values before the scale multiply) at the steps the caller asks for."""

    def __init__(self, scheme: Scheme, state0: torch.Tensor, generator: Optional[torch.Generator]):
        self.scheme, self.fmt, self.generator = scheme, scheme.fmt, generator
        self.codes = torch.empty(state0.shape, dtype=torch.float32, device=state0.device)
        self.previous_codes = torch.empty_like(self.codes)
        self.state = roundtrip_(state0.to(torch.float32).clone(), self.fmt, generator, codes_out=self.codes)

    def step(self, s: StepInputs, i: int, outer32: torch.Tensor, keep_codes: bool) -> torch.Tensor:
        """``outer32 = (dt·x) ⊗ B`` in fp32, shared by all conventional schemes of the step.
        ``keep_codes``: keep this step's codes; :meth:`stalled` compares them with the previous
        step's, so keep them at every step whose stall is measured and at the step before it
        (a pass over the state that the other steps save)."""
        self.state.mul_(s.a32[i][..., None, None]).add_(outer32)
        y = torch.matmul(self.state, s.C32[i][..., None])[..., 0]
        y = _gated(y, s.Dx32[i], s.gate32[i] if s.gate32 is not None else None)
        if keep_codes:
            self.previous_codes, self.codes = self.codes, self.previous_codes
        roundtrip_(self.state, self.fmt, self.generator, codes_out=self.codes if keep_codes else None)
        return y

    def stalled(self) -> torch.Tensor:
        """Per head: fraction of stored codes this step left unchanged ``[heads]`` (a scale that
        follows the row maximum moves the values of a row whose codes stay)."""
        return (self.codes == self.previous_codes).to(torch.float64).mean(dim=(0, 2, 3))

    def state_error_sq(self, exact: torch.Tensor) -> torch.Tensor:
        """``Σ (S̃ − S)²`` per head over (batch, headdim, dstate) ``[heads]``."""
        return (self.state.double() - exact).square().sum(dim=(0, 2, 3))


class ReplayGroup:
    """All replay schemes of one ring length: one ring of inputs, stacked checkpoints and read copies."""

    def __init__(self, schemes: list[Scheme], state0: torch.Tensor, generators: list[Optional[torch.Generator]]):
        self.schemes, self.generators = schemes, generators
        self.L = schemes[0].ring_len
        batch, heads, P, N = state0.shape
        f, dev = torch.float64, state0.device
        self.ring_x = torch.zeros(self.L, batch, heads, P, dtype=f, device=dev)
        self.ring_B = torch.zeros(self.L, batch, heads, N, dtype=f, device=dev)
        self.ring_dt = torch.zeros(self.L, batch, heads, dtype=f, device=dev)
        self.count = 0
        k = len(schemes)
        self.checkpoint = torch.empty(k, batch, heads, P, N, dtype=f, device=dev)  # stored values
        self.checkpoint_codes = torch.empty(k, batch, heads, P, N, dtype=torch.float32, device=dev)
        self.read = torch.empty_like(self.checkpoint)  # what normal steps read
        exact0 = state0.to(f)
        self._store(exact0.expand(k, -1, -1, -1, -1))
        self.ck_error_sq = (self.checkpoint - exact0).square().sum(dim=(3, 4))  # [k, batch, heads]
        self.stall = torch.zeros(k, heads, dtype=f, device=dev)
        self.decay = torch.ones(batch, heads, dtype=f, device=dev)

    def _store(self, folded: torch.Tensor) -> None:
        """Round the folded states to fp32, store checkpoints (values and codes) and rebuild read
        copies (in order per scheme: checkpoint then read copy, like :func:`decode_replay` draws its
        noise)."""
        for j, (scheme, gen) in enumerate(zip(self.schemes, self.generators)):
            ck = roundtrip_(folded[j].to(torch.float32), scheme.checkpoint, gen, codes_out=self.checkpoint_codes[j])
            self.checkpoint[j].copy_(ck)
            if scheme.read is None:
                self.read[j].copy_(ck)
            else:
                self.read[j].copy_(roundtrip_(ck.clone(), scheme.read, gen))

    def step(self, s: StepInputs, i: int, exact_state: torch.Tensor) -> torch.Tensor:
        """Outputs ``[k, batch, heads, headdim]`` of every scheme of the group for step ``i``."""
        n = self.count
        self.ring_x[n], self.ring_B[n], self.ring_dt[n] = s.x64[i], s.B64[i], s.dt64[i]
        n += 1
        lam = torch.cumsum(self.ring_dt[:n], dim=0)  # [n, batch, heads]
        decay = torch.exp(s.A64 * lam[-1])  # [batch, heads]
        w = torch.exp(s.A64 * (lam[-1] - lam)) * self.ring_dt[:n]  # [n, batch, heads]
        C = s.C64[i]
        BC = (self.ring_B[:n] * C).sum(-1)  # [n, batch, heads]
        ring_y = torch.einsum("lbh,lbhp->bhp", w * BC, self.ring_x[:n])
        # The token that fills the ring outputs from the fold, which starts from the checkpoint,
        # not the read copy (decode_replay).
        base = self.checkpoint if n == self.L else self.read
        ck_y = torch.matmul(base, C[..., None])[..., 0]  # [k, batch, heads, headdim]
        y = _gated(decay[..., None] * ck_y + ring_y, s.Dx64[i], s.gate64[i] if s.gate64 is not None else None)
        self.decay = decay
        self.count = n
        if n == self.L:
            self._flush(decay, w, exact_state)
        return y

    def _flush(self, decay, w, exact_state) -> None:
        fold = torch.einsum("lbh,lbhp,lbhn->bhpn", w, self.ring_x, self.ring_B)
        previous_codes = self.checkpoint_codes.clone()
        self._store(decay[..., None, None] * self.checkpoint + fold)
        self.stall = (self.checkpoint_codes == previous_codes).to(torch.float64).mean(dim=(1, 3, 4))
        self.ck_error_sq = (self.checkpoint - exact_state).square().sum(dim=(3, 4))
        self.decay = torch.ones_like(decay)
        self.count = 0

    def state_error_sq(self) -> torch.Tensor:
        """Per scheme and head ``[k, heads]``: ``Σ (S_replay − S)²`` where the replay state (checkpoint
        with the ring folded in) differs from the exact one by the decayed checkpoint error only."""
        return (self.decay.square() * self.ck_error_sq).sum(dim=1)
