"""The planner's search over keep / offload / recompute per name, on numbers.

Nothing here traces or measures: :class:`Search` and :func:`drop_useless`
call an ``evaluate(choice) -> Outcome`` function they are given (the
planner's analyzer, or a table in a test), and :class:`AdditiveModel` adds up
the effects of names measured one at a time. See
:mod:`remat_toolkit._src.planning.uniform` for the stages and the facts of JAX's
partial evaluation the branch and bound relies on.

Example:
  >>> from remat_toolkit._src.planning.search import Choice, Limits, Outcome, Search
  >>> table = {frozenset(): (0, 10), frozenset({"a"}): (4, 0)}  # bytes, cost
  >>> def evaluate(c):
  ...   nbytes, cost = table[c.save]
  ...   return Outcome(c, nbytes, 0, cost, cost, {n: 4 for n in c.save})
  >>> search = Search(evaluate, ["a"], Limits(device=4, host=0),
  ...                 allow_offload=False)
  >>> search.run()
  >>> sorted(search.best.choice.save), search.complete
  (['a'], True)
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import json
import math
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

from remat_toolkit._src.core.pareto import undominated

__all__ = ["Choice", "Outcome", "Limits", "Search", "AdditiveModel",
           "drop_useless", "OutOfEvaluations", "largest_fitting"]


@dataclasses.dataclass(frozen=True)
class Choice:
  """What a candidate policy does: names kept/offloaded, or a whole mode."""

  save: frozenset[str] = frozenset()
  offload: frozenset[str] = frozenset()
  mode: str = ""

  def digest(self) -> str:
    text = json.dumps([self.mode, sorted(self.save), sorted(self.offload)])
    return hashlib.sha1(text.encode()).hexdigest()[:8]


@dataclasses.dataclass(frozen=True)
class Outcome:
  """A choice as measured: the numbers the search compares.

  Attributes:
    choice: what was measured (None for a policy no choice of names
      expresses, such as a wrapped JAX policy: never a search candidate).
    device_bytes: activation bytes kept on device.
    host_bytes: bytes offloaded to host.
    recompute_flops: FLOPs recomputed.
    cost: recompute plus transfer FLOP-equivalents (what is minimised).
    device_by_name: device bytes kept per checkpoint name.
    report: the measurement behind the numbers (opaque to the search).
  """

  choice: Choice | None
  device_bytes: int
  host_bytes: int
  recompute_flops: int
  cost: float
  device_by_name: Mapping[str, int]
  report: Any = None

  def key(self) -> tuple[float, int, int]:
    return (self.cost, self.device_bytes, self.host_bytes)

  def chosen(self) -> Choice:
    """:attr:`choice`, of an outcome the search made (which always has one).

    Raises:
      RuntimeError: for the outcome of a policy no choice expresses.
    """
    if self.choice is None:
      raise RuntimeError("a search outcome without a choice of names; please "
                         "report this.")
    return self.choice


Evaluate = Callable[[Choice], Outcome]


class OutOfEvaluations(Exception):
  """Raised by an evaluator past its limit; the search stops unproven."""


@dataclasses.dataclass
class Limits:
  device: float
  host: float

  def fit(self, o: Outcome) -> bool:
    return o.device_bytes <= self.device and o.host_bytes <= self.host


class Search:
  """Best-first branch and bound over keep / offload / recompute per name.

  A node fixes some names as kept, offloaded or recomputed and leaves the
  rest undecided; its *top* is the choice that keeps every undecided name.
  The top's recompute is the least of any completion, and its residuals that
  are not undecided names are held by every completion: so the top gives a
  lower bound (cost, bytes) and, when it fits, the node's optimum. Nodes are
  expanded least bound first; a child's top is evaluated only when the child
  is reached, so the search evaluates few choices beyond those whose bound
  beats the optimum.
  """

  def __init__(self, evaluate: Evaluate, names: Sequence[str],
               limits: Limits, allow_offload: bool):
    self.evaluate = evaluate
    self.names = tuple(sorted(names))
    self.limits = limits
    self.allow_offload = allow_offload
    self.best: Outcome | None = None
    self.complete = True
    self._heap: list[tuple] = []
    self._count = itertools.count()

  def offer(self, o: Outcome) -> None:
    if self.limits.fit(o) and (self.best is None or o.key() < self.best.key()):
      self.best = o

  def run(self) -> None:
    """Searches until proven; lets OutOfEvaluations through at the limit."""
    self.complete = False
    self._push((-math.inf, 0), frozenset(), frozenset(), self.names)
    while self._heap:
      bound, _, saved, offloaded, undecided = heapq.heappop(self._heap)
      if self._dominated(bound):
        break  # every other node's bound is at least as large
      self._expand(bound, saved, offloaded, undecided)
    self.complete = True

  def _push(self, bound, saved, offloaded, undecided) -> None:
    heapq.heappush(self._heap, (bound, next(self._count), saved, offloaded,
                                undecided))

  def _dominated(self, bound: tuple[float, float]) -> bool:
    # Only recompute is proven; ties in bytes are settled by drop_useless.
    return self.best is not None and bound[0] >= self.best.cost

  def _expand(self, bound, saved, offloaded, undecided) -> None:
    top = self.evaluate(Choice(saved | frozenset(undecided), offloaded))
    free = sum(top.device_by_name.get(n, 0) for n in undecided)
    forced = top.device_bytes - free
    if forced > self.limits.device or top.host_bytes > self.limits.host:
      return
    exact = (top.cost, forced)
    if self._dominated(exact):
      return
    if exact > bound:  # the evaluated bound is tighter: wait for its turn
      self._push(exact, saved, offloaded, undecided)
      return
    if self.limits.fit(top):
      self.offer(top)
      return
    # Branch on the undecided name holding the most bytes: it decides fit.
    name = max(undecided, key=lambda n: (top.device_by_name.get(n, 0), n))
    rest = tuple(n for n in undecided if n != name)
    kept = top.device_by_name.get(name, 0)
    self._push((top.cost, forced + kept), saved | {name}, offloaded, rest)
    if self.allow_offload:
      self._push(exact, saved, offloaded | {name}, rest)
    self._push(exact, saved, offloaded, rest)


def drop_useless(evaluate: Evaluate, best: Outcome, limits: Limits) -> Outcome:
  """Drops kept names whose removal costs no recompute and no bytes."""
  for name in sorted(best.chosen().save,
                     key=lambda n: -best.device_by_name.get(n, 0)):
    choice = best.chosen()
    trial = evaluate(dataclasses.replace(choice, save=choice.save - {name}))
    if (limits.fit(trial) and trial.cost <= best.cost
        and trial.device_bytes <= best.device_bytes):
      best = trial
  return best


class AdditiveModel:
  """Predicted bytes and recompute per name, from one measurement each.

  Each name is measured alone against ``boundary-only``; the model adds
  those effects up. It is exact when names do not interact and only guides
  the search otherwise: every prediction it makes is measured before use.
  """

  def __init__(self, base: Outcome, singles: Mapping[str, Outcome],
               transfer_flops_per_byte: float, allow_offload: bool):
    self.base = base
    self.transfer = transfer_flops_per_byte
    self.allow_offload = allow_offload
    # (name, added device bytes, recompute saved) of names that do anything.
    self.items = [(n, o.device_bytes - base.device_bytes, base.cost - o.cost)
                  for n, o in sorted(singles.items())
                  if (o.device_bytes, o.cost) != (base.device_bytes, base.cost)]

  def ranked(self, limits: Limits, count: int) -> list[tuple[float, Choice]]:
    """Up to ``count`` (predicted cost, choice) predicted to fit, cheapest first.

    An exact dynamic programme over the predicted (device, host, cost)
    states, dropping states another state beats on all three.
    """
    # (device bytes, host bytes, cost, names kept, names offloaded)
    states: list[tuple[Any, ...]] = [(self.base.device_bytes, 0, self.base.cost,
                                      frozenset(), frozenset())]
    shrink = [0] * (len(self.items) + 1)  # most bytes the rest could free
    for i in range(len(self.items) - 1, -1, -1):
      shrink[i] = shrink[i + 1] + max(-self.items[i][1], 0)
    for i, item in enumerate(self.items):
      grown = [s for state in states for s in self._grow(state, item)]
      states = undominated(
          [s for s in grown if s[0] - shrink[i + 1] <= limits.device
           and s[1] <= limits.host], key=lambda s: s[:3])
    fitting = sorted((s for s in states if s[0] <= limits.device),
                     key=lambda s: (s[2], s[0], s[1]))
    return [(s[2], Choice(save=s[3], offload=s[4])) for s in fitting[:count]]

  def _grow(self, state: tuple, item: tuple) -> list[tuple]:
    """The state with ``item``'s name recomputed, kept, and maybe offloaded."""
    dev, host, cost, keep, off = state
    name, nbytes, saved = item
    out = [state, (dev + nbytes, host, cost - saved, keep | {name}, off)]
    if self.allow_offload and nbytes > 0:
      out.append((dev, host + nbytes, cost - saved + 2 * nbytes * self.transfer,
                  keep, off | {name}))
    return out


T = TypeVar("T")


def largest_fitting(solve: Callable[[int], T | None],
                    figure: Callable[[T], float],
                    kept: Callable[[T], int], lo: int, hi: int,
                    budget: float) -> T | None:
  """The plan at the largest kept-bytes limit in ``[lo, hi]`` whose
  ``figure`` (a step's peak) fits ``budget``; None if none does.

  ``solve(limit)`` is the least-recompute plan keeping at most ``limit``
  bytes (None: nothing keeps so little), ``kept(plan)`` the bytes it keeps.
  Lowering the limit never lowers the recompute, so the largest limit that
  fits gives the least recompute, provided the figure grows with the limit:
  the search assumes so (a peak only roughly does) and bisects. The top is
  tried first (it often fits), then the bottom (if it does not fit, nothing
  does), then the bracket: a plan that does not fit at ``mid`` keeps
  ``kept(plan) <= mid`` bytes and is what every limit from there to ``mid``
  gives, so the upper end moves down to its bytes, not only to ``mid``.

  Example:
    >>> plans = {0: ("recompute all", 9), 40: ("keep a", 5), 90: ("keep b", 0)}
    >>> def solve(limit):  # the least-recompute plan keeping <= limit
    ...   return max((k, p) for k, p in plans.items() if k <= limit)
    >>> peak = {0: 100, 40: 130, 90: 190}  # the step's peak of each
    >>> largest_fitting(solve, lambda c: peak[c[0]], lambda c: c[0], 0, 90,
    ...                 budget=150)
    (40, ('keep a', 5))
  """
  if hi < lo:
    return None
  top = solve(hi)
  if top is not None and figure(top) <= budget:
    return top
  best = solve(lo)
  if best is None or figure(best) > budget:
    return None
  good = lo
  bad = hi if top is None else max(min(kept(top), hi), good + 1)
  while bad - good > 1:
    mid = (good + bad) // 2
    found = solve(mid)
    if found is not None and figure(found) <= budget:
      good, best = mid, found
    else:
      below = mid if found is None else kept(found)
      bad = below if below > good else mid
  return best
