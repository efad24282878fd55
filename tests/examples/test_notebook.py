"""The example notebook runs top to bottom (its cells assert their own results)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "worker_groups.ipynb"


@pytest.mark.slow
def test_worker_group_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "[0, 10, 20, 30, 40, 50, 60, 70] [0, 0, 0, 0, 1, 1, 1, 1]" in outputs
    assert "max |actor - rollout| log-prob gap" in outputs
    assert "refused: config key rollout.temprature" in outputs  # a typed section names a misspelt key
