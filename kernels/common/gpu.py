"""Properties of the GPU a launch runs on, looked up once per device: torch's property calls
were the largest single cost of an eager replay step's Python on the H200 machine's host."""

from __future__ import annotations

import functools

import torch


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 for any other device (the interpreter)."""
    return _properties(_index(device)).multi_processor_count if device.type == "cuda" else 1


def capability(device: torch.device) -> tuple:
    """``(major, minor)`` compute capability of a CUDA device."""
    props = _properties(_index(device))
    return props.major, props.minor
