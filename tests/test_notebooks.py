"""Every notebook in notebooks/ runs top to bottom in a fresh kernel without an error.

Notebooks are stored without outputs; this executes them in memory and writes nothing back.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: A kernel that takes longer than this on one cell has hung, not merely run slowly: the cells
#: do one optimisation or a few exhaustive evaluations each (seconds on a laptop CPU).
CELL_TIMEOUT_S = 600


def test_notebooks_exist_and_are_stored_without_outputs():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_tradeoffs.ipynb",
                                           "03_budget_shopping.ipynb", "04_validation.ipynb"]
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert cell.get("outputs") == [], f"{path.name}: a cell has stored outputs"
                assert cell.get("execution_count") is None, f"{path.name}: execution count"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat "
                                   "(pip install -e '.[dev]')")
    nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient "
                                   "(pip install -e '.[dev]')")
    pytest.importorskip("ipykernel", reason="notebook tests need ipykernel "
                        "(pip install -e '.[dev]')")
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"     # the kernel inherits it: keep JAX off any GPU
    try:
        client = nbclient.NotebookClient(
            nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}})
        # The kernel must be this interpreter (the one with capopt installed), whatever
        # other "python3" kernels the machine has registered.
        client.kernel_manager_class = _this_python_kernel_manager()
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
    finally:
        if env_before is None:
            os.environ.pop("JAX_PLATFORMS", None)
        else:
            os.environ["JAX_PLATFORMS"] = env_before
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"


def _this_python_kernel_manager():
    from jupyter_client.manager import KernelManager

    class ThisPython(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            if cmd and os.path.basename(cmd[0]).startswith("python"):
                cmd[0] = sys.executable
            return cmd

    return ThisPython
