"""``S · Cᵀ`` of a state tile on tensor cores, with the accuracy of fp32 FMAs (kernels/README.md,
"exact_dot.py: exact products on tensor cores", also for where it did not pay).

The code values of bf16, fp8 (e4m3, e5m2) and int8 states are exact in bf16, and a product of
two bf16 values has at most 16 significant bits, so a tensor core forms it exactly and only the
fp32 accumulation rounds. An fp32 input is the exact sum of three bf16 parts (an fp16 one of
two), so a product with it is that many bf16 products. The verify kernels spent most of their
instructions on ``S · C_i`` as FMAs (one per element and draft); as a tensor-core product it is a
conversion per element and a few MMA instructions per tile.

Host helpers: ``exact_in_bf16(fmt) -> bool``, ``input_parts(dtype) -> int``.
In-kernel: ``bf16_codes(codes, DTYPE, HW)``, ``dot_columns(state, columns, PARTS, HW)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import codec
from .constants import BF16, FP8_E4M3, FP8_E5M2, INT8

_PARTS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def exact_in_bf16(fmt) -> bool:
    """Whether a state format's code values are exact in bf16 with its scale kept apart (a row
    or head scale multiplies the product afterwards; block32 scales would have to enter it)."""
    return fmt.dtype in ("bf16", "fp8_e4m3", "fp8_e5m2", "int8") and fmt.granularity in (None, "row", "head")


def input_parts(dtype: torch.dtype) -> int:
    """bf16 parts whose sum is exactly any value of an input dtype (8 significant bits each)."""
    if dtype not in _PARTS:
        raise TypeError(f"inputs of dtype {dtype} have no exact bf16 split; expected one of {list(_PARTS)}")
    return _PARTS[dtype]


@triton.jit
def bf16_codes(codes, DTYPE: tl.constexpr, HW: tl.constexpr):
    """Code values of a bf16 (raw int16 bits), fp8 (uint8 bits) or int8 tile, exact: bf16 on the
    GPU; fp32 under the interpreter, whose bf16 arithmetic and dots operate on raw bits."""
    tl.static_assert((DTYPE == BF16) | (DTYPE == FP8_E4M3) | (DTYPE == FP8_E5M2) | (DTYPE == INT8))
    if not HW:
        values = codec.decode(codes, DTYPE, HW)
    elif DTYPE == BF16:
        values = codes.to(tl.bfloat16, bitcast=True)
    elif DTYPE == FP8_E4M3:
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    elif DTYPE == FP8_E5M2:
        values = codes.to(tl.float8e5, bitcast=True).to(tl.bfloat16)
    else:
        values = codes.to(tl.bfloat16)
    return values


@triton.jit
def _dot(a, b, acc, HW: tl.constexpr):
    if HW:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _split(a):
    """fp32 ``a`` as bf16 ``(hi, mid, lo)`` with ``hi + mid + lo == a`` exactly (8 significant bits
    each; each remainder is exact in fp32 by Sterbenz, whether the cast rounds or truncates).
    Parts below bf16's normal range (|a| under 2**-110) may lose bits."""
    hi = a.to(tl.bfloat16)
    rest = a - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dot_columns(state, columns, PARTS: tl.constexpr, HW: tl.constexpr):
    """``state · columnsᵀ`` ([BLOCK_P, BLOCK_N] · [BLOCK_N, BLOCK_C] → [BLOCK_P, BLOCK_C] fp32,
    all sizes ≥ 16): ``state`` from :func:`bf16_codes`, ``columns`` in the input dtype with
    ``PARTS = input_parts(dtype)``. Every product exact (the parts of :func:`_split` sum to the
    input), the sums in fp32; the small parts are added first."""
    acc = tl.zeros([state.shape[0], columns.shape[0]], tl.float32)
    if PARTS == 1:
        acc = _dot(state, tl.trans(columns), acc, HW)
    else:
        hi, mid, lo = _split(columns.to(tl.float32))  # lo is zero for fp16 inputs (11 bits)
        if PARTS == 3:
            acc = _dot(state, tl.trans(lo), acc, HW)
        acc = _dot(state, tl.trans(mid), acc, HW)
        acc = _dot(state, tl.trans(hi), acc, HW)
    return acc
