"""Every gated delta rule kernel once or a few times at small shapes, for ``compute-sanitizer``
(``CHECKS.md``): the conventional step over every state format and both gate kinds (padding
rows, slots out of order, partial and whole tiles, ``slot_flags``; on a GPU 8-bit row and head
scales take the fused arithmetic), the replay step and its flush at staggered cursors (8-bit and
16-bit read copies, 16-bit checkpoints, a batch of 130 rows that takes the large-batch launch),
verify and commit with early flushes, the per-draft baseline, and the replay ops on slots whose
cursor memory holds garbage.

    compute-sanitizer --tool memcheck python3 -m bench.sanitize_gated_delta

Its own checks, exit code, ``--device`` and ``--quick`` are those of :mod:`bench.sanitize`.
"""

from __future__ import annotations

import sys

import torch

import qstate
from qstate import SLOT_BAD_CURSOR, GatedDeltaReplayCache, quantize

from .sanitize import arguments, check_finite, run_groups

CONVENTIONAL_FORMATS = ("fp32", "bf16", "fp16", "bf16+sr", "fp8_e4m3:row", "fp8_e5m2:row", "int8:row", "int8:head",
                        "fp8_e4m3:head", "int8:block32", "fp8_e4m3:block32", "int8:row+sr")
# (checkpoint, read copy) of the replay caches: every read format and each checkpoint dtype.
REPLAY_FORMATS = (("fp32", None), ("fp32", "fp8_e4m3:row"), ("fp32", "int8:row"), ("bf16", "fp8_e5m2:row"),
                  ("fp16", "bf16"))
BASELINE_FORMATS = ("fp32", "bf16", "fp8_e4m3:row")
# (HK, HV, K, V): partial tiles (K, V not powers of two; K a multiple of 32 for block32) and a
# whole-tile shape.
SHAPES = ((1, 2, 96, 40), (2, 4, 128, 128))
GATES = ("scalar", "channel")
SLOTS, RING, MAX_DRAFT = 8, 4, 3
GARBAGE = {5: 100000, 6: -2}  # slot -> cursor written behind from_tensors' check
DRAFT_LENGTHS = (1, 3, 2, 3, 3)  # drafts per verify round: a ring of 4 + 3 flushes early from the second 3
LARGE_BATCH = 130  # above the batch from which the replay step launches without programmatic overlap


def _inputs(g, batch, shape, gate, device, dtype, T=None):
    HK, HV, K, V = shape
    lead = (batch,) if T is None else (batch, T)
    gate_shape = (*lead, HV) + ((K,) if gate == "channel" else ())
    return dict(q=torch.randn(*lead, HK, K, generator=g).to(device, dtype),
                k=torch.randn(*lead, HK, K, generator=g).to(device, dtype),
                v=torch.randn(*lead, HV, V, generator=g).to(device, dtype),
                g=(-0.5 * torch.rand(*gate_shape, generator=g)).to(device),
                beta=torch.rand(*lead, HV, generator=g).to(device))


def _stored(fmt, slots, shape, g, device):
    """A random ``(slots, HV, V, K)`` state stored in ``fmt``: ``(codes, scales or None)`` on
    ``device``."""
    _, HV, K, V = shape
    q = quantize(torch.randn(slots, HV, V, K, generator=g), fmt)
    return q.data.to(device), None if q.scale is None else q.scale.to(device)


def conventional(device, formats, failures, shapes=SHAPES, gates=GATES) -> int:
    g = torch.Generator().manual_seed(0)
    calls = 0
    slots = torch.tensor([3, -1, 0, 6, 2], device=device)  # a padding row, slots out of order
    for shape in shapes:
        for gate in gates:
            for fmt in formats:
                state, scale = _stored(fmt, 7, shape, g, device)
                flags = torch.zeros(7, dtype=torch.int32, device=device)
                for step in range(2):
                    out = qstate.gated_delta_update(state, **_inputs(g, slots.numel(), shape, gate, device,
                                                                     torch.bfloat16),
                                                    state_indices=slots, state_scale=scale, state_format=fmt,
                                                    seed=step, slot_flags=flags)
                    calls += 1
                check_finite(f"conventional {fmt} {gate} {shape}", out, failures)
                if bool(flags.any()):
                    failures.append(f"conventional {fmt} {gate}: slot flags {flags.tolist()} on finite inputs")
    return calls


def _cache(device, shape, gate, ck, rd, garbage, max_draft=0):
    HK, HV, K, V = shape
    cache = GatedDeltaReplayCache.allocate(SLOTS, HK, HV, K, V, gate=gate, ring_len=RING, checkpoint=ck, read=rd,
                                           input_dtype=torch.bfloat16, device=device, max_draft=max_draft)
    cache.reset(range(SLOTS), torch.randn(SLOTS, HV, V, K, generator=torch.Generator().manual_seed(2)))
    if garbage:
        for slot, cursor in GARBAGE.items():
            cache.cursor[slot] = cursor
    return cache


def _check_flags(name, cache, garbage, failures):
    flags = cache.slot_flags.tolist()
    expected = [SLOT_BAD_CURSOR if garbage and s in GARBAGE else 0 for s in range(SLOTS)]
    if flags != expected:
        failures.append(f"{name}: slot flags {flags}, expected {expected}")


def replay(device, formats, failures, garbage=False, shapes=SHAPES, gates=GATES, large=True) -> int:
    """Decode steps with staggered admissions (slot s joins at step s, so rows flush on different
    steps), a padding row in each call, and with ``large`` a call of ``LARGE_BATCH`` rows (8
    distinct slots, the rest padding)."""
    g = torch.Generator().manual_seed(3)
    calls = 0
    for shape in shapes:
        for gate in gates:
            for ck, rd in formats:
                cache = _cache(device, shape, gate, ck, rd, garbage)
                for step in range(2 * RING + 1):
                    live = [s for s in range(SLOTS) if s <= step]
                    slots = torch.tensor(live + [-1], device=device)
                    out = qstate.gated_delta_replay(cache, **_inputs(g, slots.numel(), shape, gate, device,
                                                                     torch.bfloat16), slot_indices=slots)
                    calls += 1
                    served = [i for i, s in enumerate(live) if not garbage or s not in GARBAGE]
                    check_finite(f"replay {ck}/{rd} {gate} {shape} step {step}", out[served], failures)
                if large:
                    rows = torch.full((LARGE_BATCH,), -1, device=device)
                    rows[LARGE_BATCH - SLOTS:] = torch.arange(SLOTS, device=device)
                    qstate.gated_delta_replay(cache, **_inputs(g, LARGE_BATCH, shape, gate, device, torch.bfloat16),
                                              slot_indices=rows)
                    calls += 1
                _check_flags(f"replay {ck}/{rd} {gate} {shape}", cache, garbage, failures)
    return calls


def speculative(device, formats, failures, garbage=False, shapes=SHAPES, gates=GATES,
                draft_lengths=DRAFT_LENGTHS) -> int:
    """Verify + commit rounds of T drafts (``draft_lengths``; later rounds flush early), accepted
    counts staggered across rows, a padding row in each call."""
    g = torch.Generator().manual_seed(4)
    calls = 0
    slots = torch.tensor([0, 1, -1, 2, 3, 4, 5, 6], device=device)
    served = [0, 1, 3, 4] + ([] if garbage else [6, 7])  # rows of slots 0-3 (and 5, 6)
    for shape in shapes:
        for gate in gates:
            for ck, rd in formats:
                cache = _cache(device, shape, gate, ck, rd, garbage, max_draft=MAX_DRAFT)
                for rnd, T in enumerate(draft_lengths):
                    inp = _inputs(g, slots.numel(), shape, gate, device, torch.bfloat16, T=T)
                    out = qstate.gated_delta_replay_verify(cache, **inp, slot_indices=slots)
                    accepted = torch.tensor([(rnd + i) % (T + 1) for i in range(slots.numel())], dtype=torch.int32,
                                            device=device)
                    if garbage:  # pending drafts, as a CPU commit's host check wants: the kernel refuses these slots
                        for slot in GARBAGE:
                            cache.drafts[slot] = T
                    qstate.gated_delta_replay_commit(cache, accepted, slot_indices=slots)
                    calls += 2
                    check_finite(f"verify {ck}/{rd} {gate} {shape} T={T}", out[served], failures)
                if not garbage:
                    qstate.gated_delta_replay_check_commits(cache)
                _check_flags(f"verify {ck}/{rd} {gate} {shape}", cache, garbage, failures)
    return calls


def baseline(device, formats, failures, shapes=SHAPES, gates=GATES, T=3) -> int:
    """The per-draft-state baseline: drafts into ``intermediate``, then each row's accepted one
    back into its slot (rows accepting 0 keep their state)."""
    g = torch.Generator().manual_seed(5)
    calls = 0
    slots = torch.tensor([4, -1, 0, 2], device=device)
    for shape in shapes:
        HK, HV, K, V = shape
        for gate in gates:
            for fmt in formats:
                state, scale = _stored(fmt, 5, shape, g, device)
                inter = torch.empty((slots.numel(), T, HV, V, K), dtype=state.dtype, device=device)
                inter_scale = None if scale is None else torch.empty(inter.shape[:-1], device=device)
                out = qstate.gated_delta_update_drafts(
                    state, **_inputs(g, slots.numel(), shape, gate, device, torch.bfloat16, T=T),
                    intermediate=inter, state_scale=scale, intermediate_scale=inter_scale, state_format=fmt,
                    slot_indices=slots)
                accepted = torch.tensor([T, 1, 0, 2], dtype=torch.int32, device=device)
                qstate.gated_delta_commit_drafts(state, inter, accepted, slot_indices=slots, state_scale=scale,
                                                 intermediate_scale=inter_scale, state_format=fmt)
                calls += 2
                check_finite(f"baseline {fmt} {gate} {shape}", out[[0, 2, 3]], failures)
    return calls


def main(argv=None) -> int:
    device, quick = arguments(__doc__, argv)
    conv = CONVENTIONAL_FORMATS[4:5] if quick else CONVENTIONAL_FORMATS
    rep = REPLAY_FORMATS[1:2] if quick else REPLAY_FORMATS
    base = BASELINE_FORMATS[2:] if quick else BASELINE_FORMATS
    failures: list[str] = []
    return run_groups("sanitize_gated_delta", (
        ("conventional", lambda: conventional(device, conv, failures)),
        ("replay", lambda: replay(device, rep, failures)),
        ("speculative", lambda: speculative(device, rep, failures)),
        ("baseline", lambda: baseline(device, base, failures)),
        ("replay, garbage cursors", lambda: replay(device, rep, failures, garbage=True)),
        ("speculative, garbage cursors", lambda: speculative(device, rep, failures, garbage=True))), failures, device)

if __name__ == "__main__":
    sys.exit(main())
