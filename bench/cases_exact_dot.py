"""Check of the tensor-core product (``qstate.kernels.common.exact_dot``) against fp64, for the tests
(interpreter) and ``bench/run_gpu.py`` (GPU). No timed cases: the product is timed inside the
verify kernels that use it.

Bounds (``u = 2**-24``; kernels/README.md, "exact_dot.py: exact products on tensor cores"):
every product is exact and ``PARTS · K`` of them are summed in fp32, so each output is within
``γ = PARTS·K·u`` of ``Σ|products|``; the check allows twice that (the tensor cores'
accumulation is not specified to round to nearest). The worst-case bound is loose, so the RMS of
the errors, in units of ``Σ|products|``, must also stay under ``8·sqrt(PARTS·K)·u``: a product
that lost a part of the split or rounded its inputs to tf32 is off by 2**-9 to 2**-11 of it.
"""

from __future__ import annotations

import math

import torch

from qstate import formats
from qstate.kernels.common import exact_dot, exact_dot_probe

U = 2.0 ** -24
STATE_FORMATS = ("bf16", "fp8_e4m3:row", "fp8_e5m2:row", "int8:row")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _wide(shape, generator, dtype=torch.float32):
    """Normal values spread over many binades (products of every magnitude), within fp16's
    range for fp16."""
    spread = 1.5 if dtype == torch.float16 else 3.0
    x = torch.randn(shape, generator=generator) * torch.exp(spread * torch.randn(shape, generator=generator))
    return x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)


def _every_fp8_code(fmt, n):
    """All finite codes of an fp8 format (subnormals included), repeated to ``n`` values."""
    dtype = fmt.storage_dtype
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    codes = codes[torch.isfinite(codes.to(torch.float32))]
    return codes.repeat(math.ceil(n / codes.numel()))[:n]


def _compare(name, got, exact, magnitude, parts, K):
    """(failure or None, report row) for ``got`` against fp64 ``exact`` with ``Σ|products|``."""
    error = (got.double() - exact).abs() / magnitude.clamp_min(1e-300)
    bound = 2 * parts * K * U
    rms = error.pow(2).mean().sqrt().item()
    rms_bound = 8 * math.sqrt(parts * K) * U
    row = dict(check=name, max_error=error.max().item(), bound=bound, rms_error=rms, rms_bound=rms_bound)
    bad = not torch.isfinite(got).all() or row["max_error"] > bound or rms > rms_bound
    return (f"{name}: max {row['max_error']:.2e} (bound {bound:.2e}), rms {rms:.2e} (bound {rms_bound:.2e})"
            if bad else None), row


def check_kernel(device, tiles=4, P=16, N=128, M=16):
    """The product on ``device`` for every state format and input dtype. Returns
    ``(failures, report)``."""
    failures, report = [], []
    g = torch.Generator().manual_seed(11)
    for text in STATE_FORMATS:
        fmt = formats.StateFormat.parse(text)
        codes = formats.quantize(_wide((tiles, P, N), g), fmt).data
        if fmt.dtype.startswith("fp8"):
            codes[0] = _every_fp8_code(fmt, P * N).view(P, N)  # subnormals and the extremes
        values = codes.to(torch.float64)
        for dtype in INPUT_DTYPES:
            columns = _wide((tiles, M, N), g, dtype)
            got = exact_dot_probe.state_times_columns(codes.to(device), fmt, columns.to(device)).cpu()
            c = columns.to(torch.float64)
            failure, row = _compare(f"{text} x {str(dtype).removeprefix('torch.')}", got, values @ c.transpose(1, 2),
                                    values.abs() @ c.abs().transpose(1, 2), exact_dot.input_parts(dtype), N)
            report.append(row)
            if failure:
                failures.append(failure)
    return failures, report
