"""The ``qstate`` command: ``qstate drift``, ``qstate choose``, ``qstate models``.

    qstate drift --model nemotron-h-8b [--schemes fp32,fp8_e4m3:row,...] [--steps 8192] [--out report] [--force]
    qstate drift --model qwen3.5-9b [--schemes int8:row,replay/fp32/fp8_e4m3:row/16/inputs,...]
    qstate drift --config path/to/config.json ...
    qstate drift --hf-model path/to/weights [--schemes ...] [--new-tokens 64] [--prompt TEXT] [--device cuda]
    qstate choose --model kimi-linear-48b-a3b --tolerance 1e-2 [--objective memory]
    qstate models

Both layer families work: Mamba-2 models and gated delta rule models (GDN, KDA); ``qstate models``
lists them. Scheme strings: ``<format>`` (conventional, or "naive" for the delta rule) or
``replay/<checkpoint>[/<read>]/<ring_len>[/<ring>]``, ``<ring>`` being the delta rule's ring kind
(``inputs``, the default, or ``corrected``). Defaults by family: Mamba-2 runs 8192 steps of 16
heads, recorded every ``steps / 512``; a delta-rule run 4096 steps of 8 heads (a head holds
``K × V`` = 16384 elements), recorded every ``steps / 128``.

``drift`` checks ``--out`` (a folder it can write, holding no earlier report unless ``--force``)
before simulating, prints the summary and writes the markdown and JSON before the figure; the
figure needs matplotlib (the ``notebooks`` extra) and is skipped, saying so, without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from typing import Optional, Sequence

import torch

from . import profiles

__all__ = ["main"]


def _profile(args) -> profiles.Profile:
    if not args.config:
        return profiles.get(args.model)
    try:
        return profiles.from_hf_config(args.config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"argument --config: {str(err).removeprefix('config: ')}") from None


# What a drift report writes; an --out folder holding any of them is refused unless --force.
_REPORT_FILES = ("report.md", "drift.json", "drift.png")
_HF_REPORT_FILES = ("model_drift.md", "model_drift.json", "model_drift.png")


def _prepare_out(out: str, force: bool, files: Sequence[str]) -> None:
    """Create ``out`` and check that it takes a file, before any simulation: a report that cannot
    be written, or one that would overwrite an earlier one, is refused first."""
    earlier = [name for name in files if os.path.exists(os.path.join(out, name))]
    if earlier and not force:
        raise ValueError(f"argument --out: {out!r} already holds a report ({', '.join(earlier)}); "
                         f"give another folder or --force to overwrite it")
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".qstate-write-check")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"argument --out: cannot write a report into {out!r} ({err.strerror or err})") from None


def _have_matplotlib() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # None in sys.modules, or a module without a spec
        return False


_PLOT_SKIPPED = "plot skipped: matplotlib is not installed (an optional extra: pip install 'qstate[notebooks]')"


def _count(text: str) -> int:
    """argparse type of counts (steps, batch, threads, ...): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _device(text: str) -> str:
    """argparse type of --device: cpu, or a CUDA device this machine has (checked before simulating)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"expected a CUDA device of this machine ({torch.cuda.device_count()} found), got {text!r}")
    return text


def _folder(text: str) -> str:
    """argparse type of --out: a folder, created if missing; an existing file is refused before simulating."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a folder (created if missing), got the existing file {text!r}")
    return text


def _model_args(parser: argparse.ArgumentParser):
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=f"built-in profile, one of {profiles.names()}")
    source.add_argument("--config", help="a transformers config.json (Mamba2, NemotronH, Qwen3-Next, Qwen3.5, "
                        "Kimi Linear, GLM-5.x) or its folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", type=_device, default="cpu", help="torch device for the simulation (cpu, cuda)")
    parser.add_argument("--threads", type=_count, default=None, help="torch CPU threads (default: torch's)")
    return source


def _check_prompt(path: str, prompt: str) -> None:
    # hf_model_report encodes the prompt only after loading the model, and a prompt of no tokens
    # then fails inside the model's forward pass.
    from .integrations.hf_import import import_transformers

    transformers = import_transformers()

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except OSError as err:
        raise FileNotFoundError(f"argument --hf-model: expected a folder with a tokenizer to encode --prompt, "
                                f"got {path!r} ({err})") from None
    if not tokenizer(prompt).input_ids:
        raise ValueError(f"argument --prompt: expected text that encodes to at least one token, got {prompt!r}")


def _drift_hf(args) -> int:
    from .analysis.schemes import parse_schemes
    from .integrations.hf_import import import_transformers

    try:
        import_transformers()
    except ImportError as err:
        raise ValueError(f"argument --hf-model: needs transformers (the 'hf' extra: pip install 'qstate[hf]'), "
                         f"which does not import here ({err})") from None
    from .analysis.model_drift import DEFAULT_HF_SCHEMES, hf_model_report

    simulation_only = [f"--{name}" for name in ("steps", "heads", "every") if hasattr(args, name)]
    if simulation_only:
        raise ValueError(f"argument {simulation_only[0]}: expected only without --hf-model (the model's drift "
                         f"decodes --new-tokens tokens of every head), got --hf-model")
    if args.prompt is not None and args.prompt_tokens is not None:
        raise ValueError("argument --prompt-tokens: expected only without --prompt (the prompt sets the length), "
                         "got both")
    schemes = parse_schemes(",".join(DEFAULT_HF_SCHEMES) if args.schemes is None else args.schemes)
    if args.prompt is not None:
        _check_prompt(args.hf_model, args.prompt)
    new_tokens = 64 if args.new_tokens is None else args.new_tokens
    prompt_tokens = 32 if args.prompt_tokens is None else args.prompt_tokens
    _prepare_out(args.out, args.force, _HF_REPORT_FILES)
    plot = _have_matplotlib()
    result = hf_model_report(args.hf_model, schemes, new_tokens, prompt=args.prompt, prompt_tokens=prompt_tokens,
                             batch=args.batch, seed=args.seed, device=args.device, out=args.out, plot=plot)
    print(result.to_markdown())
    print(f"\nwrote {args.out}/model_drift.md, model_drift.json" + (" and model_drift.png" if plot else
                                                                     f"; {_PLOT_SKIPPED}"))
    return 0


def _drift(args) -> int:
    if args.hf_model:
        return _drift_hf(args)
    from .analysis.report import write_report
    from .analysis.drift import simulate
    from .analysis.schemes import default_schemes, parse_schemes

    hf_only = {"--new-tokens": args.new_tokens, "--prompt": args.prompt, "--prompt-tokens": args.prompt_tokens}
    given = [option for option, value in hf_only.items() if value is not None]
    if given:
        raise ValueError(f"argument {given[0]}: expected only with --hf-model (the simulation does not use it), "
                         f"got no --hf-model")
    profile = _profile(args)
    steps, heads, records = _DRIFT_DEFAULTS[profile.family]
    steps = getattr(args, "steps", steps)
    every = getattr(args, "every", max(1, steps // records))
    schemes = parse_schemes(",".join(default_schemes(profile)) if args.schemes is None else args.schemes)
    _prepare_out(args.out, args.force, _REPORT_FILES)
    result = simulate(profile, schemes, steps, batch=args.batch, heads=getattr(args, "heads", heads), seed=args.seed,
                      device=args.device, every=every)
    print(result.summary().markdown())
    command = "qstate " + " ".join(shlex.quote(a) for a in args.argv)
    plot = _have_matplotlib()
    path = write_report(result, args.out, command, plot=plot)
    print(f"\nwrote {path} and drift.json" + (", drift.png" if plot else f"; {_PLOT_SKIPPED}") +
          f" ({result.elapsed_s:.1f} s simulated)")
    return 0


# (steps, heads, records) of a simulated drift run by layer family, when not given. A delta-rule
# record costs a pass over every scheme's state, several times a step's work: fewer of them.
_DRIFT_DEFAULTS = {"mamba2": (8192, 16, 512), "gated_delta": (4096, 8, 128)}


def _choose(args) -> int:
    from .analysis.choose import recommend

    rec = recommend(_profile(args), args.tolerance, steps=args.steps, objective=args.objective,
                    candidates=args.candidates, device=args.device, heads=args.heads, batch=args.batch,
                    seed=args.seed)
    print(rec)
    return 0 if rec.best is not None else 1


def _models(args) -> int:
    print("| model | nheads | headdim | dstate | ngroups | SSM layers |\n|---|---|---|---|---|---|")
    for name in profiles.names("mamba2"):
        p = profiles.get(name)
        print(f"| {name} | {p.nheads} | {p.headdim} | {p.dstate} | {p.ngroups} | {p.n_ssm_layers} |")
    print("\n| model | key heads | value heads | head_k_dim | head_v_dim | gate | delta-rule layers |\n"
          "|---|---|---|---|---|---|---|")
    for name in profiles.names("gated_delta"):
        p = profiles.get(name)
        print(f"| {name} | {p.num_k_heads} | {p.num_v_heads} | {p.head_k_dim} | {p.head_v_dim} | "
              f"{p.gate} ({p.gate_form}) | {p.n_layers} |")
    return 0


def _heads(text: str):
    """``16`` (that many heads spanning the decay range), ``all``, or ``0,5,9`` (indices)."""
    if text == "all":
        return None
    if "," in text:
        return [int(h) for h in text.split(",") if h.strip()]
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qstate", description="Numerics of quantized SSM and delta-rule decode "
                                     "state.")
    sub = parser.add_subparsers(dest="command", required=True)

    drift = sub.add_parser("drift", help="simulate storage schemes against the exact recurrence; write a report")
    _model_args(drift).add_argument(
        "--hf-model", metavar="PATH", help="local transformers Mamba2/NemotronH weights: drift of the logits "
        "(teacher-forced, each scheme against the unpatched model) instead of a simulation")
    drift.add_argument("--schemes", help="comma-separated scheme strings (default: the demo set of the model's "
                       "layer family)")
    # The simulation's options are absent unless given (SUPPRESS), so that --hf-model can refuse them.
    drift.add_argument("--steps", type=_count, default=argparse.SUPPRESS,
                       help="decode steps (default: 8192 Mamba-2, 4096 delta rule)")
    drift.add_argument("--batch", type=_count, default=2)
    drift.add_argument("--heads", type=_heads, default=argparse.SUPPRESS,
                       help="number of heads spanning the decay range, 'all', or comma-separated indices "
                       "(default: 16 Mamba-2, 8 delta rule)")
    drift.add_argument("--every", type=_count, default=argparse.SUPPRESS,
                       help="record every N steps (default: steps / 512 Mamba-2, steps / 128 delta rule)")
    drift.add_argument("--out", type=_folder, default="report",
                       help="output folder (report.md, drift.json, drift.png); one holding a report is refused")
    drift.add_argument("--force", action="store_true", help="overwrite a report already in --out")
    # The --hf-model options default to None so that one given without --hf-model is refused.
    drift.add_argument("--new-tokens", type=_count, default=None, help="--hf-model: decode steps (default: 64)")
    drift.add_argument("--prompt", help="--hf-model: prompt text, encoded by the model's tokenizer")
    drift.add_argument("--prompt-tokens", type=_count, default=None,
                       help="--hf-model without --prompt: length of the random prompt (default: 32)")
    drift.set_defaults(run=_drift)

    choose = sub.add_parser("choose", help="recommend the cheapest scheme within an error tolerance")
    _model_args(choose)
    choose.add_argument("--tolerance", type=float, required=True, help="largest p99 relative output error")
    choose.add_argument("--objective", choices=("traffic", "memory"), default="traffic")
    choose.add_argument("--steps", type=_count, default=4096)
    choose.add_argument("--batch", type=_count, default=1)
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
    if getattr(args, "threads", None) is not None:
        torch.set_num_threads(args.threads)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        parser.exit(2, f"qstate {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
