"""Slot isolation on the GPU, the promises the CPU suites check under the interpreter
(tests/mamba2/test_garbage_cursor.py, test_slot_flags.py, tests/test_properties_slots.py):

* a cursor outside its ring (5 and 100000 past a ring of 3 or 5 tokens, −2): replay decode (both
  step kernels), verify and commit on that slot write no byte of any slot, output NaN for the
  row and set ``SLOT_BAD_CURSOR`` for that slot only; the batch's other rows decode exactly as
  if the row were padding;
* a NaN in one row's inputs (conventional, replay decode with a flush, verify): every other
  slot's bytes and outputs equal a clean run's, and only the poisoned slot is flagged
  ``SLOT_NONFINITE``;
* a slot named twice in one call (a caller's contract on a GPU, where no sync checks it): the
  slots named once and the slots not named end as in a call without the repeated rows.

    python3 -m bench.cases_isolation        (also run by bench.run_gpu with the other checks)
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from qstate import (SLOT_BAD_CURSOR, SLOT_NONFINITE, ReplayCache, quantize, replay_commit, replay_decode,
                    replay_verify, selective_state_update)

H, P, N, G = 4, 24, 32, 2
SLOTS, RING, DRAFT, BAD = 6, 3, 2, 2
GARBAGE = (RING + DRAFT, -2, 100000)
PER_CALL = ("flush_rows", "flush_counters", "commit_errors")


def _bits(t):
    return t.detach().contiguous().unsqueeze(-1).view(torch.uint8).clone()


def _clone(cache):
    return dataclasses.replace(cache, **{k: v.clone() for k, v in cache.tensors().items() if v is not None})


def _slot_diffs(a, b, slots, skip=()):
    """Names of per-slot tensors whose bytes differ between caches a and b at ``slots``."""
    out = []
    for name, t in a.tensors().items():
        if t is None or name in PER_CALL or name in skip:
            continue
        if not torch.equal(_bits(t)[slots], _bits(b.tensors()[name])[slots]):
            out.append(name)
    return out


def _inputs(g, device, batch, T=None):
    lead = (batch,) if T is None else (batch, T)
    return dict(x=torch.randn(*lead, H, P, generator=g).to(device), dt=torch.randn(*lead, H, generator=g).to(device),
                A=-(0.5 + torch.rand(H, generator=g)).to(device), B=torch.randn(*lead, G, N, generator=g).to(device),
                C=torch.randn(*lead, G, N, generator=g).to(device), D=torch.randn(H, generator=g).to(device),
                z=torch.randn(*lead, H, P, generator=g).to(device),
                dt_bias=(torch.randn(H, generator=g) - 2).to(device))


def _cache(device, max_draft=0, read="fp8_e4m3:row", ring=RING, num_slots=SLOTS):
    cache = ReplayCache.allocate(num_slots, H, P, N, G, ring_len=ring, read=read, input_dtype=torch.float32,
                                 device=device, max_draft=max_draft)
    cache.reset(range(num_slots), torch.randn(num_slots, H, P, N, generator=torch.Generator().manual_seed(1)))
    return cache


def _stagger(cache, g, device):
    for rows in ([0, 1, 2, 3, 4, 5], [1, 2, 4], [2, 5]):
        idx = torch.tensor(rows, device=device)
        replay_decode(cache, **_inputs(g, device, len(rows)), dt_softplus=True, slot_indices=idx)


def garbage_cursors(device, failures):
    g = torch.Generator().manual_seed(2)
    expected_flags = [SLOT_BAD_CURSOR if s == BAD else 0 for s in range(SLOTS)]
    for garbage in GARBAGE:
        # Batch 6 runs the per-head step kernel, 64 the grouped one (replay.default_heads_per_program).
        for slots in (SLOTS, 64):
            cache = _cache(device, num_slots=slots)
            _stagger(cache, g, device)
            cache.cursor[BAD] = garbage
            clean = _clone(cache)
            inp = _inputs(g, device, slots)
            out = replay_decode(cache, **inp, dt_softplus=True, slot_indices=torch.arange(slots, device=device))
            padded = torch.tensor([s if s != BAD else -1 for s in range(slots)], device=device)
            expected = replay_decode(clean, **inp, dt_softplus=True, slot_indices=padded)
            rest = [s for s in range(slots) if s != BAD]
            key = f"decode cursor {garbage} batch {slots}"
            diffs = _slot_diffs(cache, clean, rest, skip=("slot_flags",))
            diffs += [f"bad slot {d}" for d in _slot_diffs(cache, clean, [BAD], skip=("slot_flags",))]
            if diffs:
                failures.append(f"{key}: bytes differ from the padded run: {diffs}")
            if not torch.equal(out[rest], expected[rest]):
                failures.append(f"{key}: other rows' outputs differ from the padded run")
            flags = [SLOT_BAD_CURSOR if s == BAD else 0 for s in range(slots)]
            if not bool(torch.isnan(out[BAD]).all()) or cache.slot_flags.tolist() != flags:
                failures.append(f"{key}: row not NaN or flags {cache.slot_flags.tolist()}")
        cache = _cache(device, max_draft=DRAFT)
        replay_verify(cache, **_inputs(g, device, SLOTS, T=1), dt_softplus=True)
        replay_commit(cache, torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.int32, device=device))
        cache.cursor[BAD] = garbage
        before = _clone(cache)
        alone = torch.tensor([BAD], device=device)
        out = replay_verify(cache, **_inputs(g, device, 1, T=DRAFT), dt_softplus=True, slot_indices=alone)
        cache.drafts[BAD] = DRAFT
        before.drafts[BAD] = DRAFT
        replay_commit(cache, torch.tensor([1], dtype=torch.int32, device=device), alone)
        diffs = _slot_diffs(cache, before, list(range(SLOTS)), skip=("slot_flags",))
        if diffs or not bool(torch.isnan(out).all()) or cache.slot_flags.tolist() != expected_flags:
            failures.append(f"verify/commit cursor {garbage}: changed {diffs}, flags {cache.slot_flags.tolist()}")


def nan_inputs(device, failures):
    g = torch.Generator().manual_seed(3)
    poisoned_row, expected_flags = 1, [0, SLOT_NONFINITE, 0, 0, 0, 0]
    others = [s for s in range(SLOTS) if s != poisoned_row]
    # Replay decode over two steps: the poisoned slot flushes on the second (ring of 2).
    cache = _cache(device, ring=2)
    clean = _clone(cache)
    for step in range(2):
        inp = _inputs(g, device, SLOTS)
        bad = dict(inp, x=inp["x"].clone())
        bad["x"][poisoned_row, 0, 0] = float("nan")
        out = replay_decode(cache, **bad, dt_softplus=True)
        expected = replay_decode(clean, **inp, dt_softplus=True)
        if not torch.equal(out[others], expected[others]):
            failures.append(f"replay NaN step {step}: other rows' outputs differ from a clean run")
    diffs = _slot_diffs(cache, clean, others, skip=("slot_flags",))
    if diffs or cache.slot_flags.tolist() != expected_flags:
        failures.append(f"replay NaN: other slots differ in {diffs}, flags {cache.slot_flags.tolist()}")
    # Verify.
    cache = _cache(device, max_draft=DRAFT)
    clean = _clone(cache)
    inp = _inputs(g, device, SLOTS, T=DRAFT)
    bad = dict(inp, B=inp["B"].clone())
    bad["B"][poisoned_row, 1, 0, 3] = float("inf")
    out, expected = replay_verify(cache, **bad, dt_softplus=True), replay_verify(clean, **inp, dt_softplus=True)
    diffs = _slot_diffs(cache, clean, others, skip=("slot_flags",))
    if diffs or not torch.equal(out[others], expected[others]) or cache.slot_flags.tolist() != expected_flags:
        failures.append(f"verify inf: other slots differ in {diffs}, flags {cache.slot_flags.tolist()}")
    # Conventional, 8-bit row state.
    q = quantize(torch.randn(SLOTS, H, P, N, generator=g), "int8:row")
    runs = []
    for poison in (True, False):
        state, scale = q.data.to(device).clone(), q.scale.to(device).clone()
        flags = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        inp = _inputs(torch.Generator().manual_seed(4), device, SLOTS)
        if poison:
            inp["x"][poisoned_row, 2, 5] = float("nan")
        y = selective_state_update(state, **inp, dt_softplus=True, state_scale=scale, state_format="int8:row",
                                   slot_flags=flags)
        runs.append((state, scale, y, flags))
    (s1, c1, y1, f1), (s0, c0, y0, _) = runs
    if not (torch.equal(s1[others], s0[others]) and torch.equal(c1[others], c0[others])
            and torch.equal(y1[others], y0[others])) or f1.tolist() != expected_flags:
        failures.append(f"conventional NaN: other slots differ or flags {f1.tolist()}")


def repeated_slots(device, failures):
    """A slot named twice: on a GPU (no sync checks it) the slots named once end as in the call
    without the repeats and unnamed ones unchanged; on CPU tensors the call raises and writes nothing."""
    g = torch.Generator().manual_seed(5)
    twice = torch.tensor([0, 3, 3, 4], device=device)
    once = torch.tensor([0, -1, -1, 4], device=device)
    untouched = [1, 2, 5]
    cache = _cache(device)
    _stagger(cache, g, device)
    clean = _clone(cache)
    inp = _inputs(g, device, 4)
    if device.type == "cpu":
        try:
            replay_decode(cache, **inp, dt_softplus=True, slot_indices=twice)
            failures.append("replay repeated slot on CPU tensors: no error")
        except ValueError:
            if _slot_diffs(cache, clean, list(range(SLOTS))):
                failures.append("replay repeated slot on CPU tensors: raised after writing")
        return
    out = replay_decode(cache, **inp, dt_softplus=True, slot_indices=twice)
    expected = replay_decode(clean, **inp, dt_softplus=True, slot_indices=once)
    diffs = _slot_diffs(cache, clean, [0, 4] + untouched)
    if diffs or not torch.equal(out[[0, 3]], expected[[0, 3]]):
        failures.append(f"replay repeated slot: other slots differ in {diffs}")
    q = quantize(torch.randn(SLOTS, H, P, N, generator=g), "fp8_e4m3:row")
    states = []
    for rows in (twice, once):
        state, scale = q.data.to(device).clone(), q.scale.to(device).clone()
        y = selective_state_update(state, **_inputs(torch.Generator().manual_seed(6), device, 4), dt_softplus=True,
                                   state_batch_indices=rows, state_scale=scale, state_format="fp8_e4m3:row")
        states.append((state, scale, y))
    (s1, c1, y1), (s0, c0, y0) = states
    keep = [0, 4] + untouched
    if not (torch.equal(_bits(s1)[keep], _bits(s0)[keep]) and torch.equal(c1[keep], c0[keep])
            and torch.equal(y1[[0, 3]], y0[[0, 3]])):
        failures.append("conventional repeated slot: other slots or rows differ")


def check_kernel(device):
    """The three isolation checks; returns (failures, report rows)."""
    failures, report = [], []
    for name, fn in (("garbage cursors", garbage_cursors), ("NaN inputs", nan_inputs),
                     ("repeated slots", repeated_slots)):
        before = len(failures)
        try:
            fn(device, failures)
        except Exception as err:  # a crash is a failed check (the garbage-cursor one crashed once)
            failures.append(f"{name}: raised {type(err).__name__}: {err}")
        report.append(f"isolation {name}: {len(failures) - before} failures")
    return failures, report


def main(argv=None) -> int:
    device = torch.device(argv[0] if argv else "cuda")
    failures, report = check_kernel(device)
    for row in report:
        print(row)
    for f in failures:
        print("  FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
