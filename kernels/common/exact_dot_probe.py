"""The tensor-core product of :mod:`qstate.kernels.exact_dot` alone, on whole tensors.

They exist to check those products against fp64 (tests under the interpreter, ``bench/run_gpu.py``
on the GPU, where the tensor cores run): one program multiplies one ``[P, N]`` tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import codec, exact_dot


@triton.jit
def _columns_kernel(codes_ptr, columns_ptr, out_ptr, DTYPE: tl.constexpr, PARTS: tl.constexpr, HW: tl.constexpr,
                    P: tl.constexpr, N: tl.constexpr, M: tl.constexpr):
    tile = tl.program_id(0)
    rows = tl.arange(0, P)
    cols = tl.arange(0, N)
    ms = tl.arange(0, M)
    codes = tl.load(codes_ptr + tile * P * N + rows[:, None] * N + cols[None, :])  # [P, N]
    columns = tl.load(columns_ptr + tile * M * N + ms[:, None] * N + cols[None, :])  # [M, N]
    product = exact_dot.dot_columns(exact_dot.bf16_codes(codes, DTYPE, HW), columns, PARTS, HW)  # [P, M]
    tl.store(out_ptr + tile * P * M + rows[:, None] * M + ms[None, :], product)


def state_times_columns(codes: torch.Tensor, fmt, columns: torch.Tensor) -> torch.Tensor:
    """``code values · columnsᵀ`` per tile: ``codes (tiles, P, N)`` in the storage of ``fmt``
    (a format with ``exact_dot.exact_in_bf16``, scale left out), ``columns (tiles, M, N)``
    bf16/fp16/fp32; P, N, M powers of two ≥ 16. Returns ``(tiles, P, M)`` fp32."""
    tiles, P, N = codes.shape
    M = columns.shape[1]
    out = torch.empty((tiles, P, M), dtype=torch.float32, device=codes.device)
    _columns_kernel[(tiles,)](
        codec.storage_view(codes, fmt).contiguous(), columns.contiguous(), out, DTYPE=codec.dtype_code(fmt),
        PARTS=exact_dot.input_parts(columns.dtype), HW=codec.hardware_casts(codes.device), P=P, N=N, M=M,
    )
    return out
