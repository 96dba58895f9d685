"""The one chart: memory kept (x) against recompute (y), Pareto front joined.

The memory axis holds the activations each policy keeps, or, for a
comparison made with ``peak=True``, the predicted peak of its step
(``memory="peak"``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any
from typing import cast

from remat_toolkit._src.core.pareto import pareto_flags
from remat_toolkit._src.display.common import require
from remat_toolkit._src.results import base
from remat_toolkit._src.results.analysis import Comparison
from remat_toolkit._src.results.planning import FIELD_PREFIXES
from remat_toolkit._src.results.planning import Frontier

# ======================================================== the one plot
# (html, dataclasses and Comparison are imported in the sections above.)


#: What the memory axis can hold, and its label.
MEMORY_AXES = {"kept": "activation memory kept",
               "peak": "predicted peak of one step"}


@dataclasses.dataclass(frozen=True)
class PlotPoint:
  """One policy on the memory-vs-recompute chart.

  ``memory_bytes`` is what the memory axis holds: the activations kept, or
  the step's predicted peak.
  """

  label: str
  memory_bytes: int
  recompute_percent: float
  on_front: bool
  planned: bool = False
  per_region: bool = False


@functools.singledispatch
def plot_points(result: Any, memory: str = "kept") -> list[PlotPoint]:
  """The points :func:`plot` draws for ``result``, with ``memory`` (a key of
  :data:`MEMORY_AXES`) on the memory axis."""
  raise TypeError(f"no memory-vs-recompute chart for {type(result).__name__}")


@plot_points.register
def _(comparison: Comparison, memory: str = "kept") -> list[PlotPoint]:
  rows = comparison.rows()
  if memory == "kept":
    return [PlotPoint(r["policy"], r["activation_bytes"],
                      r["recompute_percent"], r["pareto"]) for r in rows]
  if comparison.peaks is None:
    raise ValueError(
        "plot(memory='peak') needs the peaks of the policies; compare them "
        "with rt.compare(..., peak=True).")
  # On the peak's axis the front is the peak's: a policy that keeps more
  # can peak lower.
  front = pareto_flags([(r["peak_bytes"], r["recompute_flops"],
                         r["offloaded_bytes"]) for r in rows])
  return [PlotPoint(r["policy"], r["peak_bytes"], r["recompute_percent"], f)
          for r, f in zip(rows, front, strict=True)]


@plot_points.register
def _(frontier: Frontier, memory: str = "kept") -> list[PlotPoint]:
  if memory != "kept":
    raise ValueError(
        f"plot(memory={memory!r}) is for a comparison made with "
        "rt.compare(..., peak=True); a frontier's memory axis is the "
        "activations kept (memory='kept').")
  return [PlotPoint(p.label, p.activation_bytes, p.recompute_percent,
                    p.on_frontier, planned=p.source != "named",
                    per_region=p.source == "per-region plan")
          for p in frontier.points]


@base.plot.register(Comparison)
@base.plot.register(Frontier)
def plot(result: Any, ax: Any = None, *, max_bytes: int | None = None,
         memory: str = "kept") -> Any:
  """Memory kept, or the step's peak, (x) vs recompute (y, % of a no-remat step).

  Pareto-optimal points are red and joined by a step line (from each, the
  least recompute affordable until the next); plans, when present, are
  triangles, per-region plans diamonds, and the named policies' own front
  is drawn dashed beside them, so the gain of mixing policies per region
  shows as the gap. Named policies are labelled, each label placed where it
  overlaps no other label and no point and stays inside the axes. Memory is
  in MiB or GiB by its size, on a log axis when it spans more than 30x.
  Needs matplotlib.

  Args:
    result: a :class:`Comparison` or a :class:`Frontier`.
    ax: the axes to draw on (default: a new figure's).
    max_bytes: where the memory axis ends (points beyond are out of view
      and unlabelled); default: past the largest point.
    memory: what the memory axis holds: ``"kept"``, the activations each
      policy keeps, or ``"peak"``, the predicted peak of its step (a
      :class:`Comparison` made with ``peak=True``; the front is then the
      peak's).

  Returns:
    The matplotlib axes drawn on (a new figure's when ``ax`` is None).

  Raises:
    ValueError: ``memory`` is neither ``"kept"`` nor ``"peak"``, or
      ``"peak"`` for a result without peaks.
  """
  if memory not in MEMORY_AXES:
    raise ValueError(f"plot(memory={memory!r}): the memory axis is one of "
                     f"{', '.join(map(repr, MEMORY_AXES))}.")
  points = plot_points(result, memory)
  require("matplotlib", "plot")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import FuncFormatter
  if ax is None:
    _, ax = plt.subplots(figsize=(8, 5))
  largest = (max_bytes if max_bytes is not None
             else max((p.memory_bytes for p in points), default=0))
  unit, scale = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
  for kind, marker, label in (((False, False), "o", "named policy"),
                              ((True, False), "^", "plan"),
                              ((True, True), "D", "per-region plan")):
    group = [p for p in points if (p.planned, p.per_region) == kind]
    if group:
      ax.scatter([p.memory_bytes / scale for p in group],
                 [p.recompute_percent for p in group], marker=marker,
                 c=["tab:red" if p.on_front else "tab:gray" for p in group],
                 label=label, zorder=2)
  front = sorted((p.memory_bytes / scale, p.recompute_percent)
                 for p in points if p.on_front)
  if front:
    ax.step(*zip(*front, strict=True), where="post", color="tab:red", lw=1)
  if any(p.per_region for p in points):
    named = [(p.memory_bytes, p.recompute_percent) for p in points
             if not p.planned]
    flags = pareto_flags(named)
    uniform = sorted((b / scale, r) for (b, r), f in zip(named, flags,
                                                         strict=True) if f)
    if uniform:
      ax.step(*zip(*uniform, strict=True), where="post", color="tab:gray",
              lw=1, ls="--", label="named policies' front")
  shown = [p for p in points
           if max_bytes is None or p.memory_bytes <= max_bytes]
  smallest = min((p.memory_bytes for p in shown if p.memory_bytes),
                 default=0)
  top = max((p.memory_bytes for p in shown), default=0)
  if smallest and top / smallest > 30:
    ax.set_xscale("log")
  if max_bytes is not None:
    ax.set_xlim(right=max_bytes / scale)
  ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
  ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
  ax.set_xlabel(f"{MEMORY_AXES[memory]} ({unit})")
  ax.set_ylabel("recompute FLOPs (% of a no-remat step)")
  ax.set_title("remat: memory vs recompute")
  if any(p.planned for p in points):
    ax.legend(loc="upper right")
  # Policies that keep the same share one point and one label.
  labels: dict[tuple[int, float], list[str]] = {}
  for p in shown:
    if not p.planned:
      labels.setdefault((p.memory_bytes, p.recompute_percent),
                        []).append(p.label)
  # A point several policies share is named after ours, not the field's.
  for names in labels.values():
    names.sort(key=lambda n: n.startswith(FIELD_PREFIXES))
  _place_labels(ax, [(nbytes / scale, percent,
                      names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else ""))
                     for (nbytes, percent), names in labels.items()],
                [(p.memory_bytes / scale, p.recompute_percent) for p in shown])
  return ax


#: Where a label may go, in points from its point: right, left, above, below.
_OFFSETS = ((4, 3), (4, -9), (-4, 3), (-4, -9), (4, 10), (-4, 10), (4, -16),
            (-4, -16), (4, 17), (-4, 17), (4, -23), (-4, -23))
_FONT = 7

_Box = tuple[float, float, float, float]  # left, bottom, right, top (pixels)
_Placing = tuple[float, int, int, _Box]  # its overlap, its offset, its box


def _place_labels(ax: Any, labels: list[tuple[float, float, str]],
                  points: list[tuple[float, float]]) -> None:
  """Annotates each ``(x, y, text)`` at the first offset of :data:`_OFFSETS`
  whose box overlaps no label placed before, no point and no axes edge
  (the least overlapping one when none is free)."""
  fig = ax.figure
  ax.autoscale_view()
  to_pixels = ax.transData.transform
  per_point = fig.dpi / 72
  left, bottom, right, top = ax.get_window_extent().extents
  dots = [tuple(to_pixels(xy)) for xy in points]
  placed: list[_Box] = []

  def overlap(a, b) -> float:
    dx = min(a[2], b[2]) - max(a[0], b[0])
    dy = min(a[3], b[3]) - max(a[1], b[1])
    return dx * dy if dx > 0 and dy > 0 else 0.0

  # Left to right, lowest first: the front's labels are placed first.
  for x, y, text in sorted(labels, key=lambda item: (item[0], item[1])):
    px, py = to_pixels((x, y))
    width = 0.6 * _FONT * len(text) * per_point
    height = 1.2 * _FONT * per_point
    best: _Placing | None = None
    for dx, dy in _OFFSETS:
      x0 = px + dx * per_point - (width if dx < 0 else 0)
      y0 = py + dy * per_point
      box = (x0, y0, x0 + width, y0 + height)
      outside = (max(left - box[0], 0) + max(box[2] - right, 0)
                 + max(bottom - box[1], 0) + max(box[3] - top, 0)) * height
      cost = (outside + sum(overlap(box, b) for b in placed)
              + sum(overlap(box, (qx - 3, qy - 3, qx + 3, qy + 3))
                    for qx, qy in dots))
      if best is None or cost < best[0]:
        best = (cost, dx, dy, box)
      if cost == 0:
        break
    _, dx, dy, box = cast(_Placing, best)  # _OFFSETS is not empty: one was tried
    placed.append(box)
    ax.annotate(text, (x, y), fontsize=_FONT, xytext=(dx, dy),
                textcoords="offset points", ha="right" if dx < 0 else "left",
                zorder=3)
