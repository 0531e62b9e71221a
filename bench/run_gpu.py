"""GPU entry point: correctness first (codec and kernels against the references, on the GPU),
then timing under CUDA-graph replay with a cold L2. See bench/README.md for how to run it.

    python3 -m bench.run_gpu --out DIR [--groups conventional,replay] [--only NAMES] [--sweep [MODULE]]
                             [--checks MODULES | --skip-checks]

Writes ``DIR/<group>.json`` (``--out`` defaults to bench/results/) and prints the markdown
table; ``python3 -m bench.harness DIR/<group>.json`` writes that table into bench/TABLES.md.
While the cases run, each timed row is also in ``DIR/<group>.partial.json`` (``"complete":
false``), so a run killed part way keeps what it timed; a finished run removes those files.
Case modules register themselves on import: add yours to ``CASE_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time

import torch

from . import harness

CASE_MODULES = ("bench.cases_conventional", "bench.cases_replay", "bench.cases_speculative", "bench.cases_exact_dot",
                "bench.cases_isolation", "bench.cases_gated_delta", "bench.cases_gated_delta_speculative")
# Only functions named check_codec / check_kernel / sweep_cases / eager_overhead / annotate and
# cases registered with harness.register are used from each module.


def _load_case_modules():
    """``(modules, failures)``: a module that does not import is a failure of the run (its
    checks did not run), reported after the others ran."""
    loaded, failures = [], []
    for name in CASE_MODULES:
        try:
            loaded.append(importlib.import_module(name))
        except Exception as err:  # one broken case module must not stop the others' run
            failures.append(f"{name} did not import: {type(err).__name__}: {err}")
            print(f"run_gpu: FAIL {failures[-1]}", flush=True)
    return loaded, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--groups", default=None, help="comma-separated case groups (default: all)")
    parser.add_argument("--sweep", nargs="?", const="", default=None,
                        help="also time tile sweeps where a module offers one (optionally only modules whose "
                             "name contains this, e.g. --sweep replay)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--checks", default=None,
                        help="run the checks of only the case modules whose name contains one of these "
                             "(comma-separated, e.g. gated_delta); default: every module's")
    parser.add_argument("--only", default=None, help="time only cases whose name contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    try:  # before any long work: an unwritable --out would lose every result at the end
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, ".run_gpu-write-probe")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        print(f"run_gpu: --out: expected a writable directory, got {args.out!r} ({err})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("run_gpu: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    command = "python3 -m bench.run_gpu " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    modules, import_failures = _load_case_modules()
    checked = [m for m in modules if args.checks is None
               or any(part in m.__name__ for part in args.checks.split(","))]
    if args.checks is not None and not checked:
        print(f"run_gpu: --checks: expected a part of a case module's name ({', '.join(CASE_MODULES)}), got "
              f"{args.checks!r}", file=sys.stderr)
        return 2
    groups = args.groups.split(",") if args.groups else None
    env = harness.environment()
    print(env, flush=True)

    failures, checks = list(import_failures), {}
    if not args.skip_checks:
        for module in checked:
            for fn_name in ("check_codec", "check_kernel"):
                fn = getattr(module, fn_name, None)
                if fn is None:
                    continue
                t0 = time.time()
                try:
                    result = fn(device)
                except Exception as err:  # a crashing check is a failure, not the end of the run
                    result = [f"{module.__name__}.{fn_name} raised {type(err).__name__}: {err}"]
                fails, report = result if isinstance(result, tuple) else (result, None)
                failures += fails
                checks[f"{module.__name__}.{fn_name}"] = dict(failures=fails, report=report)
                print(f"{module.__name__}.{fn_name}: {len(fails)} failures ({time.time() - t0:.0f} s)", flush=True)
                for f in fails:
                    print("  FAIL", f, flush=True)
                for row in report or []:
                    print("  ", row, flush=True)

    ceiling = harness.copy_ceiling_gbs(device)
    read_ceiling = harness.read_ceiling_gbs(device)
    print(f"copy ceiling {ceiling:.0f} GB/s, reading alone {read_ceiling:.0f} GB/s", flush=True)
    all_cases = harness.cases(device, groups)
    if args.only:
        all_cases = [c for c in all_cases if any(part in c.name for part in args.only.split(","))]
    if args.sweep is not None:
        for module in modules:
            if hasattr(module, "sweep_cases") and args.sweep in module.__name__:
                all_cases = module.sweep_cases(device) + all_cases
    all_cases.sort(key=lambda case: case.peer)  # stable: peers last, each list's order kept
    by_group: dict[str, list] = {}
    for case in all_cases:
        try:
            us = harness.time_case(case)
        except Exception as err:  # e.g. a tile that does not compile: record it, time the rest
            failures.append(f"{case.name}: {type(err).__name__}: {err}")
            print(f"{case.name:55s} FAILED {type(err).__name__}: {err}", flush=True)
            continue
        gbs = case.bytes_moved / (us * 1e-6) / 1e9
        row = dict(group=case.group, name=case.name, params=case.params, us=us, bytes=case.bytes_moved, gbs=gbs,
                   pct_copy=100 * gbs / ceiling)
        by_group.setdefault(case.group, []).append(row)
        harness.write_json(_partial_path(args.out, case.group),
                           dict(_payload(case.group, env, command, ceiling, read_ceiling, by_group[case.group], checks,
                                         {}, failures), complete=False))
        print(f"{case.name:55s} {case.params.get('block_p', '')!s:>3} {case.params.get('num_warps', '')!s:>2} "
              f"{us:9.1f} us {gbs:7.0f} GB/s {row['pct_copy']:5.1f} %", flush=True)
    # The clocks may still have been ramping at the first measurement: take the better of two.
    try:
        ceiling_after = harness.copy_ceiling_gbs(device)
    except Exception as err:  # a case that broke the CUDA context must not lose the rows timed before it
        failures.append(f"copy ceiling after the cases: {type(err).__name__}: {err}")
        ceiling_after = 0.0
    print(f"copy ceiling after the cases {ceiling_after:.0f} GB/s", flush=True)
    if ceiling_after > ceiling:
        for rows in by_group.values():
            for row in rows:
                row["pct_copy"] = 100 * row["gbs"] / ceiling_after
        ceiling = ceiling_after
    for module in modules:
        if hasattr(module, "annotate"):
            module.annotate(by_group)
    extras = {}
    for module in modules:
        if hasattr(module, "eager_overhead"):
            try:
                extras[module.__name__] = module.eager_overhead(device)
            except Exception as err:  # the timed cases above are written out whatever happens here
                failures.append(f"{module.__name__}.eager_overhead raised {type(err).__name__}: {err}")
                continue
            print("eager", module.__name__, extras[module.__name__], flush=True)

    for group, rows in by_group.items():
        payload = _payload(group, env, command, ceiling, read_ceiling, rows, checks, extras, failures)
        harness.write_json(os.path.join(args.out, f"{group}.json"), payload)
        os.remove(_partial_path(args.out, group))
        print(harness.markdown_table(payload), flush=True)
    return 1 if failures else 0


def _partial_path(out: str, group: str) -> str:
    return os.path.join(out, f"{group}.partial.json")


def _payload(group, env, command, ceiling, read_ceiling, rows, checks, eager, failures) -> dict:
    """What ``<group>.json`` holds (``bench.harness.markdown_table`` reads it)."""
    return dict(key=group, environment=env, command=command, copy_ceiling_gbs=ceiling, read_ceiling_gbs=read_ceiling,
                results=rows, checks=checks, eager=eager, failures=failures)


if __name__ == "__main__":
    sys.exit(main())
