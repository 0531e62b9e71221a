"""Quantized routes through transformers, checked against the reference of their own scheme:
one layer's decode inputs are recorded from a patched generate, and its outputs and states are
compared step by step with ``decode_naive`` (conventional) or ``decode_replay`` (replay)."""

from helpers import hf_tiny
import torch

from qstate import reference
from qstate.formats import QuantizedState, dequantize, quantize
from qstate.integrations import transformers as qt

STEP_FIELDS = ("x", "dt", "B", "C", "z")


def _rel_rms(a, b):
    return float((a.double() - b.double()).square().mean().sqrt() / b.double().square().mean().sqrt())


def _record(route, before, after):
    """Wrap ``route.decode``: ``before(route)`` and ``after(route, y)`` are logged with the step."""
    log, decode = [], route.decode

    def recording(state, step):
        entry = dict(step=step, before=before(route))
        y = decode(state, step)
        entry.update(y=y.detach().clone(), after=after(route))
        log.append(entry)
        return y

    route.decode = recording
    return log


def test_conventional_fp8_route_steps_as_decode_naive():
    model = hf_tiny.nemotron_h(seed=3)
    ids = hf_tiny.prompt(batch=2, length=5, seed=4)
    with qt.patch(model, "fp8_e4m3:row") as patched:
        route = next(iter(patched.routes.values()))

        def stored(r, y=None):
            return r.codes.clone(), r.scale.clone()

        log = _record(route, stored, stored)
        hf_tiny.generate(model, ids, 6)
    assert len(log) == 5
    fmt = route.fmt
    for entry in log:
        s = entry["step"]
        state0 = dequantize(QuantizedState(*entry["before"], fmt))
        y_ref, S_ref = reference.decode_naive(state0, *(getattr(s, k)[None] for k in ("x", "dt")), s.A,
                                              *(getattr(s, k)[None] for k in ("B", "C")), s.D,
                                              None if s.z is None else s.z[None],
                                              s.dt_bias, s.dt_softplus, fmt=fmt)
        # The kernel's fp32 sums may differ from the reference's in the last bit, moving a scale
        # by an ulp: codes equal (the reference's recovered by re-quantizing its stored values,
        # which gives back the same codes), scales within fp32 rounding.
        codes, scale = entry["after"]
        ref = quantize(S_ref, fmt)
        assert torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.allclose(scale, ref.scale, rtol=2**-20, atol=0)
        assert _rel_rms(entry["y"], y_ref[0]) <= 1e-5


def test_replay_route_steps_as_decode_replay():
    """No flush within the run (ring 16, 10 steps): the read copy is the prefill state's on both
    sides, so outputs and the folded state differ by fp32 arithmetic only."""
    model = hf_tiny.mamba2(seed=5)
    ids = hf_tiny.prompt(batch=2, length=5, seed=6)
    name = next(n for n, _ in qt.find_mixers(model))
    prefill = _prefill_state(model, ids, name)
    with qt.patch(model, "replay/fp32/fp8_e4m3:row/16") as patched:
        route = patched.routes[name]
        log = _record(route, lambda r: None, lambda r: None)
        hf_tiny.generate(model, ids, 11)
        folded = patched.caches[name].materialize(route.slots, log[0]["step"].A)
    assert len(log) == 10
    steps = [entry["step"] for entry in log]
    first = steps[0]
    stack = {k: None if getattr(first, k) is None else torch.stack([getattr(s, k) for s in steps])
             for k in STEP_FIELDS}
    y_ref, S_ref = reference.decode_replay(prefill, stack["x"], stack["dt"], first.A, stack["B"], stack["C"], first.D,
                                           stack["z"], first.dt_bias, first.dt_softplus, checkpoint="fp32",
                                           read="fp8_e4m3:row", ring_len=16)
    assert _rel_rms(torch.stack([entry["y"] for entry in log]), y_ref) <= 1e-5
    assert _rel_rms(folded, S_ref) <= 1e-5


def _prefill_state(model, ids, name):
    """The layer's state after the prompt, as the route syncs from it before the first step."""
    mixers = [n for n, _ in qt.find_mixers(model)]
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
    cache = getattr(prefill, qt._cache_argument(model))
    return cache.get_recurrent_state(mixers.index(name), state_idx=0).clone().float()
