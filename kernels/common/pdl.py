"""Programmatic dependent launch (PDL, sm_90 and later): a kernel may start launching while the
kernel before it in the stream finishes, so consecutive decode kernels (the replay step and
flush kernels, one layer's step and the next) do not pay a full launch gap between them
(kernels/README.md, "Launch overlap").

A kernel that takes part calls :func:`grid_dependency` before its first global memory access:
it waits until the previous kernel has finished and its writes are visible, then lets the next
kernel begin launching. The previous kernel need not take part (it then counts as finished
when it exits), so this is safe next to any other kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import gpu


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA devices of compute capability 9.0 or
    later (never under the interpreter)."""
    if device.type != "cuda":
        return False
    return gpu.capability(device) >= (9, 0)


def launch_options(pdl: bool) -> dict:
    """Launch keyword arguments of a kernel that calls :func:`grid_dependency` with ``pdl``."""
    return {"launch_pdl": True} if pdl else {}
