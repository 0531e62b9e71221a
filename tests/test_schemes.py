"""Schemes: string form, bytes per step and resident, and the engine's store-and-reload codec."""

import pytest
import torch

from qstate import profiles
from qstate.analysis.roundtrip import roundtrip_
from qstate.analysis.schemes import DEFAULT_SCHEMES, Scheme, candidate_schemes, parse_schemes
from qstate.formats import StateFormat, dequantize, quantize

NEMOTRON = profiles.get("nemotron-h-8b")



@pytest.mark.parametrize("text", list(DEFAULT_SCHEMES) + ["int8:block32+sr", "replay/int8:row/bf16/8"])
def test_string_form_round_trips(text):
    scheme = Scheme.parse(text)
    assert str(scheme) == text
    assert Scheme.parse(str(scheme)) == scheme


def test_constructors_match_the_string_form():
    assert Scheme.replay("fp32", "fp8_e4m3:row", 16) == Scheme.parse("replay/fp32/fp8_e4m3:row/16")
    assert Scheme.replay() == Scheme.parse("replay/fp32/16")
    assert Scheme.conventional("fp8_e4m3") == Scheme.parse("fp8_e4m3:row")


@pytest.mark.parametrize("bad", ["fp7", "replay/fp32", "replay/fp32/x/y/16", "replay/fp32/abc", "fp32/bf16"])
def test_unknown_scheme_names_the_argument(bad):
    with pytest.raises(ValueError, match="scheme"):
        Scheme.parse(bad)


def test_bad_ring_length():
    with pytest.raises(ValueError, match="ring_len"):
        Scheme.replay("fp32", None, 0)


def test_bytes_follow_the_design_formulas():
    # docs/design.md#conventional-decode, #replay: conventional 2·s; replay s_read + 2·s_ck/L (s_ck + s_ck/L without a read copy).
    P, N = NEMOTRON.headdim, NEMOTRON.dstate
    token = (P * 2 + N * 2 / 16 + 4) / (P * N)  # x, B shared by 16 heads, dt: per state element
    assert Scheme.parse("fp32").bytes_per_step(NEMOTRON) == 8.0
    assert Scheme.parse("fp8_e4m3:row").bytes_per_step(NEMOTRON) == pytest.approx(2 * (1 + 4 / N))
    ring = (17 / 2 + 2) * token
    assert Scheme.parse("replay/fp32/16").bytes_per_step(NEMOTRON) == pytest.approx(4.25 + ring)
    assert Scheme.parse("replay/fp32/fp8_e4m3:row/16").bytes_per_step(NEMOTRON) == pytest.approx(
        1 + 4 / N + 0.5 + ring)
    assert Scheme.parse("replay/fp32/fp8_e4m3:row/16").bytes_resident(NEMOTRON) == pytest.approx(
        5 + 4 / N + 16 * token)
    assert Scheme.parse("int8:head").bytes_resident(NEMOTRON) == pytest.approx(1 + 4 / (P * N))


def test_parse_schemes_and_candidates():
    assert [str(s) for s in parse_schemes("fp32, replay/fp32/16")] == ["fp32", "replay/fp32/16"]
    with pytest.raises(ValueError, match="schemes"):
        parse_schemes("")
    with pytest.raises(TypeError, match="^schemes: expected a comma-separated string"):
        parse_schemes(5)
    cands = candidate_schemes()
    assert len(cands) == 12 + 4 * 5 * 3 and len(set(cands)) == len(cands)


def _awkward_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 64, generator=g) * torch.exp(torch.randn(3, 4, 8, 64, generator=g) * 6)
    x[0, 0, 0, :7] = 0.0  # zeros in a group
    x[0, 1] = 0.0  # an all-zero head
    x[1, 1, 1, 3] = 3e38  # saturation
    x[2, 0, 0, :] = torch.tensor([1.0 + 2.0**-8 * k for k in range(64)])  # fine ties for every grid
    return x


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8_e4m3:row", "fp8_e4m3:head", "fp8_e4m3:block32",
                                 "fp8_e5m2:row", "fp8_e5m2:block32", "int8:row", "int8:head", "int8:block32"])
def test_roundtrip_equals_quantize_dequantize(fmt):
    x = _awkward_values()
    fmt = StateFormat.parse(fmt)
    q = quantize(x, fmt)
    codes = torch.full_like(x, float("nan"))
    got = roundtrip_(x.clone(), fmt, codes_out=codes)
    assert torch.equal(got, dequantize(q))  # value equality (int8 may keep the sign of a zero)
    # The grid values of the codes, before the scale; bit for bit except that int8 keeps no −0.0.
    assert torch.equal(codes, q.data.float())


@pytest.mark.parametrize("fmt", ["fp8_e4m3:row", "fp8_e4m3:block32", "fp8_e5m2:head"])
def test_fp8_roundtrip_keeps_every_bit(fmt):
    """fp8 rounds in fp32 arithmetic rather than through torch's cast: the same bits, −0 included."""
    x = _awkward_values()
    x[0, 2, 0, :] = torch.tensor([1.0] + [-(2.0**-40)] * 63)  # negative values that round to −0
    fmt = StateFormat.parse(fmt)
    got = roundtrip_(x.clone(), fmt)
    want = dequantize(quantize(x, fmt))
    assert (got.view(torch.int32) == want.view(torch.int32)).all()
    assert torch.signbit(got[0, 2, 0, 1:]).all()


@pytest.mark.parametrize("fmt", ["fp8_e4m3:row+sr", "int8:block32+sr", "bf16+sr"])
def test_roundtrip_stochastic_draws_like_quantize(fmt):
    x = _awkward_values()
    fmt = StateFormat.parse(fmt)
    q = quantize(x, fmt, generator=torch.Generator().manual_seed(5))
    codes = torch.empty_like(x)
    got = roundtrip_(x.clone(), fmt, torch.Generator().manual_seed(5), codes_out=codes)
    assert torch.equal(got, dequantize(q))
    assert torch.equal(codes, q.data.float())
