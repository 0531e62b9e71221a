"""Properties of every op and cache method over random slot sets, formats and ring positions
(tiny shapes, derandomized in CI): an unnamed slot keeps every byte (codes, scales, ring,
cursor, counters); a NaN or inf in one row changes no other row's output or slot, bit for bit;
two identical runs, ``+sr`` included, give the same bits."""

import pytest
import torch
from helpers import ci_examples
from hypothesis import given
from hypothesis import strategies as st

import qstate
from qstate.cache import ReplayCache
from qstate.formats import quantize

# The poisoned rows' NaN and inf make the interpreter's numpy warn; the assertions are the check.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SLOTS, H, P, N, G = 5, 2, 3, 32, 1
STATE_FORMATS = ["fp32", "bf16+sr", "fp16", "int8:row", "fp8_e4m3:head", "fp8_e5m2:block32", "int8:row+sr"]
CHECKPOINTS = ["fp32", "bf16+sr", "int8:row"]
READS = [None, "fp8_e4m3:row", "int8:block32"]


def _bits(t):
    if t is None:
        return None
    t = t.detach().contiguous()
    return t.view(torch.uint8).clone() if t.dtype.is_floating_point else t.clone()


def _same(a, b):
    return (a is None and b is None) or torch.equal(_bits(a), _bits(b))


def _inputs(batch, seed, T=None):
    g = torch.Generator().manual_seed(seed)
    lead = (batch,) if T is None else (batch, T)
    return dict(x=torch.randn(*lead, H, P, generator=g), dt=torch.randn(*lead, H, generator=g),
                A=-torch.rand(H, generator=g) - 0.5, B=torch.randn(*lead, G, N, generator=g),
                C=torch.randn(*lead, G, N, generator=g), D=torch.randn(H, generator=g),
                z=torch.randn(*lead, H, P, generator=g), dt_bias=torch.randn(H, generator=g))


slot_rows = st.lists(st.one_of(st.integers(0, SLOTS - 1), st.just(-1)), min_size=1, max_size=4).filter(
    lambda rows: len([r for r in rows if r >= 0]) == len({r for r in rows if r >= 0}))


def _state(fmt, seed):
    values = torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(seed))
    q = quantize(values, fmt, generator=torch.Generator().manual_seed(seed))
    return q.data, q.scale


@ci_examples(6)
@given(fmt=st.sampled_from(STATE_FORMATS), rows=slot_rows, seed=st.integers(0, 2**31 - 1))
def test_selective_state_update_keeps_unnamed_slots(fmt, rows, seed):
    state, scale = _state(fmt, seed % 1000)
    before = (_bits(state), _bits(scale))
    idx = torch.tensor(rows)
    inp = _inputs(len(rows), seed % 1000)
    out = qstate.selective_state_update(state, **inp, dt_softplus=True, state_batch_indices=idx,
                                        state_scale=scale, state_format=fmt, seed=seed)
    untouched = [s for s in range(SLOTS) if s not in rows]
    assert torch.equal(_bits(state[untouched]), before[0][untouched])
    if scale is not None:
        assert torch.equal(_bits(scale[untouched]), before[1][untouched])
    assert torch.all(out[idx < 0] == 0)


def _cache(ck, rd, seed, *, max_draft=0, warm_steps=0):
    """A cache with every slot admitted and ring positions spread by a few warm-up steps."""
    cache = ReplayCache.allocate(SLOTS, H, P, N, G, ring_len=3, checkpoint=ck, read=rd, input_dtype=torch.float32,
                                 seed=seed, max_draft=max_draft)
    g = torch.Generator().manual_seed(seed)
    cache.reset(list(range(SLOTS)), torch.randn(SLOTS, H, P, N, generator=g), generator=g)
    for t in range(warm_steps):
        rows = torch.arange(SLOTS)[: 1 + (t * 2) % SLOTS]  # a different number of tokens per slot
        qstate.replay_decode(cache, **_inputs(len(rows), seed + t), dt_softplus=True, slot_indices=rows)
    return cache


def _snapshot(cache):
    return {k: _bits(v) for k, v in cache.tensors().items()}


def _unnamed_unchanged(cache, before, rows):
    untouched = [s for s in range(SLOTS) if s not in rows]
    for name, t in cache.tensors().items():
        if t is None or name in ("flush_rows", "flush_counters", "commit_errors"):
            continue
        assert torch.equal(_bits(t)[untouched], before[name][untouched]), name
    assert cache.flush_counters.tolist() == [0, 0]
    assert torch.equal(_bits(cache.commit_errors), before["commit_errors"])


@ci_examples(5)
@given(ck=st.sampled_from(CHECKPOINTS), rd=st.sampled_from(READS), rows=slot_rows, seed=st.integers(0, 999),
       warm=st.integers(0, 3))
def test_replay_decode_and_reset_keep_unnamed_slots(ck, rd, rows, seed, warm):
    cache = _cache(ck, rd, seed, warm_steps=warm)
    before = _snapshot(cache)
    idx = torch.tensor(rows)
    out = qstate.replay_decode(cache, **_inputs(len(rows), seed), dt_softplus=True, slot_indices=idx)
    _unnamed_unchanged(cache, before, rows)
    assert torch.all(out[idx < 0] == 0)
    before = _snapshot(cache)
    live = [r for r in rows if r >= 0]
    cache.reset(live, torch.randn(len(live), H, P, N), generator=torch.Generator().manual_seed(seed))
    _unnamed_unchanged(cache, before, live)


@ci_examples(4)
@given(rd=st.sampled_from(READS), rows=slot_rows, seed=st.integers(0, 999), T=st.integers(1, 2))
def test_verify_and_commit_keep_unnamed_slots(rd, rows, seed, T):
    cache = _cache("fp32", rd, seed, max_draft=2)
    before = _snapshot(cache)
    idx = torch.tensor(rows)
    qstate.replay_verify(cache, **_inputs(len(rows), seed, T=T), dt_softplus=True, slot_indices=idx)
    _unnamed_unchanged(cache, before, rows)
    before = _snapshot(cache)
    qstate.replay_commit(cache, torch.full((len(rows),), T, dtype=torch.int32), idx)
    _unnamed_unchanged(cache, before, rows)


@ci_examples(5)
@given(fmt=st.sampled_from(STATE_FORMATS), poison=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
       field=st.sampled_from(["x", "dt", "B", "C", "z"]), seed=st.integers(0, 999))
def test_a_poisoned_row_changes_no_other_row(fmt, poison, field, seed):
    rows = torch.tensor([3, 0, 4])
    inp = _inputs(3, seed)
    runs = []
    for value in (None, poison):
        state, scale = _state(fmt, seed)
        given_inp = {k: v.clone() for k, v in inp.items()}
        if value is not None:
            given_inp[field][1] = value  # row 1 (slot 0)
        out = qstate.selective_state_update(state, **given_inp, dt_softplus=True, state_batch_indices=rows,
                                            state_scale=scale, state_format=fmt, seed=seed)
        runs.append((out, state, scale))
    (out0, state0, scale0), (out1, state1, scale1) = runs
    keep = [0, 2]
    assert torch.equal(_bits(out0[keep]), _bits(out1[keep]))
    others = [s for s in range(SLOTS) if s != 0]
    assert torch.equal(_bits(state0[others]), _bits(state1[others]))
    if scale0 is not None:
        assert torch.equal(_bits(scale0[others]), _bits(scale1[others]))


@ci_examples(1)
@given(ck=st.sampled_from(CHECKPOINTS), rd=st.sampled_from(READS),
       poison=st.sampled_from([float("nan"), float("inf")]), seed=st.integers(0, 999))
def test_a_poisoned_replay_row_changes_no_other_row(ck, rd, poison, seed):
    caches, outs = [], []
    for value in (None, poison):
        cache = _cache(ck, rd, seed)
        ys = []
        for t in range(3):  # up to a flush (ring_len 3)
            inp = _inputs(3, seed + t)
            if value is not None:
                inp["x"][1] = value
            ys.append(qstate.replay_decode(cache, **inp, dt_softplus=True, slot_indices=torch.tensor([2, 1, 4])))
        caches.append(cache)
        outs.append(torch.stack(ys))
    assert torch.equal(_bits(outs[0][:, [0, 2]]), _bits(outs[1][:, [0, 2]]))
    others = [0, 2, 3, 4]
    for name, t in caches[0].tensors().items():
        if t is not None and t.shape[0] == SLOTS and name != "flush_rows":
            assert torch.equal(_bits(t)[others], _bits(caches[1].tensors()[name])[others]), name


@ci_examples(2)
@given(fmt=st.sampled_from(["bf16+sr", "int8:row+sr", "fp8_e4m3:block32+sr"]), seed=st.integers(0, 2**31 - 1))
def test_stochastic_rounding_is_a_function_of_the_seed(fmt, seed):
    results = []
    for seed_arg in (seed, seed, torch.tensor([seed])):
        state, scale = _state(fmt, 1)
        out = qstate.selective_state_update(state, **_inputs(3, 2), dt_softplus=True,
                                            state_batch_indices=torch.tensor([4, 1, 2]), state_scale=scale,
                                            state_format=fmt, seed=seed_arg)
        results.append((_bits(out), _bits(state), _bits(scale)))
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]) if a is not None)
    # A tensor seed holding the same value gives the same noise as the int.
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]) if a is not None)


def test_replay_runs_repeat_bit_for_bit():
    snapshots = []
    for _ in range(2):
        cache = _cache("bf16+sr", "int8:row+sr", 5, warm_steps=2)
        qstate.replay_decode(cache, **_inputs(SLOTS, 9), dt_softplus=True)
        snapshots.append(_snapshot(cache))
    assert all(_same(snapshots[0][k], snapshots[1][k]) for k in snapshots[0])


@ci_examples(3)
@given(fmt=st.sampled_from(["fp32", "int8:row", "fp8_e4m3:row"]), rows=slot_rows, seed=st.integers(0, 999))
def test_baseline_drafts_and_commit_keep_unnamed_slots(fmt, rows, seed):
    from qstate.ops.speculative import commit_drafts, selective_state_update_drafts

    state, scale = _state(fmt, seed)
    before = (_bits(state), _bits(scale))
    idx, T = torch.tensor(rows), 2
    inter = torch.zeros((len(rows), T, H, P, N), dtype=state.dtype)
    inter_scale = None if scale is None else torch.ones((len(rows), T, H, P))
    selective_state_update_drafts(state, **_inputs(len(rows), seed, T=T), dt_softplus=True,
                                  state_batch_indices=idx, intermediate=inter, state_scale=scale,
                                  intermediate_scale=inter_scale, state_format=fmt)
    assert _same(state, before[0]) and _same(scale, before[1])  # read, never written
    commit_drafts(state, inter, torch.full((len(rows),), T, dtype=torch.int32), idx, state_scale=scale,
                  intermediate_scale=inter_scale, state_format=fmt)
    untouched = [s for s in range(SLOTS) if s not in rows]
    assert torch.equal(_bits(state)[untouched], before[0][untouched])
    if scale is not None:
        assert torch.equal(_bits(scale)[untouched], before[1][untouched])
