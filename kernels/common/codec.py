"""In-kernel state codec shared by every kernel: the number rules of :mod:`qstate.formats`,
reproduced bit for bit on the GPU and under ``TRITON_INTERPRET=1``.

Why each trick is needed (the interpreter's casts are wrong, the GPU's ``/`` is approximate)
is written up in ``kernels/README.md``. Every function below is ``@triton.jit`` unless marked
"host"; the signatures are stable (new helpers are added, none renamed).

Codes of the formats (constexpr ``DTYPE``): ``FP32, BF16, FP16, FP8_E4M3, FP8_E5M2, INT8``.
Scale granularity (constexpr ``GRAN``): ``GRAN_NONE, GRAN_ROW, GRAN_HEAD, GRAN_BLOCK32``.
Noise streams of stochastic rounding (constexpr ``SR_STREAM``): ``SR_UNIFORM, SR_UNIFORM4,
SR_NOISE8``. Here they are host ints; kernels compare the constexprs of :mod:`.constants`.

Storage seen by a kernel (what :func:`storage_view` passes): fp32 → fp32, fp16 → fp16,
bf16 → int16 (raw bits), fp8_e4m3 / fp8_e5m2 → uint8 (raw bits), int8 → int8.

Host helpers (plain Python):

* ``dtype_code(fmt) -> int`` and ``granularity_code(fmt) -> int``
* ``storage_view(t: torch.Tensor, fmt) -> torch.Tensor``: the view a kernel's pointer takes
* ``hardware_casts(device) -> bool``: True on a GPU (``HW`` below), False under the interpreter
* ``qmax(fmt) -> float`` and ``emax(fmt) -> int``: the ``QMAX`` and ``EMAX`` constexprs

``HW: tl.constexpr``: True lets the GPU's exact conversion instructions (cvt.rn.satfinite) do the
rounding and the fp8/fp16/bf16 conversions; False uses exact integer/fp32 arithmetic that is
right on both (the interpreter must use False). Both give identical bits.

In-kernel functions:

* ``uniform(seed, counter) -> fp32``: u in [0, 1), a multiple of 2**-24, from the counter-based
  Philox stream ``tl.randint(seed, counter)``; ``counter`` is the element's position (int32).
* ``uniform4(seed, counter, N_ROUNDS=10) -> fp32``: the same kind of u from one Philox call per
  four elements (``tl.randint4x``): ``counter`` is ``[R, K]`` and the result ``[R, 4K]``, column
  ``4k + i`` taking word ``i`` of counter ``k``'s draw. Another stream than ``uniform``'s.
* ``noise8(seed, counter, N_ROUNDS=7) -> int32``: 16-bit noise in [0, 2**16), eight per Philox
  call (each 32-bit word split in two halves): ``counter`` is ``[R, K]`` and the result
  ``[R, 8K]``, column ``8k + 2i + h`` taking half ``h`` (0: the low 16 bits) of word ``i`` of
  counter ``k``'s draw.
* ``row_noise8(seed, element_rows, dstate, BLOCK_N, N_ROUNDS=7) -> int32``: ``noise8`` of the
  elements of whole state rows, ``[R, BLOCK_N]``: row ``r``'s octet ``k`` (its columns
  ``8k .. 8k + 7``) takes the counter ``element_rows[r] · ceil(dstate / 8) + k``. The stream
  of every ``+sr`` state store (conventional kernel, replay and speculative flushes).
* ``uniform16(noise) -> fp32``: u = ``noise · 2**-16`` in [0, 1) of ``noise8``'s noise. Another
  stream than ``uniform4``'s; 16 bits of noise against 24 move a rounding's probability by
  less than 2**-16.
* ``reciprocal_rn(s) -> fp32``: ``1 / s`` correctly rounded (per scale group, for ``divide_rn``).
* ``divide_rn(x, s, s_recip, HW) -> fp32``: ``x / s`` correctly rounded. ``HW``: one multiply and
  two FMAs with ``s_recip = reciprocal_rn(s)`` (Markstein's correction); else ``tl.div_rn``.
* ``scale_from_amax(amax, QMAX: constexpr, EMAX: constexpr, GRAN: constexpr) -> fp32``:
  ``clamp(amax / QMAX, FLT_MIN, 2**(126 - EMAX))``; for block32 the MX rule
  ``2**clamp(floor(log2(amax)) - EMAX, -126, 126 - EMAX)``.
* ``scale_from_amax_fused(amax, QMAX, EMAX, HW) -> (scale, reciprocal, unclamped)``: row/head
  scales of ``scale_from_amax`` with ``amax · RN(1/QMAX)`` for the quotient (within an ulp of
  it), an approximate ``1/scale`` (for ``encode_product``; ``HW``: the GPU's ``rcp.approx``, within
  an ulp; else the quotient), and whether the scale lies below
  the upper clamp (False for inf and NaN): then every ``|v| ≤ amax`` has ``|v·recip|`` round
  to at most QMAX, so no saturation is needed.
* ``saturate(v, QMAX: constexpr) -> fp32``: clamp to ``[-QMAX, QMAX]`` (before rounding).
* ``encode_saturating(v, u, QMAX, DTYPE, STOCHASTIC, HW)``: ``encode(saturate(v))``, the
  clamp left to the GPU's satfinite casts (e4m3, fp16, bf16) with round to nearest.
* ``encode_product(v, recip, u, QMAX, DTYPE, STOCHASTIC, HW, SATURATE)``: codes of
  ``saturate(v·recip)`` (``SATURATE``; else of ``v·recip``, for callers that know it is in
  range) with the product rounded once (int8: to an integer inside one FMA), not the quotient
  ``divide_rn`` gives: a code can differ where the quotient lies within an ulp of a rounding
  boundary. For kernels allowed to differ from the references in last bits (``FUSED``).
* ``encode_sr16(v, recip, r, QMAX, DTYPE, HW)``: codes of ``saturate(v·recip)`` rounded
  stochastically with the 16-bit noise ``r`` of ``noise8`` (u = r·2**-16), for int8, fp8 and
  bf16 (bf16: pass recip 1.0). bf16 rounds on the bits and gives ``encode``'s codes for that u
  bit for bit. int8 rounds ``v·recip`` once (inside an FMA, to 2**-15) and uses 15 bits of the
  noise; fp8 takes ``floor(q + u)`` of the product's ``q = v·recip / step`` in one addition
  (exact from the smallest normal up; e4m3 on a GPU leaves the saturation to its cast). So a
  code can differ from the references' by one step where the quotient lies near a rounding
  boundary: for kernels allowed to differ in last bits (``FUSED``), as ``encode_product``.
* ``round_rne(v, DTYPE) -> fp32``: nearest-even grid value of ``v`` (exact arithmetic).
* ``round_sr(v, u, DTYPE) -> fp32``: ``floor(v / step + u) * step`` (exact arithmetic).
* ``grid_to_codes(g, DTYPE, HW)``: grid values → storage codes (no rounding happens).
* ``encode(v, u, DTYPE, STOCHASTIC, HW)``: saturated, scaled values → storage codes
  (``u`` is ignored unless ``STOCHASTIC``; pass 0.0).
* ``decode(codes, DTYPE, HW) -> fp32``: storage codes → code values (multiply by the scale
  to dequantize: ``code * scale``, one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import constants

# The codes as host ints (table keys, plan caches); the kernels compare the constexprs of
# :mod:`.constants`, of which these are the values.
FP32 = constants.FP32.value
BF16 = constants.BF16.value
FP16 = constants.FP16.value
FP8_E4M3 = constants.FP8_E4M3.value
FP8_E5M2 = constants.FP8_E5M2.value
INT8 = constants.INT8.value

GRAN_NONE = constants.GRAN_NONE.value
GRAN_ROW = constants.GRAN_ROW.value
GRAN_HEAD = constants.GRAN_HEAD.value
GRAN_BLOCK32 = constants.GRAN_BLOCK32.value

SR_UNIFORM = constants.SR_UNIFORM.value
SR_UNIFORM4 = constants.SR_UNIFORM4.value
SR_NOISE8 = constants.SR_NOISE8.value

_DTYPE_CODES = {"fp32": FP32, "bf16": BF16, "fp16": FP16, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2, "int8": INT8}
_GRAN_CODES = {None: GRAN_NONE, "row": GRAN_ROW, "head": GRAN_HEAD, "block32": GRAN_BLOCK32}
_STORAGE_VIEWS = {BF16: torch.int16, FP8_E4M3: torch.uint8, FP8_E5M2: torch.uint8}


def dtype_code(fmt) -> int:
    """Host: the ``DTYPE`` constexpr of a :class:`qstate.formats.StateFormat`."""
    return _DTYPE_CODES[fmt.dtype]


def granularity_code(fmt) -> int:
    """Host: the ``GRAN`` constexpr of a :class:`qstate.formats.StateFormat`."""
    return _GRAN_CODES[fmt.granularity]


def storage_view(t: torch.Tensor, fmt) -> torch.Tensor:
    """Host: the view of a state tensor (in ``fmt.storage_dtype``) that a kernel pointer takes."""
    view = _STORAGE_VIEWS.get(dtype_code(fmt))
    return t if view is None else t.view(view)


def hardware_casts(device: torch.device) -> bool:
    """Host: whether kernels on ``device`` may use the GPU's conversion instructions."""
    return device.type == "cuda"


def qmax(fmt) -> float:
    """Host: the ``QMAX`` constexpr (largest code magnitude) of a format."""
    return float(fmt.qmax)


def emax(fmt) -> int:
    """Host: the ``EMAX`` constexpr, ``floor(log2(qmax))``, of a scaled format (0 otherwise)."""
    return int(fmt.emax) if fmt.scaled else 0


@triton.jit
def uniform(seed, counter):
    # The top 24 of 32 random bits: exact in fp32, so 1 - u is exact too (needed by round_sr).
    bits = tl.randint(seed, counter)
    return (bits >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def uniform4(seed, counter, N_ROUNDS: tl.constexpr = 10):
    w0, w1, w2, w3 = tl.randint4x(seed, counter, N_ROUNDS)
    # join(join(w0, w2), join(w1, w3))[r, k, b, a] is word 2b + a: row-major order puts it at 4k + 2b + a.
    interleaved = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [R, K, 2, 2]
    bits = tl.reshape(interleaved, [counter.shape[0], counter.shape[1] * 4])
    return (bits >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def noise8(seed, counter, N_ROUNDS: tl.constexpr = 7):
    w0, w1, w2, w3 = tl.randint4x(seed, counter, N_ROUNDS)
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [counter.shape[0], counter.shape[1] * 4])
    halves = tl.join(words & 0xFFFF, words >> 16)  # [R, 4K, 2]: column 4k + i of words is word i
    return tl.reshape(halves, [counter.shape[0], counter.shape[1] * 8]).to(tl.int32)


@triton.jit
def row_noise8(seed, element_rows, dstate, BLOCK_N: tl.constexpr, N_ROUNDS: tl.constexpr = 7):
    octets = tl.arange(0, BLOCK_N // 8)
    counter = (element_rows[:, None] * ((dstate + 7) // 8) + octets[None, :]).to(tl.int32)  # [R, BLOCK_N // 8]
    return noise8(seed, counter, N_ROUNDS)  # [R, BLOCK_N]


@triton.jit
def uniform16(noise):
    return noise.to(tl.float32) * 1.52587890625e-05


@triton.jit
def reciprocal_rn(s):
    return tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def divide_rn(x, s, s_recip, HW: tl.constexpr):
    if HW:
        q = x * s_recip
        # The residual's negation, q·s − x, subtracted: q − (q·s − x)·r is the same rounded value
        # as q + (x − q·s)·r (rounding is symmetric), and when q is ±0 the residual is +0, so
        # q − (+0) keeps q's sign where q + (+0) would turn −0 into +0. Two instructions per
        # element fewer than selecting q on a zero residual (kernels/README.md, codec).
        # Negated as "* -1.0" (a sign flip, folded into the FMA): Triton's unary minus is
        # 0 − v, which gives +0 for +0.
        negated_residual = tl.fma(q, s, x * -1.0)
        q = tl.fma(negated_residual * -1.0, s_recip, q)
    else:
        q = tl.div_rn(x, s)
    return q


@triton.jit
def _pow2(exponent):
    """2**exponent for an int32 exponent in the normal fp32 range."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_from_amax(amax, QMAX: tl.constexpr, EMAX: tl.constexpr, GRAN: tl.constexpr):
    if GRAN == constants.GRAN_BLOCK32:
        # MX rule on floor(log2(amax)), read from the exponent bits. As in formats rule 2, zero and
        # NaN count as exponent -1 (torch.frexp's), inf as FLT_MAX's 127 (so the block saturates
        # at the largest scale), and subnormals fall under the -126 clamp.
        biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
        special = tl.where(amax == amax, 127, -1)  # biased 255: inf, or NaN (amax != amax)
        floor_log2 = tl.where((biased == 0) & (amax == 0.0), -1, tl.where(biased == 255, special, biased - 127))
        exponent = tl.minimum(tl.maximum(floor_log2 - EMAX, -126), 126 - EMAX)
        s = _pow2(exponent)
    else:
        s, _ = _clamp_scale(tl.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), EMAX)
    return s


@triton.jit
def scale_from_amax_fused(amax, QMAX: tl.constexpr, EMAX: tl.constexpr, HW: tl.constexpr):
    s, unclamped = _clamp_scale(amax * (1.0 / QMAX), EMAX)
    if HW:
        # One MUFU.RCP: Triton's 1/s is a correctly rounded quotient with a slow-path check.
        recip = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [s], dtype=tl.float32,
                                          is_pure=True, pack=1)
    else:
        recip = 1.0 / s
    return s, recip, unclamped


@triton.jit
def _clamp_scale(s, EMAX: tl.constexpr):
    # (the scale clamped to [smallest normal, 2**(126 - EMAX)], whether it was under the upper bound)
    largest = _pow2(tl.full(s.shape, 126 - EMAX, tl.int32))
    return tl.minimum(tl.maximum(s, 1.1754943508222875e-38), largest), s <= largest


@triton.jit
def saturate(v, QMAX: tl.constexpr):
    return tl.minimum(tl.maximum(v, -QMAX), QMAX)


@triton.jit
def encode_saturating(v, u, QMAX: tl.constexpr, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, HW: tl.constexpr):
    """``encode(saturate(v, QMAX), ...)``. The GPU's fp8 e4m3 cast (``cvt.rn.satfinite``, sm_89
    and later; Triton has no e4m3 cast below) clamps finite values and inf to ±448 itself, so
    with round to nearest the clamp is left to it: two instructions per element fewer. A NaN
    then gives a NaN code, as the reference's clamp-then-cast does (the clamp's max/min would
    give −448). fp16 and bf16 take the same route through an inline ``cvt.rn.satfinite.f16x2.f32``
    (``.bf16x2.f32``)."""
    if HW and DTYPE == constants.FP8_E4M3 and not STOCHASTIC:
        codes = encode(v, u, DTYPE, STOCHASTIC, HW)
    elif HW and DTYPE == constants.FP16 and not STOCHASTIC:
        # The same for fp16 with cvt's .satfinite (PTX ISA 8.1): clamped to ±65504 after
        # rounding, the codes of clamping first; Triton's own cast has no such form.
        codes = tl.inline_asm_elementwise("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;", "=r,r,r", [v],
                                          dtype=tl.float16, is_pure=True, pack=2)
    elif HW and DTYPE == constants.BF16 and not STOCHASTIC:
        # And for bf16 (clamped to the largest finite bf16), stored as its bits.
        codes = tl.inline_asm_elementwise("cvt.rn.satfinite.bf16x2.f32 $0, $2, $1;", "=r,r,r", [v],
                                          dtype=tl.bfloat16, is_pure=True, pack=2).to(tl.int16, bitcast=True)
    else:
        codes = encode(saturate(v, QMAX), u, DTYPE, STOCHASTIC, HW)
    return codes


@triton.jit
def encode_product(v, recip, u, QMAX: tl.constexpr, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr,
                   HW: tl.constexpr, SATURATE: tl.constexpr):
    if DTYPE == constants.INT8 and not STOCHASTIC:
        # 1.5·2**23 added inside the FMA rounds v·recip to an integer (nearest-even); the clamp
        # on the shifted value is the saturation (max/min return the number for a NaN: −QMAX).
        shifted = tl.fma(v, recip, tl.full(v.shape, 12582912.0, tl.float32))
        if SATURATE:
            shifted = tl.minimum(tl.maximum(shifted, 12582912.0 - QMAX), 12582912.0 + QMAX)
        codes = (shifted.to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)
    elif SATURATE:
        codes = encode_saturating(v * recip, u, QMAX, DTYPE, STOCHASTIC, HW)
    else:
        codes = encode(v * recip, u, DTYPE, STOCHASTIC, HW)
    return codes


@triton.jit
def encode_sr16(v, recip, r, QMAX: tl.constexpr, DTYPE: tl.constexpr, HW: tl.constexpr):
    if DTYPE == constants.INT8:
        # t = v·recip + 384 rounded once: in [384 − QMAX, 384 + QMAX] = [257, 511] after the clamp
        # (the saturation; max/min return the number for a NaN: −QMAX), a multiple of 2**-15, so
        # its low 15 mantissa bits plus 15 bits of noise carry into the integer part exactly as
        # floor(t + u) does.
        t = tl.fma(v, recip, tl.full(v.shape, 384.0, tl.float32))
        t = tl.minimum(tl.maximum(t, 384.0 - QMAX), 384.0 + QMAX)
        codes = ((t.to(tl.int32, bitcast=True) + (r >> 1) - 0x43C00000) >> 15).to(tl.int8)
    elif DTYPE == constants.FP8_E4M3 or DTYPE == constants.FP8_E5M2:
        MANT_BITS: tl.constexpr = 3 if DTYPE == constants.FP8_E4M3 else 2
        MIN_EXP: tl.constexpr = -6 if DTYPE == constants.FP8_E4M3 else -14
        w = v * recip
        if not (HW and DTYPE == constants.FP8_E4M3):
            # The GPU's e4m3 cast saturates (encode_saturating); the others need the clamp first.
            w = saturate(w, QMAX)
        # q = w / step is exact (a power of two) and q + u too for |q| >= 2**MANT_BITS (u a
        # multiple of 2**-16, q of 2**(MANT_BITS - 23)); below the smallest normal the sum can
        # round, and floor() then move by one where it lands within an ulp of an integer.
        k = _step_exponent(w, MANT_BITS, MIN_EXP)
        g = tl.floor(w * _pow2(-k) + uniform16(r)) * _pow2(k)
        codes = grid_to_codes(g, DTYPE, HW)
    else:
        tl.static_assert(DTYPE == constants.BF16)
        bits = saturate(v * recip, QMAX).to(tl.int32, bitcast=True)
        # The magnitude plus noise in its 16 dropped bits moves up a step iff f + u >= 1 (f the
        # dropped fraction); for v < 0 the noise is complemented (65535 - r), so it moves up iff
        # f > u: what floor(v/step + u) does to a negative v.
        magnitude = ((bits & 0x7FFFFFFF) + ((r ^ (bits >> 31)) & 0xFFFF)) & -65536
        # floor() gives +0 when a negative value rounds to zero; keep the sign of nonzero results only.
        codes = (tl.where(magnitude == 0, 0, magnitude | (bits & -2147483648)) >> 16).to(tl.int16)
    return codes


@triton.jit
def _step_exponent(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Exponent k of the grid step at v: 2**(max(exponent(v), MIN_EXP) - MANT_BITS)."""
    biased = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.maximum(biased - 127, MIN_EXP) - MANT_BITS


@triton.jit
def _rint_magnitude(q):
    # Adding 1.5·2**23 rounds |q| < 2**22 to an integer, nearest-even; subtracting is exact.
    return (q + 12582912.0) - 12582912.0


@triton.jit
def _copy_sign(magnitude, v):
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _float_grid_rne(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    k = _step_exponent(v, MANT_BITS, MIN_EXP)
    q = tl.abs(v) * _pow2(-k)
    return _copy_sign(_rint_magnitude(q) * _pow2(k), v)


@triton.jit
def _bf16_bits_rne(v):
    """fp32 bits of v rounded to the bf16 grid (its top 16 bits), nearest-even."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536


@triton.jit
def round_rne(v, DTYPE: tl.constexpr):
    if DTYPE == constants.INT8:
        g = _copy_sign(_rint_magnitude(tl.abs(v)), v)
    elif DTYPE == constants.BF16:
        g = _bf16_bits_rne(v).to(tl.float32, bitcast=True)
    elif DTYPE == constants.FP16:
        g = _float_grid_rne(v, 10, -14)
    elif DTYPE == constants.FP8_E4M3:
        g = _float_grid_rne(v, 3, -6)
    elif DTYPE == constants.FP8_E5M2:
        g = _float_grid_rne(v, 2, -14)
    else:
        g = v
    return g


@triton.jit
def _float_grid_sr(v, u, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    # floor(q + u) = floor(q) + [frac(q) >= 1 - u]; every term is exact in fp32.
    k = _step_exponent(v, MANT_BITS, MIN_EXP)
    q = v * _pow2(-k)
    whole = tl.floor(q)
    up = (q - whole) >= (1.0 - u)
    return (whole + up.to(tl.float32)) * _pow2(k)


@triton.jit
def _bf16_bits_sr(v, u):
    # Sign-magnitude bits: the magnitude moves up one bf16 step when floor(v/step + u) says so;
    # with f the dropped fraction (24-bit integer F) and u = j·2**-24: v >= 0 rounds up iff
    # j + F >= 2**24, v < 0 iff j < F.
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    fraction = (magnitude & 0xFFFF) << 8
    j = (u * 16777216.0).to(tl.int32)
    up = tl.where(bits < 0, j < fraction, (j + fraction) >= 16777216)
    rounded = (magnitude & -65536) + (up.to(tl.int32) << 16)
    # floor() gives +0 when a negative value rounds to zero; keep the sign of nonzero results only.
    return tl.where(rounded == 0, 0, rounded | (bits & -2147483648))


@triton.jit
def round_sr(v, u, DTYPE: tl.constexpr):
    if DTYPE == constants.INT8:
        whole = tl.floor(v)
        g = whole + ((v - whole) >= (1.0 - u)).to(tl.float32)
    elif DTYPE == constants.BF16:
        g = _bf16_bits_sr(v, u).to(tl.float32, bitcast=True)
    elif DTYPE == constants.FP16:
        g = _float_grid_sr(v, u, 10, -14)
    elif DTYPE == constants.FP8_E4M3:
        g = _float_grid_sr(v, u, 3, -6)
    elif DTYPE == constants.FP8_E5M2:
        g = _float_grid_sr(v, u, 2, -14)
    else:
        g = v
    return g


@triton.jit
def _fp8_bits(g, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bits (int32 in [0, 255]) of a value exactly on the fp8 grid, with integer ops only."""
    bits = g.to(tl.int32, bitcast=True)
    magnitude = tl.abs(g)
    normal = (((bits & 0x7FFFFFFF) >> (23 - MANT_BITS)) - ((127 - BIAS) << MANT_BITS))
    smallest_normal = _pow2(tl.full(g.shape, MIN_EXP, tl.int32))
    # min() keeps the unused branch in range, so the float → int conversion never overflows.
    subnormal = (tl.minimum(magnitude, smallest_normal) * _pow2(tl.full(g.shape, MANT_BITS - MIN_EXP, tl.int32))).to(tl.int32)
    code = tl.where(magnitude < smallest_normal, subnormal, normal)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _fp8_value(code, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, BIAS: tl.constexpr):
    """fp32 value of fp8 bits (int32 in [0, 255]), with integer ops only."""
    exponent_field = (code >> MANT_BITS) & ((1 << (7 - MANT_BITS)) - 1)
    mantissa = code & ((1 << MANT_BITS) - 1)
    normal = (((code & 0x7F) << (23 - MANT_BITS)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * _pow2(tl.full(code.shape, MIN_EXP - MANT_BITS, tl.int32))
    magnitude = tl.where(exponent_field == 0, subnormal, normal)
    return tl.where((code & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def grid_to_codes(g, DTYPE: tl.constexpr, HW: tl.constexpr):
    if DTYPE == constants.INT8:
        codes = g.to(tl.int32).to(tl.int8)
    elif DTYPE == constants.BF16:
        codes = (g.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    elif DTYPE == constants.FP16:
        codes = g.to(tl.float16)
    elif DTYPE == constants.FP8_E4M3:
        if HW:
            codes = g.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            codes = _fp8_bits(g, 3, -6, 7).to(tl.uint8)
    elif DTYPE == constants.FP8_E5M2:
        if HW:
            codes = g.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            codes = _fp8_bits(g, 2, -14, 15).to(tl.uint8)
    else:
        codes = g
    return codes


@triton.jit
def encode(v, u, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, HW: tl.constexpr):
    if STOCHASTIC:
        codes = grid_to_codes(round_sr(v, u, DTYPE), DTYPE, HW)
    elif HW and DTYPE == constants.BF16:
        codes = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
    elif HW and DTYPE == constants.FP16:
        codes = v.to(tl.float16)
    elif HW and DTYPE == constants.FP8_E4M3:
        codes = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif HW and DTYPE == constants.FP8_E5M2:
        codes = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    elif DTYPE == constants.INT8:
        # 1.5·2**23 + v rounds to nearest-even; its low mantissa bits are then the integer.
        codes = ((v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)
    else:
        codes = grid_to_codes(round_rne(v, DTYPE), DTYPE, HW)
    return codes


@triton.jit
def decode(codes, DTYPE: tl.constexpr, HW: tl.constexpr):
    if DTYPE == constants.BF16:
        values = (codes.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == constants.FP8_E4M3:
        if HW:
            values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            values = _fp8_value(codes.to(tl.int32), 3, -6, 7)
    elif DTYPE == constants.FP8_E5M2:
        if HW:
            values = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            values = _fp8_value(codes.to(tl.int32), 2, -14, 15)
    else:
        values = codes.to(tl.float32)
    return values
