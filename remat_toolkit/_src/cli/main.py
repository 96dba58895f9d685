"""The ``remat-toolkit`` command line.

Each command is a pair of small functions: ``_add_<cmd>_parser(subparsers)``
declares its arguments (starting from :func:`cli_shared.command_parser`, which
adds the options every command shares) and binds ``_cmd_<cmd>(args) -> int``,
which computes its result and ends with ``return emit(result, args)``: one
helper prints every result as text, ``--json`` or ``--csv`` and returns the
exit status. A new command is one more pair, appended to
:data:`_PARSER_BUILDERS`::

  def _add_compare_parser(subparsers):
    parser = command_parser(subparsers, "compare", summary="...")
    add_policy_list_arguments(parser, default="the whole catalogue")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=_cmd_compare)

  def _cmd_compare(args) -> int:
    ...
    return emit(comparison, args, heading=model_line(args))

One word, one meaning: ``POLICY`` (positional, or ``--policy``) is a policy to
run, a catalogue name or a ``.toml`` path; ``--policy-file PATH`` loads the
policies of a file or folder into the catalogue first.

The commands live in :mod:`cli_catalog` (``list``, ``show``) and
:mod:`cli_commands` (those that measure a model); what they share in
:mod:`cli_shared` and :mod:`cli_models`.

A user mistake (an unknown policy name, a malformed policy file) prints one
line to stderr and exits with status 2, without a traceback.

Example:
  >>> import contextlib, io
  >>> from remat_toolkit._src.cli import main as cli
  >>> with contextlib.redirect_stdout(io.StringIO()) as out:
  ...   status = cli.main(["show", "minimal"])
  >>> status, out.getvalue().splitlines()[0]
  (0, 'save-projections  (aliases: minimal)')
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src.cli import catalog as cli_catalog
from remat_toolkit._src.cli import commands as cli_commands
from remat_toolkit._src.cli import shared as cli_shared
from remat_toolkit._src.cli.shared import PROG
from remat_toolkit._src.policies import findings

__all__ = ["main", "build_parser"]

#: Exceptions that mean "the user asked for something wrong", not a bug.
_USER_ERRORS = (ValueError, FileNotFoundError)

#: One entry per command, in ``--help`` order; each adds its subparser and
#: binds ``run``.
_PARSER_BUILDERS: list[Callable[[Any], None]] = [
    cli_catalog.add_list_parser,
    cli_catalog.add_show_parser,
    *cli_commands.PARSER_BUILDERS,
]


def build_parser() -> argparse.ArgumentParser:
  """The argument parser with every registered command."""
  parser = argparse.ArgumentParser(
      prog=PROG,
      description="Choose, apply and inspect remat (activation "
                  "checkpointing) policies for JAX and Flax.")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
  subparsers.required = True
  for add_parser in _PARSER_BUILDERS:
    add_parser(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command and returns its exit status.

  Args:
    argv: the arguments after the program name; default ``sys.argv[1:]``.

  Returns:
    0 on success, 2 for a usage or user error (message on stderr), 1 when
    the reader of stdout went away (``remat-toolkit list | head``) or, for
    ``verify``, when a problem is found.
  """
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # argparse printed the usage error or --help.
    return e.code if isinstance(e.code, int) else 2
  try:
    cli_shared.load_policy_files(args)
    # Every result prints its warnings with it (JSON included); raised as
    # Python warnings too, they would show twice.
    with findings.quiet():
      return args.run(args)
  except _USER_ERRORS as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:  # `remat-toolkit list | head`: the reader left.
    # Point stdout at devnull so the interpreter's final flush cannot fail.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
