"""The chooser's traffic model against measured time: for each scheme the bench timed at batch 256
on the Nemotron-H-8B layer, the speed-up over fp32 that ``Scheme.bytes_per_step`` predicts
(bytes alone) next to the one measured in the same GPU run.

    python3 -m bench.traffic_check bench/results/conventional.json bench/results/replay.json

``qstate choose --objective traffic`` ranks schemes by bytes per step; where a kernel is bound
by instruction issue rather than bytes (the 8-bit states on the H200, bench/README.md), the
measured speed-up falls short of the predicted one, and this table says by how much.
"""

from __future__ import annotations

import argparse
import json
import sys

from qstate import profiles
from qstate.analysis.schemes import parse_schemes

PROFILE = "nemotron-h-8b"
BATCH = 256
# Scheme (the chooser's name) → bench case: the launcher's default kernel where one is timed,
# else the grouped step kernel the default runs at batch 256 (timed with 8 heads per program,
# the default has 4: 303.1 against 305.9 µs of kernels a step without a read copy).
CASES = {
    "fp32": "nemotron-h-8b/b256/fp32",
    "bf16": "nemotron-h-8b/b256/bf16",
    "fp16": "nemotron-h-8b/b256/fp16",
    "int8:row": "nemotron-h-8b/b256/int8:row",
    "fp8_e4m3:row": "nemotron-h-8b/b256/fp8_e4m3:row",
    "replay/fp32/16": "replay/b256/fp32+none/L16/default",
    "replay/fp32/fp8_e4m3:row/16": "replay/b256/fp32+fp8_e4m3:row/L16/default",
    "replay/fp32/int8:row/16": "replay/b256/fp32+int8:row/L16/grouped-h8",
    "replay/bf16/fp8_e4m3:row/16": "replay/b256/bf16+fp8_e4m3:row/L16/grouped-h8",
    "replay/fp32/fp8_e4m3:row/8": "replay/b256/fp32+fp8_e4m3:row/L8/grouped-h8",
    "replay/fp32/fp8_e4m3:row/32": "replay/b256/fp32+fp8_e4m3:row/L32/grouped-h8",
}


def table(results: dict) -> str:
    """Markdown rows for the schemes whose case is in ``results`` (case name → result dict with
    ``us`` and ``pct_copy``, as bench/run_gpu.py writes them); needs the fp32 case."""
    if CASES["fp32"] not in results:
        raise ValueError(f"results: expected the case {CASES['fp32']!r} (the fp32 baseline)")
    profile = profiles.get(PROFILE)
    base_bytes = parse_schemes("fp32")[0].bytes_per_step(profile)
    base_us = results[CASES["fp32"]]["us"]
    lines = ["| scheme | bytes per element and step | predicted speed-up (bytes) | measured µs | "
             "measured speed-up | % of copy |", "|---|---|---|---|---|---|"]
    for scheme, case in CASES.items():
        if case not in results:
            continue
        per_element = parse_schemes(scheme)[0].bytes_per_step(profile)
        row = results[case]
        lines.append(f"| `{scheme}` | {per_element:.2f} | {base_bytes / per_element:.2f}× | {row['us']:.1f} | "
                     f"{base_us / row['us']:.2f}× | {row['pct_copy']:.0f} % |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSON files of one bench/run_gpu.py run")
    args = parser.parse_args(argv)
    results = {}
    for path in args.files:
        with open(path) as fh:
            results.update({r["name"]: r for r in json.load(fh)["results"]})
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
