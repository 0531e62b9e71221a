"""The ops at their boundary: seeds, repeated slots, slot strides, plain Python arguments and
empty dimensions, each rejected before anything is launched and named in the error."""

import pytest
import torch

import qstate
from qstate import reference
from qstate.cache import ReplayCache


def _conv_inputs(batch=3, nheads=2, headdim=4, dstate=8, nslots=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(nslots, nheads, headdim, dstate, generator=g)
    return state, dict(x=torch.randn(batch, nheads, headdim, generator=g),
                       dt=torch.randn(batch, nheads, generator=g), A=-torch.rand(nheads, generator=g),
                       B=torch.randn(batch, 1, dstate, generator=g), C=torch.randn(batch, 1, dstate, generator=g),
                       D=torch.randn(nheads, generator=g), dt_bias=torch.randn(nheads, generator=g))


@pytest.mark.parametrize("seed", [2**31, 2**64, -1])
def test_selective_state_update_rejects_int_seeds_outside_31_bits(seed):
    state, inp = _conv_inputs()
    state = state.to(torch.bfloat16)
    before = state.clone()
    with pytest.raises(ValueError, match=r"^seed: expected an int in \[0, 2\*\*31\)"):
        qstate.selective_state_update(state, **inp, state_batch_indices=torch.tensor([0, 1, 2]),
                                      state_format="bf16+sr", seed=seed)
    assert torch.equal(state.view(torch.int16), before.view(torch.int16))


def test_selective_state_update_rejects_repeated_cpu_slots():
    state, inp = _conv_inputs()
    before = state.clone()
    with pytest.raises(ValueError, match="^state_batch_indices: expected no slot to repeat"):
        qstate.selective_state_update(state, **inp, state_batch_indices=torch.tensor([1, 2, 1]))
    assert torch.equal(state, before)
    # Padding repeats freely.
    qstate.selective_state_update(state, **inp, state_batch_indices=torch.tensor([-1, 2, -1]))


def test_selective_state_update_rejects_a_state_with_slot_stride_0():
    state, inp = _conv_inputs(nslots=1)
    shared = state.expand(3, -1, -1, -1)
    with pytest.raises(ValueError, match="^state: expected a nonzero stride between slots"):
        qstate.selective_state_update(shared, **inp)


@pytest.mark.parametrize("name", ["A", "dt", "D", "dt_bias"])
def test_selective_state_update_names_a_python_list(name):
    state, inp = _conv_inputs()
    inp[name] = inp[name].tolist()
    with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor, got list"):
        qstate.selective_state_update(state, **inp, state_batch_indices=torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("name", ["A", "dt", "D", "dt_bias"])
def test_replay_decode_names_a_python_list(name):
    cache = ReplayCache.allocate(3, 2, 4, 8, read=None, input_dtype=torch.float32)
    _, inp = _conv_inputs()
    inp[name] = inp[name].tolist()
    with pytest.raises(TypeError, match=f"^{name}: expected a torch.Tensor, got list"):
        qstate.replay_decode(cache, **inp)


@pytest.mark.parametrize("dims", [(4, 2, 0, 8), (4, 2, 4, 0)])
def test_selective_state_update_names_state_for_an_empty_dimension(dims):
    state = torch.zeros(dims)
    _, inp = _conv_inputs(headdim=dims[2], dstate=dims[3])
    with pytest.raises(ValueError, match="^state: "):
        qstate.selective_state_update(state, **inp, state_batch_indices=torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("fn", ["decode_exact", "decode_naive"])
def test_references_reject_a_non_bool_dt_softplus(fn):
    state, inp = _conv_inputs(batch=4)
    inp = {k: v[None] if k in ("x", "dt", "B", "C") else v for k, v in inp.items()}  # one step, time-major
    extra = dict(fmt="fp32") if fn == "decode_naive" else {}
    getattr(reference, fn)(state.double(), **inp, dt_softplus=True, **extra)
    with pytest.raises(TypeError, match="^dt_softplus: expected a bool, got str"):
        getattr(reference, fn)(state.double(), **inp, dt_softplus="False", **extra)
