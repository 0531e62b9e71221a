"""Triton kernels of qstate (installed as ``qstate.kernels``): one folder per layer family
(``mamba2``) beside ``common``, the pieces every family shares. Validation lives in
:mod:`qstate.ops`."""


def clear_launch_plans() -> None:
    """Forget the launchers' plans (tile, grid and constexprs, cached per call signature): call it
    after changing a launcher module's tuning constant, whose value a cached plan would keep."""
    from .common.launch import CompiledLaunch
    from .mamba2 import conventional, replay, speculative

    for module in (conventional, replay, speculative):
        for name, value in vars(module).items():
            if isinstance(value, CompiledLaunch):
                value.clear()
            elif name.endswith("_plan") and hasattr(value, "cache_clear"):
                value.cache_clear()
