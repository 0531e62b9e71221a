"""The notebooks run top to bottom with a small step count (injected after their parameters cell)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks")
CI_STEPS = 64
CI_NEW_TOKENS = 8


@pytest.mark.parametrize("name", ["drift_analysis.ipynb", "choose_precision.ipynb", "delta_rule_drift.ipynb"])
def test_notebook_runs(name, tmp_path):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "commit without outputs"
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(
        f"STEPS = {CI_STEPS}\nNEW_TOKENS = {CI_NEW_TOKENS}\nimport torch\ntorch.set_num_threads(1)"))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
