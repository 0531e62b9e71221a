"""Triton kernels of qstate (installed as ``qstate.kernels``): ``@triton.jit`` code and one
launcher per op. Validation lives in :mod:`qstate.ops`."""


def clear_launch_plans() -> None:
    """Forget the launchers' plans (tile, grid and constexprs, cached per call signature): call it
    after changing a launcher module's tuning constant, whose value a cached plan would keep."""
    from . import conventional, replay

    conventional._plan.cache_clear()
    replay._plan.cache_clear()
    for launch in (conventional._launch, replay._launch_step, replay._launch_step_grouped, replay._launch_flush):
        launch.clear()
