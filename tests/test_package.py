"""Packaging: the public namespace imports, and every sub-package ships in the wheel."""

import pathlib
import tomllib

import qstate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_namespace_imports():
    import qstate.analysis
    import qstate.kernels

    assert qstate.__version__
    assert {"quantize", "dequantize", "StateFormat", "reference", "profiles"} <= set(qstate.__all__)


def test_every_subpackage_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    # a sub-package of a mapped package that is itself mapped is counted once
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
