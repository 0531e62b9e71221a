"""State formats and codecs against their definition (qstate/formats.py, docs/design.md#formats)."""

import math

import pytest
import torch
from helpers import ci_examples
from hypothesis import given
from hypothesis import strategies as st

from qstate import QuantizedState, StateFormat, dequantize, quantize
from qstate.analysis.roundtrip import roundtrip_
from qstate.formats import DTYPES, GRANULARITIES

ALL_FORMATS = [
    "fp32", "bf16", "fp16", "bf16+sr", "fp16+sr",
    *[f"{d}:{g}{sr}" for d in ("fp8_e4m3", "fp8_e5m2", "int8") for g in GRANULARITIES for sr in ("", "+sr")],
]
EPS32 = 2.0**-24  # unit roundoff of fp32
TRUE_MIN32 = 2.0**-149


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text", ALL_FORMATS)
def test_str_round_trips(text):
    fmt = StateFormat.parse(text)
    assert StateFormat.parse(str(fmt)) == fmt
    assert str(fmt) == text


def test_default_granularity_is_row():
    assert StateFormat.parse("int8") == StateFormat.parse("int8:row")
    assert str(StateFormat.parse("fp8_e4m3+sr")) == "fp8_e4m3:row+sr"
    fmt = StateFormat.parse("int8:block32+sr")
    assert (fmt.dtype, fmt.granularity, fmt.stochastic, fmt.qmax) == ("int8", "block32", True, 127.0)


@pytest.mark.parametrize("text", ["fp4", "int8:col", "bf16:row", "fp32+sr", "", "int8:row+rs", "FP32", "fp8_e4m3:",
                                  "int8:+sr", "bf16:"])
def test_unknown_format_lists_choices(text):
    with pytest.raises(ValueError) as err:
        StateFormat.parse(text)
    assert "fp8_e4m3" in str(err.value) or "granularity" in str(err.value) or "stochastic" in str(err.value)


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError, match="format"):
        StateFormat.parse(8)


@pytest.mark.parametrize("text,expected", [
    ("fp32", 4.0), ("bf16", 2.0), ("fp16+sr", 2.0),
    ("int8:row", 1 + 4 / 128), ("fp8_e4m3:block32", 1 + 4 / 32), ("fp8_e5m2:head", 1 + 4 / (64 * 128)),
])
def test_bytes_per_element_counts_scales(text, expected):
    assert StateFormat.parse(text).bytes_per_element(128, headdim=64) == pytest.approx(expected)


def test_head_granularity_bytes_need_headdim():
    with pytest.raises(ValueError, match="headdim"):
        StateFormat.parse("int8:head").bytes_per_element(128)


def test_stochastic_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="^format stochastic"):
        StateFormat("int8", "row", "yes")


@pytest.mark.parametrize("text,dstate,headdim,exc", [
    ("int8:row", 0, None, ValueError), ("int8:row", -4, None, ValueError), ("bf16", 2.5, None, TypeError),
    ("int8:head", 128, 0, ValueError), ("fp8_e4m3:block32", 40, None, ValueError), ("fp32", True, None, TypeError),
])
def test_bytes_per_element_rejects_bad_sizes(text, dstate, headdim, exc):
    name = "headdim" if headdim is not None else "dstate"
    with pytest.raises(exc, match=f"^{name}"):
        StateFormat.parse(text).bytes_per_element(dstate, headdim)


@pytest.mark.parametrize("text,shape,exc", [
    ("int8:block32", (2, 40), ValueError), ("int8:row", (2, 0), ValueError), ("int8:head", (0, 32), ValueError),
    ("bf16", (32,), ValueError), ("int8:row", (2, 2.0), TypeError), ("int8:row", 5, TypeError),
])
def test_scale_shape_rejects_what_quantize_rejects(text, shape, exc):
    with pytest.raises(exc, match="^shape"):
        StateFormat.parse(text).scale_shape(shape)
    if exc is ValueError:
        with pytest.raises(ValueError, match="^x"):
            quantize(torch.ones(shape), text)


# ----------------------------------------------------------------------------- error bound

def grid_step(v: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Spacing of the code grid at v (in code units), written from the format definitions."""
    info = DTYPES[fmt.dtype]
    if fmt.dtype == "int8":
        return torch.ones_like(v, dtype=torch.float64)
    mag = v.double().abs().clamp(min=TRUE_MIN32)
    exponent = torch.floor(torch.log2(mag)).clamp(min=info.min_exponent)
    return torch.exp2(exponent - info.mantissa_bits)


def expanded_scale(q: QuantizedState, shape) -> torch.Tensor:
    if q.scale is None:
        return torch.ones(shape, dtype=torch.float64)
    s = q.scale.double()
    if q.fmt.granularity == "row":
        return s[..., None].expand(shape)
    if q.fmt.granularity == "head":
        return s[..., None, None].expand(shape)
    return s.repeat_interleave(32, dim=-1)


def assert_within_bound(x: torch.Tensor, q: QuantizedState):
    """RNE: |x − deq| ≤ half a grid step of x's group (times its scale); SR: under one step.

    Besides the grid rounding, the division x/scale and the product code·scale each round once
    in fp32 (relative 2^-24 each); subnormal fp32 results add at most one fp32 subnormal step.
    """
    fmt = q.fmt
    x64 = x.double()
    scale = expanded_scale(q, x.shape)
    v = (x64 / scale).clamp(-fmt.qmax, fmt.qmax)
    saturation = (x64.abs() - fmt.qmax * scale).clamp(min=0)
    grid = grid_step(v, fmt) * scale * (1.0 if fmt.stochastic else 0.5)
    bound = grid * (1 + 4 * EPS32) + saturation + 4 * EPS32 * x64.abs() + 2 * TRUE_MIN32
    err = (dequantize(q).double() - x64).abs()
    worst = (err - bound).max()
    assert worst <= 0, f"{fmt}: error exceeds bound by {worst.item()}"


def sample(shape, log10_mag, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0**log10_mag
    return x.float()


@ci_examples(60)
@given(
    fmt=st.sampled_from(ALL_FORMATS),
    rows=st.integers(1, 3),
    headdim=st.integers(1, 5),
    blocks=st.integers(1, 3),
    log10_mag=st.integers(-40, 37),
    seed=st.integers(0, 2**31 - 1),
)
def test_codec_bound_and_round_trip(fmt, rows, headdim, blocks, log10_mag, seed):
    x = sample((rows, headdim, 32 * blocks), log10_mag, seed)
    q = quantize(x, fmt, generator=torch.Generator().manual_seed(seed))
    assert q.data.dtype == q.fmt.storage_dtype and q.data.shape == x.shape
    assert (q.scale is None) == (not q.fmt.scaled)
    if q.scale is not None:
        assert q.scale.shape == q.fmt.scale_shape(x.shape) and q.scale.dtype == torch.float32
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    values = dequantize(q)
    assert values.dtype == torch.float32 and torch.isfinite(values).all()
    assert_within_bound(x, q)
    # Re-quantizing stored values reproduces the codes and scales bit for bit (RNE re-encodes
    # exactly-representable values; for SR they sit on the grid, so the noise cannot move them).
    again = quantize(values, q.fmt, generator=torch.Generator().manual_seed(seed + 1))
    assert torch.equal(again.data.view(torch.uint8) if again.data.element_size() == 1 else again.data,
                       q.data.view(torch.uint8) if q.data.element_size() == 1 else q.data)
    if q.scale is not None:
        assert torch.equal(again.scale, q.scale)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_saturates_instead_of_overflowing(fmt):
    x = torch.tensor([[[3.0e38, -3.4e38, 1.0, 0.0] * 8]])
    q = quantize(x, fmt)
    values = dequantize(q)
    assert torch.isfinite(values).all()
    assert values.abs().max() <= 3.4028234663852886e38
    if StateFormat.parse(fmt).dtype == "fp16":
        assert values[0, 0, 1] == -65504.0


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if StateFormat.parse(f).scaled])
def test_saturation_at_qmax(fmt):
    f = StateFormat.parse(fmt)
    x = torch.zeros(1, 2, 32)
    x[0, 0, 0], x[0, 1, 3] = 5.0, -7.0
    q = quantize(x, f)
    codes = q.data.float()
    assert codes.abs().max() <= f.qmax
    if f.granularity != "block32":  # block32 rounds the scale up to a power of two
        assert codes[0, 1, 3] == -f.qmax


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if f != "fp32"])  # fp32 stores values as they are
def test_inf_saturates_within_its_group(fmt):
    x = torch.ones(2, 3, 32)
    x[0, 1, 5] = float("inf")
    q = quantize(x, fmt)
    values = dequantize(q)
    assert torch.isfinite(values).all()
    assert torch.equal(values[1], dequantize(quantize(x[1:], fmt))[0])


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_block32_inf_saturates_like_row(dtype):
    # torch.frexp gives inf the exponent 0: the scale was a zero group's, and ±inf and 100 all
    # decoded to about ±1.
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[0, 2], x[1, 3] = float("inf"), 100.0, float("-inf"), 3.0
    fmt = StateFormat.parse(f"{dtype}:block32")
    q = quantize(x, fmt)
    values = dequantize(q)
    assert q.scale[0, 0] == fmt.max_scale
    assert values[0, 0] == fmt.qmax * fmt.max_scale and values[0, 2] == -fmt.qmax * fmt.max_scale
    assert torch.equal(values, dequantize(quantize(x, f"{dtype}:row")))


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if StateFormat.parse(f).scaled and not f.endswith("+sr")])
def test_roundtrip_equals_quantize_dequantize_with_inf_and_nan(fmt):
    """analysis.roundtrip_ (the drift engine's store) against quantize + dequantize on groups
    holding ±inf, and next to a group holding NaN (whose codes are unspecified)."""
    fmt = StateFormat.parse(fmt)
    x = sample((2, 3, 96), 0, seed=5)
    x[0, 0, 1], x[0, 0, 5], x[0, 1, 40] = float("inf"), float("-inf"), float("-inf")
    x[1, 2, 70] = float("nan")
    nan_group = torch.zeros(x.shape, dtype=torch.bool)
    if fmt.granularity == "head":
        nan_group[1] = True
    elif fmt.granularity == "row":
        nan_group[1, 2] = True
    else:
        nan_group[1, 2, 64:] = True
    q = quantize(x, fmt)
    codes = torch.full_like(x, float("nan"))
    got = roundtrip_(x.clone(), fmt, codes_out=codes)
    keep = ~nan_group
    assert torch.isfinite(got[keep]).all()
    assert got[0, 0, 1] == fmt.qmax * fmt.max_scale and got[0, 1, 40] == -fmt.qmax * fmt.max_scale
    assert torch.equal(got[keep], dequantize(q)[keep])  # value equality: int8 may keep the sign of a zero
    assert torch.equal(codes[keep], q.data.float()[keep])


@ci_examples(60)
@given(fmt=st.sampled_from(ALL_FORMATS), log2_mag=st.integers(-160, -110), seed=st.integers(0, 2**31 - 1))
def test_requantizing_tiny_values_reproduces_codes_and_scales(fmt, log2_mag, seed):
    """Subnormal and tiny groups next to zero ones: re-quantizing the values gives the codes back,
    and the scales, except that a block32 group whose codes all round to zero at the smallest
    scale 2**-126 comes back with the zero group's scale (module docstring, rule 2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 96, generator=g, dtype=torch.float64)
    x = (x * torch.exp2(torch.tensor([0.0, -8.0, -16.0], dtype=torch.float64) + log2_mag).repeat_interleave(32)).float()
    x[1, 1] = 0.0
    q = quantize(x, fmt, generator=torch.Generator().manual_seed(seed))
    again = quantize(dequantize(q), fmt, generator=torch.Generator().manual_seed(seed + 1))
    bits = (lambda t: t.view(torch.uint8)) if q.data.element_size() == 1 else (lambda t: t)
    assert torch.equal(bits(again.data), bits(q.data))
    if q.scale is None:
        return
    if q.fmt.granularity == "block32":
        zero_codes = (q.data.float().unflatten(-1, (-1, 32)) == 0).all(dim=-1)
        assert torch.equal(again.scale[~zero_codes], q.scale[~zero_codes])
        assert (again.scale[zero_codes] == 2.0 ** (-1 - q.fmt.emax)).all()
    else:
        assert torch.equal(again.scale, q.scale)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_all_zero_groups(fmt):
    x = torch.zeros(2, 3, 64)
    x[1, 2, 7] = 1.5
    q = quantize(x, fmt)
    values = dequantize(q)
    assert torch.isfinite(values).all()
    assert (values[0] == 0).all() and (values[1, :2] == 0).all()
    if q.scale is not None:
        assert torch.isfinite(q.scale).all() and (q.scale > 0).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3:row", "int8:row", "fp8_e5m2:block32", "int8:head", "bf16", "fp16"])
@pytest.mark.parametrize("log10_mag", [-44, -38, -30, 30, 38])
def test_tiny_and_huge_magnitudes(fmt, log10_mag):
    x = sample((2, 3, 64), log10_mag, seed=7)
    q = quantize(x, fmt)
    assert torch.isfinite(dequantize(q)).all()
    assert_within_bound(x, q)


def test_block32_needs_multiple_of_32():
    with pytest.raises(ValueError, match="dstate"):
        quantize(torch.ones(2, 48), "int8:block32")


def test_block32_scales_are_powers_of_two():
    q = quantize(sample((4, 3, 96), 0, 3), "fp8_e4m3:block32")
    mantissa, _ = torch.frexp(q.scale)
    assert (mantissa == 0.5).all()


def test_scale_shapes():
    x = torch.randn(5, 6, 80, 96)
    assert quantize(x, "int8:row").scale.shape == (5, 6, 80)
    assert quantize(x, "int8:head").scale.shape == (5, 6)
    assert quantize(x, "int8:block32").scale.shape == (5, 6, 80, 3)


@pytest.mark.parametrize("bad,exc", [(torch.ones(4, dtype=torch.int32).reshape(2, 2), TypeError),
                                     (torch.ones(8), ValueError), ([1.0, 2.0], TypeError)])
def test_quantize_rejects_bad_input(bad, exc):
    with pytest.raises(exc, match="x"):
        quantize(bad, "int8:row")


def test_dequantize_rejects_tensors():
    with pytest.raises(TypeError, match="QuantizedState"):
        dequantize(torch.ones(2, 2))


@pytest.mark.parametrize("text,scale", [("int8:row", torch.ones(3)), ("int8:block32", torch.ones(2, 3)),
                                        ("int8:head", None), ("bf16", torch.ones(2))])
def test_dequantize_rejects_a_scale_of_the_wrong_shape(text, scale):
    fmt = StateFormat.parse(text)
    q = QuantizedState(torch.zeros(2, 64, dtype=fmt.storage_dtype), scale, fmt)
    with pytest.raises(ValueError, match="^q: expected scale shape"):
        dequantize(q)


@pytest.mark.parametrize("shape", [(2, 3, 0), (2, 0, 32)])
def test_quantize_rejects_empty_rows(shape):
    with pytest.raises(ValueError, match="^x: expected shape"):
        quantize(torch.ones(shape), "int8:row")


@pytest.mark.parametrize("text,noise,exc", [
    ("int8:row+sr", [[0.5] * 32] * 2, TypeError),
    ("int8:row+sr", torch.zeros(2, 32, dtype=torch.int64), TypeError),
    ("int8:row+sr", torch.full((2, 32), 1.5), ValueError),
    ("int8:row+sr", torch.full((2, 32), -0.25), ValueError),
    ("int8:row+sr", torch.full((2, 32), float("nan")), ValueError),
    ("int8:row+sr", torch.full((2, 32), 0.1, dtype=torch.float64), ValueError),  # off the 2**-24 grid
    ("int8:row+sr", torch.zeros(2, 31), ValueError),
    ("int8:row", torch.zeros(2, 32), ValueError),  # round to nearest would ignore it
    ("bf16", torch.zeros(2, 32), ValueError),
])
def test_quantize_rejects_bad_noise(text, noise, exc):
    with pytest.raises(exc, match="^noise"):
        quantize(torch.ones(2, 32), text, noise=noise)


def test_quantize_rejects_a_non_generator():
    with pytest.raises(TypeError, match="^generator"):
        quantize(torch.ones(2, 32), "int8:row+sr", generator=5)


# ----------------------------------------------------------------------------- fp8 codes

def fp8_table(dtype: str):
    """Every finite fp8 value with its code, decoded from the bit layout (not from torch)."""
    exp_bits, man_bits, bias = (4, 3, 7) if dtype == "fp8_e4m3" else (5, 2, 15)
    values, codes = [], []
    for code in range(128):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if dtype == "fp8_e4m3" and code == 0x7F:
            continue  # NaN
        if dtype == "fp8_e5m2" and e == (1 << exp_bits) - 1:
            continue  # inf / NaN
        if e == 0:
            values.append(m * 2.0 ** (1 - bias - man_bits))
        else:
            values.append((1 + m / 2**man_bits) * 2.0 ** (e - bias))
        codes.append(code)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


def explicit_fp8_codes(v: torch.Tensor, dtype: str) -> torch.Tensor:
    """Saturating round-to-nearest-even onto the fp8 grid, as codes: nearest value, ties to the
    even code (mantissa LSB 0), magnitudes beyond the largest finite value saturate."""
    values, codes = fp8_table(dtype)
    mag = v.double().abs().clamp(max=values[-1].item())
    hi = torch.searchsorted(values, mag).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    code = torch.where(pick_hi, codes[hi], codes[lo])
    return code | (torch.signbit(v).long() << 7)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_equal_explicit_rne(dtype):
    g = torch.Generator().manual_seed(0)
    values, _ = fp8_table(dtype)
    midpoints = ((values[1:] + values[:-1]) / 2).float()  # exact ties
    x = torch.cat([
        torch.randn(20000, generator=g) * 3,
        torch.randn(20000, generator=g) * 1e-3,  # subnormal range after scaling
        midpoints, -midpoints, values.float(), torch.tensor([0.0, -0.0]),
    ])
    qmax = values[-1].item()
    # One row per value with a companion entry that pins the row scale to exactly 1.
    rows = torch.stack([x, torch.full_like(x, qmax)], dim=-1)[:, None, :]
    q = quantize(rows, f"{dtype}:row")
    assert (q.scale == 1.0).all()
    got = q.data[:, 0, 0].view(torch.uint8).long()
    want = explicit_fp8_codes(x, dtype)
    mismatch = (got != want).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at {x[mismatch[0]].item()}: {got[mismatch[0]]} vs {want[mismatch[0]]}"


# ----------------------------------------------------------------------------- stochastic rounding

@pytest.mark.parametrize("fmt", ["int8:row+sr", "fp8_e4m3:row+sr", "fp8_e5m2:row+sr", "bf16+sr", "fp16+sr"])
def test_stochastic_rounding_is_unbiased(fmt):
    """Mean of N independent roundings of x lies within 5 standard errors of x.

    One rounding is a Bernoulli choice between the two neighbouring grid points, so its
    standard deviation is at most step/2 and the mean's is at most step / (2·sqrt(N)).
    """
    n = 40000
    f = StateFormat.parse(fmt)
    base = torch.tensor([0.3, -1.7, 2.9, 0.013, -0.0051, 1.0])
    if f.scaled:
        base = torch.cat([base, torch.tensor([f.qmax / 50])])  # fixes the row scale to 1/50
    x = base.expand(n, 1, -1).contiguous()
    q = quantize(x, f, generator=torch.Generator().manual_seed(1))
    mean = dequantize(q).double().mean(dim=0)[0]
    scale = 1.0 if q.scale is None else q.scale[0, 0].item()
    v = (base.double() / scale).clamp(-f.qmax, f.qmax)
    step = grid_step(v, f) * scale
    assert ((mean - base.double()).abs() <= 5 * step / (2 * math.sqrt(n))).all()


def test_stochastic_rounding_uses_the_generator():
    x = torch.randn(4, 8, 64)
    a = quantize(x, "int8:row+sr", generator=torch.Generator().manual_seed(3))
    b = quantize(x, "int8:row+sr", generator=torch.Generator().manual_seed(3))
    c = quantize(x, "int8:row+sr", generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
