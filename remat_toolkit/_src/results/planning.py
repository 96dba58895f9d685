"""What :func:`remat_toolkit.plan` returns: the plan and what it was weighed against.

Data only; :mod:`remat_toolkit._src.display` renders it (``str(plan)``, a
notebook's HTML), and ``rt.save_policy(plan, path)`` writes its policy as a
file the catalogue reads.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def block(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
  >>> p = rt.plan(lambda w, x: block(w, x).sum(),
  ...             jax.ShapeDtypeStruct((16, 64), jnp.float32),
  ...             jax.ShapeDtypeStruct((8, 16), jnp.float32), budget="2KiB")
  >>> p.activation_bytes == p.report.activation_bytes, p.bounds
  (True, 'kept activations')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.policy_toml import policy_record
from remat_toolkit._src.results import base as render
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.base import Result

__all__ = ["Plan", "NamedFit", "GroupEstimate", "RegionPlan", "Frontier",
           "FrontierPoint", "KEPT_ACTIVATIONS",
           "ESTIMATED_PEAK", "PEAK", "BOUNDS", "check_bounds", "plan_bounds"]

#: ``bounds``: the budget bounds the activation bytes kept for the backward pass.
KEPT_ACTIVATIONS = "kept activations"
#: ``bounds``: the budget bounds the kept activations plus one region's
#: internals while it is recomputed (how layouts of different group sizes
#: are compared).
ESTIMATED_PEAK = "estimated peak"
#: ``bounds``: the budget bounds the training step's predicted peak
#: (:func:`remat_toolkit.peak`: parameters, inputs, gradients and everything
#: live at the step's worst moment), or with ``compile=True`` XLA's figure too.
PEAK = "peak"
BOUNDS = (KEPT_ACTIVATIONS, ESTIMATED_PEAK, PEAK)
#: How the names of presets taken from other frameworks begin (MaxText,
#: Praxis); where such a preset and one of ours keep the same, ours is shown.
FIELD_PREFIXES = ("maxtext-", "praxis-")


def check_bounds(bounds: Any) -> str:
  """``bounds`` if it is one of :data:`BOUNDS`, else a ValueError saying them."""
  if bounds not in BOUNDS:
    raise ValueError(
        f"bounds must be one of {list(BOUNDS)}, got {bounds!r}: the budget "
        "bounds the activations kept for the backward pass, their estimated "
        "peak (kept activations plus one region's workspace), or the "
        "training step's predicted peak (parameters, gradients and "
        "everything live at its worst moment, as rt.peak predicts it).")
  return bounds


def plan_bounds(bounds: Any, groups: Any) -> str:
  """What the budget bounds: as asked, else the estimated peak with groups
  (which compare layouts by their estimated or predicted peak)."""
  if bounds is None:
    return KEPT_ACTIVATIONS if groups is None else ESTIMATED_PEAK
  if check_bounds(bounds) == KEPT_ACTIVATIONS and groups is not None:
    raise ValueError(
        "bounds='kept activations' cannot compare layouts: larger groups "
        "always keep fewer activations but materialise more while a region "
        "is recomputed. With groups the budget bounds the estimated peak; "
        "pass bounds='estimated peak' (or leave it out), or drop groups.")
  return bounds


@dataclasses.dataclass(frozen=True)
class NamedFit:
  """A catalogue policy measured against the budget.

  Attributes:
    name: the policy's name.
    activation_bytes: device bytes it keeps.
    offloaded_bytes: host bytes it moves.
    recompute_flops: FLOPs it recomputes.
    recompute_percent: the same, in percent of a no-remat step.
    cost: recompute FLOPs plus transfer FLOP-equivalents.
    fits: whether it fits the budget (its predicted peak, when the budget
      bounds the step's peak).
    peak_bytes: the predicted peak of its training step when the budget
      bounds the peak (``bounds="peak"``), else None.
  """

  name: str
  activation_bytes: int
  offloaded_bytes: int
  recompute_flops: int
  recompute_percent: float
  cost: float
  fits: bool
  peak_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class GroupEstimate:
  """One group size (blocks per remat region) weighed by the planner.

  Attributes:
    group: the group size as given (None: ``fn`` as passed to :func:`plan`).
    regions: remat region executions per step (scan iterations included).
    boundary_bytes: activations under ``boundary-only``: region boundaries.
    everything_bytes: the most activations any measured policy keeps (every
      region's internals).
    workspace_bytes: one region's internals, materialised while it is
      recomputed in the backward pass under this layout's plan.
    activation_bytes: activations the plan keeps.
    estimated_peak: ``activation_bytes + workspace_bytes``.
    recompute_flops: the plan's recompute FLOPs.
    policy: the plan's policy name ("" if nothing fits).
    fits: whether the plan fits the budget (its estimated peak, or with
      ``bounds="peak"`` its predicted peak).
    note: why the layout was skipped or does not fit.
    peak_bytes: with ``bounds="peak"``, the plan's predicted step peak (the
      least predicted when nothing fits); else None.
  """

  group: Any
  regions: int
  boundary_bytes: int
  everything_bytes: int
  workspace_bytes: int
  activation_bytes: int
  estimated_peak: int
  recompute_flops: int
  policy: str
  fits: bool
  note: str = ""
  peak_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class RegionPlan:
  """One remat region of a per-region plan: its policy and what it costs.

  Attributes:
    region: the region's key: its module path (``layers_3``), or ``#k`` for
      the k-th region of a plain function.
    policy: the name of the policy it takes.
    kind: the index of its kind: regions of one kind are structurally
      identical and were measured together.
    activation_bytes: device bytes it keeps beyond its inputs (which every
      policy keeps).
    offloaded_bytes: host bytes it offloads.
    recompute_flops: matmul FLOPs it recomputes in the backward pass.
  """

  region: str
  policy: str
  kind: int
  activation_bytes: int
  offloaded_bytes: int
  recompute_flops: int


@dataclasses.dataclass(frozen=True)
class Plan(Result):
  """The policy with the least recompute that fits a budget, and its numbers.

  Attributes:
    policy: the planned :class:`Policy` (usable with ``rt.use_policy``; by
      name after :meth:`register` or :meth:`save` + ``rt.load_policies``).
    budget: the budget in bytes.
    bounds: what the budget bounds: ``"kept activations"``,
      ``"estimated peak"`` (kept activations plus :attr:`workspace_bytes`),
      the default when planned with ``groups``, or ``"peak"`` (the training
      step's predicted peak, :attr:`peak_bytes`); the text's first line
      says which.
    cost: ``recompute_flops`` plus transfer FLOP-equivalents (see
      :mod:`remat_toolkit._src.planning.planner`).
    decisions: checkpoint name -> ``"save"``, ``"offload"`` or
      ``"recompute"`` (empty when a whole alternative won).
    named: every catalogue policy measured on the same program.
    report: the analyzer's :class:`ResidualReport` of the plan; the measured
      numbers below are read from it.
    optimal: whether the branch and bound finished, which proves that no
      choice of names and no whole alternative recomputes less within the
      budget; False when it stopped at ``max_evaluations`` (the plan is then
      the best measured), and always with ``bounds="peak"`` (a bisection
      over kept-bytes limits, not a proof).
    evaluations: analyzer evaluations made on the model so far (named
      policies and per-name measurements included).
    smallest_bytes: the least activation memory any evaluated policy kept.
    workspace_bytes: one region's internals while it is recomputed.
    host_budget: host bytes allowed for offloading (None: offloading off or
      unlimited).
    host_bandwidth: bytes/s used to cost transfers.
    device_flops: FLOP/s used to convert transfer time to FLOPs.
    group: the chosen group size when ``groups`` was given.
    groups: the estimate for each group size weighed.
    warnings: what limited the search without failing it: regions with
      their own policy (they keep what they keep, whatever the plan), or no
      checkpoint name to decide on.
    regions: for a per-region plan (``per_layer=True``), each region's
      policy and numbers, in program order; empty for a uniform plan.
    per_device: whether the budget bounds one device's share of the
      activations (``per_device=True``): then every byte figure compared
      with it (:attr:`kept_bytes`, :attr:`smallest_bytes`,
      :attr:`workspace_bytes`, the named policies' and regions' bytes) is
      per device, found by :attr:`per_device_method`;
      :attr:`activation_bytes` stays the total over all devices.
    peak_bytes: with ``bounds="peak"``, the predicted peak of the plan's
      training step (``jax.jit(jax.grad(fn))``: parameters, inputs,
      gradients and everything live at its worst moment; see
      :func:`remat_toolkit.peak`); else None.
    xla_peak_bytes: with ``bounds="peak"`` and ``compile=True``, XLA's
      figure of the same step (``argument + output + temp - alias`` bytes of
      its ``memory_analysis()``), which then fits the budget; else None.
  """

  policy: Policy
  budget: int
  cost: float
  decisions: Mapping[str, str]
  named: tuple[NamedFit, ...]
  report: ResidualReport
  optimal: bool
  evaluations: int
  smallest_bytes: int
  workspace_bytes: int
  host_budget: int | None
  host_bandwidth: float
  device_flops: float
  bounds: str = KEPT_ACTIVATIONS
  group: Any = None
  groups: tuple[GroupEstimate, ...] = ()
  warnings: tuple[Finding, ...] = ()
  regions: tuple[RegionPlan, ...] = ()
  per_device: bool = False
  peak_bytes: int | None = None
  xla_peak_bytes: int | None = None

  # ------------------------------------------------------------ measured
  @property
  def activation_bytes(self) -> int:
    """Device bytes the policy keeps (measured), on all devices together."""
    return self.report.activation_bytes

  @property
  def activation_bytes_per_device(self) -> int:
    """Device bytes one device keeps (the total when unsharded)."""
    return self.report.activation_bytes_per_device

  @property
  def kept_bytes(self) -> int:
    """The kept activations the budget bounds: one device's share with
    :attr:`per_device`, else :attr:`activation_bytes`."""
    return (self.activation_bytes_per_device if self.per_device
            else self.activation_bytes)

  @property
  def devices(self) -> int:
    """Devices the arguments are sharded over (1 if none)."""
    return self.report.devices

  @property
  def per_device_method(self) -> str | None:
    """How the per-device figures were found (None when unsharded); see
    :attr:`ResidualReport.per_device_method`."""
    return self.report.per_device_method

  @property
  def offloaded_bytes(self) -> int:
    """Bytes it moves to host memory (measured)."""
    return self.report.offloaded_bytes

  @property
  def recompute_flops(self) -> int:
    """Matmul FLOPs it recomputes (measured)."""
    return self.report.recompute_flops

  @property
  def recompute_percent(self) -> float:
    """The same, in percent of a no-remat step."""
    return self.report.recompute_percent

  @property
  def estimated_peak(self) -> int:
    """``kept_bytes + workspace_bytes`` (per device with :attr:`per_device`)."""
    return self.kept_bytes + self.workspace_bytes

  @property
  def closest_builtins(self) -> tuple[NamedFit, ...]:
    """The catalogue policies that fit, least recompute first (at most 3)."""
    # Of equal policies our own preset names come before the field's.
    fitting = sorted((f for f in self.named if f.fits),
                     key=lambda f: (f.cost, f.activation_bytes,
                                    f.name.startswith(FIELD_PREFIXES), f.name))
    return tuple(fitting[:3])

  @property
  def best_builtin(self) -> NamedFit | None:
    """The fitting catalogue policy with the least recompute, if any."""
    closest = self.closest_builtins
    return closest[0] if closest else None

  @property
  def per_layer(self) -> bool:
    """Whether this plan gives each region a policy of its own."""
    return bool(self.regions)

  # ------------------------------------------------------------ use it
  @property
  def rules(self) -> dict[str, Policy]:
    """``{module path: policy}`` of a per-region plan, for
    :func:`remat_toolkit.remat_modules`.

    ``rt.remat_modules(model, plan.rules)`` makes each planned region a
    region with its planned policy, in a model one cannot edit.

    Raises:
      ValueError: for a uniform plan (give ``plan.policy`` to the blocks'
        rule instead), or for regions named by position (plain functions
        have no module path for a rule to match; use
        ``rt.use_policy(plan)``).
    """
    if not self.regions:
      raise ValueError(
          f"plan.rules is for per-region plans (rt.plan(..., per_layer=True))"
          f"; this plan gives every region {self.policy.name!r}: use "
          "rt.remat_modules(model) with `with rt.use_policy(plan):`, or the "
          "rule {'Block': plan.policy}.")
    positional = [r.region for r in self.regions
                  if region_keys.is_positional(r.region)]
    if positional:
      raise ValueError(
          f"plan.rules needs module paths, but the regions {positional[:4]} "
          "are regions of plain functions, named by position; apply the plan "
          "with `with rt.use_policy(plan):` instead.")
    return dict(self.policy.regions)

  # ------------------------------------------------------------ display
  # ------------------------------------------------------------ data
  def to_dict(self) -> dict[str, Any]:
    """Plain data: the policy, the numbers, the named policies, the groups."""
    return {
        "policy": policy_record(self.policy),
        "budget": self.budget,
        "bounds": self.bounds,
        "activation_bytes": self.activation_bytes,
        "offloaded_bytes": self.offloaded_bytes,
        "recompute_flops": self.recompute_flops,
        "recompute_percent": self.recompute_percent,
        "cost": self.cost,
        "decisions": dict(self.decisions),
        "optimal": self.optimal,
        "evaluations": self.evaluations,
        "smallest_bytes": self.smallest_bytes,
        "workspace_bytes": self.workspace_bytes,
        "estimated_peak": self.estimated_peak,
        "peak_bytes": self.peak_bytes,
        "xla_peak_bytes": self.xla_peak_bytes,
        "group": self.group,
        "groups": [dataclasses.asdict(g) for g in self.groups],
        "closest_builtins": [f.name for f in self.closest_builtins],
        "named": [dataclasses.asdict(f) for f in self.named],
        "host_budget": self.host_budget,
        "host_bandwidth": self.host_bandwidth,
        "device_flops": self.device_flops,
        "warnings": list(self.warnings),
        "regions": [dataclasses.asdict(r) for r in self.regions],
        "per_device": self.per_device,
        "devices": self.devices,
        "per_device_method": self.per_device_method,
        "activation_bytes_per_device": self.activation_bytes_per_device,
    }


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
  """One policy on the memory-vs-recompute plane.

  Attributes:
    label: the policy's name, ``plan@SIZE`` for a plan, or
      ``per-region@SIZE`` for a per-region plan.
    source: ``"named"`` (from the catalogue or given), ``"plan"`` or
      ``"per-region plan"``.
    policy: the :class:`Policy`.
    activation_bytes: device bytes kept.
    offloaded_bytes: host bytes moved.
    recompute_flops: FLOPs recomputed.
    recompute_percent: the same, in percent of a no-remat step.
    budget: the plan's budget (None for named policies).
    on_frontier: no other point is as good on device bytes, recompute and
      offloaded bytes, and better on one.
  """

  label: str
  source: str
  policy: Policy
  activation_bytes: int
  offloaded_bytes: int
  recompute_flops: int
  recompute_percent: float
  budget: int | None
  on_frontier: bool

  @property
  def criteria(self) -> tuple[int, int, int]:
    """What the Pareto flags minimise: device bytes, recompute, host bytes."""
    return (self.activation_bytes, self.recompute_flops, self.offloaded_bytes)


@dataclasses.dataclass(frozen=True)
class Frontier(Result):
  """The memory-vs-recompute Pareto frontier of named policies and plans.

  Attributes:
    points: every point, least memory first.
    warnings: what limited the plans (see :attr:`Plan.warnings`).
    skipped: policy name -> why it was not measured (e.g. offloading where
      it cannot run).
  """

  points: tuple[FrontierPoint, ...]
  warnings: tuple[Finding, ...] = ()
  skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)

  @property
  def frontier(self) -> tuple[FrontierPoint, ...]:
    """The Pareto-optimal points, least memory first."""
    return tuple(p for p in self.points if p.on_frontier)

  def rows(self) -> list[dict[str, Any]]:
    """One record per point (the table's data)."""
    return [{"label": p.label, "source": p.source,
             "activation_bytes": p.activation_bytes,
             "offloaded_bytes": p.offloaded_bytes,
             "recompute_flops": p.recompute_flops,
             "recompute_percent": p.recompute_percent, "budget": p.budget,
             "on_frontier": p.on_frontier} for p in self.points]

  def plot(self, ax=None, *, max_bytes: int | None = None):
    """Memory (x) vs recompute (y), frontier joined, plans marked (needs
    matplotlib); returns the axes.

    ``max_bytes`` ends the memory axis there (points beyond are left
    out of view and unlabelled), to look closely at the low end.
    """
    return render.plot(self, ax=ax, max_bytes=max_bytes)

  def to_dict(self) -> dict[str, Any]:
    return {"points": self.rows(), "skipped": dict(self.skipped),
            "warnings": list(self.warnings)}

