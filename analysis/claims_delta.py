"""The delta-rule statements of the README's claims table, measured on one model profile.

    python -m qstate.analysis.claims_delta --model qwen3.5-9b [--steps 4096] [--heads 8] [--batch 2]

Simulates ``int8:row``, ``fp8_e4m3:row`` (naive) and ``replay/fp32/fp8_e4m3:row/16`` with an
``inputs`` and a ``corrected`` ring, recording every step, and prints:

* each naive scheme's output error at the last step (rms over heads), and its ratio to the replay
  error over the last whole ring cycle (rms over heads and the cycle's steps, so that the flushing
  token, which reads no read copy, weighs as one step of the cycle);
* the replay's growth exponent, as ``qstate drift`` reports it (from the per-cycle RMS errors over
  the second half: :meth:`analysis.drift.DriftResult.measures`);
* the checkpoint error (rms over heads) after the first flush, after 8 flushes and at the end, per
  ring kind.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from .drift import simulate

__all__ = ["measure", "main"]

NAIVE = ("int8:row", "fp8_e4m3:row")
INPUTS = "replay/fp32/fp8_e4m3:row/16/inputs"
CORRECTED = "replay/fp32/fp8_e4m3:row/16/corrected"
RING = 16


def measure(model: str, steps: int = 4096, heads: int = 8, batch: int = 2, seed: int = 0) -> dict:
    """The numbers above, as a dict (``steps`` a multiple of the ring length, 16)."""
    if steps % RING or steps < 16 * RING:
        raise ValueError(f"steps: expected a multiple of {RING}, at least {16 * RING}, got {steps}")
    schemes = [*NAIVE, INPUTS, CORRECTED]
    r = simulate(model, schemes, steps, batch=batch, heads=heads, seed=seed, every=1)
    rms = {s: np.sqrt(np.mean(r.output_error[j] ** 2, axis=1)) for j, s in enumerate(schemes)}
    replay = schemes.index(INPUTS)
    out = {"model": model, "steps": steps, "heads": r.heads, "decay": r.decay, "batch": batch, "seed": seed,
           "replay_last_cycle_error": float(r.cycle_curve(replay)[-1]),
           "replay_growth_exponent": r.summary()[replay]["growth_exponent"]}
    for s in NAIVE:
        out[f"{s}_last_step_error"] = float(rms[s][-1])
        out[f"{s}_ratio"] = out[f"{s}_last_step_error"] / out["replay_last_cycle_error"]
    for s in (INPUTS, CORRECTED):
        ck = r.checkpoint_curve(schemes.index(s))
        out[f"{s}_checkpoint_error"] = {"flush 1": float(ck[RING - 1]), "flush 8": float(ck[8 * RING - 1]),
                                        f"flush {steps // RING}": float(ck[-1])}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = measure(args.model, args.steps, args.heads, args.batch)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
