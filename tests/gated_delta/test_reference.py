"""Gated delta rule references: exact, naive quantized and replay agree where the math says they must."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from helpers import ci_examples
from qstate.reference import gated_delta as gd

EPS32 = 2.0**-24
RING_LENGTHS = (1, 2, 5, 16, 32)


def random_inputs(T, batch=2, HK=2, HV=4, K=8, V=6, channel=False, seed=0, g_scale=0.5, beta_max=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    gate_shape = (T, batch, HV, K) if channel else (T, batch, HV)
    return dict(
        state0=r(batch, HV, V, K), q=r(T, batch, HK, K), k=r(T, batch, HK, K), v=r(T, batch, HV, V),
        g=-g_scale * torch.rand(*gate_shape, generator=g),
        beta=beta_max * torch.rand(T, batch, HV, generator=g),
    )


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def state_norms(inp, **kw):
    """Frobenius norm of the exact state after every token, ``[T]``."""
    norms, S = [], inp["state0"]
    for t in range(inp["q"].shape[0]):
        _, S = gd.step(S, *(inp[n][t] for n in ("q", "k", "v", "g", "beta")), **kw)
        norms.append(S.norm())
    return torch.stack(norms)


# ----------------------------------------------------------------------------- one step

def product_form(S, q, k, v, g, beta, group):
    """``S diag(α) (I − β k̂k̂ᵀ) + β v k̂ᵀ`` and ``S q̂`` with explicit K×K matrices, per (batch, head)."""
    batch, HV, V, K = S.shape
    qh = torch.nn.functional.normalize(q.double(), dim=-1) * K**-0.5
    kh = torch.nn.functional.normalize(k.double(), dim=-1)
    out_S, out_o = torch.empty_like(S, dtype=torch.float64), torch.empty(batch, HV, V, dtype=torch.float64)
    for b in range(batch):
        for h in range(HV):
            kk, qq = kh[b, h // group], qh[b, h // group]
            alpha = torch.exp(g[b, h].double()) * torch.ones(K, dtype=torch.float64)
            M = torch.diag(alpha) @ (torch.eye(K, dtype=torch.float64) - beta[b, h].double() * torch.outer(kk, kk))
            out_S[b, h] = S[b, h].double() @ M + beta[b, h].double() * torch.outer(v[b, h].double(), kk)
            out_o[b, h] = out_S[b, h] @ qq
    return out_o, out_S


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_decode_exact_matches_the_product_form(channel):
    inp = random_inputs(4, HK=2, HV=6, K=8, V=5, channel=channel, beta_max=2.0, seed=1)
    # Inputs already of unit norm (up to the l2 eps, 1e-6 against |x|² = 1) so that the fp32 l2 of
    # the reference and the fp64 normalize here agree to fp64 rounding; then no l2 in the reference.
    for name in ("q", "k"):
        inp[name] = torch.nn.functional.normalize(inp[name].double(), dim=-1)
    o, S = gd.decode_exact(**inp, use_qk_l2norm=False, allow_neg_eigval=True)
    S_ref = inp["state0"].double()
    for t in range(4):
        o_ref, S_ref = product_form(S_ref, *(inp[n][t] for n in ("q", "k", "v", "g", "beta")), group=3)
        assert rel(o[t], o_ref) < 1e-13
    assert o.dtype == S.dtype == torch.float64 and rel(S, S_ref) < 1e-13


def test_l2norm_is_computed_in_fp32_with_its_eps():
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 1e-4  # small vectors: the eps matters
    expected = x.float() / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    assert torch.equal(gd.l2norm(x), expected) and gd.l2norm(x).dtype == torch.float32
    inp = random_inputs(1)
    o, _ = gd.decode_exact(**inp)
    q = gd.l2norm(inp["q"]).double() * 8**-0.5
    k = gd.l2norm(inp["k"]).double()
    o2, _ = gd.decode_exact(**{**inp, "q": q, "k": k}, use_qk_l2norm=False, scale=1.0)
    assert torch.equal(o, o2)


def test_step_repeated_is_decode_exact_and_scale_is_applied():
    inp = random_inputs(5, channel=True)
    o, S = gd.decode_exact(**inp, scale=0.3)
    St = inp["state0"]
    for t in range(5):
        ot, St = gd.step(St, *(inp[n][t] for n in ("q", "k", "v", "g", "beta")), scale=0.3)
        assert torch.equal(ot, o[t])
    assert torch.equal(St, S)
    o_default, _ = gd.decode_exact(**inp)
    assert torch.allclose(o * 8**-0.5 / 0.3, o_default, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- naive

@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_naive_fp32_is_exact_to_fp32_rounding(channel):
    inp = random_inputs(24, channel=channel)
    o, S = gd.decode_exact(**inp)
    o32, S32 = gd.decode_naive(**inp, fmt="fp32")
    assert o32.dtype == S32.dtype == torch.float32
    # Each step rounds a handful of fp32 operations per element; the transition does not expand.
    assert rel(o32, o) < 64 * EPS32 * math.sqrt(24) and rel(S32, S) < 64 * EPS32 * math.sqrt(24)


def test_naive_stores_the_state_in_its_format_every_step():
    inp = random_inputs(3)
    _, S = gd.decode_naive(**inp, fmt="int8:row")
    from qstate.formats import dequantize, quantize
    assert torch.equal(S, dequantize(quantize(S, "int8:row")))  # on the grid of its own scales
    _, Sb = gd.decode_naive(**inp, fmt="bf16")
    assert torch.equal(Sb, Sb.bfloat16().float())


def test_naive_sr_is_reproducible_by_seed_or_generator():
    inp = random_inputs(6)
    a = gd.decode_naive(**inp, fmt="int8:row+sr", seed=5)
    b = gd.decode_naive(**inp, fmt="int8:row+sr", generator=torch.Generator().manual_seed(5))
    c = gd.decode_naive(**inp, fmt="int8:row+sr", seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])
    with pytest.raises(ValueError, match="seed"):
        gd.decode_naive(**inp, fmt="int8:row+sr", seed=5, generator=torch.Generator())


# ----------------------------------------------------------------------------- replay

@pytest.mark.parametrize("ring", gd.RING_KINDS)
@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_replay_fp32_without_read_copy_is_exact(ring, channel):
    T = 40
    inp = random_inputs(T, channel=channel, seed=2)
    o, S = gd.decode_exact(**inp)
    norms = state_norms(inp)
    qnorm = (gd.l2norm(inp["q"]).double() * 8**-0.5).norm(dim=-1).max()
    for L in RING_LENGTHS:
        o2, S2, ck = gd.decode_replay(**inp, ring=ring, ring_len=L, return_checkpoint=True)
        flushes = T // L
        # Each flush rounds the checkpoint to fp32 (≤ EPS32 relative per element); the transitions
        # that follow do not expand an error (α ≤ 1, ‖I − βk̂k̂ᵀ‖ ≤ 1), so errors add up at most.
        bound = flushes * EPS32 * norms.max().item() + 1e-12
        assert (S2 - S).norm().item() <= bound, (L, ring)
        assert (o2 - o).norm(dim=-1).max().item() <= bound * qnorm.item(), (L, ring)
        _, S_at = gd.decode_exact(**{n: (t[: flushes * L] if n != "state0" else t) for n, t in inp.items()}) \
            if flushes else (None, inp["state0"].double())
        assert (ck - S_at).norm().item() <= bound


def test_replay_checkpoint_rounding_is_once_per_flush():
    inp = random_inputs(32)
    inp["state0"] = inp["state0"].bfloat16().float()  # the initial checkpoint is stored as it is
    _, S = gd.decode_exact(**inp)
    _, _, ck = gd.decode_replay(**inp, checkpoint="bf16", ring_len=32, return_checkpoint=True)
    assert torch.equal(ck, S.float().bfloat16().double())


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_corrected_ring_leaks_the_read_copy_into_the_checkpoint(channel):
    # Slow heads and small betas: the transitions barely contract, so a checkpoint error stays.
    L, T = 16, 16 * 8
    inp = random_inputs(T, batch=1, HK=1, HV=2, K=16, V=8, channel=channel, g_scale=0.01, beta_max=0.1, seed=3)
    errors = {}
    for ring in gd.RING_KINDS:
        for flushes in (1, 8):
            part = {n: (t[: flushes * L] if n != "state0" else t) for n, t in inp.items()}
            _, S = gd.decode_exact(**part)
            _, _, ck = gd.decode_replay(**part, read="fp8_e4m3:row", ring=ring, ring_len=L, return_checkpoint=True)
            errors[ring, flushes] = rel(ck, S)
    # inputs ring: the checkpoint is the fp32 fold, whatever the read copy is.
    assert errors["inputs", 8] < 8 * 4 * EPS32
    # corrected ring: about one fp8 read-copy error per flush, adding up.
    assert errors["corrected", 1] > 1e-4 and errors["corrected", 8] > 2 * errors["corrected", 1]


def test_replay_read_copy_error_does_not_accumulate_in_outputs():
    T = 64
    inp = random_inputs(T, channel=True, seed=4)
    o, _ = gd.decode_exact(**inp)
    o_read, _ = gd.decode_replay(**inp, read="fp8_e4m3:row", ring_len=16)
    err = (o_read - o).flatten(1).norm(dim=1) / o.flatten(1).norm(dim=1)
    assert err[15::16].max() < 1e-6  # flushing tokens read the fp32 checkpoint
    assert err.max() < 0.05 and err[-16:].max() < 3 * err[:16].max()


# ----------------------------------------------------------------------------- properties

@ci_examples(12)
@given(
    HK=st.integers(1, 2), group=st.integers(1, 3), K=st.sampled_from([3, 8, 13]), V=st.integers(1, 7),
    T=st.integers(1, 12), L=st.integers(1, 6), channel=st.booleans(), ring=st.sampled_from(gd.RING_KINDS),
    g_scale=st.sampled_from([0.0, 0.05, 3.0]), neg=st.booleans(), seed=st.integers(0, 2**16),
)
def test_replay_equals_exact_property(HK, group, K, V, T, L, channel, ring, g_scale, neg, seed):
    inp = random_inputs(T, batch=1, HK=HK, HV=HK * group, K=K, V=V, channel=channel, seed=seed,
                        g_scale=g_scale, beta_max=2.0 if neg else 1.0)
    before = {n: t.clone() for n, t in inp.items()}
    o, S = gd.decode_exact(**inp, allow_neg_eigval=neg)
    o2, S2 = gd.decode_replay(**inp, ring=ring, ring_len=L, allow_neg_eigval=neg)
    o3, S3 = gd.decode_naive(**inp, fmt="fp32", allow_neg_eigval=neg)
    for n, t in inp.items():
        assert torch.equal(t, before[n])
    # β up to 2 reflects instead of contracting, but ‖I − βk̂k̂ᵀ‖ ≤ 1 still holds for β in [0, 2].
    scale = state_norms(inp, allow_neg_eigval=neg).max().item() + 1.0
    assert (S2 - S).norm().item() <= (T // L) * EPS32 * scale + 1e-12
    assert (o2 - o).norm().item() <= math.sqrt(T) * ((T // L) * EPS32 * scale + 1e-12)
    assert (S3.double() - S).norm().item() <= 64 * T * EPS32 * scale


# ----------------------------------------------------------------------------- bad input

def bad(**changes):
    inp = random_inputs(3, HK=2, HV=4, K=8, V=6)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("fn", ["exact", "naive", "replay"])
@pytest.mark.parametrize("inp, error, match", [
    (bad(v=torch.randn(3, 2, 5, 6)), ValueError, r"v: .*multiple of the key heads HK = 2.*got HV = 5"),
    (bad(g=-torch.rand(3, 2)), ValueError, r"g: expected 3 dimensions .* or 4 .*got shape \(3, 2\)"),
    (bad(g=-torch.rand(3, 2, 4, 7)), ValueError, r"g: expected shape \(T, batch, HV, K\) = \(3, 2, 4, 8\)"),
    (bad(g=torch.full((3, 2, 4), 0.5)), ValueError, r"g: expected log-space gates <= 0.*got 0.5"),
    (bad(g=torch.full((3, 2, 4), float("nan"))), ValueError, r"g: expected log-space gates <= 0.*got nan"),
    (bad(beta=torch.full((3, 2, 4), 1.5)), ValueError, r"beta: expected values in \[0, 1\].*allow_neg_eigval.*1.5"),
    (bad(beta=torch.full((3, 2, 4), -0.1)), ValueError, r"beta: expected values in \[0, 1\]"),
    (bad(beta=torch.rand(3, 2, 2)), ValueError, r"beta: expected shape \(T, batch, HV\) = \(3, 2, 4\)"),
    (bad(q=torch.randn(3, 2, 2, 7)), ValueError, r"q: expected shape \(T, batch, HK, K\) as k = \(3, 2, 2, 8\)"),
    (bad(state0=torch.randn(2, 4, 6, 7)), ValueError, r"state0: expected K = 8 \(k's head_k_dim\).*\(2, 4, 6, 7\)"),
    (bad(state0=torch.randn(2, 4, 5, 8)), ValueError, r"state0: expected V = 6 \(v's head_v_dim\)"),
    (bad(state0=torch.randn(2, 2, 6, 8)), ValueError, r"state0: expected shape \(batch, HV, V, K\) .*HV = 4"),
    (bad(v=torch.randn(3, 1, 4, 6)), ValueError, r"v: expected shape \(T, batch, HV, V\)"),
    (bad(k=torch.randn(0, 2, 2, 8), q=torch.randn(0, 2, 2, 8)), ValueError, r"k: expected at least one step"),
    (bad(k=torch.randint(0, 3, (3, 2, 2, 8))), TypeError, r"k: expected a floating-point tensor"),
    (bad(use_qk_l2norm=1), TypeError, r"use_qk_l2norm: expected a bool, got int"),
    (bad(scale=-1.0), ValueError, r"scale: expected a finite number > 0, got -1.0"),
])
def test_bad_input_names_the_argument(fn, inp, error, match):
    before = {n: t.clone() for n, t in inp.items() if isinstance(t, torch.Tensor)}
    call = {"exact": gd.decode_exact, "naive": lambda **kw: gd.decode_naive(**kw, fmt="int8:row"),
            "replay": gd.decode_replay}[fn]
    with pytest.raises(error, match=match):
        call(**inp)
    for n, t in before.items():
        assert torch.equal(inp[n], t) or torch.isnan(t).all()


def test_replay_arguments():
    inp = random_inputs(3)
    with pytest.raises(ValueError, match=r"ring: expected one of \['inputs', 'corrected'\], got 'values'"):
        gd.decode_replay(**inp, ring="values")
    with pytest.raises(ValueError, match=r"ring_len: expected an int >= 1, got 0"):
        gd.decode_replay(**inp, ring_len=0)
    with pytest.raises(ValueError, match=r"read: .*unknown format 'int4'"):
        gd.decode_replay(**inp, read="int4")
    with pytest.raises(TypeError, match=r"return_checkpoint: expected a bool"):
        gd.decode_replay(**inp, return_checkpoint=None)
    # β up to 2 is accepted with allow_neg_eigval
    inp["beta"] = 2 * torch.rand(inp["beta"].shape)
    gd.decode_replay(**inp, allow_neg_eigval=True)
