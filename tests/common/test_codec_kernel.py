"""The in-kernel codec (kernels/common/codec.py) against qstate.formats, bit for bit.

Runs the probe kernel (one program quantizes one head) under the interpreter on CPU, with the
exact-arithmetic paths (``hardware_casts=False``); ``bench/run_gpu.py`` repeats it on the GPU
with and without the GPU's conversion instructions.
"""

import numpy as np
import pytest
import torch
from helpers import ci_examples
from helpers.codes import bits_of
from hypothesis import given
from hypothesis import strategies as st

from qstate import formats
from qstate.kernels.common import codec_probe

FORMATS = [
    "fp32", "bf16", "fp16", "bf16+sr", "fp16+sr",
    *[f"{d}:{g}{sr}" for d in ("fp8_e4m3", "fp8_e5m2", "int8") for g in ("row", "head", "block32") for sr in ("", "+sr")],
]


def _grid_midpoints(fmt: formats.StateFormat) -> torch.Tensor:
    """Values exactly halfway between neighbouring codes of ``fmt`` (ties for round-to-nearest)."""
    if fmt.dtype == "int8":
        grid = torch.arange(0, 128, dtype=torch.float32)
    elif fmt.dtype in ("fp8_e4m3", "fp8_e5m2"):
        grid = torch.arange(0, 128, dtype=torch.uint8).view(fmt.storage_dtype).float()
        grid = grid[torch.isfinite(grid) & (grid <= fmt.qmax)]
    else:
        grid = torch.arange(0, 0x7C00, 97, dtype=torch.int16).view(torch.float16).float()
    grid = torch.sort(grid).values
    return (grid[:-1] + grid[1:]) / 2


def _inputs(fmt: formats.StateFormat, seed: int, heads=3, headdim=8, dstate=96) -> torch.Tensor:
    """Random magnitudes over many binades, zeros, subnormals, huge values, and exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, headdim, dstate, generator=gen) * torch.exp(3 * torch.randn(heads, headdim, 1, generator=gen))
    x[0, 0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-41, 3e38, -7e-39])
    x[0, 1] = 0.0
    if fmt.scaled:
        # A row whose amax is qmax·2**-3 has the power-of-two scale 2**-3, so midpoints·2**-3
        # stay exact ties after the division by the scale.
        ties = _grid_midpoints(fmt)
        picks = ties[torch.randint(len(ties), (dstate,), generator=gen)] * 0.125
        signs = torch.where(torch.rand(dstate, generator=gen) < 0.5, -1.0, 1.0)
        x[1, 2] = picks * signs
        x[1, 2, 0] = fmt.qmax * 0.125
    elif fmt.dtype != "fp32":
        ties = _grid_midpoints(formats.StateFormat.parse("fp16"))
        x[1, 2] = ties[torch.randint(len(ties), (dstate,), generator=gen)]
        if fmt.dtype == "bf16":
            # bf16 ties: the 16 dropped bits are exactly 0x8000.
            bits = torch.randint(0x0080, 0x7F00, (dstate,), generator=gen, dtype=torch.int32) << 16 | 0x8000
            x[1, 3] = bits.view(torch.float32)
    return x


@pytest.mark.parametrize("text", FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_codec_matches_formats_bit_for_bit(text, seed):
    fmt = formats.StateFormat.parse(text)
    x = _inputs(fmt, seed)
    codes, scale, noise, values = codec_probe.quantize_heads(x, fmt, seed=1234 + seed, hardware_casts=False)
    expected = formats.quantize(x, fmt, noise=noise)
    assert torch.equal(bits_of(codes), bits_of(expected.data))
    if fmt.scaled:
        assert torch.equal(bits_of(scale), bits_of(expected.scale))
    assert torch.equal(bits_of(values), bits_of(formats.dequantize(expected)))


@pytest.mark.parametrize("text", ["fp8_e4m3:block32", "fp8_e5m2:block32", "int8:block32", "int8:block32+sr"])
def test_block32_inf_saturates_as_formats_does(text):
    """An inf amax takes FLT_MAX's exponent (formats rule 2): the block saturates at the largest
    scale, as row and head groups do, instead of taking a zero group's scale."""
    fmt = formats.StateFormat.parse(text)
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    x[0, 1, 3], x[0, 1, 5], x[1, 2, 40] = float("inf"), 100.0, float("-inf")
    codes, scale, noise, values = codec_probe.quantize_heads(x, fmt, seed=7, hardware_casts=False)
    expected = formats.quantize(x, fmt, noise=noise)
    assert torch.equal(bits_of(codes), bits_of(expected.data))
    assert torch.equal(bits_of(scale), bits_of(expected.scale))
    assert values[0, 1, 3] == fmt.qmax * fmt.max_scale and values[1, 2, 40] == -fmt.qmax * fmt.max_scale


def test_noise_is_a_24_bit_uniform_stream_keyed_by_seed_and_position():
    fmt = formats.StateFormat.parse("int8:row+sr")
    x = torch.randn(4, 16, 64)
    noise_a = codec_probe.quantize_heads(x, fmt, seed=7, hardware_casts=False)[2]
    noise_b = codec_probe.quantize_heads(x * 2, fmt, seed=7, hardware_casts=False)[2]
    noise_c = codec_probe.quantize_heads(x, fmt, seed=8, hardware_casts=False)[2]
    assert torch.equal(noise_a, noise_b)  # depends on the seed and the position only
    assert (noise_a != noise_c).float().mean() > 0.99
    assert noise_a.min() >= 0 and noise_a.max() < 1
    assert torch.equal(noise_a * 2**24, torch.floor(noise_a * 2**24))
    assert abs(noise_a.mean().item() - 0.5) < 0.02  # 4096 draws: sd of the mean 0.0045


def _philox4x32(seed: int, counters: np.ndarray, rounds: int) -> np.ndarray:
    """Philox4x32 (Salmon et al. 2011) of counters ``(c, 0, 0, 0)`` and key ``(seed, 0)``: ``(n, 4)`` uint32."""
    mask = np.uint64(0xFFFFFFFF)
    c = [counters.astype(np.uint64), *(np.zeros_like(counters, dtype=np.uint64) for _ in range(3))]
    k0, k1 = np.uint64(seed), np.uint64(0)
    for _ in range(rounds):
        p0, p2 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [((p2 >> np.uint64(32)) ^ c[1] ^ k0) & mask, p2 & mask, ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & mask,
             p0 & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c, axis=-1).astype(np.uint32)


@pytest.mark.parametrize("sr_stream,rounds", [(0, 10), (1, 10), (1, 7), (2, 7), (2, 10)])
def test_noise_streams_are_the_documented_philox_words(sr_stream, rounds):
    """Stream 0: word 0 of the draw at the element's position. Stream 1: column 4k + i of row r
    takes word i of the draw at r·ceil(dstate/4) + k (dstate 42: the last quad is partial).
    Stream 2: column 8k + 2i + h takes half h (0: low) of word i of the draw at
    r·ceil(dstate/8) + k, as a multiple of 2**-16."""
    groups, headdim, dstate, seed = 2, 3, 42, 99
    fmt = formats.StateFormat.parse("int8:row+sr")
    noise = codec_probe.quantize_heads(torch.zeros(groups, headdim, dstate), fmt, seed=seed, hardware_casts=False,
                                       sr_stream=sr_stream, sr_rounds=rounds)[2]
    row = np.arange(groups * headdim)[:, None]
    col = np.arange(dstate)[None, :]
    per_row = lambda a: np.broadcast_to(a, (groups * headdim, dstate)).ravel()  # noqa: E731
    if sr_stream == 0:
        words = _philox4x32(seed, (row * dstate + col).ravel(), rounds)[:, 0]
        uniform = (words >> 8).astype(np.float32) * 2.0**-24
    elif sr_stream == 1:
        draws = _philox4x32(seed, (row * -(-dstate // 4) + col // 4).ravel(), rounds)
        words = draws[np.arange(draws.shape[0]), per_row(col % 4)]
        uniform = (words >> 8).astype(np.float32) * 2.0**-24
    else:
        draws = _philox4x32(seed, (row * -(-dstate // 8) + col // 8).ravel(), rounds)
        words = draws[np.arange(draws.shape[0]), per_row(col % 8 // 2)]
        uniform = np.where(per_row(col % 2) == 0, words & 0xFFFF, words >> 16).astype(np.float32) * 2.0**-16
    expected = torch.from_numpy(uniform).reshape(groups, headdim, dstate)
    assert torch.equal(noise, expected)


@pytest.mark.parametrize("sr_stream,rounds,bits", [(1, 10, 24), (2, 7, 16)])
@pytest.mark.parametrize("text", ["fp16+sr", "bf16+sr", "int8:row+sr", "fp8_e4m3:head+sr", "fp8_e5m2:block32+sr"])
def test_codec_with_multiword_noise_matches_formats(text, sr_stream, rounds, bits):
    fmt = formats.StateFormat.parse(text)
    x = _inputs(fmt, 0)
    codes, scale, noise, values = codec_probe.quantize_heads(x, fmt, seed=77, hardware_casts=False,
                                                            sr_stream=sr_stream, sr_rounds=rounds)
    expected = formats.quantize(x, fmt, noise=noise)
    assert torch.equal(bits_of(codes), bits_of(expected.data))
    if fmt.scaled:
        assert torch.equal(bits_of(scale), bits_of(expected.scale))
    assert noise.min() >= 0 and noise.max() < 1 and abs(noise.mean().item() - 0.5) < 0.03
    assert torch.equal(noise * 2**bits, torch.floor(noise * 2**bits))


@ci_examples(40)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=True), min_size=64, max_size=64),
    text=st.sampled_from(["bf16+sr", "fp16+sr", "int8:row+sr", "fp8_e4m3:row+sr", "fp8_e5m2:head+sr"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sixteen_bit_stream_codes_match_formats(values, text, seed):
    """Any fp32 values (subnormals, ±0, ±inf, the largest floats): codes of the 16-bit noise
    stream (bf16 rounded on the bits by ``codec.encode_sr16``) equal ``qstate.formats``' for
    the noise the probe reports, bit for bit."""
    fmt = formats.StateFormat.parse(text)
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 2, 32)
    codes, scale, noise, _ = codec_probe.quantize_heads(x, fmt, seed=seed, hardware_casts=False, sr_stream=2,
                                                       sr_rounds=7)
    expected = formats.quantize(x, fmt, noise=noise)
    assert torch.equal(bits_of(codes), bits_of(expected.data))
    if fmt.scaled:
        assert torch.equal(bits_of(scale), bits_of(expected.scale))


@pytest.mark.parametrize("value", [1.0 + 0.3 * 2.0**-7, -(1.0 + 0.3 * 2.0**-7), -0.7 * 2.0**-133, 3.0 * 2.0**-140])
def test_sixteen_bit_stream_rounds_bf16_without_bias(value):
    """bf16 on the bits: a value a fraction f of a step above a grid point rounds up with
    probability f, on both signs and among subnormals (the noise complemented for negatives)."""
    fmt = formats.StateFormat.parse("bf16+sr")
    x = torch.full((4, 32, 32), value, dtype=torch.float32)
    codes = codec_probe.quantize_heads(x, fmt, seed=3, hardware_casts=False, sr_stream=2, sr_rounds=7)[0]
    low = torch.tensor(value).to(torch.bfloat16)
    low = low if abs(low.float().item()) <= abs(value) else torch.nextafter(low, torch.zeros_like(low))
    high = torch.nextafter(low, torch.full_like(low, float("inf") if value > 0 else float("-inf")))
    step = abs(high.float().item() - low.float().item())
    f = abs(value - low.float().item()) / step
    assert set(codes.flatten().float().unique().tolist()) <= {low.float().item(), high.float().item()}
    up = (codes.float() == high.float()).double().mean().item()
    assert abs(up - f) < 4 * (f * (1 - f) / codes.numel()) ** 0.5
