"""The notebooks are stored without outputs, run top to bottom, and show their plots."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
FILES = sorted(NOTEBOOKS.glob("*.ipynb"))
# notebooks that draw a figure
PLOTS = {"01-shuffle.ipynb", "02-rechunk.ipynb", "04-replicated.ipynb"}


def test_there_are_notebooks():
    names = {f.name for f in FILES}
    assert {"01-shuffle.ipynb", "02-rechunk.ipynb", "03-write-a-service.ipynb",
            "04-replicated.ipynb"} <= names


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nbformat = pytest.importorskip("nbformat")
    with warnings.catch_warnings():
        # a cell without an id warns now and will be an error in later nbformat versions
        warnings.simplefilter("error")
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    for cell in nb.cells:
        assert cell.get("id"), cell.source[:60]
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # The kernel (and the workers it starts) import this checkout's dask_services.
    root = str(NOTEBOOKS.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors
    if path.name in PLOTS:
        assert any("image/png" in o.get("data", {}) for o in outputs), "no plot shown"
