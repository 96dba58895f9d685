"""``remat-toolkit list`` and ``remat-toolkit show``: the policy catalogue.

These render :class:`Policy` objects, not results, so their text lives here
rather than in :mod:`remat_toolkit._src.display`: :class:`PolicyListing` and
:class:`PolicyDescription` are what the two commands hand to
:func:`~remat_toolkit._src.cli.shared.emit`.

Example:
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.cli import catalog as cli_catalog
  >>> shown = cli_catalog.PolicyDescription(rt.get_policy("minimal"), "a.toml")
  >>> str(shown).splitlines()[0]
  'save-projections  (aliases: minimal)'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import textwrap
from collections.abc import Sequence
from typing import Any

import jax

from remat_toolkit._src.cli.shared import POLICY_HELP
from remat_toolkit._src.cli.shared import PROG
from remat_toolkit._src.cli.shared import command_parser
from remat_toolkit._src.cli.shared import emit
from remat_toolkit._src.cli.shared import policy_source
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import format as fmt
from remat_toolkit._src.core.globs import is_glob
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies import tags
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.policy import unrunnable_reason

__all__ = ["PolicyListing", "PolicyDescription", "add_list_parser",
           "add_show_parser"]

_TEXT_WIDTH = 88


# ---------------------------------------------------------------- remat3

def remat3_refusal(policy: Policy) -> str | None:
  """Why ``policy`` cannot run while ``jax_remat3`` is on, or None if it can.

  :func:`unrunnable_reason` asked with the flag on, whatever it is now: the
  catalogue says how a policy behaves both ways.
  """
  if not compat.has_remat3_flag():
    return None  # no remat3 to run under, nothing to refuse
  with compat.remat3(True):
    return unrunnable_reason(policy)


def _policy_record(policy: Policy, source: str) -> dict[str, Any]:
  """Everything ``list --json`` / ``show --json`` print about one policy."""
  return {
      "name": policy.name,
      "description": policy.description,
      "aliases": list(policy.aliases),
      "save": list(policy.save),
      "offload": list(policy.offload),
      "exclude": list(policy.exclude),
      "matmuls": policy.matmuls,
      "offload_src": policy.offload_src,
      "offload_dst": policy.offload_dst,
      "save_everything": policy.save_everything,
      "keeps": _keeps_cell(policy),
      "offloads": _offloads_cell(policy),
      "lowers_to": policy.describe_lowering(),
      "runs_under_remat3": remat3_refusal(policy) is None,
      "source": source,
  }


# ---------------------------------------------------------------- table

def _names_cell(names: Sequence[str]) -> str:
  """Tag names in full; MaxText equivalents and glob patterns as counts."""
  patterns = [n for n in names if is_glob(n)]
  maxtext = [n for n in names if n in tags.MAXTEXT_NAMES]
  shown = [n for n in names if n not in patterns and n not in maxtext]
  if not shown:  # a policy written only in MaxText names: show them.
    shown, maxtext = maxtext, []
  extras = []
  if maxtext:
    extras.append(f"{len(maxtext)} MaxText name{'s' * (len(maxtext) > 1)}")
  if patterns:
    extras.append(f"{len(patterns)} pattern{'s' * (len(patterns) > 1)}")
  text = ", ".join(shown)
  return f"{text} (+{', '.join(extras)})" if extras else text


def _keeps_cell(policy: Policy) -> str:
  if policy.save_everything:
    return "everything (no recomputation)"
  if policy.matmuls == "all":
    return "every matmul output"
  if policy.matmuls == "no-batch":
    return "matmul outputs without batch dims"
  return _names_cell(policy.save) if policy.save else "region inputs only"


def _offloads_cell(policy: Policy) -> str:
  if policy.matmuls == "offload-no-batch":
    return "matmul outputs without batch dims"
  return _names_cell(policy.offload) if policy.offload else "-"


def _wrapped_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                   widths: Sequence[int]) -> str:
  """A fixed-width table; cells wrap in their column; rows blank-separated."""
  lines: list[list[str]] = []
  for i, row in enumerate(rows):
    wrapped = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""]
               for cell, w in zip(row, widths, strict=True)]
    if i:
      lines.append([""] * len(widths))
    lines.extend([c[j] if j < len(c) else "" for c in wrapped]
                 for j in range(max(len(c) for c in wrapped)))
  # Padded headers fix each column's width; every wrapped cell fits in it.
  return fmt.text_table([h.ljust(w) for h, w in zip(headers, widths, strict=True)],
                        lines)


def _policy_table(policies: Sequence[Policy], width: int) -> str:
  # Names and aliases are never broken; long descriptions wrap instead.
  name_w = max(len(p.name) for p in policies)
  alias_w = max([len("aliases"),
                 *(len(a) for p in policies for a in p.aliases)])
  offloads_w = 20
  # keeps and trade-off share what is left of the width, 2:3.
  free = width - name_w - offloads_w - alias_w - 2 * 4
  keeps_w = max(20, free * 2 // 5)
  trade_w = max(24, free - keeps_w)
  rows = [[p.name, _keeps_cell(p), _offloads_cell(p), p.description or "-",
           ", ".join(p.aliases) or "-"] for p in policies]
  return _wrapped_table(["name", "keeps", "offloads", "trade-off", "aliases"],
                        rows, [name_w, keeps_w, offloads_w, trade_w, alias_w])


def _terminal_width() -> int:
  # Piped output has no width; 160 keeps most descriptions to a few lines.
  return shutil.get_terminal_size(fallback=(160, 24)).columns


@dataclasses.dataclass(frozen=True)
class PolicyListing:
  """The catalogue as ``list`` prints it: a table, or JSON records."""

  policies: tuple[Policy, ...]
  width: int

  def to_json(self, **kwargs: Any) -> str:
    return json.dumps([_policy_record(p, catalog.policy_source(p.name))
                       for p in self.policies], **kwargs)

  def __str__(self) -> str:
    return (f"{_policy_table(self.policies, self.width)}\n\n"
            f"{len(self.policies)} policies. `{PROG} show NAME` prints one in "
            "full. Names are case-insensitive and '-' equals '_'.")


def add_list_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "list",
      summary="List the policy catalogue: what each policy keeps, offloads "
              "and costs.")
  parser.add_argument("--json", action="store_true",
                      help="print a JSON array, one object per policy")
  parser.add_argument("--width", type=int, default=None, metavar="N",
                      help="table width in characters (default: the "
                           "terminal's; descriptions wrap to fit)")
  parser.set_defaults(run=_cmd_list)


def _cmd_list(args: argparse.Namespace) -> int:
  policies = tuple(catalog.get_policy(n) for n in catalog.list_policies())
  return emit(PolicyListing(policies, args.width or _terminal_width()), args)


# ---------------------------------------------------------------- show

def _field_lines(policy: Policy, source: str) -> list[str]:
  fields = [
      ("file", source),
      ("save", ", ".join(policy.save) or "-"),
      ("offload", ", ".join(policy.offload) or "-"),
      ("exclude", ", ".join(policy.exclude) or "-"),
      ("matmuls", policy.matmuls),
      ("save_everything", str(policy.save_everything).lower()),
      ("offload_src", policy.offload_src),
      ("offload_dst", policy.offload_dst),
  ]
  indent = " " * 18
  return [textwrap.fill(value, _TEXT_WIDTH, initial_indent=f"  {key:<16}",
                        subsequent_indent=indent, break_on_hyphens=False,
                        break_long_words=False)
          for key, value in fields]


def _lowering_lines(policy: Policy) -> list[str]:
  head = "Lowers to:"
  if any(is_glob(n) for n in policy.patterns):
    head = ("Lowers to (glob patterns expanded here against the tag "
            "vocabulary and MaxText names; at trace time, against the "
            "checkpoint names in your function):")
  out = textwrap.wrap(head, _TEXT_WIDTH)
  for text in policy.describe_lowering().splitlines():
    out.append(textwrap.fill(text, _TEXT_WIDTH, initial_indent="  ",
                             subsequent_indent="      ",
                             break_on_hyphens=False, break_long_words=False))
  return out


def _remat3_line(policy: Policy) -> str:
  refusal = remat3_refusal(policy)
  if refusal is None:
    text = ("jax_remat3: lowers to one of JAX's own policy constructors, so it "
            "behaves the same with jax_remat3 off and on.")
  else:
    text = (f"jax_remat3: CANNOT run under jax {jax.__version__}'s jax_remat3; "
            f"while it is on, Policy.to_jax() raises ValueError: {refusal}")
  return textwrap.fill(text, _TEXT_WIDTH)


@dataclasses.dataclass(frozen=True)
class PolicyDescription:
  """One policy as ``show`` prints it: fields, file, lowering, remat3."""

  policy: Policy
  source: str

  def to_json(self, **kwargs: Any) -> str:
    return json.dumps(_policy_record(self.policy, self.source), **kwargs)

  def __str__(self) -> str:
    policy = self.policy
    head = policy.name
    if policy.aliases:
      head += f"  (aliases: {', '.join(policy.aliases)})"
    lines = [head]
    if policy.description:
      lines.append(textwrap.fill(policy.description, _TEXT_WIDTH,
                                 initial_indent="  ", subsequent_indent="  "))
    lines += ["", *_field_lines(policy, self.source), "",
              *_lowering_lines(policy), "", _remat3_line(policy)]
    return "\n".join(lines)


def add_show_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "show",
      summary="Show one policy: its fields, the file it came from, and the "
              "JAX policy it lowers to.")
  parser.add_argument("name", metavar="POLICY",
                      help=f"{POLICY_HELP} (a file is checked, not loaded)")
  parser.add_argument("--json", action="store_true",
                      help="print a JSON object instead of text")
  parser.set_defaults(run=_cmd_show)


def _cmd_show(args: argparse.Namespace) -> int:
  policy = resolve.resolve_policy(args.name)
  return emit(PolicyDescription(policy, policy_source(args.name)), args)
