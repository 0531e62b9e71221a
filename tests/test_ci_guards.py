"""Guards that keep CI honest: per-test hypothesis budgets bind the CI profile only, and a CI run
without transformers fails instead of skipping its tests."""

import os
import pathlib
import re
import subprocess
import sys

from hypothesis import settings

from helpers import ci_examples

TESTS = pathlib.Path(__file__).parent


def test_explore_profile_keeps_its_budget_where_ci_sets_one(monkeypatch):
    loaded = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    assert ci_examples(3).max_examples == 3
    try:
        settings.load_profile("explore")
        monkeypatch.setenv("HYPOTHESIS_PROFILE", "explore")
        assert ci_examples(3).max_examples == settings.get_profile("explore").max_examples == 500
    finally:
        settings.load_profile(loaded)


def test_no_test_fixes_its_example_count_for_every_profile():
    """A plain ``@settings(max_examples=n)`` would override the explore profile's budget."""
    fixed = [f"{p.relative_to(TESTS)}:{i + 1}" for p in TESTS.rglob("test_*.py")
             for i, line in enumerate(p.read_text().splitlines()) if re.match(r"\s*@settings\(.*max_examples", line)]
    assert not fixed, f"use helpers.ci_examples(n) instead: {fixed}"


def test_ci_fails_without_transformers(tmp_path):
    (tmp_path / "transformers.py").write_text("raise ImportError('blocked for this test')\n")
    env = {**os.environ, "CI": "true", "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                             str(TESTS / "test_package.py")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "CI=true: transformers must import" in result.stdout + result.stderr
