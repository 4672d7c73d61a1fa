"""The notebooks run, top to bottom, in a real kernel: they never rot."""

from __future__ import annotations

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("name", ["runtime_tour", "inspect_ddp"])
def test_notebook_executes(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=100, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    if name == "runtime_tour":
        assert "rank 2: sum=6.0 avg=1.0" in text and "received 4.0 from rank 3" in text
    else:
        assert "Timeline(measured" in text and "buckets, step" in text
        assert "1024 ranks fsdp" in text and "predicted peak" in text  # the memory view
        assert any("image/png" in o.get("data", {}) for o in outputs)  # the timelines
        assert any("text/html" in o.get("data", {}) for o in outputs)  # the plan
