"""Gated delta rule references in plain torch: exact, naive quantized, and replay (GDN and KDA).

One token, per value head ``h`` with key head ``h // (HV / HK)``, the state ``S`` being ``V × K``::

    q̂ = l2(q) · scale,  k̂ = l2(k)          l2(x) = x / sqrt(Σx² + 1e-6), scale = K^-1/2 by default
    α = exp(g)                              one scalar per head (GDN) or one per key channel (KDA)
    S_t = S_{t−1} diag(α) (I − β k̂ k̂ᵀ) + β v k̂ᵀ
        = S_{t−1} diag(α) + d_t k̂ᵀ,          d_t = β (v − S_{t−1} diag(α) k̂)   (the corrected value)
    o_t = S_t q̂

Inputs are time-major:

====================  =============================================================
``state0``            ``(batch, HV, V, K)``: V-first, K contiguous (serving layout)
``q``, ``k``          ``(T, batch, HK, K)``
``v``                 ``(T, batch, HV, V)``
``g``                 ``(T, batch, HV)`` (GDN) or ``(T, batch, HV, K)`` (KDA): log-space gates, ``<= 0``
``beta``              ``(T, batch, HV)``, after the sigmoid: in ``[0, 1]``
====================  =============================================================

HV must be a multiple of HK. ``beta`` may reach 2 with ``allow_neg_eigval=True`` (the option
fla's GatedDeltaNet and KDA layers offer as ``allow_neg_eigval`` and OLMo-hybrid enables by
default; Qwen3-Next, Qwen3.5, Kimi Linear and GLM-5.3-Flash keep ``β = sigmoid(b)`` in [0, 1]).
Each function returns ``(o (T, batch, HV, V), final_state (batch, HV, V, K))``.

Number rules:

* With ``use_qk_l2norm`` (default), ``l2`` is computed in fp32 from the inputs cast to fp32, as
  transformers and fla do, and the result is then promoted; without it q and k are used as given.
* :func:`step`, :func:`decode_exact` and :func:`decode_replay` compute in fp64 (the scale is
  applied in fp64, ``α = exp(g)`` in fp64).
* :func:`decode_naive` computes in fp32, as a kernel does: the stored state is dequantized, updated
  in fp32, the output is taken from the *unrounded* new state, and the new state is quantized once
  for storage. A state format's scale groups run over K: ``row`` is one scale per V-row.
* :func:`decode_replay` stores its checkpoint in ``checkpoint`` after rounding the fp64 fold to
  fp32 (one quantization per flush) and its read copy as ``Q_read(deq(checkpoint))``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

from .. import _validate
from ..formats import FormatLike, as_format, dequantize, quantize

__all__ = ["step", "decode_exact", "decode_naive", "decode_replay", "decode_speculative", "l2norm", "RING_KINDS",
           "L2_EPS"]

L2_EPS = 1e-6  # the eps of transformers' and fla's l2 norm
RING_KINDS = ("inputs", "corrected")
_BETA_MAX = 1.0
_BETA_MAX_NEG_EIGVAL = 2.0


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σx² + 1e-6)`` over the last dim, in fp32 (whatever ``x``'s dtype)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


@dataclasses.dataclass(frozen=True)
class Dims:
    steps: int
    batch: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    channel_gate: bool  # KDA: g carries one gate per key channel


def _check(state0, q, k, v, g, beta, scale, use_qk_l2norm, allow_neg_eigval, *, time_major: bool = True) -> Dims:
    """Validate the arguments; each error names the argument, the expected and the actual value."""
    lead = int(time_major)
    tname = "T, " if time_major else ""
    for name, t, ndim in (("state0" if time_major else "state", state0, 4), ("q", q, 3 + lead),
                          ("k", k, 3 + lead), ("v", v, 3 + lead), ("beta", beta, 2 + lead)):
        _validate.tensor(name, t, ndim=ndim)
    _validate.tensor("g", g)
    sname = "state0" if time_major else "state"
    if g.dim() not in (2 + lead, 3 + lead):
        raise ValueError(f"g: expected {2 + lead} dimensions ({tname}batch, HV) for a per-head gate or {3 + lead} "
                         f"({tname}batch, HV, K) for a per-channel gate, got shape {tuple(g.shape)}")
    tlead = tuple(k.shape[:lead])
    if time_major and k.shape[0] < 1:
        raise ValueError(f"k: expected at least one step, got T = {k.shape[0]}")
    batch, HK, K = k.shape[lead:]
    _validate.shape("q", q, k.shape, f"({tname}batch, HK, K) as k")
    HV, V = v.shape[-2:]
    _validate.shape("v", v, tlead + (batch, HV, V), f"({tname}batch, HV, V) with {tname}batch of k")
    if HK < 1 or HV % HK:
        raise ValueError(f"v: the number of value heads HV must be a multiple of the key heads HK = {HK} (k), "
                         f"got HV = {HV}")
    if state0.shape[:2] != (batch, HV):
        raise ValueError(f"{sname}: expected shape (batch, HV, V, K) with batch = {batch}, HV = {HV} (from v), "
                         f"got {tuple(state0.shape)}")
    if state0.shape[2] != V:
        raise ValueError(f"{sname}: expected V = {V} (v's head_v_dim) in dim 2, got shape {tuple(state0.shape)}")
    if state0.shape[3] != K:
        raise ValueError(f"{sname}: expected K = {K} (k's head_k_dim) in dim 3, got shape {tuple(state0.shape)}")
    channel = g.dim() == 3 + lead
    g_shape = tlead + (batch, HV) + ((K,) if channel else ())
    _validate.shape("g", g, g_shape, f"({tname}batch, HV{', K' if channel else ''})")
    _validate.shape("beta", beta, tlead + (batch, HV), f"({tname}batch, HV)")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != state0.device:
            raise ValueError(f"{name}: expected device {state0.device} ({sname}'s), got {t.device}")
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"use_qk_l2norm: expected a bool, got {type(use_qk_l2norm).__name__}")
    if not isinstance(allow_neg_eigval, bool):
        raise TypeError(f"allow_neg_eigval: expected a bool, got {type(allow_neg_eigval).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale: expected None or a real number, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale: expected a finite number > 0, got {scale}")
    if g.numel() and not bool((g <= 0).all()):
        bad = g[~(g <= 0)]
        raise ValueError(f"g: expected log-space gates <= 0 (decay exp(g) <= 1), got {bad.flatten()[0].item()}")
    top = _BETA_MAX_NEG_EIGVAL if allow_neg_eigval else _BETA_MAX
    if beta.numel() and not bool(((beta >= 0) & (beta <= top)).all()):
        bad = beta[~((beta >= 0) & (beta <= top))]
        hint = "" if allow_neg_eigval else " (allow_neg_eigval=True allows [0, 2])"
        raise ValueError(f"beta: expected values in [0, {top:g}]{hint}, got {bad.flatten()[0].item()}")
    return Dims(int(k.shape[0]) if time_major else 1, batch, HK, HV, K, V, channel)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, dims: Dims, dtype: torch.dtype):
    """Per-value-head ``q̂, k̂ [.., HV, K]``, ``v``, ``α [.., HV, K]`` and ``β [.., HV]`` in ``dtype``."""
    group = dims.num_v_heads // dims.num_k_heads
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = dims.head_k_dim ** -0.5 if scale is None else float(scale)
    q = q.to(dtype).repeat_interleave(group, dim=-2) * scale
    k = k.to(dtype).repeat_interleave(group, dim=-2)
    alpha = torch.exp(g.to(dtype))
    if not dims.channel_gate:
        alpha = alpha[..., None].expand(*alpha.shape, dims.head_k_dim)
    return q, k, v.to(dtype), alpha, beta.to(dtype)


def _update(S, k, v, alpha, beta):
    """``S diag(α) + d k̂ᵀ`` with ``d = β (v − S diag(α) k̂)``, in the dtype of the arguments.

    ``S [batch, HV, V, K]``, ``k, α [batch, HV, K]``, ``v [batch, HV, V]``, ``β [batch, HV]``.
    Returns ``(new S, d [batch, HV, V])``."""
    S = S * alpha[..., None, :]
    d = beta[..., None] * (v - (S * k[..., None, :]).sum(-1))
    return S + d[..., None] * k[..., None, :], d


def _read(S, q):
    """``S q̂``: ``[batch, HV, V, K] · [batch, HV, K] → [batch, HV, V]``."""
    return (S * q[..., None, :]).sum(-1)


def step(state, q, k, v, g, beta, *, scale=None, use_qk_l2norm=True, allow_neg_eigval=False):
    """One decode token in fp64.

    ``state (batch, HV, V, K)``, ``q, k (batch, HK, K)``, ``v (batch, HV, V)``, ``g (batch, HV)``
    or ``(batch, HV, K)``, ``beta (batch, HV)``. Returns ``(o (batch, HV, V), new_state)``, fp64.
    """
    dims = _check(state, q, k, v, g, beta, scale, use_qk_l2norm, allow_neg_eigval, time_major=False)
    qh, kh, vv, alpha, b = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, dims, torch.float64)
    S, _ = _update(state.double(), kh, vv, alpha, b)
    return _read(S, qh), S


def decode_exact(state0, q, k, v, g, beta, *, scale=None, use_qk_l2norm=True, allow_neg_eigval=False):
    """The exact recurrence in fp64 over ``T`` tokens. Returns ``(o, final_state)``, fp64."""
    dims = _check(state0, q, k, v, g, beta, scale, use_qk_l2norm, allow_neg_eigval)
    qh, kh, vv, alpha, b = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, dims, torch.float64)
    S = state0.double()
    outs = []
    for t in range(dims.steps):
        S, _ = _update(S, kh[t], vv[t], alpha[t], b[t])
        outs.append(_read(S, qh[t]))
    return torch.stack(outs), S


def _generator(seed, generator) -> Optional[torch.Generator]:
    if seed is None:
        return generator
    if generator is not None:
        raise ValueError("seed: expected seed or generator, not both; got both")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed: expected None or an int, got {type(seed).__name__}")
    return torch.Generator().manual_seed(int(seed))


def decode_naive(
    state0, q, k, v, g, beta, *, fmt: FormatLike, scale=None, use_qk_l2norm=True, allow_neg_eigval=False,
    seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
):
    """The naive quantized recurrence: the state is stored in ``fmt`` and re-quantized every step.

    ``S̃_0 = Q(state0)``; each token computes ``S = deq(S̃) diag(α) + d k̂ᵀ`` in fp32, outputs
    ``o = S q̂`` from that unrounded ``S``, and stores ``S̃ = Q(S)`` (scale groups over K).
    Stochastic (``+sr``) formats draw their noise from ``generator``, or from a CPU generator
    seeded with ``seed`` (give at most one; neither: torch's default generator).
    Returns ``(o, final_state)`` in fp32, ``final_state = deq(S̃_T)``.
    """
    fmt = as_format(fmt, "fmt")
    dims = _check(state0, q, k, v, g, beta, scale, use_qk_l2norm, allow_neg_eigval)
    gen = _generator(seed, generator)
    qh, kh, vv, alpha, b = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, dims, torch.float32)
    stored = quantize(state0.float(), fmt, generator=gen)
    outs = []
    for t in range(dims.steps):
        S, _ = _update(dequantize(stored), kh[t], vv[t], alpha[t], b[t])
        outs.append(_read(S, qh[t]))
        stored = quantize(S, fmt, generator=gen)
    return torch.stack(outs), dequantize(stored)


class _InputRing:
    """The inputs since the checkpoint, fp64, each ``[batch, HV, …]``: k̂, v, α (per channel), β."""

    def __init__(self):
        self.k, self.v, self.alpha, self.beta = [], [], [], []

    def __len__(self):
        return len(self.k)

    def append(self, base, k, v, alpha, beta):
        """Keep the token's inputs (``base`` is unused: the inputs need no state)."""
        self.k.append(k)
        self.v.append(v)
        self.alpha.append(alpha)
        self.beta.append(beta)

    def output(self, base, q):
        """``S_t q̂`` by the adjoint sweep: the query is carried back through the ring's
        transitions (newest first) and meets ``base`` once at the end."""
        T = q
        o = torch.zeros_like(self.v[0])
        for k, v, alpha, beta in zip(reversed(self.k), reversed(self.v), reversed(self.alpha), reversed(self.beta)):
            c = beta * (k * T).sum(-1)  # [batch, HV]
            o = o + c[..., None] * v
            T = alpha * (T - c[..., None] * k)
        return o + _read(base, T)

    def fold(self, S):
        """The ring applied to ``S`` token by token."""
        for k, v, alpha, beta in zip(self.k, self.v, self.alpha, self.beta):
            S, _ = _update(S, k, v, alpha, beta)
        return S


class _CorrectedRing:
    """Corrected values ``d_j`` with their k̂ and α since the checkpoint, fp64.

    ``d_t = β (v − S_{t−1} diag(α) k̂)`` is computed from the state the step reads, rebuilt from
    the base it reads (read copy or checkpoint) as ``base diag(Πα) + Σ_j d_j (k̂_j ⊙ Π_{i>j} α_i)ᵀ``."""

    def __init__(self):
        self.k, self.d, self.alpha = [], [], []

    def __len__(self):
        return len(self.k)

    def fold(self, S):
        """``S diag(Πα) + Σ_j d_j (k̂_j ⊙ Π_{i>j} α_i)ᵀ``: linear in the stored d, no k̂k̂ᵀ terms."""
        for k, d, alpha in zip(self.k, self.d, self.alpha):
            S = S * alpha[..., None, :] + d[..., None] * k[..., None, :]
        return S

    def append(self, base, k, v, alpha, beta):
        """Keep the token's ``d``, computed from ``base`` with the ring folded in."""
        _, d = _update(self.fold(base), k, v, alpha, beta)
        self.k.append(k)
        self.d.append(d)
        self.alpha.append(alpha)

    def output(self, base, q):
        return _read(self.fold(base), q)


def decode_replay(
    state0, q, k, v, g, beta, *, checkpoint: FormatLike = "fp32", read: Optional[FormatLike] = None,
    ring_len: int = 16, ring: str = "inputs", scale=None, use_qk_l2norm=True, allow_neg_eigval=False,
    return_checkpoint: bool = False, seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
):
    """Replay decoding in fp64: a checkpoint, an optional read copy, and a ring of ``ring_len`` tokens.

    The checkpoint ``S_c`` is stored in ``checkpoint``; the read copy ``R_c = Q_read(deq(S_c))``
    in ``read`` (``None``: steps read ``deq(S_c)``). The initial checkpoint is ``Q_ck(state0)``.
    Each token joins the ring; the token that fills it (``ring_len`` tokens) flushes: it reads the
    checkpoint instead of the read copy, and its output is that of the new unrounded state. The
    flush folds the ring into ``S_c`` in fp64, rounds the fold to fp32, stores it in
    ``checkpoint`` and rebuilds the read copy from the stored checkpoint.

    ``ring="inputs"``: the ring holds ``(k̂, v, α, β)``. A step outputs ``o_t`` by the adjoint
    sweep (``T ← q̂``; newest first ``c = β_j k̂_j·T``, ``o += c v_j``, ``T = α_j ⊙ (T − c k̂_j)``;
    then ``o += R_c T``), and the flush applies the ring's tokens to ``S_c`` one by one. A read copy
    costs each output one rounding of the checkpoint carried through the ring's contraction and
    never reaches the checkpoint.

    ``ring="corrected"``: the ring holds the corrected values ``d_t = β (v − S_{t−1} diag(α) k̂)``
    with ``k̂`` and ``α``, where ``S_{t−1}`` is rebuilt from what the step reads (``R_c``, or
    ``S_c`` at a flush) and the ring; outputs and the flush use
    ``S = base diag(Πα) + Σ_j d_j (k̂_j ⊙ Π_{i>j} α_i)ᵀ``. With a read copy every ``d_j`` carries
    the read copy's error, and the flush writes it into the checkpoint: the checkpoint drifts by
    one read-copy error per flush.

    ``+sr`` formats draw their noise from ``generator`` or a CPU generator seeded with ``seed``.
    Returns ``(o, final_state)`` fp64, ``final_state`` being the checkpoint with the ring folded in.
    With ``return_checkpoint=True`` returns ``(o, final_state, checkpoint_values)``: the last
    stored checkpoint (after token ``ring_len · (T // ring_len)``; ``Q_ck(state0)`` when no
    flush happened) as fp64 values, the state the next flush would start from.
    """
    ck_fmt = as_format(checkpoint, "checkpoint")
    read_fmt = None if read is None else as_format(read, "read")
    _validate.positive_int("ring_len", ring_len)
    if ring not in RING_KINDS:
        raise ValueError(f"ring: expected one of {list(RING_KINDS)}, got {ring!r}")
    if not isinstance(return_checkpoint, bool):
        raise TypeError(f"return_checkpoint: expected a bool, got {type(return_checkpoint).__name__}")
    dims = _check(state0, q, k, v, g, beta, scale, use_qk_l2norm, allow_neg_eigval)
    gen = _generator(seed, generator)
    qh, kh, vv, alpha, b = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, dims, torch.float64)
    ring_type = _InputRing if ring == "inputs" else _CorrectedRing

    def store(S: torch.Tensor):
        ck_values = dequantize(quantize(S.float(), ck_fmt, generator=gen)).double()
        if read_fmt is None:
            return ck_values, ck_values
        return ck_values, dequantize(quantize(ck_values.float(), read_fmt, generator=gen)).double()

    S_c, R_c = store(state0)
    buf = ring_type()
    outs = []
    for t in range(dims.steps):
        flush = len(buf) + 1 == ring_len
        base = S_c if flush else R_c
        buf.append(base, kh[t], vv[t], alpha[t], b[t])
        outs.append(buf.output(base, qh[t]))
        if flush:
            S_c, R_c = store(buf.fold(S_c))
            buf = ring_type()
    o, final = torch.stack(outs), (buf.fold(S_c) if len(buf) else S_c)
    return (o, final, S_c) if return_checkpoint else (o, final)


def decode_speculative(
    state0, q, k, v, g, beta, num_accepted, *, checkpoint: FormatLike = "fp32", read: Optional[FormatLike] = None,
    ring_len: int = 16, scale=None, use_qk_l2norm=True, allow_neg_eigval=False, return_checkpoint: bool = False,
):
    """Speculative decoding on replay in fp64: ``R`` rounds of ``T`` drafts, each a verify and a commit.

    ``q, k (R, T, batch, HK, K)``, ``v (R, T, batch, HV, V)``, ``g (R, T, batch, HV)`` or ``(R,
    T, batch, HV, K)``, ``beta (R, T, batch, HV)``, ``num_accepted (R, batch)`` integers in
    ``0 … T``. Checkpoint and read copy are stored as in :func:`decode_replay`. In round r,
    draft t of a row outputs the exact recurrence from the read copy (the checkpoint without
    one) over the row's committed ring tokens and drafts ``0 … t`` (the adjoint sweep); the
    commit keeps the first ``num_accepted[r, row]`` drafts in the ring, and a row whose committed
    tokens reach ``ring_len`` folds them into the checkpoint (fp64 from the stored checkpoint,
    then stored) and rebuilds its read copy. Returns ``(o (R, T, batch, HV, V), final_state)``
    and, with ``return_checkpoint``, the stored checkpoints' values last.
    """
    ck_fmt = as_format(checkpoint, "checkpoint")
    read_fmt = None if read is None else as_format(read, "read")
    _validate.positive_int("ring_len", ring_len)
    if not isinstance(return_checkpoint, bool):
        raise TypeError(f"return_checkpoint: expected a bool, got {type(return_checkpoint).__name__}")
    _validate.tensor("k", k, ndim=5)
    R, T = k.shape[:2]
    flat = [t.reshape(R * T, *t.shape[2:]) if t.dim() >= 2 and t.shape[:2] == (R, T) else t
            for t in (q, k, v, g, beta)]
    dims = _check(state0, *flat, scale, use_qk_l2norm, allow_neg_eigval)
    if dims.steps != R * T:
        raise ValueError(f"q: expected leading dims (R, T) = ({R}, {T}) as k, got shape {tuple(q.shape)}")
    _validate.tensor("num_accepted", num_accepted, floating=False)
    _validate.shape("num_accepted", num_accepted, (R, dims.batch), "(R, batch)")
    if num_accepted.dtype.is_floating_point or num_accepted.dtype == torch.bool:
        raise TypeError(f"num_accepted: expected an integer tensor, got {num_accepted.dtype}")
    if num_accepted.numel() and not bool(((num_accepted >= 0) & (num_accepted <= T)).all()):
        raise ValueError(f"num_accepted: expected values in 0 … T = {T}, got {num_accepted.tolist()}")
    qh, kh, vv, alpha, b = (t.reshape(R, T, *t.shape[1:])
                            for t in _prepare(*flat, scale, use_qk_l2norm, dims, torch.float64))

    def store(S: torch.Tensor):
        ck_values = dequantize(quantize(S.float(), ck_fmt)).double()
        if read_fmt is None:
            return ck_values, ck_values
        return ck_values, dequantize(quantize(ck_values.float(), read_fmt)).double()

    o = torch.zeros(R, T, dims.batch, dims.num_v_heads, dims.head_v_dim, dtype=torch.float64)
    finals, checkpoints = [], []
    for row in range(dims.batch):
        pick = slice(row, row + 1)
        S_c, R_c = store(state0[pick].double())
        committed = _InputRing()
        for r in range(R):
            drafts = [(kh[r, t, pick], vv[r, t, pick], alpha[r, t, pick], b[r, t, pick]) for t in range(T)]
            for t in range(T):
                ring = _InputRing()
                for token in zip(committed.k, committed.v, committed.alpha, committed.beta):
                    ring.append(None, *token)
                for token in drafts[:t + 1]:
                    ring.append(None, *token)
                o[r, t, pick] = ring.output(R_c, qh[r, t, pick])
            for token in drafts[:int(num_accepted[r, row])]:
                committed.append(None, *token)
            if len(committed) >= ring_len:
                S_c, R_c = store(committed.fold(S_c))
                committed = _InputRing()
        finals.append(committed.fold(S_c))
        checkpoints.append(S_c)
    final, ck = torch.cat(finals), torch.cat(checkpoints)
    return (o, final, ck) if return_checkpoint else (o, final)
