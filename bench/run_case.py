"""Run harness cases eagerly a few times and exit: a target for an external profiler.

    ncu -k regex:'^_replay_step_kernel$' --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section SchedulerStats \\
        python3 -m bench.run_case "replay/b256/fp32+fp8_e4m3:row/L16/per-head/normal-step"

The names are exact case names (``python3 -m bench.run_case --list``). Each case runs
``--calls`` times (default 3) on one buffer set; the first call compiles.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import harness
from .run_gpu import _load_case_modules


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="exact case names")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--list", action="store_true", help="print every case name and exit")
    args = parser.parse_args(argv)
    _load_case_modules()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {case.name: case for case in harness.cases(device)}
    if args.list:
        print("\n".join(cases))
        return 0
    unknown = [name for name in args.names if name not in cases]
    if unknown:
        print(f"run_case: no case named {unknown} (see --list)", file=sys.stderr)
        return 2
    if device.type != "cuda":
        print("run_case: no CUDA device", file=sys.stderr)
        return 2
    for name in args.names:
        buffers = cases[name].make_buffers()
        for _ in range(args.calls):
            cases[name].run(buffers)
        torch.cuda.synchronize()
        print(f"ran {name} {args.calls} times", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
