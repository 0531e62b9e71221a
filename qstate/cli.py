"""The ``qstate`` command: ``qstate drift``, ``qstate choose``, ``qstate models``.

    qstate drift --model nemotron-h-8b [--schemes fp32,fp8_e4m3:row,...] [--steps 8192] [--out report]
    qstate drift --config path/to/config.json ...
    qstate drift --hf-model path/to/weights [--schemes ...] [--new-tokens 64] [--prompt TEXT] [--device cuda]
    qstate choose --model nemotron-h-8b --tolerance 1e-2 [--objective memory]
    qstate models

Scheme strings: ``<format>`` (conventional) or ``replay/<checkpoint>[/<read>]/<ring_len>``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional, Sequence

import torch

from . import profiles

__all__ = ["main"]


def _profile(args) -> profiles.Profile:
    if args.config:
        return profiles.from_hf_config(args.config)
    return profiles.get(args.model)


def _model_args(parser: argparse.ArgumentParser):
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=f"built-in profile, one of {profiles.names()}")
    source.add_argument("--config", help="a transformers config.json (Mamba2 or NemotronH) or its folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device for the simulation (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return source


def _drift_hf(args) -> int:
    from .analysis.model_drift import DEFAULT_HF_SCHEMES, hf_model_report

    result = hf_model_report(args.hf_model, args.schemes or ",".join(DEFAULT_HF_SCHEMES), args.new_tokens,
                             prompt=args.prompt, prompt_tokens=args.prompt_tokens, batch=args.batch,
                             seed=args.seed, device=args.device, out=args.out)
    print(result.to_markdown())
    print(f"\nwrote {args.out}/model_drift.md, model_drift.json and model_drift.png")
    return 0


def _drift(args) -> int:
    if args.hf_model:
        return _drift_hf(args)
    from .analysis.report import write_report
    from .analysis.schemes import DEFAULT_SCHEMES
    from .analysis.drift import simulate

    profile = _profile(args)
    every = args.every or max(1, args.steps // 512)
    result = simulate(profile, args.schemes or ",".join(DEFAULT_SCHEMES), args.steps, batch=args.batch,
                      heads=args.heads, seed=args.seed, device=args.device, every=every)
    command = "qstate " + " ".join(shlex.quote(a) for a in args.argv)
    path = write_report(result, args.out, command)
    print(result.summary().markdown())
    print(f"\nwrote {path}, drift.png and drift.json ({result.elapsed_s:.1f} s simulated)")
    return 0


def _choose(args) -> int:
    from .analysis.choose import recommend

    rec = recommend(_profile(args), args.tolerance, steps=args.steps, objective=args.objective,
                    candidates=args.candidates, device=args.device, heads=args.heads, batch=args.batch,
                    seed=args.seed)
    print(rec)
    return 0 if rec.best is not None else 1


def _models(args) -> int:
    print("| model | nheads | headdim | dstate | ngroups | SSM layers |\n|---|---|---|---|---|---|")
    for name in profiles.names():
        p = profiles.get(name)
        print(f"| {name} | {p.nheads} | {p.headdim} | {p.dstate} | {p.ngroups} | {p.n_ssm_layers} |")
    return 0


def _heads(text: str):
    """``16`` (that many heads spanning the decay range), ``all``, or ``0,5,9`` (indices)."""
    if text == "all":
        return None
    if "," in text:
        return [int(h) for h in text.split(",") if h.strip()]
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qstate", description="Numerics of quantized SSM decode state.")
    sub = parser.add_subparsers(dest="command", required=True)

    drift = sub.add_parser("drift", help="simulate storage schemes against the exact recurrence; write a report")
    _model_args(drift).add_argument(
        "--hf-model", metavar="PATH", help="local transformers Mamba2/NemotronH weights: drift of the logits "
        "(teacher-forced, each scheme against the unpatched model) instead of a simulation")
    drift.add_argument("--schemes", help="comma-separated scheme strings (default: the demo set)")
    drift.add_argument("--steps", type=int, default=8192)
    drift.add_argument("--batch", type=int, default=2)
    drift.add_argument("--heads", type=_heads, default=16,
                       help="number of heads spanning the decay range, 'all', or comma-separated indices")
    drift.add_argument("--every", type=int, default=None, help="record every N steps (default: steps / 512)")
    drift.add_argument("--out", default="report", help="output folder (report.md, drift.png, drift.json)")
    drift.add_argument("--new-tokens", type=int, default=64, help="--hf-model: decode steps")
    drift.add_argument("--prompt", help="--hf-model: prompt text, encoded by the model's tokenizer")
    drift.add_argument("--prompt-tokens", type=int, default=32,
                       help="--hf-model without --prompt: length of the random prompt")
    drift.set_defaults(run=_drift)

    choose = sub.add_parser("choose", help="recommend the cheapest scheme within an error tolerance")
    _model_args(choose)
    choose.add_argument("--tolerance", type=float, required=True, help="largest p99 relative output error")
    choose.add_argument("--objective", choices=("traffic", "memory"), default="traffic")
    choose.add_argument("--steps", type=int, default=4096)
    choose.add_argument("--batch", type=int, default=1)
    choose.add_argument("--heads", type=_heads, default=8,
                        help="number of heads spanning the decay range, 'all', or comma-separated indices")
    choose.add_argument("--candidates", help="comma-separated scheme strings (default: 72 candidates)")
    choose.set_defaults(run=_choose)

    models = sub.add_parser("models", help="list the built-in model profiles")
    models.set_defaults(run=_models)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        parser.exit(2, f"qstate {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
