"""What a remat region is called: the key a per-region policy is looked up by.

A region is named by its module path where it has one: a linen module's
scope path (``layers_3``, ``transformer/h/0``), an NNX module's attribute
path (``layers/3``), with a ``remat_chain`` group's name after its owner's
path (``remat_group_1``). A region of a plain function has no path, so it is
named by position: ``#0`` for the first such region traced, ``#1`` for the
next, counted afresh in each ``rt.use_policy`` block and each analysis. The
analyzer and a running model name a region by the same function
(:func:`region_key`), so a plan made on one applies to the other.

Example:
  >>> from remat_toolkit._src.policies import region_keys
  >>> with region_keys.counting():
  ...   region_keys.region_key(("layers_3",)), region_keys.region_key(None), \\
  ...       region_keys.region_key(()), region_keys.region_key(None)
  ('layers_3', '#0', '#1', '#2')
  >>> region_keys.key_matches("layers_3", "layers_*"), \\
  ...     region_keys.is_positional("#2")
  (True, True)
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterator
from collections.abc import Sequence

from remat_toolkit._src.core.globs import glob_match
from remat_toolkit._src.policies import ambient

__all__ = ["region_key", "counting", "key_matches", "is_positional",
           "position_of"]

# Outside any block positions still advance (and mean nothing to a plan).
_loose = itertools.count()

_POSITION = re.compile(r"#(\d+)")


@contextlib.contextmanager
def counting() -> Iterator[None]:
  """Regions without a module path are numbered from ``#0`` inside."""
  with ambient.entered():
    yield


def region_key(path: Sequence[str] | None) -> str:
  """The key of a region being traced: its module path, else its position.

  Args:
    path: the region's module path (scope names), or None / empty for a
      region that has none (a plain function).

  Returns:
    ``"a/b/c"``, or ``"#k"`` for the k-th region without a path traced in
    the current :func:`counting` block.
  """
  if path:
    return "/".join(str(p) for p in path)
  counter = ambient.current().positions
  return f"#{next(counter if counter is not None else _loose)}"


def key_matches(key: str, pattern: str) -> bool:
  """Whether region ``key`` matches ``pattern`` (a key, or a glob where
  ``*`` also crosses ``/``)."""
  return glob_match(key, pattern)


def is_positional(key: str) -> bool:
  """Whether ``key`` names a region by position (``#k``)."""
  return _POSITION.fullmatch(key) is not None


def position_of(key: str) -> int | None:
  """``k`` for a positional key ``#k``, else None."""
  found = _POSITION.fullmatch(key)
  return int(found.group(1)) if found else None
