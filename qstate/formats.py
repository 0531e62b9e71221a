"""State formats and their codecs (quantize / dequantize), in plain torch.

A format string is ``<dtype>[:<granularity>][+sr]`` (docs/design.md#formats):

* dtype: ``fp32``, ``bf16``, ``fp16``, ``fp8_e4m3`` (max 448), ``fp8_e5m2`` (max 57344),
  ``int8`` (symmetric, ±127).
* granularity of the fp32 scale, 8-bit dtypes only (default ``row``), for a state shaped
  ``(..., headdim, dstate)``:

  - ``row``: one scale per ``(..., headdim)`` row over dstate; scale shape ``(..., headdim)``;
  - ``head``: one scale per ``(...)`` over ``(headdim, dstate)``; scale shape ``(...)``;
  - ``block32``: one power-of-two scale per 32 consecutive dstate values;
    scale shape ``(..., headdim, dstate // 32)``.
* ``+sr``: stochastic rounding instead of round-to-nearest-even (not for fp32).

Number rules, which every kernel reproduces bit for bit:

1. ``amax`` = max |x| over the group, in fp32.
2. ``scale = clamp(amax / qmax, FLT_MIN, max_scale)`` (one fp32 division) with
   ``max_scale = 2**(126 − emax)`` and ``emax = floor(log2(qmax))`` (8, 15, 6), so that
   ``qmax · scale`` is finite. ``block32`` uses the MX rule instead:
   ``scale = 2**clamp(floor(log2(amax)) − emax, −126, 126 − emax)``, so values in
   ``(qmax, 2**(emax+1)) · scale`` saturate. This keeps ``quantize(dequantize(q))`` equal to
   ``q``'s codes, which a round-up power of two does not (its scale too, except for a block32
   group so small that all its codes round to zero at the smallest scale ``2**−126``: its zero
   values come back with the zero group's scale). A zero group gets the smallest scale
   (``FLT_MIN``, or ``2**(−1 − emax)`` for block32) and all-zero codes. An inf saturates to
   ``qmax · max_scale`` (for block32, an inf ``amax`` counts as ``FLT_MAX``).
3. ``v = x / scale`` (one fp32 division), clamped to ``[-qmax, qmax]`` *before* rounding.
4. ``v`` is rounded once onto the grid of the code dtype: round-to-nearest-even, or with
   ``+sr`` ``floor(v / step + u) * step`` with ``u ~ U[0, 1)`` and ``step`` the grid spacing at
   ``v``. Values saturate at ±qmax, never become inf or NaN.
5. ``dequantize`` is ``code * scale`` in fp32 (one rounding).

Unscaled 16-bit formats follow rules 3–4 with ``scale = 1`` and ``qmax`` the dtype's largest
finite value (saturating instead of overflowing to inf).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from . import _validate

__all__ = [
    "DTYPES",
    "GRANULARITIES",
    "StateFormat",
    "QuantizedState",
    "quantize",
    "dequantize",
    "round_to_grid",
    "as_format",
]

FLT_MIN = torch.finfo(torch.float32).tiny
FLT_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class _DtypeInfo:
    storage: torch.dtype
    qmax: float
    mantissa_bits: int  # explicit mantissa bits of the grid (0 for int8: unit steps)
    min_exponent: int  # exponent of the smallest normal; below it the step is constant
    scaled: bool
    bytes: int


DTYPES: dict[str, _DtypeInfo] = {
    "fp32": _DtypeInfo(torch.float32, FLT_MAX, 23, -126, False, 4),
    "bf16": _DtypeInfo(torch.bfloat16, torch.finfo(torch.bfloat16).max, 7, -126, False, 2),
    "fp16": _DtypeInfo(torch.float16, 65504.0, 10, -14, False, 2),
    "fp8_e4m3": _DtypeInfo(torch.float8_e4m3fn, 448.0, 3, -6, True, 1),
    "fp8_e5m2": _DtypeInfo(torch.float8_e5m2, 57344.0, 2, -14, True, 1),
    "int8": _DtypeInfo(torch.int8, 127.0, 0, 0, True, 1),
}
GRANULARITIES = ("row", "head", "block32")
BLOCK = 32


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """A parsed state format; build it with :meth:`parse`. ``str()`` gives the canonical string."""

    dtype: str
    granularity: Optional[str] = None
    stochastic: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"format dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        info = DTYPES[self.dtype]
        if info.scaled:
            if self.granularity is None:
                object.__setattr__(self, "granularity", "row")
            elif self.granularity not in GRANULARITIES:
                raise ValueError(
                    f"format granularity: expected one of {list(GRANULARITIES)}, got {self.granularity!r}"
                )
        elif self.granularity is not None:
            raise ValueError(
                f"format granularity: {self.dtype} has no scale, so no granularity; got {self.granularity!r}"
            )
        if not isinstance(self.stochastic, bool):
            raise TypeError(f"format stochastic: expected a bool, got {self.stochastic!r}")
        if self.stochastic and self.dtype == "fp32":
            raise ValueError("format '+sr': stochastic rounding needs a narrower dtype than fp32")

    @classmethod
    def parse(cls, text: Union[str, "StateFormat"]) -> "StateFormat":
        """Parse ``'<dtype>[:<granularity>][+sr]'``, e.g. ``'int8:row+sr'`` or ``'bf16'``."""
        if isinstance(text, StateFormat):
            return text
        if not isinstance(text, str):
            raise TypeError(f"format: expected a str or StateFormat, got {type(text).__name__}")
        body, sr = text.strip(), False
        if body.endswith("+sr"):
            body, sr = body[: -len("+sr")], True
        dtype, colon, gran = body.partition(":")
        if dtype not in DTYPES or (colon and gran not in GRANULARITIES):
            raise ValueError(
                f"format: unknown format {text!r}; expected '<dtype>[:<granularity>][+sr]' with dtype in "
                f"{sorted(DTYPES)} and granularity in {list(GRANULARITIES)} (8-bit dtypes only)"
            )
        return cls(dtype, gran or None, sr)

    def __str__(self) -> str:
        return self.dtype + (f":{self.granularity}" if self.granularity else "") + ("+sr" if self.stochastic else "")

    @property
    def storage_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype].storage

    @property
    def qmax(self) -> float:
        """Largest code magnitude: 448, 57344, 127, or the dtype's largest finite value."""
        return DTYPES[self.dtype].qmax

    @property
    def emax(self) -> int:
        """Exponent of the top binade of the codes, ``floor(log2(qmax))``: 8, 15 or 6 for 8-bit."""
        return math.frexp(self.qmax)[1] - 1

    @property
    def max_scale(self) -> float:
        """Largest scale, ``2**(126 − emax)``: ``qmax · scale`` stays finite in fp32."""
        return 2.0 ** (126 - self.emax)

    @property
    def scaled(self) -> bool:
        return DTYPES[self.dtype].scaled

    def scale_shape(self, shape) -> Optional[tuple]:
        """Shape of the fp32 scale for a state of ``shape = (..., headdim, dstate)``; None if unscaled.
        Rejects the shapes :func:`quantize` rejects."""
        try:
            shape = tuple(shape)
        except TypeError:
            raise TypeError(f"shape: expected a sequence of ints, got {type(shape).__name__}") from None
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise TypeError(f"shape: expected a sequence of ints >= 0, got {shape}")
        _check_state_shape("shape", shape, self)
        if not self.scaled:
            return None
        if self.granularity == "row":
            return shape[:-1]
        if self.granularity == "head":
            return shape[:-2]
        return shape[:-1] + (shape[-1] // BLOCK,)

    def bytes_per_element(self, dstate: int, headdim: Optional[int] = None) -> float:
        """Bytes held per state element, fp32 scales included.

        ``head`` granularity needs ``headdim`` (one scale per ``headdim × dstate``).
        """
        _validate.positive_int("dstate", dstate)
        if headdim is not None:
            _validate.positive_int("headdim", headdim)
        if self.granularity == "block32" and dstate % BLOCK:
            raise ValueError(f"dstate: block32 needs dstate % 32 == 0, got {dstate}")
        data = DTYPES[self.dtype].bytes
        if not self.scaled:
            return float(data)
        if self.granularity == "row":
            return data + 4.0 / dstate
        if self.granularity == "block32":
            return data + 4.0 / BLOCK
        if headdim is None:
            raise ValueError("headdim: needed for the bytes of a 'head'-granularity scale, got None")
        return data + 4.0 / (headdim * dstate)


FormatLike = Union[str, StateFormat]


def as_format(fmt: FormatLike, name: str = "fmt") -> StateFormat:
    """``StateFormat.parse`` with the argument's name in the error message."""
    try:
        return StateFormat.parse(fmt)
    except (ValueError, TypeError) as err:
        raise type(err)(f"{name}: {err}") from None


@dataclasses.dataclass
class QuantizedState:
    """Codes in the format's storage dtype, shaped like the state, and the fp32 scale (or None)."""

    data: torch.Tensor
    scale: Optional[torch.Tensor]
    fmt: StateFormat


def _check_state_shape(name: str, shape: tuple, fmt: StateFormat) -> None:
    # An empty row or head has no amax, so no scale: headdim and dstate must be at least 1.
    if len(shape) < 2 or min(shape[-2:]) < 1:
        raise ValueError(f"{name}: expected shape (..., headdim, dstate) with headdim, dstate >= 1, got {shape}")
    if fmt.granularity == "block32" and shape[-1] % BLOCK:
        raise ValueError(f"{name}: block32 needs dstate % 32 == 0, got dstate {shape[-1]}")


def _check_state(x: torch.Tensor, fmt: StateFormat) -> None:
    _validate.tensor("x", x)
    _check_state_shape("x", tuple(x.shape), fmt)


def _check_noise(noise, x: torch.Tensor, fmt: StateFormat) -> None:
    if not fmt.stochastic:
        raise ValueError(f"noise: only stochastic ('+sr') formats take noise, got format {fmt}")
    _validate.tensor("noise", noise)
    if noise.shape != x.shape:
        raise ValueError(f"noise: expected shape {tuple(x.shape)}, got {tuple(noise.shape)}")
    # round_to_grid is exact only for fp32 noise in [0, 1) on the 2**-24 grid torch.rand draws from.
    u = noise.float()
    if not bool(((u >= 0) & (u < 1) & (torch.floor(u * 2.0**24) == u * 2.0**24)).all()):
        raise ValueError(f"noise: expected multiples of 2**-24 in [0, 1), got values in "
                         f"[{u.min().item()}, {u.max().item()}]")


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2**exponent`` as fp32 for int32 exponents in [-149, 127], built from its bits (exact,
    subnormals included, and much faster than ``ldexp`` on the CPU)."""
    normal = (exponent + 127).clamp(min=1) << 23
    subnormal = 1 << (exponent + 149).clamp(min=0, max=22)
    return torch.where(exponent >= -126, normal, subnormal).to(torch.int32).view(torch.float32)


def grid_step(v: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Spacing of the code grid of a float ``fmt`` at each fp32 value ``v`` (in code units):
    ``2**(max(floor(log2|v|), min_exponent) − mantissa_bits)``, read off the fp32 exponent bits
    (zero and fp32 subnormals fall below every format's smallest normal exponent)."""
    info = DTYPES[fmt.dtype]
    biased = (v.float().view(torch.int32) >> 23) & 0xFF
    return _power_of_two(torch.clamp(biased - 127, min=info.min_exponent) - info.mantissa_bits)


def round_to_grid(v: torch.Tensor, fmt: StateFormat, noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round fp32 ``v`` (already clamped to ±qmax) onto the code grid of ``fmt``, in fp32.

    Round-to-nearest-even when ``noise`` is None, else ``floor(v / step + noise) * step`` with
    ``noise`` uniform in [0, 1) and a multiple of 2**-24 (as ``torch.rand`` draws it; it is taken
    as fp32). Every operation is exact in fp32: the steps are powers of two, ``v / step`` has
    at most 12 integer bits, and ``floor(y + u)`` is ``floor(y) + [1 − u ≤ y − floor(y)]``, a
    comparison of two exact values. So the result is representable in the storage dtype and the
    final cast does no rounding.
    """
    info = DTYPES[fmt.dtype]
    v = v.float()
    step = None
    if fmt.dtype != "int8":
        step = grid_step(v, fmt)
        v = v / step
    if noise is None:
        q = torch.round(v)
    else:
        low = torch.floor(v)
        q = low + ((1.0 - noise.float()) <= (v - low)).float()
    if step is not None:
        q = q * step
    return torch.clamp(q, -info.qmax, info.qmax)


def _group_amax(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """amax per scale group, shaped like the scale."""
    a = x.abs()
    if fmt.granularity == "row":
        return a.amax(dim=-1)
    if fmt.granularity == "head":
        return a.amax(dim=(-2, -1))
    return a.unflatten(-1, (-1, BLOCK)).amax(dim=-1)


def _expand_scale(scale: torch.Tensor, shape, fmt: StateFormat) -> torch.Tensor:
    if fmt.granularity == "row":
        return scale.unsqueeze(-1).expand(shape)
    if fmt.granularity == "head":
        return scale[..., None, None].expand(shape)
    return scale.repeat_interleave(BLOCK, dim=-1)


def compute_scale(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The fp32 scale of ``x`` in ``fmt`` (rules 1–2 of the module docstring)."""
    amax = _group_amax(x.float(), fmt)
    if fmt.granularity != "block32":
        # A tensor divisor: CUDA torch turns division by a Python scalar into a multiplication by
        # its reciprocal, which is not the one IEEE division of rule 2.
        return torch.clamp(amax / torch.full_like(amax, fmt.qmax), FLT_MIN, fmt.max_scale)
    # MX rule: the largest magnitude lands in the top binade of the code, [2**emax, 2**(emax+1)).
    # amax = m · 2**exp, 0.5 <= m < 1, so floor(log2 amax) = exp - 1. frexp gives inf the exponent
    # 0 (a zero group's scale, under which the rest of the group would be crushed to ±qmax); as
    # FLT_MAX it gets the largest scale and saturates like row and head. NaN passes the clamp.
    _, exp = torch.frexp(amax.clamp(max=FLT_MAX))
    shared = torch.clamp(exp - 1 - fmt.emax, min=-126, max=126 - fmt.emax)
    return torch.ldexp(torch.ones_like(amax), shared)


def quantize(
    x: torch.Tensor,
    fmt: FormatLike,
    *,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
) -> QuantizedState:
    """Store ``x (..., headdim, dstate)`` in ``fmt``.

    Returns ``QuantizedState(data, scale, fmt)``: ``data`` shaped like ``x`` in the storage dtype
    (``torch.float8_e4m3fn``, ``torch.int8``, …); ``scale`` fp32 shaped ``fmt.scale_shape(x.shape)``
    or None for fp32/bf16/fp16. Stochastic formats draw ``u ~ U[0, 1)`` from ``generator``
    (or use ``noise`` when given: shaped like ``x``, multiples of 2**-24 in [0, 1) as
    ``torch.rand`` draws them; only ``+sr`` formats take it). NaN in a group makes that group's
    codes unspecified; it does not reach other groups.
    """
    fmt = as_format(fmt)
    _check_state(x, fmt)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    if noise is not None:
        _check_noise(noise, x, fmt)
    xf = x.float()
    if fmt.stochastic and noise is None:
        device = xf.device if generator is None else generator.device
        noise = torch.rand(xf.shape, generator=generator, device=device).to(xf.device)
    if fmt.dtype == "fp32":
        return QuantizedState(xf.clone(), None, fmt)
    scale = compute_scale(xf, fmt) if fmt.scaled else None
    v = xf / _expand_scale(scale, xf.shape, fmt) if fmt.scaled else xf
    v = torch.clamp(v, -fmt.qmax, fmt.qmax)
    codes = round_to_grid(v, fmt, noise)
    return QuantizedState(codes.to(fmt.storage_dtype), scale, fmt)


def dequantize(q: QuantizedState) -> torch.Tensor:
    """fp32 values of a :class:`QuantizedState`: ``code * scale`` (one fp32 rounding).

    ``q.data`` must be in the format's storage dtype (an fp8 format's codes as
    ``torch.float8_*``, not viewed as ``uint8``) and ``q.scale`` fp32 of the format's scale
    shape (None for unscaled formats); anything else raises, naming ``q``."""
    if not isinstance(q, QuantizedState):
        raise TypeError(f"q: expected a QuantizedState, got {type(q).__name__}")
    if not isinstance(q.fmt, StateFormat):
        raise TypeError(f"q: expected fmt to be a StateFormat, got {type(q.fmt).__name__}")
    _validate.tensor("q", q.data, floating=False)
    # Codes in another dtype (fp8 viewed as uint8, int8 labelled fp8) would decode to other numbers.
    if q.data.dtype != q.fmt.storage_dtype:
        raise TypeError(f"q: expected codes of dtype {q.fmt.storage_dtype} for {q.fmt}, got {q.data.dtype}")
    _check_state_shape("q", tuple(q.data.shape), q.fmt)
    expected = q.fmt.scale_shape(q.data.shape)
    if q.scale is not None and not isinstance(q.scale, torch.Tensor):
        raise TypeError(f"q: expected scale to be a torch.Tensor or None, got {type(q.scale).__name__}")
    if q.scale is not None and q.scale.dtype != torch.float32:
        raise TypeError(f"q: expected an fp32 scale, got {q.scale.dtype}")
    got = None if q.scale is None else tuple(q.scale.shape)
    if got != expected:
        raise ValueError(f"q: expected scale shape {expected} for data {tuple(q.data.shape)} in {q.fmt}, got {got}")
    values = q.data.float()
    if q.scale is None:
        return values
    return values * _expand_scale(q.scale.float(), values.shape, q.fmt)
