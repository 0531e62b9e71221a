"""Host-side size arithmetic of the launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function`` objects in the Triton
versions we support: called from Python, each call goes through a wrapper that unwraps every
argument, which was about a fifth of a launcher's Python time (profile of an eager batch-1
call), paid on every eager launch. These are the same integers from plain Python.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
