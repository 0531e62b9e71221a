"""Every kernel once or a few times at small shapes, for ``compute-sanitizer`` (bench/README.md,
"Sanitizer"): the conventional kernel over every state format (padding rows, odd headdim, whole
and partial tiles, ``slot_flags``), the codec probe, replay decode (per-head and grouped step
kernels, flushes, staggered cursors, padding, 8-bit checkpoints and read copies), verify (with
early flushes) and commit, and the same ops on a slot whose cursor memory holds garbage.

    compute-sanitizer --tool memcheck python3 -m bench.sanitize

Prints one line per group and exits 1 if an output of a served row is not finite, or a slot
flag is set where none should be (the sanitizer's own report is what it checks). ``--device
cpu`` runs the same calls under the interpreter (slow; ``--quick`` keeps one format per op).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import qstate
from qstate import SLOT_BAD_CURSOR, ReplayCache, quantize, replay_commit, replay_decode, replay_verify
from qstate.formats import as_format
from qstate.kernels.common import codec_probe

CONVENTIONAL_FORMATS = ("fp32", "bf16", "fp16", "bf16+sr", "fp8_e4m3:row", "fp8_e5m2:row", "int8:row", "int8:head",
                        "fp8_e4m3:head", "int8:block32", "fp8_e4m3:block32", "fp8_e4m3:row+sr")
# (checkpoint, read copy) of the replay caches: fp32 and 8-bit checkpoints, 8-bit read copies of every granularity.
REPLAY_FORMATS = (("fp32", None), ("fp32", "fp8_e4m3:row"), ("fp32", "int8:head"), ("bf16", "fp8_e4m3:block32"),
                  ("int8:row", None), ("fp32", "fp8_e4m3:row+sr"))
# (headdim, dstate): odd sizes (partial tiles) and a whole-tile shape (the conventional EVEN path).
SHAPES = ((5, 32), (64, 128))
NHEADS, NGROUPS, RING, MAX_DRAFT = 4, 2, 4, 3
DRAFT_LENGTHS = (1, 3, 2, 3, 3)  # drafts per verify round: a ring of 4 + 3 flushes early from the second 3


def _inputs(g, batch, headdim, dstate, device, dtype, T=None):
    lead = (batch,) if T is None else (batch, T)
    return dict(x=torch.randn(*lead, NHEADS, headdim, generator=g).to(device, dtype),
                dt=torch.randn(*lead, NHEADS, generator=g).to(device),
                A=-(0.5 + torch.rand(NHEADS, generator=g)).to(device),
                B=torch.randn(*lead, NGROUPS, dstate, generator=g).to(device, dtype),
                C=torch.randn(*lead, NGROUPS, dstate, generator=g).to(device),
                D=torch.randn(NHEADS, generator=g).to(device),
                z=torch.randn(*lead, NHEADS, headdim, generator=g).to(device),
                dt_bias=(torch.randn(NHEADS, generator=g) - 2).to(device))


def check_finite(name, t, failures):
    if not bool(torch.isfinite(t.float()).all()):
        failures.append(f"{name}: non-finite output")


def arguments(doc, argv) -> tuple:
    """A driver's command line: ``(device, quick)``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="one format per op")
    args = parser.parse_args(argv)
    return torch.device(args.device), args.quick


def run_groups(label, groups, failures, device) -> int:
    """Run each ``(name, calls)`` group (``calls()`` returns how many op calls it made), print a
    line per group and the failures; the exit code: 1 on any failure."""
    for name, run in groups:
        t0 = time.time()
        calls = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"{label}: {name}: {calls} calls ({time.time() - t0:.1f} s)", flush=True)
    for f in failures:
        print(f"{label}: FAIL", f, flush=True)
    print(f"{label}: {len(failures)} failures", flush=True)
    return 1 if failures else 0


def conventional(device, formats, failures, shapes=SHAPES) -> int:
    g = torch.Generator().manual_seed(0)
    calls = 0
    for headdim, dstate in shapes:
        nslots = 7
        slots = torch.tensor([3, -1, 0, 6, 2], device=device)  # a padding row, slots out of order
        for fmt in formats:
            q = quantize(torch.randn(nslots, NHEADS, headdim, dstate, generator=g), fmt)
            state, scale = q.data.to(device), None if q.scale is None else q.scale.to(device)
            flags = torch.zeros(nslots, dtype=torch.int32, device=device)
            inp = _inputs(g, slots.numel(), headdim, dstate, device, torch.bfloat16)
            for step in range(2):
                out = qstate.selective_state_update(state, **inp, dt_softplus=True, state_batch_indices=slots,
                                                    state_scale=scale, state_format=fmt, seed=step, slot_flags=flags)
                calls += 1
            check_finite(f"conventional {fmt} {headdim}x{dstate}", out, failures)
            if bool(flags.any()):
                failures.append(f"conventional {fmt}: slot flags {flags.tolist()} on finite inputs")
    return calls


def codec(device, formats) -> int:
    """The codec probe over the formats it takes (no block32: that granularity is the conventional kernel's)."""
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1)).to(device)
    probed = [as_format(f) for f in formats if "block32" not in f]
    for fmt in probed:
        codec_probe.quantize_heads(x, fmt, seed=3)
    return len(probed)


def _cache(device, ck, rd, headdim, dstate, max_draft=0):
    cache = ReplayCache.allocate(8, NHEADS, headdim, dstate, NGROUPS, ring_len=RING, checkpoint=ck, read=rd,
                                 input_dtype=torch.bfloat16, device=device, seed=11, max_draft=max_draft)
    cache.reset(range(8), torch.randn(8, NHEADS, headdim, dstate, generator=torch.Generator().manual_seed(2)))
    return cache


def replay(device, formats, failures, garbage=False, shapes=SHAPES, grouped=True) -> int:
    """Decode steps with staggered admissions (cursors differ, rows flush on different steps) at
    batch 9 (per-head step kernel) and, with ``grouped``, 64 (the grouped kernel; each call names
    8 distinct slots, the other rows padding)."""
    g = torch.Generator().manual_seed(3)
    calls = 0
    for headdim, dstate in shapes:
        for ck, rd in formats:
            cache = _cache(device, ck, rd, headdim, dstate)
            if garbage:
                cache.cursor[5] = 100000
                cache.cursor[6] = -2
            for step in range(2 * RING + 1):
                live = [s for s in range(8) if s <= step]  # slot s admitted at step s
                slots = torch.tensor(live + [-1], device=device)
                inp = _inputs(g, slots.numel(), headdim, dstate, device, torch.bfloat16)
                out = replay_decode(cache, **inp, dt_softplus=True, slot_indices=slots)
                calls += 1
                served = [i for i, s in enumerate(live) if not garbage or s not in (5, 6)]
                check_finite(f"replay {ck}/{rd} step {step}", out[served], failures)
            big = torch.arange(64, device=device) % 8
            for start in range(0, 64 if grouped else 0, 8):  # 64 rows, 8 distinct slots a call
                rows = torch.full((64,), -1, device=device)
                rows[start:start + 8] = big[start:start + 8]
                replay_decode(cache, **_inputs(g, 64, headdim, dstate, device, torch.bfloat16), dt_softplus=True,
                              slot_indices=rows)
                calls += 1
            _check_flags(f"replay {ck}/{rd}", cache, garbage, failures)
    return calls


def speculative(device, formats, failures, garbage=False, shapes=SHAPES, draft_lengths=DRAFT_LENGTHS) -> int:
    """Verify + commit rounds of T drafts (``draft_lengths``; later rounds flush early), accepted counts staggered."""
    g = torch.Generator().manual_seed(4)
    calls = 0
    for headdim, dstate in shapes:
        for ck, rd in formats:
            cache = _cache(device, ck, rd, headdim, dstate, max_draft=MAX_DRAFT)
            if garbage:
                cache.cursor[5] = 100000
                cache.cursor[6] = -2
            for rnd, T in enumerate(draft_lengths):
                slots = torch.tensor([0, 1, -1, 2, 3, 4, 5, 6], device=device)
                inp = _inputs(g, slots.numel(), headdim, dstate, device, torch.bfloat16, T=T)
                out = replay_verify(cache, **inp, dt_softplus=True, slot_indices=slots)
                accepted = torch.tensor([(rnd + i) % (T + 1) for i in range(slots.numel())], dtype=torch.int32,
                                        device=device)
                if garbage:
                    cache.drafts[5:7] = T  # pending drafts, as a CPU commit's host check wants: the kernel refuses them
                replay_commit(cache, accepted, slots)
                calls += 2
                served = [0, 1, 3, 4, 5] + ([] if garbage else [6, 7])  # rows of slots 0-4 (and 5, 6)
                check_finite(f"verify {ck}/{rd} T={T}", out[served], failures)
            _check_flags(f"verify {ck}/{rd}", cache, garbage, failures)
    return calls


def _check_flags(name, cache, garbage, failures):
    flags = cache.slot_flags.tolist()
    expected = [0] * 5 + ([SLOT_BAD_CURSOR] * 2 if garbage else [0, 0]) + [0]
    if flags != expected:
        failures.append(f"{name}: slot flags {flags}, expected {expected}")


def main(argv=None) -> int:
    device, quick = arguments(__doc__, argv)
    conv = CONVENTIONAL_FORMATS[4:5] if quick else CONVENTIONAL_FORMATS
    rep = REPLAY_FORMATS[1:2] if quick else REPLAY_FORMATS
    failures: list[str] = []
    return run_groups("sanitize", (
        ("conventional", lambda: conventional(device, conv, failures)),
        ("codec", lambda: codec(device, conv)),
        ("replay", lambda: replay(device, rep, failures)),
        ("speculative", lambda: speculative(device, rep, failures)),
        ("replay, garbage cursors", lambda: replay(device, rep, failures, garbage=True)),
        ("speculative, garbage cursors", lambda: speculative(device, rep, failures, garbage=True))), failures, device)

if __name__ == "__main__":
    sys.exit(main())
