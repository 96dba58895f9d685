"""The memory-vs-recompute frontier: named policies and plans on one plane.

:func:`frontier` traces the model once, measures the named policies and
plans at several budgets on that one trace, and marks the Pareto-optimal
points (:func:`remat_toolkit._src.core.pareto.pareto_flags` over device bytes,
recompute FLOPs and offloaded bytes, as ``Comparison.pareto()``). With
``per_layer=True`` the plans choose a policy per region, and by default one
is made at each step of the exact per-region front (thinned to
:data:`DENSE_BUDGETS`), so the frontier is dense between the named points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.core.format import parse_bytes
from remat_toolkit._src.core.pareto import pareto_flags
from remat_toolkit._src.planning.planner import DEFAULT_MAX_EVALUATIONS
from remat_toolkit._src.planning.planner import Planner
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.planning import Frontier
from remat_toolkit._src.results.planning import FrontierPoint

__all__ = ["frontier", "DENSE_BUDGETS"]

# Budgets planned at when none are given.
_DEFAULT_BUDGETS = 8
#: Per-region plans made by default with ``per_layer=True``: the steps of
#: the exact per-region front, thinned evenly to at most this many.
DENSE_BUDGETS = 24


def frontier(fn: Callable[..., Any], *args: Any,
             policies: Sequence[resolve.PolicyLike] | None = None,
             budgets: Sequence[int | str] | int | None = None,
             max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
             per_layer: bool = False) -> Frontier:
  """The memory-vs-recompute frontier over named policies and plans.

  The model is traced once; plans at different budgets share evaluations.

  Args:
    fn: returns a scalar loss; see :func:`plan`.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees.
    policies: what ``policy=`` accepts, in a list (default: every catalogue
      policy that does not offload; offloading is a third axis). A policy
      that cannot run here is skipped with a warning.
    budgets: activation budgets to plan at, or how many, spread evenly from
      ``boundary-only`` to ``save-everything`` (default 8; with
      ``per_layer``, the steps of the per-region front, at most
      :data:`DENSE_BUDGETS`).
    max_evaluations: per plan; see :func:`plan`.
    per_layer: plan a policy per region (see :func:`plan`): the points
      between the named ones that uniform policies cannot reach.

  Returns:
    A :class:`Frontier`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
    >>> f = rt.frontier(lambda w, x: block(w, x).sum(),
    ...                 jax.ShapeDtypeStruct((16, 64), jnp.float32),
    ...                 jax.ShapeDtypeStruct((8, 16), jnp.float32),
    ...                 policies=["boundary-only"], budgets=["2KiB"])
    >>> [(p.label, p.recompute_flops, p.on_frontier) for p in f.points]
    [('boundary-only', 16384, True), ('plan@2.0 KiB', 0, True)]
  """
  check_flag("per_layer", per_layer)
  planner = Planner(fn, *args)
  chosen = resolve.resolve_policies(policies, default=_default_policies())
  runnable, skipped = resolve.split_runnable(chosen)
  named = [_point(p.name, "named", p, planner.measure(p), None)
           for p in runnable]
  items = named + _frontier_plans(planner, budgets, max_evaluations,
                                  per_layer)
  flags = pareto_flags([p.criteria for p in items])
  points = [dataclasses.replace(p, on_frontier=f)
            for p, f in zip(items, flags, strict=True)]
  points.sort(key=lambda p: (p.activation_bytes, p.recompute_flops, p.label))
  result = Frontier(points=tuple(points), warnings=planner.warnings,
                    skipped=skipped)
  warn_once([*result.warnings, *skipped.values()])
  return result


def _default_policies() -> list[Policy]:
  policies = [catalog.get_policy(n) for n in catalog.list_policies()]
  return [p for p in policies if not p.offloads]


def _point(label: str, source: str, policy: Policy, report: ResidualReport,
           budget: int | None) -> FrontierPoint:
  return FrontierPoint(label=label, source=source, policy=policy,
                       activation_bytes=report.activation_bytes,
                       offloaded_bytes=report.offloaded_bytes,
                       recompute_flops=report.recompute_flops,
                       recompute_percent=report.recompute_percent,
                       budget=budget, on_frontier=False)


def _frontier_budgets(planner: Planner, budgets, per_layer: bool) -> list[int]:
  if budgets is None and per_layer:
    return _front_steps(planner)
  if budgets is None or (isinstance(budgets, int) and not isinstance(budgets, bool)):
    count = _DEFAULT_BUDGETS if budgets is None else budgets
    if count < 1:
      raise ValueError(f"budgets must be a positive count or a list of sizes, "
                       f"got {budgets!r}.")
    lo, hi = planner.boundary_only_bytes, planner.save_everything_bytes
    if count == 1:
      return [hi]
    return sorted({lo + (hi - lo) * i // (count - 1) for i in range(count)})
  if isinstance(budgets, (str, bytes)):
    raise TypeError(f"budgets must be a list of sizes or a count, got "
                    f"{budgets!r}; write budgets=[{budgets!r}].")
  return [parse_bytes(b) for b in budgets]


def _front_steps(planner: Planner) -> list[int]:
  """The device bytes of each step of the per-region front (where another
  byte of budget buys less recompute), thinned evenly."""
  regions = planner.region_planner
  steps = sorted({regions.predicted(m)[0] for m in regions.mixes})
  if len(steps) <= DENSE_BUDGETS:
    return steps
  last = len(steps) - 1
  return sorted({steps[round(i * last / (DENSE_BUDGETS - 1))]
                 for i in range(DENSE_BUDGETS)})


def _frontier_plans(planner: Planner, budgets, max_evaluations: int,
                    per_layer: bool) -> list[FrontierPoint]:
  out: list[FrontierPoint] = []
  label, source = ("per-region", "per-region plan") if per_layer else (
      "plan", "plan")
  for budget in _frontier_budgets(planner, budgets, per_layer):
    try:
      p = planner.plan(budget, max_evaluations=max_evaluations,
                       per_layer=per_layer)
    except ValueError:  # nothing fits this budget: no point to draw
      continue
    # Dense budgets lie close together: more digits keep labels apart.
    size = format_bytes(budget, digits=3 if per_layer else 1)
    out.append(_point(f"{label}@{size}", source, p.policy, p.report, budget))
  return out
