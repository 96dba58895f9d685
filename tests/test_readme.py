"""The README's Python examples run as printed."""

import re
from pathlib import Path

from remat_toolkit._src import compat as compat

README = Path(__file__).resolve().parent.parent / "README.md"


def _run_first_block_after(heading, capsys):
  """Runs the first Python block after ``heading``; returns what it printed."""
  text = README.read_text(encoding="utf-8")
  section = text[text.index(heading):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(code, "README.md", "exec"), {})
  return capsys.readouterr().out


def test_five_minute_example_runs(capsys):
  out = _run_first_block_after("## In five minutes", capsys)
  assert "policy save-ffn" in out and "ffn.up" in out
  assert "boundary-only" in out and "save-everything" in out


def test_models_that_remat_themselves_example_runs(capsys):
  out = _run_first_block_after("### Models that remat themselves", capsys)
  assert "boundary-only" in out and "save-ffn" in out and "save-everything" in out
  assert "no remat region" not in out and "4 remat regions" in out


def test_kernel_example_runs(capsys):
  out = _run_first_block_after("### Kernels (`custom_vjp`)", capsys)
  assert "attn.q" in out
  # The flash kernel's residuals are named inside a custom_vjp: the default
  # remat implementation honours the name, jax_remat3 (by default) does not.
  assert ("attn.context" in out) is not compat.remat3_enabled()
