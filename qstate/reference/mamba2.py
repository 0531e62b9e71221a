"""Reference recurrences in plain torch: exact, naive quantized, and replay (docs/design.md#recurrence to #read-copy).

Inputs are time-major and in compact Mamba-2 form:

====================  ==================================
``state0``            ``(batch, nheads, headdim, dstate)``
``x``, ``z``          ``(T, batch, nheads, headdim)``
``dt``                ``(T, batch, nheads)``
``B``, ``C``          ``(T, batch, ngroups, dstate)``
``A``, ``D``,         ``(nheads,)``
``dt_bias``
====================  ==================================

Each returns ``(y, final_state)`` with ``y (T, batch, nheads, headdim)``. Number rules:

* :func:`decode_exact` and :func:`decode_replay` compute in fp64.
* :func:`decode_naive` computes in fp32, as a kernel does: the stored state is dequantized,
  updated as ``a·S + (dt·x) ⊗ B`` in fp32, the output is taken from the *unrounded* new state,
  and the new state is quantized once for storage.
* ``dt`` is processed as ``dt + dt_bias`` and, with ``dt_softplus``, ``softplus`` of that
  (left as is above 20, like the kernels).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _validate
from ..formats import FormatLike, as_format, dequantize, quantize

__all__ = ["mamba2_step", "decode_exact", "decode_naive", "decode_replay", "process_dt"]


def process_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor] = None, dt_softplus: bool = False) -> torch.Tensor:
    """``dt + dt_bias`` then ``softplus`` (identity above 20), in ``dt``'s dtype."""
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus: expected a bool, got {type(dt_softplus).__name__}")
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt)
    return dt


def _per_head(BC: torch.Tensor, nheads: int) -> torch.Tensor:
    """``(..., ngroups, dstate)`` → ``(..., nheads, dstate)``: head h reads group h // (nheads / ngroups)."""
    return BC.repeat_interleave(nheads // BC.shape[-2], dim=-2)


def _output(y: torch.Tensor, x: torch.Tensor, D, z) -> torch.Tensor:
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * x
    if z is not None:
        y = y * z * torch.sigmoid(z)
    return y


def _update(S, x, dtp, A, Bh):
    """One step in the dtype of its arguments: ``a·S + (dt·x) ⊗ B``."""
    a = torch.exp(dtp * A)  # [batch, nheads]
    return a[..., None, None] * S + (dtp[..., None] * x)[..., None] * Bh[..., None, :]


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """One decode token in fp64.

    ``state (batch, nheads, headdim, dstate)``, ``x, z (batch, nheads, headdim)``,
    ``dt (batch, nheads)``, ``B, C (batch, ngroups, dstate)``, ``A, D, dt_bias (nheads,)``.
    Returns ``(y (batch, nheads, headdim), new_state (batch, nheads, headdim, dstate))``, both fp64.
    """
    dims = _validate.decode_inputs(state, x, dt, A, B, C, D, z, dt_bias)
    f = torch.float64
    dtp = process_dt(dt.to(f), None if dt_bias is None else dt_bias.to(f), dt_softplus)
    S = _update(state.to(f), x.to(f), dtp, A.to(f), _per_head(B.to(f), dims.nheads))
    y = (S * _per_head(C.to(f), dims.nheads)[..., None, :]).sum(-1)
    return _output(y, x.to(f), None if D is None else D.to(f), None if z is None else z.to(f)), S


def _time_major(state0, x, dt, A, B, C, D, z, dt_bias):
    return _validate.decode_inputs(state0, x, dt, A, B, C, D, z, dt_bias, time_major=True)


def decode_exact(state0, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
    """The exact recurrence in fp64 over ``T`` tokens. Returns ``(y, final_state)``, fp64."""
    _time_major(state0, x, dt, A, B, C, D, z, dt_bias)
    S = state0.double()
    ys = []
    for t in range(x.shape[0]):
        y, S = mamba2_step(S, x[t], dt[t], A, B[t], C[t], D, None if z is None else z[t], dt_bias, dt_softplus)
        ys.append(y)
    return torch.stack(ys), S


def decode_naive(
    state0, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, *,
    fmt: FormatLike, generator: Optional[torch.Generator] = None,
):
    """The naive quantized recurrence: the state is stored in ``fmt`` and re-quantized every step.

    ``S̃_0 = Q(state0)``; each token computes ``S = a·deq(S̃) + (dt·x) ⊗ B`` in fp32, outputs
    ``y = S·C + D·x`` (gated by z) from that unrounded ``S``, and stores ``S̃ = Q(S)``.
    Stochastic formats draw their noise from ``generator``.
    Returns ``(y, final_state)`` in fp32, ``final_state = deq(S̃_T)``.
    """
    fmt = as_format(fmt, "fmt")
    dims = _time_major(state0, x, dt, A, B, C, D, z, dt_bias)
    f = torch.float32
    A32 = A.to(f)
    D32 = None if D is None else D.to(f)
    bias = None if dt_bias is None else dt_bias.to(f)
    stored = quantize(state0.float(), fmt, generator=generator)
    ys = []
    for t in range(x.shape[0]):
        dtp = process_dt(dt[t].to(f), bias, dt_softplus)
        xt = x[t].to(f)
        S = _update(dequantize(stored), xt, dtp, A32, _per_head(B[t].to(f), dims.nheads))
        y = (S * _per_head(C[t].to(f), dims.nheads)[..., None, :]).sum(-1)
        ys.append(_output(y, xt, D32, None if z is None else z[t].to(f)))
        stored = quantize(S, fmt, generator=generator)
    return torch.stack(ys), dequantize(stored)


class _Ring:
    """The inputs since the checkpoint, fp64: x ``[L, batch, nheads, headdim]``, processed dt
    ``[L, batch, nheads]``, B per head ``[L, batch, nheads, dstate]``."""

    def __init__(self):
        self.x, self.dt, self.B = [], [], []

    def __len__(self):
        return len(self.x)

    def append(self, x, dt, B):
        self.x.append(x)
        self.dt.append(dt)
        self.B.append(B)

    def weights(self, A):
        """``exp(A·Λ_t)`` ``[batch, nheads]`` and ``exp(A·(Λ_t − Λ_j))·dt_j`` ``[n, batch, nheads]``."""
        dts = torch.stack(self.dt)
        lam = torch.cumsum(dts, dim=0)
        return torch.exp(A * lam[-1]), torch.exp(A * (lam[-1] - lam)) * dts

    def fold(self, S, A):
        """``exp(A·Λ_t)·S + Σ_j exp(A·(Λ_t − Λ_j))·dt_j · x_j ⊗ B_j``."""
        if not self.x:
            return S
        decay, w = self.weights(A)
        xs, Bs = torch.stack(self.x), torch.stack(self.B)
        return decay[..., None, None] * S + torch.einsum("lbh,lbhp,lbhn->bhpn", w, xs, Bs)


def decode_replay(
    state0, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, *,
    checkpoint: FormatLike = "fp32", read: Optional[FormatLike] = None, ring_len: int = 16,
    generator: Optional[torch.Generator] = None,
):
    """Replay decoding (docs/design.md#replay, #read-copy), in fp64.

    The checkpoint ``S_c`` is stored in ``checkpoint``; the read copy ``R_c = Q_read(deq(S_c))``
    in ``read`` (``None``: outputs read ``deq(S_c)``). Each token joins the ring and outputs

        y_t = exp(A·Λ_t)·(R_c·C_t) + Σ_j exp(A·(Λ_t − Λ_j))·dt_j·(B_j·C_t)·x_j + D·x_t

    except the token that fills the ring (``ring_len`` tokens): it flushes, and its output comes
    from the fold itself, ``y_t = S_t·C_t + D·x_t`` with ``S_t = exp(A·Λ_t)·deq(S_c) + Σ_j …``
    the unrounded new state (docs/design.md#recurrence), i.e. the formula above with ``deq(S_c)`` in place of
    ``R_c``: a flush reads the checkpoint instead of the read copy (docs/design.md#read-copy). The fold is computed in
    fp64, rounded to fp32 and stored in ``checkpoint`` (one quantization per flush), and the read
    copy is rebuilt from the stored checkpoint. The initial checkpoint is ``Q_ck(state0)``.

    Error of a read copy: outputs differ from the same recurrence without a read copy by
    ``exp(A·Λ_t)·((R_c − S_c)·C_t)`` only (nothing at a flush), so for output element p
    ``|Δy_p| ≤ exp(A·Λ_t) · Σ_n |R_c − S_c|_{p,n} · |C_t,n|`` with ``|R_c − S_c|`` at most half
    a grid step of the read format at that element (round-to-nearest) times its scale: the error
    is one quantization of the checkpoint, decayed, and does not accumulate across steps.

    Returns ``(y, final_state)`` fp64; ``final_state`` is the checkpoint with the ring folded in.
    """
    ck_fmt = as_format(checkpoint, "checkpoint")
    read_fmt = None if read is None else as_format(read, "read")
    _validate.positive_int("ring_len", ring_len)
    dims = _time_major(state0, x, dt, A, B, C, D, z, dt_bias)
    f = torch.float64
    A64 = A.to(f)
    D64 = None if D is None else D.to(f)
    bias = None if dt_bias is None else dt_bias.to(f)

    def store(S: torch.Tensor):
        ck = quantize(S.float(), ck_fmt, generator=generator)
        ck_values = dequantize(ck).double()
        if read_fmt is None:
            return ck_values, ck_values
        return ck_values, dequantize(quantize(ck_values.float(), read_fmt, generator=generator)).double()

    S_c, R_c = store(state0)
    ring = _Ring()
    ys = []
    for t in range(x.shape[0]):
        xt = x[t].to(f)
        Ct = _per_head(C[t].to(f), dims.nheads)
        ring.append(xt, process_dt(dt[t].to(f), bias, dt_softplus), _per_head(B[t].to(f), dims.nheads))
        decay, w = ring.weights(A64)
        BC = (torch.stack(ring.B) * Ct).sum(-1)  # [n, batch, nheads]
        flush = len(ring) == ring_len
        base = S_c if flush else R_c
        ring_y = torch.einsum("lbh,lbhp->bhp", w * BC, torch.stack(ring.x))
        y = decay[..., None] * (base * Ct[..., None, :]).sum(-1) + ring_y
        ys.append(_output(y, xt, D64, None if z is None else z[t].to(f)))
        if flush:
            S_c, R_c = store(ring.fold(S_c, A64))
            ring = _Ring()
    return torch.stack(ys), ring.fold(S_c, A64)

