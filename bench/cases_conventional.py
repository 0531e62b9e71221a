"""Benchmark cases and GPU correctness checks of the conventional decode kernel."""

from __future__ import annotations

import dataclasses
import itertools

import torch

import qstate
from qstate import formats, profiles, reference
from qstate.kernels.common import codec, codec_probe
from qstate.kernels.mamba2 import conventional as kernel

from .harness import Case, bits, eager_us, graph_matches_eager, register

MODELS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b")
BATCHES = (1, 16, 64, 256)
FORMATS = ("fp32", "bf16", "fp16", "int8:row", "fp8_e4m3:row", "bf16+sr", "fp16+sr", "int8:row+sr", "fp8_e4m3:row+sr")
ALL_FORMATS = (
    "fp32", "bf16", "fp16", "bf16+sr", "fp16+sr",
    *[f"{d}:{g}{sr}" for d in ("int8", "fp8_e4m3", "fp8_e5m2") for g in ("row", "head", "block32") for sr in ("", "+sr")],
)


def _bytes_moved(fmt, batch, nheads, headdim, dstate, ngroups, input_bytes):
    """State and scales read and written, plus the inputs read and the output written."""
    per_slot = nheads * headdim * dstate * fmt.bytes_per_element(dstate, headdim)
    io = batch * (3 * nheads * headdim + 2 * ngroups * dstate) * input_bytes + batch * nheads * 4
    return int(2 * batch * per_slot + io)


def make_inputs(model, batch, fmt, device, input_dtype=torch.bfloat16, seed=0):
    """One buffer set: the state in ``fmt`` (random values) and one token's inputs."""
    prof = profiles.get(model)
    H, P, N, G = prof.nheads, prof.headdim, prof.dstate, prof.ngroups
    gen = torch.Generator(device=device).manual_seed(seed)
    q = formats.quantize(torch.randn(batch, H, P, N, device=device, generator=gen), fmt)
    return dict(
        state=q.data, state_scale=q.scale,
        x=torch.randn(batch, H, P, device=device, dtype=input_dtype, generator=gen),
        dt=torch.randn(batch, H, device=device, dtype=input_dtype, generator=gen) * 0.5,
        A=-torch.rand(H, device=device, generator=gen) * 8 - 1,
        B=torch.randn(batch, G, N, device=device, dtype=input_dtype, generator=gen),
        C=torch.randn(batch, G, N, device=device, dtype=input_dtype, generator=gen),
        D=torch.ones(H, device=device), z=torch.randn(batch, H, P, device=device, dtype=input_dtype, generator=gen),
        dt_bias=torch.randn(H, device=device, generator=gen) - 4,
        out=torch.empty(batch, H, P, device=device, dtype=input_dtype),
        state_batch_indices=torch.arange(batch, device=device, dtype=torch.int32),
    )


def run_public(buffers, fmt_text, seed=1):
    qstate.selective_state_update(
        buffers["state"], buffers["x"], buffers["dt"], buffers["A"], buffers["B"], buffers["C"], buffers["D"],
        buffers["z"], buffers["dt_bias"], True, buffers["state_batch_indices"], state_scale=buffers["state_scale"],
        state_format=fmt_text, out=buffers["out"], seed=seed,
    )


def run_launcher(buffers, fmt, block_p=None, num_warps=None, variant=None, maxnreg=None):
    """The launcher alone, with a tile and variant override (sweeps)."""
    b = buffers
    kernel.launch(
        codec.storage_view(b["state"], fmt), b["state_scale"], b["x"], b["dt"], b["A"], b["B"], b["C"], b["D"], b["z"],
        b["dt_bias"], b["state_batch_indices"], b["out"], 1, None,
        dtype_code=codec.dtype_code(fmt), granularity=codec.granularity_code(fmt), stochastic=fmt.stochastic,
        qmax=codec.qmax(fmt), emax=codec.emax(fmt), dt_softplus=True, pad_slot_id=-1,
        heads_per_group=b["x"].shape[1] // b["B"].shape[1], block_p=block_p, num_warps=num_warps, variant=variant,
        maxnreg=maxnreg,
    )


def _case(model, batch, text, device, group="conventional", **extra):
    fmt = formats.StateFormat.parse(text)
    prof = profiles.get(model)
    nbytes = _bytes_moved(fmt, batch, prof.nheads, prof.headdim, prof.dstate, prof.ngroups, 2)
    params = dict(model=model, batch=batch, format=text, inputs="bf16", **extra)
    if "block_p" in extra:
        run = lambda b: run_launcher(b, fmt, extra["block_p"], extra["num_warps"])  # noqa: E731
    else:
        run = lambda b: run_public(b, text)  # noqa: E731
    return Case(group, f"{model}/b{batch}/{text}", params, nbytes,
                lambda: make_inputs(model, batch, fmt, device), run, set_bytes=nbytes // 2)


@register("conventional")
def timing_cases(device):
    return [_case(m, b, f, device) for m in MODELS for b in BATCHES for f in FORMATS
            if m == MODELS[0] or b in (1, 256)]


def sweep_cases(device):
    """Kernel variants against the default at batch 256 of the first model (bench/run_gpu.py
    --sweep); the first run's tile sweep is ``tile_cases``."""
    return variant_cases(device)


def tile_cases(device, formats_=("fp32", "fp16", "int8:row", "fp8_e4m3:row"), block_ps=(8, 16, 32, 64),
               warps=(4, 8)):
    """Tile sweep at batch 256 of the first model (the first H200 run's --sweep)."""
    return [_case(MODELS[0], 256, f, device, group="sweep", block_p=bp, num_warps=w)
            for f in formats_ for bp in block_ps for w in warps]


# Kernel variants timed against the default (kernels/conventional.Variant): tag → (Variant,
# BLOCK_P or None for the default tile, num_warps or None). 8-bit tiles use 168 registers at
# 32 × 128 × 4 warps (sm_90 compile), so smaller tiles looping over more heads are in the list.
# "plain" is the first kernel's code path. Dropped after losing for fp16, int8:row and
# fp8_e4m3:row alike in the d0c2baa sweep: 4 heads with 2 stages (346 / 331 / 422 µs), 4 heads
# with prefetch and 8 warps (359 / 347 / 399), 8 heads with 2 stages at 16 rows (379 / 393).
_V = kernel.Variant
RNE_VARIANTS = {
    "default": (None, None, None),
    "plain": (_V(), None, None),
    "even": (_V(even=True), None, None),
    "even-hpp2-pf": (_V(even=True, heads_per_prog=2, prefetch=True), None, None),
    "even-hpp4-pf": (_V(even=True, heads_per_prog=4, prefetch=True), None, None),
    "even-hpp8-pf": (_V(even=True, heads_per_prog=8, prefetch=True), None, None),
    "even-hpp4-st3": (_V(even=True, heads_per_prog=4, num_stages=3), None, None),
}
RNE_VARIANTS_8BIT = {
    "even-hpp8-pf-bp16": (_V(even=True, heads_per_prog=8, prefetch=True), 16, 4),
}
SR_VARIANTS = {
    "default": (None, None, None),
    "sr4": (_V(sr_stream=1), None, None),  # the default before the 16-bit stream
    "sr4-r7": (_V(sr_stream=1, sr_rounds=7), None, None),
    "even-hpp4-pf-sr4": (_V(even=True, heads_per_prog=4, prefetch=True, sr_stream=1), None, None),
    "even-hpp8-pf-bp16-sr4": (_V(even=True, heads_per_prog=8, prefetch=True, sr_stream=1), 16, 4),
}


def variant_cases(device, model=MODELS[0], batch=256):
    """Default vs variants at batch 256 (bench/run_gpu.py --sweep conventional): 40 cases."""
    plan = [(text, RNE_VARIANTS) for text in ("fp16", "bf16", "int8:row", "fp8_e4m3:row")]
    plan += [(text, RNE_VARIANTS_8BIT) for text in ("int8:row", "fp8_e4m3:row")]
    plan += [(text, SR_VARIANTS) for text in ("int8:row+sr", "fp8_e4m3:row+sr")]
    return [_variant_case(model, batch, text, tag, *spec, device) for text, table in plan for tag, spec in table.items()]


def _variant_case(model, batch, text, tag, variant, block_p, num_warps, device, maxnreg=None):
    fmt = formats.StateFormat.parse(text)
    prof = profiles.get(model)
    config_p, _, config_warps, config_variant, config_maxnreg = kernel.launch_config(
        fmt.storage_dtype.itemsize, prof.headdim, prof.dstate, codec.granularity_code(fmt), batch, prof.nheads,
        prof.nheads // prof.ngroups, stochastic=fmt.stochastic, dtype=codec.dtype_code(fmt))
    if maxnreg is None and block_p is None and num_warps is None and variant is None:
        maxnreg = config_maxnreg
    block_p, num_warps, variant = block_p or config_p, num_warps or config_warps, variant or config_variant
    nbytes = _bytes_moved(fmt, batch, prof.nheads, prof.headdim, prof.dstate, prof.ngroups, 2)
    params = dict(model=model, batch=batch, format=f"{text} [{tag}]", inputs="bf16", variant=tag, block_p=block_p,
                  num_warps=num_warps, maxnreg=maxnreg)
    return Case("sweep-conventional", f"{model}/b{batch}/{text}/{tag}", params, nbytes,
                lambda: make_inputs(model, batch, fmt, device),
                lambda b: run_launcher(b, fmt, block_p, num_warps, variant, maxnreg), set_bytes=nbytes // 2)


def eager_overhead(device):
    """µs per eager call at batch 1 (public function, and the launcher alone), fp32 state."""
    fmt = formats.StateFormat.parse("fp32")
    b = make_inputs(MODELS[0], 1, fmt, device)
    return dict(public_us=eager_us(lambda: run_public(b, "fp32")), launcher_us=eager_us(lambda: run_launcher(b, fmt)))


def check_codec(device):
    """The codec probe on the GPU, with and without conversion instructions, vs qstate.formats:
    every format (stochastic ones with noise stream 0 and the launcher's default stream), 2**19
    values per format over many binades, bit for bit. Returns failures."""
    failures = []
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 64, 128, device=device, generator=gen)
    x = x * torch.exp(4 * torch.randn(64, 64, 1, device=device, generator=gen))
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-41, 3e38])
    x[0, 1] = 0.0
    for text in ALL_FORMATS:
        fmt = formats.StateFormat.parse(text)
        streams = [(0, 10)]
        if fmt.stochastic:
            default = kernel.DEFAULT_VARIANTS[(fmt.storage_dtype.itemsize, True)]
            streams.append((default.sr_stream, default.sr_rounds))
        for hw, (stream, rounds) in itertools.product((False, True), streams):
            codes, scale, noise, values = codec_probe.quantize_heads(x, fmt, seed=5, hardware_casts=hw,
                                                                    sr_stream=stream, sr_rounds=rounds)
            expected = formats.quantize(x, fmt, noise=noise)
            bad = int((bits(codes) != bits(expected.data)).sum())
            if fmt.scaled:
                bad += int((bits(scale) != bits(expected.scale)).sum())
            if bad:
                failures.append(f"codec {text} hw={hw} stream {stream}: {bad} codes/scales differ")
    return failures


def _check_shapes():
    """(profile, batch, formats, head_loop) of the GPU check: every format at a small shape (where
    the launcher splits headdim into 4-row tiles), the unscaled and row-scaled formats at a shape
    that keeps their full GPU tiles (``kernel._TILE_ROWS_BY_DTYPE``), and the formats whose GPU
    launch changes with the grid (``kernel.HEAD_LOOP_CONFIGS``) at a shape whose launch must take
    that configuration."""
    parsed = {text: formats.StateFormat.parse(text) for text in ALL_FORMATS}
    head_loop = [text for text, fmt in parsed.items() if fmt.granularity in (None, "row")
                 and (codec.dtype_code(fmt), fmt.stochastic) in kernel.HEAD_LOOP_CONFIGS]
    full_tile = [text for text, fmt in parsed.items() if fmt.granularity in (None, "row") and text not in head_loop]
    return [(profiles.Profile("check", 8, 64, 128, 2, 1), 4, ALL_FORMATS, False),
            (profiles.Profile("check-full-tile", 32, 64, 128, 2, 1), 64, full_tile, False),
            (profiles.Profile("check-head-loop", 32, 64, 128, 2, 1), 256, head_loop, True)]


def _check_format(prof, batch, text, input_dtype, steps, device, failures, report, head_loop=False):
    """One format of :func:`check_kernel` at ``prof``'s shape; appends to failures and report.
    ``head_loop``: on a GPU the launch must take the format's ``HEAD_LOOP_CONFIGS`` entry."""
    inp = prof.sample_inputs(steps, batch, seed=3, device=device, dtype=input_dtype)
    fmt = formats.StateFormat.parse(text)
    gen = torch.Generator(device=device).manual_seed(0)
    q = formats.quantize(torch.randn(batch, prof.nheads, prof.headdim, prof.dstate, device=device, generator=gen), fmt)
    state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
    config = kernel.launch_config(fmt.storage_dtype.itemsize, prof.headdim, prof.dstate, codec.granularity_code(fmt),
                                  batch, prof.nheads, prof.nheads // prof.ngroups, device.type == "cuda",
                                  fmt.stochastic, codec.dtype_code(fmt) if device.type == "cuda" else None)
    loop = kernel.HEAD_LOOP_CONFIGS.get((codec.dtype_code(fmt), fmt.stochastic))
    if head_loop and device.type == "cuda" and config[3] != loop[2]:
        failures.append(f"kernel {text} {prof.name}: batch {batch} does not take the head-loop launch ({config})")
    ys = []
    for t in range(steps):
        out = torch.full_like(inp.x[t], float("nan"))
        qstate.selective_state_update(state, inp.x[t], inp.dt[t], inp.A, inp.B[t], inp.C[t], inp.D, inp.z[t],
                                      inp.dt_bias, True, state_scale=scale, state_format=text, out=out, seed=t)
        ys.append(out.float())
    kw = inp.kwargs()
    kw["state0"] = formats.dequantize(q)
    y_ref, S_ref = reference.decode_naive(**kw, fmt=fmt, generator=gen)
    y_exact = reference.decode_exact(**kw)[0]
    y = torch.stack(ys)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    # The first output depends only on the stored state the kernel starts from. decode_naive
    # stores Q(state0) first; with +sr that re-rounds dequantized codes whose recomputed scale
    # can move by an ulp (another stored state: 2 of 131072 outputs off by 1e-4, run of cb9f93e),
    # so the first step is compared against the round-to-nearest format's, which restores q.
    y_first = y_ref[0] if not fmt.stochastic else reference.decode_naive(
        **kw, fmt=dataclasses.replace(fmt, stochastic=False))[0][0]
    first = rel(y[0], y_first)
    first_bound = 4e-3 if input_dtype == torch.bfloat16 else 1e-5
    differing = 0.0
    if (fmt.scaled or fmt.dtype in ("bf16", "fp16")) and not fmt.stochastic:
        differing = (bits(state) != bits(formats.quantize(S_ref, fmt).data)).double().mean().item()
    err, err_ref = rel(y, y_exact), rel(y_ref, y_exact)
    # Outputs in bf16 add one bf16 rounding (2**-9 relative) that decode_naive's fp32 lacks.
    ok = (bool(torch.isfinite(y).all()) and first < first_bound and differing < 1e-3
          and err <= 1.5 * err_ref + first_bound)
    report.append(dict(format=text, shape=prof.name, batch=batch, config=f"{config[0]}x{config[1]} w{config[2]} "
                       f"{config[3]}", inputs=str(input_dtype).replace("torch.", ""), first_step_rel=first,
                       codes_differing=differing, err_vs_fp64=err, naive_err_vs_fp64=err_ref, ok=ok))
    if not ok:
        failures.append(f"kernel {text} {prof.name} {input_dtype}: first {first:.2e} differing {differing:.2e} "
                        f"err {err:.2e} vs naive {err_ref:.2e}")


def check_kernel(device, steps=3):
    """Kernel vs decode_naive on the GPU, every format, fp32 and bf16 inputs, T steps.

    The GPU contracts ``a·S + u`` into an FMA and sums ``S·C`` in another order, so a code may
    flip where the reference's value lies within an ulp of a rounding boundary, and a flipped
    code moves later outputs by up to one grid step. So: the first step's output (same stored
    state for both; for ``+sr`` decode_naive of the round-to-nearest format, whose first store
    gives back the codes) within 1e-5 relative RMS of decode_naive (4e-3 with bf16 outputs: one bf16
    rounding); < 0.1 % of the final codes different (round-to-nearest 8/16-bit formats; an fp32
    state differs in last bits by the FMA); and the error of all outputs against fp64 within
    1.5× decode_naive's own (+ the first-step bound), which also covers ``+sr``
    (other noise than the reference's). Returns (failures, rows of the report).
    """
    failures, report = [], []
    for prof, batch, texts, head_loop in _check_shapes():
        for input_dtype in (torch.float32, torch.bfloat16):
            for text in texts:
                _check_format(prof, batch, text, input_dtype, steps, device, failures, report, head_loop)
    variant_failures, variant_report = check_variants(device)
    return failures + variant_failures + check_graph(device), report + variant_report


def check_graph(device, batch=64, steps=8):
    """Steps of the public op under CUDA-graph replay (the kernel launching with PDL, each step
    reading the state the step before wrote) against the same steps run eagerly without PDL,
    bit for bit (:func:`harness.graph_matches_eager`): states, scales and outputs, for fp32,
    fp16, int8:row, fp8_e4m3:row and fp8_e4m3:row+sr. Returns failures."""
    failures = []
    for text in ("fp32", "fp16", "int8:row", "fp8_e4m3:row", "fp8_e4m3:row+sr"):
        fmt = formats.StateFormat.parse(text)

        def make():
            torch.manual_seed(0)  # quantize draws a +sr format's noise from torch's generator
            buffers = make_inputs(MODELS[0], batch, fmt, device)
            buffers["outs"] = torch.full((steps,) + tuple(buffers["out"].shape), float("nan"), device=device,
                                         dtype=buffers["out"].dtype)
            return buffers

        def run(buffers, text=text):
            for i in range(steps):
                buffers["out"] = buffers["outs"][i]
                run_public(buffers, text, seed=i)

        failures += graph_matches_eager(
            f"conventional graph {text}", make, run,
            lambda b: dict(state=b["state"], state_scale=b["state_scale"], outputs=b["outs"]))
    return failures


def _output_magnitudes(values, b, rows):
    """``M·|z·σ(z)|`` for each output of ``rows`` (fp64, ``[len(rows), nheads, headdim]``), with
    ``M = Σ_n (|a·S_n| + |dt·x·B_n|)·|C_n| + |D·x|`` the magnitudes of the terms an output sums:
    ``values [len(rows), nheads, headdim, dstate]`` the rows' stored states, ``b`` the inputs of
    :func:`check_variants` (softplus dt). Outputs near zero by cancellation can differ between
    two summation orders by far more than their own bf16 ulp; this bounds by how much."""
    H, ngroups = b["x"].shape[1], b["B"].shape[1]
    dt = torch.nn.functional.softplus(b["dt"][rows].double() + b["dt_bias"].double())  # [R, H]
    a = torch.exp(dt * b["A"].double())
    Bh = b["B"][rows].double().repeat_interleave(H // ngroups, 1)  # [R, H, N]
    Ch = b["C"][rows].double().repeat_interleave(H // ngroups, 1)
    x, z = b["x"][rows].double(), b["z"][rows].double()  # [R, H, P]
    terms = (a[..., None, None] * values.double()).abs() + ((dt[..., None] * x)[..., None] * Bh[:, :, None, :]).abs()
    M = (terms * Ch[:, :, None, :].abs()).sum(-1) + (b["D"].double()[:, None] * x).abs()
    return M * (z * torch.sigmoid(z)).abs()


def check_variants(device, nheads=16, headdim=64, dstate=128, ngroups=2):
    """Every timed variant against the default path on the GPU, with padding rows: untouched
    slots bit for bit, padded outputs zero, every output within one bf16 rounding of the
    default's plus the two fp32 evaluations' error bound (another code shape contracts other
    FMAs and sums in another order: each output is within ``(dstate + 9)·2**-24·M`` of the exact
    one, ``M`` the sum of its terms' magnitudes, :func:`_output_magnitudes`; then a bf16 output
    may round the other way, ``2**-7·max(|a|, |b|)``), < 0.1 % codes differing for the same noise
    stream; with another stream than the default's (other noise) int8 codes within one step of
    the default's. Returns (failures, report rows)."""
    failures, report = [], []
    nslots, batch, H, P, N, G = 6, 4, nheads, headdim, dstate, ngroups
    indices = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=device)
    live, live_slots = [0, 2], [3, 0]
    for text in ("fp16", "bf16", "int8:row", "fp8_e4m3:row", "int8:head", "fp8_e5m2:block32", "int8:row+sr",
                 "fp8_e4m3:row+sr"):
        fmt = formats.StateFormat.parse(text)
        gen = torch.Generator(device=device).manual_seed(1)
        torch.manual_seed(1)  # quantize draws a +sr format's noise from torch's generator
        q = formats.quantize(torch.randn(nslots, H, P, N, device=device, generator=gen), fmt)
        r = lambda *shape: torch.randn(*shape, device=device, generator=gen)  # noqa: E731
        b = dict(x=r(batch, H, P).bfloat16(), z=r(batch, H, P).bfloat16(), dt=(r(batch, H) * 0.5).bfloat16(),
                 A=-torch.rand(H, device=device, generator=gen) * 8 - 1, D=torch.ones(H, device=device),
                 dt_bias=r(H) - 4, B=r(batch, G, N).bfloat16(), C=r(batch, G, N).bfloat16())
        slack = 2 * (N + 9) * 2.0 ** -24 * _output_magnitudes(formats.dequantize(q)[live_slots], b, live)
        results = {}
        if fmt.stochastic:
            variants = SR_VARIANTS
        else:
            variants = dict(RNE_VARIANTS, **(RNE_VARIANTS_8BIT if fmt.storage_dtype.itemsize == 1 else {}))
        for tag, (variant, block_p, num_warps) in variants.items():
            state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
            out = torch.full_like(b["x"], float("nan"))
            try:
                kernel.launch(
                    codec.storage_view(state, fmt), scale, b["x"], b["dt"], b["A"], b["B"], b["C"], b["D"], b["z"],
                    b["dt_bias"], indices, out, 1, None, dtype_code=codec.dtype_code(fmt),
                    granularity=codec.granularity_code(fmt), stochastic=fmt.stochastic, qmax=codec.qmax(fmt),
                    emax=codec.emax(fmt), dt_softplus=True, pad_slot_id=5, heads_per_group=H // G, block_p=block_p,
                    num_warps=num_warps, variant=variant)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as err:  # a variant that does not compile is reported, not fatal
                failures.append(f"variant {text} {tag}: {type(err).__name__}: {err}")
                continue
            results[tag] = (state, scale, out)
        if "default" not in results:
            continue
        ref_state, _, ref_out = results["default"]
        for tag, (state, scale, out) in results.items():
            untouched = all(torch.equal(bits(state[i]), bits(q.data[i])) for i in (1, 2, 4, 5))
            if scale is not None:
                untouched = untouched and all(torch.equal(bits(scale[i]), bits(q.scale[i])) for i in (1, 2, 4, 5))
            padded_zero = bool((out[1] == 0).all() and (out[3] == 0).all())
            rel = ((out[live].double() - ref_out[live].double()).norm() / ref_out[live].double().norm()).item()
            one_rounding = bool(((out[live].double() - ref_out[live].double()).abs()
                                 <= 2.0 ** -7 * torch.maximum(out[live].double().abs(), ref_out[live].double().abs())
                                 + slack).all())
            variant = variants[tag][0]
            default = kernel.DEFAULT_VARIANTS[(fmt.storage_dtype.itemsize, True)] if fmt.stochastic else None
            same_stream = not fmt.stochastic or variant is None or (
                (variant.sr_stream, variant.sr_rounds) == (default.sr_stream, default.sr_rounds))
            if same_stream:
                differing = (bits(state[[3, 0]]) != bits(ref_state[[3, 0]])).double().mean().item()
                codes_ok = differing < 1e-3
            else:
                differing = (state[[3, 0]].int() - ref_state[[3, 0]].int()).abs().max().item() if fmt.dtype == "int8" \
                    else float("nan")
                codes_ok = fmt.dtype != "int8" or differing <= 1
            ok = untouched and padded_zero and one_rounding and codes_ok
            report.append(dict(format=text, variant=tag, untouched=untouched, padded_zero=padded_zero, out_rel=rel,
                               codes_differing=differing, ok=ok))
            if not ok:
                failures.append(f"variant {text} {tag}: untouched {untouched} padded {padded_zero} out {rel:.1e} "
                                f"codes {differing}")
    return failures, report
