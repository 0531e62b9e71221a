"""GPU check of the transformers drop-in: ``model.generate()`` through qstate's real kernels.

Builds random-initialised Mamba2 and Nemotron-H models with published head shapes (docs/design.md#model-shapes,
fewer layers and a small vocabulary; no downloads), in fp32 and bf16, on the GPU. For each,
greedy ``generate()`` unpatched and patched with each scheme; reports whether qstate ran every
decode step of every layer, whether each replay cache flushed and holds the ring it should
after them, token agreement with the unpatched run, the largest relative logit difference,
and wall time (eager, not a benchmark). For the fp32 models it also runs the
teacher-forced :func:`qstate.analysis.model_drift`. Writes ``bench/results/gpu_model_check.json``.

Run on a GPU machine from the repository root (with transformers >= 5.0)::

    pip install --no-deps --no-build-isolation -e . && python3 bench/gpu_model_check.py

or, through the device tool, from a copy with ``kernels/`` placed as ``qstate.kernels``::

    export QSTATE_COMMIT=$(git rev-parse --short HEAD); S=/tmp/site; mkdir -p $S; cp -r qstate $S/;
    cp -r kernels $S/qstate/kernels; cp -r analysis $S/qstate/analysis;
    PYTHONPATH=$S python3 bench/gpu_model_check.py --out $OUT/gpu_model_check.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time

import torch

SCHEMES = ["fp32", "replay/fp32/16", "fp8_e4m3:row", "replay/fp32/fp8_e4m3:row/16", "bf16"]


def build(kind: str, dtype: torch.dtype, device: str):
    from qstate.integrations.hf_import import import_transformers

    transformers = import_transformers()
    torch.manual_seed(0)
    if kind == "mamba2":  # Mamba2-2.7B heads: 80 × 64 × 128, 1 group (here 16 heads)
        config = transformers.Mamba2Config(
            vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_heads=16, head_dim=64, state_size=128,
            n_groups=1, expand=2, chunk_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = transformers.Mamba2ForCausalLM(config)
    else:  # Nemotron-H-8B heads: 128 × 64 × 128, 8 groups (here 16 heads)
        config = transformers.NemotronHConfig(
            vocab_size=1024, hidden_size=512, layers_block_type=["mamba", "attention", "mamba", "mlp", "mamba"],
            num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1024,
            mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = transformers.NemotronHForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def generate(model, ids, tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="bench/results/gpu_model_check.json")
    args = parser.parse_args()

    from qstate.analysis import model_drift
    from qstate.integrations.hf_import import import_transformers
    from qstate.integrations.transformers import patch

    transformers = import_transformers()
    transformers.logging.set_verbosity_error()
    device = "cuda"
    rows, drifts, drift_measures = [], {}, None
    for kind in ("mamba2", "nemotron_h"):
        for dtype in (torch.float32, torch.bfloat16):
            model = build(kind, dtype, device)
            ids = torch.randint(3, 1024, (args.batch, 24), generator=torch.Generator().manual_seed(1)).to(device)
            reference, ref_time = generate(model, ids, args.tokens)
            ref_logits = torch.stack(reference.logits).double()
            for scheme in SCHEMES:
                with patch(model, scheme) as patched:
                    got, wall = generate(model, ids, args.tokens)
                    steps = sorted(set(patched.steps.values()))
                    caches = [c for c in patched.caches.values() if c is not None]
                    devices = sorted({str(c.device) for c in caches})
                    flushes = sorted({int(g) for c in caches for g in c.generation.tolist()})
                    cursors = sorted({int(k) for c in caches for k in c.cursor.tolist()})
                    ring_len = patched.scheme.ring_len if patched.scheme.is_replay else None
                logits = torch.stack(got.logits).double()
                new = slice(ids.shape[1], None)
                row = {
                    "model": kind, "dtype": str(dtype).replace("torch.", ""), "scheme": scheme,
                    "qstate_steps_per_layer": steps, "expected_steps": args.tokens - 1,
                    "replay_cache_devices": devices,
                    # a replay route that took transformers' state for an outside write at every
                    # token would reset its ring each step: no flushes, cursor 1
                    "replay_flushes": flushes, "replay_cursors": cursors,
                    "expected_flushes_cursor": None if ring_len is None else list(divmod(args.tokens - 1, ring_len)),
                    "finite": bool(torch.isfinite(logits).all()),
                    "token_agreement": float((got.sequences[:, new] == reference.sequences[:, new]).double().mean()),
                    "max_rel_logit_diff": float((logits - ref_logits).abs().max() / ref_logits.abs().max()),
                    "seconds": round(wall, 3), "unpatched_seconds": round(ref_time, 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            if dtype == torch.float32:
                drift = model_drift(model, ids, SCHEMES, args.tokens)
                drifts[kind] = drift.summary()
                drift_measures = drift.measures()
                print(f"\nmodel_drift {kind} fp32, {args.tokens} tokens, batch {args.batch}\n{drift}\n", flush=True)
            del model
            torch.cuda.empty_cache()

    commit = os.environ.get("QSTATE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    payload = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "commit": commit or None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "command": "python3 bench/gpu_model_check.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
        "rows": rows, "model_drift": drifts, "model_drift_measures": drift_measures,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=1)
    failures = [r for r in rows if r["qstate_steps_per_layer"] != [r["expected_steps"]] or not r["finite"]
                or (r["expected_flushes_cursor"] is not None
                    and [r["replay_flushes"], r["replay_cursors"]] != [[n] for n in r["expected_flushes_cursor"]])
                or (r["scheme"] in ("fp32", "replay/fp32/16") and r["dtype"] == "float32" and r["token_agreement"] < 1)]
    print(f"{len(rows)} runs, {len(failures)} failures", flush=True)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
