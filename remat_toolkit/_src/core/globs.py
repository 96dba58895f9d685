"""Glob patterns: the one rule for names, region keys and rules alike.

Checkpoint names, region keys and module-path rules are written by users
either as exact strings or as ``fnmatch`` globs (``*`` also crosses ``/``).
Whether a string is a glob, how it matches and how a name is written so that
it matches only itself are decided here, once.

Example:
  >>> from remat_toolkit._src.core import globs
  >>> globs.is_glob("layers_*"), globs.is_glob("layers_3")
  (True, False)
  >>> globs.glob_match("SelfAttention/query", "*attention/*", ignore_case=True)
  True
  >>> globs.glob_match("w[1]", globs.escape_glob("w[1]"))
  True
"""

from __future__ import annotations

import fnmatch

__all__ = ["is_glob", "glob_match", "escape_glob"]

_GLOB_CHARS = frozenset("*?[")
_ESCAPES = {"*": "[*]", "?": "[?]", "[": "[[]"}


def is_glob(text: str) -> bool:
  """Whether ``text`` holds a glob character (``*``, ``?`` or ``[``)."""
  return any(c in _GLOB_CHARS for c in text)


def glob_match(name: str, pattern: str, *, ignore_case: bool = False) -> bool:
  """Whether ``name`` matches ``pattern``: a glob, else the exact string.

  Args:
    name: the string tested (a checkpoint name, a region key, a path).
    pattern: an exact string or a glob (``*`` also crosses ``/``).
    ignore_case: compare case-insensitively (checkpoint names are spelt
      ``SelfAttention`` in one model and ``attn`` in another).
  """
  if ignore_case:
    name, pattern = name.lower(), pattern.lower()
  if is_glob(pattern):
    return fnmatch.fnmatchcase(name, pattern)
  return name == pattern


def escape_glob(name: str) -> str:
  """A glob that matches ``name`` only (its glob characters bracketed)."""
  return "".join(_ESCAPES.get(c, c) for c in name)
