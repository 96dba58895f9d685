"""The command-line reference page shows every command and option of the parser.

``docs/cli.md`` is filled at build time by the mkdocs hook
``docs/_ext/cli_reference.py``; these tests run the hook on the page as the
build does, without mkdocs, and check the result against ``build_parser()``.
"""

import argparse
import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from remat_toolkit._src.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "docs" / "_ext" / "cli_reference.py"
PAGE = ROOT / "docs" / "cli.md"


def _load_hook():
  spec = importlib.util.spec_from_file_location("cli_reference", HOOK)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


hook = _load_hook()
COMMANDS = hook.commands(build_parser())


def _built_page() -> str:
  page = SimpleNamespace(file=SimpleNamespace(src_uri=hook.PAGE))
  return hook.on_page_markdown(PAGE.read_text(encoding="utf-8"), page=page,
                               config=None, files=None)


def _sections(markdown: str) -> dict[str, str]:
  """Each ``## `remat-toolkit COMMAND` `` section's text, by command."""
  parts = re.split(r"^## `remat-toolkit (\S+)`$", markdown, flags=re.M)
  return dict(zip(parts[1::2], parts[2::2], strict=True))


def _words(action: argparse.Action) -> list[str]:
  """How the help names an argument: its option strings, or a positional's metavar."""
  if action.option_strings:
    return list(action.option_strings)
  return [action.metavar or action.dest]


def _shown(word: str, text: str) -> bool:
  # Whole words only: --policy must not pass on the strength of --policy-file.
  return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_the_page_has_the_line_the_hook_replaces():
  assert hook.PLACEHOLDER in PAGE.read_text(encoding="utf-8")
  assert hook.PLACEHOLDER not in _built_page()


def test_one_section_per_command_in_help_order():
  assert list(_sections(_built_page())) == list(COMMANDS)
  assert len(COMMANDS) >= 9


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_of_a_command_is_in_its_section(command):
  section = _sections(_built_page())[command]
  subparser = COMMANDS[command]
  assert f"usage: remat-toolkit {command} " in section
  missing = [word for action in subparser._actions for word in _words(action)
             if not _shown(word, section)]
  assert not missing, (
      f"the reference of `remat-toolkit {command}` does not show {missing}: an "
      "option hidden from --help (help=argparse.SUPPRESS) is missing from the page too")


def test_the_program_section_lists_every_command():
  before_first_command = _built_page().split("\n## ", 1)[0]
  assert all(_shown(name, before_first_command) for name in COMMANDS)


def test_the_text_does_not_depend_on_the_terminal(monkeypatch):
  monkeypatch.setenv("COLUMNS", "200")
  wide = hook.render()
  monkeypatch.setenv("COLUMNS", "40")
  assert hook.render() == wide
