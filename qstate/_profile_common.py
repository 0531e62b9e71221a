"""Helpers shared by the profile families: number checks, seeds, head selection."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Optional

import torch

from . import _validate


def bounded(name: str, value, low: float, *, strict: bool, low_name: str = "") -> None:
    """Check that ``value`` is a finite real number ``> low`` (``strict``) or ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (strict and value == low):
        bound = f"{low_name} = {low}" if low_name else f"{low}"
        raise ValueError(f"{name}: expected a finite number {'>' if strict else '>='} {bound}, got {value}")


def index(value) -> Optional[int]:
    """``value`` as an int if it is an integer (Python, numpy or torch), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def seeded_generator(seed) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (an int in [-2**63, 2**64))."""
    value = index(seed)
    if value is None:
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if not -2**63 <= value < 2**64:
        raise ValueError(f"seed: expected an int in [-2**63, 2**64), got {value}")
    return torch.Generator().manual_seed(value)


def stratified(count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` fp64 draws in [0, 1), one per ``1/count`` quantile, in an order set by ``generator``."""
    u = (torch.arange(count, dtype=torch.float64) + torch.rand(count, generator=generator, dtype=torch.float64)) / count
    return u[torch.randperm(count, generator=generator)]


def spread(decays: torch.Tensor, count: int) -> list[int]:
    """``count`` indices whose ``decays`` are evenly spaced in rank (slowest last), sorted."""
    total = decays.numel()
    _validate.positive_int("heads", count)
    if count > total:
        raise ValueError(f"heads: expected at most {total} heads, got {count}")
    order = torch.argsort(decays)
    picks = torch.linspace(0, total - 1, count).round().long()
    return sorted(order[picks].tolist())


def resolve_heads(heads, total: int, spread_heads) -> list[int]:
    """None → all ``total`` heads; an int ``k`` → ``spread_heads(k)``; else explicit indices."""
    if heads is None:
        return list(range(total))
    count = index(heads)
    if count is not None:
        return spread_heads(count)
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise TypeError(f"heads: expected None, an int or a sequence of head indices, got {type(heads).__name__}")
    given = list(heads)
    indices = [index(h) for h in given]
    if None in indices:
        raise TypeError(f"heads: expected int head indices, got {[h for h, i in zip(given, indices) if i is None]}")
    bad = [h for h in indices if not 0 <= h < total]
    if bad or not indices:
        raise ValueError(f"heads: expected indices in [0, {total}), got {bad or indices}")
    return indices


def check_sampling(steps, batch, dtype) -> None:
    _validate.positive_int("steps", steps)
    _validate.positive_int("batch", batch)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype}")


def config_count(key: str, value) -> int:
    """A count read from a config.json: an int >= 1, else an error naming ``key``."""
    count = index(value)
    if count is None:
        raise TypeError(f"config: {key}: expected an int, got {value!r}")
    if count < 1:
        raise ValueError(f"config: {key}: expected an int >= 1, got {count}")
    return count
