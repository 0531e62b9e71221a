"""qstate.integrations.transformers on gated delta rule models: tiny random Qwen3-Next, Qwen3.5,
Qwen3.5-MoE and Kimi Linear decode through qstate: the module-level step functions are swapped
(the installed release resolves fla inside them), and the layers of releases that bind the step
at construction (fla's function, with fla installed) have those attributes routed too.

Bounds. With an fp32 scheme the patched and unpatched decodes compute the same fp32 recurrence
in different orders: a few fp32 roundings (2**-24) per state element and step, over sums of
K = 8 terms, damped by the decay; the logits go through a few matmuls of width <= 128. We allow
1e-5 relative rms, as for the Mamba-2 patch (a bf16 state would sit near 1e-3). Against the fp64
references the kernels differ by fp32 rounding of sums over K and V per step:
``steps · K · 2**-24 · 8`` (the replay tests' bound), except where a stored 8-bit code or a bf16
value sits on a rounding boundary; those are compared at the format's own step.
"""

import sys

import pytest
import torch

from helpers import hf_tiny_delta as tiny
from helpers.hf_tiny import generate
from qstate.formats import StateFormat
from qstate.integrations import transformers as qt
from qstate.integrations.delta_routes import DeltaConventionalRoute, DeltaReplayRoute
from qstate.reference import gated_delta as reference

NEW_TOKENS = 8
REPLAY_TOKENS = 5  # the replay kernel is the slow one under the interpreter
FP32_BOUND = 1e-5


@pytest.fixture(scope="module", params=list(tiny.MODELS))
def model(request):
    return tiny.MODELS[request.param]()


def _functions(model):
    return {(type(m).__module__, qt.SUPPORTED_DELTA_LAYERS[type(m).__name__]):
            getattr(sys.modules[type(m).__module__], qt.SUPPORTED_DELTA_LAYERS[type(m).__name__])
            for _, m in qt.find_layers(model)}


def _assert_unpatched(model, functions):
    for _, layer in qt.find_layers(model):
        assert "forward" not in layer.__dict__
    assert _functions(model) == functions
    assert not hasattr(model, "_qstate_patch")


def _rel_rms(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bound(K, steps):
    return steps * K * 2.0**-24 * 8


def test_fp32_scheme_generates_as_the_unpatched_model(model):
    ids = tiny.prompt()
    expected = generate(model, ids, NEW_TOKENS)
    with qt.patch(model, "fp32") as patched:
        got = generate(model, ids, NEW_TOKENS)
    # the first token comes from the prefill; every later one from a qstate step in each delta layer
    assert patched.steps and set(patched.steps.values()) == {NEW_TOKENS - 1}
    assert torch.equal(got.sequences, expected.sequences)
    errors = [_rel_rms(g, r) for g, r in zip(got.logits, expected.logits)]
    assert max(errors) <= FP32_BOUND, errors


def test_replay_runs_every_decode_step_and_keeps_its_ring(model):
    """Every decode step of every delta layer ran through gated_delta_replay, and the ring was
    kept between steps (a cache rebuilt from transformers' state each token would run the
    conventional scheme under the replay scheme's name): 4 steps of ring 3 leave cursor 1."""
    ring_len = 3
    ids = tiny.prompt(batch=2, length=5, seed=1)
    expected = generate(model, ids, REPLAY_TOKENS)
    with qt.patch(model, f"replay/fp32/fp8_e4m3:row/{ring_len}") as patched:
        got = generate(model, ids, REPLAY_TOKENS)
    assert patched.missed_steps(REPLAY_TOKENS - 1) == {}
    for cache in patched.caches.values():
        assert cache.cursor.tolist() == [(REPLAY_TOKENS - 1) % ring_len] * 2
    logits, ref = torch.stack(got.logits), torch.stack(expected.logits)
    assert torch.isfinite(logits).all()
    # the fp8 read copy changes the logits (qstate's op really ran), but not by much
    assert 0 < _rel_rms(logits, ref) < 0.05


def test_restore_is_exact_and_the_model_decodes_as_before(model):
    ids = tiny.prompt(batch=1, length=5, seed=3)
    functions = _functions(model)
    tokens, before = qt.decode_logits(model, ids, 2)
    patched = qt.patch(model, "replay/fp32/bf16/2")
    assert patched.active and model._qstate_patch is patched and _functions(model) != functions
    for _, layer in qt.find_layers(model):
        assert "forward" in layer.__dict__
    qt.decode_logits(model, ids, 2, tokens=tokens)
    patched.restore()
    patched.restore()  # idempotent
    _assert_unpatched(model, functions)
    _, after = qt.decode_logits(model, ids, 2, tokens=tokens)
    assert torch.equal(before, after)


def test_a_corrected_ring_is_rejected_and_the_model_untouched(model):
    functions = _functions(model)
    with pytest.raises(ValueError, match="scheme: the delta-rule replay op keeps an inputs ring"):
        qt.patch(model, "replay/fp32/4/corrected")
    _assert_unpatched(model, functions)


def _record(route):
    """Wrap ``route`` so that it keeps the state it synced from (V-first), every step's compact
    inputs, outputs and the state it returned."""
    log = {"syncs": [], "inputs": [], "outputs": [], "states": []}
    sync, decode = route.sync, route.decode

    def recording_sync(state, step):
        log["syncs"].append((route.steps, state.clone()))
        sync(state, step)

    def recording_decode(step):
        log["inputs"].append({n: getattr(step, n).clone() for n in ("q", "k", "v", "g", "beta")})
        o, state = decode(step)
        log["outputs"].append(o.clone())
        log["states"].append(state.clone())
        return o, state

    route.sync, route.decode = recording_sync, recording_decode
    return log


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
@pytest.mark.parametrize("scheme", ["bf16", "replay/fp32/fp8_e4m3:row/3"])
def test_recorded_decode_equals_the_reference_of_the_scheme(name, scheme):
    """One layer's decode inputs, as the route handed them to qstate in a patched run, replayed
    through qstate.reference.gated_delta from the prefill's state, give the route's outputs and
    states: the conversion of transformers' layout loses nothing, and the route synced once."""
    model = tiny.MODELS[name]()
    with qt.patch(model, scheme) as patched:
        layer, route = next(iter(patched.routes.items()))
        log = _record(route)
        qt.decode_logits(model, tiny.prompt(batch=2, length=6, seed=4), REPLAY_TOKENS)
    assert [steps for steps, _ in log["syncs"]] == [0]
    state0 = log["syncs"][0][1]
    inputs = {n: torch.stack([step[n] for step in log["inputs"]]) for n in ("q", "k", "v", "g", "beta")}
    outputs, states = torch.stack(log["outputs"]), torch.stack(log["states"])
    T, K = outputs.shape[0], inputs["k"].shape[-1]
    if scheme.startswith("replay"):
        o_ref, final = reference.decode_replay(state0, *inputs.values(), checkpoint="fp32", read="fp8_e4m3:row",
                                               ring_len=3)
        # outputs read the fp8 copy of a checkpoint that is exact to fp32 rounding: codes agree,
        # unless one sits on a rounding boundary after a flush (one e4m3 step, 2**-3, in one element)
        assert _rel_rms(outputs, o_ref) < 2.0**-3 / (K * outputs[0].numel()) ** 0.5 + _bound(K, T)
        assert _rel_rms(states[-1], final) < _bound(K, T)
        assert torch.equal(route.cache.cursor, torch.full((2,), T % 3, dtype=torch.int32))
    else:
        fmt = StateFormat.parse(scheme)
        o_ref, final = reference.decode_naive(state0, *inputs.values(), fmt=fmt)
        # the kernel and the reference round the same fp32 values to bf16: equal but where fp32
        # ordering differences cross a bf16 boundary (2**-8 relative in that element)
        assert _rel_rms(outputs, o_ref) < 2.0**-8
        assert _rel_rms(states[-1], final) < 2.0**-8
        assert (states[-1] != final).float().mean() < 0.02


def _transformers_function(model):
    layer = qt.find_layers(model)[0][1]
    return getattr(sys.modules[type(layer).__module__], qt.SUPPORTED_DELTA_LAYERS[type(layer).__name__]), layer


def _random_call(layer, *, batch=3, repeat=False, seed=0):
    """One decode call's arguments in transformers' shapes for ``layer``."""
    gen = torch.Generator().manual_seed(seed)
    kda = type(layer).__name__.startswith("Kimi")
    HV = layer.num_heads if kda else layer.num_v_heads
    HK = HV if kda else layer.num_k_heads
    K = layer.head_dim if kda else layer.head_k_dim
    V = layer.head_dim if kda else layer.head_v_dim
    q, k = torch.randn(batch, 1, HK, K, generator=gen), torch.randn(batch, 1, HK, K, generator=gen)
    if repeat:
        q, k = q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2)
    g = -torch.rand((batch, 1, HV, K) if kda else (batch, 1, HV), generator=gen)
    return dict(query=q, key=k, value=torch.randn(batch, 1, HV, V, generator=gen), g=g,
                beta=torch.rand(batch, 1, HV, generator=gen),
                initial_state=torch.randn(batch, HV, K, V, generator=gen), output_final_state=True,
                use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear"])
def test_a_route_step_equals_transformers_own_function(name):
    """Layouts: a route's output and returned state ``(batch, HV, K, V)`` equal transformers'
    function on the same call within fp32 rounding, whether q and k come with HK heads or
    repeated to HV heads (older releases); both head counts give bit-identical results."""
    original, layer = _transformers_function(tiny.MODELS[name]())
    call = _random_call(layer)
    o_ref, state_ref = original(**{n: t.clone() if torch.is_tensor(t) else t for n, t in call.items()})
    K = call["key"].shape[-1]
    results = []
    for repeat in (False, True):
        route = DeltaConventionalRoute("layer", StateFormat.parse("fp32"))
        results.append(route(original, **_random_call(layer, repeat=repeat)))
    (o, state), (o_rep, state_rep) = results
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    assert _rel_rms(o, o_ref) < _bound(K, 1) and _rel_rms(state, state_ref) < _bound(K, 1)
    assert torch.equal(o, o_rep) and torch.equal(state, state_rep)


@pytest.mark.parametrize("make_route", [lambda: DeltaConventionalRoute("layer", StateFormat.parse("fp8_e4m3:row")),
                                        lambda: DeltaReplayRoute("layer", StateFormat.parse("fp32"), None, 4)],
                         ids=["conventional", "replay"])
def test_a_route_resyncs_after_an_outside_write_only(make_route):
    """transformers copies the returned state into its cache tensor and passes that tensor back:
    the route's own steps do not rebuild its storage; a write from outside (a halving) does."""
    original, layer = _transformers_function(tiny.MODELS["qwen3_5"]())
    route = make_route()
    log = _record(route)
    call = _random_call(layer, batch=2)
    cache_state = call.pop("initial_state")
    for t in range(5):
        if t == 3:
            cache_state.mul_(0.5)
        _, new_state = route(original, initial_state=cache_state, **call)
        cache_state.copy_(new_state)
    assert [steps for steps, _ in log["syncs"]] == [0, 3]
    assert route.steps == 5


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_a_layer_holding_fla_step_function_decodes_through_qstate(name):
    """With fla installed, releases that bind the step to the layer at construction decode
    through the layer's attribute (fla's function), not the module-level name: the patch routes
    that attribute too (fla never runs while patched; fp32 tokens as unpatched) and puts the very
    same function back on exit. Simulated (``hf_tiny_delta.FlaBindingRelease``): the installed
    release does not bind, and on a CPU fla's kernels would not run; the stand-in has fla's name
    and signature, which is all the patch looks at."""
    model = tiny.MODELS[name]()
    release = tiny.FlaBindingRelease(model)
    functions = _functions(model)
    ids = tiny.prompt(batch=2, length=5, seed=2)
    expected = generate(model, ids, REPLAY_TOKENS)
    fla_calls = release.calls
    assert fla_calls == len(release.layers) * (REPLAY_TOKENS - 1)  # unpatched, every decode step ran fla
    with qt.patch(model, "fp32") as patched:
        got = generate(model, ids, REPLAY_TOKENS)
        assert all(getattr(layer, release.ATTRIBUTE) is not release.fla_function for layer in release.layers)
    assert release.calls == fla_calls
    assert patched.missed_steps(REPLAY_TOKENS - 1) == {}
    assert torch.equal(got.sequences, expected.sequences)
    assert max(_rel_rms(g, r) for g, r in zip(got.logits, expected.logits)) <= FP32_BOUND
    assert _functions(model) == functions and not hasattr(model, "_qstate_patch")
    assert all(vars(layer)[release.ATTRIBUTE] is release.fla_function for layer in release.layers)
    generate(model, ids, 2)
    assert release.calls == fla_calls + len(release.layers)  # restored: fla decodes again


def test_a_bf16_model_keeps_bf16_inputs_in_the_ring():
    """A bf16 model hands bf16 q, k, v: the replay ring stores them as they come, and the ring
    is kept between steps (2 steps of ring 3 leave cursor 2)."""
    model = tiny.qwen3_5().to(torch.bfloat16)
    with qt.patch(model, "replay/fp32/fp8_e4m3:row/3") as patched:
        _, logits = qt.decode_logits(model, tiny.prompt(batch=1, length=4, seed=5), 2)
    (cache,) = patched.caches.values()
    assert set(patched.steps.values()) == {2} and cache.cursor.tolist() == [2]
    assert cache.ring_k.dtype == cache.ring_v.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()
