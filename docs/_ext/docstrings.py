"""Griffe extension: reads the package's Sphinx-flavoured Google docstrings.

The docstrings are written for ``help()`` and doctest: ``Example:`` sections
and Sphinx roles (``:func:`plan```). mkdocstrings' Google parser knows only
``Examples:`` and renders roles as text, so before any docstring is parsed this
extension

- renames an ``Example:`` section to ``Examples:`` (rendered as code, not as a
  quote of ``>>>`` lines);
- reads a ``Returns:`` section as prose, its type taken from the signature
  (the parser would take the text before a colon for the type);
- turns a role into a link when it names an object an API page documents
  (``[`plan`][remat_toolkit.plan]``), otherwise into a code span;
- shows a parameter whose default is a module constant
  (``max_evaluations=DEFAULT_MAX_EVALUATIONS``) with the constant's value
  (``max_evaluations=48``): a reader of the page cannot look the name up.

Only the rendered text changes: the package's source is left as it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

API_PAGES = Path(__file__).resolve().parent.parent / "api"

# :func:`name`, :class:`~remat_toolkit.results.Plan`, :meth:`Plan.save`, ...
_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")
_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)
# The first line of a Returns/Yields section, which is prose here: a colon in it
# would otherwise be read as "type: description".
_RETURNS_FIRST_LINE = re.compile(r"^(\s*(?:Returns|Yields):[ \t]*\n[ \t]+)(?=\S)", re.M)
_DIRECTIVE = re.compile(r"^:::\s+(\S+)", re.M)


def documented_identifiers(pages: Path = API_PAGES) -> list[str]:
  """The objects the API pages render, as ``::: identifier`` lines name them."""
  found = []
  for page in sorted(pages.glob("*.md")):
    found.extend(_DIRECTIVE.findall(page.read_text(encoding="utf-8")))
  return found


class SphinxDocstrings(griffe.Extension):
  """Rewrites roles and ``Example:`` headings in every docstring of the package."""

  def __init__(self) -> None:
    super().__init__()
    self._documented = documented_identifiers()
    # A role names its target by its last component, or by a dotted tail of
    # it (``Plan.save``, ``results.Plan``): both resolve to the public path.
    self._by_tail: dict[str, str] = {}
    for identifier in self._documented:
      parts = identifier.split(".")
      for start in range(1, len(parts)):
        self._by_tail.setdefault(".".join(parts[start:]), identifier)

  def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
    del kwargs
    for obj in _walk(pkg):
      if obj.docstring is not None:
        obj.docstring.value = self._rewrite(obj.docstring.value)
      if obj.is_function:
        for parameter in obj.parameters:
          value = _constant_value(obj, parameter.default)
          if value is not None:
            parameter.default = value

  def _rewrite(self, text: str) -> str:
    text = _EXAMPLE_HEADING.sub(r"\1Examples:", text)
    # An empty type before the colon: the type comes from the signature.
    text = _RETURNS_FIRST_LINE.sub(r"\1: ", text)
    return _ROLE.sub(self._role, text)

  def _role(self, match: re.Match[str]) -> str:
    short, target = match.group(1) == "~", match.group(2).strip()
    if target.startswith("rt."):  # the docstrings' own abbreviation of the package
      target = "remat_toolkit." + target.removeprefix("rt.")
    shown = target.rsplit(".", 1)[-1] if short else match.group(2).strip()
    identifier = target if target in self._documented else self._by_tail.get(target)
    if identifier is None:
      return f"`{shown}`"
    return f"[`{shown}`][{identifier}]"


_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*")
_LITERAL = re.compile(r"-?[0-9][0-9_.e+-]*|'[^']*'|\"[^\"]*\"")


def _constant_value(function: griffe.Object, default: Any) -> str | None:
  """The literal value of ``default`` when it names a module constant."""
  if default is None or not _CONSTANT.fullmatch(str(default)):
    return None
  try:
    target = function.module[str(default)]
  except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
    return None
  value = getattr(target, "value", None)
  if value is None or not _LITERAL.fullmatch(str(value)):
    return None
  text = str(value)
  if "." in text and abs(float(text)) >= 1e6:  # 25000000000.0 -> 2.5e+10
    return format(float(text), "g")
  return text


def _walk(obj: griffe.Object):
  yield obj
  for member in obj.members.values():
    if not member.is_alias:
      yield from _walk(member)
