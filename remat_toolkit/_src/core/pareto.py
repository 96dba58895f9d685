"""The one Pareto rule: which points no other point beats, every criterion minimised.

A point is *dominated* when another point is no worse on every criterion and
better on at least one. Equal points do not dominate each other, so every
copy of an undominated point is on the front. Callers choose the criteria:

* ``Comparison.pareto()`` and ``Frontier``: device bytes kept, recompute
  FLOPs, host bytes offloaded (offloading spends host transfers, so an
  offloading policy does not hide the policies that move nothing);
* the planner's dynamic programme (:func:`undominated`): predicted device
  bytes, host bytes and cost, keeping one state of each equal triple.

Example:
  >>> from remat_toolkit._src.core.pareto import pareto_flags
  >>> pareto_flags([(1, 9), (5, 5), (5, 5), (6, 5), (9, 1)])
  [True, True, True, False, True]
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

__all__ = ["pareto_flags", "undominated", "dominates"]

T = TypeVar("T")


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
  """Whether ``a`` is no worse than ``b`` on every criterion and differs."""
  return all(x <= y for x, y in zip(a, b, strict=True)) and tuple(a) != tuple(b)


def pareto_flags(points: Sequence[Sequence[float]]) -> list[bool]:
  """For each point, whether no other point dominates it (all minimised).

  Args:
    points: tuples of numbers, all of one length (the criteria).

  Returns:
    One flag per point, in the order given; equal points share their flag.

  Raises:
    ValueError: if the points do not all have the same number of criteria.
  """
  keys = [tuple(p) for p in points]
  if len({len(k) for k in keys}) > 1:
    raise ValueError(
        f"every point needs the same number of criteria, got lengths "
        f"{sorted({len(k) for k in keys})}; give each point all criteria.")
  flags = [False] * len(keys)
  # In lexicographic order a dominator comes before what it dominates, and
  # whatever dominates a dominated point dominates its victims too: so each
  # point is checked only against the distinct front found so far.
  front: list[tuple] = []
  for i in sorted(range(len(keys)), key=lambda i: keys[i]):
    key = keys[i]
    if front and front[-1] == key:
      flags[i] = True  # a copy of a front point
    elif not any(dominates(f, key) for f in front):
      front.append(key)
      flags[i] = True
  return flags


def undominated(items: Sequence[T], key: Callable[[T], Sequence[Any]]
                ) -> list[T]:
  """The items on the front of ``key``, one per distinct key, in key order.

  Of items with equal keys the first given is kept: for the planner's
  dynamic programme they are interchangeable states.
  """
  keys = [tuple(key(x)) for x in items]
  seen: set[tuple] = set()
  out = []
  for i in sorted(range(len(items)), key=lambda i: keys[i]):
    if keys[i] not in seen:
      seen.add(keys[i])
      out.append(i)
  flags = pareto_flags([keys[i] for i in out])
  return [items[i] for i, on in zip(out, flags, strict=True) if on]
