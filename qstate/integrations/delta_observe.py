"""Watch the one-token decode steps of a transformers model's gated delta rule layers.

transformers computes the decode step of every delta-rule layer with a module-level function of
its ``modeling_*.py``, looked up at call time: ``torch_recurrent_gated_delta_rule`` (Qwen3-Next,
Qwen3.5, Qwen3.5-MoE) and ``recurrent_kimi_delta_attention`` (Kimi Linear, GLM-5.x-next), called as
``f(query, key, value, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=True)``
with ``query, key (batch, 1, HK, K)`` (HV heads in releases that repeat them first),
``value (batch, 1, HV, V)``, ``g (batch, 1, HV)`` or ``(batch, 1, HV, K)`` in log space,
``beta (batch, 1, HV)`` after the sigmoid and ``initial_state (batch, HV, K, V)``.
:func:`observe` swaps that function for a wrapper while it is active and wraps each layer's
``forward`` so the wrapper knows which layer calls; the wrapper runs transformers' function
unchanged and hands the step to a recorder. Releases that bind the step to each layer at
construction (fla's function when flash-linear-attention is installed, else transformers') call
it through that attribute instead: those attributes (:func:`.delta_routes.step_attributes`) get
the same wrapper. Leaving the context puts back every name, attribute and ``forward``, the very
objects that were there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
from typing import Callable, Iterator

import torch

from .delta_routes import step_attributes

__all__ = ["SUPPORTED_LAYERS", "DeltaStep", "find_delta_layers", "observe"]

# Layer class → the module-level function its decode step calls.
SUPPORTED_LAYERS = {
    "Qwen3NextGatedDeltaNet": "torch_recurrent_gated_delta_rule",
    "Qwen3_5GatedDeltaNet": "torch_recurrent_gated_delta_rule",
    "Qwen3_5MoeGatedDeltaNet": "torch_recurrent_gated_delta_rule",
    "KimiLinearDeltaAttention": "recurrent_kimi_delta_attention",
    "Glm5NextTextLinearAttention": "recurrent_kimi_delta_attention",
}

_ACTIVE_LAYER: contextvars.ContextVar = contextvars.ContextVar("qstate_delta_layer", default=None)


@dataclasses.dataclass
class DeltaStep:
    """One decode token of one layer in :mod:`qstate.reference.gated_delta`'s shapes (no T):
    ``q, k (batch, HK, K)``, ``v (batch, HV, V)``, ``g (batch, HV)`` or ``(batch, HV, K)``,
    ``beta (batch, HV)``, ``state`` and ``new_state (batch, HV, V, K)`` (V-first views).
    The tensors are transformers' own, valid during the call only: its cache may reuse them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor
    new_state: torch.Tensor


def find_delta_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` for every supported delta-rule layer of ``model``, in module order."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    found = []
    for name, module in model.named_modules():
        function = SUPPORTED_LAYERS.get(type(module).__name__)
        if function is not None and hasattr(sys.modules.get(type(module).__module__), function):
            found.append((name, module))
    return found


def _wrapper(original: Callable, record: Callable[[str, DeltaStep], None]) -> Callable:
    @functools.wraps(original)
    def step(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        out = original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       **kwargs)
        layer = _ACTIVE_LAYER.get()
        if layer is not None and initial_state is not None and query.shape[1] == 1 and out[1] is not None:
            record(layer, DeltaStep(q=query[:, 0], k=key[:, 0], v=value[:, 0], g=g[:, 0], beta=beta[:, 0],
                                    state=initial_state.transpose(-1, -2), new_state=out[1].transpose(-1, -2)))
        return out

    return step


@contextlib.contextmanager
def observe(model: torch.nn.Module, record: Callable[[str, DeltaStep], None]) -> Iterator[list]:
    """While active, ``record(layer_name, step)`` sees every one-token decode step of every
    delta-rule layer of ``model``. Yields the ``(name, layer)`` list; raises ``ValueError`` for
    a model without supported layers (:data:`SUPPORTED_LAYERS`)."""
    layers = find_delta_layers(model)
    if not layers:
        raise ValueError(f"model: expected a transformers model with gated delta rule layers "
                         f"({', '.join(SUPPORTED_LAYERS)}), found none in {type(model).__name__}")
    # read before the module-level names are swapped: step_attributes matches the original function
    bindings = [(layer, step_attributes(layer, getattr(sys.modules[type(layer).__module__],
                                                        SUPPORTED_LAYERS[type(layer).__name__])))
                for _, layer in layers]
    swapped, bound, wrapped = [], [], []
    try:
        for module_name in sorted({type(m).__module__ for _, m in layers}):
            module = sys.modules[module_name]
            for function in sorted({SUPPORTED_LAYERS[type(m).__name__] for _, m in layers
                                    if type(m).__module__ == module_name}):
                original = getattr(module, function)
                setattr(module, function, _wrapper(original, record))
                swapped.append((module, function, original))
        for layer, attributes in bindings:
            for attribute in attributes:
                original = layer.__dict__[attribute]
                layer.__dict__[attribute] = _wrapper(original, record)
                bound.append((layer, attribute, original))
        for name, layer in layers:
            had_own = "forward" in layer.__dict__
            inner = layer.forward

            def forward(*args, _inner=inner, _name=name, **kwargs):
                token = _ACTIVE_LAYER.set(_name)
                try:
                    return _inner(*args, **kwargs)
                finally:
                    _ACTIVE_LAYER.reset(token)

            layer.forward = forward
            wrapped.append((layer, had_own, inner))
        yield layers
    finally:
        for layer, had_own, inner in reversed(wrapped):
            if had_own:
                layer.forward = inner
            else:
                del layer.forward
        for layer, attribute, original in reversed(bound):
            layer.__dict__[attribute] = original
        for module, function, original in reversed(swapped):
            setattr(module, function, original)
