"""Replay decode on the GPU, in the shared harness (``python3 -m bench.run_gpu``): a
check of every step kernel against the fp64 reference, then timing in the same run as the
conventional kernel, with the ratio to its fp32 case at the same batch (``annotate``).

Headline: staggered cursors, then aligned, at batches 1, 16, 64 and 256, fp32
checkpoint with and without the fp8 read copy, for what ``replay_decode`` runs (``/default``)
and the single-launch step kernel (``/fused``), with the conventional fp32 kernel timed in the
same group as the yardstick (``replay/b{batch}/conventional-fp32``); ``annotate`` reports each
case's ratio to it and checks ``TARGETS``. Further cases (Nemotron-H-8B layer, bf16 inputs)
for the per-head and the grouped step kernel (name suffix ``/per-head`` or ``/grouped-h8``) and
the ``/no-agree`` variant (lanes not made to agree; what ``agree`` costs):

* ``replay/b{batch}/{checkpoint}+{read}/L{L}/...``: one timed call runs a whole flush cycle
  (``L`` steps, so exactly one flush per slot); µs and bytes are per step, bytes from
  ``ReplayCache.bytes_per_step`` (ring included) plus the decode inputs and output.
  ``/staggered``: cursors spread over the ring, so every step flushes 1/L of the rows.
* ``.../normal-step`` and ``.../flush-step``: one step with every row normal (cursor 0) or every
  row flushing (cursor L − 1); the call includes the 1 KB cursor fill that sets this up (~2 µs).

``sweep_cases`` (``--sweep replay``): the grouped kernel's normal step at batch 256 over heads
per program, warps and head-loop pipeline stages, and the small-batch tiles.
"""

from __future__ import annotations

import torch

from qstate import reference
from qstate._cache_slots import slot_state_bytes
from qstate.cache import ReplayCache
from qstate.formats import dequantize, quantize
from qstate.kernels.mamba2.replay import launch_replay_decode

from . import harness

LAYER = dict(nheads=128, headdim=64, dstate=128, ngroups=8)  # Nemotron-H-8B
MODEL = "nemotron-h-8b"
STEP_KERNELS = {"per-head": dict(heads_per_program=0), "grouped-h8": dict(heads_per_program=8),
                "default": dict(heads_per_program=None)}
_CACHE_FIELDS = ("checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B", "cursor",
                 "generation", "flush_rows", "flush_counters", "slot_flags")


def inputs(batch, nheads, headdim, dstate, ngroups, *, device, dtype=torch.bfloat16, T=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if T is None else (T,)
    return dict(
        x=torch.randn(*lead, batch, nheads, headdim, generator=g).to(device, dtype),
        dt=(0.5 * torch.randn(*lead, batch, nheads, generator=g)).to(device, dtype),
        A=(-(0.5 + 3.5 * torch.rand(nheads, generator=g))).to(device),
        B=torch.randn(*lead, batch, ngroups, dstate, generator=g).to(device, dtype),
        C=torch.randn(*lead, batch, ngroups, dstate, generator=g).to(device, dtype),
        D=torch.randn(nheads, generator=g).to(device),
        z=torch.randn(*lead, batch, nheads, headdim, generator=g).to(device, dtype),
        dt_bias=(-2.0 + 0.5 * torch.randn(nheads, generator=g)).to(device),
    )


def io_bytes(batch, nheads, headdim, dstate, ngroups, elem=2):
    """Decode inputs and output of one step: x, z, y, B, C, dt."""
    return batch * (3 * nheads * headdim * elem + 2 * ngroups * dstate * elem + nheads * elem)


def step(cache, inp, out, **kernel):
    """One decode step through the launcher (the custom op's body, minus validation) with an
    explicit step kernel: ``kernel`` = launch_replay_decode's heads_per_program / step_* args."""
    t = cache.tensors()
    launch_replay_decode(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"], True,
                         None, out, *(t[k] for k in _CACHE_FIELDS), checkpoint_format=cache.checkpoint_format,
                         read_format=cache.read_format, seed=cache.seed, **kernel)


# ---------------------------------------------------------------------------- correctness

CHECK_SHAPE = dict(nheads=32, headdim=64, dstate=128, ngroups=2)  # 16 heads per group, as the layer
CHECK_COMBOS = [(torch.float32, ck, rd) for ck, rd in (
    ("fp32", None), ("fp32", "fp8_e4m3:row"), ("bf16", "fp8_e4m3:row"), ("fp32", "int8:row"), ("fp32", "fp8_e5m2:row"),
    ("fp32", "int8:head"), ("fp32", "fp8_e4m3:block32"), ("fp16", "bf16"), ("int8:row", "fp16"),
    ("fp8_e4m3:row", None), ("bf16+sr", None), ("bf16+sr", "fp8_e4m3:row"), ("fp16+sr", "int8:row"))] + [
    (torch.bfloat16, ck, rd) for ck, rd in (("fp32", None), ("fp32", "fp8_e4m3:row"), ("bf16", "fp8_e4m3:row"))]


def _decode(device, shape, ck, rd, dtype, inp, state0, batch, L, T, kernel):
    cache = ReplayCache.allocate(batch, **shape, ring_len=L, checkpoint=ck, read=rd, input_dtype=dtype, device=device)
    # Seeded, so that every step kernel starts from the same stochastically rounded checkpoint.
    cache.reset(list(range(batch)), state0, generator=torch.Generator(device=device).manual_seed(3))
    ys, read_mismatches = [], 0
    for t in range(T):
        out = torch.full((batch, shape["nheads"], shape["headdim"]), float("nan"), device=device, dtype=dtype)
        step(cache, {k: (v[t] if v.dim() > 1 else v) for k, v in inp.items()}, out, **kernel)
        ys.append(out)
        if rd is not None and not cache.read_format.stochastic and (t + 1) % L == 0:
            # Against torch's codec on the CPU (IEEE division there for certain).
            expected = quantize(cache.checkpoint_values(list(range(batch))).cpu(), rd)
            bits = torch.uint8 if cache.read.element_size() == 1 else torch.int16
            read_mismatches += int((cache.read.cpu().view(bits) != expected.data.view(bits)).sum())
            if expected.scale is not None:
                read_mismatches += int((cache.read_scale.cpu() != expected.scale).sum())
    return torch.stack(ys).double().cpu(), cache, read_mismatches


def _rel(a, b):
    return float((a - b).norm() / b.norm())


U = 2.0 ** -24
# One rounding of a 16-bit output, relative (a whole bf16 ulp: the interpreter's cast truncates).
OUTPUT_U = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -11}


def _fp32_output_bound(state0, cpu, L, T, N, dtype):
    """Per-element bound on |y − y_ref| for an fp32 checkpoint without a read copy, from the
    fp32 error analysis of tests/mamba2/test_replay.py: each step's output is within
    ``κ_y·u·M`` of the fp64 value (``M`` the same recurrence over absolute values, times the
    gate's magnitude), ``κ_y = L + 4 + (L + 1)·max|A·Λ| + dstate + 6``, and each of the
    ``T // L`` flushes before it carries at most ``κ_fold·u·M`` forward (decay ≤ 1); plus one
    rounding of a 16-bit output."""
    absolute = {k: (v.abs() if k in ("x", "B", "C", "D") else v) for k, v in cpu.items() if k != "z"}
    y_abs, _ = reference.decode_exact(state0.abs(), **absolute, dt_softplus=True)
    y_ref_mag = reference.decode_exact(state0, **cpu, dt_softplus=True)[0].abs()
    dts = reference.process_dt(cpu["dt"].double(), cpu["dt_bias"].double(), True)  # [T, batch, H]
    decay_exponent = float((cpu["A"].double().abs() * dts.sum(0)).max())  # a bound on any cycle's |A·Λ|
    kappa_y = L + 4 + (L + 1) * decay_exponent + N + 6
    z = cpu["z"].double()
    gate = (z * torch.sigmoid(z)).abs().clamp(min=1.0)
    return (T // L + 1) * kappa_y * U * y_abs * gate + OUTPUT_U[dtype] * y_ref_mag + 1e-30


def check_kernel(device, shape=None, batch=3, L=4, T=10, sweep=True):
    """Every step kernel against ``decode_replay`` (fp64, same formats) over T steps (two flush
    cycles), and the grouped kernels against the per-head one.

    Fails when: outputs are not finite; read-copy codes or scales differ from
    ``quantize(dequantize(checkpoint))`` (round-to-nearest read formats); outputs or the
    materialized state are off the reference by more than 5e-3 relative RMS (1e-2 for ``+sr``:
    other noise than the reference's; the fp32-folded checkpoint may round to another code than
    the fp64 fold, which moves outputs by up to a grid step of the read format; a ``+sr``
    checkpoint's outputs through a read copy also by twice the read format's relative RMS error
    on the reference's state); or, with an fp32
    checkpoint, the materialized state is off by more than 1e-5 (each fp32 fold is within
    ``κ_fold·u`` ≈ 1e-6 of the absolute sum, kernels/README.md "Error bounds"; a fold whose
    products lost fp32 precision, e.g. bf16 tensor-core products of unsplit factors, is ~1e-3
    off; the speculative check uses the same 1e-5); or a grouped
    kernel's checkpoint is not bit-identical to the per-head kernel's (the same flush kernel folds
    the same ring), or its outputs differ from the per-head kernel's by more than 1e-5 relative RMS
    (4e-3 with bf16 outputs: one bf16 rounding either side). With ``sweep``, also every tile of
    ``sweep_cases`` (bf16 inputs, so the sweep reuses the compiled kernels). An fp32 checkpoint
    without a read copy is also held, element by element, to the fp32 bound of
    :func:`_fp32_output_bound` (about 1e-5 of the output magnitudes here). Returns
    (failures, report rows).
    """
    shape = shape or CHECK_SHAPE
    failures, report = [], []
    H, P, N = shape["nheads"], shape["headdim"], shape["dstate"]
    sweep_kernels = {f"grouped-h{h}-w{w}-s{s}": dict(heads_per_program=h, step_warps=w, step_stages=s)
                     for h, w, s in _SWEEP_TILES} if sweep else {}
    for dtype, ck, rd in CHECK_COMBOS:
        inp = inputs(batch, **shape, device=device, dtype=dtype, T=T, seed=1)
        state0 = torch.randn(batch, H, P, N, generator=torch.Generator().manual_seed(2)).to(device)
        cpu = {k: v.cpu() for k, v in inp.items()}
        y_ref, S_ref = reference.decode_replay(state0.cpu(), **cpu, dt_softplus=True, checkpoint=ck, read=rd,
                                               ring_len=L)
        tol = 1e-2 if "+sr" in ck else 5e-3
        y_tol = tol
        # An fp32 checkpoint without a read copy rounds nothing but fp32 arithmetic: bounded per element.
        y_bound = _fp32_output_bound(state0.cpu(), cpu, L, T, N, dtype) if (ck, rd) == ("fp32", None) else None
        if "+sr" in ck and rd is not None:
            # Other noise than the reference's rounds the checkpoint, and its read copy is then
            # another rounding into the read format than the reference's: the outputs may
            # differ by both read copies' errors, measured on the reference's state.
            y_tol = tol + 2 * _rel(dequantize(quantize(S_ref.float(), rd)).double(), S_ref)
        kernels = dict(STEP_KERNELS)
        if dtype == torch.bfloat16 and ck == "fp32" and rd in (None, "fp8_e4m3:row"):
            kernels.update(sweep_kernels)
        baseline = None
        for name, kernel in kernels.items():
            key = f"{ck}/{rd}/{str(dtype).replace('torch.', '')}/{name}"
            try:
                y, cache, mismatches = _decode(device, shape, ck, rd, dtype, inp, state0, batch, L, T, kernel)
            except Exception as err:  # a kernel that does not compile fails its check, not the run
                failures.append(f"replay {key}: raised {type(err).__name__}: {err}")
                continue
            S = cache.materialize(list(range(batch)), inp["A"]).double().cpu()
            row = dict(check=key, y_rel_rms=_rel(y, y_ref), state_rel_rms=_rel(S, S_ref), read_mismatches=mismatches,
                       finite=bool(torch.isfinite(y).all()))
            problems = []
            if not row["finite"]:
                problems.append("non-finite outputs")
            if mismatches:
                problems.append(f"{mismatches} read codes/scales differ")
            if y_bound is not None:
                row["y_over_fp32_bound"] = float(((y - y_ref).abs() / y_bound).max())
                if not row["y_over_fp32_bound"] <= 1.0:
                    problems.append(f"y {row['y_over_fp32_bound']:.3g} × the fp32 bound")
            state_tol = 1e-5 if ck == "fp32" else tol
            if not (row["y_rel_rms"] <= y_tol and row["state_rel_rms"] <= state_tol):
                problems.append(f"y rel {row['y_rel_rms']:.2e} (tol {y_tol:.3g}) state rel {row['state_rel_rms']:.2e} "
                                f"(tol {state_tol:g})")
            if baseline is None:
                baseline = (y, cache.checkpoint.cpu())
            else:
                row["y_rel_vs_per_head"] = _rel(y, baseline[0])
                row["checkpoint_bit_identical"] = torch.equal(
                    cache.checkpoint.cpu().view(torch.uint8), baseline[1].view(torch.uint8))
                same_tol = 4e-3 if dtype == torch.bfloat16 else 1e-5
                if not (row["y_rel_vs_per_head"] <= same_tol and row["checkpoint_bit_identical"]):
                    problems.append(f"vs per-head: y rel {row['y_rel_vs_per_head']:.2e} (tol {same_tol:g}), "
                                    f"checkpoint identical {row['checkpoint_bit_identical']}")
            row["ok"] = not problems
            report.append(row)
            if problems:
                failures.append(f"replay {key}: " + "; ".join(problems))
    failures += check_graph(device)
    return failures, report


def check_graph(device, batch=64, steps=40, layer=LAYER):
    """Replay steps under CUDA-graph replay (kernels launching with PDL) against the same steps
    run eagerly without PDL, bit for bit (:func:`harness.graph_matches_eager`): every cache
    tensor but the flush list (its order is that of the atomics) and every step's output,
    staggered cursors so that every step flushes some rows. Returns failures."""
    failures = []
    for read in (None, "fp8_e4m3:row"):
        for kernel_name in ("default", "per-head", "fused"):
            def make():
                cache, inp, _ = _buffers(batch, "fp32", read, 16, layer, device, "staggered")
                outs = torch.full((steps, batch, layer["nheads"], layer["headdim"]), float("nan"), device=device,
                                  dtype=torch.bfloat16)
                return cache, inp, outs

            def run(buffers, kernel=STEP_KERNELS[kernel_name]):
                cache, inp, outs = buffers
                for i in range(steps):
                    step(cache, inp, outs[i], **kernel)

            def tensors(buffers):
                cache, _, outs = buffers
                return dict({k: v for k, v in cache.tensors().items() if k != "flush_rows"}, outputs=outs)

            failures += harness.graph_matches_eager(f"replay graph fp32+{read or 'none'} {kernel_name}", make, run,
                                                    tensors)
    return failures


# ---------------------------------------------------------------------------- timing


def _probe(checkpoint, read, ring_len, layer):
    return ReplayCache.allocate(1, **layer, ring_len=ring_len, checkpoint=checkpoint, read=read, device="meta")


def _buffers(batch, checkpoint, read, ring_len, layer, device, phase):
    cache = ReplayCache.allocate(batch, **layer, ring_len=ring_len, checkpoint=checkpoint, read=read, device=device)
    cache.reset(list(range(batch)))
    if phase == "staggered":
        cache.cursor.copy_(torch.arange(batch, device=device, dtype=torch.int32) % ring_len)
    out = torch.empty(batch, layer["nheads"], layer["headdim"], device=device, dtype=torch.bfloat16)
    return cache, inputs(batch, **layer, device=device), out


def _label(checkpoint, read, ring_len):
    return f"{checkpoint}+{read or 'none'}/L{ring_len}"


def cycle_case(batch, checkpoint, read, ring_len, kernel_name, device, *, phase="aligned", layer=LAYER,
               kernel=None):
    """Whole flush cycles: one call = ``ring_len`` steps; µs and bytes per step."""
    probe = _probe(checkpoint, read, ring_len, layer)
    kernel = STEP_KERNELS[kernel_name] if kernel is None else kernel
    moved = int(probe.bytes_per_step() * batch + io_bytes(batch, **layer))

    def run(buffers):
        cache, inp, out = buffers
        for _ in range(ring_len):
            step(cache, inp, out, **kernel)

    name = f"replay/b{batch}/{_label(checkpoint, read, ring_len)}/{kernel_name}" + (
        "/staggered" if phase == "staggered" else "")
    return harness.Case(
        "replay", name,
        dict(model=MODEL, batch=batch, format=f"replay {checkpoint} + {read or 'no read'}, L{ring_len}, {kernel_name}",
             inputs=f"bf16, flush cycles{', staggered' if phase == 'staggered' else ''}", kernel=kernel_name,
             checkpoint=checkpoint, read=read, ring_len=ring_len, phase=phase),
        moved, lambda: _buffers(batch, checkpoint, read, ring_len, layer, device, phase), run,
        set_bytes=int(probe.nbytes * batch), steps_per_call=ring_len)


def single_step_case(batch, checkpoint, read, ring_len, kernel_name, which, device, *, layer=LAYER, kernel=None,
                     group="replay", label=None):
    """One step with every row normal (cursor 0: the state read, no ring tokens yet) or every row
    flushing (cursor L − 1: checkpoint read, checkpoint and read copy written, L ring tokens read)."""
    probe = _probe(checkpoint, read, ring_len, layer)
    kernel = STEP_KERNELS[kernel_name] if kernel is None else kernel
    ck = slot_state_bytes(probe.checkpoint, probe.checkpoint_scale)
    rd = ck if probe.read is None else slot_state_bytes(probe.read, probe.read_scale)
    per_token = (layer["nheads"] * (layer["headdim"] * probe.ring_x.element_size() + 4)
                 + layer["ngroups"] * layer["dstate"] * probe.ring_B.element_size())
    if which == "normal":
        cursor, per_slot = 0, rd + per_token
    else:
        cursor, per_slot = ring_len - 1, 2 * ck + (0 if probe.read is None else rd) + (ring_len + 1) * per_token
    moved = int(per_slot * batch + io_bytes(batch, **layer))

    def run(buffers):
        cache, inp, out = buffers
        cache.cursor.fill_(cursor)
        step(cache, inp, out, **kernel)

    label = label or kernel_name
    return harness.Case(
        group, f"replay/b{batch}/{_label(checkpoint, read, ring_len)}/{label}/{which}-step",
        dict(model=MODEL, batch=batch, format=f"replay {checkpoint} + {read or 'no read'}, L{ring_len}, {label}",
             inputs=f"bf16, {which} step only", kernel=label, checkpoint=checkpoint, read=read, ring_len=ring_len,
             phase=f"{which}-step"),
        moved, lambda: _buffers(batch, checkpoint, read, ring_len, layer, device, "aligned"), run,
        set_bytes=int(probe.nbytes * batch))


# Targets from vLLM's ReplaySSM kernel, measured on the H200 beside the project's kernels:
# (read copy, batch, pattern) → the most µs a step may take and / or the least speed-up over the
# conventional fp32 kernel timed in the same run (the peer's over its own conventional kernel).
TARGETS = {
    (None, 1, "staggered"): dict(us=6.67, x=0.67), (None, 16, "staggered"): dict(us=27.8, x=1.39),
    (None, 64, "staggered"): dict(us=88.2, x=1.62), (None, 256, "staggered"): dict(us=332.9, x=1.70),
    (None, 1, "aligned"): dict(us=6.67), (None, 16, "aligned"): dict(us=26.0, x=1.49),
    (None, 64, "aligned"): dict(x=1.73), (None, 256, "aligned"): dict(us=290 * 1.02, x=1.82),
    ("fp8_e4m3:row", 1, "staggered"): dict(us=5.5), ("fp8_e4m3:row", 16, "staggered"): dict(us=13.0),
    ("fp8_e4m3:row", 64, "staggered"): dict(us=38.0), ("fp8_e4m3:row", 256, "staggered"): dict(us=130.0),
    ("fp8_e4m3:row", 256, "aligned"): dict(us=132 * 1.02),  # no regression: within 2 % of 132 µs
}
HEADLINE_BATCHES = (1, 16, 64, 256)
# The single-launch step kernel (launch_replay_decode(fused=True)) and lanes left to disagree (agree=False).
STEP_KERNELS.update({"fused": dict(fused=True), "no-agree": dict(agree=False)})


def conventional_case(batch, device, layer=LAYER):
    """The yardstick: the conventional fp32 kernel (public op) at ``batch``, in this group so that
    ``--only replay/`` times it in the same run as the replay cases."""
    from . import cases_conventional
    state_bytes = layer["nheads"] * layer["headdim"] * layer["dstate"] * 4
    moved = int(2 * batch * state_bytes + io_bytes(batch, **layer))
    return harness.Case(
        "replay", f"replay/b{batch}/conventional-fp32",
        dict(model=MODEL, batch=batch, format="conventional fp32", inputs="bf16", kernel="conventional",
             phase="yardstick"),
        moved, lambda: cases_conventional.make_inputs(MODEL, batch, "fp32", device),
        lambda b: cases_conventional.run_public(b, "fp32"), set_bytes=moved // 2)


@harness.register("replay")
def timing_cases(device, layer=LAYER):
    out = [conventional_case(batch, device, layer) for batch in HEADLINE_BATCHES]
    # Headline: staggered cursors (a serving engine's admissions: every step flushes 1/16 of the
    # rows), then aligned, for what replay_decode runs and the single-launch candidate.
    for batch in HEADLINE_BATCHES:
        for read in (None, "fp8_e4m3:row"):
            for phase in ("staggered", "aligned"):
                for name in ("default", "fused"):
                    out.append(cycle_case(batch, "fp32", read, 16, name, device, phase=phase, layer=layer))
    # Each step kernel alone, and the other formats and ring lengths, at batch 256.
    for name in ("per-head", "grouped-h8"):
        for batch in (64, 16):
            out += [cycle_case(batch, "fp32", read, 16, name, device, phase="staggered", layer=layer)
                    for read in (None, "fp8_e4m3:row")]
        out += [cycle_case(256, "bf16", "fp8_e4m3:row", 16, name, device, layer=layer),
                cycle_case(256, "bf16+sr", "fp8_e4m3:row", 16, name, device, layer=layer),
                cycle_case(256, "fp32", "int8:row", 16, name, device, layer=layer),
                cycle_case(256, "fp32", "fp8_e4m3:row", 8, name, device, layer=layer),
                cycle_case(256, "fp32", "fp8_e4m3:row", 32, name, device, layer=layer)]
        for read in (None, "fp8_e4m3:row"):
            for which in ("normal", "flush"):
                out.append(single_step_case(256, "fp32", read, 16, name, which, device, layer=layer))
    out += [single_step_case(256, "fp32", read, 16, "default", which, device, layer=layer)
            for read in (None, "fp8_e4m3:row") for which in ("normal", "flush")]
    # What agreeing lanes cost where the kernels are busiest: the same cycles without them.
    out += [cycle_case(256, "fp32", read, 16, "no-agree", device, phase="staggered", layer=layer)
            for read in (None, "fp8_e4m3:row")]
    return out


# (heads per program, warps, head-loop stages) of the grouped step kernel's sweep.
_SWEEP_TILES = [(h, w, 2) for h in (4, 8, 16) for w in (4, 8)] + [(8, 4, 1), (8, 4, 3)]


# Small-batch step tiles (rows of headdim, warps) for the per-head and single-launch kernels.
_SMALL_BATCH_TILES = [(16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (32, 4)]


def sweep_cases(device, layer=LAYER):
    """``python3 -m bench.run_gpu --sweep replay``: the grouped kernel's normal step at batch 256
    over ``_SWEEP_TILES``, and whole staggered flush cycles at batches 1, 16 and 64 over
    ``_SMALL_BATCH_TILES`` for the per-head and the single-launch step kernels (tiles per batch)."""
    out = [single_step_case(256, "fp32", read, 16, None, "normal", device, layer=layer, group="replay-sweep",
                            kernel=dict(heads_per_program=h, step_warps=w, step_stages=s),
                            label=f"grouped-h{h}-w{w}-s{s}")
           for read in ("fp8_e4m3:row", None) for h, w, s in _SWEEP_TILES]
    for batch in (1, 16, 64):
        for read in ("fp8_e4m3:row", None):
            for kernel, fused in (("per-head", False), ("fused", True)):
                for rows, warps in _SMALL_BATCH_TILES:
                    case = cycle_case(batch, "fp32", read, 16, kernel, device, phase="staggered", layer=layer,
                                      kernel=dict(heads_per_program=0, fused=fused, step_block_p=rows,
                                                  step_warps=warps))
                    case.group = "replay-sweep"
                    case.name += f"/p{rows}-w{warps}"
                    out.append(case)
    return out


def eager_overhead(device, layer=LAYER):
    """µs per eager step at batch 1, fp32 checkpoint + fp8_e4m3:row read copy: the public
    ``replay_decode`` and the launcher alone (two kernel launches a step either way)."""
    from qstate import replay_decode
    cache, inp, out = _buffers(1, "fp32", "fp8_e4m3:row", 16, layer, device, "aligned")
    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
    return dict(public_us=harness.eager_us(lambda: replay_decode(cache, *args, True, out=out)),
                launcher_us=harness.eager_us(lambda: step(cache, inp, out)))


def annotate(by_group):
    """Each replay case's speed-up over the conventional fp32 kernel at its batch
    (``x_conventional_fp32`` > 1: replay is faster), timed in the same run (this group's
    yardstick, else the conventional group's), and whether it meets ``TARGETS``
    (``target`` and ``target_met`` in its row; a miss is printed)."""
    conventional = {r["params"]["batch"]: r["us"] for r in by_group.get("conventional", [])
                    if r["params"].get("model") == MODEL and r["params"].get("format") == "fp32"}
    conventional.update({r["params"]["batch"]: r["us"] for r in by_group.get("replay", [])
                         if r["params"].get("kernel") == "conventional"})
    for group in ("replay", "replay-sweep"):
        for r in by_group.get(group, []):
            p = r["params"]
            if p.get("kernel") == "conventional":
                continue
            base = conventional.get(p["batch"])
            if base is not None:
                r["x_conventional_fp32"] = base / r["us"]
            target = TARGETS.get((p.get("read"), p["batch"], p.get("phase"))) if p.get("checkpoint") == "fp32" and \
                p.get("ring_len") == 16 else None
            if target is not None:
                met = r["us"] <= target.get("us", float("inf")) and (
                    "x" not in target or r.get("x_conventional_fp32", 0.0) >= target["x"])
                r["target"], r["target_met"] = target, met
            ratio = f"{r['x_conventional_fp32']:5.2f}x conventional fp32" if base is not None else ""
            verdict = "" if target is None else ("  target met" if r["target_met"] else f"  MISSED target {target}")
            print(f"{r['name']:60s} {r['us']:8.1f} us  {ratio}{verdict}", flush=True)
