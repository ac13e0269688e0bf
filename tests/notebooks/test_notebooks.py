"""The research notebooks: each runs top to bottom in a fresh kernel (small settings injected
after its `parameters` cell, as papermill does) and draws its figures; in git they carry no
outputs. A notebook that errors fails the suite."""

import os

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient

NOTEBOOKS = REPO / "notebooks"
# Per notebook: the settings the suite runs it with (a few steps, short inputs); WORK_DIR is added.
# Each distinct training phase compiles a train step: the suite trains in one phase only.
SMALL = {
    "data_tour.ipynb": {"NUM_DOCUMENTS": 6, "BATCHES": 2},
    "msa_selection.ipynb": {"STEPS": 3, "SEQ_LEN": 256, "WARMUP_STEPS": 0, "RECALL_EVERY": 0},
    "scaling_plan.ipynb": {"FSDP_SIZES": [16, 32]},
    "train_and_sample.ipynb": {"STEPS": 2, "MAX_NEW_TOKENS": 8},
}
CELL_TIMEOUT = 400  # seconds: a cell that compiles a train step on a loaded 2-core machine


def test_notebooks_are_the_four_named_ones():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_is_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (name, cell.source[:60])
    tags = [cell.metadata.get("tags", []) for cell in notebook.cells]
    assert sum("parameters" in t for t in tags) == 1, f"{name}: needs one 'parameters' cell"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs_and_draws(name, tmp_path):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    settings = {**SMALL[name], "WORK_DIR": str(tmp_path / "work")}
    cells = notebook.cells
    position = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    injected = "\n".join(f"{key} = {value!r}" for key, value in settings.items())
    cells.insert(position + 1, nbformat.v4.new_code_cell("# injected by the test\n" + injected))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user has
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})  # fmt: skip
    client.execute(env=env)
    figures = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs
               if "image/png" in o.get("data", {})]  # fmt: skip
    assert len(figures) >= 2, f"{name} drew {len(figures)} figures"
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]  # fmt: skip
    assert not errors
