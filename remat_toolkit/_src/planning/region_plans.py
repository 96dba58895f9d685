"""Per-region plans made on the planner's trace: the measured mix, its Plan and its Policy.

:class:`~remat_toolkit._src.planning.per_region.RegionPlanner` measures each
kind of region's candidates and solves the knapsack over them; this module
takes its cheapest mixes, measures them on the whole program, and makes the
:class:`Plan` (``Planner.plan(budget, per_layer=True)``) and its per-region
:class:`Policy`, named for the model and the mix. With ``bounds="peak"`` the
kept-bytes limit is bisected over the exact per-region front's range
(:func:`~remat_toolkit._src.planning.peak_search.search_peak`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.planning.planner import Planner
  >>> @rt.remat
  ... def block(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
  >>> planner = Planner(lambda w, x: block(block(w, x), x).sum(),
  ...                   jax.ShapeDtypeStruct((16, 16), jnp.float32),
  ...                   jax.ShapeDtypeStruct((16, 16), jnp.float32))
  >>> p = planner.plan("2KiB", per_layer=True)  # one region keeps its matmul
  >>> sorted(r.activation_bytes for r in p.regions), p.recompute_flops
  ([0, 1024], 8192)
  >>> planner.plan("2KiB").recompute_flops  # uniform: both regions or neither
  16384
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Protocol

from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.planning.choices import describe_bound
from remat_toolkit._src.planning.knapsack import Mix
from remat_toolkit._src.planning.peak_search import StepPeaks
from remat_toolkit._src.planning.peak_search import cached_solve
from remat_toolkit._src.planning.peak_search import search_peak
from remat_toolkit._src.planning.per_region import Candidate
from remat_toolkit._src.planning.per_region import Measurer
from remat_toolkit._src.planning.per_region import RegionPlanner
from remat_toolkit._src.planning.search import Limits
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.peak import Peak
from remat_toolkit._src.results.planning import PEAK
from remat_toolkit._src.results.planning import NamedFit
from remat_toolkit._src.results.planning import Plan
from remat_toolkit._src.results.planning import RegionPlan

__all__ = ["RegionPlanning", "plan_per_region", "plan_per_region_peak",
           "region_policy"]

_NOT_ADDITIVE = Finding(
    "the regions' measured effects do not add up to the whole program's "
    "(regions interact), so the per-region plan is the best of the mixes "
    "measured, not proven optimal; its figures are measured.", "not-additive")

# A measured per-region mix: its outcome, the mix, and whether it measured
# as predicted.
_Measured = tuple[Outcome, Mix, bool]


class RegionPlanning(Measurer, Protocol):
  """What per-region plans take from the planner besides its measurements:
  its per-region planner, the step's peaks, the figures every Plan carries
  and the error for a budget nothing fits
  (:class:`~remat_toolkit._src.planning.planner.Planner` is one)."""

  model_id: str
  per_device: bool
  host_bandwidth: float
  device_flops: float
  warnings: tuple[Finding, ...]
  peaks: StepPeaks

  @property
  def region_planner(self) -> RegionPlanner:
    """The per-region planner on the trace."""

  @property
  def evaluations(self) -> int:
    """Analyzer evaluations made so far."""

  def smallest(self) -> Outcome:
    """The measured outcome keeping the fewest device bytes."""

  def workspace_bytes(self, kept: int) -> int:
    """One region's internals, materialised again while it is recomputed."""

  def named_fits(self, limits: Limits, peak_budget: int | None = None
                 ) -> tuple[NamedFit, ...]:
    """Every catalogue policy measured, and whether it fits."""

  def infeasible(self, budget: int, complete: bool, bounds: str) -> ValueError:
    """The error for a budget nothing fits."""


def plan_per_region(planner: RegionPlanning, limit: int, limits: Limits,
                    bounds: str, host: int | None) -> Plan:
  """The per-region plan for one budget (what ``Planner.plan(per_layer=True)``
  returns).

  The cheapest mixes predicted to fit are measured on the whole program,
  cheapest first, until one measures as predicted (then it is the optimum
  over the candidates) or
  :data:`~remat_toolkit._src.planning.per_region.MIXES_MEASURED` were tried
  (then the best that fits is taken, marked not optimal).

  Raises:
    ValueError: when no mix fits (the message gives the least any keeps).
  """
  found = _region_best(planner, limits)
  if found is None:
    # A region keeps at least its inputs, so no mix keeps less than
    # boundary-only, which was measured: the error can say that.
    raise planner.infeasible(limit, True, bounds)
  return _region_plan(planner, found, limit, planner.named_fits(limits),
                      bounds, host)


def _region_best(planner: RegionPlanning, limits: Limits) -> _Measured | None:
  """The cheapest measured mix that fits ``limits`` (None: none does)."""
  regions = planner.region_planner
  measured: list[_Measured] = []
  for mix in regions.best(limits.device, limits.host):
    outcome = planner.evaluate.policy(
        region_policy(planner, regions.assignment(mix)))
    exact = regions.predicted(mix)[:3] == (
        outcome.device_bytes, outcome.host_bytes, outcome.recompute_flops)
    if limits.fit(outcome):
      measured.append((outcome, mix, exact))
      if exact:
        break  # measured as predicted: the cheapest mix, proven
  return min(measured, key=lambda m: m[0].key()) if measured else None


def _region_plan(planner: RegionPlanning, found: _Measured, limit: int,
                 named: tuple[NamedFit, ...], bounds: str, host: int | None,
                 peak: Peak | None = None) -> Plan:
  """The per-region Plan of a measured mix."""
  outcome, mix, exact = found
  regions = planner.region_planner
  assignment = regions.assignment(mix)
  compiled = peak is not None and peak.xla_bytes is not None
  warnings = planner.warnings + (() if exact else (_NOT_ADDITIVE,))
  return Plan(
      policy=region_policy(planner, assignment, limit, outcome, bounds,
                           compiled),
      budget=limit, cost=outcome.cost, decisions={}, named=named,
      report=outcome.report, optimal=exact and peak is None,
      evaluations=planner.evaluations,
      smallest_bytes=planner.smallest().device_bytes,
      workspace_bytes=planner.workspace_bytes(outcome.device_bytes),
      bounds=bounds, host_budget=host, host_bandwidth=planner.host_bandwidth,
      device_flops=planner.device_flops,
      warnings=warnings + (() if peak is None else tuple(peak.warnings)),
      regions=tuple(_region_rows(regions, assignment)),
      per_device=planner.per_device,
      peak_bytes=None if peak is None else peak.bytes,
      xla_peak_bytes=None if peak is None else peak.xla_bytes)


def plan_per_region_peak(planner: RegionPlanning, limit: int, host: int | None,
                         compile: bool) -> Plan:
  """The per-region plan whose predicted step peak fits ``limit`` (what
  ``Planner.plan(per_layer=True, bounds="peak")`` returns).

  The kept-bytes limit is bisected over the exact per-region front's range
  (:func:`~remat_toolkit._src.planning.peak_search.search_peak`), each limit
  planned as :func:`plan_per_region` plans it; with ``compile`` the
  winner's XLA figure must fit too.

  Raises:
    ValueError: when no mix fits (the message gives the least predicted
      peak, and the least XLA figure compiled).
  """
  regions = planner.region_planner
  hosts = math.inf if host is None else host
  devices = [regions.predicted(m)[0] for m in regions.mixes]

  def describe_found(found: _Measured) -> tuple[Outcome, Policy, str]:
    policy = region_policy(planner, regions.assignment(found[1]))
    return found[0], policy, f"the per-region mix {policy.name}"

  # Built apart: inside the call, its type would come from search_peak's
  # parameter, which lets None through as a candidate.
  cached = cached_solve(lambda kept: _region_best(planner, Limits(kept, hosts)),
                        lambda found: found[0].device_bytes)
  best = search_peak(planner.peaks, cached, describe_found, min(devices),
                     max(devices), limit, compile)
  if best is None:
    raise planner.infeasible(limit, True, PEAK)
  peak = planner.peaks(describe_found(best)[1], best[0], compile=compile)
  return _region_plan(
      planner, best, limit,
      planner.named_fits(Limits(device=math.inf, host=hosts), limit), PEAK,
      host, peak)


def region_policy(planner: RegionPlanning,
                  assignment: Sequence[tuple[str, Candidate]],
                  budget: int | None = None, outcome: Outcome | None = None,
                  bounds: str = "", compiled: bool = False) -> Policy:
  """The per-region policy giving each region its candidate's policy, named
  for the model and the assignment."""
  pairs = tuple((key, c.policy) for key, c in assignment)
  digest = hashlib.sha1(json.dumps(
      [[k, p.name] for k, p in pairs]).encode()).hexdigest()[:8]
  description = ""
  if outcome is not None and budget is not None:  # a plan's: given together
    bound = describe_bound(bounds, planner.per_device, compiled)
    counts = Policy(name="counts", regions=pairs).keeps_summary()
    description = (
        f"Planned by remat_toolkit.plan per region for {bound} of at most "
        f"{format_bytes(budget)}: {counts[len('per region: '):]}; recomputes "
        f"the rest ({outcome.report.recompute_percent:.1f}% of a no-remat "
        "step).")
  return Policy(name=f"plan-{planner.model_id}-{digest}", regions=pairs,
                description=description)


def _region_rows(regions: RegionPlanner,
                 assignment: Sequence[tuple[str, Candidate]]
                 ) -> list[RegionPlan]:
  kinds = {key: i for i, kind in enumerate(regions.kinds) for key in kind.keys}
  return [RegionPlan(region=key, policy=c.policy.name, kind=kinds[key],
                     activation_bytes=c.option.device,
                     offloaded_bytes=c.option.host,
                     recompute_flops=c.recompute_flops)
          for key, c in assignment]
