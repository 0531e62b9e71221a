"""Per-slot flags of the gated delta rule ops (``kernels/README.md#cursor-safety``) under the
interpreter: a cursor outside the ring, written into the cache's memory behind ``from_tensors``'
host check, makes the replay step output NaN for its row, write nothing of its slot (its cursor
included) and set ``SLOT_BAD_CURSOR``, while every byte of every other slot equals a run where
that row is padding; a NaN in one row's inputs sets ``SLOT_NONFINITE`` for that row's slot only
(conventional step with ``slot_flags``, replay step and flush) and leaves every other slot's
bytes and outputs equal to a clean run's; ``reset`` clears the reset slots' flags."""

import dataclasses

import pytest
import torch

import qstate
from qstate import SLOT_BAD_CURSOR, SLOT_NONFINITE

from helpers.gated_delta import bits_of, stored_state, token

HK, HV, K, V = 1, 2, 32, 16
SLOTS, RING, BAD_SLOT = 4, 4, 2
NAN = float("nan")


def _bytes(t):
    return t.detach().contiguous().unsqueeze(-1).view(torch.uint8).clone()  # [..., 1, bytes]: rows kept


def _clone(cache):
    return dataclasses.replace(cache, **{n: t.clone() for n, t in cache.tensors().items() if t is not None})


def _same_slots(a, b, slots):
    """Every per-slot tensor equal at ``slots``; the cache-wide ones (``commit_errors``) whole."""
    for name, t in a.tensors().items():
        if t is None:
            continue
        if t.shape[0] == a.num_slots:
            assert torch.equal(_bytes(t)[slots], _bytes(b.tensors()[name])[slots]), name
        else:
            assert torch.equal(_bytes(t), _bytes(b.tensors()[name])), name


def _staggered(read="fp8_e4m3:row", channel=False):
    """Slots at cursors 3, 3, 1, 3 after some steps (rings and checkpoints non-trivial)."""
    cache = qstate.GatedDeltaReplayCache.allocate(SLOTS, HK, HV, K, V, gate="channel" if channel else "scalar",
                                                  ring_len=RING, read=read, input_dtype=torch.float32)
    cache.reset(range(SLOTS), torch.randn(SLOTS, HV, V, K, generator=torch.Generator().manual_seed(1)))
    for t, rows in enumerate(([0, 1, 2, 3], [0, 2], [2], [2, 3, 0, 1], [1, 2, 3])):
        qstate.gated_delta_replay(cache, **token(len(rows), HK, HV, K, V, channel=channel, seed=t),
                                  slot_indices=torch.tensor(rows))
    assert cache.cursor.tolist() == [3, 3, 1, 3] and not cache.slot_flags.any()
    return cache


@pytest.mark.parametrize("garbage", [RING, -2, 100000])
def test_a_garbage_cursor_writes_nothing_and_flags_the_slot(garbage):
    cache = _staggered()
    cache.cursor[BAD_SLOT] = garbage  # device memory, behind from_tensors' check
    clean = _clone(cache)
    before = _clone(cache)
    inp = token(SLOTS, HK, HV, K, V, seed=9)
    out = torch.full((SLOTS, HV, V), NAN)
    qstate.gated_delta_replay(cache, **inp, slot_indices=torch.arange(SLOTS), out=out)
    padded = torch.tensor([0, 1, -1, 3])
    expected = qstate.gated_delta_replay(clean, **inp, slot_indices=padded)
    others = [0, 1, 3]
    assert torch.equal(out[others], expected[others])
    assert out[BAD_SLOT].isnan().all()
    _same_slots(cache, clean, others)
    assert cache.slot_flags.tolist() == [0, 0, SLOT_BAD_CURSOR, 0]
    cache.slot_flags[BAD_SLOT] = 0  # the only word of the bad slot the call may write
    _same_slots(cache, before, [BAD_SLOT])


def _poisoned(inp, row):
    bad = {n: t.clone() for n, t in inp.items()}
    bad["v"][row, 1, 3] = NAN
    return bad


@pytest.mark.parametrize("fmt", ["fp32", "int8:row", "fp8_e4m3:block32"])
def test_conventional_flags_the_poisoned_rows_slot_only(fmt):
    q = stored_state(qstate.formats.StateFormat.parse(fmt), (SLOTS, HV, V, K))
    rows = torch.tensor([2, 0, -1, 3], dtype=torch.int32)  # slot 1 idle, a padding row
    inp = token(4, HK, HV, K, V, seed=3)
    poisoned = _poisoned(inp, 1)  # slot 0
    poisoned["q"][2] = NAN  # the padding row: no slot to flag

    def run(inputs, flags):
        state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
        out = torch.full((4, HV, V), NAN)
        qstate.gated_delta_update(state, **inputs, state_indices=rows, state_scale=scale, state_format=fmt,
                                  out=out, slot_flags=flags)
        return state, scale, out

    flags = torch.zeros(SLOTS, dtype=torch.int32)
    state, scale, out = run(poisoned, flags)
    assert flags.tolist() == [SLOT_NONFINITE, 0, 0, 0]
    clean_flags = torch.zeros(SLOTS, dtype=torch.int32)
    clean_state, clean_scale, clean_out = run(inp, clean_flags)
    assert not clean_flags.any()
    others = [1, 2, 3]
    assert torch.equal(bits_of(state[others]), bits_of(clean_state[others]))
    if scale is not None:
        assert torch.equal(bits_of(scale[others]), bits_of(clean_scale[others]))
    assert torch.equal(out[[0, 3]], clean_out[[0, 3]]) and not out[2].any()
    # Without slot_flags the op stores and outputs the same bits.
    plain_state, _, plain_out = run(poisoned, None)
    assert torch.equal(bits_of(plain_state), bits_of(state)) and torch.equal(bits_of(plain_out), bits_of(out))
    run(inp, flags)  # sticky: a clean call does not clear it
    assert flags.tolist() == [SLOT_NONFINITE, 0, 0, 0]
    with pytest.raises(TypeError, match="^slot_flags:"):
        run(inp, flags.long())
    with pytest.raises(ValueError, match="^slot_flags:"):
        run(inp, torch.zeros(SLOTS + 1, dtype=torch.int32))


@pytest.mark.parametrize("channel", [False, True], ids=["gdn", "kda"])
def test_replay_flags_the_poisoned_rows_slot_only_and_reset_clears_it(channel):
    """Slot 0 takes a NaN on a normal step (its flush, next, outputs NaN too) and slot 3 on its
    flush; the other slots' bytes and outputs equal a clean run's, step after step."""
    cache = _staggered(channel=channel)
    cache.cursor.copy_(torch.tensor([2, 1, 0, 2], dtype=torch.int32))
    clean = _clone(cache)
    rows = torch.tensor([0, 3, 1, 2])
    for t in range(2):
        inp = token(SLOTS, HK, HV, K, V, channel=channel, seed=20 + t)
        bad = _poisoned(inp, t)  # slot 0 (normal step), then slot 3 (its flush)
        out = qstate.gated_delta_replay(cache, **bad, slot_indices=rows)
        expected = qstate.gated_delta_replay(clean, **inp, slot_indices=rows)
        others = [r for r in range(SLOTS) if r > t]
        assert torch.equal(bits_of(out[others]), bits_of(expected[others]))
        assert out[t].isnan().any()
        _same_slots(cache, clean, [1, 2, 3] if t == 0 else [1, 2])
    assert cache.slot_flags.tolist() == [SLOT_NONFINITE, 0, 0, SLOT_NONFINITE]
    assert not clean.slot_flags.any()
    assert cache.checkpoint[3].isnan().any() and not cache.checkpoint[[1, 2]].isnan().any()
    cache.reset([0])
    assert cache.slot_flags.tolist() == [0, 0, 0, SLOT_NONFINITE]
    again = qstate.GatedDeltaReplayCache.from_tensors(
        checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
        ring_beta=cache.ring_beta, cursor=cache.cursor, read_format=cache.read_format, read=cache.read,
        read_scale=cache.read_scale, slot_flags=cache.slot_flags)
    again.reset([3])
    assert again.slot_flags is cache.slot_flags and not cache.slot_flags.any()
    with pytest.raises(ValueError, match="^slot_flags:"):
        qstate.GatedDeltaReplayCache.from_tensors(
            checkpoint=cache.checkpoint, ring_k=cache.ring_k, ring_v=cache.ring_v, ring_g=cache.ring_g,
            ring_beta=cache.ring_beta, cursor=cache.cursor, read_format=cache.read_format, read=cache.read,
            read_scale=cache.read_scale, slot_flags=cache.slot_flags[:3])
