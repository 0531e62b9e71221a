"""In-place store-and-reload of a state in a format: ``S ← dequantize(quantize(S, fmt))``.

The drift engine keeps every stored state as the fp32 values it decodes to; this module gives
those values with as few passes over memory as torch allows, bit for bit equal to
:func:`qstate.formats.quantize` followed by :func:`qstate.formats.dequantize`:

* round-to-nearest-even goes through torch's own casts for bf16 and fp16 (fp32 → bf16 / fp16
  round to nearest even, subnormals included) after the explicit clamp to ``±qmax``, so no cast
  ever sees an out-of-range value (the torch-version differences in docs/design.md#triton-interpreter
  are about those) and for fp8_e5m2 (fp16's top byte); fp8_e4m3 rounds in fp32 arithmetic instead
  (:func:`_round_to_grid_`, 6× faster than torch's e4m3 → fp32 cast on the CPU), to the same
  bits, signed zeros included;
  int8 uses ``torch.round`` (half to even);
* stochastic rounding draws its noise exactly as :func:`qstate.formats.quantize` does, so a
  generator seeded like the one given to :func:`qstate.reference.decode_naive` draws the same
  noise, and rounds with the same exact fp32 arithmetic as :func:`qstate.formats.round_to_grid`.

On request it also gives the codes: the grid values before the scale multiply, equal to
``quantize(...).data.float()`` (for unscaled formats the values themselves). The drift engine
compares them between steps: with a per-row or per-head scale the values change whenever the
row maximum does, the codes only when the rounding moves.

``tests/test_schemes.py`` checks both equalities on values spanning subnormals, ties and saturation;
``tests/test_formats.py`` on groups holding ±inf, next to one holding NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from qstate.formats import BLOCK, DTYPES, FLT_MAX, FLT_MIN, StateFormat, grid_step

__all__ = ["roundtrip_"]

_MANTISSA = 23  # explicit mantissa bits of fp32
_EXPONENT_BIAS = 127
_EXPONENT_BITS = 0x7F800000  # the exponent field of an fp32 (sign and mantissa cleared)


def _exponent_field(v: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The fp32 exponent field (bits, as int32) of ``2**max(floor(log2|v|), min_exponent)``
    for each fp32 value of ``v`` (zero and subnormals fall below every format's smallest normal)."""
    info = DTYPES[fmt.dtype]
    lowest = (info.min_exponent + _EXPONENT_BIAS) << _MANTISSA
    return (v.view(torch.int32) & _EXPONENT_BITS).clamp_(min=lowest)


def _fast_grid_step(v: torch.Tensor, fmt: StateFormat) -> Optional[torch.Tensor]:
    """:func:`qstate.formats.grid_step` of fp32 ``v`` in three passes, by subtracting the mantissa
    bits in the exponent field; None for a format whose smallest step is an fp32 subnormal (bf16)."""
    info = DTYPES[fmt.dtype]
    if info.min_exponent - info.mantissa_bits < 1 - _EXPONENT_BIAS:
        return None
    return _exponent_field(v, fmt).sub_(info.mantissa_bits << _MANTISSA).view(torch.float32)


def _round_to_grid_(v: torch.Tensor, fmt: StateFormat) -> None:
    """In place, round fp32 ``v`` (already clamped to ±qmax) to nearest even on the grid of a float
    ``fmt`` whose codes stay below 2**104 (not bf16): ``(v + c) − c`` with ``c = 1.5·2**23·step`` rounds at exactly ``step``, since ``v + c``
    lies in ``c``'s binade, where the fp32 spacing is ``step`` and ties go to the even multiple (the
    even code). ``x − x`` is +0, so the sign goes back on from ``v`` (fp8 keeps −0)."""
    info = DTYPES[fmt.dtype]
    c = _exponent_field(v, fmt).add_(((_MANTISSA - info.mantissa_bits) << _MANTISSA) | (1 << (_MANTISSA - 1)))
    c = c.view(torch.float32)
    rounded = v + c
    rounded.sub_(c)
    torch.copysign(rounded, v, out=v)


def _scale(grouped: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The fp32 scale of each group (rules 1–2 of :mod:`qstate.formats`), shaped to broadcast
    against ``grouped`` (the state, or for ``block32`` its ``(..., dstate // 32, 32)`` view)."""
    dims = (-2, -1) if fmt.granularity == "head" else -1
    # abs().amax() rather than an inf-norm: torch's inf-norm over a short last dimension (32) runs
    # about 50× slower on the CPU.
    amax = grouped.abs().amax(dim=dims, keepdim=True)
    if fmt.granularity != "block32":
        return torch.clamp(amax / fmt.qmax, FLT_MIN, fmt.max_scale)
    # As in formats.compute_scale: an inf amax counts as FLT_MAX (frexp gives inf the exponent 0).
    _, exp = torch.frexp(amax.clamp(max=FLT_MAX))
    shared = torch.clamp(exp - 1 - fmt.emax, min=-126, max=126 - fmt.emax)
    return torch.ldexp(torch.ones_like(amax), shared)


def roundtrip_(values: torch.Tensor, fmt: StateFormat, generator: Optional[torch.Generator] = None,
               codes_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Replace fp32 ``values (..., headdim, dstate)`` by their stored-and-reloaded values; returns it.
    ``codes_out`` (fp32, shaped like ``values``), when given, receives the codes as grid
    values: ``quantize(values, fmt).data.float()``."""
    if fmt.dtype == "fp32":
        if codes_out is not None:
            codes_out.copy_(values)
        return values
    if fmt.stochastic:
        # The same draw as quantize() makes, so a generator seeded like decode_naive's agrees.
        device = values.device if generator is None else generator.device
        noise = torch.rand(values.shape, generator=generator, device=device).to(values.device)
    grouped = values.unflatten(-1, (-1, BLOCK)) if fmt.granularity == "block32" else values
    scale = _scale(grouped, fmt) if fmt.scaled else None
    if scale is not None:
        grouped.div_(scale)
    grouped.clamp_(-fmt.qmax, fmt.qmax)
    if fmt.stochastic:
        _stochastic_round_(values, fmt, noise)
    elif fmt.dtype == "int8":
        grouped.round_()
    elif fmt.dtype == "fp8_e4m3":
        _round_to_grid_(values, fmt)
    else:
        grouped.copy_(grouped.to(fmt.storage_dtype))
    if codes_out is not None:
        codes_out.copy_(values)
    if scale is not None:
        grouped.mul_(scale)
    return values


def _stochastic_round_(v: torch.Tensor, fmt: StateFormat, noise: torch.Tensor) -> None:
    """In place, :func:`qstate.formats.round_to_grid` with noise: ``floor(v/step + u)·step`` as
    ``floor(y) + [1 − u ≤ y − floor(y)]``, exact in fp32, with one temporary besides the noise."""
    step = None
    if fmt.dtype != "int8":
        step = _fast_grid_step(v, fmt)
        if step is None:
            step = grid_step(v, fmt)
        v.div_(step)
    low = torch.floor(v)
    v.sub_(low)  # the fraction, exact
    up = torch.le(noise.neg_().add_(1.0), v)  # 1 − u is exact for u a multiple of 2**-24
    torch.add(low, up, out=v)
    if step is not None:
        v.mul_(step)
