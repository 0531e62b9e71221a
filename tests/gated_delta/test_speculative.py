"""Speculative decoding on gated delta rule layers (``qstate.gated_delta_replay_verify`` /
``gated_delta_replay_commit``) and the per-draft-state baseline, under the interpreter.

Each round's outputs are checked against the exact recurrence (fp64) from what the kernel
reads, the slot's read copy (or checkpoint), over its committed ring tokens and the drafts:
the adjoint sweep is exact, so the only error is fp32 rounding of sums over K and V, bounded
as in tests/gated_delta/test_replay.py by ``(n + T) · K · 2**-24 · 8`` relative. After every
commit that flushed, the read copy must be ``quantize`` of the stored checkpoint bit for bit.
End to end (fp32 checkpoint, no read copy), the outputs and the checkpoint equal
``reference.gated_delta.decode_speculative``'s and the accepted outputs and the materialized
state equal decoding the accepted tokens one by one (``decode_exact``) within fp32 rounding.
"""

import pytest
import torch
from hypothesis import given, strategies as st

import qstate
from qstate import formats
from qstate.ops import gated_delta_speculative as spec
from qstate.reference import gated_delta as reference

from helpers import ci_examples
from helpers.gated_delta import bits_of, rel_rms

NAMES = ("q", "k", "v", "g", "beta")
HK, HV, K, V = 1, 2, 32, 16


def bound(K, tokens):
    return tokens * K * 2.0**-24 * 8


def allocate(num_slots, *, channel, ring_len, max_draft, read=None, checkpoint="fp32", V=V):
    return qstate.GatedDeltaReplayCache.allocate(num_slots, HK, HV, K, V, gate="channel" if channel else "scalar",
                                                 ring_len=ring_len, checkpoint=checkpoint, read=read,
                                                 input_dtype=torch.float32, max_draft=max_draft)


def drafts(batch, T, *, channel, seed, V=V):
    """``q, k (batch, T, HK, K)``, ``v (batch, T, HV, V)``, ``g``, ``beta``."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(q=r(batch, T, HK, K), k=r(batch, T, HK, K), v=r(batch, T, HV, V),
                g=-0.5 * torch.rand(batch, T, HV, *((K,) if channel else ()), generator=g),
                beta=torch.rand(batch, T, HV, generator=g))


def check_read_copy(cache):
    if cache.read_format is None:
        return
    want = formats.quantize(cache.checkpoint_values(range(cache.num_slots)), cache.read_format)
    assert torch.equal(bits_of(cache.read), bits_of(want.data))
    if want.scale is None:  # an unscaled read copy (bf16)
        assert cache.read_scale is None
    else:
        assert torch.equal(bits_of(cache.read_scale), bits_of(want.scale))


class Shadow:
    """Per slot: the tokens committed since the last flush and all accepted tokens and outputs."""

    def __init__(self, cache):
        self.cache = cache
        self.ring = {s: [] for s in range(cache.num_slots)}
        self.accepted = {s: [] for s in range(cache.num_slots)}
        self.outputs = {s: [] for s in range(cache.num_slots)}
        self.flushes = 0

    def round(self, inp, slots, accepted):
        """Verify and commit one round; check each live row's outputs; return the outputs."""
        cache, T = self.cache, inp["v"].shape[1]
        expected = {}
        for row, s in enumerate(slots):
            if s < 0:
                continue
            assert int(cache.cursor[s]) == len(self.ring[s])
            tokens = self.ring[s] + [{n: inp[n][row, t] for n in NAMES} for t in range(T)]
            stacked = {n: torch.stack([t[n] for t in tokens])[:, None] for n in NAMES}
            o, _ = reference.decode_exact(cache.read_values(s), *(stacked[n] for n in NAMES))
            expected[row] = (o[-T:, 0], len(tokens))
        out = torch.full(inp["v"].shape, float("nan"))
        indices = torch.tensor(slots, dtype=torch.int32)
        qstate.gated_delta_replay_verify(cache, **inp, slot_indices=indices, out=out)
        for row, (o, tokens) in expected.items():
            assert rel_rms(out[row], o) < bound(K, tokens), f"row {row}"
        for row, s in enumerate(slots):
            if s < 0:
                assert torch.equal(out[row], torch.zeros_like(out[row]))
                continue
            assert int(cache.drafts[s]) == T
            kept = [{n: inp[n][row, t] for n in NAMES} for t in range(int(accepted[row]))]
            self.ring[s] += kept
            self.accepted[s] += kept
            self.outputs[s] += [out[row, t] for t in range(len(kept))]
        qstate.gated_delta_replay_commit(cache, torch.tensor(accepted, dtype=torch.int32), slot_indices=indices)
        for s in slots:
            if s >= 0 and len(self.ring[s]) >= cache.ring_len:
                self.ring[s] = []
                self.flushes += 1
            if s >= 0:
                assert int(cache.cursor[s]) == len(self.ring[s]) and int(cache.drafts[s]) == 0
        check_read_copy(cache)
        return out

    def check_sequential(self, state0):
        """Accepted outputs and the materialized state against decoding the accepted tokens one
        by one (fp32 checkpoint, no read copy: fp32 rounding only)."""
        cache = self.cache
        for s in range(cache.num_slots):
            if not self.accepted[s]:
                continue
            stacked = {n: torch.stack([t[n] for t in self.accepted[s]])[:, None] for n in NAMES}
            o, final = reference.decode_exact(state0[s:s + 1], *(stacked[n] for n in NAMES))
            tokens = len(self.accepted[s])
            assert rel_rms(torch.stack(self.outputs[s]), o[:, 0]) < bound(K, tokens), f"slot {s}"
            assert rel_rms(cache.materialize([s]), final) < bound(K, tokens), f"slot {s}"


CASES = [
    # (channel, ring_len, max_draft, T, checkpoint, read, split, prefetch, rounds)
    (False, 4, 3, 3, "fp32", None, None, False, 6),
    (True, 4, 4, 3, "fp32", "fp8_e4m3:row", (4, 2), False, 3),
    (False, 5, 2, 2, "bf16", "int8:row", None, False, 6),
    (True, 4, 3, 3, "fp32", "int8:row", (4, 2), True, 4),
    (False, 4, 3, 3, "fp32", None, None, True, 4),
    (True, 4, 3, 2, "fp32", "bf16", (4, 2), True, 4),
]


@pytest.mark.parametrize("channel,ring_len,max_draft,T,checkpoint,read,split,prefetch,rounds", CASES)
def test_rounds_against_the_exact_recurrence_from_what_they_read(monkeypatch, channel, ring_len, max_draft, T,
                                                                  checkpoint, read, split, prefetch, rounds):
    """Staggered slots, padding rows, random acceptance counts; flushes at commits checked.
    ``split``: the GPU's launch shape (V over 2 programs of 2 chunks; the fold's tiles of 4 rows);
    ``prefetch``: the verify loads each chunk of the state one chunk ahead."""
    from qstate.kernels.gated_delta import speculative
    monkeypatch.setattr(speculative, "INTERPRETER_SPLIT", split)
    monkeypatch.setattr(speculative, "PREFETCH", prefetch)
    g = torch.Generator().manual_seed(1)
    cache = allocate(4, channel=channel, ring_len=ring_len, max_draft=max_draft, read=read, checkpoint=checkpoint)
    state0 = torch.randn(4, HV, V, K, generator=g)
    cache.reset(range(4), state0)
    shadow = Shadow(cache)
    for r in range(rounds):
        slots = [[2, 0, -1], [1, 3, 0], [0, 2, 3]][r % 3]
        accepted = [int(a) for a in torch.randint(0, T + 1, (3,), generator=g)]
        shadow.round(drafts(3, T, channel=channel, seed=10 + r), slots, accepted)
    assert shadow.flushes >= 1
    if read is None and checkpoint == "fp32":
        shadow.check_sequential(state0)


@pytest.mark.parametrize("sweep_group,case", [(0, CASES[4]), (0, CASES[1]), (2, CASES[3])])
def test_rounds_with_other_sweep_groups(monkeypatch, sweep_group, case):
    """The verify's sweep over the committed tokens ``sweep_group`` at a time (0: every ring
    position unrolled, masked past the cursor)."""
    from qstate.kernels.gated_delta import speculative
    monkeypatch.setattr(speculative, "SWEEP_GROUP", sweep_group)
    test_rounds_against_the_exact_recurrence_from_what_they_read(monkeypatch, *case)


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_against_decode_speculative(channel):
    """All drafts' outputs (accepted or not), the stored checkpoint and the final state equal the
    fp64 reference's within fp32 rounding (fp32 checkpoint, no read copy)."""
    R, T, L, batch = 5, 2, 3, 2
    g = torch.Generator().manual_seed(4)
    rounds = [drafts(batch, T, channel=channel, seed=40 + r) for r in range(R)]
    accepted = torch.randint(0, T + 1, (R, batch), generator=g)
    state0 = torch.randn(batch, HV, V, K, generator=g)
    cache = allocate(batch, channel=channel, ring_len=L, max_draft=T)
    cache.reset(range(batch), state0)
    outs = []
    for r in range(R):
        outs.append(qstate.gated_delta_replay_verify(cache, **rounds[r]))
        qstate.gated_delta_replay_commit(cache, accepted[r].int())
    time_major = {n: torch.stack([x[n].transpose(0, 1) for x in rounds]) for n in NAMES}
    o_ref, final, ck = reference.decode_speculative(state0, *(time_major[n] for n in NAMES), accepted, ring_len=L,
                                                    return_checkpoint=True)
    assert rel_rms(torch.stack(outs).transpose(1, 2), o_ref) < bound(K, L + T)
    assert rel_rms(cache.checkpoint, ck) < bound(K, L + T) * R
    assert rel_rms(cache.materialize(range(batch)), final) < bound(K, L + T) * R


@ci_examples(6)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=5))
def test_any_acceptance_sequence_equals_sequential_decode(accepted):
    """A slot accepting ``accepted[r]`` of 2 drafts in round r outputs and ends in what decoding
    the accepted tokens one by one gives; the cursor follows the flush rule."""
    cache = allocate(1, channel=False, ring_len=3, max_draft=2, V=8)
    state0 = torch.randn(1, HV, 8, K, generator=torch.Generator().manual_seed(2))
    cache.reset([0], state0)
    shadow = Shadow(cache)
    for r, a in enumerate(accepted):
        shadow.round(drafts(1, 2, channel=False, seed=r, V=8), [0], [a])
    shadow.check_sequential(state0)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_nan_in_a_rejected_draft_reaches_no_accepted_output_and_no_other_slot(monkeypatch, prefetch):
    """Draft 1 of slot 0 holds NaN in one input at a time and is rejected: draft 0's output, the
    next round (after both slots' flushes) and slot 1 are bit for bit those of a run where that
    draft was finite; the flags mark slot 0 only (the NaN reached draft 1's own output).
    The host's value checks are off, as on a GPU (they would refuse a NaN gate or β)."""
    from qstate.kernels.gated_delta import speculative
    monkeypatch.setattr(spec._gated_delta_checks, "check_values", lambda g, beta: None)
    monkeypatch.setattr(speculative, "PREFETCH", prefetch)

    def run(poison):
        cache = allocate(2, channel=False, ring_len=1, max_draft=2, read="fp8_e4m3:row", V=8)
        cache.reset([0, 1], torch.randn(2, HV, 8, K, generator=torch.Generator().manual_seed(3)))
        outs = []
        for r in range(2):
            inp = drafts(2, 2, channel=False, seed=60 + r, V=8)
            if r == 0 and poison is not None:
                inp[poison][0, 1] = float("nan")
            outs.append(qstate.gated_delta_replay_verify(cache, **inp))
            qstate.gated_delta_replay_commit(cache, torch.tensor([1, 2], dtype=torch.int32))
        return torch.stack(outs), cache

    clean, clean_cache = run(None)
    assert clean_cache.cursor.tolist() == [0, 0]  # every commit flushed both slots
    for name in NAMES:
        got, cache = run(name)
        keep = torch.ones_like(got, dtype=torch.bool)
        keep[0, 0, 1] = False
        assert torch.equal(got[keep], clean[keep]), name
        assert not got[0, 0, 1].isfinite().all(), name
        assert cache.slot_flags.tolist() == [qstate.SLOT_NONFINITE, 0], name
        assert torch.equal(cache.checkpoint, clean_cache.checkpoint), name
        assert torch.equal(cache.read, clean_cache.read), name


def test_bad_cursors_and_commits_on_the_device_path():
    """What the kernels do where the host checks do not run (GPU tensors): a cursor outside the
    ring, a commit without a verify, a count outside 0 … T."""
    cache = allocate(3, channel=False, ring_len=4, max_draft=2)
    cache.cursor[1] = 9
    before = {n: t.clone() for n, t in cache.tensors().items() if t is not None}
    out = qstate.gated_delta_replay_verify(cache, **drafts(3, 2, channel=False, seed=0))
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    assert cache.slot_flags.tolist() == [0, qstate.SLOT_BAD_CURSOR, 0]
    for name in ("ring_k", "ring_v", "ring_g", "ring_beta", "drafts", "cursor"):
        assert torch.equal(getattr(cache, name)[1], before[name][1]), name
    assert cache.drafts.tolist() == [2, 0, 2]
    # Slot 1 has no pending drafts and slot 2 a count past T: both untouched, both recorded.
    spec._commit_op(torch.tensor([1, 1, 3], dtype=torch.int32), None, cache.checkpoint, cache.read, cache.read_scale,
                    cache.ring_k, cache.ring_v, cache.ring_g, cache.ring_beta, cache.cursor, cache.drafts,
                    cache.commit_errors, cache.slot_flags, "fp32", "", cache.max_draft, True)
    assert cache.cursor.tolist() == [1, 9, 0] and cache.drafts.tolist() == [0, 0, 2]
    with pytest.raises(ValueError, match="without a pending gated_delta_replay_verify and num_accepted outside"):
        qstate.gated_delta_replay_check_commits(cache)
    qstate.gated_delta_replay_check_commits(cache)  # cleared


def test_bad_input_names_the_argument_and_changes_nothing():
    cache = allocate(2, channel=False, ring_len=4, max_draft=2, read="int8:row")
    good = drafts(2, 2, channel=False, seed=0)
    before = {n: t.clone() for n, t in cache.tensors().items() if t is not None}
    verify_cases = [
        (dict(drafts(2, 3, channel=False, seed=0)), ValueError, "k", "T <= cache.max_draft"),
        (dict(g=torch.zeros(2, 2, HV, K)), ValueError, "g", "one gate per head"),
        (dict(v=torch.zeros(2, 2, HV, V + 1)), ValueError, "v", ""),
        (dict(k=good["k"].bfloat16()), TypeError, "k", "input dtype"),
        (dict(beta=torch.full((2, 2, HV), 1.5)), ValueError, "beta", ""),
        (dict(slot_indices=torch.tensor([0, 0])), ValueError, "slot_indices", ""),
        (dict(out=torch.zeros(2, 1, HV, V)), ValueError, "out", ""),
    ]
    for overrides, exc, name, text in verify_cases:
        with pytest.raises(exc, match=f"^{name}:.*{text}"):
            qstate.gated_delta_replay_verify(cache, **{**good, **overrides})
    with pytest.raises(ValueError, match="^num_accepted: slots .* no pending"):
        qstate.gated_delta_replay_commit(cache, torch.zeros(2, dtype=torch.int32))
    for n, t in before.items():
        assert torch.equal(bits_of(getattr(cache, n)), bits_of(t)), n
    qstate.gated_delta_replay_verify(cache, **good)
    before = {n: t.clone() for n, t in cache.tensors().items() if t is not None}
    for accepted, exc, text in ((torch.tensor([3, 0], dtype=torch.int32), ValueError, "0 … T"),
                                (torch.tensor([-1, 0], dtype=torch.int32), ValueError, "0 … T"),
                                (torch.zeros(2), TypeError, "dtype"), (torch.zeros(2, 1, dtype=torch.int32),
                                                                       ValueError, "shape")):
        with pytest.raises(exc, match=f"^num_accepted: .*{text}"):
            qstate.gated_delta_replay_commit(cache, accepted)
    for n, t in before.items():
        assert torch.equal(bits_of(getattr(cache, n)), bits_of(t)), n
    plain = allocate(2, channel=False, ring_len=4, max_draft=0)
    with pytest.raises(ValueError, match="^cache: .*max_draft >= 1"):
        qstate.gated_delta_replay_verify(plain, **good)
    with pytest.raises(ValueError, match="^cache: .*max_draft 0"):
        qstate.gated_delta_replay(cache, **{n: t[:, 0] for n, t in good.items()})
    with pytest.raises(ValueError, match="^max_draft:"):
        allocate(1, channel=False, ring_len=4, max_draft=-1)


def test_cache_sizes_and_from_tensors_with_drafts():
    cache = allocate(2, channel=True, ring_len=4, max_draft=3, read="fp8_e4m3:row")
    assert cache.ring_len == 4 and cache.capacity == 7 and cache.ring_k.shape[2] == 7
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in cache.tensors().values() if t is not None)
    fields = {n: getattr(cache, n) for n in ("checkpoint", "read", "read_scale", "ring_k", "ring_v", "ring_g",
                                             "ring_beta", "cursor")}
    again = qstate.GatedDeltaReplayCache.from_tensors(**fields, read_format="fp8_e4m3:row", max_draft=3)
    assert again.ring_len == 4 and again.drafts.tolist() == [0, 0]
    cache.cursor[1] = 4
    with pytest.raises(ValueError, match=r"^cursor: expected values in \[0, 4\)"):
        qstate.GatedDeltaReplayCache.from_tensors(**fields, read_format="fp8_e4m3:row", max_draft=3)
    with pytest.raises(ValueError, match="^ring_k: expected more than max_draft"):
        qstate.GatedDeltaReplayCache.from_tensors(**fields, read_format="fp8_e4m3:row", max_draft=7)


@pytest.mark.parametrize("fmt", ["fp32", "int8:row"])
def test_baseline_equals_conventional_steps(fmt):
    """The per-draft-state kernel writes the states T conventional steps write, bit for bit, and
    its commit copies the accepted one into the slot."""
    T, t_max, batch = 3, 4, 3
    inp = drafts(batch, T, channel=True, seed=7)
    q = formats.quantize(torch.randn(batch + 1, HV, V, K, generator=torch.Generator().manual_seed(8)), fmt)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    inter = torch.zeros((batch, t_max, HV, V, K), dtype=state.dtype)
    inter_scale = None if scale is None else torch.zeros((batch, t_max, HV, V))
    out = torch.full(inp["v"].shape, float("nan"))
    qstate.gated_delta_update_drafts(state, **inp, intermediate=inter, state_scale=scale,
                                     intermediate_scale=inter_scale, state_format=fmt, slot_indices=slots, out=out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref_state, ref_scale = state.clone(), None if scale is None else scale.clone()
    for t in range(T):
        y = qstate.gated_delta_update(ref_state, *(inp[n][:, t] for n in NAMES), state_indices=slots,
                                      state_scale=ref_scale, state_format=fmt)
        for row, s in ((0, 2), (2, 0)):
            assert torch.equal(bits_of(inter[row, t]), bits_of(ref_state[s])), (t, row)
            if ref_scale is not None:
                assert torch.equal(inter_scale[row, t], ref_scale[s])
        assert torch.equal(out[[0, 2], t], y[[0, 2]])
    before = state.clone()
    qstate.gated_delta_commit_drafts(state, inter, torch.tensor([3, 2, 0], dtype=torch.int32), slot_indices=slots,
                                     state_scale=scale, intermediate_scale=inter_scale, state_format=fmt)
    assert torch.equal(bits_of(state[2]), bits_of(inter[0, 2]))
    assert torch.equal(bits_of(state[0]), bits_of(before[0])) and torch.equal(bits_of(state[1]), bits_of(before[1]))
    with pytest.raises(ValueError, match="^num_accepted: expected values in 0 … T_max"):
        qstate.gated_delta_commit_drafts(state, inter, torch.tensor([5, 0, 0], dtype=torch.int32), slot_indices=slots,
                                         state_scale=scale, intermediate_scale=inter_scale, state_format=fmt)
    with pytest.raises(ValueError, match="^state_format: the per-draft baseline"):
        qstate.gated_delta_update_drafts(state, **inp, intermediate=inter, state_format="int8:head",
                                         state_scale=torch.ones(batch + 1, HV), slot_indices=slots)


def test_torch_compile_through_the_custom_ops():
    """Verify and commit trace whole (fullgraph) through their custom ops and equal the eager
    calls bit for bit, over rounds that flush."""
    T = 2
    caches = [allocate(2, channel=False, ring_len=3, max_draft=T, read="fp8_e4m3:row") for _ in range(2)]
    rounds = [(drafts(2, T, channel=False, seed=80 + r), torch.tensor([2, 1], dtype=torch.int32)) for r in range(2)]

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled(q, k, v, g, beta, accepted):
        o = qstate.gated_delta_replay_verify(caches[1], q, k, v, g, beta)
        qstate.gated_delta_replay_commit(caches[1], accepted)
        return o

    for inp, accepted in rounds:
        expected = qstate.gated_delta_replay_verify(caches[0], **inp)
        qstate.gated_delta_replay_commit(caches[0], accepted)
        assert torch.equal(compiled(**inp, accepted=accepted), expected)
    for name, t in caches[0].tensors().items():
        if t is not None:
            assert torch.equal(caches[1].tensors()[name], t), name
