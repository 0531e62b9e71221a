"""The in-kernel codec (kernels/codec.py) against qstate.formats, bit for bit.

Runs the probe kernel (one program quantizes one head) under the interpreter on CPU, with the
exact-arithmetic paths (``hardware_casts=False``); ``bench/run_gpu.py`` repeats it on the GPU
with and without the GPU's conversion instructions.
"""

import pytest
import torch

from qstate import formats
from qstate.kernels import codec_probe

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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("text", FORMATS)
@pytest.mark.parametrize("seed", [0, 1])
def test_codec_matches_formats_bit_for_bit(text, seed):
    fmt = formats.StateFormat.parse(text)
    x = _inputs(fmt, seed)
    codes, scale, noise, values = codec_probe.quantize_heads(x, fmt, seed=1234 + seed, hardware_casts=False)
    expected = formats.quantize(x, fmt, noise=noise)
    assert torch.equal(_bits(codes), _bits(expected.data))
    if fmt.scaled:
        assert torch.equal(_bits(scale), _bits(expected.scale))
    assert torch.equal(_bits(values), _bits(formats.dequantize(expected)))


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
