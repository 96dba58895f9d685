"""Planning across layouts: the same model at several group sizes.

A group size is how many blocks share one remat region. Larger regions keep
fewer boundaries but materialise more while one is recomputed, so layouts
are compared by their *estimated peak* (kept activations plus one region's
workspace), or by the training step's predicted peak (``bounds="peak"``),
never by kept activations alone, and the plan with the least recompute among
the layouts that fit wins.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.results.planning import ESTIMATED_PEAK
from remat_toolkit._src.results.planning import PEAK
from remat_toolkit._src.results.planning import GroupEstimate
from remat_toolkit._src.results.planning import Plan

__all__ = ["GroupsLike", "DEFAULT_GROUP_SIZES", "layouts", "plan_groups"]

#: Group sizes weighed when ``groups`` is a callable (``"sqrt"``: about
#: sqrt(layers), as the built-in models read it).
DEFAULT_GROUP_SIZES: tuple[int | str, ...] = (1, 2, 4, "sqrt")

GroupsLike = (Mapping[Any, tuple[Callable[..., Any], Sequence[Any]]]
              | Callable[[Any], tuple[Callable[..., Any], Sequence[Any]]])
"""How a plan builds the model at each group size (``plan(groups=...)``):
a mapping from group size to ``(fn, args)``, or a function of the group
size returning ``(fn, args)``."""

# (group size, a thunk building (fn, args) for it).
Layout = tuple[Any, Callable[[], Any]]


def layouts(groups: Any, sizes: Sequence[Any] | None) -> list[Layout]:
  """The layouts ``groups`` describes, each built only when planned."""
  if isinstance(groups, Mapping):
    if sizes is not None:
      raise ValueError("group_sizes only applies when groups is a callable; "
                       "with a mapping its keys are the group sizes.")
    return [(g, _returning(v)) for g, v in groups.items()]
  if callable(groups):
    chosen = DEFAULT_GROUP_SIZES if sizes is None else tuple(sizes)
    if not chosen:
      raise ValueError("group_sizes is empty; give at least one group size.")
    return [(g, functools.partial(groups, g)) for g in chosen]
  raise TypeError(
      f"groups must be a mapping group size -> (fn, args) or a callable "
      f"group size -> (fn, args), got {groups!r}.")


def _returning(value: Any) -> Callable[[], Any]:
  """A thunk giving ``value``."""
  return lambda: value


def _unpack_layout(group: Any, value: Any) -> tuple[Callable[..., Any], tuple]:
  if (not isinstance(value, (tuple, list)) or len(value) != 2
      or not callable(value[0]) or not isinstance(value[1], (tuple, list))):
    raise TypeError(
        f"groups[{group!r}] must be a pair (fn, args) with args a tuple of "
        f"fn's arguments, got {value!r}.")
  return value[0], tuple(value[1])


def plan_groups(layouts: Sequence[Layout], limit: int,
                make_planner: Callable[..., Any], search: dict) -> Plan:
  """The plan with the least recompute whose peak fits ``limit``.

  Args:
    layouts: ``(group, build)`` pairs; ``build()`` gives ``(fn, args)``.
    limit: the peak budget in bytes.
    make_planner: ``make_planner(fn, *args)`` -> a ``Planner``.
    search: keyword arguments of ``Planner.plan``; its ``bounds`` (default
      ``"estimated peak"``) says which peak: the estimated one or the
      step's predicted one (``"peak"``).

  Raises:
    ValueError: no layout fits, saying the smallest peak.
  """
  search = {"bounds": ESTIMATED_PEAK, **search}
  plans: list[Plan] = []
  estimates: list[GroupEstimate] = []
  for group, build in layouts:
    try:
      fn, args = _unpack_layout(group, build())
      planner = make_planner(fn, *args)
    except ValueError as e:
      estimates.append(GroupEstimate(group, 0, 0, 0, 0, 0, 0, 0, "", False,
                                     f"skipped: {e}"))
      continue
    plan, estimate = _plan_layout(group, planner, limit, search)
    estimates.append(estimate)
    if plan is not None:
      plans.append(plan)
  if not plans:
    raise _nothing_fits(limit, estimates, search["bounds"])
  best = min(plans, key=lambda p: (p.cost, p.peak_bytes or p.estimated_peak))
  return dataclasses.replace(best, groups=tuple(estimates))


def _plan_layout(group: Any, planner: Any, limit: int, search: dict
                 ) -> tuple[Plan | None, GroupEstimate]:
  facts = (group, planner.region_executions, planner.boundary_only_bytes,
           planner.everything_bytes)
  try:
    p = planner.plan(limit, **search)
  except ValueError:
    kept = planner.boundary_only_bytes
    workspace = planner.workspace_bytes(kept)
    recompute = planner.measure(resolve.BOUNDARY_ONLY).recompute_flops
    return None, GroupEstimate(*facts, workspace, kept, kept + workspace,
                               recompute, "", False, "nothing fits",
                               planner.least_peak()
                               if search["bounds"] == PEAK else None)
  p = dataclasses.replace(p, group=group)
  return p, GroupEstimate(*facts, p.workspace_bytes, p.kept_bytes,
                          p.estimated_peak, p.recompute_flops, p.policy.name,
                          True, peak_bytes=p.peak_bytes)


def _nothing_fits(limit: int, estimates: Sequence[GroupEstimate],
                  bounds: str) -> ValueError:
  which = "predicted" if bounds == PEAK else "estimated"
  figures = [e.peak_bytes if bounds == PEAK else e.estimated_peak
             for e in estimates]
  peaks = [p for p in figures if p]
  least = (f"; the smallest {which} peak of any layout is "
           f"{format_bytes(min(peaks))} ({min(peaks)} bytes)") if peaks else ""
  return ValueError(
      f"No group size fits the peak budget of {format_bytes(limit)} "
      f"({limit} bytes){least}. Raise the budget or use a smaller "
      "micro-batch.")
