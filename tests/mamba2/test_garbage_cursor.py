"""A cursor outside its ring, written into device memory behind ``from_tensors``' host check,
is met on the device: replay decode (both step kernels), verify and commit on that slot write
nothing of any slot (every byte of every other slot, and of the slot itself, unchanged), do not
crash, output NaN for the row and set ``SLOT_BAD_CURSOR`` in its ``slot_flags``; the other rows
of the batch decode exactly as if the row were padding."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from qstate import SLOT_BAD_CURSOR
from qstate.cache import ReplayCache
from qstate.kernels.mamba2 import replay as replay_kernels
from qstate.ops.replay import replay_decode
from qstate.ops.speculative import replay_commit, replay_verify

from tests.helpers.replay import make_inputs, step_args

H, P, N, G = 2, 4, 5, 1
SLOTS, RING, DRAFT, BAD_SLOT = 4, 3, 2, 2
GARBAGE = (RING + DRAFT, -2, 100000)  # one past a verify cache's ring (and a decode cache's), below, far past
PER_CALL = ("flush_rows", "flush_counters", "commit_errors")  # scratch and error words, not per slot


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().unsqueeze(-1).view(torch.uint8).clone()  # [..., 1, bytes]: rows kept


def _snapshot(cache: ReplayCache) -> dict:
    return {k: _bits(v) for k, v in cache.tensors().items() if v is not None}


def _assert_slots_unchanged(cache: ReplayCache, before: dict, slots) -> None:
    for name, t in cache.tensors().items():
        if t is None or name in PER_CALL:
            continue
        for s in slots:
            assert torch.equal(_bits(t)[s], before[name][s]), f"{name}[{s}] changed"


def _bad_slot_checks(cache: ReplayCache, before: dict, out_row: torch.Tensor) -> None:
    others = [s for s in range(SLOTS) if s != BAD_SLOT]
    _assert_slots_unchanged(cache, before, others)
    flags = cache.slot_flags.clone()
    assert flags[BAD_SLOT] == SLOT_BAD_CURSOR and not flags[others].any()
    cache.slot_flags[BAD_SLOT] = 0  # the only byte of the bad slot the call may write
    before = dict(before, slot_flags=_bits(cache.slot_flags))
    _assert_slots_unchanged(cache, before, [BAD_SLOT])
    assert torch.isnan(out_row).all()
    assert not cache.flush_counters.any()


def _clone(cache: ReplayCache) -> ReplayCache:
    return dataclasses.replace(cache, **{k: v.clone() for k, v in cache.tensors().items() if v is not None})


@functools.lru_cache(maxsize=None)
def _staggered_decode_cache() -> ReplayCache:
    """Slots at cursors 0, 1, 2, 0 after some steps (rings and states non-trivial); callers clone it."""
    inp = make_inputs(6, SLOTS, H, P, N, G, seed=3)
    cache = ReplayCache.allocate(SLOTS, H, P, N, G, ring_len=RING, read="fp8_e4m3:row", input_dtype=torch.float32)
    cache.reset(range(SLOTS), torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(1)))
    for t, rows in enumerate(([0, 1, 2, 3], [1, 2], [2, 3], [0, 1, 2, 3])):
        idx = torch.tensor(rows)
        replay_decode(cache, **step_args(inp, t, idx), dt_softplus=True, slot_indices=idx)
    return cache


@pytest.fixture(params=[0, 2], ids=["per-head-step", "grouped-step"])
def step_kernel(request, monkeypatch):
    launch = functools.partial(replay_kernels.launch_replay_decode, heads_per_program=request.param)
    monkeypatch.setattr(replay_kernels, "launch_replay_decode", launch)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_decode_with_a_garbage_cursor_writes_nothing_and_flags_the_slot(garbage, step_kernel):
    inp = make_inputs(6, SLOTS, H, P, N, G, seed=3)
    cache = _clone(_staggered_decode_cache())
    cache.cursor[BAD_SLOT] = garbage  # device memory, behind from_tensors' check
    before = _snapshot(cache)
    alone = torch.tensor([BAD_SLOT])
    out = replay_decode(cache, **step_args(inp, 4, alone), dt_softplus=True, slot_indices=alone)
    _bad_slot_checks(cache, before, out[0])

    # In a full batch the other rows decode as if the bad row were padding.
    cache.slot_flags.zero_()
    clean = _clone(cache)
    before = _snapshot(cache)
    out = replay_decode(cache, **step_args(inp, 5), dt_softplus=True, slot_indices=torch.arange(SLOTS))
    padded = torch.tensor([0, 1, -1, 3])
    expected = replay_decode(clean, **step_args(inp, 5), dt_softplus=True, slot_indices=padded)
    others = padded >= 0
    assert torch.equal(out[others], expected[others])
    for name, t in cache.tensors().items():
        if t is not None and name not in PER_CALL + ("slot_flags",):
            assert torch.equal(_bits(t)[others], _bits(clean.tensors()[name])[others]), name
            assert torch.equal(_bits(t)[BAD_SLOT], before[name][BAD_SLOT]), name
    assert cache.slot_flags.tolist() == [0, 0, SLOT_BAD_CURSOR, 0]
    assert torch.isnan(out[BAD_SLOT]).all() and not cache.flush_counters.any()


def _draft_inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(SLOTS, T, H, P, generator=g), dt=0.5 * torch.randn(SLOTS, T, H, generator=g),
                A=-(0.5 + torch.rand(H, generator=g)), B=torch.randn(SLOTS, T, G, N, generator=g),
                C=torch.randn(SLOTS, T, G, N, generator=g), D=torch.randn(H, generator=g),
                z=torch.randn(SLOTS, T, H, P, generator=g), dt_bias=-2.0 + 0.5 * torch.randn(H, generator=g))


def _rows(inp, idx):
    return {k: (v[idx] if v.dim() > 1 else v) for k, v in inp.items()}


@functools.lru_cache(maxsize=None)
def _staggered_draft_cache() -> ReplayCache:
    cache = ReplayCache.allocate(SLOTS, H, P, N, G, ring_len=RING, read="fp8_e4m3:row", input_dtype=torch.float32,
                                 max_draft=DRAFT)
    cache.reset(range(SLOTS), torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(2)))
    inp = _draft_inputs(1, 5)
    replay_verify(cache, **inp, dt_softplus=True)
    replay_commit(cache, torch.tensor([1, 0, 1, 1], dtype=torch.int32))
    return cache


@pytest.mark.parametrize("garbage", GARBAGE)
def test_verify_and_commit_with_a_garbage_cursor_write_nothing_and_flag_the_slot(garbage):
    cache = _clone(_staggered_draft_cache())
    cache.cursor[BAD_SLOT] = garbage
    before = _snapshot(cache)
    alone = torch.tensor([BAD_SLOT])
    out = replay_verify(cache, **_rows(_draft_inputs(DRAFT, 6), alone), dt_softplus=True, slot_indices=alone)
    _bad_slot_checks(cache, before, out[0])

    cache.drafts[BAD_SLOT] = DRAFT  # a pending verify, as the host check of a CPU commit wants
    before = _snapshot(cache)
    replay_commit(cache, torch.tensor([1], dtype=torch.int32), alone)
    _bad_slot_checks(cache, before, torch.full((1,), float("nan")))
    assert not cache.commit_errors.any()


def test_a_commit_past_the_ring_from_garbage_drafts_writes_nothing_and_flags_the_slot():
    cache = _clone(_staggered_draft_cache())
    cache.drafts[BAD_SLOT] = 100  # garbage: the accepted count passes the host check, not the ring
    before = _snapshot(cache)
    alone = torch.tensor([BAD_SLOT])
    replay_commit(cache, torch.tensor([50], dtype=torch.int32), alone)
    _bad_slot_checks(cache, before, torch.full((1,), float("nan")))
