"""The tutorials in docs/tutorials run: each notebook executed top to bottom (nbclient), on the session's tiny
llama; any error, including a failed assert in a cell, fails the test. One kernel serves the three notebooks
(a kernel start, with torch and transformers imported in it, is most of the cost). The vLLM tutorial runs on
eager here (TUTORIAL_BACKEND): a vLLM engine start in the kernel would exceed the suite's time budget."""

import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

TUTORIALS = sorted((Path(__file__).parents[1] / "docs" / "tutorials").glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel(tiny_path, tmp_path_factory):
    """A started python3 kernel whose environment points the tutorials at the tiny llama, on eager, headless."""
    folder = tmp_path_factory.mktemp("tutorials")
    env = {**os.environ, "TUTORIAL_MODEL": str(tiny_path("llama")), "TUTORIAL_BACKEND": "eager",
           "MPLBACKEND": "Agg"}
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(folder))
    yield km, folder
    km.shutdown_kernel(now=True)


def test_there_are_three_tutorials():
    assert [p.stem for p in TUTORIALS] == ["01_first_look", "02_steering_vector", "03_attribution"]


@pytest.mark.parametrize("notebook", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(notebook, kernel):
    km, folder = kernel
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": str(folder)}}).execute()
    outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    if notebook.stem == "01_first_look":  # the lens and the attention plots were drawn
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 2
