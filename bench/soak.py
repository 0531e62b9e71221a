"""Soak: one ReplayCache (fp32 checkpoint, ``fp8_e4m3:row`` read copy, ring 16) decoding
``--steps`` tokens (default 1,000,000) at batch 256 on the nemotron-h-8b layer, with staggered
admissions and resets, its outputs checked against an fp32 conventional run every
``--check-every`` steps (bench/README.md, "Soak").

    python3 -m bench.soak [--steps N] [--out bench/results/soak.json]

Every step decodes all ``batch`` slots; the first ``--ref-rows`` slots are also decoded by
``selective_state_update`` over an fp32 state from the same inputs (the reference). Steps run
as CUDA graphs of ``--graph-steps`` steps (inputs drawn inside the graph from the CUDA
generator). Between graphs a group of slots is re-admitted (``reset`` to a fresh state, the
reference row too) and decodes a few steps alone, so admissions land at every ring position.
A check compares the last step's outputs of the reference rows with the reference (relative
RMS against :func:`bound`), and requires every output finite and ``slot_flags`` all zero. Writes
a JSON summary; exits 1 on a failed check. ``--device cpu`` (with a small ``--shape``) runs the
same loop eagerly under the interpreter, for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

import torch

from qstate import ReplayCache, profiles, replay_decode, selective_state_update
from qstate.formats import DTYPES, as_format

PROFILE, CHECKPOINT, READ, RING_LEN = "nemotron-h-8b", "fp32", "fp8_e4m3:row", 16
OUTPUT_DTYPE = torch.bfloat16
# A sequence lives this many graphs between its admissions (a group of slots re-admitted per graph).
LIFE_GRAPHS = 40


def bound(read: str = READ, output_dtype: torch.dtype = OUTPUT_DTYPE) -> float:
    """Relative RMS bound on replay outputs against the fp32 conventional run: the largest
    relative rounding of one read-copy element (half a grid step, ``2**-(mantissa_bits + 1)``;
    the read copy is the only rounding of state on this path: the checkpoint folds in fp32), plus
    one rounding of each side's output (``2**-8`` each for bf16). The theory's rms estimate of
    one read-copy rounding, ``analysis.theory.rounding_rms`` (0.026 for ``fp8_e4m3:row``), lies
    well below it; the fp32 recurrences differ by about 1e-6."""
    fmt = as_format(read)
    half_step = 2.0 ** -(DTYPES[fmt.dtype].mantissa_bits + 1)
    output = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[output_dtype]
    return half_step + 2 * output


class Soak:
    """The cache, the reference state and static input/output buffers of one step."""

    def __init__(self, device, batch, ref_rows, H, P, N, G, seed):
        self.device, self.batch, self.R = device, batch, ref_rows
        model = dataclasses.replace(profiles.get(PROFILE), nheads=H, headdim=P, dstate=N, ngroups=G)
        layer = model.sample_inputs(1, 1, seed=seed)  # the model's A, D and dt_bias
        self.A, self.D, self.dt_bias = (t.to(device) for t in (layer.A, layer.D, layer.dt_bias))
        self.cache = ReplayCache.allocate(batch, H, P, N, G, ring_len=RING_LEN, checkpoint=CHECKPOINT, read=READ,
                                          input_dtype=OUTPUT_DTYPE, device=device, seed=seed)
        self.ref = torch.zeros(ref_rows, H, P, N, device=device)
        self.gen = None if device.type == "cuda" else torch.Generator().manual_seed(seed)
        self.state_gen = torch.Generator().manual_seed(seed + 1)
        self.x = torch.empty(batch, H, P, device=device, dtype=OUTPUT_DTYPE)
        self.z = torch.empty_like(self.x)
        self.dt = torch.empty(batch, H, device=device)
        self.B = torch.empty(batch, G, N, device=device, dtype=OUTPUT_DTYPE)
        self.C = torch.empty(batch, G, N, device=device)
        self.out = torch.empty_like(self.x)
        self.ref_out = torch.empty(ref_rows, H, P, device=device, dtype=OUTPUT_DTYPE)

    def _draw(self):
        for t in (self.x, self.z, self.B, self.C):
            t.normal_(generator=self.gen)
        self.dt.normal_(0.0, 0.5, generator=self.gen)

    def step(self):
        """One token for every slot, and for the reference rows; inputs drawn on the device."""
        self._draw()
        replay_decode(self.cache, self.x, self.dt, self.A, self.B, self.C, self.D, self.z, self.dt_bias, True,
                      out=self.out)
        R = self.R
        selective_state_update(self.ref, self.x[:R], self.dt[:R], self.A, self.B[:R], self.C[:R], self.D, self.z[:R],
                               self.dt_bias, True, out=self.ref_out)

    def admit(self, slots: list, lead_in: int):
        """Re-admit ``slots`` (a fresh prefill state, the reference rows too), then decode them
        alone ``lead_in`` steps, so they sit at another ring position than the rest."""
        shape = (len(slots), *self.cache.checkpoint.shape[1:])
        state = 0.5 * torch.randn(shape, generator=self.state_gen)
        self.cache.reset(slots, state)
        idx = torch.tensor(slots, device=self.device)
        ref = idx < self.R
        self.ref[idx[ref]] = state.to(self.device)[ref.cpu()]
        for _ in range(lead_in):
            self._draw()
            args = (self.A, self.D, self.dt_bias)
            replay_decode(self.cache, self.x[:len(slots)], self.dt[:len(slots)], args[0], self.B[:len(slots)],
                          self.C[:len(slots)], args[1], self.z[:len(slots)], args[2], True, slot_indices=idx,
                          out=self.out[:len(slots)])
            if bool(ref.any()):
                rows = ref.nonzero().flatten()
                selective_state_update(self.ref, self.x[rows], self.dt[rows], self.A, self.B[rows], self.C[rows],
                                       self.D, self.z[rows], self.dt_bias, True, state_batch_indices=idx[rows])

    def check(self) -> dict:
        """Relative RMS of the reference rows' last outputs, finiteness, slot flags."""
        y, y_ref = self.out[:self.R].double(), self.ref_out.double()
        rel = float((y - y_ref).norm() / y_ref.norm().clamp(min=1e-300))
        return dict(rel_rms=rel, finite=bool(torch.isfinite(self.out).all()),
                    flagged_slots=int((self.cache.slot_flags != 0).sum()))


def _block(soak: Soak, steps: int):
    """``steps`` steps as one callable: a captured CUDA graph on a GPU, a loop elsewhere."""
    if soak.device.type != "cuda":
        return lambda: [soak.step() for _ in range(steps)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        soak.step()  # compiles and prepares the launches outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            soak.step()
    return graph.replay


def run(steps, batch, ref_rows, check_every, graph_steps, shape, device, seed=0) -> dict:
    if check_every % graph_steps:
        raise ValueError(f"--check-every: expected a multiple of --graph-steps ({graph_steps}), got {check_every}")
    if ref_rows > batch:
        raise ValueError(f"--ref-rows: expected at most --batch ({batch}), got {ref_rows}")
    H, P, N, G = shape
    torch.manual_seed(seed)
    soak = Soak(device, batch, ref_rows, H, P, N, G, seed)
    soak.admit(list(range(batch)), 0)
    block = _block(soak, graph_steps)
    soak.admit(list(range(batch)), 0)  # the warm-up step of the capture moved every slot
    groups = max(1, min(LIFE_GRAPHS, batch))
    checks, failures, done, graphs = [], [], 0, 0
    limit = bound()
    t0 = time.time()
    while done < steps:
        block()
        done += graph_steps
        graphs += 1
        if done % check_every == 0 or done >= steps:
            result = dict(step=done, **soak.check())
            checks.append(result)
            bad = [k for k, ok in (("rel_rms", result["rel_rms"] <= limit), ("finite", result["finite"]),
                                   ("flags", result["flagged_slots"] == 0)) if not ok]
            if bad:
                failures.append(dict(result, failed=bad))
            print(f"soak: step {done}: rel RMS {result['rel_rms']:.4f} (bound {limit:.4f}), finite "
                  f"{result['finite']}, flagged slots {result['flagged_slots']} ({time.time() - t0:.0f} s)",
                  flush=True)
        # Re-admit one group of slots, then decode it alone a few steps (another ring position).
        soak.admit([s for s in range(batch) if s % groups == graphs % groups], graphs % RING_LEN)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    return dict(steps=done, batch=batch, shape=dict(nheads=H, headdim=P, dstate=N, ngroups=G),
                checkpoint=CHECKPOINT, read=READ, ring_len=RING_LEN, ref_rows=ref_rows, check_every=check_every,
                graph_steps=graph_steps, bound=limit, max_rel_rms=max(c["rel_rms"] for c in checks),
                checks=checks, failures=failures, wall_s=wall, us_per_step=1e6 * wall / done,
                device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__)


def main(argv=None) -> int:
    layer = profiles.get(PROFILE)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ref-rows", type=int, default=64)
    parser.add_argument("--check-every", type=int, default=10_000)
    parser.add_argument("--graph-steps", type=int, default=500)
    parser.add_argument("--shape", default=f"{layer.nheads},{layer.headdim},{layer.dstate},{layer.ngroups}",
                        help="nheads,headdim,dstate,ngroups (default: nemotron-h-8b)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "soak.json"))
    args = parser.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    if len(shape) != 4:
        parser.error(f"argument --shape: expected nheads,headdim,dstate,ngroups, got {args.shape!r}")
    summary = run(args.steps, args.batch, args.ref_rows, args.check_every, args.graph_steps, shape,
                  torch.device(args.device))
    summary["command"] = "python3 -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"soak: {summary['steps']} steps, {summary['us_per_step']:.1f} µs/step, max rel RMS "
          f"{summary['max_rel_rms']:.4f} (bound {summary['bound']:.4f}), {len(summary['failures'])} failed checks; "
          f"{args.out}", flush=True)
    return 1 if summary["failures"] or not math.isfinite(summary["max_rel_rms"]) else 0


if __name__ == "__main__":
    sys.exit(main())
