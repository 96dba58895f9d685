"""The exact multiple-choice knapsack behind per-region plans, on numbers.

Each remat region (a *group*) takes exactly one of its options, each option
adding device bytes, host bytes and a cost (recompute plus transfer
FLOP-equivalents). :func:`pareto_mixes` returns every undominated way to
choose, by a dynamic programme over the groups that keeps, after each group,
only the partial sums no other partial sum beats on device bytes, host bytes
and cost. Pruning a dominated partial sum never loses an optimum (whatever
completes it completes its dominator as well), so the result is exact: for
any budget, :func:`cheapest` finds the least cost among *all* combinations
that fit. Nothing here traces or measures; the per-region planner
(:mod:`~remat_toolkit._src.planning.per_region`) gives it measured numbers.

Example:
  >>> from remat_toolkit._src.planning.knapsack import Option, pareto_mixes, cheapest
  >>> region = [Option(0, 0, 10), Option(4, 0, 3), Option(9, 0, 0)]
  >>> mixes = pareto_mixes([region, region])
  >>> [(m.device, m.cost) for m in mixes]
  [(0, 20), (4, 13), (8, 6), (13, 3), (18, 0)]
  >>> best = cheapest(mixes, device=10)
  >>> best.picks, best.cost
  ((1, 1), 6)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src.core.pareto import undominated

__all__ = ["Option", "Mix", "pareto_mixes", "cheapest"]


@dataclasses.dataclass(frozen=True)
class Option:
  """One choice for one group: what it adds.

  Attributes:
    device: device bytes.
    host: host bytes.
    cost: what is minimised (recompute FLOPs plus transfer equivalents).
  """

  device: int
  host: int
  cost: float


@dataclasses.dataclass(frozen=True)
class Mix:
  """One option per group, and the sums.

  Attributes:
    device: device bytes, summed.
    host: host bytes, summed.
    cost: cost, summed.
    picks: the option chosen in each group (an index into its options).
  """

  device: int
  host: int
  cost: float
  picks: tuple[int, ...]


# A partial sum: (device, host, cost, trail), the trail a linked list of
# picks, newest first, so that states share their prefixes.
_State = tuple[int, int, float, Any]


def pareto_mixes(groups: Sequence[Sequence[Option]], *,
                 device: float = math.inf, host: float = math.inf
                 ) -> list[Mix]:
  """Every undominated choice of one option per group, least device first.

  Args:
    groups: the options of each group, in group order (non-empty each).
    device: combinations above this many device bytes are not needed (they
      are dropped as soon as the groups left cannot bring them back under).
    host: likewise for host bytes.

  Returns:
    The combinations that no other combination beats on device bytes, host
    bytes and cost, one per distinct sum (the first found: lower option
    indices first), sorted by device bytes.

  Raises:
    ValueError: if a group has no option.
  """
  for i, options in enumerate(groups):
    if not options:
      raise ValueError(f"group {i} has no option; every group needs one.")
  # The least each suffix of groups can add: a partial sum over the limit
  # by more than the rest can take away never fits.
  least_device = [0] * (len(groups) + 1)
  least_host = [0] * (len(groups) + 1)
  for i in range(len(groups) - 1, -1, -1):
    least_device[i] = least_device[i + 1] + min(o.device for o in groups[i])
    least_host[i] = least_host[i + 1] + min(o.host for o in groups[i])
  flat = all(o.host == 0 for options in groups for o in options)
  states: list[_State] = [(0, 0, 0, None)]
  for i, options in enumerate(groups):
    grown = [(d + o.device, h + o.host, c + o.cost, (trail, k))
             for d, h, c, trail in states for k, o in enumerate(options)]
    grown = [s for s in grown if s[0] + least_device[i + 1] <= device
             and s[1] + least_host[i + 1] <= host]
    states = _front_2d(grown) if flat else undominated(
        grown, key=lambda s: s[:3])
  return [Mix(d, h, c, _picks(trail, len(groups)))
          for d, h, c, trail in sorted(states, key=lambda s: s[:3])]


def cheapest(mixes: Sequence[Mix], *, device: float,
             host: float = math.inf) -> Mix | None:
  """The least-cost mix within the limits (fewer device bytes on ties)."""
  fitting = [m for m in mixes if m.device <= device and m.host <= host]
  return min(fitting, key=lambda m: (m.cost, m.device, m.host), default=None)


def _front_2d(states: list[_State]) -> list[_State]:
  """Device/cost front of host-free states: a sweep in device order."""
  out: list[_State] = []
  best = math.inf
  # Stable sort: of equal (device, cost) the first made (lower picks) stays.
  for state in sorted(states, key=lambda s: (s[0], s[2])):
    if state[2] < best:
      out.append(state)
      best = state[2]
  return out


def _picks(trail: Any, count: int) -> tuple[int, ...]:
  picks = []
  while trail is not None:
    trail, k = trail
    picks.append(k)
  if len(picks) != count:
    raise RuntimeError(f"a mix of {len(picks)} picks for {count} groups; "
                       "please report this.")
  return tuple(reversed(picks))
