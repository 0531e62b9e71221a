"""ReplayCache at its boundary: cursors of a cache over foreign memory, seeds, the read copy's
random stream, device and format arguments named in errors, and failed calls that change nothing."""

import pytest
import torch

from qstate import replay_decode
from qstate.cache import ReplayCache


def _foreign(cursor_values, *, max_draft=0, drafts=None):
    """A cache built with ``from_tensors`` over an allocated cache's tensors (ring_len 3)."""
    own = ReplayCache.allocate(4, 2, 4, 8, ring_len=3, read=None, input_dtype=torch.float32, max_draft=max_draft)
    own.cursor.copy_(torch.tensor(cursor_values, dtype=torch.int32))
    if drafts is not None:
        own.drafts.copy_(torch.tensor(drafts, dtype=torch.int32))
    t = own.tensors()
    return dict(checkpoint=t["checkpoint"], ring_x=t["ring_x"], ring_dt=t["ring_dt"], ring_B=t["ring_B"],
                cursor=t["cursor"], generation=t["generation"], flush_rows=t["flush_rows"],
                flush_counters=t["flush_counters"], drafts=t["drafts"], max_draft=max_draft)


@pytest.mark.parametrize("cursors", [[0, 0, 5, 0], [0, -2, 0, 0], [100000, 0, 0, 0], [0, 0, 0, 3]])
def test_from_tensors_rejects_cursors_outside_the_ring(cursors):
    with pytest.raises(ValueError, match=r"^cursor: expected values in \[0, 3\)"):
        ReplayCache.from_tensors(**_foreign(cursors))


def test_from_tensors_accepts_cursors_inside_the_ring():
    cache = ReplayCache.from_tensors(**_foreign([0, 1, 2, 0]))
    assert cache.cursor.tolist() == [0, 1, 2, 0]


def test_from_tensors_checks_cursors_and_drafts_against_the_speculative_ring():
    ReplayCache.from_tensors(**_foreign([4, 0, 0, 0], max_draft=2))  # capacity 5
    with pytest.raises(ValueError, match=r"^cursor: expected values in \[0, 5\)"):
        ReplayCache.from_tensors(**_foreign([5, 0, 0, 0], max_draft=2))
    with pytest.raises(ValueError, match=r"^drafts: expected values in \[0, 2\]"):
        ReplayCache.from_tensors(**_foreign([0, 0, 0, 0], max_draft=2, drafts=[3, 0, 0, 0]))
    with pytest.raises(ValueError, match="^drafts: expected cursor \\+ drafts <= 5"):
        ReplayCache.from_tensors(**_foreign([4, 0, 0, 0], max_draft=2, drafts=[2, 0, 0, 0]))


def test_from_tensors_names_checkpoint_format():
    with pytest.raises(ValueError, match="^checkpoint_format: "):
        ReplayCache.from_tensors(**_foreign([0, 0, 0, 0]), checkpoint_format="int4")
    with pytest.raises(ValueError, match="^read_format: "):
        ReplayCache.from_tensors(**_foreign([0, 0, 0, 0]), read_format="int4")
    with pytest.raises(ValueError, match="^checkpoint_format: expected fp32"):
        ReplayCache.from_tensors(**_foreign([0, 0, 0, 0]), checkpoint_format="int8:head")


def test_allocate_names_checkpoint():
    with pytest.raises(ValueError, match="^checkpoint: "):
        ReplayCache.allocate(1, 1, 1, 1, checkpoint="int4")


def _sr_cache():
    cache = ReplayCache.allocate(2, 2, 4, 8, checkpoint="fp32", read="int8:row+sr")
    return cache


def test_reset_draws_the_read_copy_from_the_generator():
    state = torch.randn(2, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    reads = []
    for _ in range(2):
        cache = _sr_cache()
        torch.manual_seed(123)
        before = torch.get_rng_state()
        cache.reset([0, 1], state, generator=torch.Generator().manual_seed(7))
        assert torch.equal(torch.get_rng_state(), before), "the global stream was consumed"
        reads.append(cache.read.clone())
        torch.manual_seed(999)  # a different global state must not change the next run
    assert torch.equal(reads[0], reads[1])


@pytest.mark.parametrize("seed", [2**64, 2**31, -1])
def test_allocate_rejects_seeds_outside_31_bits(seed):
    with pytest.raises(ValueError, match=r"^seed: expected an int in \[0, 2\*\*31\)"):
        ReplayCache.allocate(1, 1, 1, 1, seed=seed)


@pytest.mark.parametrize("seed", [2**64, -5])
def test_from_tensors_rejects_seeds_outside_31_bits(seed):
    with pytest.raises(ValueError, match=r"^seed: expected an int in \[0, 2\*\*31\)"):
        ReplayCache.from_tensors(**_foreign([0, 0, 0, 0]), seed=seed)


def test_seed_at_the_top_of_the_range_decodes():
    cache = ReplayCache.allocate(2, 2, 4, 8, ring_len=1, checkpoint="bf16+sr", read=None,
                                 input_dtype=torch.float32, seed=2**31 - 1)
    g = torch.Generator().manual_seed(0)
    y = replay_decode(cache, torch.randn(2, 2, 4, generator=g), torch.randn(2, 2, generator=g), -torch.ones(2),
                      torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g))
    assert torch.isfinite(y).all() and cache.flush_counters.tolist() == [0, 0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_allocate_on_a_missing_gpu_names_device():
    with pytest.raises(ValueError, match="^device: "):
        ReplayCache.allocate(1, 1, 1, 1, device="cuda")
