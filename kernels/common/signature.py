"""What an op's dispatch entry is keyed on: the metadata of a call's tensors.

An op's argument checks read shapes, strides, dtypes and devices, never device data, and its
plain arguments (formats, flags, pad ids): their outcome, and every argument of its launches but
the tensors' addresses, is a function of those. :func:`tensor_metas` is that metadata as a
hashable key. :class:`TensorsLike` answers the question an eager repeat asks, "are these
tensors laid out as those were?", in one C++ call (torch's tensor guard, the check
``torch.compile`` runs before a compiled graph: dtype, device, dispatch keys, sizes and
strides) instead of building the key, where torch has one that behaves as expected.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # a torch without dynamo's guards: every call builds the key
    _TensorGuards = None


def tensor_metas(tensors: Sequence) -> tuple:
    """``(dtype, device, shape, strides)`` of each tensor, None for None, and for anything else a
    fresh object that equals nothing (a call with such an argument always runs the checks,
    which reject it). One comprehension: the key is built on every call that is not a repeat."""
    return tuple([(t.dtype, t.device, t.shape, t.stride()) if isinstance(t, torch.Tensor) else
                  None if t is None else object() for t in tensors])


class TensorsLike:
    """``like(tensors)``: whether ``tensors`` (a sequence with None in places) has None in the
    same places as the tensors it was made from and, everywhere else, tensors of the same dtype,
    device, dispatch keys, sizes and strides. Addresses and values are not compared. Made by
    :meth:`of`, which gives None where that cannot be checked this way (an argument that is
    neither a tensor nor None, or no working tensor guard in this torch)."""

    __slots__ = ("_absent", "_guard")

    def __init__(self, absent: tuple, guard):
        self._absent = absent
        self._guard = guard

    @classmethod
    def of(cls, tensors: Sequence) -> Optional["TensorsLike"]:
        if not _GUARDS_WORK:
            return None
        present = [t for t in tensors if t is not None]
        if not all(isinstance(t, torch.Tensor) for t in present):
            return None
        return cls(tuple([t is None for t in tensors]), _guard(present))

    def __call__(self, tensors: Sequence) -> bool:
        if tuple([t is None for t in tensors]) != self._absent:
            return False
        return self._guard.check(*[t for t in tensors if t is not None])


def _guard(tensors: list):
    return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _guards_work() -> bool:
    """Whether this torch's tensor guard accepts what it was made from and refuses another
    stride, dtype or shape and a non-tensor (a private API: checked once, off if it differs)."""
    if _TensorGuards is None:
        return False
    try:
        base = torch.zeros(2, 3)
        guard = _guard([base, base[0]])
        refused = (torch.zeros(3, 2).t(), base[0]), (base.double(), base[0]), (base, base[:, 0]), (base, 1.0)
        return guard.check(torch.ones(2, 3), torch.ones(3)) is True and not any(
            guard.check(*args) for args in refused)
    except Exception:  # noqa: BLE001 - any other behaviour turns the guard off
        return False


_GUARDS_WORK = _guards_work()
