"""CPU speed of the drift engine, in state element-steps per second.

One element-step is one state element (batch × heads × headdim × dstate, or batch × value heads ×
V × K for the delta rule) of one scheme advanced by one decode step. Mamba-2 rows run Nemotron-H-8B
shapes; the delta-rule rows a GDN layer (Qwen3.5-9B) and a KDA layer (Kimi-Linear-48B-A3B). Each single-scheme run includes everything a drift run does besides that scheme:
sampling the inputs, the exact fp64 recurrence, recording errors (every 64 steps). Multi-scheme runs
(the demo set, the chooser's 72 candidates) count the element-steps of all their schemes.

    python bench/drift_speed.py [--threads 2] [--steps 512] [--family mamba2|gated_delta] [--out bench/results]

Writes ``drift_speed.json`` under ``--out`` and prints a markdown table (paste it into
analysis/README.md#drift-speed with the date, machine and command); exits 1 when a case misses the target, at
least 1e8 element-steps/s for fp32 and 8-bit schemes on 2 cores, for both layer families.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

from qstate.analysis.drift import simulate
from qstate.analysis.schemes import DEFAULT_SCHEMES, DELTA_DEFAULT_SCHEMES, candidate_schemes

SINGLE = ("fp32", "bf16", "fp8_e4m3:row", "fp8_e5m2:row", "int8:row", "int8:block32", "fp8_e4m3:row+sr",
          "replay/fp32/16", "replay/fp32/fp8_e4m3:row/16", "replay/bf16/int8:row/16")
# (model, scheme) of the delta-rule rows: naive and replay on a GDN and a KDA layer.
DELTA_SINGLE = (("qwen3.5-9b", "int8:row"), ("qwen3.5-9b", "replay/fp32/fp8_e4m3:row/16/inputs"),
                ("kimi-linear-48b-a3b", "fp8_e4m3:row"), ("kimi-linear-48b-a3b", "replay/fp32/fp8_e4m3:row/16/inputs"))
MAMBA2_MODEL = "nemotron-h-8b"
TARGET = 1e8


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("QSTATE_COMMIT", "unknown")


def measure(schemes, steps: int, heads: int, batch: int, model: str = MAMBA2_MODEL) -> dict:
    simulate(model, schemes, 32, batch=batch, heads=heads, every=64)  # warm-up: one cycle of a ring of 32
    result = simulate(model, schemes, steps, batch=batch, heads=heads, every=64)
    rate = result.element_steps_per_second()
    return {"model": model, "schemes": [str(s) for s in result.schemes], "steps": steps, "heads": heads,
            "batch": batch, "seconds": result.elapsed_s, "element_steps_per_s": rate}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--family", choices=("mamba2", "gated_delta"), default=None,
                        help="only the rows of one layer family (default: both)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    if args.family in (None, "mamba2"):
        for scheme in SINGLE:
            rows.append({"case": scheme, **measure([scheme], args.steps, args.heads, args.batch)})
        rows.append({"case": f"demo set ({len(DEFAULT_SCHEMES)} schemes)",
                     **measure(list(DEFAULT_SCHEMES), args.steps, args.heads, args.batch)})
        rows.append({"case": "chooser candidates (72 schemes, 8 heads, batch 1)",
                     **measure(candidate_schemes(), args.steps // 2, 8, 1)})
    if args.family in (None, "gated_delta"):
        # Delta-rule heads hold K × V = 16384 elements (Nemotron-H's 8192): half the heads, same state size.
        delta_heads = max(1, args.heads // 2)
        for model, scheme in DELTA_SINGLE:
            rows.append({"case": f"{model}: {scheme}", **measure([scheme], args.steps, delta_heads, args.batch,
                                                                 model)})
        rows.append({"case": f"qwen3.5-9b: delta demo set ({len(DELTA_DEFAULT_SCHEMES)} schemes)",
                     **measure(list(DELTA_DEFAULT_SCHEMES), args.steps, delta_heads, args.batch, "qwen3.5-9b")})
    record = {
        "date": datetime.date.today().isoformat(), "commit": _commit(), "machine": platform.processor() or
        platform.machine(), "cpu_count": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
        "command": "python bench/drift_speed.py " + " ".join(argv), "target": TARGET, "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "drift_speed.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"| case | element-steps/s ({args.threads} threads) | s | ≥ 1e8 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['element_steps_per_s']:.3g} | {r['seconds']:.2f} | "
              f"{'yes' if r['element_steps_per_s'] >= TARGET else 'no'} |")
    missed = [r["case"] for r in rows if r["element_steps_per_s"] < TARGET]
    if missed:
        print(f"drift_speed: target {TARGET:.0e} element-steps/s missed by {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
