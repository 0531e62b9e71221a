"""Per-slot flags set on the device (``SLOT_NONFINITE``): set for the poisoned slot only, by the
conventional kernel (with ``slot_flags``), replay decode (step and flush kernels), verify and a
verify's flush; the other slots' flags stay zero and their bytes and outputs equal a clean run's;
``reset`` clears a slot's flags; the conventional op without ``slot_flags`` writes the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from qstate import SLOT_BAD_CURSOR, SLOT_NONFINITE, quantize
from qstate.cache import ReplayCache
from qstate.kernels.common.slot_flags import flag_nonfinite
from qstate.ops.conventional import selective_state_update
from qstate.ops.replay import replay_decode
from qstate.ops.speculative import replay_commit, replay_verify

from tests.helpers.replay import make_inputs, step_args

H, P, G = 2, 4, 1
NAN = float("nan")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().unsqueeze(-1).view(torch.uint8).clone()


def _clone(cache: ReplayCache) -> ReplayCache:
    return dataclasses.replace(cache, **{k: v.clone() for k, v in cache.tensors().items() if v is not None})


def _same_slots(a: ReplayCache, b: ReplayCache, slots) -> None:
    for name, t in a.tensors().items():
        if t is not None and t.shape[0] == a.num_slots and name != "flush_rows":
            assert torch.equal(_bits(t)[slots], _bits(b.tensors()[name])[slots]), name


def test_flag_values_are_distinct_bits():
    assert {SLOT_BAD_CURSOR, SLOT_NONFINITE} == {1, 2}


@pytest.mark.parametrize("fmt,dstate", [("fp32", 5), ("fp8_e4m3:row", 5), ("int8:block32", 32)])
def test_conventional_flags_the_poisoned_rows_slot_only(fmt, dstate):
    g = torch.Generator().manual_seed(0)
    nslots = 4
    q = quantize(torch.randn(nslots, H, P, dstate, generator=g), fmt)
    rows = torch.tensor([2, 0, -1, 3])  # slot 1 idle, a padding row
    x = torch.randn(4, H, P, generator=g)
    args = dict(dt=torch.rand(4, H, generator=g), A=-torch.rand(H, generator=g),
                B=torch.randn(4, G, dstate, generator=g), C=torch.randn(4, G, dstate, generator=g),
                D=torch.randn(H, generator=g))
    poisoned = x.clone()
    poisoned[1, 1, 2] = NAN  # slot 0
    poisoned[2] = NAN  # the padding row: no slot to flag

    def run(inputs, flags):
        state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
        out = selective_state_update(state, inputs, **args, state_batch_indices=rows, state_scale=scale,
                                     state_format=fmt, slot_flags=flags)
        return state, scale, out

    flags = torch.zeros(nslots, dtype=torch.int32)
    state, scale, out = run(poisoned, flags)
    assert flags.tolist() == [SLOT_NONFINITE, 0, 0, 0]
    clean_flags = torch.zeros(nslots, dtype=torch.int32)
    clean_state, clean_scale, clean_out = run(x, clean_flags)
    assert not clean_flags.any()
    others = torch.tensor([1, 2, 3])
    assert torch.equal(_bits(state)[others], _bits(clean_state)[others])
    if scale is not None:
        assert torch.equal(_bits(scale)[others], _bits(clean_scale)[others])
    assert torch.equal(out[[0, 3]], clean_out[[0, 3]]) and not out[2].any()
    # Without slot_flags the op stores and outputs the same bits.
    plain_state, plain_scale, plain_out = run(poisoned, None)
    assert torch.equal(_bits(plain_state), _bits(state)) and torch.equal(_bits(plain_out), _bits(out))
    # Sticky: a clean call does not clear it.
    run(x, flags)
    assert flags.tolist() == [SLOT_NONFINITE, 0, 0, 0]


def test_conventional_slot_flags_is_checked():
    state = torch.zeros(2, H, P, 5)
    args = dict(x=torch.zeros(2, H, P), dt=torch.zeros(2, H), A=torch.zeros(H), B=torch.zeros(2, G, 5),
                C=torch.zeros(2, G, 5))
    with pytest.raises(TypeError, match="slot_flags"):
        selective_state_update(state, **args, slot_flags=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_flags"):
        selective_state_update(state, **args, slot_flags=torch.zeros(3, dtype=torch.int32))


def test_replay_decode_flags_step_and_flush_rows_and_reset_clears():
    slots, N = 3, 5
    inp = make_inputs(3, slots, H, P, N, G, seed=4)
    cache = ReplayCache.allocate(slots, H, P, N, G, ring_len=2, read="fp8_e4m3:row", input_dtype=torch.float32)
    cache.reset(range(slots), torch.randn(slots, H, P, N, generator=torch.Generator().manual_seed(5)))
    first = torch.tensor([0, 1])
    replay_decode(cache, **step_args(inp, 0, first), dt_softplus=True, slot_indices=first)  # cursors 1, 1, 0
    clean = _clone(cache)
    poisoned = step_args(inp, 1)
    poisoned["x"] = poisoned["x"].clone()
    poisoned["x"][0, 1, 0] = NAN  # slot 0 flushes this step (flush kernel)
    poisoned["B"] = poisoned["B"].clone()
    poisoned["B"][2, 0, 3] = float("inf")  # slot 2 at cursor 0 (step kernel)
    out = replay_decode(cache, **poisoned, dt_softplus=True)
    expected = replay_decode(clean, **step_args(inp, 1), dt_softplus=True)
    assert cache.slot_flags.tolist() == [SLOT_NONFINITE, 0, SLOT_NONFINITE]
    assert not clean.slot_flags.any()
    _same_slots(cache, clean, [1])
    assert torch.equal(out[1], expected[1])
    cache.reset([0])
    assert cache.slot_flags.tolist() == [0, 0, SLOT_NONFINITE]


def test_verify_and_its_flush_flag_the_poisoned_slot_only():
    slots, N, T = 3, 5, 2
    g = torch.Generator().manual_seed(6)

    def drafts():
        return dict(x=torch.randn(slots, T, H, P, generator=g), dt=torch.randn(slots, T, H, generator=g),
                    A=-torch.rand(H, generator=g) - 0.5, B=torch.randn(slots, T, G, N, generator=g),
                    C=torch.randn(slots, T, G, N, generator=g))

    cache = ReplayCache.allocate(slots, H, P, N, G, ring_len=2, checkpoint="int8:row", read=None,
                                 input_dtype=torch.float32, max_draft=T)
    cache.reset(range(slots), torch.randn(slots, H, P, N, generator=g))
    accept = torch.ones(slots, dtype=torch.int32)
    inp = drafts()
    clean = _clone(cache)
    poisoned = dict(inp, x=inp["x"].clone())
    poisoned["x"][1, 0, 0, 0] = NAN  # slot 1's first draft, accepted below
    replay_verify(cache, **poisoned, dt_softplus=True)
    replay_verify(clean, **inp, dt_softplus=True)
    assert cache.slot_flags.tolist() == [0, SLOT_NONFINITE, 0]
    replay_commit(cache, accept)
    replay_commit(clean, accept)
    cache.slot_flags.zero_()
    # Every cursor is 1 now: the next verify flushes, folding slot 1's NaN token into its checkpoint.
    inp = drafts()
    out = replay_verify(cache, **inp, dt_softplus=True)
    expected = replay_verify(clean, **inp, dt_softplus=True)
    assert cache.slot_flags.tolist() == [0, SLOT_NONFINITE, 0]
    _same_slots(cache, clean, [0, 2])
    assert torch.equal(out[[0, 2]], expected[[0, 2]])


@triton.jit
def _flag_tile_kernel(values_ptr, flags_ptr, slots_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      TWO_D: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    values = tl.load(values_ptr + tl.program_id(0) * BLOCK_R * BLOCK_C + r[:, None] * BLOCK_C + c[None, :])
    slot = tl.load(slots_ptr + tl.program_id(0))
    if TWO_D:
        flag_nonfinite(flags_ptr, slot, values, mask)
    else:
        flag_nonfinite(flags_ptr, slot, tl.reshape(values, [BLOCK_R * BLOCK_C]), tl.reshape(mask, [BLOCK_R * BLOCK_C]))


@pytest.mark.parametrize("two_d", [True, False])
def test_flag_nonfinite_sets_the_bit_once_and_only_under_the_mask(two_d):
    # Tiles of 4 × 8 with 3 × 5 live: per program a value placed at a live or a masked position.
    cases = [(None, False), ((1, 2, NAN), True), ((2, 4, float("inf")), True), ((0, 0, float("-inf")), True),
             ((3, 1, NAN), False), ((1, 6, float("inf")), False), ((2, 2, 3.4e38), False)]
    values = torch.randn(len(cases), 4, 8, generator=torch.Generator().manual_seed(1))
    for i, (where, _) in enumerate(cases):
        if where is not None:
            values[i, where[0], where[1]] = where[2]
    values[6, :3, :5] = 3.4e38  # finite everywhere: a row sum would overflow, the elements do not
    slots = torch.arange(len(cases), dtype=torch.int32) * 2  # odd words are neighbours: never touched
    flags = torch.zeros(2 * len(cases), dtype=torch.int32)
    flags[1::2] = 4  # a bit the kernel must leave alone
    _flag_tile_kernel[(len(cases),)](values, flags, slots, 3, 5, BLOCK_R=4, BLOCK_C=8, TWO_D=two_d)
    expected = torch.tensor([SLOT_NONFINITE if bad else 0 for _, bad in cases], dtype=torch.int32)
    assert torch.equal(flags[0::2], expected)
    assert torch.equal(flags[1::2], torch.full((len(cases),), 4, dtype=torch.int32))
