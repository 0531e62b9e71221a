"""Call signatures: what an op's checks and launches read of a call.

An op's argument checks read shapes, strides, dtypes and devices, never device data, and its
plain arguments (format, flags, pad id): their outcome, and every argument of its launches but
the tensors' addresses, is a function of a signature made of those. An eager caller repeats one
signature step after step, so an op keeps one entry per signature in its
``kernels.common.launch.Dispatch``: the checks run the first time it meets a signature, a
repeat skips them (on the H200 machine's host they were about a third of an eager call's
Python) and, on a GPU, launches what the first call prepared. Checks of values (slot indices on
CPU tensors, seeds) do not belong in a signature and run every call.
"""

from __future__ import annotations

from typing import Hashable

import torch


def tensor_meta(t) -> Hashable:
    """What the checks read of one argument: ``(dtype, device, shape, strides)`` of a tensor,
    None for None, and for anything else a fresh object that equals nothing, so that a call with
    such an argument always runs the checks (which reject it)."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t.dtype, t.device, t.shape, t.stride()
    return object()


def metas(tensors) -> tuple:
    """:func:`tensor_meta` of each of ``tensors``, in one comprehension (no call per argument: the
    signature is built on every call)."""
    return tuple([(t.dtype, t.device, t.shape, t.stride()) if isinstance(t, torch.Tensor) else
                  None if t is None else object() for t in tensors])
