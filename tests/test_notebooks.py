"""Executes every notebook in ``notebooks/`` and checks its key output.

The notebooks are kept as jupytext percent scripts; each is converted to a
notebook in a temporary folder and run top to bottom in a fresh IPython kernel
running this interpreter (its own kernelspec, so a ``python3`` kernel installed
elsewhere cannot stand in), as a reader would run it. A cell that raises fails
the test (the notebooks assert what their text claims), and so does a notebook
whose key output is missing.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

from ipykernel.kernelspec import write_kernel_spec  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

# Slow and mode-independent: CI runs it once per leg.
pytestmark = pytest.mark.slow

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
KERNEL_NAME = "remat-toolkit-tests"

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
    ],
    "03_third_party_model.py": [
        "attn/",  # attention submodule outputs kept under save-attention
        "mlp/",  # feed-forward submodule outputs kept under save-ffn
        "boundary-only",
    ],
    "04_fitting_a_budget.py": [
        "dominant:",  # the memory breakdown
        "activation budget",  # the plan's summary
        "loaded policy",
    ],
}


def _notebook_sources() -> list[pathlib.Path]:
  return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_every_notebook_has_expectations():
  names = [p.name for p in _notebook_sources()]
  assert names, f"no notebooks found in {NOTEBOOKS}"
  assert sorted(names) == sorted(EXPECTED)


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


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs(name, tmp_path, kernel_dir):
  nb = _execute(NOTEBOOKS / name, tmp_path, kernel_dir)
  text = _outputs_text(nb)
  missing = [s for s in EXPECTED[name] if s not in text]
  assert not missing, f"{name}: outputs lack {missing}"


def test_kernel_is_this_interpreter(tmp_path, kernel_dir):
  nb = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
  _run(nb, tmp_path, kernel_dir, timeout=60)
  printed = nb.cells[0].outputs[0]["text"].strip()
  assert pathlib.Path(printed).resolve() == pathlib.Path(sys.executable).resolve()
