"""The README's first example runs as printed."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_five_minute_example_runs(capsys):
  text = README.read_text(encoding="utf-8")
  section = text[text.index("## In five minutes"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(code, "README.md", "exec"), {})
  out = capsys.readouterr().out
  assert "policy save-ffn" in out and "ffn.up" in out
  assert "boundary-only" in out and "save-everything" in out


def test_models_that_remat_themselves_example_runs(capsys):
  text = README.read_text(encoding="utf-8")
  section = text[text.index("### Models that remat themselves"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(code, "README.md", "exec"), {})
  out = capsys.readouterr().out
  assert "boundary-only" in out and "save-ffn" in out and "save-everything" in out
  assert "no remat region" not in out and "4 remat regions" in out
