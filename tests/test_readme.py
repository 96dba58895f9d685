"""The README runs as printed: its Python blocks here, its commands in CI."""

import re
from pathlib import Path

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


def test_every_python_block_runs_and_the_five_minute_example_prints_its_point(capsys):
  text = README.read_text(encoding="utf-8")
  printed = run_markdown_examples(README, capsys)
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
