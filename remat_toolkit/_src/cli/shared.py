"""What every ``remat-toolkit`` command shares: options, policies, output.

:func:`command_parser` adds the options every command takes
(``--policy-file``), :func:`policy_list` reads the ``POLICY`` arguments of a
many-policy command (a name, ``all`` or a ``.toml`` path, each resolved as
every ``policy=`` argument of the library is), and :func:`emit` prints a
command's result as text, JSON or CSV; every command ends with it.

Example:
  >>> import argparse
  >>> from remat_toolkit._src.cli import shared as cli_shared
  >>> args = argparse.Namespace(policy=["minimal"], more_policies=[])
  >>> [p.name for p in cli_shared.policy_list(args)]
  ['save-projections']
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import Policy

__all__ = ["PROG", "POLICY_HELP", "command_parser", "load_policy_files",
           "add_policy_argument", "add_policy_list_arguments", "chosen_policy",
           "policy_list",
           "policy_source", "emit", "warn"]

PROG = "remat-toolkit"

#: What ``POLICY`` means wherever a command runs policies.
POLICY_HELP = (f"a policy name or alias (see `{PROG} list`), or the path of a "
               ".toml policy file")

def command_parser(subparsers: Any, name: str, *, summary: str
                   ) -> argparse.ArgumentParser:
  """A subcommand parser with the options every command shares."""
  parser = subparsers.add_parser(name, help=summary, description=summary)
  parser.add_argument(
      "--policy-file", dest="policy_files", action="append", default=[],
      metavar="PATH",
      help="load the policies in this TOML file or folder first, replacing "
           "built-ins of the same name (repeatable; the "
           f"{catalog.POLICY_PATH_ENV} variable works too)")
  return parser


def load_policy_files(args: argparse.Namespace) -> None:
  # Same precedence as REMAT_TOOLKIT_POLICY_PATH: the user's files win.
  for path in args.policy_files:
    catalog.load_policies(path, override=True)


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
  """``--policy POLICY``: the one policy a command runs (default: ambient)."""
  parser.add_argument(
      "--policy", default=None, metavar="POLICY",
      help=f"{POLICY_HELP} (default: the ambient default, boundary-only)")


def add_policy_list_arguments(parser: argparse.ArgumentParser, *,
                              default: str) -> None:
  """``POLICY ...`` and ``--policy POLICY`` (repeatable): the policies to run."""
  parser.add_argument(
      "policy", nargs="*", metavar="POLICY",
      help=f"policies to run: {POLICY_HELP}; 'all' for the whole catalogue "
           f"(default: {default})")
  # The same word as in analyze/verify, so `--policy X` never reads as an
  # abbreviation of --policy-file.
  parser.add_argument(
      "--policy", dest="more_policies", action="append", default=[],
      metavar="POLICY", help="one more policy to run (repeatable)")


# ---------------------------------------------------------------- policies

def chosen_policy(args: argparse.Namespace) -> Policy | None:
  """The one policy of ``--policy``, resolved before the model is built so
  that a misspelt name fails at once; None for the ambient one."""
  return None if args.policy is None else resolve.resolve_policy(args.policy)


def policy_list(args: argparse.Namespace) -> list[Policy] | None:
  """The policies a many-policy command runs; None for the entry's default."""
  names = [*args.policy, *args.more_policies]
  if not names:
    return None
  if "all" in names:
    names = catalog.list_policies()
  return resolve.resolve_policies(names)


def policy_source(name: str) -> str:
  """Where the policy ``name`` came from: its file, or the catalogue's word."""
  if resolve.is_policy_file(name):
    return str(Path(name))
  return catalog.policy_source(name)


# ---------------------------------------------------------------- output

def warn(message: str) -> None:
  print(f"{PROG}: warning: {message}", file=sys.stderr)


def _carries_warnings(document: str) -> bool:
  data = json.loads(document)
  return isinstance(data, dict) and "warnings" in data


def emit(result: Any, args: argparse.Namespace, *, heading: str | None = None,
         text: str | None = None, status: int = 0) -> int:
  """Prints ``result`` as the options ask and returns the exit status.

  ``--json`` prints ``result.to_json(indent=2)``, ``--csv`` ``result.to_csv()``
  and otherwise ``text`` (default: ``str(result)``), under ``heading`` when
  given. Warnings a JSON or CSV document has no place for go to stderr, one
  line each, so none is lost.

  Args:
    result: what the command computed; has ``to_json`` (and ``to_csv`` if the
      command offers ``--csv``).
    args: the parsed options.
    heading: a line printed above the text (what was measured).
    text: the text to print instead of ``str(result)``.
    status: the exit status to return.

  Returns:
    ``status``.
  """
  document = None
  if getattr(args, "json", False):
    document = result.to_json(indent=2)
    print(document)
  elif getattr(args, "csv", False):
    print(result.to_csv(), end="")
  else:
    if heading is not None:
      print(heading)
    print(str(result) if text is None else text)
    return status
  if document is None or not _carries_warnings(document):
    for warning in getattr(result, "warnings", ()):
      warn(warning)
  return status
