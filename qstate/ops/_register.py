"""How the ops are registered and called.

Every op here mutates its arguments and returns nothing, so its fake (meta) implementation does
nothing. :func:`mutating_op` registers ``impl`` as a ``torch.library`` custom op with such a
fake, and returns the function the public API calls. That goes through the custom op wherever
something may be tracing or faking the call: while ``torch.compile`` traces, under any
``TorchDispatchMode`` (``FakeTensorMode``, functionalization, debugging modes) and on meta
tensors. Otherwise (eager calls, and CUDA-graph capture, which records the same launches) it
calls ``impl`` itself, skipping the dispatcher's handling of the arguments: with kernel
launches stubbed out on a 2-core CPU host, ``replay_decode``'s 25 arguments through the
dispatcher took about 210 µs a call, the whole public call without it about 10
(``bench/host_overhead.py``). An eager GPU call whose signature has been launched before does
not come here: it launches what its op's dispatch entry prepared (kernels/README.md#dispatch).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def _no_output(*args, **kwargs) -> None:
    return None


def mutating_op(name: str, impl: Callable[..., None], mutates_args: Sequence[str]) -> Callable[..., None]:
    """Register ``impl`` (annotated, returns None; its first argument a tensor) as the custom op
    ``name``; returns its caller."""
    op = torch.library.custom_op(name, impl, mutates_args=tuple(mutates_args))
    op.register_fake(_no_output)

    def call(*args) -> None:
        if eager(args[0]):
            impl(*args)
        else:
            op(*args)

    return call


def host_values(device: torch.device) -> bool:
    """Whether a call's value checks read its tensors on the host: CPU tensors only (reading a
    GPU tensor would sync), and not while ``torch.compile`` traces or a dispatch mode
    (``FakeTensorMode``) fakes the call (its tensors hold no values)."""
    return device.type == "cpu" and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def eager(first: torch.Tensor) -> bool:
    """Whether a call whose first tensor is ``first`` runs the implementation itself: nothing is
    tracing or faking it and its tensors are not meta tensors."""
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None and first.device.type != "meta"
