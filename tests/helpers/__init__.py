"""Helpers shared by test files (no test file imports another): ``conventional`` and ``replay``
for the Mamba-2 kernel tests, ``gated_delta`` for the gated delta ones, ``launches`` for the
launches a stand-in kernel logged, ``hf_tiny`` and ``hf_tiny_delta`` for tiny transformers
models, and ``ci_examples``. Importable as ``helpers`` from every test folder (pytest puts
``tests/``, the conftest's folder, on the path)."""

import os

from hypothesis import settings


def ci_examples(count: int) -> settings:
    """``@ci_examples(n)``: a test's example budget in the CI profile (slow tests keep CI within
    its time); any other profile (``explore``) keeps its own, so it searches further."""
    return settings(max_examples=count) if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else settings()
