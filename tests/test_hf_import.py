"""qstate.integrations.hf_import: transformers >= 5.25 imports Hugging Face's ``kernels`` package,
which a checkout's ``kernels/`` directory shadows wherever the checkout's root is on sys.path."""

import importlib
import importlib.util
import os
import sys

import pytest

from qstate.integrations import hf_import

OURS = os.path.realpath(importlib.util.find_spec("qstate.kernels").origin)
CHECKOUT = os.path.dirname(os.path.dirname(OURS))


def _without_checkout(path):
    return [entry for entry in path if os.path.realpath(entry or os.curdir) != CHECKOUT]


@pytest.fixture
def clean_kernels(monkeypatch):
    """No ``kernels`` module imported during the test; whatever was there before comes back."""
    if os.path.basename(os.path.dirname(OURS)) != "kernels":
        pytest.skip("qstate.kernels is not a checkout's kernels/ directory (not an editable install)")
    before = sys.modules.pop("kernels", None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("kernels", None)
    if before is not None:
        sys.modules["kernels"] = before
    importlib.invalidate_caches()


@pytest.fixture
def installed(tmp_path):
    """A directory holding a stand-in for the installed ``kernels`` package."""
    package = tmp_path / "site" / "kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    importlib.invalidate_caches()
    return tmp_path / "site"


def test_the_installed_package_is_loaded_where_the_checkout_shadows_it(clean_kernels, installed):
    sys.path[:] = [CHECKOUT, str(installed), *_without_checkout(sys.path)]
    assert os.path.realpath(importlib.util.find_spec("kernels").origin) == OURS  # shadowed
    path = list(sys.path)
    hf_import.load_installed_kernels()
    assert sys.modules["kernels"].CUDAProperties == "installed"
    assert os.path.realpath(sys.modules["kernels"].__file__) == os.path.realpath(installed / "kernels" / "__init__.py")
    assert sys.path == path


def test_nothing_is_loaded_when_only_the_checkout_has_a_kernels_directory(clean_kernels):
    sys.path[:] = [CHECKOUT]
    hf_import.load_installed_kernels()
    assert "kernels" not in sys.modules
    assert sys.path == [CHECKOUT]


def test_a_kernels_package_found_elsewhere_is_left_alone(clean_kernels, installed):
    sys.path[:] = [str(installed), *_without_checkout(sys.path)]
    hf_import.load_installed_kernels()
    assert "kernels" not in sys.modules


def test_an_imported_kernels_module_is_kept(clean_kernels, installed):
    marker = type(sys)("kernels")
    sys.modules["kernels"] = marker
    sys.path[:] = [CHECKOUT, str(installed), *_without_checkout(sys.path)]
    hf_import.load_installed_kernels()
    assert sys.modules["kernels"] is marker
