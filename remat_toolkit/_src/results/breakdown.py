"""The memory breakdown of one training step, as data.

Bytes per category (parameters, gradients, optimizer state, activations,
inputs) and whether remat is the tool for them. Measured by
:mod:`remat_toolkit._src.analysis.breakdown`; rendered by
:mod:`remat_toolkit._src.display`.

Example:
  >>> from remat_toolkit._src.results.breakdown import Breakdown
  >>> b = Breakdown(param_bytes=400, grad_bytes=400, optimizer_bytes=800,
  ...               activation_bytes=100, offloaded_bytes=0, input_bytes=10,
  ...               boundary_only_bytes=50, save_everything_bytes=300,
  ...               recompute_percent=0.0, policy="save-everything",
  ...               optimizer="adamw", remat_regions=2)
  >>> b.dominant, b.remat_helps
  ('optimizer state', False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.results import base as render
from remat_toolkit._src.results.base import Result

__all__ = ["Breakdown", "CATEGORIES"]

#: The categories of a breakdown, in display order.
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer state",
                               "activations", "inputs")
_STATE = ("parameters", "gradients", "optimizer state")


@dataclasses.dataclass(frozen=True)
class Breakdown(Result):
  """Bytes per category of one training step, and what remat can change.

  Attributes:
    param_bytes: the parameters (``fn``'s first argument).
    grad_bytes: their gradients (floating-point leaves only).
    optimizer_bytes: the optimizer state (0 without an optimizer).
    activation_bytes: activations kept on device for the backward pass under
      ``policy``.
    offloaded_bytes: activations moved to host memory under ``policy``.
    input_bytes: the batch (``fn``'s other arguments).
    boundary_only_bytes: activations under ``boundary-only``: the least remat
      keeps.
    save_everything_bytes: activations under ``save-everything``: no remat.
    recompute_percent: recompute FLOPs of ``policy``, in percent of a
      no-remat step.
    policy: the analysed policy's name.
    optimizer: the optimizer's name (None without one).
    remat_regions: remat regions that read the ambient policy.
    xla_temp_bytes: XLA's temporary buffer size for ``jit(grad(fn))`` under
      ``policy`` (only with ``compile=True``).
    xla_note: the backend (and CPU scheduler) that figure was taken with.
    warnings: why the activations may not be the policy's own (see
      :func:`remat_toolkit._src.analysis.report.build_report`).
  """

  param_bytes: int
  grad_bytes: int
  optimizer_bytes: int
  activation_bytes: int
  offloaded_bytes: int
  input_bytes: int
  boundary_only_bytes: int
  save_everything_bytes: int
  recompute_percent: float
  policy: str
  optimizer: str | None
  remat_regions: int
  xla_temp_bytes: int | None = None
  xla_note: str = ""
  warnings: tuple[Finding, ...] = ()

  # ------------------------------------------------------------ totals
  def categories(self) -> dict[str, int]:
    """Bytes per category, in :data:`CATEGORIES` order."""
    return dict(zip(CATEGORIES, (self.param_bytes, self.grad_bytes,
                                 self.optimizer_bytes, self.activation_bytes,
                                 self.input_bytes), strict=True))

  @property
  def total_bytes(self) -> int:
    """Device bytes held at the start of the backward pass (XLA's
    temporaries come on top)."""
    return sum(self.categories().values())

  @property
  def state_bytes(self) -> int:
    """Parameters, gradients and optimizer state: what remat cannot touch."""
    return self.param_bytes + self.grad_bytes + self.optimizer_bytes

  @property
  def dominant(self) -> str:
    """The largest category (ties go to the first in display order)."""
    cats = self.categories()
    return max(CATEGORIES, key=lambda c: (cats[c], -CATEGORIES.index(c)))

  @property
  def remat_helps(self) -> bool:
    """Whether activations are the largest category, so remat is the tool."""
    return self.dominant == "activations"

  def total_with(self, activation_bytes: int) -> int:
    """The total if activations took ``activation_bytes`` instead."""
    return self.total_bytes - self.activation_bytes + activation_bytes

  @property
  def verdict(self) -> str:
    """One paragraph: is remat the right tool for this step's memory?"""
    lo, hi = self.boundary_only_bytes, self.save_everything_bytes
    span = (f"Remat moves activations between {format_bytes(lo)} "
            f"(boundary-only) and {format_bytes(hi)} (save-everything), "
            f"a total of {format_bytes(self.total_with(lo))} to "
            f"{format_bytes(self.total_with(hi))}.")
    if self.remat_regions == 0:
      return ("fn has no remat region that reads the ambient policy, so no "
              "policy changes its memory; wrap its blocks with "
              "remat_toolkit.remat to let remat help.")
    if self.dominant in _STATE:
      share = 100.0 * self.state_bytes / max(self.total_bytes, 1)
      verb = "dominates" if self.dominant == "optimizer state" else "dominate"
      return (f"The {self.dominant} {verb}: "
              f"parameters, gradients and optimizer state take "
              f"{format_bytes(self.state_bytes)} ({share:.0f}% of the total). "
              "Remat cannot rescue an out-of-memory error caused mainly by "
              "optimizer state or model parameters; shard them (FSDP/ZeRO), "
              "use a lighter optimizer or a lower precision. " + span)
    if self.dominant == "activations":
      return ("Activations dominate, so remat is the right tool. " + span
              + " `remat-toolkit plan --budget SIZE` finds the policy with "
              "the least recompute for a budget.")
    return ("The inputs dominate; remat does not change them. " + span)

  # ------------------------------------------------------------ display
  def rows(self) -> list[dict[str, Any]]:
    """One record per category (the table's data)."""
    total = max(self.total_bytes, 1)
    notes = {
        "parameters": "held for the whole step",
        "gradients": "one per floating-point parameter",
        "optimizer state": self.optimizer or "no optimizer given",
        "activations": f"kept for backward under {self.policy}"
                       + (f"; {format_bytes(self.offloaded_bytes)} more on host"
                          if self.offloaded_bytes else ""),
        "inputs": "the batch",
    }
    return [{"category": c, "bytes": b, "share": 100.0 * b / total,
             "note": notes[c]} for c, b in self.categories().items()]

  def summary_lines(self) -> list[str]:
    """The headline figures and warnings, one line each."""
    return render.summary_lines(self)

  def to_dict(self) -> dict[str, Any]:
    """Plain data: every field, the totals, the dominant category, the verdict."""
    out = dataclasses.asdict(self)
    out["warnings"] = list(self.warnings)
    out.update(total_bytes=self.total_bytes, dominant=self.dominant,
               remat_helps=self.remat_helps, verdict=self.verdict)
    return out
