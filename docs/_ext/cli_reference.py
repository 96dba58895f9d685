"""mkdocs hook: the command-line reference, rendered from the parser.

``docs/cli.md`` holds a placeholder line; while the site is built it is
replaced by the ``--help`` of ``remat-toolkit`` and of each of its commands,
as :func:`remat_toolkit._src.cli.main.build_parser` makes them, so the page
cannot fall behind the options. The help is wrapped at a fixed width rather
than the terminal's, so the page is the same wherever it is built.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The checkout's package, not whichever one the environment has installed:
# the page documents the parser of the code being built.
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

PAGE = "cli.md"
PLACEHOLDER = "<!-- cli-reference -->"
WIDTH = 88


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
  """The parser's subcommands by name, in ``--help`` order (aliases left out)."""
  # argparse has no public accessor for its subparsers.
  found: dict[str, argparse.ArgumentParser] = {}
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, subparser in action.choices.items():
        if id(subparser) not in {id(p) for p in found.values()}:
          found[name] = subparser
  return found


def help_text(parser: argparse.ArgumentParser) -> str:
  """``parser.format_help()`` at :data:`WIDTH` columns, without colour."""
  parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)
  parser.color = False  # Python 3.14 colours help when stdout is a terminal.
  return parser.format_help().rstrip()


def render(parser: argparse.ArgumentParser | None = None) -> str:
  """The reference as Markdown: the program's help, then one section per command.

  Args:
    parser: the parser to document; default the ``remat-toolkit`` parser.

  Returns:
    A ``## `remat-toolkit COMMAND` `` section per command, each holding its
    help as a text block.
  """
  if parser is None:
    from remat_toolkit._src.cli.main import build_parser
    parser = build_parser()
  sections = [f"```text\n$ {parser.prog} --help\n{help_text(parser)}\n```"]
  for subparser in commands(parser).values():
    sections.append(f"## `{subparser.prog}`\n\n"
                    f"```text\n$ {subparser.prog} --help\n{help_text(subparser)}\n```")
  return "\n\n".join(sections)


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
  """Replaces the placeholder of ``cli.md`` with the rendered reference."""
  del kwargs
  if page.file.src_uri != PAGE:
    return markdown
  if PLACEHOLDER not in markdown:
    # mkdocs is there only while the site is built; the tests import this
    # file without it.
    from mkdocs.exceptions import PluginError
    raise PluginError(f"{PAGE} has lost its {PLACEHOLDER} line, where the "
                      "command-line reference goes")
  return markdown.replace(PLACEHOLDER, render())
