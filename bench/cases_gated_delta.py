"""Gated delta rule decode on the GPU (GDN and KDA), in the shared harness
(``python3 -m bench.run_gpu --groups gated_delta``): checks of both ops against the fp64
references, then timing with the peer (fla's decode kernels, fp32 state) in the same run.

Cases (bf16 inputs, group ``gated_delta``), per layer of :data:`LAYERS`:

* ``gdn/<layer>/b<batch>/conventional/<format>``: one ``gated_delta_update`` step; bytes: the
  state (and scales) read and written, plus the inputs and output.
* ``gdn/<layer>/b<batch>/replay/<checkpoint>+<read>/L16``: one timed call runs a whole flush
  cycle (16 steps); µs and bytes per step, bytes from ``GatedDeltaReplayCache.bytes_per_step``
  plus the inputs and output. ``/staggered``: cursors spread over the ring, so every step
  flushes 1/16 of the rows.
* ``gdn/<layer>/b<batch>/fla``: fla's ``fused_recurrent_gated_delta_rule`` (``fused_recurrent_kda``
  for KDA) on an fp32 state of the same size, one token (skipped, with a printed note, where fla
  does not import). Its state is ``(batch, HV, K, V)``; q and k are given per value head.

``annotate`` adds each case's speed-up over the conventional fp32 step of its layer and batch.
"""

from __future__ import annotations

import contextlib

import torch

import qstate
from qstate import formats
from qstate.kernels.common import codec
from qstate.reference import gated_delta as reference

from .harness import Case, graph_matches_eager, register

# (HK, HV, K, V, gate) of the layers timed (docs/design.md#gdn-shapes).
LAYERS = {
    "qwen3.5-122b-a10b": (16, 64, 128, 128, "scalar"),
    "qwen3.5-9b": (16, 32, 128, 128, "scalar"),
    "kimi-linear-48b-a3b": (32, 32, 128, 128, "channel"),
}
MAIN = "qwen3.5-122b-a10b"
BATCHES = (1, 16, 64, 256)
CONVENTIONAL_FORMATS = ("fp32", "bf16", "int8:row", "fp8_e4m3:row")
REPLAY_FORMATS = (("fp32", None), ("fp32", "fp8_e4m3:row"))
RING_LEN = 16


def token(batch, HK, HV, K, V, gate, *, device, dtype=torch.bfloat16, T=None, seed=0):
    """Decode inputs with realistic ranges: gates in [-1, 0), β in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    lead = () if T is None else (T,)
    gate_shape = lead + (batch, HV) + ((K,) if gate == "channel" else ())
    return dict(q=torch.randn(*lead, batch, HK, K, generator=g).to(device, dtype),
                k=torch.randn(*lead, batch, HK, K, generator=g).to(device, dtype),
                v=torch.randn(*lead, batch, HV, V, generator=g).to(device, dtype),
                g=(-torch.rand(*gate_shape, generator=g)).to(device),
                beta=torch.sigmoid(torch.randn(*lead, batch, HV, generator=g)).to(device))


def io_bytes(batch, HK, HV, K, V, gate, elem=2):
    """q, k, v and the output in ``elem`` bytes; g and β in fp32."""
    return batch * ((2 * HK * K + 2 * HV * V) * elem + HV * (K if gate == "channel" else 1) * 4 + HV * 4)


# ---------------------------------------------------------------------------- correctness


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


CHECK_LAYER = (2, 8, 128, 96)  # HK, HV, K, V: HV/HK 4, V not a power of two
# The launchers whose constants the check variants and the sweep set.
_CONV = "qstate.kernels.gated_delta.conventional"
_REPLAY = "qstate.kernels.gated_delta.replay"
CHECK_FORMATS = ("fp32", "bf16", "fp16", "int8:row", "fp8_e4m3:row", "fp8_e5m2:row", "int8:head",
                 "fp8_e4m3:block32", "bf16+sr", "int8:row+sr")
CHECK_REPLAY = (("fp32", None), ("fp32", "fp8_e4m3:row"), ("fp32", "int8:row"), ("fp32", "fp8_e5m2:row"),
                ("bf16", "fp8_e4m3:row"), ("fp16", "bf16"))


def check_conventional(device, batch=3, steps=4):
    """``gated_delta_update`` against ``decode_naive`` (same format) and ``decode_exact``, GDN
    and KDA, fp32 inputs. The GPU's ``exp`` is approximate, it contracts products into FMAs and
    sums over K in another order, so a code may flip where the reference's value lies within an
    ulp of a rounding boundary, and a flipped code moves later outputs by up to a grid step.
    Fails when outputs are not finite, when more than 0.1 % of the final codes differ from
    ``quantize`` of decode_naive's final fp32 state (round-to-nearest 8/16-bit formats), or when
    the outputs' error against fp64 exceeds 1.5× decode_naive's own plus 1e-5 (fp32 sums over
    K = 128: ``steps · K · 2**-24`` ≈ 3e-5 per element at worst, 1e-5 in RMS)."""
    failures, report = [], []
    HK, HV, K, V = CHECK_LAYER
    for gate in ("scalar", "channel"):
        inp = token(batch, HK, HV, K, V, gate, device=device, dtype=torch.float32, T=steps, seed=1)
        state0 = torch.randn(batch, HV, V, K, generator=torch.Generator().manual_seed(2)).to(device)
        cpu = {n: t.cpu() for n, t in inp.items()}
        y_exact = reference.decode_exact(state0.cpu(), **cpu)[0]
        for text in CHECK_FORMATS:
            fmt = formats.StateFormat.parse(text)
            q = formats.quantize(state0, fmt)
            state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
            ys = []
            for t in range(steps):
                ys.append(qstate.gated_delta_update(state, *(inp[n][t] for n in ("q", "k", "v", "g", "beta")),
                                                    state_scale=scale, state_format=text, seed=t).cpu())
            y = torch.stack(ys)
            y_ref, S_ref = reference.decode_naive(formats.dequantize(q).cpu(), **cpu, fmt=fmt, seed=0)
            differing = 0.0
            if fmt.dtype != "fp32" and not fmt.stochastic:
                differing = float((_bits(state.cpu()) != _bits(formats.quantize(S_ref, fmt).data)).double().mean())
            err, err_ref = _rel(y, y_exact), _rel(y_ref, y_exact)
            ok = bool(torch.isfinite(y).all()) and differing < 1e-3 and err <= 1.5 * err_ref + 1e-5
            report.append(dict(check=f"conventional {gate} {text}", codes_differing=differing, err_vs_fp64=err,
                               naive_err_vs_fp64=err_ref, ok=ok))
            if not ok:
                failures.append(f"gated_delta conventional {gate} {text}: differing {differing:.2e} err {err:.2e} "
                                f"vs naive {err_ref:.2e}")
    return failures, report


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_replay(device, batch=4, L=4, steps=10):
    """``gated_delta_replay`` against ``decode_replay(ring="inputs")``, GDN and KDA, bf16
    inputs, staggered cursors (slot ``s`` starts ``s`` tokens into its ring, by steps of that
    slot alone). Fails when outputs are not finite; when the read copy's codes or scales differ
    from ``quantize`` of the stored checkpoint (on the CPU); when an fp32 checkpoint is off the
    reference's by more than 1e-5 relative RMS (each fold is ``L`` fp32 updates with sums over
    K = 128: ≲ ``L · K · 2**-24`` ≈ 3e-5 per element at worst), another checkpoint by more
    than one of its grid steps (2**-8); or when outputs are off by more than 4e-3 plus twice the
    read copy's own error (the reference's outputs against ``decode_exact``): bf16 outputs round
    once (2**-9), and a read code that the fp32 fold moved across a boundary moves outputs by up
    to a grid step."""
    failures, report = [], []
    HK, HV, K, V = CHECK_LAYER
    for gate in ("scalar", "channel"):
        for ck, rd in CHECK_REPLAY:
            name = f"replay {gate} {ck}+{rd or 'none'}"
            inp = token(batch, HK, HV, K, V, gate, device=device, T=steps, seed=3)
            state0 = torch.randn(batch, HV, V, K, generator=torch.Generator().manual_seed(4))
            cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=L, checkpoint=ck,
                                                          read=rd, device=device)
            cache.reset(range(batch), state0)
            names = ("q", "k", "v", "g", "beta")
            ys = [[] for _ in range(batch)]
            # Stagger: slot s runs its first s tokens alone, then every slot steps together.
            for s in range(batch):
                for t in range(s % L):
                    ys[s].append(qstate.gated_delta_replay(
                        cache, *(inp[n][t, s:s + 1] for n in names),
                        slot_indices=torch.tensor([s], device=device, dtype=torch.int32))[0].cpu())
            for t in range(steps):
                rows = [s for s in range(batch) if t + s % L < steps]
                if not rows:
                    break
                index = torch.tensor(rows, device=device)
                step_inp = [torch.stack([inp[n][t + s % L, s] for s in rows]) for n in names]
                out = qstate.gated_delta_replay(cache, *step_inp,
                                                slot_indices=index.to(torch.int32)).cpu()
                for i, s in enumerate(rows):
                    ys[s].append(out[i])
            cpu = {n: t.cpu() for n, t in inp.items()}
            problems, row = [], dict(check=name)
            y_errs, ck_errs = [], []
            for s in range(batch):
                y = torch.stack(ys[s]).float()
                one = {n: t[:len(ys[s]), s:s + 1] for n, t in cpu.items()}
                y_ref, _, ck_ref = reference.decode_replay(state0[s:s + 1], **one, checkpoint=ck, read=rd, ring_len=L,
                                                           return_checkpoint=True)
                y_exact = reference.decode_exact(state0[s:s + 1], **one)[0]
                tol = 4e-3 + 2 * _rel(y_ref, y_exact) if rd is not None else 4e-3
                y_errs.append(_rel(y, y_ref[:, 0]))
                ck_errs.append(_rel(cache.checkpoint_values(s).cpu(), ck_ref))
                if not bool(torch.isfinite(y).all()) or y_errs[-1] > tol:
                    problems.append(f"slot {s} y rel {y_errs[-1]:.2e} (tol {tol:.2e})")
                if ck_errs[-1] > (1e-5 if ck == "fp32" else 2.0**-8):
                    problems.append(f"slot {s} checkpoint rel {ck_errs[-1]:.2e}")
            if rd is not None:
                want = formats.quantize(cache.checkpoint_values(range(batch)).cpu(), rd)
                mismatches = int((_bits(cache.read.cpu()) != _bits(want.data)).sum())
                if want.scale is not None:
                    mismatches += int((cache.read_scale.cpu() != want.scale).sum())
                row["read_mismatches"] = mismatches
                if mismatches:
                    problems.append(f"{mismatches} read codes/scales differ")
            row.update(y_rel_max=max(y_errs), checkpoint_rel_max=max(ck_errs), ok=not problems)
            report.append(row)
            failures += [f"gated_delta {name}: {p}" for p in problems]
    return failures, report


def check_graph(device, batch=64, steps=20):
    """Replay and conventional steps captured in a CUDA graph against the same steps run
    eagerly, bit for bit (staggered cursors: every step flushes some rows)."""
    failures = []
    HK, HV, K, V, gate = LAYERS[MAIN]
    for read in (None, "fp8_e4m3:row"):
        def make(read=read):
            cache, inp, _ = _replay_buffers(batch, MAIN, "fp32", read, device, staggered=True)
            outs = torch.full((steps, batch, HV, V), float("nan"), device=device, dtype=torch.bfloat16)
            state = torch.randn(batch, HV, V, K, device=device, generator=torch.Generator(device).manual_seed(0))
            return cache, inp, outs, state

        def run(buffers):
            cache, inp, outs, state = buffers
            for i in range(steps):
                qstate.gated_delta_replay(cache, **inp, out=outs[i])
                qstate.gated_delta_update(state, **inp)

        def tensors(buffers):
            cache, _, outs, state = buffers
            return dict({k: v for k, v in cache.tensors().items() if v is not None}, outputs=outs, state=state)

        failures += graph_matches_eager(f"gated_delta graph fp32+{read or 'none'}", make, run, tensors)
    return failures


def check_kernel(device):
    """Every check of this module; (failures, report rows)."""
    f1, r1 = check_conventional(device)
    f2, r2 = check_variant(check_conventional, device, _CONV, "references' order", FUSED_ON_GPU=False)
    f3, r3 = check_replay(device)
    f4, r4 = check_variant(check_replay, device, _REPLAY, "chunked", MIN_PROGRAMS=0)
    f5, r5 = check_variant(check_conventional, device, _CONV, "tiles in a loop", V_LOOP=4, MIN_PROGRAMS=0)
    f6, r6 = check_variant(check_replay, device, _REPLAY, "inverse row in a loop", INVERSE_IN_SWEEP=False)
    return f1 + f2 + f3 + f4 + f5 + f6 + check_graph(device), r1 + r2 + r3 + r4 + r5 + r6


@contextlib.contextmanager
def launcher_constants(module_name, **constants):
    """A launcher module's constants set for a block (a dict constant updated, not replaced), the
    launch plans rebuilt on both sides of it."""
    import importlib

    from qstate.kernels import clear_launch_plans

    launcher = importlib.import_module(module_name)
    saved = {name: getattr(launcher, name) for name in constants}
    for name, value in constants.items():
        setattr(launcher, name, {**saved[name], **value} if isinstance(value, dict) else value)
    clear_launch_plans()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(launcher, name, value)
        clear_launch_plans()


def check_variant(check, device, module_name, tag, **constants):
    """``check(device)`` with launcher constants set, for code its default plans do not reach: the
    conventional kernel's references' order (``FUSED_ON_GPU=False``) and its tiles in a loop
    (``V_LOOP=4, MIN_PROGRAMS=0``: q̂, k̂ and the gates reused across them); the replay launcher's
    ``MIN_PROGRAMS=0`` (``V_LOOP`` chunks per program, the sweep's result reused across them),
    which its small grids never reach, and the KDA step kernel's row of ``(I + B)⁻¹`` from a
    loop (``INVERSE_IN_SWEEP=False``)."""
    with launcher_constants(module_name, **constants):
        failures, report = check(device)
    return [f"{f} [{tag}]" for f in failures], [dict(r, check=f"{r['check']} [{tag}]") for r in report]


# ---------------------------------------------------------------------------- timing


def _conventional_buffers(batch, layer, text, device):
    HK, HV, K, V, gate = LAYERS[layer]
    fmt = formats.StateFormat.parse(text)
    q = formats.quantize(torch.randn(batch, HV, V, K, device=device), fmt)
    return dict(state=q.data, state_scale=q.scale, **token(batch, HK, HV, K, V, gate, device=device),
                out=torch.empty(batch, HV, V, device=device, dtype=torch.bfloat16))


def conventional_case(batch, layer, text, device):
    HK, HV, K, V, gate = LAYERS[layer]
    fmt = formats.StateFormat.parse(text)
    state_bytes = HV * V * K * fmt.bytes_per_element(K, V)
    moved = int(2 * batch * state_bytes + io_bytes(batch, HK, HV, K, V, gate))

    def run(b):
        qstate.gated_delta_update(b["state"], b["q"], b["k"], b["v"], b["g"], b["beta"], state_scale=b["state_scale"],
                                  state_format=text, out=b["out"], seed=1)

    return Case("gated_delta", f"gdn/{layer}/b{batch}/conventional/{text}",
                dict(model=layer, batch=batch, format=text, op="conventional", inputs="bf16"),
                moved, lambda: _conventional_buffers(batch, layer, text, device), run)


def _replay_buffers(batch, layer, checkpoint, read, device, staggered):
    HK, HV, K, V, gate = LAYERS[layer]
    cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=RING_LEN,
                                                  checkpoint=checkpoint, read=read, device=device)
    if staggered:
        cache.cursor.copy_(torch.arange(batch, device=device, dtype=torch.int32) % RING_LEN)
    out = torch.empty(batch, HV, V, device=device, dtype=torch.bfloat16)
    return cache, token(batch, HK, HV, K, V, gate, device=device), out


def replay_case(batch, layer, checkpoint, read, device, staggered=False):
    HK, HV, K, V, gate = LAYERS[layer]
    probe = qstate.GatedDeltaReplayCache.allocate(1, HK, HV, K, V, gate=gate, ring_len=RING_LEN,
                                                  checkpoint=checkpoint, read=read, device="meta")
    moved = int(probe.bytes_per_step() * batch + io_bytes(batch, HK, HV, K, V, gate))

    def run(buffers):
        cache, inp, out = buffers
        for _ in range(RING_LEN):
            qstate.gated_delta_replay(cache, **inp, out=out)

    label = f"{checkpoint}+{read or 'none'}/L{RING_LEN}" + ("/staggered" if staggered else "")
    return Case("gated_delta", f"gdn/{layer}/b{batch}/replay/{label}",
                dict(model=layer, batch=batch, format=f"replay {checkpoint} + {read or 'no read'}, L{RING_LEN}",
                     op="replay", inputs=f"bf16, flush cycles{', staggered' if staggered else ''}"),
                moved, lambda: _replay_buffers(batch, layer, checkpoint, read, device, staggered), run,
                set_bytes=int(probe.nbytes * batch), steps_per_call=RING_LEN)


def _fla():
    """fla's decode kernels, or None (with a printed note) where fla does not import."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.kda import fused_recurrent_kda
    except Exception as err:  # any failure to import leaves the peer out, not the run
        print(f"cases_gated_delta: fla not importable ({type(err).__name__}: {err}); peer cases skipped", flush=True)
        return None
    return dict(scalar=fused_recurrent_gated_delta_rule, channel=fused_recurrent_kda)


def fla_case(batch, layer, kernels, device):
    """fla's kernel on an fp32 ``(batch, HV, K, V)`` state, one token, q and k per value head."""
    HK, HV, K, V, gate = LAYERS[layer]
    moved = int(2 * batch * HV * K * V * 4 + io_bytes(batch, HV, HV, K, V, gate))

    def make():
        inp = token(batch, HK, HV, K, V, gate, device=device)
        group = HV // HK
        return dict(q=inp["q"].repeat_interleave(group, 1)[:, None], k=inp["k"].repeat_interleave(group, 1)[:, None],
                    v=inp["v"][:, None], g=inp["g"][:, None], beta=inp["beta"][:, None],
                    state=torch.zeros(batch, HV, K, V, device=device))

    def run(b):
        kernels[gate](b["q"], b["k"], b["v"], b["g"], b["beta"], initial_state=b["state"], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)

    return Case("gated_delta", f"gdn/{layer}/b{batch}/fla", dict(model=layer, batch=batch, format="fla fp32",
                                                                 op="fla", inputs="bf16"), moved, make, run, peer=True)


@register("gated_delta")
def timing_cases(device):
    out = []
    for batch in BATCHES:
        out += [conventional_case(batch, MAIN, text, device) for text in CONVENTIONAL_FORMATS]
        out += [replay_case(batch, MAIN, ck, rd, device) for ck, rd in REPLAY_FORMATS]
    for layer in LAYERS:
        out += [replay_case(256, layer, ck, rd, device, staggered=True) for ck, rd in REPLAY_FORMATS]
        if layer != MAIN:
            out += [conventional_case(256, layer, text, device) for text in ("fp32", "fp8_e4m3:row")]
    if device.type == "cuda":
        kernels = _fla()
        if kernels is not None:
            out += [fla_case(batch, MAIN, kernels, device) for batch in BATCHES]
            out += [fla_case(256, layer, kernels, device) for layer in LAYERS if layer != MAIN]
    return out


# Tuning alternatives timed by ``sweep_cases``: tag → {module constant: value}, applied around
# each call (the first of each list is the default).
_ROWS = "TILE_ROWS_BY_DTYPE"
_LOOPS = {f"loop{n}": {"V_LOOP": n} for n in (2, 4, 8)}
CONVENTIONAL_SWEEP = {
    "fp32": {"default": {}, "16x4w": {_ROWS: {codec.FP32: (16, 4)}}, "8x1w": {_ROWS: {codec.FP32: (8, 1)}},
             "32x2w": {_ROWS: {codec.FP32: (32, 2)}}, **_LOOPS},
    "bf16": {"default": {}, "32x4w": {_ROWS: {codec.BF16: (32, 4)}}, "32x2w": {_ROWS: {codec.BF16: (32, 2)}}, **_LOOPS},
    "int8:row": {"default": {}, "32x2w": {_ROWS: {codec.INT8: (32, 2)}}, "32x4w": {_ROWS: {codec.INT8: (32, 4)}},
                 "32x1w": {_ROWS: {codec.INT8: (32, 1)}}, "references-order": {"FUSED_ON_GPU": False}, **_LOOPS,
                 "loop8-cap128": {"V_LOOP": 8, "REGISTER_CAP": 128}},
    "fp8_e4m3:row": {"default": {}, "32x2w": {_ROWS: {codec.FP8_E4M3: (32, 2)}},
                     "32x4w": {_ROWS: {codec.FP8_E4M3: (32, 4)}}, "references-order": {"FUSED_ON_GPU": False},
                     **_LOOPS},
}
REPLAY_SWEEP = {
    "default": {},
    "prefetch": {"PREFETCH": True},
    "flush-ieee": {"FOLD_PRECISION": "ieee"},
    "flush-64x4w": {"FLUSH_ROWS": 64, "FLUSH_WARPS": 4},
    "flush-128x4w": {"FLUSH_WARPS": 4},
}


def with_constants(module_name, constants, run):
    """``run`` with ``module_name``'s constants set for the call (:func:`launcher_constants`)."""

    def tuned(buffers):
        with launcher_constants(module_name, **constants):
            run(buffers)

    return tuned


def _retagged(case, tag, module_name, constants):
    case.group = "sweep-gated_delta"
    case.name = f"{case.name}/{tag}"
    case.params = dict(case.params, variant=tag, format=f"{case.params['format']} [{tag}]")
    case.run = with_constants(module_name, constants, case.run)
    return case


def sweep_cases(device):
    """Tiles and code shapes of both ops against their defaults (``bench.run_gpu --sweep
    gated_delta``): the main layer at batch 256 (staggered replay cursors) and 16; 43 cases."""
    out = []
    for text, table in CONVENTIONAL_SWEEP.items():
        for tag, constants in table.items():
            out.append(_retagged(conventional_case(256, MAIN, text, device), tag, _CONV, constants))
    for tag in ("default", "16x4w"):
        out.append(_retagged(conventional_case(16, MAIN, "fp32", device), tag, _CONV, CONVENTIONAL_SWEEP["fp32"][tag]))
    for ck, rd in REPLAY_FORMATS:
        for tag, constants in REPLAY_SWEEP.items():
            out.append(_retagged(replay_case(256, MAIN, ck, rd, device, staggered=True), tag, _REPLAY, constants))
    for tag in ("default", "prefetch"):
        out.append(_retagged(replay_case(16, MAIN, "fp32", "fp8_e4m3:row", device), tag, _REPLAY, REPLAY_SWEEP[tag]))
    return out


def annotate(by_group):
    """Speed-up of each case over the conventional fp32 step of its layer and batch, same run."""
    rows = by_group.get("gated_delta", [])
    base = {(r["params"]["model"], r["params"]["batch"]): r["us"] for r in rows
            if r["params"].get("op") == "conventional" and r["params"].get("format") == "fp32"}
    for r in rows:
        ref = base.get((r["params"]["model"], r["params"]["batch"]))
        if ref is not None:
            r["x_conventional_fp32"] = ref / r["us"]
            print(f"{r['name']:60s} {r['us']:8.1f} us  {r['x_conventional_fp32']:5.2f}x conventional fp32", flush=True)
