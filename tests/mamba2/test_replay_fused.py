"""The single-launch replay step (``launch_replay_decode(fused=True)``) and the ``agree``
variant against the two-launch path, bit for bit: outputs and every cache tensor, over flush
cycles with staggered cursors, padding rows, a slot with a garbage cursor, and the two paths
alternating on one cache (the flush kernel leaves ``flush_rows`` zero for the single launch's
tickets). The two-launch path itself is checked against the fp64 reference in test_replay.py."""

from __future__ import annotations

import pytest
import torch

from qstate import SLOT_BAD_CURSOR
from qstate.cache import ReplayCache
from qstate.kernels.mamba2 import replay as replay_kernels

from helpers.replay import make_inputs, new_cache, step_args

H, P, N, G = 4, 12, 20, 2  # headdim 12 → one 16-row tile in both paths, so the sums are the same
L, SLOTS, T = 3, 6, 5
ROWS = torch.tensor([3, -1, 0, 5, 2, 4], dtype=torch.int32)  # slot 1 idle, one padding row
BAD = 4  # slot with a cursor outside its ring


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _run(checkpoint, read, variants):
    """T steps, step t through ``variants[t % len(variants)]`` (launcher keywords); the outputs
    and the cache."""
    cache = new_cache(SLOTS, H, P, N, G, ring_len=L, checkpoint=checkpoint, read=read)
    cache.reset(list(range(SLOTS)), torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(4)),
                generator=torch.Generator().manual_seed(5))
    cache.cursor.copy_(torch.arange(SLOTS, dtype=torch.int32) % L)  # staggered: a row flushes at every step
    cache.cursor[BAD] = 7
    inp = make_inputs(T, len(ROWS), H, P, N, G, seed=6)
    t_ = cache.tensors()
    outs = []
    for t in range(T):
        a = step_args(inp, t)
        out = torch.full((len(ROWS), H, P), float("nan"))
        replay_kernels.launch_replay_decode(
            a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], True, ROWS, out,
            *(t_[k] for k in ("checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B",
                              "cursor", "generation", "flush_rows", "flush_counters", "slot_flags")),
            checkpoint_format=cache.checkpoint_format, read_format=cache.read_format, seed=cache.seed,
            **variants[t % len(variants)])
        outs.append(out)
    return torch.stack(outs), cache


TWO_LAUNCHES = dict(heads_per_program=0, fused=False)


@pytest.mark.parametrize("checkpoint,read,alternate", [("fp32", "fp8_e4m3:row", True), ("bf16+sr", "int8:row", False),
                                                       ("fp16", "int8:head", False)])
def test_single_launch_equals_two_launches_bit_for_bit(checkpoint, read, alternate):
    y0, c0 = _run(checkpoint, read, [TWO_LAUNCHES])
    for variants in [[dict(fused=True)]] + ([[dict(fused=True), TWO_LAUNCHES]] if alternate else []):
        y, c = _run(checkpoint, read, variants)
        assert torch.equal(_bits(y), _bits(y0)), variants
        for name, t in c.tensors().items():
            if t is not None:
                assert torch.equal(_bits(t), _bits(c0.tensors()[name])), (variants, name)
    # Every cursor moved T steps on, the bad one stayed and was flagged; the scratch is zero again.
    expected = (torch.arange(SLOTS) % L + T) % L
    expected[1], expected[BAD] = 1, 7  # slot 1 is in no row; the bad slot is never written
    assert c0.cursor.tolist() == expected.tolist()
    assert c0.slot_flags.tolist() == [SLOT_BAD_CURSOR if s == BAD else 0 for s in range(SLOTS)]
    assert not c0.flush_rows.any() and not c0.flush_counters.any()
    assert bool(torch.isnan(y0[:, 5]).all()) and not bool(y0[:, 1].any())  # the bad slot's row; padding
    assert bool(torch.isfinite(y0[:, [0, 2, 3, 4]]).all())


def test_bad_cursor_slot_keeps_every_byte_in_the_single_launch():
    fresh = new_cache(SLOTS, H, P, N, G, ring_len=L, checkpoint="fp32", read="fp8_e4m3:row")
    fresh.reset(list(range(SLOTS)), torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(4)),
                generator=torch.Generator().manual_seed(5))
    fresh.cursor[BAD] = 7
    _, after = _run("fp32", "fp8_e4m3:row", [dict(fused=True)])
    for name in ("checkpoint", "read", "read_scale", "ring_x", "ring_dt", "ring_B", "generation", "cursor"):
        assert torch.equal(_bits(after.tensors()[name][BAD]), _bits(fresh.tensors()[name][BAD])), name


@pytest.mark.parametrize("kernel", [dict(heads_per_program=0), dict(heads_per_program=2), dict(fused=True)])
def test_agree_variant_is_bit_identical_under_the_interpreter(kernel):
    """``agree`` only makes lanes agree on the GPU; under the interpreter every sum has one value."""
    y0, c0 = _run("fp32", "fp8_e4m3:row", [dict(kernel, agree=False)])
    y, c = _run("fp32", "fp8_e4m3:row", [dict(kernel, agree=True)])
    assert torch.equal(_bits(y), _bits(y0))
    for name, t in c.tensors().items():
        if t is not None:
            assert torch.equal(_bits(t), _bits(c0.tensors()[name])), name


def test_fused_plan_takes_the_flush_tile_and_one_launch():
    cache = ReplayCache.allocate(1, 128, 64, 128, 8, ring_len=16, read="fp8_e4m3:row", device="meta")
    plan = replay_kernels._plan(1, 128, 64, 128, 8, 16, torch.device("cpu"), 1, cache.checkpoint_format,
                                cache.read_format, True, True, True, False, True, None, None, None, None, True, False,
                                None)
    assert plan.fused and plan.step_grid == (128 * 2, 1) and plan.step_constexprs["BLOCK_P"] == 32
