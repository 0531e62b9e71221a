"""Shared GPU benchmark harness: CUDA-graph timing with a cold L2, copy and read-only ceilings
measured in the same run, and JSON / markdown writers.

A *case* is built by a function registered with :func:`register` under a group name (one module
per op: ``bench/cases_conventional.py``, ``bench/cases_replay.py``, ...). A builder takes the
device and returns ``Case``s; each case's ``make_buffers()`` returns one independent set of
arguments and ``run(buffers)`` launches the op once on it. The harness allocates enough buffer
sets to exceed ``COLD_BYTES`` (so each call finds its data outside the 50 MB L2), captures one
CUDA graph that calls ``run`` once per set, replays it, and reports the median time per call.

Adding cases: a module ``bench/cases_<op>.py`` registers builders with ``@register("<group>")``,
each returning ``Case``s (``make_buffers()``, ``run(buffers)``, ``bytes_moved``). Optional module
functions used by ``run_gpu.py``: ``check_codec(device)``, ``check_kernel(device)`` (→ failures,
report rows), ``sweep_cases(device)``, ``eager_overhead(device)``, ``annotate(by_group)``. List
the module in ``run_gpu.CASE_MODULES``; all registered groups are timed in one run, against the
same ceilings.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl

COLD_BYTES = 128 * 2**20  # more than twice the H200's 50 MB L2
MAX_SETS = 64


@dataclasses.dataclass
class Case:
    """One timed configuration. ``bytes_moved`` counts bytes read plus written per call."""

    group: str
    name: str
    params: dict
    bytes_moved: int
    make_buffers: Callable[[], Any]
    run: Callable[[Any], None]
    set_bytes: int = 0  # device bytes of one buffer set (defaults to bytes_moved)
    steps_per_call: int = 1  # op steps one run() makes (a whole flush cycle); µs and bytes_moved are per step
    peer: bool = False  # another project's kernel: timed after every qstate case, so a fault in it costs no qstate row


_BUILDERS: dict[str, list[Callable[[torch.device], list[Case]]]] = {}


def register(group: str):
    """Decorator: ``@register("conventional") def cases(device) -> list[Case]``."""
    def wrap(fn):
        _BUILDERS.setdefault(group, []).append(fn)
        return fn
    return wrap


def cases(device: torch.device, groups: Optional[list[str]] = None) -> list[Case]:
    out = []
    for group, builders in _BUILDERS.items():
        if groups is None or group in groups:
            for build in builders:
                out.extend(build(device))
    return out


def _graph_time_us(calls: Callable[[], None], ncalls: int, replays: int = 20) -> float:
    """Median µs per call of a CUDA graph made of ``ncalls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # warm-up: compiles kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / ncalls)
    del graph
    return statistics.median(times)


def time_case(case: Case, replays: int = 20) -> float:
    """Median µs per call under CUDA-graph replay, each call on a buffer set not in L2."""
    set_bytes = case.set_bytes or case.bytes_moved
    nsets = max(2, min(MAX_SETS, -(-COLD_BYTES // max(set_bytes, 1))))
    sets = [case.make_buffers() for _ in range(nsets)]

    def calls():
        for buffers in sets:
            case.run(buffers)

    try:
        return _graph_time_us(calls, nsets * case.steps_per_call, replays)
    finally:
        del sets
        torch.cuda.empty_cache()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size, for bit-for-bit comparisons (NaN equal to
    itself, −0 unequal to +0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def graph_matches_eager(name: str, make_buffers: Callable[[], Any], steps: Callable[[Any], None],
                        tensors: Callable[[Any], dict]) -> list[str]:
    """Failures where ``steps(buffers)`` captured in a CUDA graph and replayed (its kernels
    launching with programmatic dependent launch where the GPU has it, kernels/pdl.py) leaves
    ``tensors(buffers)`` other than the same steps run eagerly with PDL off, bit for bit: a
    kernel that touched memory before its grid-dependency wait would race with the kernel
    before it. ``make_buffers`` must give equal buffers on every call."""
    from qstate.kernels import clear_launch_plans
    from qstate.kernels.common import pdl

    enabled = pdl.enabled
    eager = make_buffers()
    # Launch plans (and prepared launches) keep the PDL choice of the call that made them, so
    # each side starts from none: the eager steps must not reuse PDL plans, nor the graph theirs.
    pdl.enabled = lambda device: False
    clear_launch_plans()
    try:
        steps(eager)
    finally:
        pdl.enabled = enabled
        clear_launch_plans()
    steps(make_buffers())  # compiles the PDL kernels outside the capture
    torch.cuda.synchronize()
    captured = make_buffers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps(captured)
    graph.replay()
    torch.cuda.synchronize()
    failures = []
    expected, actual = tensors(eager), tensors(captured)
    for key, want in expected.items():
        got = actual[key]
        if want is None:
            continue
        differing = int((bits(want) != bits(got)).sum())
        if differing:
            failures.append(f"{name}: graph replay differs from eager in {key} ({differing} elements)")
    return failures


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def copy_ceiling_gbs(device: torch.device, nbytes: int = 2**30) -> float:
    """Bandwidth of a device-to-device copy (bytes read + written per second), in GB/s: the
    better of torch's copy and a plain wide-load Triton copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    n, block = src.numel(), 8192
    us_torch = _graph_time_us(lambda: dst.copy_(src), 1, replays=50)
    us_triton = _graph_time_us(lambda: _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block), 1, replays=50)
    return 2 * nbytes / (min(us_torch, us_triton) * 1e-6) / 1e9


@triton.jit
def _read_kernel(src_ptr, sums_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sums_ptr + tl.program_id(0), tl.sum(tl.load(src_ptr + offsets, mask=offsets < n, other=0.0), axis=0))


def read_ceiling_gbs(device: torch.device, nbytes: int = 2**31) -> float:
    """Bandwidth of reading alone (bytes read per second), in GB/s: a Triton kernel whose
    programs each sum 32 KB, the better of two block sizes. What a read-only kernel (a replay
    normal step) can reach; on the H200 about 14 % above the copy ceiling (bench/README.md)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    n = src.numel()
    best = float("inf")
    for block, warps in ((8192, 4), (16384, 8)):
        sums = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=device)
        best = min(best, _graph_time_us(
            lambda: _read_kernel[(triton.cdiv(n, block),)](src, sums, n, BLOCK=block, num_warps=warps), 1, replays=30))
    return nbytes / (best * 1e-6) / 1e9


def eager_us(fn: Callable[[], None], iters: int = 200, rounds: int = 5) -> float:
    """Wall µs per call of ``fn`` called back to back without graphs (host-bound at batch 1):
    the median over ``rounds`` rounds of ``iters`` calls (a host's other work moves single
    rounds by tens of µs)."""
    import statistics
    import time
    for _ in range(10):
        fn()
    per_round = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        per_round.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(per_round)


def environment() -> dict:
    commit = os.environ.get("QSTATE_COMMIT")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        commit=commit, torch=torch.__version__, triton=triton.__version__,
    )


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)


def markdown_table(payload: dict) -> str:
    """The results table of one run (``payload`` as written by ``bench/run_gpu.py``)."""
    env = payload["environment"]
    lines = [
        f"Command `{payload['command']}`. Copy ceiling measured in the same run: "
        f"{payload['copy_ceiling_gbs']:.0f} GB/s (read + write)"
        + (f"; reading alone: {payload['read_ceiling_gbs']:.0f} GB/s." if "read_ceiling_gbs" in payload else "."),
        "",
        "| op | model | batch | format | inputs | µs | MB moved | GB/s | % of copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        p = r["params"]
        label = p.get("format", "") + (f" (BLOCK_P {p['block_p']}, {p['num_warps']} warps)" if "block_p" in p else "")
        lines.append(
            f"| {r['group']} | {p.get('model', '')} | {p.get('batch', '')} | {label} | "
            f"{p.get('inputs', '')} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f} |"
        )
    for note in payload.get("notes", []):
        lines.append("")
        lines.append(note)
    lines += ["", f"measured on {env['gpu']}, {env['date']}, {env['commit']} (torch {env['torch']}, triton {env['triton']})"]
    return "\n".join(lines)


def update_readme(readme: str, table: str, key: str) -> None:
    """Replace the text between ``readme``'s results markers for ``key`` with ``table``
    (appended with its markers when absent), so each run's table keeps its own place."""
    begin, end = f"<!-- results:{key}:begin -->", f"<!-- results:{key}:end -->"
    with open(readme) as fh:
        text = fh.read()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{table}\n{end}{tail}"
    else:
        text = f"{text.rstrip()}\n\n{begin}\n{table}\n{end}\n"
    with open(readme, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Write the table of a run's JSON into bench/TABLES.md")
    parser.add_argument("json_path")
    parser.add_argument("--readme", default=os.path.join(os.path.dirname(__file__), "TABLES.md"))
    parser.add_argument("--key", default=None, help="marker key (default: the JSON's 'key')")
    args = parser.parse_args()
    with open(args.json_path) as fh:
        payload = json.load(fh)
    update_readme(args.readme, markdown_table(payload), args.key or payload["key"])
