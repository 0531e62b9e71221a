"""Speculative decoding on replay (``qstate.replay_verify`` / ``replay_commit``) and the
per-draft-state baseline, under the interpreter.

Each slot is shadowed as in tests/mamba2/test_replay.py: the kernel's checkpoint at the start of the
current flush cycle plus the tokens committed since. Every round, all T outputs of a row must
equal ``decode_replay`` (fp64, from that checkpoint, same read format, no flush inside) over the
committed tokens followed by the T drafts, within the fp32 bound of kernels/README.md
("Replay: error bounds"; with ``L`` the tokens replayed: ``κ_fold = L + 4 + (L + 1)·max|A·Λ|``,
``κ_y = κ_fold + dstate + 6``, ``|Δ| ≤ κ·u·M`` with ``M`` the same sum over absolute values).
When a verify flushed (``generation`` moved), the new checkpoint must equal the fp64 fold of the
committed tokens within ``κ_fold·u·M`` and the read copy must be ``quantize(checkpoint)`` bit for
bit. At the end ``materialize`` must equal the shadow's fold, and decoding all accepted tokens
one by one with ``decode_exact`` within ``cycles · κ_fold,max · u · M`` (each cycle's fold error
decays afterwards exactly like the state it was made in).
"""

from __future__ import annotations

import pytest
import torch

from qstate import reference
from qstate.cache import ReplayCache
from qstate.formats import quantize
from qstate.ops.speculative import (commit_drafts, replay_check_commits, replay_commit, replay_verify,
                                    selective_state_update_drafts)
from qstate.ops.conventional import selective_state_update

U = 2.0 ** -24
DRAFT_LENGTHS = (1, 2, 4, 7)
NAMES = ("x", "dt", "B", "C", "z")


def draft_inputs(g, batch, T, nheads, headdim, dstate, ngroups):
    return dict(x=torch.randn(batch, T, nheads, headdim, generator=g), dt=0.5 * torch.randn(batch, T, nheads, generator=g),
                B=torch.randn(batch, T, ngroups, dstate, generator=g), C=torch.randn(batch, T, ngroups, dstate, generator=g),
                z=torch.randn(batch, T, nheads, headdim, generator=g))


def layer_params(g, nheads):
    return dict(A=-(0.5 + 3.5 * torch.rand(nheads, generator=g)), D=torch.randn(nheads, generator=g),
                dt_bias=-2.0 + 0.5 * torch.randn(nheads, generator=g))


class Shadow:
    """Per slot: the kernel's checkpoint at the cycle start, the tokens committed since, all
    accepted tokens from admission, and the number of flush cycles."""

    def __init__(self, cache, params, state0):
        self.cache, self.params = cache, params
        self.start = {s: cache.checkpoint_values([s])[0].clone() for s in range(cache.num_slots)}
        self.cycle = {s: [] for s in range(cache.num_slots)}
        self.history = {s: [] for s in range(cache.num_slots)}
        self.cycles = {s: 1 for s in range(cache.num_slots)}
        self.state0 = state0
        self.flushes = 0

    def _replay(self, s, tokens, absolute=False, start=None):
        p, cache = self.params, self.cache
        start = self.start[s] if start is None else start
        stack = {k: torch.stack([t[k] for t in tokens])[:, None] for k in NAMES}
        if absolute:
            stack = {k: (v if k == "dt" else v.abs()) for k, v in stack.items()}
            start = start.abs()
        read = None if absolute or cache.read_format is None else str(cache.read_format)
        return reference.decode_replay(start[None], stack["x"], stack["dt"], p["A"], stack["B"], stack["C"],
                                       p["D"].abs() if absolute else p["D"], None if absolute else stack["z"],
                                       p["dt_bias"], True, checkpoint="fp32", read=read, ring_len=10**6)

    def kappa_fold(self, tokens):
        dts = torch.stack([reference.process_dt(t["dt"].double(), self.params["dt_bias"].double(), True)
                           for t in tokens])
        L = len(tokens)
        return L + 4 + (L + 1) * float((self.params["A"].double().abs() * dts.sum(0)).max())

    def check_flush(self, s):
        cache, tokens = self.cache, self.cycle[s]
        (_, fold), (_, fold_abs) = self._replay(s, tokens), self._replay(s, tokens, absolute=True)
        got = cache.checkpoint_values([s])[0].double()
        bound = self.kappa_fold(tokens) * U * fold_abs[0] + 1e-35
        assert torch.all((got - fold[0]).abs() <= bound), f"slot {s}: flushed checkpoint off the fp64 fold"
        if cache.read_format is not None:
            expected = quantize(cache.checkpoint_values([s]), cache.read_format)
            assert torch.equal(cache.read[s:s + 1].view(torch.uint8), expected.data.view(torch.uint8)), s
            assert torch.equal(cache.read_scale[s:s + 1], expected.scale), s
        self.start[s] = cache.checkpoint_values([s])[0].clone()
        self.cycle[s] = []
        self.cycles[s] += 1
        self.flushes += 1

    def check_outputs(self, s, drafts, y):
        tokens = self.cycle[s] + drafts
        y_ref, _ = self._replay(s, tokens)
        # Magnitudes of the output sums: the values the outputs read in place of the checkpoint.
        y_abs, _ = self._replay(s, tokens, absolute=True, start=self.cache.read_values([s])[0])
        T = len(drafts)
        z = torch.stack([t["z"] for t in drafts]).double()
        gate = (z * torch.sigmoid(z)).abs().clamp(min=1.0)
        kappa_y = self.kappa_fold(tokens) + self.cache.dstate + 6
        bound = kappa_y * U * y_abs[-T:, 0] * gate + 1e-30
        err = (y.double() - y_ref[-T:, 0]).abs()
        assert torch.all(err <= bound), f"slot {s}: draft outputs {float((err / bound).max()):.3g} × the fp32 bound"

    def commit(self, s, drafts, accepted):
        self.cycle[s] += drafts[:accepted]
        self.history[s] += drafts[:accepted]

    def check_final(self):
        cache, p = self.cache, self.params
        got = cache.materialize(list(range(cache.num_slots)), p["A"]).double()
        for s in range(cache.num_slots):
            if self.cycle[s]:
                (_, fold), (_, fold_abs) = self._replay(s, self.cycle[s]), self._replay(s, self.cycle[s], absolute=True)
                bound = self.kappa_fold(self.cycle[s]) * U * fold_abs[0]
            else:
                fold, bound = self.start[s][None].double(), torch.zeros(1)
            assert torch.all((got[s] - fold[0]).abs() <= bound + 1e-35), f"slot {s}: materialize off the shadow fold"
            if not self.history[s]:
                continue
            stack = {k: torch.stack([t[k] for t in self.history[s]])[:, None] for k in NAMES}
            _, exact = reference.decode_exact(self.state0[s:s + 1], stack["x"], stack["dt"], p["A"], stack["B"],
                                              stack["C"], p["D"], stack["z"], p["dt_bias"], True)
            _, exact_abs = reference.decode_exact(self.state0[s:s + 1].abs(), stack["x"].abs(), stack["dt"], p["A"],
                                                  stack["B"].abs(), stack["C"], None, None, p["dt_bias"], True)
            kappa = max(self.kappa_fold(self.history[s][i:i + cache.capacity])
                        for i in range(0, len(self.history[s]), cache.capacity))
            bound = self.cycles[s] * kappa * U * exact_abs[0] + 1e-35
            assert torch.all((got[s] - exact[0]).abs() <= bound), f"slot {s}: materialize off decode_exact"


def run_rounds(*, nheads, headdim, dstate, ngroups, read, ring_len, rounds, batch, padding, seed):
    g = torch.Generator().manual_seed(seed)
    slots = batch + 1
    cache = ReplayCache.allocate(slots, nheads, headdim, dstate, ngroups, ring_len=ring_len, read=read,
                                 input_dtype=torch.float32, max_draft=max(DRAFT_LENGTHS))
    state0 = torch.randn(slots, nheads, headdim, dstate, generator=g)
    cache.reset(list(range(slots)), state0)
    params = layer_params(g, nheads)
    shadow = Shadow(cache, params, state0.double())
    for _ in range(rounds):
        T = DRAFT_LENGTHS[int(torch.randint(len(DRAFT_LENGTHS), (), generator=g))]
        order = torch.randperm(slots, generator=g)[:batch]
        if padding:
            order[int(torch.randint(batch, (), generator=g))] = -1
        inp = draft_inputs(g, batch, T, nheads, headdim, dstate, ngroups)
        generation = cache.generation.clone()
        untouched = {s: cache.checkpoint[s].clone() for s in range(slots) if s not in order.tolist()}
        out = torch.full((batch, T, nheads, headdim), float("nan"))
        y = replay_verify(cache, **inp, **params, dt_softplus=True, slot_indices=order.int(), out=out)
        for s in (cache.generation != generation).nonzero().flatten().tolist():
            shadow.check_flush(s)
        for s, before in untouched.items():
            assert torch.equal(cache.checkpoint[s], before) and int(cache.drafts[s]) == 0
        accepted = torch.randint(0, T + 1, (batch,), generator=g)
        for row, s in enumerate(order.tolist()):
            if s < 0:
                assert torch.all(y[row] == 0)
                continue
            drafts = [{k: inp[k][row, t] for k in NAMES} for t in range(T)]
            shadow.check_outputs(s, drafts, y[row])
            shadow.commit(s, drafts, int(accepted[row]))
        replay_commit(cache, accepted.int(), slot_indices=order.int())
    shadow.check_final()
    return shadow


@pytest.mark.parametrize("read", [None, "fp8_e4m3:row"])
def test_rounds_match_decoding_the_accepted_tokens(read):
    shadow = run_rounds(nheads=4, headdim=16, dstate=32, ngroups=2, read=read, ring_len=5, rounds=14, batch=3,
                        padding=True, seed=1 if read else 2)
    assert shadow.flushes >= 3  # the early flush ran and was checked


def test_odd_shapes_and_int8_read():
    shadow = run_rounds(nheads=6, headdim=10, dstate=48, ngroups=3, read="int8:row", ring_len=3, rounds=8, batch=2,
                        padding=False, seed=3)
    assert shadow.flushes >= 1


def test_stale_ring_tokens_past_the_cursor_do_not_reach_outputs():
    """The verify kernel loads ring positions past the cursor (rejected drafts, older cycles) so
    that its loads need not wait for the cursor, and selects them away: NaN there changes no
    output and no state, over rounds that flush early."""
    g = torch.Generator().manual_seed(4)
    nheads, headdim, dstate, ngroups, batch, T = 2, 8, 32, 1, 2, 3
    params = layer_params(g, nheads)
    state0 = torch.randn(batch, nheads, headdim, dstate, generator=g)
    rounds = [(draft_inputs(g, batch, T, nheads, headdim, dstate, ngroups),
               torch.randint(0, T + 1, (batch,), generator=g).int()) for _ in range(8)]
    outs, caches = [], []
    for poison in (False, True):
        cache = ReplayCache.allocate(batch, nheads, headdim, dstate, ngroups, ring_len=8, read="fp8_e4m3:row",
                                     input_dtype=torch.float32, max_draft=T)
        cache.reset([0, 1], state0)
        ys = []
        for inp, accepted in rounds:
            if poison:
                for s in range(batch):
                    n = int(cache.cursor[s])
                    cache.ring_x[s, :, n:] = float("nan")
                    cache.ring_dt[s, :, n:] = float("nan")
                    cache.ring_B[s, :, n:] = float("nan")
            ys.append(replay_verify(cache, **inp, **params, dt_softplus=True))
            replay_commit(cache, accepted)
        outs.append(torch.stack(ys))
        caches.append(cache)
    assert int(caches[1].generation.sum()) >= 2  # rows flushed early
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0].checkpoint, caches[1].checkpoint)
    assert torch.equal(caches[0].read, caches[1].read)


@pytest.mark.parametrize("read", [None, "fp8_e4m3:row"])
@pytest.mark.parametrize("cursor", [0, 2])  # 2: the verify flushes the row first (n + 2T > capacity)
def test_a_non_finite_later_draft_leaves_earlier_outputs_alone(read, cursor):
    """Draft i's output is decoding's through draft i: a NaN or inf in any input of a later draft
    changes none of the earlier drafts' outputs (bit for bit), and reaches its own."""
    g = torch.Generator().manual_seed(6)
    nheads, headdim, dstate, ngroups, T = 2, 8, 16, 1, 3
    params = layer_params(g, nheads)
    state0 = torch.randn(1, nheads, headdim, dstate, generator=g)
    warmup = draft_inputs(g, 1, T, nheads, headdim, dstate, ngroups)
    clean = draft_inputs(g, 1, T, nheads, headdim, dstate, ngroups)

    def verify(inp):
        cache = ReplayCache.allocate(1, nheads, headdim, dstate, ngroups, ring_len=4, read=read,
                                     input_dtype=torch.float32, max_draft=T)
        cache.reset([0], state0)
        if cursor:
            replay_verify(cache, **{k: v[:, :cursor] for k, v in warmup.items()}, **params, dt_softplus=True)
            replay_commit(cache, torch.tensor([cursor], dtype=torch.int32))
        return replay_verify(cache, **inp, **params, dt_softplus=True), cache

    expected, cache = verify(clean)
    assert int(cache.generation[0]) == (1 if cursor else 0) and torch.isfinite(expected).all()
    for name in NAMES:
        for bad in (float("nan"), float("inf")):
            inp = {k: v.clone() for k, v in clean.items()}
            inp[name][0, T - 1] = bad
            got, _ = verify(inp)
            assert torch.equal(got[0, :T - 1], expected[0, :T - 1]), (name, bad)
            if name != "z":  # an infinite gate input can still give a finite output
                assert not torch.isfinite(got[0, T - 1]).all(), (name, bad)


def test_commit_errors_and_bad_input():
    cache = ReplayCache.allocate(2, 2, 4, 32, 1, ring_len=4, read=None, input_dtype=torch.float32, max_draft=2)
    g = torch.Generator().manual_seed(0)
    params = layer_params(g, 2)
    inp = draft_inputs(g, 2, 2, 2, 4, 32, 1)
    with pytest.raises(ValueError, match="no pending replay_verify"):
        replay_commit(cache, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="T <= cache.max_draft"):
        replay_verify(cache, **draft_inputs(g, 2, 3, 2, 4, 32, 1), **params)
    replay_verify(cache, **inp, **params)
    with pytest.raises(ValueError, match="0 … T"):
        replay_commit(cache, torch.tensor([3, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="num_accepted: expected dtype"):
        replay_commit(cache, torch.zeros(2))
    with pytest.raises(ValueError, match="num_accepted: expected shape"):
        replay_commit(cache, torch.zeros(2, 1, dtype=torch.int32))
    assert cache.cursor.tolist() == [0, 0]
    replay_commit(cache, torch.tensor([2, 1], dtype=torch.int32))
    assert cache.cursor.tolist() == [2, 1] and cache.drafts.tolist() == [0, 0]
    # The device path: the kernel refuses a commit without a verify and records it.
    from qstate.ops.speculative import _replay_commit_op
    _replay_commit_op(torch.tensor([1, 1], dtype=torch.int32), None, cache.cursor, cache.drafts, cache.commit_errors,
                      cache.slot_flags, cache.capacity)
    assert cache.cursor.tolist() == [2, 1]
    with pytest.raises(ValueError, match="without a pending replay_verify"):
        replay_check_commits(cache)
    replay_check_commits(cache)  # cleared
    with pytest.raises(ValueError, match="max_draft 0"):
        from qstate.ops.replay import replay_decode
        replay_decode(cache, **{k: v[:, 0] for k, v in inp.items()}, **params)
    plain = ReplayCache.allocate(2, 2, 4, 32, 1, ring_len=4, read=None, input_dtype=torch.float32)
    with pytest.raises(ValueError, match="max_draft = 0"):
        replay_verify(plain, **inp, **params)


def test_verify_checks_slot_values_and_layout_after_a_good_call():
    """replay_verify runs its metadata checks once per signature; slot values every call."""
    cache = ReplayCache.allocate(2, 2, 4, 32, 1, ring_len=4, read=None, input_dtype=torch.float32, max_draft=2)
    g = torch.Generator().manual_seed(0)
    params = layer_params(g, 2)
    inp = draft_inputs(g, 2, 2, 2, 4, 32, 1)
    replay_verify(cache, **inp, **params, slot_indices=torch.tensor([1, 0]))
    replay_commit(cache, torch.tensor([1, 1], dtype=torch.int32), slot_indices=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="repeat"):
        replay_verify(cache, **inp, **params, slot_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="num_slots"):
        replay_verify(cache, **inp, **params, slot_indices=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="x: expected a unit stride|x: expected unit stride"):
        replay_verify(cache, **{**inp, "x": torch.zeros(2, 2, 2, 4, 2)[..., 0]}, **params)
    with pytest.raises(TypeError, match="dt_softplus: expected a bool"):
        replay_verify(cache, **inp, **params, dt_softplus=0)
    strided = torch.tensor([1, 1, 0, 1])[::2]  # [1, 0] to the host, [1, 1] to a kernel
    with pytest.raises(ValueError, match="slot_indices: expected a contiguous tensor"):
        replay_verify(cache, **inp, **params, slot_indices=strided)
    replay_verify(cache, **inp, **params, slot_indices=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="slot_indices: expected a contiguous tensor"):
        replay_commit(cache, torch.tensor([1, 1], dtype=torch.int32), slot_indices=strided)
    replay_commit(cache, torch.tensor([1, 1], dtype=torch.int32), slot_indices=torch.tensor([1, 0]))
    assert cache.cursor.tolist() == [2, 2]


@pytest.mark.parametrize("fmt", ["fp32", "int8:row"])
def test_baseline_equals_conventional_steps(fmt):
    """The per-draft-state kernel writes the states T conventional steps write, bit for bit, and
    its commit copies the accepted one into the slot."""
    g = torch.Generator().manual_seed(5)
    H, P, N, G, batch, T, t_max = 4, 16, 32, 2, 3, 4, 5
    params = layer_params(g, H)
    inp = draft_inputs(g, batch, T, H, P, N, G)
    values = torch.randn(batch + 1, H, P, N, generator=g)
    q = quantize(values, fmt)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    inter = torch.zeros((batch, t_max, H, P, N), dtype=state.dtype)
    inter_scale = None if scale is None else torch.zeros((batch, t_max, H, P))
    out = torch.full((batch, T, H, P), float("nan"))
    selective_state_update_drafts(state, **inp, **params, dt_softplus=True, state_batch_indices=slots,
                                  intermediate=inter, state_scale=scale, intermediate_scale=inter_scale,
                                  state_format=fmt, out=out)
    assert torch.all(out[1] == 0)
    ref_state, ref_scale = state.clone(), None if scale is None else scale.clone()
    for t in range(T):
        y = selective_state_update(ref_state, **{k: v[:, t] for k, v in inp.items()}, **params, dt_softplus=True,
                                   state_batch_indices=slots, state_scale=ref_scale, state_format=fmt)
        for row, s in ((0, 2), (2, 0)):
            assert torch.equal(inter[row, t].view(torch.uint8), ref_state[s].view(torch.uint8)), (t, row)
            if ref_scale is not None:
                assert torch.equal(inter_scale[row, t], ref_scale[s])
        torch.testing.assert_close(out[[0, 2], t], y[[0, 2]], rtol=2e-6, atol=1e-6)
    accepted = torch.tensor([3, 2, 0], dtype=torch.int32)
    before = state.clone()
    commit_drafts(state, inter, accepted, slots, state_scale=scale, intermediate_scale=inter_scale, state_format=fmt)
    assert torch.equal(state[2].view(torch.uint8), inter[0, 2].view(torch.uint8))
    assert torch.equal(state[0].view(torch.uint8), before[0].view(torch.uint8))  # nothing accepted
    assert torch.equal(state[1].view(torch.uint8), before[1].view(torch.uint8))  # padding row's would-be slot
    with pytest.raises(ValueError, match="0 … T_max"):
        commit_drafts(state, inter, torch.tensor([6, 0, 0], dtype=torch.int32), slots, state_scale=scale,
                      intermediate_scale=inter_scale, state_format=fmt)


def test_torch_compile_through_the_custom_ops():
    """Under ``torch.compile`` verify and commit go through ``qstate::replay_verify`` and
    ``qstate::replay_commit`` (eager calls run their implementations directly): same outputs
    and cache, bit for bit, over rounds that flush."""
    g = torch.Generator().manual_seed(5)
    nheads, headdim, dstate, ngroups, batch, T = 2, 8, 32, 1, 2, 3
    params = layer_params(g, nheads)
    rounds = [(draft_inputs(g, batch, T, nheads, headdim, dstate, ngroups),
               torch.randint(0, T + 1, (batch,), generator=g).int()) for _ in range(4)]
    caches = [ReplayCache.allocate(batch, nheads, headdim, dstate, ngroups, ring_len=4, read="fp8_e4m3:row",
                                   input_dtype=torch.float32, max_draft=T) for _ in range(2)]
    for c in caches:
        c.reset([0, 1])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled_round(cache, x, dt, B, C, z, A, D, dt_bias, accepted):
        y = replay_verify(cache, x, dt, A, B, C, D, z, dt_bias, True)
        replay_commit(cache, accepted)
        return y

    for inp, accepted in rounds:
        expected = replay_verify(caches[0], **inp, **params, dt_softplus=True)
        replay_commit(caches[0], accepted)
        got = compiled_round(caches[1], **inp, **params, accepted=accepted)
        assert torch.equal(got, expected)
    assert int(caches[0].generation.sum()) >= 1  # some row flushed
    for name, tensor in caches[0].tensors().items():
        if tensor is not None:
            assert torch.equal(caches[1].tensors()[name], tensor), name
