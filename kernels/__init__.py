"""Triton kernels of qstate (installed as ``qstate.kernels``): one folder per layer family
(``mamba2``) beside ``common``, the pieces every family shares. Validation lives in
:mod:`qstate.ops`."""

import functools
import importlib
import pkgutil


@functools.lru_cache(maxsize=None)
def _modules() -> tuple:
    """Every module of every folder here (imported), so a new launcher module is never left out."""
    return tuple(importlib.import_module(info.name) for info in pkgutil.walk_packages(__path__, __name__ + "."))


def clear_launch_plans() -> None:
    """Forget the launchers' plans (tile, grid and constexprs, cached per call signature) and the
    ops' prepared launches: call it after changing a launcher module's tuning constant, whose
    value a cached plan would keep."""
    from .common.launch import CompiledLaunch, clear_dispatches

    clear_dispatches()
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, CompiledLaunch):
                value.clear()
            elif name.endswith("_plan") and hasattr(value, "cache_clear"):
                value.cache_clear()
