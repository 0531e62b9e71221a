"""Host size arithmetic of the launchers (``qstate.kernels.common.sizes``) against Triton's own."""

import triton

from qstate.kernels.common import sizes


def test_cdiv_matches_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 32, 64, 100):
            assert sizes.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_matches_triton():
    for n in list(range(1, 2100)) + [2**20 - 1, 2**20, 2**20 + 1]:
        assert sizes.next_power_of_2(n) == triton.next_power_of_2(n), n
