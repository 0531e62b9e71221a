"""Checks that run once per call signature.

An op's argument checks read shapes, strides, dtypes and devices, never device data, and its
plain arguments (format, flags, pad id): their outcome is a function of a signature made of
those. An eager caller repeats one signature step after step, so an op runs its checks the
first time it meets a signature and remembers it when they pass; a repeat skips straight to the
launch. On the H200 machine's host the checks were about a third of an eager call's Python
(bench/README.md, "Eager overhead"). Checks of values (slot indices on CPU tensors) do not
belong in a signature and run every call.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

# Signatures remembered per op; past this many (a caller cycling through shapes) the set starts
# again rather than grow.
MAX_REMEMBERED = 4096


def tensor_meta(t) -> Hashable:
    """What the checks read of one argument: ``(dtype, device, shape, strides)`` of a tensor,
    None for None, and for anything else a fresh object that equals nothing, so that a call with
    such an argument always runs the checks (which reject it)."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t.dtype, t.device, t.shape, t.stride()
    return object()


class AcceptedSignatures:
    """Signatures whose checks passed, for one op."""

    def __init__(self) -> None:
        self._seen: set = set()

    def check_once(self, signature, check: Callable[..., None], *args) -> None:
        """``check(*args)`` unless ``signature`` passed before; remembered when it passes. An
        unhashable signature (a plain argument of a type the checks reject) is always checked."""
        try:
            if signature in self._seen:
                return
        except TypeError:
            check(*args)
            return
        check(*args)
        if len(self._seen) >= MAX_REMEMBERED:
            self._seen.clear()
        self._seen.add(signature)
