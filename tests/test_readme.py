"""The README runs as printed: its Python blocks here, its commands in CI."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from shared_helpers import markdown_code_blocks
from shared_helpers import run_markdown_examples

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"


def _section(text, name):
  """The text between the README's ``--8<-- [start:name]``/``[end:name]`` markers."""
  match = re.search(rf"\[start:{name}\] -->\n(.*?)<!-- --8<-- \[end:{name}\]", text, re.S)
  assert match, f"README.md has no section {name!r} (the docs site includes it)"
  return match.group(1)


@pytest.mark.slow
def test_every_python_block_runs_and_the_five_minute_example_prints_its_point():
  text = README.read_text(encoding="utf-8")
  printed = run_markdown_examples(README)
  assert printed, "README.md has no Python block"
  section = _section(text, "five-minutes")
  five_minutes = next(printed[b.line] for b in markdown_code_blocks(README)
                      if b.lang == "python" and b.code in section)
  # rt.analyze keeps each block's ffn.up: float32 [8, 128, 1024], 4 MiB, in all four regions.
  assert "policy save-ffn" in five_minutes
  kept = [line for line in five_minutes.splitlines()
          if "ffn.up" in line and "4.0 MiB" in line]
  assert [re.search(r"layers_\d", line).group() for line in kept] == [
      f"layers_{i}" for i in range(4)], five_minutes
  # rt.compare: one row per policy asked for, and nothing warned about regions.
  for policy in ("boundary-only", "save-ffn", "save-everything"):
    assert re.search(rf"^{policy}\s", five_minutes, re.M), policy
  assert "4 remat regions" in five_minutes and "no remat region" not in five_minutes


def test_the_commands_are_what_ci_runs():
  """Each command of the README's bash blocks is a line .ci/run executes."""
  ci_lines = [line.strip() for line in CI.read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.strip().startswith("#")]
  commands = [line.strip()
              for block in markdown_code_blocks(README) if block.lang == "bash"
              for line in block.code.splitlines()
              if line.strip() and not line.strip().startswith("#")]
  assert commands, "README.md has no bash block"
  for command in commands:
    assert command in ci_lines, f".ci/run does not run the README's command {command!r}"


def test_relative_links_point_at_files():
  text = README.read_text(encoding="utf-8")
  targets = re.findall(r"\]\((?!https?://|#)([^)#]+)(?:#[^)]*)?\)", text)
  assert targets, "README.md links to nothing in the repository"
  missing = [t for t in targets if not (ROOT / t).exists()]
  assert not missing, f"README.md links to files that do not exist: {missing}"


def _compare_block(text):
  """The README's ``$ remat-toolkit compare`` block and the JAX it names."""
  section = _section(text, "compare")
  jax_version = re.search(r"\bjax (\S+),", section).group(1)
  output = re.search(r"\$ remat-toolkit compare\n(.*?)\n```", section, re.S).group(1)
  return jax_version, output


def _table_rows(output):
  """policy -> (activations, offloaded, recompute, residuals)."""
  rows = {}
  for line in output.splitlines():
    cells = re.split(r"\s{2,}", line.strip())
    if len(cells) >= 7 and re.fullmatch(r"[a-z0-9-]+", cells[0]):
      rows[cells[0]] = (cells[1], cells[3], cells[4], cells[5])
  return rows


@pytest.mark.slow
def test_the_compare_table_is_what_the_command_prints():
  """The README's table is ``remat-toolkit compare``'s output, verbatim, on
  the JAX it names; on another release every policy's figures but
  ``save-everything``'s (and the percentages relative to it) are the same."""
  jax_version, block = _compare_block(README.read_text(encoding="utf-8"))
  env = {k: v for k, v in os.environ.items() if k != "JAX_REMAT3"}
  printed = subprocess.run([sys.executable, "-m", "remat_toolkit", "compare"],
                           capture_output=True, text=True, check=True,
                           env=env, cwd=ROOT).stdout.rstrip()
  if jax.__version__ == jax_version:
    assert printed == block.rstrip()
  ours, theirs = _table_rows(printed), _table_rows(block)
  assert len(ours) >= 20 and set(ours) == set(theirs)
  for policy in set(ours) - {"save-everything"}:
    assert ours[policy] == theirs[policy], policy
