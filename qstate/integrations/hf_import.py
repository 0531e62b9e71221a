"""Import transformers where a qstate checkout would shadow Hugging Face's ``kernels`` package.

transformers >= 5.25 depends on the ``kernels`` distribution and imports it when it loads a
model class. A qstate checkout keeps its Triton sources in a top-level ``kernels/`` directory
(installed as ``qstate.kernels``). Wherever the checkout's root is on ``sys.path`` (``python -m``
or pytest started there), ``import kernels`` finds that directory instead, and loading a model
fails with "cannot import name 'CUDAProperties' from 'kernels'". :func:`import_transformers`
loads the installed ``kernels`` first in that case; qstate itself never imports a top-level
``kernels``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def import_transformers():
    """The ``transformers`` module (``ImportError`` without it). Where a qstate checkout's
    ``kernels/`` directory would shadow the installed ``kernels`` package, that package is
    loaded first, so that transformers finds it in ``sys.modules``."""
    load_installed_kernels()
    return importlib.import_module("transformers")


def load_installed_kernels() -> None:
    """Put the installed ``kernels`` package in ``sys.modules`` if ``import kernels`` would
    resolve to the directory ``qstate.kernels`` comes from. Nothing happens when ``kernels`` is
    already imported, when it resolves elsewhere, or when no ``kernels`` package is installed
    (transformers then does not look for one). ``sys.path`` is left as it was."""
    if "kernels" in sys.modules:
        return
    found = importlib.util.find_spec("kernels")
    ours = importlib.util.find_spec("qstate.kernels")
    if found is None or ours is None or found.origin is None or ours.origin is None:
        return
    if os.path.realpath(found.origin) != os.path.realpath(ours.origin):
        return
    checkout = os.path.dirname(os.path.dirname(os.path.realpath(ours.origin)))
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if os.path.realpath(entry or os.curdir) != checkout]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # no kernels package installed besides the checkout's directory
    finally:
        sys.path[:] = saved
