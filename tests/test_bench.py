"""The benchmark helpers that run on the CPU too (the GPU timing itself runs through bench/run_gpu.py)."""

import pytest

from bench import breakdown
from qstate.kernels import speculative


def test_set_constant_sets_a_launcher_constant_to_a_literal(monkeypatch):
    monkeypatch.setattr(speculative, "FLUSH_TILE", speculative.FLUSH_TILE)
    breakdown.set_constant("qstate.kernels.speculative.FLUSH_TILE = (16, 4)")
    assert speculative.FLUSH_TILE == (16, 4)


@pytest.mark.parametrize("assignment, message", [
    ("FLUSH_TILE", "expected MODULE.NAME=VALUE"),
    ("qstate.kernels.speculative.NO_SUCH_TILE=(1, 1)", "has no attribute 'NO_SUCH_TILE'"),
])
def test_set_constant_rejects_what_it_cannot_set(assignment, message):
    with pytest.raises(ValueError, match=message):
        breakdown.set_constant(assignment)
