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
