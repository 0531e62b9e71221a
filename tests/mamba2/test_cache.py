"""ReplayCache: allocation, admission (reset), read-out (materialize), sizes, and its checks."""

import pytest
import torch

from qstate.cache import ReplayCache
from qstate.formats import dequantize, quantize


def test_allocate_shapes_and_dtypes():
    cache = ReplayCache.allocate(3, 4, 8, 32, 2, ring_len=5, checkpoint="bf16", read="fp8_e4m3:block32")
    assert cache.checkpoint.shape == (3, 4, 8, 32) and cache.checkpoint.dtype == torch.bfloat16
    assert cache.checkpoint_scale is None
    assert cache.read.dtype == torch.float8_e4m3fn and cache.read_scale.shape == (3, 4, 8, 1)
    assert cache.ring_x.shape == (3, 4, 5, 8) and cache.ring_x.dtype == torch.bfloat16
    assert cache.ring_dt.shape == (3, 4, 5) and cache.ring_B.shape == (3, 2, 5, 32)
    assert cache.cursor.tolist() == [0, 0, 0]
    assert cache.nbytes == sum(t.numel() * t.element_size() for t in cache.tensors().values() if t is not None)


@pytest.mark.parametrize("read", ["fp8_e4m3:row", "int8:head", "fp8_e4m3:block32", "int8:block32"])
def test_allocate_stores_what_quantize_gives_a_zero_state(read):
    cache = ReplayCache.allocate(2, 2, 4, 64, checkpoint="int8:row", read=read)
    zeros = torch.zeros(2, 2, 4, 64)
    for data, scale, fmt in ((cache.checkpoint, cache.checkpoint_scale, cache.checkpoint_format),
                             (cache.read, cache.read_scale, cache.read_format)):
        q = quantize(zeros, fmt)
        assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(scale, q.scale)


def test_bytes_per_step_of_the_headline_layout():
    """fp32 checkpoint + fp8_e4m3:row read copy, ring 16: 1.5 state bytes per element (the read
    copy every step; the checkpoint at a flush only, which does not read the read copy) plus the
    row scales and the ring (kernels/mamba2/README.md)."""
    H, P, N, G, L = 128, 64, 128, 8, 16
    cache = ReplayCache.allocate(1, H, P, N, G, ring_len=L, device="meta")
    E = H * P * N
    read = E + H * P * 4
    state = ((L - 1) * read + 2 * 4 * E + read) / L
    token = H * (P * 2 + 4) + G * N * 2
    ring = ((L - 1) * (L - 2) // 2 + 2 * L) * token / L
    assert cache.bytes_per_step() == pytest.approx(state + ring)
    assert 1.5 < state / E < 1.55


def test_reset_stores_the_checkpoint_and_its_read_copy():
    g = torch.Generator().manual_seed(0)
    cache = ReplayCache.allocate(3, 2, 4, 32, checkpoint="int8:row", read="fp8_e4m3:row")
    state = torch.randn(2, 2, 4, 32, generator=g)
    cache.cursor.fill_(3)
    cache.reset([2, 0], state)
    ck = quantize(state, "int8:row")
    assert torch.equal(cache.checkpoint[[2, 0]], ck.data) and torch.equal(cache.checkpoint_scale[[2, 0]], ck.scale)
    rd = quantize(dequantize(ck), "fp8_e4m3:row")
    assert torch.equal(cache.read[[2, 0]].view(torch.uint8), rd.data.view(torch.uint8))
    assert cache.cursor.tolist() == [0, 3, 0]
    assert torch.equal(cache.materialize([2, 0], torch.full((2,), -1.0)), dequantize(ck))


def test_materialize_folds_the_ring():
    cache = ReplayCache.allocate(1, 1, 2, 32, ring_len=4, read=None, input_dtype=torch.float32)
    S = torch.ones(1, 1, 2, 32)
    cache.reset([0], S)
    cache.ring_x[0, 0, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    cache.ring_dt[0, 0, :2] = torch.tensor([0.5, 0.25])
    cache.ring_B[0, 0, :2] = 1.0
    cache.cursor[0] = 2
    A = torch.tensor([-2.0])
    got = cache.materialize([0], A)[0, 0, :, 0].double()
    decay = torch.exp(torch.tensor(-2.0 * 0.75, dtype=torch.float64))
    w0 = torch.exp(torch.tensor(-2.0 * 0.25, dtype=torch.float64)) * 0.5
    expected = decay + w0 * torch.tensor([1.0, 2.0], dtype=torch.float64) + 0.25 * torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-6)


def test_materialize_reads_no_ring_entry_past_the_cursor():
    """Entries past the cursor (an earlier cycle's tokens, rejected drafts) may hold NaN or inf;
    the fold selects the live ones instead of weighting the others by 0 (0 · NaN = NaN)."""
    cache = ReplayCache.allocate(2, 2, 4, 32, ring_len=4, read=None, input_dtype=torch.float32, max_draft=2)
    g = torch.Generator().manual_seed(0)
    cache.reset([0, 1], torch.randn(2, 2, 4, 32, generator=g))
    cache.ring_x[:, :, :2] = torch.randn(2, 2, 2, 4, generator=g)
    cache.ring_dt[:, :, :2] = torch.rand(2, 2, 2, generator=g)
    cache.ring_B[:, :, :2] = torch.randn(2, 1, 2, 32, generator=g)
    cache.cursor[:] = torch.tensor([2, 0], dtype=torch.int32)
    A = torch.tensor([-1.0, -0.5])
    clean = cache.materialize([0, 1], A)
    cache.ring_x[:, :, 2:] = float("nan")
    cache.ring_dt[:, :, 2:] = float("inf")
    cache.ring_B[:, :, 2:] = float("nan")
    assert torch.isfinite(clean).all()
    assert torch.equal(cache.materialize([0, 1], A), clean)
    assert torch.equal(clean[1], cache.checkpoint_values([1])[0])


def test_from_tensors_checks_every_field():
    base = ReplayCache.allocate(2, 2, 4, 32, ring_len=3, read="int8:head")
    fields = {k: v for k, v in base.tensors().items()}
    cache = ReplayCache.from_tensors(**fields, checkpoint_format="fp32", read_format="int8:head")
    assert cache.ring_len == 3
    with pytest.raises(ValueError, match="read_scale: expected shape"):
        ReplayCache.from_tensors(**{**fields, "read_scale": torch.zeros(2, 3)}, read_format="int8:head")
    with pytest.raises(ValueError, match="read: expected None"):
        ReplayCache.from_tensors(**fields)
    with pytest.raises(TypeError, match="cursor: expected dtype torch.int32"):
        ReplayCache.from_tensors(**{**fields, "cursor": fields["cursor"].long()}, read_format="int8:head")
    with pytest.raises(TypeError, match="^seed: expected an int"):
        ReplayCache.from_tensors(**fields, read_format="int8:head", seed="7")


def test_allocate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ngroups"):
        ReplayCache.allocate(1, 6, 4, 32, 4)
    with pytest.raises(ValueError, match="checkpoint"):
        ReplayCache.allocate(1, 2, 4, 32, checkpoint="int8:head")
    with pytest.raises(ValueError, match="read"):
        ReplayCache.allocate(1, 2, 4, 48, read="fp8_e4m3:block32")
    with pytest.raises(TypeError, match="input_dtype"):
        ReplayCache.allocate(1, 2, 4, 32, input_dtype=torch.int8)
    for seed in (None, "7", 1.5, True):
        with pytest.raises(TypeError, match="^seed: expected an int"):
            ReplayCache.allocate(1, 2, 4, 32, seed=seed)
    with pytest.raises(ValueError, match="^device: expected"):
        ReplayCache.allocate(1, 2, 4, 32, device="cpux")
