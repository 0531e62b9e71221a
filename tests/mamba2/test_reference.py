"""Reference recurrences: exact, naive quantized and replay agree where the math says they must."""

import pytest
import torch
from helpers import ci_examples
from hypothesis import given
from hypothesis import strategies as st

from qstate import profiles
from qstate.reference import decode_exact, decode_naive, decode_replay, mamba2_step, process_dt

EPS32 = 2.0**-24


def random_inputs(T, batch=2, nheads=4, headdim=8, dstate=16, ngroups=2, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        state0=r(batch, nheads, headdim, dstate),  # fp32: exactly representable by an fp32 checkpoint
        x=r(T, batch, nheads, headdim),
        dt=torch.rand(T, batch, nheads, generator=g) * 0.2,
        A=-(torch.rand(nheads, generator=g) * 3 + 0.2),
        B=r(T, batch, ngroups, dstate),
        C=r(T, batch, ngroups, dstate),
        D=r(nheads),
        z=r(T, batch, nheads, headdim) if gated else None,
    )


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def gate(inp):
    """|z·sigmoid(z)| per output element (1 without z): the gate scales output errors."""
    z = inp["z"]
    return torch.ones_like(inp["x"], dtype=torch.float64) if z is None else (z * torch.sigmoid(z)).abs().double()


def per_head(BC, nheads):
    return BC.double().repeat_interleave(nheads // BC.shape[-2], dim=-2)


# ----------------------------------------------------------------------------- one step

def test_mamba2_step_matches_the_formula():
    inp = random_inputs(1, gated=True)
    dt_bias = torch.randn(4)
    y, S = mamba2_step(inp["state0"], inp["x"][0], inp["dt"][0], inp["A"], inp["B"][0], inp["C"][0],
                       inp["D"], inp["z"][0], dt_bias=dt_bias, dt_softplus=True)
    f = torch.float64
    dt = torch.nn.functional.softplus(inp["dt"][0].to(f) + dt_bias.to(f))
    a = torch.exp(dt * inp["A"].to(f))
    Bh, Ch = per_head(inp["B"][0], 4), per_head(inp["C"][0], 4)
    S_ref = a[..., None, None] * inp["state0"].to(f) + torch.einsum("bh,bhp,bhn->bhpn", dt, inp["x"][0].to(f), Bh)
    y_ref = torch.einsum("bhpn,bhn->bhp", S_ref, Ch) + inp["D"].to(f)[:, None] * inp["x"][0].to(f)
    zz = inp["z"][0].to(f)
    y_ref = y_ref * zz * torch.sigmoid(zz)
    assert S.dtype == y.dtype == torch.float64
    assert rel(S, S_ref) < 1e-14 and rel(y, y_ref) < 1e-14


def test_softplus_is_skipped_above_20():
    dt = torch.tensor([[-3.0, 0.0, 19.0, 25.0]], dtype=torch.float64)
    out = process_dt(dt, dt_softplus=True)
    assert out[0, 3] == 25.0
    assert torch.allclose(out[0, :3], torch.nn.functional.softplus(dt[0, :3]), rtol=1e-15)


# ----------------------------------------------------------------------------- replay vs exact

def test_replay_without_flush_equals_exact():
    inp = random_inputs(20)
    y_e, S_e = decode_exact(**inp)
    y_r, S_r = decode_replay(**inp, ring_len=21)
    assert rel(y_r, y_e) < 1e-12 and rel(S_r, S_e) < 1e-12


@pytest.mark.parametrize("ring_len", [1, 3, 16])
def test_replay_fp32_checkpoint_within_fp32_rounding(ring_len):
    """Each flush rounds the checkpoint to fp32 once: |δ| ≤ 2^-24·|S| per element. Those errors
    decay (|a| < 1), so after k flushes |ΔS| ≤ k·2^-24·max_t|S_t| and, for output element p,
    |Δy_p| ≤ k·2^-24·max|S|·‖C_t‖₁·|z·σ(z)|."""
    T = 37  # not a multiple of any ring_len above
    inp = random_inputs(T, seed=ring_len)
    y_e, S_e = decode_exact(**inp)
    y_r, S_r = decode_replay(**inp, ring_len=ring_len)
    states = []
    S = inp["state0"].double()
    for t in range(T):
        _, S = mamba2_step(S, inp["x"][t], inp["dt"][t], inp["A"], inp["B"][t], inp["C"][t])
        states.append(S.abs().amax())
    s_max = torch.stack(states).max()
    flushes = torch.arange(T, dtype=torch.float64) // ring_len  # flushes before output t
    c_norm = per_head(inp["C"], 4).abs().sum(-1)  # [T, batch, nheads]
    bound = flushes[:, None, None, None] * EPS32 * s_max * c_norm[..., None] * gate(inp) * (1 + 1e-6) + 1e-12
    assert ((y_r - y_e).abs() <= bound).all()
    assert ((S_r - S_e).abs() <= (T // ring_len) * EPS32 * s_max * (1 + 1e-6) + 1e-12).all()
    if ring_len < T:
        assert (y_r - y_e).abs().max() > 0  # the flushes really round


@pytest.mark.parametrize("read", ["int8:row", "fp8_e4m3:row"])
@pytest.mark.parametrize("ring_len", [4, 16])
def test_read_copy_error_is_one_quantization_of_the_checkpoint(read, ring_len):
    """With a read copy R_c = Q(S_c), outputs move by exp(A·Λ_t)·((R_c − S_c)·C_t) only, so
    |Δy_p| ≤ exp(A·Λ_t)·Σ_n |R_c − S_c|_{p,n}·|C_t,n|·|z·σ(z)|, with, per element of row p
    (scale s_p = amax_p / qmax, round-to-nearest):
      int8:      |R − S| ≤ s_p/2
      fp8_e4m3:  |R − S| ≤ 2^-4·|S| + s_p·2^-10   (half a step in a normal binade, or in the
                                                   subnormal range of step s_p·2^-9)
    plus two fp32 roundings (x/s and code·s), ≤ 2^-23·|S|. The bound holds at every step:
    the error does not accumulate across flushes."""
    T = 3 * ring_len + 5
    inp = random_inputs(T, seed=11)
    y_ck, _ = decode_replay(**inp, ring_len=ring_len)
    y_rd, _ = decode_replay(**inp, ring_len=ring_len, read=read)
    f = torch.float64
    dts = process_dt(inp["dt"].to(f))
    A = inp["A"].to(f)
    Ch = per_head(inp["C"], 4)
    qmax = 127.0 if read.startswith("int8") else 448.0
    worst = 0.0
    for t in range(T):
        c = (t // ring_len) * ring_len  # tokens folded into the checkpoint that output t reads
        S_c = inp["state0"].double() if c == 0 else decode_replay(**{k: v[:c] if k not in ("state0", "A", "D") and v is not None else v for k, v in inp.items()}, ring_len=ring_len)[1].float().double()
        s = S_c.abs().amax(-1, keepdim=True) / qmax
        if read.startswith("int8"):
            dR = s / 2 + 2.0**-23 * S_c.abs()
        else:
            dR = 2.0**-4 * S_c.abs() + s * 2.0**-10 + 2.0**-23 * S_c.abs()
        decay = torch.exp(A * dts[c : t + 1].sum(0))  # [batch, nheads]
        bound = decay[..., None] * (dR * Ch[t][..., None, :].abs()).sum(-1) * gate(inp)[t]
        err = (y_rd[t] - y_ck[t]).abs()
        assert (err <= bound * (1 + 1e-5) + 1e-12).all(), f"step {t}"
        worst = max(worst, (err / bound).max().item())
    assert worst > 0.01  # the bound is not vacuous


@pytest.mark.parametrize("read", ["int8:row", "fp8_e4m3:row", "bf16"])
def test_a_flushing_token_outputs_from_the_fold_not_the_read_copy(read):
    """The token that fills the ring outputs from the unrounded new state,
    the fold of the checkpoint, so its output is the same with or without a read copy (the
    checkpoints do not depend on it); every other token reads the read copy."""
    ring_len, T = 4, 13
    inp = random_inputs(T, seed=8)
    y_ck, _ = decode_replay(**inp, ring_len=ring_len)
    y_rd, _ = decode_replay(**inp, ring_len=ring_len, read=read)
    flushing = torch.arange(T) % ring_len == ring_len - 1
    assert torch.equal(y_rd[flushing], y_ck[flushing])
    assert ((y_rd[~flushing] - y_ck[~flushing]).abs().amax(dim=(1, 2, 3)) > 0).all()


def test_replay_checkpoint_formats_quantize_once_per_flush():
    inp = random_inputs(12, seed=5)
    y_e, _ = decode_exact(**inp)
    y_no_flush, _ = decode_replay(**inp, checkpoint="bf16", ring_len=100)
    y_flush, _ = decode_replay(**inp, checkpoint="bf16", ring_len=4)
    # one bf16 rounding of state0 (relative 2^-8): a few 1e-3 of relative output error
    assert 1e-5 < rel(y_no_flush, y_e) < 1e-2
    assert 1e-5 < rel(y_flush, y_e) < 2e-2


# ----------------------------------------------------------------------------- naive

def test_naive_fp32_equals_exact_within_fp32_rounding():
    """Each fp32 step rounds a = exp(dt·A), dt·x, the product and the sum (≤ 4·2^-24 of |S|
    per step, carried forward with |a| < 1) and the output sum over dstate (≤ dstate·2^-24 of
    Σ|S||C|); so ‖Δy‖ ≤ (4T + dstate)·2^-24·‖ Σ_n |S||C| ‖ (plus the same for D·x and the gate)."""
    T, N = 64, 16
    inp = random_inputs(T, dstate=N, seed=3)
    y_e, S_e = decode_exact(**inp)
    y_n, S_n = decode_naive(**inp, fmt="fp32")
    assert y_n.dtype == torch.float32
    scale = torch.stack([(S_e.abs() * per_head(inp["C"][t], 4).abs()[..., None, :]).sum(-1) for t in range(T)])
    bound = (4 * T + N) * EPS32 * (scale * gate(inp)).norm()
    assert (y_n.double() - y_e).norm() <= bound
    assert rel(S_n, S_e) <= (4 * T) * EPS32
    assert rel(y_n, y_e) > 0


@pytest.mark.parametrize("fmt", ["bf16", "int8:row", "fp8_e4m3:row", "fp8_e5m2:block32", "int8:head+sr"])
def test_naive_stores_the_state_in_its_format(fmt):
    inp = random_inputs(10, dstate=32, seed=4)
    from qstate import dequantize, quantize

    _, S = decode_naive(**inp, fmt=fmt, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dequantize(quantize(S, fmt, generator=torch.Generator().manual_seed(1))), S)


@ci_examples(8)
@given(seed=st.integers(0, 1000), T=st.integers(1, 24), ring_len=st.integers(1, 8))
def test_replay_fp32_tracks_exact_for_any_schedule(seed, T, ring_len):
    inp = random_inputs(T, batch=1, nheads=2, headdim=4, dstate=8, ngroups=1, seed=seed)
    y_e, _ = decode_exact(**inp)
    y_r, _ = decode_replay(**inp, ring_len=ring_len)
    assert rel(y_r, y_e) < 4 * (T // ring_len + 1) * EPS32 * 10


# ----------------------------------------------------------------------------- central claim

def test_central_claim_replay_fp8_read_beats_naive_fp8_on_slow_heads():
    """Over 2,048 steps on heads with a ≥ 0.999, storing the state in fp8_e4m3:row and
    re-quantizing every step ends with ≥ 5× the output error of replay with an fp32 checkpoint
    and an fp8_e4m3:row read copy (the naive update is smaller than half an fp8 step, so it is
    lost: the state stagnates; replay's error is one quantization of the checkpoint)."""
    T = 2048
    prof = profiles.Profile("slow-heads", nheads=4, headdim=16, dstate=32, ngroups=1, n_ssm_layers=1)
    inp = prof.sample_inputs(T, batch=2, seed=0)
    inp.A = torch.tensor([-1.0, -1.2, -1.35, -1.5])
    inp.dt_bias = torch.full((4,), -8.5)  # dt ≈ 2e-4, wandering by e^(±4σ) with σ = 0.25
    inp.dt = inp.dt * 0.5
    dt = process_dt(inp.dt.double(), inp.dt_bias.double(), True)
    a = torch.exp(dt * inp.A.double())
    assert a.min() >= 0.999, a.min()
    kw = inp.kwargs()
    y_e, _ = decode_exact(**kw)
    y_naive, _ = decode_naive(**kw, fmt="fp8_e4m3:row")
    y_replay, _ = decode_replay(**kw, checkpoint="fp32", read="fp8_e4m3:row", ring_len=16)
    final = slice(T - 1, T)
    err_naive, err_replay = rel(y_naive[final], y_e[final]), rel(y_replay[final], y_e[final])
    assert err_naive >= 5 * err_replay, (err_naive, err_replay)


# ----------------------------------------------------------------------------- bad input

def test_bad_input_names_the_argument():
    inp = random_inputs(3)
    cases = [
        (dict(B=torch.randn(3, 2, 2, 15)), ValueError, "B"),
        (dict(x=torch.randn(2, 4, 8)), ValueError, "x"),
        (dict(dt=torch.ones(3, 2, 4, dtype=torch.int64)), TypeError, "dt"),
        (dict(B=torch.randn(3, 2, 3, 16), C=torch.randn(3, 2, 3, 16)), ValueError, "ngroups"),
        (dict(A=torch.randn(5)), ValueError, "A"),
        (dict(state0=torch.randn(2, 4, 8)), ValueError, "state"),
        (dict(z=torch.randn(3, 2, 4, 7)), ValueError, "z"),
        (dict(D=torch.randn(4, 1)), ValueError, "D"),
    ]
    for change, exc, name in cases:
        with pytest.raises(exc, match=name):
            decode_exact(**{**inp, **change})
    with pytest.raises(ValueError, match="fmt"):
        decode_naive(**inp, fmt="fp7")
    with pytest.raises(ValueError, match="read"):
        decode_replay(**inp, read="int9:row")
    with pytest.raises(ValueError, match="ring_len"):
        decode_replay(**inp, ring_len=0)
    with pytest.raises(ValueError, match="checkpoint"):
        decode_replay(**inp, checkpoint="fp64")
