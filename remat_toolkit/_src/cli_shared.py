"""What every ``remat-toolkit`` command shares: options, policies, output.

:func:`command_parser` adds the options every command takes
(``--policy-file``), :func:`resolve_policy_arg` turns a ``POLICY`` argument (a
name or a ``.toml`` path) into a :class:`Policy`, and :func:`emit` prints a
command's result as text, JSON or CSV; every command ends with it.

Example:
  >>> from remat_toolkit._src import cli_shared
  >>> cli_shared.resolve_policy_arg("minimal").name
  'save-projections'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from remat_toolkit._src import catalog
from remat_toolkit._src import resolve
from remat_toolkit._src.policy import Policy

__all__ = ["PROG", "POLICY_HELP", "command_parser", "deprecation_notes",
           "load_policy_files", "add_policy_argument",
           "add_policy_list_arguments", "resolve_policy_arg",
           "resolve_policy_list", "policy_source", "emit", "warn"]

PROG = "remat-toolkit"

#: What ``POLICY`` means wherever a command runs policies.
POLICY_HELP = (f"a policy name or alias (see `{PROG} list`), or the path of a "
               ".toml policy file")

_DEPRECATED_FILE_OPTION = "--policies"


# ---------------------------------------------------------------- options

class _PolicyFileAction(argparse.Action):
  """Appends a path; remembers when it came by the deprecated spelling."""

  def __call__(self, parser: argparse.ArgumentParser,
               namespace: argparse.Namespace, values: Any,
               option_string: str | None = None) -> None:
    # A fresh list: the default one is shared by every parse.
    setattr(namespace, self.dest, [*getattr(namespace, self.dest), values])
    if option_string == _DEPRECATED_FILE_OPTION:
      namespace.deprecated_policies_option = True


def command_parser(subparsers: Any, name: str, *, summary: str
                   ) -> argparse.ArgumentParser:
  """A subcommand parser with the options every command shares."""
  parser = subparsers.add_parser(name, help=summary, description=summary)
  parser.set_defaults(policy_files=[], deprecated_policies_option=False)
  parser.add_argument(
      "--policy-file", dest="policy_files", action=_PolicyFileAction,
      metavar="PATH",
      help="load the policies in this TOML file or folder first, replacing "
           "built-ins of the same name (repeatable; the "
           f"{catalog.POLICY_PATH_ENV} variable works too)")
  parser.add_argument(
      _DEPRECATED_FILE_OPTION, dest="policy_files", action=_PolicyFileAction,
      metavar="PATH",
      help="deprecated spelling of --policy-file (it names files to load, "
           "not policies to run)")
  return parser


def deprecation_notes(args: argparse.Namespace) -> list[str]:
  """One line per deprecated option ``args`` were given with."""
  if not getattr(args, "deprecated_policies_option", False):
    return []
  return [f"{_DEPRECATED_FILE_OPTION} is deprecated and will be removed; "
          "write --policy-file PATH (policies to run are POLICY arguments)"]


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

def _is_policy_file(name: str) -> bool:
  return name.endswith(".toml") or "/" in name or "\\" in name


def resolve_policy_arg(name: str | None) -> Policy | None:
  """The policy a ``POLICY`` argument names: a catalogue name or a .toml file.

  None stays None: the entry point then uses the ambient policy.

  Raises:
    FileNotFoundError: for a path that is not a file.
    ValueError: for an unknown name or a malformed file.
  """
  if name is None:
    return None
  if not _is_policy_file(name):
    return resolve.resolve_policy(name)
  path = Path(name)
  if not path.is_file():
    raise FileNotFoundError(
        f"Policy file {name!r} does not exist; give a policy name (see "
        f"`{PROG} list`) or the path of a .toml policy file.")
  return catalog.parse_policy_file(path)


def resolve_policy_list(args: argparse.Namespace) -> list[Policy] | None:
  """The policies a many-policy command runs; None for the entry's default."""
  names = [*args.policy, *args.more_policies]
  if not names:
    return None
  if "all" in names:
    names = catalog.list_policies()
  return [resolve_policy_arg(n) for n in names]


def policy_source(name: str) -> str:
  """Where the policy ``name`` came from: its file, or the catalogue's word."""
  if _is_policy_file(name):
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
