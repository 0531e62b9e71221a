"""qstate.integrations.transformers: a tiny random Mamba2 / Nemotron-H decodes through qstate.

Kernels run under the Triton interpreter on CPU, so the models are tiny (2 Mamba layers,
4 heads × 16 × 16) and the long runs few.

Bound for the fp32 schemes. Patched and unpatched decodes compute the same fp32 recurrence
with different operation orders (replay through its ring algebra): each state element differs
by a few fp32 roundings (u = 2⁻²⁴ ≈ 6e-8) per step, and the decay |a| < 1 damps earlier
differences instead of piling them up. The logits then go through a few matmuls of width
≤ 128, each adding at most ~√128·u relative rms. So the relative rms difference of the logits
stays near 1e-6; we allow 1e-5 (a bf16 state, u = 2⁻⁹, would sit near 1e-3).
"""

import re
import sys

import pytest
import torch

from helpers import hf_tiny
from qstate.integrations import transformers as qt
from qstate.formats import StateFormat
from qstate.integrations.decode_routes import ConventionalRoute, DecodeStep, ReplayRoute

NEW_TOKENS = 64
FP32_BOUND = 1e-5


@pytest.fixture(scope="module")
def mamba2():
    return hf_tiny.mamba2()


@pytest.fixture(scope="module")
def nemotron_h():
    return hf_tiny.nemotron_h()


def _module_functions(model):
    modules = {type(m).__module__ for _, m in qt.find_mixers(model)}
    return {name: getattr(sys.modules[name], qt.STEP_FUNCTION) for name in modules}


def _assert_unpatched(model, functions):
    for _, mixer in qt.find_mixers(model):
        assert "forward" not in mixer.__dict__
    assert _module_functions(model) == functions
    assert not hasattr(model, "_qstate_patch")


def _rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


@pytest.mark.parametrize("scheme", ["fp32", "replay/fp32/16"])
def test_fp32_schemes_generate_as_the_unpatched_model(mamba2, scheme):
    ids = hf_tiny.prompt()
    reference = hf_tiny.generate(mamba2, ids, NEW_TOKENS)
    with qt.patch(mamba2, scheme) as patched:
        got = hf_tiny.generate(mamba2, ids, NEW_TOKENS)
    # the first token comes from the prefill; every later one from a qstate decode step per layer
    assert set(patched.steps.values()) == {NEW_TOKENS - 1}
    assert torch.equal(got.sequences, reference.sequences)
    errors = [_rel_rms(g, r) for g, r in zip(got.logits, reference.logits)]
    assert len(errors) == NEW_TOKENS
    assert max(errors) <= FP32_BOUND, errors


@pytest.mark.parametrize("scheme", ["fp8_e4m3:row", "replay/fp32/fp8_e4m3:row/4"])
def test_quantized_schemes_generate_finite_logits_on_nemotron_h(nemotron_h, scheme):
    ids = hf_tiny.prompt(batch=2, length=5, seed=1)
    new_tokens = 12
    reference = hf_tiny.generate(nemotron_h, ids, new_tokens)
    with qt.patch(nemotron_h, scheme) as patched:
        got = hf_tiny.generate(nemotron_h, ids, new_tokens)
    assert len(patched.steps) == 2 and set(patched.steps.values()) == {new_tokens - 1}
    logits = torch.stack(got.logits)
    assert torch.isfinite(logits).all()
    # the quantized state changes the logits (so qstate's op really ran), but not by much
    difference = (logits - torch.stack(reference.logits)).abs().max()
    assert 0 < difference < 0.1 * torch.stack(reference.logits).abs().max()


def test_prefill_state_seeds_the_replay_cache(mamba2):
    ids = hf_tiny.prompt(batch=3, length=7, seed=2)
    with torch.no_grad():
        prefill = mamba2(ids, use_cache=True)
    cache = getattr(prefill, qt._cache_argument(mamba2))
    names = [name for name, _ in qt.find_mixers(mamba2)]
    prefill_states = [cache.get_recurrent_state(i, state_idx=0).clone() for i in range(len(names))]
    with qt.patch(mamba2, "replay/fp32/16") as patched:
        qt.decode_logits(mamba2, ids, 1)
        for name, state in zip(names, prefill_states):
            replay = patched.caches[name]
            assert replay.cursor.tolist() == [1, 1, 1]  # one token in the ring, no flush yet
            assert torch.equal(replay.checkpoint, state)  # fp32 checkpoint = the prefill's final state


def test_replay_keeps_its_ring_under_inference_mode(mamba2):
    """torch.inference_mode keeps no version counters, which the routes use to tell their own
    writes of transformers' state from a prefill's or a reorder's. Without them the replay route
    must still keep its ring and flush, not rebuild the cache from the state every token (which
    would measure the conventional scheme under the replay scheme's name)."""
    ids = hf_tiny.prompt(batch=1, length=9)
    runs = []
    for mode in (torch.no_grad, torch.inference_mode):
        with qt.patch(mamba2, "replay/bf16/8") as patched:
            with mode():
                got = mamba2.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
            caches = list(patched.caches.values())
            runs.append(([c.cursor.tolist() for c in caches], [c.generation.tolist() for c in caches],
                         torch.stack(got.logits)))
    (cursors, flushes, logits), (cursors_im, flushes_im, logits_im) = runs
    assert flushes == flushes_im and all(f == [1] for f in flushes)
    assert cursors == cursors_im
    assert torch.equal(logits, logits_im)


_ROUTES = {
    "conventional bf16": lambda: ConventionalRoute("layer", StateFormat.parse("bf16")),
    "conventional fp32 (in place)": lambda: ConventionalRoute("layer", StateFormat.parse("fp32")),
    "replay fp32, ring 4": lambda: ReplayRoute("layer", StateFormat.parse("fp32"), None, ring_len=4),
}


def _drive_route(make_route, mode, clone):
    """Five steps of one route, with an outside write (a halving) before the fourth. ``clone``
    steps a fresh clone and copies it back, as transformers >= 5.25 does. Returns the steps at
    which the route rebuilt its storage, and the final state."""
    route = make_route()
    syncs = []
    real_sync = route.sync
    route.sync = lambda state, step: (syncs.append(route.steps), real_sync(state, step))
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 4, 16, generator=g), torch.rand(1, 4, generator=g), -torch.rand(4, generator=g),
            torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g))

    def step(state):
        stepped = state.clone() if clone else state
        route(None, stepped, *args, dt_softplus=True)
        if clone:
            state.copy_(stepped)

    with mode():
        state = torch.randn(1, 4, 16, 8, generator=g)
        for _ in range(3):
            step(state)
        state.mul_(0.5)
        step(state)
        step(state)
    return syncs, state


@pytest.mark.parametrize("route", list(_ROUTES))
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_route_resyncs_after_an_outside_write_only(route, mode):
    """The route's own steps do not rebuild its storage; a write to the state from outside does,
    with version counters (no_grad) and without them (inference_mode), whether the caller steps
    its own tensor or a fresh clone each step. A followed clone steps exactly as the tensor would
    (an in-place route that kept stepping the previous clone would leave the state behind)."""
    syncs, state = _drive_route(_ROUTES[route], mode, clone=False)
    syncs_cloned, state_cloned = _drive_route(_ROUTES[route], mode, clone=True)
    assert syncs == [0, 3]
    assert syncs_cloned == [0, 3]
    assert torch.equal(state_cloned, state)


def test_restore_is_exact_and_the_model_decodes_as_before(mamba2):
    ids = hf_tiny.prompt(batch=1, length=5, seed=3)
    functions = _module_functions(mamba2)
    tokens, before = qt.decode_logits(mamba2, ids, 3)
    patched = qt.patch(mamba2, "fp8_e4m3:row")
    assert patched.active and mamba2._qstate_patch is patched
    for _, mixer in qt.find_mixers(mamba2):
        assert "forward" in mixer.__dict__
    patched.restore()
    patched.restore()  # idempotent
    _assert_unpatched(mamba2, functions)
    _, after = qt.decode_logits(mamba2, ids, 3, tokens=tokens)
    assert torch.equal(before, after)


def test_two_models_share_the_dispatcher_and_restore_independently():
    first, second = hf_tiny.mamba2(seed=1), hf_tiny.mamba2(seed=2)
    functions = _module_functions(first)
    ids = hf_tiny.prompt(batch=1, length=4, seed=4)
    with qt.patch(first, "fp32") as p1:
        with qt.patch(second, "replay/fp32/4") as p2:
            qt.decode_logits(second, ids, 2)
        qt.decode_logits(first, ids, 2)
        assert set(p1.steps.values()) == {2} and set(p2.steps.values()) == {2}
        # the inner exit left the first model routed
        assert _module_functions(first) != functions
    _assert_unpatched(first, functions)
    _assert_unpatched(second, functions)


def test_model_without_mamba2_mixers_is_rejected():
    with pytest.raises(ValueError, match="Mamba2ForCausalLM or NemotronHForCausalLM"):
        qt.patch(torch.nn.Sequential(torch.nn.Linear(4, 4)), "fp32")
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        qt.patch("not a model", "fp32")


@pytest.mark.parametrize("scheme", ["fp7", "replay/fp32", "replay/fp32/fp8_e4m3:row/0", "", 3])
def test_bad_scheme_is_rejected_and_the_model_untouched(mamba2, scheme):
    functions = _module_functions(mamba2)
    with pytest.raises((ValueError, TypeError), match="scheme|ring_len"):
        qt.patch(mamba2, scheme)
    _assert_unpatched(mamba2, functions)


@pytest.mark.parametrize("version", ["5.26.0", "6.1.0.dev0", "4.57.1"])
def test_an_unchecked_transformers_release_is_rejected_and_the_model_untouched(mamba2, monkeypatch, version):
    """A release whose decode call was not read may step the state in a way the routes do not
    follow (5.25 began stepping a clone), so releases outside the checked range fail."""
    functions = _module_functions(mamba2)
    monkeypatch.setattr(qt, "_transformers_version", lambda: version)
    with pytest.raises(ValueError, match=r"model: expected a model of transformers >= 5\.0, < 5\.26 .*got "
                                         rf"transformers {re.escape(version)}"):
        qt.patch(mamba2, "replay/fp32/16")
    monkeypatch.undo()
    _assert_unpatched(mamba2, functions)


def test_patching_twice_is_rejected(mamba2):
    functions = _module_functions(mamba2)
    with qt.patch(mamba2, "fp32"):
        with pytest.raises(ValueError, match="already patched"):
            qt.patch(mamba2, "bf16")
    _assert_unpatched(mamba2, functions)


def test_a_failure_midway_leaves_the_model_unpatched(mamba2, monkeypatch):
    functions = _module_functions(mamba2)
    real_wrap, calls = qt._wrap_forward, []

    def wrap_then_fail(mixer, route):
        calls.append(mixer)
        if len(calls) == 2:
            raise RuntimeError("injected failure on the second mixer")
        real_wrap(mixer, route)

    monkeypatch.setattr(qt, "_wrap_forward", wrap_then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        qt.patch(mamba2, "fp32")
    assert len(calls) == 2
    _assert_unpatched(mamba2, functions)


def test_a_cache_on_another_device_is_rejected(mamba2):
    with qt.patch(mamba2, "fp32") as patched:
        route = next(iter(patched.routes.values()))
        state = torch.zeros(1, 4, 16, 16, device="meta")
        x, dt = torch.zeros(1, 4, 16), torch.zeros(1, 4, 16)
        A = torch.zeros(4, 16, 16)
        B = C = torch.zeros(1, 1, 16)
        with pytest.raises(ValueError, match="cache: .* on meta .* inputs are on cpu"):
            route(None, state, x, dt, A, B, C, torch.ones(4, 16), dt_bias=torch.zeros(4, 16), dt_softplus=True)


def test_decode_step_compacts_tied_arguments_and_rejects_untied_ones():
    dt = torch.randn(2, 4)[:, :, None].expand(2, 4, 16)
    A = torch.randn(4)[:, None, None].expand(4, 16, 8)
    step = DecodeStep.from_transformers(torch.randn(2, 4, 16), dt, A, torch.randn(2, 1, 8), torch.randn(2, 1, 8),
                                        torch.ones(4)[:, None].expand(4, 16), None, True, None)
    assert step.dt.shape == (2, 4) and step.A.shape == (4,) and step.D.shape == (4,)
    assert torch.equal(step.dt, dt[..., 0]) and torch.equal(step.A, A[:, 0, 0])
    with pytest.raises(ValueError, match="dt: expected mamba_ssm's tied form"):
        DecodeStep.from_transformers(torch.randn(2, 4, 16), torch.randn(2, 4, 16), A, torch.randn(2, 1, 8),
                                     torch.randn(2, 1, 8), None, None, True, None)


def test_decode_logits_rejects_bad_arguments(mamba2):
    with pytest.raises(ValueError, match="input_ids: expected an integer tensor"):
        qt.decode_logits(mamba2, torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="new_tokens: expected an int >= 1"):
        qt.decode_logits(mamba2, hf_tiny.prompt(), 0)
    for empty in (hf_tiny.prompt()[:, :0], hf_tiny.prompt()[:0]):
        with pytest.raises(ValueError, match="input_ids: expected at least one sequence of at least one token"):
            qt.decode_logits(mamba2, empty, 2)
    with pytest.raises(ValueError, match="tokens: expected shape"):
        qt.decode_logits(mamba2, hf_tiny.prompt(batch=2), 3, tokens=torch.zeros(2, 2, dtype=torch.long))


def test_cpu_kernels_without_the_interpreter_give_a_clear_error(mamba2, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with qt.patch(mamba2, "fp32"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            qt.decode_logits(mamba2, hf_tiny.prompt(batch=1, length=3), 1)
