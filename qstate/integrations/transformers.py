"""transformers drop-in: decode a Mamba-2 / Nemotron-H or gated delta rule (Qwen3-Next, Qwen3.5,
Qwen3.5-MoE, Kimi Linear) model through qstate.

::

    from qstate.integrations.transformers import patch

    with patch(model, "replay/fp32/fp8_e4m3:row/16"):
        out = model.generate(input_ids, max_new_tokens=64)   # unchanged call

How it hooks in. transformers 5.x computes the one-token decode of every Mamba-2 mixer with a
module-level function, ``mamba2_selective_state_update`` of the mixer's ``modeling_*.py``
(looked up at call time, so it can be swapped), and the prompt with a chunked scan whose final
state it stores in its cache. :func:`patch`

1. swaps that module-level function for a dispatcher (once per modeling module, reference
   counted over patched models); outside a patched mixer the dispatcher calls the original;
2. wraps the ``forward`` of each patched mixer (an instance attribute) so that, while it runs,
   the dispatcher sends the decode step to that mixer's route (:mod:`.decode_routes`):
   conventional schemes to :func:`qstate.selective_state_update`, replay schemes to
   :func:`qstate.replay_decode` over a :class:`qstate.ReplayCache` that is ``reset`` with the
   prefill's final state.

Gated delta rule layers are patched the same way through the one-token function their class
calls (:data:`SUPPORTED_DELTA_LAYERS`; docs/design.md#gdn-clients), and through the attributes of
releases that bind it to each layer, fla's or transformers' (:func:`.delta_routes.step_attributes`):
conventional schemes go to
:func:`qstate.gated_delta_update`, replay schemes to :func:`qstate.gated_delta_replay` over a
:class:`qstate.GatedDeltaReplayCache` (:mod:`.delta_routes`). A model with delta layers has
only those patched.

Prefill stays as transformers does it. Restoring puts back every name and attribute, exactly. Only the layer classes
whose decode call was read and checked are recognised: :data:`SUPPORTED_MIXERS`,
:data:`SUPPORTED_DELTA_LAYERS`.

Needs transformers >= 5.0, < 5.26 (the ``hf`` extra; :data:`SUPPORTED_TRANSFORMERS`) only to
build the model; this module imports no third-party library. Models of other releases are
refused: a release may change how it steps the state (5.25 began stepping a copy of the
cache's state, which the routes follow; :mod:`.decode_routes`).
"""

from __future__ import annotations

import contextvars
import functools
import importlib.metadata
import inspect
import re
import sys
from typing import Callable, Optional

import torch

from .decode_routes import ConventionalRoute, LayerRoute, ReplayRoute
from .delta_observe import SUPPORTED_LAYERS as SUPPORTED_DELTA_LAYERS
from .delta_observe import find_delta_layers
from .delta_routes import DeltaConventionalRoute, DeltaReplayRoute, step_attributes

__all__ = ["SUPPORTED_MIXERS", "SUPPORTED_DELTA_LAYERS", "Patch", "patch", "attach_routes", "find_mixers", "find_layers",
           "decode_logits"]

SUPPORTED_MIXERS = ("Mamba2Mixer", "NemotronHMamba2Mixer")
STEP_FUNCTION = "mamba2_selective_state_update"
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")  # by transformers version and model
# The releases whose decode call was read and checked (5.0-5.24 step the cache's tensor, 5.25 a
# clone it copies back). One the routes did not follow would look like an outside write at every
# token: a replay scheme would run as a conventional one under its own name.
SUPPORTED_TRANSFORMERS = ((5, 0), (5, 26))  # from, up to but not including

_ACTIVE_ROUTE: contextvars.ContextVar = contextvars.ContextVar("qstate_active_route", default=None)
_INSTALLED: dict[tuple, list] = {}  # (modeling module, function) -> [original function, number of patches using it]


def find_mixers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, mixer)`` for every supported Mamba-2 mixer of ``model``, in module order."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ in SUPPORTED_MIXERS and hasattr(sys.modules.get(type(module).__module__), STEP_FUNCTION):
            found.append((name, module))
    if not found:
        raise ValueError(
            f"model: expected a transformers Mamba2ForCausalLM or NemotronHForCausalLM with Mamba-2 mixers "
            f"({', '.join(SUPPORTED_MIXERS)}), found none in {type(model).__name__}")
    _check_transformers_version(type(found[0][1]).__module__)
    return found


def _transformers_version() -> str:
    return importlib.metadata.version("transformers")


def _check_transformers_version(module_name: str) -> None:
    if module_name.split(".")[0] != "transformers":
        return
    version = _transformers_version()
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= release < high:
        raise ValueError(
            f"model: expected a model of transformers >= {low[0]}.{low[1]}, < {high[0]}.{high[1]} (the releases "
            f"whose Mamba-2 decode qstate was checked against), got transformers {version}; "
            f"pip install \"transformers<{high[0]}.{high[1]}\"")


def _dispatcher(original: Callable) -> Callable:
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        route = _ACTIVE_ROUTE.get()
        if route is None:
            return original(*args, **kwargs)
        return route(original, *args, **kwargs)

    dispatch.__qstate_original__ = original
    return dispatch


def _install(target: tuple) -> None:
    entry = _INSTALLED.get(target)
    if entry is not None:
        entry[1] += 1
        return
    module_name, function = target
    module = sys.modules[module_name]
    original = getattr(module, function)
    setattr(module, function, _dispatcher(original))
    _INSTALLED[target] = [original, 1]


def _uninstall(target: tuple) -> None:
    entry = _INSTALLED[target]
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _INSTALLED[target]
    module_name, function = target
    module = sys.modules[module_name]
    if getattr(getattr(module, function), "__qstate_original__", None) is entry[0]:
        setattr(module, function, entry[0])


def _wrap_forward(mixer: torch.nn.Module, route) -> None:
    inner = mixer.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        token = _ACTIVE_ROUTE.set(route)
        route.begin_forward()
        try:
            return inner(*args, **kwargs)
        finally:
            route.end_forward()
            _ACTIVE_ROUTE.reset(token)

    forward.__qstate_inner__ = inner
    mixer.forward = forward


def _bind_steps(layer: torch.nn.Module, names: list) -> None:
    """Route the decode function ``layer`` holds as attributes ``names`` (a binding release)."""
    for name in names:
        layer.__dict__[name] = _dispatcher(layer.__dict__[name])


def _unbind_steps(layer: torch.nn.Module, names: list) -> None:
    for name in names:
        layer.__dict__[name] = layer.__dict__[name].__qstate_original__


def _unwrap_forward(mixer: torch.nn.Module, had_own_forward: bool) -> None:
    inner = mixer.__dict__["forward"].__qstate_inner__
    if had_own_forward:
        mixer.forward = inner
    else:
        del mixer.forward


class Patch:
    """A patched model: ``routes`` maps each mixer's module name to its route. Use as a context
    manager, or call :meth:`restore`. Build with :func:`patch` or :func:`attach_routes`."""

    def __init__(self, model: torch.nn.Module, routes: dict, mixers: list, scheme=None):
        self.model = model
        self.scheme = scheme
        self.routes = routes
        self._mixers = mixers  # [(mixer or delta layer, had its own forward attribute)]
        self._modules = sorted({(type(m).__module__, _step_function(m)) for m, _ in mixers})
        # the attributes of each layer that hold its decode function (releases that bind it)
        self._bound = [step_attributes(m, getattr(sys.modules[type(m).__module__], _step_function(m)))
                       if _is_delta_layer(m) else [] for m, _ in mixers]
        self.active = False

    def _apply(self) -> None:
        if getattr(self.model, "_qstate_patch", None) is not None:
            raise ValueError("model: already patched by qstate; restore the first patch before patching again")
        done_mixers, done_modules = [], []
        try:
            for target in self._modules:
                _install(target)
                done_modules.append(target)
            for (mixer, had_own), route, bound in zip(self._mixers, self.routes.values(), self._bound):
                _wrap_forward(mixer, route)
                _bind_steps(mixer, bound)
                done_mixers.append((mixer, had_own, bound))
            self.model._qstate_patch = self
        except BaseException:
            for mixer, had_own, bound in reversed(done_mixers):
                _unbind_steps(mixer, bound)
                _unwrap_forward(mixer, had_own)
            for target in reversed(done_modules):
                _uninstall(target)
            raise
        self.active = True

    def restore(self) -> None:
        """Put the model back exactly as it was (idempotent)."""
        if not self.active:
            return
        for (mixer, had_own), bound in zip(reversed(self._mixers), reversed(self._bound)):
            _unbind_steps(mixer, bound)
            _unwrap_forward(mixer, had_own)
        for target in reversed(self._modules):
            _uninstall(target)
        del self.model._qstate_patch
        self.active = False

    @property
    def steps(self) -> dict:
        """Decode steps each route has run since patching (0 means qstate never ran there)."""
        return {name: route.steps for name, route in self.routes.items()}

    def missed_steps(self, expected: int) -> dict:
        """``{layer: steps}`` of the layers whose route ran other than ``expected`` decode steps:
        a decode that bypassed qstate there (empty when every layer ran them all)."""
        return {name: steps for name, steps in self.steps.items() if steps != expected}

    @property
    def caches(self) -> dict:
        """Replay schemes: the :class:`qstate.ReplayCache` (Mamba-2) or
        :class:`qstate.GatedDeltaReplayCache` (delta rule) of each layer (None before its first step)."""
        return {name: getattr(route, "cache", None) for name, route in self.routes.items()}

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def _step_function(layer: torch.nn.Module) -> str:
    return SUPPORTED_DELTA_LAYERS.get(type(layer).__name__, STEP_FUNCTION)


def find_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers :func:`patch` routes: the gated delta rule layers of ``model``
    (:data:`SUPPORTED_DELTA_LAYERS`) when it has any, else its Mamba-2 mixers (:func:`find_mixers`)."""
    layers = find_delta_layers(model)
    if not layers:
        return find_mixers(model)
    _check_transformers_version(type(layers[0][1]).__module__)
    return layers


def _is_delta_layer(layer: torch.nn.Module) -> bool:
    return type(layer).__name__ in SUPPORTED_DELTA_LAYERS


def attach_routes(model: torch.nn.Module, make_route: Callable[[str, torch.nn.Module], object],
                  scheme=None) -> Patch:
    """Patch ``model`` with ``make_route(name, layer)`` per layer of :func:`find_layers` (a
    :class:`LayerRoute`- or :class:`~.delta_routes.DeltaLayerRoute`-like callable). All routes
    are built before anything is changed; on failure nothing is."""
    mixers = find_layers(model)
    routes = {name: make_route(name, mixer) for name, mixer in mixers}
    result = Patch(model, routes, [(m, "forward" in m.__dict__) for _, m in mixers], scheme)
    result._apply()
    return result


def _route(scheme, seed: int, name: str, layer: torch.nn.Module):
    if _is_delta_layer(layer):
        if scheme.is_replay:
            if scheme.ring == "corrected":
                raise ValueError(f"scheme: the delta-rule replay op keeps an inputs ring, got {scheme} "
                                 f"(drop the '/corrected')")
            return DeltaReplayRoute(name, scheme.checkpoint, scheme.read, scheme.ring_len)
        return DeltaConventionalRoute(name, scheme.fmt, seed=seed)
    if scheme.is_replay:
        return ReplayRoute(name, scheme.checkpoint, scheme.read, scheme.ring_len, seed=seed)
    return ConventionalRoute(name, scheme.fmt, seed=seed)


def _route_factory(scheme, seed: int) -> Callable[[str, torch.nn.Module], LayerRoute]:
    return functools.partial(_route, scheme, seed)


def patch(model: torch.nn.Module, scheme, *, seed: int = 0) -> Patch:
    """Route the one-token decode step of every Mamba-2 mixer or gated delta rule layer of
    ``model`` through qstate.

    ``model``: a transformers ``Mamba2ForCausalLM`` or ``NemotronHForCausalLM`` (or any module
    holding :data:`SUPPORTED_MIXERS`), or a Qwen3-Next, Qwen3.5 (dense or MoE) or Kimi Linear
    model (any module holding :data:`SUPPORTED_DELTA_LAYERS`: conventional schemes run
    :func:`qstate.gated_delta_update`, replay schemes :func:`qstate.gated_delta_replay`; module
    :mod:`.delta_routes`). ``scheme``: a :class:`qstate.analysis.schemes.Scheme` or its
    string form (``"fp32"``, ``"fp8_e4m3:row"``, ``"replay/fp32/16"``,
    ``"replay/fp32/fp8_e4m3:row/16"``). ``seed`` keys stochastic rounding.

    Returns a :class:`Patch`, also a context manager that restores the model on exit.
    ``model.generate()`` and ``model(...)`` work unchanged; prefill runs as before and its final
    state seeds qstate's storage. Raises ``ValueError`` for a model with neither, a scheme that
    does not parse (or a ``corrected`` ring on a delta-rule model), or a model that is already
    patched; the model is then unchanged.
    """
    from ..analysis.schemes import Scheme

    parsed = Scheme.parse(scheme)
    return attach_routes(model, _route_factory(parsed, seed), scheme=parsed)


def _cache_argument(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in params:
            return name
    raise ValueError(f"model: {type(model).__name__}.forward takes none of the cache arguments {CACHE_ARGUMENTS}")


@torch.no_grad()
def decode_logits(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, *,
                  tokens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``input_ids (batch, prompt)``, then feed ``new_tokens`` tokens one at a time.

    The fed tokens are ``tokens (batch, new_tokens)`` (teacher forcing) or, when None, greedy
    (the first is the argmax of the prefill's last logits). Returns ``(tokens, logits)``:
    the fed tokens and ``logits (batch, new_tokens, vocab)``, fp32, where ``logits[:, k]`` is the
    next-token distribution after feeding ``tokens[:, k]`` (decode step k + 1).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        got = (f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"input_ids: expected an integer tensor (batch, prompt_len), got {got}")
    if not input_ids.numel():
        raise ValueError(f"input_ids: expected at least one sequence of at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens: expected an int >= 1, got {new_tokens!r}")
    if tokens is not None and tuple(tokens.shape) != (input_ids.shape[0], new_tokens):
        raise ValueError(f"tokens: expected shape (batch, new_tokens) = {(input_ids.shape[0], new_tokens)}, "
                         f"got {tuple(tokens.shape)}")
    key = _cache_argument(model)
    out = model(input_ids=input_ids, use_cache=True)
    cache = getattr(out, key)
    next_logits = out.logits[:, -1]
    fed, logits = [], []
    for k in range(new_tokens):
        token = next_logits.argmax(-1) if tokens is None else tokens[:, k].to(input_ids.device)
        fed.append(token)
        out = model(input_ids=token[:, None], use_cache=True, **{key: cache})
        cache = getattr(out, key)
        next_logits = out.logits[:, -1]
        logits.append(next_logits.float())
    return torch.stack(fed, dim=1), torch.stack(logits, dim=1)
