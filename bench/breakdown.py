"""Per-kernel device time of the harness's cases: where a call's microseconds go.

    python3 -m bench.breakdown --only "spec replay fp32+fp8_e4m3:row b256" [--out DIR] [--warm]
        [--set qstate.kernels.mamba2.speculative.FLUSH_TILE="(16, 4)" ...]

Each selected case runs eagerly on buffer sets that together exceed the L2 (as in
:func:`harness.time_case`), under ``torch.profiler``; the device time of every kernel is summed
by kernel name and divided by the number of calls. Eager launches leave gaps between kernels, so
the sum is the device work of a call, not its CUDA-graph time; the kernels' shares are what this
is for. Writes ``DIR/breakdown.json`` and prints one table per case.

``--warm`` runs every call on one buffer set instead: a case whose set fits in the L2 (50 MB on
an H200; batch 16 of the conventional 8-bit cases) then reads no DRAM, so its time is the
kernel's instruction and latency cost alone, the floor no memory tuning goes below.

``--set MODULE.NAME=VALUE`` (repeatable) sets a launcher constant (a tile, a program count)
to a Python literal before timing: the tile sweeps of bench/README.md are such runs.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from qstate.kernels import clear_launch_plans

from . import harness
from .run_gpu import _load_case_modules

ROUNDS = 5


def kernel_times(case: harness.Case, rounds: int = ROUNDS, warm: bool = False) -> dict[str, float]:
    """µs per call of each kernel the case launches, averaged over ``rounds`` passes over its
    cold buffer sets (the first pass, which compiles, is not profiled); with ``warm``, over
    ``rounds`` calls on one set."""
    set_bytes = case.set_bytes or case.bytes_moved
    nsets = 1 if warm else max(2, min(harness.MAX_SETS, -(-harness.COLD_BYTES // max(set_bytes, 1))))
    sets = [case.make_buffers() for _ in range(nsets)]
    for buffers in sets:
        case.run(buffers)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for buffers in sets:
                case.run(buffers)
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time
    calls = rounds * nsets * case.steps_per_call
    del sets
    torch.cuda.empty_cache()
    return {name: us / calls for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def set_constant(assignment: str) -> None:
    """``"pkg.module.NAME=literal"``: set that module attribute, which must exist already."""
    target, sep, literal = assignment.partition("=")
    module_name, _, name = target.strip().rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"--set: expected MODULE.NAME=VALUE, got {assignment!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"--set: {module_name} has no attribute {name!r}")
    setattr(module, name, ast.literal_eval(literal.strip()))
    clear_launch_plans()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True, help="comma-separated substrings of case names")
    parser.add_argument("--groups", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--warm", action="store_true", help="one buffer set for every call (L2-resident if it fits)")
    args = parser.parse_args(argv)
    for assignment in args.set:
        set_constant(assignment)
    if not torch.cuda.is_available():
        print("breakdown: no CUDA device", file=sys.stderr)
        return 2
    _load_case_modules()
    device = torch.device("cuda")
    selected = [c for c in harness.cases(device, args.groups.split(",") if args.groups else None)
                if any(part in c.name for part in args.only.split(","))]
    report = {}
    for case in selected:
        times = kernel_times(case, warm=args.warm)
        report[case.name] = times
        print(f"\n{case.name}: {sum(times.values()):.1f} µs of kernels per call")
        for name, us in times.items():
            print(f"  {us:9.1f} µs  {name}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "breakdown.json"), "w") as fh:
            json.dump(dict(environment=harness.environment(), command="python3 -m bench.breakdown "
                           + " ".join(argv if argv is not None else sys.argv[1:]), cases=report), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
