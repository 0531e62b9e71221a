"""The replay decode op's interface (``qstate.replay_decode``): argument checks, the fake
implementation, ``torch.compile`` through the custom op, the default step kernel, and the eager
path's prepared launches. The kernels' numbers are checked in ``test_replay.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qstate.cache import ReplayCache
from qstate.kernels.mamba2 import replay as replay_kernels
from qstate.ops.replay import replay_decode

from helpers.launches import assert_launched_as_computed
from helpers.replay import make_inputs, new_cache, step_args


# ---------------------------------------------------------------------------- bad input


def small_cache(**kw):
    return new_cache(2, 2, 4, 32, 1, ring_len=2, **kw)


def small_step(batch=2):
    inp = make_inputs(1, batch, 2, 4, 32, 1)
    return step_args(inp, 0)


@pytest.mark.parametrize("after_a_good_call", [False, True])
def test_rejects_mismatched_shapes_devices_and_dtypes(after_a_good_call):
    """Also after a good call (the op checks once per signature)."""
    cache = small_cache()
    args = small_step()
    if after_a_good_call:
        replay_decode(cache, **args)
    with pytest.raises(ValueError, match="x: expected shape"):
        replay_decode(cache, **{**args, "x": torch.zeros(2, 3, 4)})
    with pytest.raises(ValueError, match="B: expected shape"):
        replay_decode(cache, **{**args, "B": torch.zeros(2, 1, 16)})
    with pytest.raises(TypeError, match="x: expected the cache's input dtype"):
        replay_decode(cache, **{**args, "x": args["x"].half()})
    with pytest.raises(ValueError, match="C: expected device"):
        replay_decode(cache, **{**args, "C": args["C"].to("meta")})
    with pytest.raises(TypeError, match="cache: expected a qstate.ReplayCache"):
        replay_decode(object(), **args)
    with pytest.raises(ValueError, match="batch must be <= num_slots"):
        replay_decode(cache, **small_step(batch=3))
    with pytest.raises(TypeError, match="dt_softplus: expected a bool"):
        replay_decode(cache, **{**args, "dt_softplus": 0})
    for name in ("dt", "C", "z"):
        with pytest.raises(TypeError, match=rf"^{name}: expected one of"):
            replay_decode(cache, **{**args, name: args[name].double()})


@pytest.mark.parametrize("after_a_good_call", [False, True])
def test_rejects_bad_slot_indices(after_a_good_call):
    """Values are checked on every call, not once per signature."""
    cache = small_cache()
    args = small_step()
    if after_a_good_call:
        replay_decode(cache, **args, slot_indices=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="repeat"):
        replay_decode(cache, **args, slot_indices=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="num_slots"):
        replay_decode(cache, **args, slot_indices=torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="slot_indices: expected dtype"):
        replay_decode(cache, **args, slot_indices=torch.tensor([0.0, 1.0]))
    # A strided view of [1, 0]: the kernel would read [1, 1], which the host checks never see.
    with pytest.raises(ValueError, match="slot_indices: expected a contiguous tensor"):
        replay_decode(cache, **args, slot_indices=torch.tensor([1, 1, 0, 1])[::2])


def test_reset_rejects_bad_states_and_slots():
    cache = small_cache(read="fp8_e4m3:row")
    with pytest.raises(ValueError, match="state: expected shape"):
        cache.reset([0], torch.zeros(1, 2, 4, 16))
    with pytest.raises(ValueError, match="slots: expected slot indices in"):
        cache.reset([2])
    with pytest.raises(ValueError, match="distinct"):
        cache.reset([0, 0])
    with pytest.raises(TypeError, match="slots: expected a flat sequence of ints"):
        cache.reset([1.5])
    with pytest.raises(TypeError, match="generator: expected a torch.Generator"):
        cache.reset([0], generator=3)
    assert cache.cursor.tolist() == [0, 0]


def test_fake_impl_traces_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        cache = small_cache(read="fp8_e4m3:row")
        args = small_step()
        out = replay_decode(cache, **args)
    assert out.shape == (2, 2, 4)


@pytest.mark.parametrize("batch, expected", [
    (256, replay_kernels.DEFAULT_HEADS_PER_PROGRAM),
    (64, replay_kernels.DEFAULT_HEADS_PER_PROGRAM),
    (63, 0),
    (16, 0),
    (1, 0),
])
def test_default_step_kernel_by_batch(batch, expected):
    """The launcher's default step kernel follows the H200 measurements (kernels/mamba2/replay.py)."""
    assert replay_kernels.default_heads_per_program(batch) == expected


def test_torch_compile_through_the_custom_op():
    """Under ``torch.compile`` the step goes through ``qstate::replay_decode`` (eager calls run
    its implementation directly): same outputs and cache, bit for bit, over a flush."""
    inp = make_inputs(3, 2, 4, 8, 32, 2)
    caches = [ReplayCache.allocate(2, 4, 8, 32, 2, ring_len=2, read="fp8_e4m3:row", input_dtype=torch.float32)
              for _ in range(2)]
    for c in caches:
        c.reset([0, 1])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled_step(cache, x, dt, A, B, C, D, z, dt_bias):
        return replay_decode(cache, x, dt, A, B, C, D, z, dt_bias, True)

    for t in range(3):
        expected = replay_decode(caches[0], **step_args(inp, t), dt_softplus=True)
        got = compiled_step(caches[1], **step_args(inp, t))
        assert torch.equal(got, expected), t
    for name, tensor in caches[0].tensors().items():
        if tensor is not None:
            assert torch.equal(caches[1].tensors()[name], tensor), name


# ---------------------------------------------------------------------------- prepared eager launches


def _eager_decode_call(seed, batch, num_slots):
    """One step's arguments with every optional one (bf16 ring inputs, slot indices with a
    padding row, an fp8 read copy, so the launcher passes storage views of the cache)."""
    inp = make_inputs(1, batch, 4, 8, 32, 2, seed=seed, dtype=torch.bfloat16)
    args = step_args(inp, 0)
    slots = torch.arange(batch) % num_slots
    slots[1] = -1
    args.update(slot_indices=slots, out=torch.empty(batch, 4, 8, dtype=torch.bfloat16), dt_softplus=True)
    return args


def _eager_cache(num_slots):
    return ReplayCache.allocate(num_slots, 4, 8, 32, 2, ring_len=4, read="fp8_e4m3:row", input_dtype=torch.bfloat16)


def _launched_as(entry):
    """How a logged launch was made: "bind", "compiled" (CompiledLaunch's table: the launcher's
    uint8 view of the fp8 read copy) or "prepared" (the cache's fp8 tensor itself)."""
    kind, name, args = entry[:3]
    read = args[10] if name.startswith("_replay_step") else args[9]
    return "prepared" if kind == "compiled" and read.dtype == torch.float8_e4m3fn else kind


@pytest.mark.parametrize("batch", [2, 64])
def test_an_eager_decode_repeat_launches_what_the_full_path_would(stand_in_kernels, batch):
    """Second call of a signature, other inputs and another cache of the same layout: the step
    and flush kernels' compiled launchers, no bind, with exactly the arguments the launcher
    computes for that call (tensors by address)."""
    log = stand_in_kernels(replay_kernels)
    caches = [_eager_cache(batch + 1) for _ in range(2)]
    replay_decode(caches[0], **_eager_decode_call(0, batch, batch + 1))
    second = _eager_decode_call(1, batch, batch + 1)
    replay_decode(caches[1], **second)
    step = "_replay_step_grouped_kernel" if replay_kernels.default_heads_per_program(batch) else "_replay_step_kernel"
    assert [(_launched_as(entry), entry[1]) for entry in log] == [
        ("bind", step), ("bind", "_replay_flush_kernel"), ("prepared", step), ("prepared", "_replay_flush_kernel")]
    c, s = caches[1], second
    expected = replay_kernels._decode_launches(
        s["x"], s["dt"], s["A"], s["B"], s["C"], s["D"], s["z"], s["dt_bias"], True, s["slot_indices"], s["out"],
        c.checkpoint, c.checkpoint_scale, c.read, c.read_scale, c.ring_x, c.ring_dt, c.ring_B, c.cursor,
        c.generation, c.flush_rows, c.flush_counters, c.slot_flags, checkpoint_format=c.checkpoint_format,
        read_format=c.read_format, seed=c.seed)
    for bound, launched, (launch, _, args, constexprs) in zip(log[:2], log[2:], expected):
        assert bound[3] == constexprs
        assert_launched_as_computed(launched[2], args, constexprs, launch.kernel.signature.parameters)


def test_an_eager_decode_repeat_takes_the_full_path_where_it_must(stand_in_kernels):
    """A strided dt is copied for the launch (never prepared); a checkpoint at another 16-byte
    alignment, which only the flush kernel reads, is another flush kernel: the step kernel then
    launches once, from CompiledLaunch's table, not twice."""
    log = stand_in_kernels(replay_kernels)

    def call(seed, cache=None, **overrides):
        args = {**_eager_decode_call(seed, 2, 3), **overrides}
        start = len(log)
        replay_decode(cache or _eager_cache(3), **args)
        return [_launched_as(entry) for entry in log[start:]]

    strided_dt = lambda: torch.randn(2, 8)[:, ::2]  # noqa: E731
    assert call(0, dt=strided_dt()) == ["bind", "bind"]
    assert call(1, dt=strided_dt()) == ["compiled", "compiled"]
    assert call(2) == ["compiled", "compiled"]
    assert call(3) == ["prepared", "prepared"]
    cache = _eager_cache(3)
    shifted = torch.empty(cache.checkpoint.numel() + 1)[1:].view(cache.checkpoint.shape)  # 4 bytes off
    assert call(4, cache=dataclasses.replace(cache, checkpoint=shifted)) == ["compiled", "bind"]
