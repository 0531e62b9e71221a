"""Bad inputs of every public function: the expected error type, the argument named first in
the message, and nothing changed (cache, state and ``out`` bit-identical after the raise)."""

import pytest
import torch

import qstate
from qstate import reference
from qstate.cache import ReplayCache
from qstate.formats import QuantizedState, StateFormat, dequantize, quantize

SLOTS, H, P, N, G = 4, 2, 3, 32, 1


def _inputs(batch, T=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (batch,) if T is None else (batch, T)
    return dict(x=torch.randn(*lead, H, P, generator=g), dt=torch.randn(*lead, H, generator=g),
                A=-torch.rand(H, generator=g) - 0.5, B=torch.randn(*lead, G, N, generator=g),
                C=torch.randn(*lead, G, N, generator=g), D=torch.randn(H, generator=g),
                z=torch.randn(*lead, H, P, generator=g), dt_bias=torch.randn(H, generator=g))


def _bits(t):
    return None if t is None else (t.view(torch.uint8) if t.dtype.is_floating_point else t).clone()


def _cache(ring_len=1, max_draft=0, read="int8:row"):
    cache = ReplayCache.allocate(SLOTS, H, P, N, G, ring_len=ring_len, checkpoint="bf16+sr", read=read,
                                 input_dtype=torch.float32, max_draft=max_draft)
    cache.reset(list(range(SLOTS)), torch.randn(SLOTS, H, P, N, generator=torch.Generator().manual_seed(1)),
                generator=torch.Generator().manual_seed(2))
    return cache


def _replace(d, **kw):
    return {**d, **kw}


ROWS = torch.tensor([2, 0, 3])
CONV = _inputs(3)
CONV_BAD = [
    (dict(A=[-1.0, -1.0]), TypeError, "A"),
    (dict(dt=CONV["dt"].tolist()), TypeError, "dt"),
    (dict(D=[1.0, 1.0]), TypeError, "D"),
    (dict(dt_bias=[0.0, 0.0]), TypeError, "dt_bias"),
    (dict(x=CONV["x"][:, :1]), ValueError, "x"),
    (dict(B=CONV["B"].double()), TypeError, "B"),
    (dict(z=CONV["z"][:2]), ValueError, "z"),
    (dict(dt_softplus="False"), TypeError, "dt_softplus"),
    (dict(state_batch_indices=torch.tensor([2, 0, 2])), ValueError, "state_batch_indices"),
    (dict(state_batch_indices=torch.tensor([2, 0, 9])), ValueError, "state_batch_indices"),
    (dict(state_batch_indices=torch.tensor([2.0, 0.0, 1.0])), TypeError, "state_batch_indices"),
    (dict(seed=2**31), ValueError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed="7"), TypeError, "seed"),
    (dict(state_format="int4"), ValueError, "state_format"),
    (dict(state_scale=None), ValueError, "state_scale"),
    (dict(out=torch.zeros(3, H, P + 1)), ValueError, "out"),
    (dict(pad_slot_id=1.5), TypeError, "pad_slot_id"),
]


@pytest.mark.parametrize("bad, error, name", CONV_BAD, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(CONV_BAD)])
def test_selective_state_update_rejects_and_changes_nothing(bad, error, name):
    q = quantize(torch.randn(SLOTS, H, P, N), "int8:row")
    state, scale = q.data.clone(), q.scale.clone()
    out = torch.full((3, H, P), float("nan"))
    kwargs = _replace(dict(**CONV, dt_softplus=True, state_batch_indices=ROWS, state_scale=scale,
                           state_format="int8:row+sr", out=out, seed=5), **bad)
    before = [_bits(t) for t in (state, scale, out)]
    with pytest.raises(error, match=f"^{name}: "):
        qstate.selective_state_update(state, **kwargs)
    assert all(torch.equal(a, _bits(t)) for a, t in zip(before, (state, scale, out)))


REPLAY_BAD = [
    (dict(A=[-1.0, -1.0]), TypeError, "A"),
    (dict(dt=CONV["dt"].tolist()), TypeError, "dt"),
    (dict(x=CONV["x"].double()), TypeError, "x"),
    (dict(C=CONV["C"][:, :, :5]), ValueError, "C"),
    (dict(dt_softplus=1), TypeError, "dt_softplus"),
    (dict(slot_indices=torch.tensor([1, 1, 3])), ValueError, "slot_indices"),
    (dict(slot_indices=torch.tensor([1, 4, 3])), ValueError, "slot_indices"),
    (dict(slot_indices=torch.tensor([1, 2, 3], dtype=torch.int16)), TypeError, "slot_indices"),
    (dict(out=torch.zeros(3, H, P, dtype=torch.float16)), TypeError, "out"),
]


@pytest.mark.parametrize("bad, error, name", REPLAY_BAD, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(REPLAY_BAD)])
def test_replay_decode_rejects_and_changes_nothing(bad, error, name):
    # ring_len 1: every good call would flush, so a half-done call would show in every tensor.
    cache = _cache()
    out = torch.full((3, H, P), float("nan"))
    before = {k: _bits(v) for k, v in cache.tensors().items()}
    kwargs = _replace(dict(**CONV, dt_softplus=True, slot_indices=torch.tensor([1, 2, 3]), out=out), **bad)
    with pytest.raises(error, match=f"^{name}: "):
        qstate.replay_decode(cache, **kwargs)
    assert all(torch.equal(before[k], _bits(v)) for k, v in cache.tensors().items() if v is not None)
    assert torch.isnan(out).all()


def test_a_cache_seed_set_out_of_range_is_refused():
    cache = _cache()
    with pytest.raises(ValueError, match=r"^seed: expected an int in \[0, 2\*\*31\)"):
        cache.seed = 2**64
    assert cache.seed == 0


def test_verify_and_commit_reject_and_change_nothing():
    cache = _cache(ring_len=3, max_draft=2)
    draft = _inputs(3, T=2)
    before = {k: _bits(v) for k, v in cache.tensors().items()}
    cases = [
        (lambda: qstate.replay_verify(cache, **_replace(draft, x=draft["x"][:, :, :1]), dt_softplus=True),
         ValueError, "x"),
        (lambda: qstate.replay_verify(cache, **_inputs(3, T=3), dt_softplus=True), ValueError, "x"),
        (lambda: qstate.replay_verify(cache, **draft, dt_softplus=True, slot_indices=torch.tensor([0, 0, 1])),
         ValueError, "slot_indices"),
        (lambda: qstate.replay_commit(cache, torch.tensor([1, 1, 1], dtype=torch.int32)), ValueError,
         "num_accepted"),
        (lambda: qstate.replay_commit(cache, [1, 1, 1]), TypeError, "num_accepted"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=f"^{name}: "):
            call()
        assert all(torch.equal(before[k], _bits(v)) for k, v in cache.tensors().items() if v is not None), name


def test_cache_methods_reject_and_change_nothing():
    cache = _cache(ring_len=3)
    before = {k: _bits(v) for k, v in cache.tensors().items()}
    cases = [
        (lambda: cache.reset([0, 0]), ValueError, "slots"),
        (lambda: cache.reset([SLOTS]), ValueError, "slots"),
        (lambda: cache.reset([1.0]), TypeError, "slots"),
        (lambda: cache.reset([0], torch.zeros(2, H, P, N)), ValueError, "state"),
        (lambda: cache.reset([0], generator=3), TypeError, "generator"),
        (lambda: cache.materialize([0], [-1.0, -1.0]), TypeError, "A"),
    ]
    for call, error, name in cases:
        with pytest.raises(error, match=f"^{name}: "):
            call()
        assert all(torch.equal(before[k], _bits(v)) for k, v in cache.tensors().items() if v is not None), name


CONSTRUCTION_BAD = [
    (lambda: ReplayCache.allocate(0, H, P, N), ValueError, "num_slots"),
    (lambda: ReplayCache.allocate(1, 3, P, N, ngroups=2), ValueError, "ngroups"),
    (lambda: ReplayCache.allocate(1, H, P, N, checkpoint="int8:head"), ValueError, "checkpoint"),
    (lambda: ReplayCache.allocate(1, H, P, N, read="int4"), ValueError, "read"),
    (lambda: ReplayCache.allocate(1, H, P, 20, read="int8:block32"), ValueError, "read"),
    (lambda: ReplayCache.allocate(1, H, P, N, input_dtype=torch.float64), TypeError, "input_dtype"),
    (lambda: ReplayCache.allocate(1, H, P, N, seed=2**40), ValueError, "seed"),
    (lambda: ReplayCache.allocate(1, H, P, N, max_draft=-1), ValueError, "max_draft"),
    (lambda: ReplayCache.allocate(1, H, P, N, device="nonsense"), ValueError, "device"),
    (lambda: quantize(torch.zeros(2, 0, 4), "int8:row"), ValueError, "x"),
    (lambda: quantize(torch.zeros(2, 4, 4), "int8:row", noise=torch.zeros(2, 4, 4)), ValueError, "noise"),
    (lambda: quantize(torch.zeros(2, 4, 4), "int4"), ValueError, "fmt"),
    (lambda: dequantize(QuantizedState(torch.zeros(2, 4, dtype=torch.uint8), torch.ones(2),
                                       StateFormat.parse("fp8_e4m3:row"))), TypeError, "q"),
    (lambda: dequantize(QuantizedState(torch.zeros(2, 4, dtype=torch.int8), torch.ones(3),
                                       StateFormat.parse("int8:row"))), ValueError, "q"),
    (lambda: reference.decode_exact(torch.zeros(3, H, P, N), *(_inputs(3)[k][None] for k in ("x", "dt")), CONV["A"],
                                    *(_inputs(3)[k][None] for k in ("B", "C")), dt_softplus="no"),
     TypeError, "dt_softplus"),
]


@pytest.mark.parametrize("call, error, name", CONSTRUCTION_BAD,
                         ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(CONSTRUCTION_BAD)])
def test_construction_and_codecs_name_the_argument(call, error, name):
    with pytest.raises(error, match=f"^{name}: "):
        call()
