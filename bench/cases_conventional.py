"""Benchmark cases and GPU correctness checks of the conventional decode kernel."""

from __future__ import annotations

import torch

import qstate
from qstate import formats, profiles, reference
from qstate.kernels import codec, codec_probe
from qstate.kernels import conventional as kernel

from .harness import Case, register

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


def run_launcher(buffers, fmt, block_p=None, num_warps=None):
    """The launcher alone, with a tile override (block-size sweeps)."""
    b = buffers
    kernel.launch(
        codec.storage_view(b["state"], fmt), b["state_scale"], b["x"], b["dt"], b["A"], b["B"], b["C"], b["D"], b["z"],
        b["dt_bias"], b["state_batch_indices"], b["out"], 1, None,
        dtype_code=codec.dtype_code(fmt), granularity=codec.granularity_code(fmt), stochastic=fmt.stochastic,
        qmax=codec.qmax(fmt), emax=codec.emax(fmt), dt_softplus=True, pad_slot_id=-1,
        heads_per_group=b["x"].shape[1] // b["B"].shape[1], block_p=block_p, num_warps=num_warps,
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


def sweep_cases(device, formats_=("fp32", "fp16", "int8:row", "fp8_e4m3:row"), block_ps=(8, 16, 32, 64),
                warps=(4, 8)):
    """Tile sweep at batch 256 of the first model (bench/run_gpu.py --sweep)."""
    return [_case(MODELS[0], 256, f, device, group="sweep", block_p=bp, num_warps=w)
            for f in formats_ for bp in block_ps for w in warps]


def eager_overhead(device):
    """µs per eager call at batch 1 (public function, and the launcher alone), fp32 state."""
    from .harness import eager_us
    fmt = formats.StateFormat.parse("fp32")
    b = make_inputs(MODELS[0], 1, fmt, device)
    return dict(public_us=eager_us(lambda: run_public(b, "fp32")), launcher_us=eager_us(lambda: run_launcher(b, fmt)))


def _bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_codec(device):
    """The codec probe on the GPU, with and without conversion instructions, vs qstate.formats:
    every format, 2**19 values per format over many binades, bit for bit. Returns failures."""
    failures = []
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 64, 128, device=device, generator=gen)
    x = x * torch.exp(4 * torch.randn(64, 64, 1, device=device, generator=gen))
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-41, 3e38])
    x[0, 1] = 0.0
    for text in ALL_FORMATS:
        fmt = formats.StateFormat.parse(text)
        for hw in (False, True):
            codes, scale, noise, values = codec_probe.quantize_heads(x, fmt, seed=5, hardware_casts=hw)
            expected = formats.quantize(x, fmt, noise=noise)
            bad = int((_bits(codes) != _bits(expected.data)).sum())
            if fmt.scaled:
                bad += int((_bits(scale) != _bits(expected.scale)).sum())
            if bad:
                failures.append(f"codec {text} hw={hw}: {bad} codes/scales differ")
    return failures


def check_kernel(device, steps=3):
    """Kernel vs decode_naive on the GPU, every format, fp32 and bf16 inputs, T steps.

    The GPU contracts ``a·S + u`` into an FMA and sums ``S·C`` in another order, so a code may
    flip where the reference's value lies within an ulp of a rounding boundary, and a flipped
    code moves later outputs by up to one grid step. So: the first step's output (same stored
    state for both) within 1e-5 relative RMS of decode_naive (4e-3 with bf16 outputs: one bf16
    rounding); < 0.1 % of the final codes different (round-to-nearest 8/16-bit formats; an fp32
    state differs in last bits by the FMA); and the error of all outputs against fp64 within
    1.5× decode_naive's own (+ the first-step bound), which also covers ``+sr``
    (other noise than the reference's). Returns (failures, rows of the report).
    """
    failures, report = [], []
    prof = profiles.Profile("check", 8, 64, 128, 2, 1)
    for input_dtype in (torch.float32, torch.bfloat16):
        inp = prof.sample_inputs(steps, 4, seed=3, device=device, dtype=input_dtype)
        for text in ALL_FORMATS:
            fmt = formats.StateFormat.parse(text)
            gen = torch.Generator(device=device).manual_seed(0)
            q = formats.quantize(torch.randn(4, 8, 64, 128, device=device, generator=gen), fmt)
            state, scale = q.data.clone(), None if q.scale is None else q.scale.clone()
            ys = []
            for t in range(steps):
                out = torch.full_like(inp.x[t], float("nan"))
                qstate.selective_state_update(state, inp.x[t], inp.dt[t], inp.A, inp.B[t], inp.C[t], inp.D, inp.z[t],
                                              inp.dt_bias, True, state_scale=scale, state_format=text, out=out,
                                              seed=t)
                ys.append(out.float())
            kw = inp.kwargs()
            kw["state0"] = formats.dequantize(q)
            y_ref, S_ref = reference.decode_naive(**kw, fmt=fmt, generator=gen)
            y_exact = reference.decode_exact(**kw)[0]
            y = torch.stack(ys)
            rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
            first = rel(y[0], y_ref[0])
            first_bound = 4e-3 if input_dtype == torch.bfloat16 else 1e-5
            differing = 0.0
            if (fmt.scaled or fmt.dtype in ("bf16", "fp16")) and not fmt.stochastic:
                differing = (_bits(state) != _bits(formats.quantize(S_ref, fmt).data)).double().mean().item()
            err, err_ref = rel(y, y_exact), rel(y_ref, y_exact)
            # Outputs in bf16 add one bf16 rounding (2**-9 relative) that decode_naive's fp32 lacks.
            ok = (bool(torch.isfinite(y).all()) and first < first_bound and differing < 1e-3
                  and err <= 1.5 * err_ref + first_bound)
            report.append(dict(format=text, inputs=str(input_dtype).replace("torch.", ""), first_step_rel=first,
                               codes_differing=differing, err_vs_fp64=err, naive_err_vs_fp64=err_ref, ok=ok))
            if not ok:
                failures.append(f"kernel {text} {input_dtype}: first {first:.2e} differing {differing:.2e} "
                                f"err {err:.2e} vs naive {err_ref:.2e}")
    return failures, report
