"""Keeps every notebook in ``notebooks/`` in sync with its script, and runs it.

Each notebook is a jupytext pair: a percent script (``0N_*.py``, reviewed as a
text diff) and the ``.ipynb`` Jupyter shows without the jupytext plugin,
committed without outputs. The pair must hold the same cells, as jupytext
makes them of the script.

Each script is also converted to a notebook in a temporary folder and run top
to bottom in a fresh IPython kernel running this interpreter (its own
kernelspec, so a ``python3`` kernel installed elsewhere cannot stand in), as a
reader would run it. A cell that raises fails the test (the notebooks assert
what their text claims), and so does a notebook whose key output is missing.
"""

from __future__ import annotations

import pathlib
import sys
import tomllib

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

from ipykernel.kernelspec import write_kernel_spec  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

# Running a notebook is slow and mode-independent: CI runs it once per leg.
slow = pytest.mark.slow

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
KERNEL_NAME = "remat-toolkit-tests"
SYNC_COMMAND = "jupytext --sync notebooks/0*.py"

# What each notebook must print or display: a fragment of the output of the
# cells that carry its point.
EXPECTED = {
    "01_quickstart.py": [
        "policy save-ffn:",  # the report's summary
        "JAX lists",  # the cross-check against print_saved_residuals
        "largest parameter difference after the step",
    ],
    "02_choosing_a_policy.py": [
        "% of save-everything",  # the comparison table
        "image/png",  # the Pareto chart
        "Pareto-optimal:",
        # the ranking flip: naive keeps more in attention, flash in the FFN
        "naive  keep all of attention  456.0 MiB",
        "flash  keep all of attention   72.4 MiB",
        "recompute the FFN to free the most",
        # the findings, each printed once where the text explains it
        "keeps the outputs of 24 matmuls between two activations",
        "again in the backward pass",
    ],
    "03_third_party_model.py": [
        "attn/",  # attention submodule outputs kept under save-attention
        "mlp/",  # feed-forward submodule outputs kept under save-ffn
        "boundary-only",
    ],
    "04_fitting_a_budget.py": [
        "dominant:",  # the memory breakdown
        "activation budget",  # the plan's summary
        "per region (each region",  # the per-region plan's table
        "per-region plans between",  # the dense frontier
        "loaded policy",
    ],
}


def _notebook_sources() -> list[pathlib.Path]:
  return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_every_notebook_has_expectations():
  names = [p.name for p in _notebook_sources()]
  assert names, f"no notebooks found in {NOTEBOOKS}"
  assert sorted(names) == sorted(EXPECTED)


def _cells(nb) -> list[tuple[str, str, dict]]:
  """What a reader sees of each cell; ids are jupytext's, random per new cell."""
  return [(c.cell_type, c.source, dict(c.metadata)) for c in nb.cells]


def _leftover_outputs(nb) -> list[int]:
  """Indices of the code cells that carry outputs or an execution count."""
  return [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
          and (c.get("outputs") or c.get("execution_count") is not None)]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_is_in_sync_with_its_script(name):
  script = NOTEBOOKS / name
  ipynb = script.with_suffix(".ipynb")
  assert ipynb.exists(), (
      f"{ipynb.name} is missing: run `{SYNC_COMMAND}` and commit it")
  committed = nbformat.read(ipynb, as_version=4)
  nbformat.validate(committed)
  assert _cells(committed) == _cells(jupytext.read(script)), (
      f"{ipynb.name} and {name} differ: after editing either one, run "
      f"`{SYNC_COMMAND}` (it updates the older of the pair)")
  assert committed.metadata.get("kernelspec", {}).get("name") == "python3"
  assert not _leftover_outputs(committed), (
      f"{ipynb.name} is committed with outputs in cells "
      f"{_leftover_outputs(committed)}: clear them with `jupytext --to ipynb "
      f"notebooks/{name}` (or Jupyter's \"Clear All Outputs\"), then commit")


def test_every_notebook_is_paired_by_the_jupytext_config():
  config = tomllib.loads((NOTEBOOKS / "jupytext.toml").read_text())
  assert config["formats"] == "ipynb,py:percent"
  stray = sorted({p.stem for p in NOTEBOOKS.glob("*.ipynb")}
                 - {p.stem for p in _notebook_sources()})
  assert not stray, (f"notebooks without a script: {stray}; create it with "
                     f"`jupytext --to py:percent notebooks/NAME.ipynb`")


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory) -> pathlib.Path:
  """A kernelspec that runs this interpreter, whatever kernels are installed."""
  root = tmp_path_factory.mktemp("kernels")
  write_kernel_spec(root / KERNEL_NAME)
  return root


def _outputs_text(nb) -> str:
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      parts.append(out.get("text", ""))
      for mime, value in out.get("data", {}).items():
        parts.append(mime)
        if mime.startswith("text/"):
          parts.append(value if isinstance(value, str) else "".join(value))
  return "\n".join(parts)


def _run(nb, workdir: pathlib.Path, kernel_dir: pathlib.Path, timeout: int):
  """Executes ``nb`` in place in a fresh kernel started in ``workdir``."""
  km = KernelManager(
      kernel_name=KERNEL_NAME,
      kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
  client = nbclient.NotebookClient(
      nb, km=km, timeout=timeout,
      resources={"metadata": {"path": str(workdir)}})
  try:
    client.execute()
  finally:
    if km.has_kernel:
      km.shutdown_kernel(now=True)
  return nb


def _execute(source: pathlib.Path, workdir: pathlib.Path,
             kernel_dir: pathlib.Path):
  """Converts a percent script to a notebook file in ``workdir`` and runs it."""
  ipynb = workdir / source.with_suffix(".ipynb").name
  nbformat.write(jupytext.read(source), ipynb)
  nb = nbformat.read(ipynb, as_version=4)
  return _run(nb, workdir, kernel_dir, timeout=300)


@slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(name, tmp_path, kernel_dir):
  nb = _execute(NOTEBOOKS / name, tmp_path, kernel_dir)
  text = _outputs_text(nb)
  missing = [s for s in EXPECTED[name] if s not in text]
  assert not missing, f"{name}: outputs lack {missing}"
  # The docs site shows stderr in red: a warning there (a finding raised
  # again, a third-party package's, with a machine's path) is noise.
  stderr = [out.get("text", "") for cell in nb.cells
            for out in cell.get("outputs", []) if out.get("name") == "stderr"]
  assert not stderr, f"{name} writes to stderr: {stderr}"


@slow
def test_kernel_is_this_interpreter(tmp_path, kernel_dir):
  nb = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
  _run(nb, tmp_path, kernel_dir, timeout=60)
  printed = nb.cells[0].outputs[0]["text"].strip()
  assert pathlib.Path(printed).resolve() == pathlib.Path(sys.executable).resolve()
