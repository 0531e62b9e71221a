"""Comparisons of 8-bit code tensors shared by both layer families' tests."""

import torch


def grid_steps_apart(kernel, expected, fmt):
    """How many grid steps separate two code tensors (int8: integers; fp8: sign-magnitude bits)."""
    if fmt.dtype == "int8":
        return (kernel.int() - expected.int()).abs()
    a, b = kernel.view(torch.uint8).int(), expected.view(torch.uint8).int()
    signed = lambda c: torch.where(c >= 128, -(c - 128), c)  # noqa: E731
    return (signed(a) - signed(b)).abs()


def bits_of(t):
    """A tensor's bits as an integer tensor of its element size (for bit-for-bit comparisons)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_poison_stays_in_its_slot(q, launch):
    """``launch(state, scale) -> out`` on copies of ``q``'s codes and scales ``(3 slots, heads ≥
    2, rows ≥ 6, ·)``, clean and with a NaN and an inf in slot 1's scales: slots 0 and 2
    (outputs, codes, scales) equal bit for bit; returns the poisoned run's outputs."""
    runs = []
    for poison in (False, True):
        state, scale = q.data.clone(), q.scale.clone()
        if poison:
            scale[1, 0, 2] = float("nan")
            scale[1, 1, 5] = float("inf")
        out = launch(state, scale)
        runs.append((out, bits_of(out), bits_of(state), bits_of(scale)))
    for clean, poisoned in zip(runs[0][1:], runs[1][1:]):
        assert torch.equal(poisoned[[0, 2]], clean[[0, 2]])
    return runs[1][0]


def assert_padding_and_untouched_slots(out, state, scale, q):
    """After a launch over slot indices ``[3, -1, 0, 5]`` with ``pad_slot_id=5`` on copies of
    ``q`` (6 slots): rows 1 and 3 output zero, rows 0 and 2 finite, slots 1, 2, 4, 5 unchanged."""
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
    for untouched in (1, 2, 4, 5):
        assert torch.equal(bits_of(state[untouched]), bits_of(q.data[untouched]))
        assert torch.equal(bits_of(scale[untouched]), bits_of(q.scale[untouched]))
    assert not out[0].isnan().any() and not out[2].isnan().any()
