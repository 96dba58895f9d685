"""The budget planner: the policy with the least recompute that fits a budget.

:func:`plan` decides, for every checkpoint name in the model (each name
selects all its instances across layers), whether to keep it on device,
offload it to host memory or recompute it, so that the activation bytes kept
for the backward pass fit ``budget`` with the least recompute. The matmul
policies (``save-matmuls``, ``save-matmuls-no-batch``) and ``save-everything``
are weighed as whole alternatives, since JAX cannot combine them with names.

Every number in a :class:`Plan` is measured by the residual analyzer on a
program traced once; none is predicted. The search measures the named
policies and each name alone, measures an additive model's best predictions,
then repairs or proves the result by a branch and bound over real
evaluations (:mod:`~remat_toolkit._src.planning.uniform` gives the stages and
the facts of JAX's partial evaluation they rely on).

Offloading is costed in FLOP-equivalents: an offloaded residual crosses the
host link twice (out in the forward pass, back in the backward pass), and
``2 * bytes / host_bandwidth`` seconds is converted at ``device_flops``
FLOP/s. Transfers that overlap with compute cost less in practice, so this
errs towards recomputing.

With ``bounds="peak"`` the budget bounds the training step's predicted peak,
which does not add up over names: the kept-bytes limit is bisected
(:mod:`~remat_toolkit._src.planning.peak_search`).

This module plans; what a choice of names means and how it is measured is
in :mod:`~remat_toolkit._src.planning.choices`, the uniform search in
:mod:`~remat_toolkit._src.planning.uniform` works on numbers alone through
:mod:`~remat_toolkit._src.planning.search`, the arguments are checked in
:mod:`~remat_toolkit._src.planning.checks`, the result is data
(:mod:`~remat_toolkit._src.results.planning`, rendered by
:mod:`~remat_toolkit._src.display`), per-region plans are measured by
:mod:`~remat_toolkit._src.planning.per_region` and made in
:mod:`~remat_toolkit._src.planning.region_plans`, per-device figures in
:mod:`~remat_toolkit._src.planning.per_device`, layouts of several group sizes
are weighed in :mod:`~remat_toolkit._src.planning.groups` and the frontier is
drawn from plans in :mod:`~remat_toolkit._src.planning.frontier`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def block(w, x):
  ...   h = rt.tag(x @ w, "ffn.up")  # 2 KiB, a matmul to redo
  ...   return rt.tag(jnp.tanh(h), "ffn.act") @ w.T  # 2 KiB, cheap to redo
  >>> loss = lambda w, x: block(w, x).sum()
  >>> args = (jax.ShapeDtypeStruct((16, 64), jnp.float32),
  ...         jax.ShapeDtypeStruct((8, 16), jnp.float32))
  >>> p = rt.plan(loss, *args, budget="2KiB")
  >>> p.policy.save, p.activation_bytes, p.recompute_flops
  (('ffn.up',), 2048, 0)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from remat_toolkit._src.analysis.breakdown import resolve_optimizer
from remat_toolkit._src.analysis.report import program_findings
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.core.format import parse_bytes
from remat_toolkit._src.planning.checks import check_peak_options
from remat_toolkit._src.planning.checks import check_rates
from remat_toolkit._src.planning.checks import check_search
from remat_toolkit._src.planning.choices import MODES
from remat_toolkit._src.planning.choices import OFFLOAD_MODES
from remat_toolkit._src.planning.choices import Evaluator
from remat_toolkit._src.planning.choices import choice_label
from remat_toolkit._src.planning.choices import choice_policy
from remat_toolkit._src.planning.choices import decisions
from remat_toolkit._src.planning.choices import describe
from remat_toolkit._src.planning.choices import describe_choice
from remat_toolkit._src.planning.choices import model_id
from remat_toolkit._src.planning.groups import DEFAULT_GROUP_SIZES
from remat_toolkit._src.planning.groups import GroupsLike
from remat_toolkit._src.planning.groups import layouts
from remat_toolkit._src.planning.groups import plan_groups
from remat_toolkit._src.planning.peak_search import StepPeaks
from remat_toolkit._src.planning.peak_search import cached_solve
from remat_toolkit._src.planning.peak_search import search_peak
from remat_toolkit._src.planning.per_device import check_per_device
from remat_toolkit._src.planning.per_region import RegionPlanner
from remat_toolkit._src.planning.region_plans import plan_per_region
from remat_toolkit._src.planning.region_plans import plan_per_region_peak
from remat_toolkit._src.planning.search import Choice
from remat_toolkit._src.planning.search import Limits
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.planning.uniform import UniformSearch
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import region_inputs
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.peak import Peak
from remat_toolkit._src.results.planning import ESTIMATED_PEAK
from remat_toolkit._src.results.planning import KEPT_ACTIVATIONS
from remat_toolkit._src.results.planning import PEAK
from remat_toolkit._src.results.planning import GroupEstimate
from remat_toolkit._src.results.planning import NamedFit
from remat_toolkit._src.results.planning import Plan
from remat_toolkit._src.results.planning import check_bounds
from remat_toolkit._src.results.planning import plan_bounds

__all__ = ["plan", "Plan", "Planner", "NamedFit", "GroupEstimate",
           "DEFAULT_HOST_BANDWIDTH", "DEFAULT_DEVICE_FLOPS",
           "DEFAULT_GROUP_SIZES", "DEFAULT_MAX_EVALUATIONS"]

#: Bytes per second each way between device and pinned host memory
#: (PCIe 4.0 x16 in practice).
DEFAULT_HOST_BANDWIDTH: float = 25e9
#: FLOP/s a recompute runs at, to convert transfer time to FLOP-equivalents
#: (about 40% of an H100's dense bf16 peak).
DEFAULT_DEVICE_FLOPS: float = 400e12
#: Analyzer evaluations the repair and proof stages may take per plan; past
#: them the best plan measured is returned, marked not proven optimal.
DEFAULT_MAX_EVALUATIONS = 48

_NO_NAMES = Finding(
    "no remat region that reads the ambient policy holds a checkpoint name, "
    "so the plan could only choose between boundary-only and the whole-model "
    "alternatives (save-everything, save-matmuls, save-matmuls-no-batch); tag "
    "the tensors worth keeping with remat_toolkit.tag(x, name) to let it keep "
    "some and recompute the rest.", "no-names")

# ==================================================================== planner

class Planner:
  """Plans on one traced model, for as many budgets as asked.

  The trace, the named policies and the per-name measurements are shared
  between budgets, so each further budget costs only its own search.
  :func:`plan` and :func:`frontier` are built on it.

  Args:
    fn: returns a scalar loss; see :func:`plan`.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees.
    allow_offload: also consider host offloading (needs ``jax_remat3`` off).
    host_bandwidth: bytes/s each way between device and host.
    device_flops: FLOP/s, to convert transfer time into FLOP-equivalents.
    per_device: every budget bounds one device's share of sharded
      arguments' activations (see :func:`plan`).

  Raises:
    ValueError: ``fn`` has no remat region that reads the ambient policy,
      offloading under ``jax_remat3``, a rate that is not positive, or
      ``per_device=True`` with unsharded arguments.
    TypeError: ``per_device`` is not a bool.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> from remat_toolkit._src.planning.planner import Planner
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
    >>> planner = Planner(lambda w, x: block(w, x).sum(),
    ...                   jax.ShapeDtypeStruct((16, 64), jnp.float32),
    ...                   jax.ShapeDtypeStruct((8, 16), jnp.float32))
    >>> [planner.plan(b).recompute_flops for b in (0, "2KiB")]
    [16384, 0]
  """

  def __init__(self, fn: Callable[..., Any], *args: Any,
               allow_offload: bool = False,
               host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
               device_flops: float = DEFAULT_DEVICE_FLOPS,
               per_device: bool = False, optimizer: Any = None):
    check_rates(allow_offload, host_bandwidth, device_flops)
    check_per_device(per_device)
    # bounds="peak" bounds the optax train step when given one.
    optimizer = None if optimizer is None else resolve_optimizer(optimizer)
    program = TracedProgram(fn, args)
    self.per_device = check_per_device(per_device, program)
    # Found once: the plan's warnings, and every candidate's report.
    found = program_findings(program)
    if program.regions == 0:
      raise ValueError("There is nothing to plan: " + found.about_regions()[0])
    self.program = program
    self.warnings: tuple[Finding, ...] = (
        *found.about_regions(),
        *(() if program.ambient_names else (_NO_NAMES,)), *found.notes)
    self.allow_offload = allow_offload
    self.host_bandwidth = float(host_bandwidth)
    self.device_flops = float(device_flops)
    # Measures choices and policies, cached; shared with per-region plans.
    self.evaluate = Evaluator(program, self.device_flops / self.host_bandwidth,
                              per_device, found)
    # Offloading, a plan may also move each region's input (region_inputs).
    offloadable = {region_inputs.INPUT_NAME} if allow_offload else set()
    self.names: tuple[str, ...] = tuple(sorted(program.names | offloadable))
    self.model_id = model_id(fn, program)
    self._named = self._catalogue()
    self._whole = {m: self.evaluate(Choice(mode=m)) for m in MODES
                   if allow_offload or m not in OFFLOAD_MODES}
    # boundary-only everywhere: what every other figure is compared with.
    self.boundary = self.evaluate(Choice())
    self._every_name = self.evaluate(Choice(save=frozenset(self.names)))
    # What recomputing a region can materialise again: the most any measured
    # policy keeps (under jax_remat3 save-everything still recomputes
    # unnamed values, so it is not always the largest).
    self._everything = max([self._every_name, *self._whole.values()],
                           key=lambda o: o.device_bytes)
    self.region_executions = _region_executions(program, self._everything)
    # Keeping every name (or a whole alternative) recomputes the least.
    self.uniform = UniformSearch(
        self.evaluate, self.names, self.boundary, allow_offload,
        least_cost=min(o.cost for o in [self._every_name, *self._whole.values()]))
    self._regions: RegionPlanner | None = None
    # The training step's peak under each policy (bounds="peak"), predicted
    # and compiled, built on this trace when first asked for.
    self.peaks = StepPeaks(
        program, len(jax.tree_util.tree_leaves(args[0])) if args else 0,
        optimizer)

  # ------------------------------------------------------------ facts
  @property
  def evaluations(self) -> int:
    """Analyzer evaluations made so far."""
    return self.evaluate.evaluations

  @property
  def boundary_only_bytes(self) -> int:
    """Activations under ``boundary-only``."""
    return self.boundary.device_bytes

  @property
  def save_everything_bytes(self) -> int:
    """Activations under ``save-everything``."""
    return self._whole["save-everything"].device_bytes

  @property
  def everything_bytes(self) -> int:
    """The most activations any measured policy keeps."""
    return self._everything.device_bytes

  def workspace_bytes(self, kept: int) -> int:
    """One region's internals, materialised again while it is recomputed,
    when ``kept`` activation bytes are kept (a chain of identical regions)."""
    return max(self.everything_bytes - kept, 0) // self.region_executions

  def peak_limit(self, budget: int) -> int:
    """The most kept bytes whose estimated peak fits ``budget`` (-1: none).

    The peak ``kept + workspace_bytes(kept)`` never falls as ``kept`` grows,
    so a bisection finds the limit.
    """
    lo, hi = -1, budget
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if mid + self.workspace_bytes(mid) <= budget:
        lo = mid
      else:
        hi = mid - 1
    return lo

  def step_peak(self, policy: Policy, outcome: Outcome, label: str = "",
                compile: bool = False) -> Peak:
    """The :class:`Peak` of ``policy``'s training step on this trace, cached
    (see :class:`~remat_toolkit._src.planning.peak_search.StepPeaks`)."""
    return self.peaks(policy, outcome, label, compile=compile)

  def least_peak(self) -> int | None:
    """The least predicted step peak computed so far (None: none yet)."""
    return self.peaks.least()

  # ------------------------------------------------------------ planning
  def plan(self, budget: int | str, *, host_budget: int | str | None = None,
           max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
           bounds: str = KEPT_ACTIVATIONS, per_layer: bool = False,
           compile: bool = False) -> Plan:
    """The plan for one budget; see :func:`plan` for the arguments.

    Args:
      budget: device bytes (int or ``"8GiB"``) for what ``bounds`` says.
      host_budget: host bytes offloading may use (default: unlimited).
      max_evaluations: analyzer evaluations for this budget's search (with
        ``bounds="peak"``: for each kept-bytes limit it tries).
      bounds: ``"kept activations"``, ``"estimated peak"`` to bound the
        kept activations plus one region's workspace, or ``"peak"`` to
        bound the training step's predicted peak.
      per_layer: choose a policy per remat region (see
        :mod:`~remat_toolkit._src.planning.per_region`).
      compile: with ``bounds="peak"``, compile the chosen plan and go on
        to the next candidate while XLA's figure is over the budget.
    """
    limit = parse_bytes(budget)
    host = check_search(self.allow_offload, host_budget, max_evaluations)
    check_flag("per_layer", per_layer)
    check_peak_options(check_bounds(bounds), compile, self.per_device)
    if bounds == PEAK:
      return self._plan_peak(limit, host, max_evaluations, per_layer, compile)
    peak = bounds == ESTIMATED_PEAK
    device = min(self.peak_limit(limit), limit) if peak else limit
    limits = Limits(device=device, host=math.inf if host is None else host)
    if per_layer:
      return plan_per_region(self, limit, limits, bounds, host)
    best, complete = self.uniform.solve(limits, max_evaluations)
    if best is None:
      raise self.infeasible(limit, complete, bounds)
    choice = best.chosen()
    policy = choice_policy(choice, f"plan-{self.model_id}-{choice.digest()}",
                            describe(choice, limit, best, bounds,
                                     self.per_device))
    return Plan(
        policy=policy, budget=limit, cost=best.cost,
        decisions=decisions(choice, self.names),
        named=self.named_fits(limits), report=best.report,
        optimal=complete, evaluations=self.evaluations,
        smallest_bytes=self.smallest().device_bytes,
        workspace_bytes=self.workspace_bytes(best.device_bytes),
        bounds=bounds, host_budget=host, host_bandwidth=self.host_bandwidth,
        device_flops=self.device_flops, warnings=self.warnings,
        per_device=self.per_device)

  def _plan_peak(self, limit: int, host: int | None, max_evaluations: int,
                 per_layer: bool, compile: bool) -> Plan:
    """The least-recompute plan whose predicted step peak fits ``limit``
    (see :func:`plan`, ``bounds="peak"``)."""
    if per_layer:
      return plan_per_region_peak(self, limit, host, compile)
    hosts = math.inf if host is None else host
    complete = True

    def solve(kept: int) -> Outcome | None:
      nonlocal complete
      best, done = self.uniform.solve(Limits(device=kept, host=hosts),
                                      max_evaluations)
      complete = complete and done
      return best

    # The named policies (and whole alternatives) compete as they are: the
    # peak only roughly grows with the kept bytes, so one of them can fit
    # with less recompute than the bisection's plan.
    named = [o for o in self._named.values()
             if o.choice is not None and o.host_bytes <= hosts]
    # Built apart: inside the call, its type would come from search_peak's
    # parameter, which lets None through as a candidate.
    cached = cached_solve(solve, lambda o: o.device_bytes)
    best = search_peak(
        self.peaks, cached,
        lambda o: (o, self.choice_policy(o.chosen()), _label(o.chosen())),
        self.smallest().device_bytes, self.everything_bytes, limit, compile,
        named)
    if best is None:
      raise self.infeasible(limit, complete, PEAK)
    choice = best.chosen()
    peak = self.step_peak(self.choice_policy(choice), best, compile=compile)
    policy = choice_policy(choice, f"plan-{self.model_id}-{choice.digest()}",
                            describe(choice, limit, best, PEAK,
                                     self.per_device, compile))
    return Plan(
        policy=policy, budget=limit, cost=best.cost,
        decisions=decisions(choice, self.names),
        named=self.named_fits(Limits(device=math.inf, host=hosts), limit),
        report=best.report, optimal=False, evaluations=self.evaluations,
        smallest_bytes=self.smallest().device_bytes,
        workspace_bytes=self.workspace_bytes(best.device_bytes),
        bounds=PEAK, host_budget=host, host_bandwidth=self.host_bandwidth,
        device_flops=self.device_flops,
        warnings=self.warnings + tuple(peak.warnings),
        per_device=self.per_device, peak_bytes=peak.bytes,
        xla_peak_bytes=peak.xla_bytes)

  @property
  def region_planner(self) -> RegionPlanner:
    """The per-region planner on this trace (candidates measured once)."""
    if self._regions is None:
      self._regions = RegionPlanner(self)
    return self._regions

  def choice_policy(self, choice: Choice) -> Policy:
    """The policy doing what ``choice`` says, named for this model."""
    return choice_policy(choice, f"plan-{self.model_id}-{choice.digest()}",
                          describe_choice(choice))

  def measure(self, policy: resolve.PolicyLike) -> ResidualReport:
    """The analyzer's report of one policy (what ``policy=`` accepts).

    Policies of names and whole alternatives are cached with every other
    evaluation of this planner; a wrapped JAX policy is measured as given.

    Raises:
      ValueError: for a policy that cannot run on this JAX now.
    """
    resolved = resolve.require_runnable(resolve.resolve_policy(policy))
    return self._measure(resolved).report

  # ------------------------------------------------------------ internals
  def _measure(self, policy: Policy) -> Outcome:
    if policy.is_jax_policy or policy.is_per_region:
      return self.evaluate.policy(policy)
    return self.evaluate(self.as_choice(policy))

  def _catalogue(self) -> dict[str, Outcome]:
    policies = [catalog.get_policy(n) for n in catalog.list_policies()]
    # A per-region policy in the catalogue was planned for some model; it
    # is no candidate for this one.
    policies = [p for p in policies if not p.is_per_region]
    if not self.allow_offload:
      policies = [p for p in policies if not p.offloads]
    # allow_offload=True was refused already where offloading cannot run.
    runnable, _ = resolve.split_runnable(policies)
    return {p.name: self._measure(p) for p in runnable}

  def as_choice(self, policy: Policy) -> Choice:
    """The choice of names (or whole alternative) ``policy`` makes here."""
    if policy.save_everything:
      return Choice(mode="save-everything")
    modes = {"all": "save-matmuls", "no-batch": "save-matmuls-no-batch",
             "offload-no-batch": "offload-matmuls-no-batch"}
    if policy.matmuls in modes:
      return Choice(mode=modes[policy.matmuls])
    saved, offloaded = policy.expand(self.names)
    present = frozenset(self.names)
    return Choice(save=saved & present, offload=offloaded & present)

  def smallest(self) -> Outcome:
    """The measured outcome keeping the fewest device bytes."""
    return min(self.evaluate.outcomes(),
               key=lambda o: (o.device_bytes, o.cost))

  def named_fits(self, limits: Limits, peak_budget: int | None = None
                 ) -> tuple[NamedFit, ...]:
    """Every catalogue policy measured here, and whether it fits (with
    ``peak_budget``: whether its predicted step peak fits that)."""
    out = []
    for n, o in self._named.items():
      fits, peak = limits.fit(o), None
      if peak_budget is not None:
        policy = (catalog.get_policy(n) if o.choice is None
                  else self.choice_policy(o.choice))
        peak = self.step_peak(policy, o, n).bytes
        fits = fits and peak <= peak_budget
      out.append(NamedFit(name=n, activation_bytes=o.device_bytes,
                          offloaded_bytes=o.host_bytes,
                          recompute_flops=o.recompute_flops,
                          recompute_percent=o.report.recompute_percent,
                          cost=o.cost, fits=fits, peak_bytes=peak))
    return tuple(out)

  def infeasible(self, budget: int, complete: bool, bounds: str) -> ValueError:
    """The error for a budget nothing fits, saying the least that does."""
    why = "" if complete else (
        " (the search stopped at its evaluation limit; raise max_evaluations)")
    if bounds == PEAK:
      return self.peaks.none_fits(budget, why)
    peak = bounds == ESTIMATED_PEAK
    small = self.smallest()
    label = _label(small.chosen())
    what = "peak budget" if peak else "activation budget"
    what = f"per-device {what}" if self.per_device else what
    least, measure = small.device_bytes, "activation memory"
    if peak:  # the estimated peak grows with what is kept: least kept, least peak
      least += self.workspace_bytes(least)
      measure = "estimated peak (kept activations + one region's workspace)"
    return ValueError(
        f"No policy fits the {what} of {format_bytes(budget)} ({budget} "
        f"bytes){why}: the least {measure} measured is "
        f"{format_bytes(least)} ({least} bytes, "
        f"{label}). Raise the budget to at least that, use a smaller "
        "micro-batch, larger remat groups, or (jax_remat3 off) "
        "allow_offload=True.")


def _label(choice: Choice) -> str:
  """How an error names a choice: its mode, its names, or boundary-only."""
  return choice.mode or choice_label(choice) or "boundary-only"


def _region_executions(program: TracedProgram, everything: Outcome) -> int:
  # For a chain of identical blocks: regions in the jaxpr, times the scan
  # length their residuals are stacked over.
  stacked = max((r.stacked for r in everything.report.activations), default=1)
  return max(program.regions * stacked, 1)


def plan(fn: Callable[..., Any], *args: Any, budget: int | str,
         bounds: str | None = None, allow_offload: bool = False,
         host_budget: int | str | None = None,
         host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
         device_flops: float = DEFAULT_DEVICE_FLOPS,
         groups: GroupsLike | None = None,
         group_sizes: Sequence[Any] | None = None,
         max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
         per_layer: bool = False, per_device: bool = False,
         compile: bool = False, optimizer: Any = None) -> Plan:
  """The policy with the least recompute that fits ``budget``.

  Args:
    fn: returns a scalar loss; its remat regions built with ``policy=None``
      take the candidate policies.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).
    budget: device bytes, as an int or a string such as ``"8GiB"``, for what
      ``bounds`` says. Parameters, gradients and optimizer state are not
      included (see :func:`rt.memory_breakdown`), but with
      ``bounds="peak"``, where parameters and gradients are (and, with
      ``optimizer``, the optimizer state).
    bounds: what ``budget`` bounds: ``"kept activations"`` (the activations
      kept for the backward pass; the default without ``groups``),
      ``"estimated peak"`` (kept activations plus one region's internals
      while it is recomputed; the default with ``groups``) or ``"peak"``
      (the training step's predicted peak, as :func:`rt.peak` predicts it
      for ``jax.jit(jax.grad(fn))``: parameters, inputs, gradients and
      everything live at its worst moment, so here the budget *includes*
      parameters and gradients; the optimizer state too with
      ``optimizer``, which bounds the optax train step). The plan's
      text and :attr:`Plan.bounds` say which. With ``"peak"`` the search
      bisects the kept-bytes limit: each limit's least-recompute plan is
      found as for ``"kept activations"`` and its step's peak predicted
      (once per plan), and the largest limit whose plan's peak fits wins;
      the named policies compete as they are, since the peak only roughly
      grows with the kept bytes. The result is then the least recompute
      found, not proven (:attr:`Plan.optimal` is False), and
      :attr:`Plan.peak_bytes` is its predicted peak. With ``groups``, every
      layout is planned so and the least recompute wins.
    allow_offload: also consider moving names to host memory (refused where
      offloading cannot run, e.g. under a ``jax_remat3`` that ignores it).
    host_budget: host bytes offloading may use (default: unlimited).
    host_bandwidth: bytes/s each way between device and host, to cost
      transfers.
    device_flops: FLOP/s, to convert transfer seconds into FLOP-equivalents.
    groups: other layouts of the same model, by group size (blocks per remat
      region): a mapping ``group -> (fn, args)`` or a callable
      ``group -> (fn, args)``. Every layout, ``fn`` itself included as "as
      given", is planned for its estimated peak, and the plan takes the
      layout with the least recompute.
    group_sizes: the sizes passed to a callable ``groups`` (default
      :data:`DEFAULT_GROUP_SIZES`); a size the callable rejects with
      ``ValueError`` is reported and skipped.
    max_evaluations: analyzer evaluations the repair and proof may take
      (the named policies and one measurement per name come on top); past
      it the best plan measured is returned with ``optimal=False``.
    per_layer: choose a policy for each remat region rather than one for
      all: an exact multiple-choice knapsack over measured per-region
      candidates, the result measured on the whole program (see
      :mod:`~remat_toolkit._src.planning.per_region`). The plan's policy is a
      per-region :class:`Policy`; :attr:`Plan.regions` lists each region's
      choice. Regions inside one ``scan`` are one region. Never more
      recompute than the best uniform choice among the candidates.
    per_device: ``budget`` bounds what one device holds of sharded
      arguments' activations (their largest shards), not the total; every
      figure the plan compares is then per device, and its text says by
      which method they were found. The arguments must carry shardings
      (``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec))``);
      ``mesh`` may be a ``jax.sharding.AbstractMesh`` of any size: with
      ``Explicit`` axes the shardings are read off the trace, with ``Auto``
      axes the program is compiled for ``mesh.size`` simulated CPU devices
      in a subprocess (see :mod:`~remat_toolkit._src.analysis.sharding`).
      ``host_budget`` and offloaded bytes stay totals over all devices.
      Not with ``bounds="peak"`` (yet).
    compile: with ``bounds="peak"``, also compile the chosen plan's step
      (on this machine's backend) and, while XLA's figure (``argument +
      output + temp - alias`` of ``memory_analysis()``) is over ``budget``,
      bisect the kept limit below it again with XLA's figure as the test:
      the plan returned never has an XLA figure over the budget
      (:attr:`Plan.xla_peak_bytes`). Each test compiles a step.
    optimizer: with ``bounds="peak"``, bound the optax train step's peak
      instead of ``jax.grad``'s: the optimizer state and the update
      included, parameters and state donated (a name, e.g. ``"adamw"``, or
      an optax ``GradientTransformation``; as :func:`rt.peak` takes it).

  Returns:
    A :class:`Plan`; its ``warnings`` (each raised once as a ``UserWarning``)
    say what limited the search.

  Raises:
    ValueError: a budget below the least any policy keeps (the message says
      how much that is), a malformed size, ``fn`` without remat regions,
      offloading where it cannot run, ``bounds='kept activations'`` with
      ``groups``, ``per_device=True`` with unsharded arguments or with
      ``bounds='peak'``, ``compile=True`` or ``optimizer`` without
      ``bounds='peak'``, an unknown optimizer name, or a first argument
      without a floating-point leaf with ``bounds='peak'``.
    TypeError: malformed ``groups``; ``per_layer``, ``per_device`` or
      ``compile`` not a bool.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
    >>> args = (jax.ShapeDtypeStruct((16, 64), jnp.float32),
    ...         jax.ShapeDtypeStruct((8, 16), jnp.float32))
    >>> p = rt.plan(lambda w, x: block(w, x).sum(), *args, budget="2KiB")
    >>> p.decisions, p.bounds, p.optimal
    ({'ffn.up': 'save'}, 'kept activations', True)

    The step's peak bounded instead (parameters and gradients included):

    >>> q = rt.plan(lambda w, x: block(w, x).sum(), *args, budget="64KiB",
    ...             bounds="peak")
    >>> q.bounds, q.peak_bytes <= 64 * 1024
    ('peak', True)

    A budget per device, for a 64 x 4 mesh this machine does not have (an
    ``AbstractMesh`` of ``Explicit`` axes: the shardings are traced):

    >>> from jax.sharding import AbstractMesh, AxisType, NamedSharding
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = AbstractMesh((64, 4), ("data", "model"),
    ...                     axis_types=(AxisType.Explicit,) * 2)
    >>> def sharded(shape, *spec):
    ...   return jax.ShapeDtypeStruct(shape, jnp.float32,
    ...                               sharding=NamedSharding(mesh, P(*spec)))
    >>> @rt.remat
    ... def mlp(w1, w2, x):
    ...   h = jnp.tanh(rt.tag(x @ w1, "ffn.up"))  # sharded P("data", "model")
    ...   return jnp.matmul(h, w2, out_sharding=P("data", None))
    >>> p = rt.plan(lambda w1, w2, x: mlp(w1, w2, x).sum(),
    ...             sharded((64, 256), None, "model"),
    ...             sharded((256, 64), "model", None),
    ...             sharded((1024, 64), "data", None),
    ...             budget="4KiB", per_device=True)
    >>> p.decisions, p.activation_bytes_per_device, p.activation_bytes
    ({'ffn.up': 'save'}, 4096, 1048576)
    >>> p.devices, p.per_device_method
    (256, 'traced shardings')
  """
  limit = parse_bytes(budget)
  bounds = plan_bounds(bounds, groups)
  check_rates(allow_offload, host_bandwidth, device_flops)
  check_search(allow_offload, host_budget, max_evaluations)
  check_per_device(per_device)
  check_flag("per_layer", per_layer)
  check_peak_options(bounds, compile, per_device, optimizer)
  rates = dict(allow_offload=allow_offload, host_bandwidth=host_bandwidth,
               device_flops=device_flops, per_device=per_device,
               optimizer=optimizer)
  search: dict[str, Any] = dict(
      host_budget=host_budget, max_evaluations=max_evaluations,
      per_layer=per_layer, bounds=bounds, compile=compile)
  if groups is None:
    result = Planner(fn, *args, **rates).plan(limit, **search)
  else:
    candidates = [(None, lambda: (fn, args))] + layouts(groups, group_sizes)
    result = plan_groups(candidates, limit,
                         lambda f, *a: Planner(f, *a, **rates), search)
  warn_once(result.warnings)
  return result
