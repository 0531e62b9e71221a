"""Replay decode on the GPU: correctness checks first, then timing against the conventional fp32
kernel in the same run (CUDA-graph replay of whole flush cycles, cold L2, medians).

    python3 bench/cases_replay.py --out bench/results/replay.json

Each timed graph runs every cache through one whole flush cycle (``ring_len`` steps), so the
mean per step includes exactly one flush per slot. Small batches rotate over several caches
so that more than 60 MB is touched per graph (cold L2). Bytes per step count the cache traffic
(``ReplayCache.bytes_per_step``, ring included) plus the decode inputs and outputs; the copy
ceiling (bytes read + written by a device copy of 1 GiB) is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time

import torch

from qstate import reference
from qstate.cache import ReplayCache
from qstate.formats import dequantize, quantize
from qstate.ops.replay import replay_decode

LAYER = dict(nheads=128, headdim=64, dstate=128, ngroups=8)  # Nemotron-H-8B
COLD_BYTES = 60e6


def inputs(batch, nheads, headdim, dstate, ngroups, *, device, dtype=torch.bfloat16, T=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if T is None else (T,)
    return dict(
        x=torch.randn(*lead, batch, nheads, headdim, generator=g).to(device, dtype),
        dt=(0.5 * torch.randn(*lead, batch, nheads, generator=g)).to(device, dtype),
        A=(-(0.5 + 3.5 * torch.rand(nheads, generator=g))).to(device),
        B=torch.randn(*lead, batch, ngroups, dstate, generator=g).to(device, dtype),
        C=torch.randn(*lead, batch, ngroups, dstate, generator=g).to(device, dtype),
        D=torch.randn(nheads, generator=g).to(device),
        z=torch.randn(*lead, batch, nheads, headdim, generator=g).to(device, dtype),
        dt_bias=(-2.0 + 0.5 * torch.randn(nheads, generator=g)).to(device),
    )


def io_bytes(batch, nheads, headdim, dstate, ngroups, elem=2):
    """Decode inputs and output of one step: x, z, y, B, C, dt."""
    return batch * (3 * nheads * headdim * elem + 2 * ngroups * dstate * elem + nheads * elem)


# ---------------------------------------------------------------------------- correctness


def check_correctness(device) -> dict:
    """Kernel vs fp64 reference on small shapes with the GPU's conversion instructions."""
    results = {}
    shape = dict(nheads=8, headdim=64, dstate=128, ngroups=2)
    batch, L, T = 3, 4, 10
    for dtype in (torch.float32, torch.bfloat16):
        for ck, rd in (("fp32", None), ("fp32", "fp8_e4m3:row"), ("bf16", "fp8_e4m3:row"), ("fp32", "int8:row"),
                       ("fp32", "fp8_e5m2:row"), ("fp32", "int8:head"), ("fp32", "fp8_e4m3:block32"),
                       ("fp16", "bf16"), ("int8:row", "fp16"), ("fp8_e4m3:row", None), ("bf16+sr", None)):
            inp = inputs(batch, **shape, device=device, dtype=dtype, T=T, seed=1)
            state0 = torch.randn(batch, *[shape[k] for k in ("nheads", "headdim", "dstate")],
                                 generator=torch.Generator().manual_seed(2)).to(device)
            cache = ReplayCache.allocate(batch, **shape, ring_len=L, checkpoint=ck, read=rd, input_dtype=dtype,
                                         device=device)
            cache.reset([0, 1, 2], state0)
            ys, exact_read, mismatches, scale_mismatches = [], True, 0, 0
            for t in range(T):
                out = torch.full((batch, shape["nheads"], shape["headdim"]), float("nan"), device=device, dtype=dtype)
                ys.append(replay_decode(cache, **{k: (v[t] if v.dim() > 1 else v) for k, v in inp.items()},
                                        dt_softplus=True, out=out))
                if rd is not None and (t + 1) % L == 0:
                    # Against torch's codec on the CPU (IEEE division there for certain).
                    expected = quantize(cache.checkpoint_values([0, 1, 2]).cpu(), rd)
                    bits = torch.uint8 if cache.read.element_size() == 1 else torch.int16
                    got = cache.read.cpu().view(bits).int()
                    diff = int((got != expected.data.view(bits).int()).sum())
                    scale_diff = 0 if expected.scale is None else int((cache.read_scale.cpu() != expected.scale).sum())
                    mismatches += diff
                    scale_mismatches += scale_diff
                    exact_read = exact_read and diff == 0 and scale_diff == 0
            y = torch.stack(ys).double().cpu()
            cpu = {k: v.cpu() for k, v in inp.items()}
            y_ref, S_ref = reference.decode_replay(state0.cpu(), **cpu, dt_softplus=True, checkpoint=ck, read=rd,
                                                   ring_len=L)
            rel = float((y - y_ref).norm() / y_ref.norm())
            S = cache.materialize([0, 1, 2], inp["A"]).double().cpu()
            rel_state = float((S - S_ref).norm() / S_ref.norm())
            key = f"{ck}/{rd}/{str(dtype).replace('torch.', '')}"
            results[key] = dict(y_rel_rms=rel, state_rel_rms=rel_state, read_codes_bit_exact=exact_read,
                                read_code_mismatches=mismatches, read_scale_mismatches=scale_mismatches,
                                finite=bool(torch.isfinite(y).all()))
            print(f"check {key:40s} y {rel:.2e} state {rel_state:.2e} read-exact {exact_read} ({mismatches} codes, {scale_mismatches} scales differ)", flush=True)
    return results


# ---------------------------------------------------------------------------- timing


def median_us(fn, steps, reps=15, before=None):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        if before:
            before()
        graph.replay()
    times = []
    for _ in range(reps):
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return statistics.median(times)


def copy_ceiling(device) -> float:
    """Best of a DMA copy and an elementwise kernel over 1 GiB (bytes read + written per second)."""
    src = torch.empty(2 ** 28, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    us = min(median_us(lambda: dst.copy_(src), 1), median_us(lambda: torch.mul(src, 1.0, out=dst), 1))
    return 2 * src.numel() * 4 / (us * 1e-6)


def time_conventional(batch, device, ceiling):
    from qstate.ops import selective_state_update

    H, P, N, G = (LAYER[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    per_copy = batch * H * P * N * 4
    copies = max(1, math.ceil(COLD_BYTES / per_copy))
    states = [torch.zeros(batch, H, P, N, device=device) for _ in range(copies)]
    inp = inputs(batch, **LAYER, device=device)
    out = torch.empty(batch, H, P, device=device, dtype=torch.bfloat16)

    def step():
        for s in states:
            selective_state_update(s, **inp, dt_softplus=True, out=out)

    us = median_us(step, copies)
    moved = 2 * per_copy + io_bytes(batch, **LAYER)
    return dict(op="conventional", state="fp32", batch=batch, us=us, bytes=moved, floor_us=moved / ceiling * 1e6,
                pct_of_ceiling=100 * moved / ceiling / (us * 1e-6))


def time_replay(batch, checkpoint, read, ring_len, device, ceiling, *, phase="aligned"):
    H, P, N, G = (LAYER[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    probe = ReplayCache.allocate(1, **LAYER, ring_len=ring_len, checkpoint=checkpoint, read=read, device="meta")
    copies = max(1, math.ceil(COLD_BYTES / (probe.nbytes * batch)))
    caches = [ReplayCache.allocate(batch, **LAYER, ring_len=ring_len, checkpoint=checkpoint, read=read,
                                   device=device) for _ in range(copies)]
    for c in caches:
        c.reset(list(range(batch)))
        if phase == "staggered":
            c.cursor.copy_(torch.arange(batch, device=device, dtype=torch.int32) % ring_len)
    inp = inputs(batch, **LAYER, device=device)
    out = torch.empty(batch, H, P, device=device, dtype=torch.bfloat16)

    def cycle():
        for c in caches:
            for _ in range(ring_len):
                replay_decode(c, **inp, dt_softplus=True, out=out)

    us = median_us(cycle, copies * ring_len)
    moved = probe.bytes_per_step() * batch + io_bytes(batch, **LAYER)
    row = dict(op="replay", checkpoint=checkpoint, read=read, ring_len=ring_len, batch=batch, phase=phase, us=us,
               bytes=moved, floor_us=moved / ceiling * 1e6, pct_of_ceiling=100 * moved / ceiling / (us * 1e-6))
    if batch >= 64 and phase == "aligned":
        # One step alone: every row normal (cursor 0) or every row flushing (cursor L - 1).
        c = caches[0]

        def one():
            replay_decode(c, **inp, dt_softplus=True, out=out)

        row["normal_step_us"] = median_us(one, 1, before=lambda: c.cursor.zero_())
        row["flush_step_us"] = median_us(one, 1, before=lambda: c.cursor.fill_(ring_len - 1))
    del caches
    torch.cuda.empty_cache()
    return row


def sweep_step_kernel(checkpoint, read, device):
    """Normal step alone (every cursor 0) at batch 256 for a few tile heights and warp counts."""
    from qstate.kernels.replay import launch_replay_decode

    batch, L = 256, 16
    cache = ReplayCache.allocate(batch, **LAYER, ring_len=L, checkpoint=checkpoint, read=read, device=device)
    inp = inputs(batch, **LAYER, device=device)
    out = torch.empty(batch, LAYER["nheads"], LAYER["headdim"], device=device, dtype=torch.bfloat16)
    t = cache.tensors()
    rows = []
    for block_p, warps in ((64, 4), (64, 8), (32, 4), (32, 2), (16, 2), (16, 4)):
        def one():
            launch_replay_decode(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"],
                                 inp["dt_bias"], True, None, out, *(t[k] for k in (
                                     "checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt",
                                     "ring_B", "cursor", "generation", "flush_rows", "flush_counters")),
                                 checkpoint_format=cache.checkpoint_format, read_format=cache.read_format, seed=0,
                                 step_block_p=block_p, step_warps=warps)
        us = median_us(one, 1, before=lambda: cache.cursor.zero_())
        rows.append(dict(checkpoint=checkpoint, read=read, block_p=block_p, warps=warps, normal_step_us=us))
        print(f"sweep {checkpoint}+{read} BLOCK_P {block_p} warps {warps}: normal step {us:.1f} us", flush=True)
    del cache
    torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/replay.json")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--quick", action="store_true", help="batch 256 headline cases only")
    parser.add_argument("--sweep", action="store_true", help="also sweep the step kernel's tiles")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    started = time.time()
    report = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv))
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True).stdout.strip()
    except OSError:
        report["commit"] = None
    import triton

    report["triton"] = triton.__version__
    if not args.skip_checks:
        report["checks"] = check_correctness(device)
    ceiling = copy_ceiling(device)
    report["copy_ceiling_TBps"] = ceiling / 1e12
    print(f"copy ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
    if args.sweep:
        report["sweep"] = sweep_step_kernel("fp32", "fp8_e4m3:row", device) + sweep_step_kernel("fp32", None, device)
    rows = []

    def add(row):
        rows.append(row)
        extra = "".join(f" {k} {row[k]:.1f}" for k in ("normal_step_us", "flush_step_us") if k in row)
        name = row["op"] + (f" {row['checkpoint']}+{row['read']} L{row['ring_len']} {row['phase']}"
                            if row["op"] == "replay" else " fp32")
        print(f"b{row['batch']:<4d} {name:48s} {row['us']:8.1f} us  floor {row['floor_us']:7.1f}  "
              f"{row['pct_of_ceiling']:5.1f}% of ceiling{extra}", flush=True)

    batches = (256,) if args.quick else (256, 16, 1)
    for batch in batches:
        add(time_conventional(batch, device, ceiling))
        add(time_replay(batch, "fp32", None, 16, device, ceiling))
        add(time_replay(batch, "fp32", "fp8_e4m3:row", 16, device, ceiling))
    add(time_replay(256, "fp32", "fp8_e4m3:row", 16, device, ceiling, phase="staggered"))
    add(time_replay(256, "fp32", None, 16, device, ceiling, phase="staggered"))
    if not args.quick:
        add(time_replay(256, "bf16", "fp8_e4m3:row", 16, device, ceiling))
        add(time_replay(256, "fp32", "int8:row", 16, device, ceiling))
        add(time_replay(256, "fp32", "fp8_e4m3:row", 8, device, ceiling))
        add(time_replay(256, "fp32", "fp8_e4m3:row", 32, device, ceiling))
    conventional = {r["batch"]: r["us"] for r in rows if r["op"] == "conventional"}
    for r in rows:
        if r["op"] == "replay":
            r["speedup_vs_conventional_fp32"] = conventional[r["batch"]] / r["us"]
    report["rows"] = rows
    report["wall_s"] = time.time() - started
    for r in rows:
        if r["op"] == "replay":
            print(f"b{r['batch']} {r['checkpoint']}+{r['read']} L{r['ring_len']} {r['phase']}: "
                  f"{r['speedup_vs_conventional_fp32']:.2f}x conventional fp32", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
