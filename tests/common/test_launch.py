"""kernels/common/launch.py: which calls reuse a compiled kernel's launcher, and with which arguments.

A stand-in kernel records what Triton would be asked: ``kernel[grid](*args, **constexprs)``
(binding and, on a miss, compiling) or the compiled kernel's ``[grid](*all_args)``."""

import inspect
import types

import pytest
import torch

from qstate.kernels.common import launch, signature


def _params(a_ptr, b_ptr, n, seed, BLOCK, FLAG=True):
    """The stand-in kernel's parameters: two pointers, two ints, two constexprs (one defaulted)."""


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("compiled", grid, args))


class _Kernel:
    def __init__(self):
        self.log = []
        self.arg_names = list(inspect.signature(_params).parameters)
        self.signature = inspect.signature(_params)

    def __getitem__(self, grid):
        def bind(*args, **kwargs):
            self.log.append(("bind", grid, args, kwargs))
            return _Compiled(self.log)
        return bind


@pytest.fixture
def kernel():
    return _Kernel()


def _args(a=None, b=None, n=64, seed=5):
    a = torch.zeros(8) if a is None else a
    b = torch.zeros(8, dtype=torch.int32) if b is None else b
    return (a, b, n, seed)


CONSTEXPRS = dict(BLOCK=32, num_warps=4, launch_pdl=True)


def test_first_call_binds_later_calls_take_the_compiled_launcher(kernel):
    run = launch.CompiledLaunch(kernel, volatile=("seed",))
    args = _args()
    run((3, 1), args, CONSTEXPRS, on_gpu=True)
    run((3, 1), args, CONSTEXPRS, on_gpu=True)
    assert kernel.log[0] == ("bind", (3, 1), args, CONSTEXPRS)
    # Every parameter in order: the call's arguments, then the constexprs (launch options
    # dropped, defaults filled in).
    assert kernel.log[1] == ("compiled", (3, 1, 1), (*args, 32, True))
    assert len(kernel.log) == 2


@pytest.mark.parametrize("change", ["dtype", "alignment", "int value", "grid", "plan", "volatile type"])
def test_anything_triton_specializes_on_binds_again(kernel, change):
    run = launch.CompiledLaunch(kernel, volatile=("seed",))
    run((3, 1), _args(), CONSTEXPRS, on_gpu=True)
    grid, constexprs, args = (3, 1), CONSTEXPRS, _args()
    if change == "dtype":
        args = _args(a=torch.zeros(8, dtype=torch.float16))
    elif change == "alignment":
        args = _args(b=torch.zeros(9, dtype=torch.int32)[1:])  # 4 bytes past a 16-byte boundary
    elif change == "int value":
        args = _args(n=65)
    elif change == "grid":
        grid = (4, 1)
    elif change == "plan":
        constexprs = dict(CONSTEXPRS)  # another launch plan: equal values, another object
    else:
        args = _args(seed=2**31)  # an i64 where the first call had an i32
    run(grid, args, constexprs, on_gpu=True)
    assert [entry[0] for entry in kernel.log] == ["bind", "bind"]


def test_a_volatile_argument_keeps_the_compiled_kernel(kernel):
    run = launch.CompiledLaunch(kernel, volatile=("seed",))
    for seed in (5, 1, 16, 2**31 - 1):  # values Triton would specialize on, were it allowed to
        run((3, 1), _args(seed=seed), CONSTEXPRS, on_gpu=True)
    assert [entry[0] for entry in kernel.log] == ["bind", "compiled", "compiled", "compiled"]
    assert [entry[2][3] for entry in kernel.log[1:]] == [1, 16, 2**31 - 1]


def test_a_non_volatile_seed_binds_per_value(kernel):
    run = launch.CompiledLaunch(kernel)
    run((3, 1), _args(seed=5), CONSTEXPRS, on_gpu=True)
    run((3, 1), _args(seed=6), CONSTEXPRS, on_gpu=True)
    assert [entry[0] for entry in kernel.log] == ["bind", "bind"]


def test_not_compiled_always_binds(kernel):
    run = launch.CompiledLaunch(kernel)
    for _ in range(3):
        run((3, 1), _args(), CONSTEXPRS, on_gpu=False)
    assert [entry[0] for entry in kernel.log] == ["bind"] * 3


def test_clear_and_the_signature_bound(kernel, monkeypatch):
    run = launch.CompiledLaunch(kernel)
    run((3, 1), _args(), CONSTEXPRS, on_gpu=True)
    run.clear()
    run((3, 1), _args(), CONSTEXPRS, on_gpu=True)
    monkeypatch.setattr(launch, "MAX_SIGNATURES", 2)
    run((3, 1), _args(n=1), CONSTEXPRS, on_gpu=True)  # second entry
    run((3, 1), _args(n=2), CONSTEXPRS, on_gpu=True)  # table full: starts again
    run((3, 1), _args(), CONSTEXPRS, on_gpu=True)
    assert [entry[0] for entry in kernel.log] == ["bind"] * 5
    assert len(run._launchers) == 2


def test_replace_kernel_swaps_the_module_attribute_and_its_launch(kernel):
    module = types.ModuleType("kernels_under_test")
    module._k = kernel
    module._launch = launch.CompiledLaunch(kernel)
    module._launch((3, 1), _args(), CONSTEXPRS, on_gpu=True)
    other = _Kernel()
    launch.replace_kernel(module, "_k", other)
    module._launch((3, 1), _args(), CONSTEXPRS, on_gpu=True)
    assert module._k is other and module._launch.kernel is other
    assert [entry[0] for entry in other.log] == ["bind"]


def test_register_caps_apply_to_gpu_launches_only():
    """A cap is a ptxas option: the interpreter takes no ``maxnreg``, and None leaves ptxas's choice."""
    assert launch.register_cap(128, torch.device("cpu")) == {}
    assert launch.register_cap(None, torch.device("cuda")) == {}
    assert launch.register_cap(128, torch.device("cuda")) == {"maxnreg": 128}


def _prepared(kernel, leading=lambda args: args, on_gpu=True):
    """A first call's launch and that launch prepared (``leading(args)``: what the repeats pass)."""
    run = launch.CompiledLaunch(kernel, volatile=("seed",))
    args = _args()
    run((3, 1), args, CONSTEXPRS, on_gpu=on_gpu)
    return run.prepare((3, 1), args, CONSTEXPRS, leading(args), on_gpu=on_gpu)


def test_a_prepared_launch_puts_the_call_arguments_before_the_bound_ones(kernel):
    prepared = _prepared(kernel)
    a, b = torch.ones(8), torch.ones(8, dtype=torch.int32)
    assert prepared(a, b, 64, 9)
    assert kernel.log[-1] == ("compiled", (3, 1, 1), (a, b, 64, 9, 32, True))
    assert len(kernel.log) == 2  # the first call's bind, then the prepared launch: no bind


def test_a_view_at_the_same_address_may_stand_for_its_argument(kernel):
    run = launch.CompiledLaunch(kernel, volatile=("seed",))
    a = torch.zeros(8)
    args = _args(a=a.view(torch.int32))  # what a launcher passes for a state in its storage dtype
    run((3, 1), args, CONSTEXPRS, on_gpu=True)
    assert run.prepare((3, 1), args, CONSTEXPRS, (a, *args[1:]), on_gpu=True) is not None


@pytest.mark.parametrize("change", ["alignment", "volatile type"])
def test_a_prepared_launch_refuses_what_triton_would_compile_again(kernel, change):
    prepared = _prepared(kernel)
    a, b, n, seed = _args()
    if change == "alignment":
        b = torch.zeros(9, dtype=torch.int32)[1:]
    else:
        seed = 2**31
    assert not prepared(a, b, n, seed)
    assert len(kernel.log) == 1  # nothing launched


def test_copies_and_uncompiled_launches_are_not_prepared(kernel):
    assert _prepared(kernel, leading=lambda args: (args[0].clone(), *args[1:])) is None  # a copy made for the launch
    assert _prepared(kernel, on_gpu=False) is None  # the interpreter


def test_prepared_launches_launch_all_or_nothing(kernel):
    """Two launches made as one from the op's tensors: a tensor at another alignment refuses
    both; a volatile leading integer cannot be among them."""
    a, b = _args()[:2]  # 16-byte aligned, as the prepared calls' tensors
    both = launch.PreparedLaunches([_prepared(kernel, leading=lambda args: args[:2]) for _ in range(2)],
                                   lambda a, b: ((a, b), (b, b)), (a, b))
    c, d = torch.ones(8), torch.ones(8, dtype=torch.int32)
    assert both(c, d)
    assert [entry[2][:2] for entry in kernel.log[2:]] == [(c, d), (d, d)]
    assert not both(c, torch.zeros(9, dtype=torch.int32)[1:])
    assert len(kernel.log) == 4
    with pytest.raises(ValueError, match="volatile"):
        launch.PreparedLaunches([_prepared(kernel)], lambda *t: (t,), _args())


def _dispatch_call(dispatch, checks, signature, kernel):
    """An op's call: its entry, the prepared launch on a hit, else the launch, then prepared."""
    entry = dispatch.entry(signature, (), checks.append, signature)
    if entry.launch(*_args()):
        return "prepared"
    if entry.unprepared:
        entry.keep(_prepared(kernel))
    return "full"


def test_one_dispatch_entry_per_signature(kernel):
    dispatch, checks = launch.Dispatch("test::op"), []
    calls = [_dispatch_call(dispatch, checks, signature, kernel) for signature in ("a", "a", "a", "b", "a")]
    assert calls == ["full", "prepared", "prepared", "full", "prepared"]
    assert checks == ["a", "b"] and len(dispatch) == 2
    assert dispatch.entry("a", (), checks.append, "a") is dispatch.entry("a", (), checks.append, "a")


def test_a_failed_check_keeps_no_entry_and_raises_every_call():
    dispatch = launch.Dispatch("test::op")

    def check(value):
        raise ValueError(f"value: expected something else, got {value}")

    for _ in range(2):
        with pytest.raises(ValueError, match="value: expected something else, got 3"):
            dispatch.entry(("sig", 3), (), check, 3)
    assert len(dispatch) == 0
    checks = []
    dispatch.entry(("unhashable", []), (), checks.append, 1)
    dispatch.entry(("unhashable", []), (), checks.append, 2)
    assert checks == [1, 2] and len(dispatch) == 0


def test_an_entry_that_cannot_be_prepared_takes_the_full_path(kernel):
    entry = launch.Dispatch("test::op").entry("a", (), lambda: None)
    entry.keep(None)
    assert not entry.unprepared and not entry.launch(*_args())


def test_dispatch_follows_enabled_and_clear(kernel, monkeypatch):
    dispatch = launch.Dispatch("test::op")
    entry = dispatch.entry("a", (), lambda: None)
    entry.keep(_prepared(kernel))
    monkeypatch.setattr(launch, "ENABLED", False)
    assert not entry.launch(*_args())
    assert not dispatch.entry("b", (), lambda: None).unprepared
    monkeypatch.setattr(launch, "ENABLED", True)
    assert entry.launch(*_args())
    launch.clear_dispatches()
    assert len(dispatch) == 0


@pytest.mark.parametrize("guards", [True, False], ids=["tensor-guard", "key-only"])
def test_tensor_layouts_are_part_of_the_signature(monkeypatch, guards):
    """A repeat of a layout (recognized by the tensor guard, or by the key where torch has no
    working guard) skips the checks; another shape, stride, dtype, None in another place or a
    non-tensor runs them, and a return to an earlier layout finds its entry again."""
    monkeypatch.setattr(signature, "_GUARDS_WORK", guards)
    dispatch, checks = launch.Dispatch("test::op"), []
    base = torch.zeros(3, 4)

    def call(label, *tensors):
        return dispatch.entry(("plain",), tensors, checks.append, label)

    first = call("first", base, None)
    assert call("same layout", torch.ones(3, 4), None) is first
    variants = {"shape": (torch.zeros(4, 4), None), "stride": (torch.zeros(4, 3).t(), None),
                "dtype": (base.double(), None), "None moved": (None, base)}
    entries = {label: call(label, *tensors) for label, tensors in variants.items()}
    assert all(entry is not first for entry in entries.values())
    assert call("first again", torch.ones(3, 4), None) is first
    # What the guard also compares but the key does not (autograd keys): a guard miss, the same entry.
    assert call("requires grad", torch.ones(3, 4, requires_grad=True), None) is first
    call("not a tensor", [[0.0] * 4] * 3, None)
    call("not a tensor", [[0.0] * 4] * 3, None)
    assert checks == ["first", *variants, "not a tensor", "not a tensor"]


def test_tensor_guard_probe_and_compile_tracing_fall_back_to_the_key(monkeypatch):
    assert signature._GUARDS_WORK, "this torch's tensor guard no longer behaves as the fast path needs"
    dispatch, checks = launch.Dispatch("test::op"), []
    dispatch.entry("p", (torch.zeros(2),), checks.append, 1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.entry("p", (torch.zeros(2),), checks.append, 2) is dispatch.entry("p", (torch.zeros(2),),
                                                                                      checks.append, 3)
    assert checks == [1]


def test_alternating_layouts_make_each_guard_once(monkeypatch):
    """A loop over a few batch sizes meets each layout's guard, made once; more layouts than
    RECENT_LAYOUTS still find their entries (by the key) and run no check again."""
    made = []
    real = signature.TensorsLike.of
    monkeypatch.setattr(signature.TensorsLike, "of", classmethod(lambda cls, t: made.append(1) or real(t)))
    dispatch, checks = launch.Dispatch("test::op"), []
    sizes = range(1, launch.RECENT_LAYOUTS + 3)
    entries = {}
    for _ in range(3):
        for batch in sizes:
            entry = dispatch.entry("p", (torch.zeros(batch, 4), None), checks.append, batch)
            assert entries.setdefault(batch, entry) is entry
    assert checks == list(sizes) and len(made) == len(sizes)
    for batch in sizes[-launch.RECENT_LAYOUTS:]:
        assert dispatch.entry("p", (torch.zeros(batch, 4), None), checks.append, -1) is entries[batch]
    assert checks == list(sizes)
