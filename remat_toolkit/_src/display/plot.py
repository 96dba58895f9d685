"""The one chart: memory kept (x) against recompute (y), Pareto front joined."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from remat_toolkit._src.core.pareto import pareto_flags
from remat_toolkit._src.display.common import require
from remat_toolkit._src.results import base
from remat_toolkit._src.results.analysis import Comparison
from remat_toolkit._src.results.planning import Frontier

# ======================================================== the one plot
# (html, dataclasses and Comparison are imported in the sections above.)


@dataclasses.dataclass(frozen=True)
class PlotPoint:
  """One policy on the memory-vs-recompute chart."""

  label: str
  activation_bytes: int
  recompute_percent: float
  on_front: bool
  planned: bool = False
  per_region: bool = False


@functools.singledispatch
def plot_points(result: Any) -> list[PlotPoint]:
  """The points :func:`plot` draws for ``result`` (Frontier: see the
  Plan, Frontier section)."""
  raise TypeError(f"no memory-vs-recompute chart for {type(result).__name__}")


@plot_points.register
def _(comparison: Comparison) -> list[PlotPoint]:
  return [PlotPoint(r["policy"], r["activation_bytes"], r["recompute_percent"],
                    r["pareto"]) for r in comparison.rows()]


@plot_points.register
def _(frontier: Frontier) -> list[PlotPoint]:
  return [PlotPoint(p.label, p.activation_bytes, p.recompute_percent,
                    p.on_frontier, planned=p.source != "named",
                    per_region=p.source == "per-region plan")
          for p in frontier.points]


@base.plot.register(Comparison)
@base.plot.register(Frontier)
def plot(result: Any, ax: Any = None) -> Any:
  """Memory kept (x, MiB) vs recompute (y, % of a no-remat step).

  Pareto-optimal points are red and joined by a step line (from each, the
  least recompute affordable until the next); plans, when present, are
  triangles, per-region plans diamonds, and the named policies' own front
  is drawn dashed beside them, so the gain of mixing policies per region
  shows as the gap. Named policies are labelled. Needs matplotlib.

  Returns:
    The matplotlib axes drawn on (a new figure's when ``ax`` is None).
  """
  require("matplotlib", "plot")
  import matplotlib.pyplot as plt
  if ax is None:
    _, ax = plt.subplots(figsize=(7, 4.5))
  points = plot_points(result)
  for kind, marker, label in (((False, False), "o", "named policy"),
                              ((True, False), "^", "plan"),
                              ((True, True), "D", "per-region plan")):
    group = [p for p in points if (p.planned, p.per_region) == kind]
    if group:
      ax.scatter([p.activation_bytes / 2**20 for p in group],
                 [p.recompute_percent for p in group], marker=marker,
                 c=["tab:red" if p.on_front else "tab:gray" for p in group],
                 label=label)
  # Policies that keep the same share one point and one label.
  labels: dict[tuple[int, float], list[str]] = {}
  for p in points:
    if not p.planned:
      labels.setdefault((p.activation_bytes, p.recompute_percent),
                        []).append(p.label)
  for (nbytes, percent), names in labels.items():
    text = names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "")
    ax.annotate(text, (nbytes / 2**20, percent), fontsize=7, xytext=(3, 3),
                textcoords="offset points")
  front = sorted((p.activation_bytes / 2**20, p.recompute_percent)
                 for p in points if p.on_front)
  if front:
    ax.step(*zip(*front, strict=True), where="post", color="tab:red", lw=1)
  if any(p.per_region for p in points):
    named = [(p.activation_bytes, p.recompute_percent) for p in points
             if not p.planned]
    flags = pareto_flags(named)
    uniform = sorted((b / 2**20, r) for (b, r), f in zip(named, flags,
                                                          strict=True) if f)
    if uniform:
      ax.step(*zip(*uniform, strict=True), where="post", color="tab:gray",
              lw=1, ls="--", label="named policies' front")
  ax.set_xlabel("activation memory kept (MiB)")
  ax.set_ylabel("recompute FLOPs (% of a no-remat step)")
  ax.set_title("remat: memory vs recompute")
  if any(p.planned for p in points):
    ax.legend()
  return ax

