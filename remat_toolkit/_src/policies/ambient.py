"""What a region being traced reads from around it, in one context.

Three things travel together through a trace and are set and reset
together: the ambient policy (``rt.use_policy``), the analyzer's stand-in
for it (``lowering.substitute_ambient``, which traces a model once for every
policy), and the count that numbers regions without a module path (``#0``,
``#1``...: afresh in each ``use_policy`` block and each analysis). They are
one immutable :class:`Ambient` in one ``ContextVar``: a block replaces what
it sets and restores the whole on exit, so a nested block cannot leave one
of the three behind.

Example:
  >>> from remat_toolkit._src.policies import ambient
  >>> with ambient.entered(policy="p") as inside:
  ...   inside.policy, next(inside.positions), next(inside.positions)
  ('p', 0, 1)
  >>> ambient.current().policy is None
  True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

__all__ = ["Ambient", "current", "entered"]


@dataclasses.dataclass(frozen=True)
class Ambient:
  """The context of a region being traced.

  Attributes:
    policy: the ambient policy (a ``Policy``), None outside ``use_policy``.
    substitute: the JAX policy (or the analyzer's markers) every region
      reading the ambient policy lowers to instead, None but while the
      analyzer traces.
    positions: the count numbering regions without a module path; None
      outside any block.
  """

  policy: Any = None
  substitute: Any = None
  positions: itertools.count | None = None


_OUTSIDE = Ambient()  # frozen: one value serves every context as default
_state: contextvars.ContextVar[Ambient] = contextvars.ContextVar(
    "remat_toolkit_ambient", default=_OUTSIDE)


def current() -> Ambient:
  """The context now."""
  return _state.get()


@contextlib.contextmanager
def entered(**changes: Any) -> Iterator[Ambient]:
  """The context with ``changes`` (fields of :class:`Ambient`) inside, its
  regions without a module path numbered from ``#0``."""
  inside = dataclasses.replace(_state.get(), positions=itertools.count(),
                               **changes)
  token = _state.set(inside)
  try:
    yield inside
  finally:
    _state.reset(token)
