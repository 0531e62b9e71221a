"""Test setup: kernels run under the Triton interpreter on machines without a GPU.

TRITON_INTERPRET must be set before any kernel module is imported (docs/design.md#triton-interpreter).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run; locally HYPOTHESIS_PROFILE=explore searches further.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=500)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_configure(config):
    # Under CI the transformers tests must run: a failed import would turn them into skips and
    # leave the run green.
    if os.environ.get("CI") == "true":
        from qstate.integrations.hf_import import import_transformers

        try:
            import_transformers()
        except ImportError as err:
            raise pytest.UsageError(f"CI=true: transformers must import (the tests of the 'hf' extra would be "
                                    f"skipped otherwise), got {type(err).__name__}: {err}") from None


@pytest.fixture(autouse=True)
def one_torch_thread():
    # CI runs two pytest workers on two cores: one torch thread each avoids oversubscription,
    # which slows a shared machine several-fold.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    # Tests patch launchers' tuning constants; a plan cached under other values would ignore them.
    from qstate.kernels import clear_launch_plans

    clear_launch_plans()
    yield
    clear_launch_plans()


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """``install(module)``: every ``CompiledLaunch`` of a kernels module launches a recording
    stand-in for its kernel, as on a GPU (compiled launchers, prepared launches), whatever the
    tensors' device; returns the shared log. Restored after the test."""
    from qstate.kernels.common.launch import CompiledLaunch, StandInKernel

    log = []

    def install(module):
        for name, value in list(vars(module).items()):
            if isinstance(value, CompiledLaunch):
                stand_in = CompiledLaunch(StandInKernel(value.kernel, log.append), value.volatile, stand_in=True)
                monkeypatch.setattr(module, name, stand_in)
        return log

    return install
