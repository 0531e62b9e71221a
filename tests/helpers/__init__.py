"""Helpers shared by test files (no test file imports another): ``conventional`` and ``replay``
for the Mamba-2 kernel tests, ``hf_tiny`` for tiny transformers models. Importable as
``helpers`` from every test folder (pytest puts ``tests/``, the conftest's folder, on the path)."""
