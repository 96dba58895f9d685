"""The budget planner: the policy with the least recompute that fits a budget.

:func:`plan` decides, for every checkpoint name in the model (each name
selects all its instances across layers), whether to keep it on device,
offload it to host memory or recompute it, so that the activation bytes kept
for the backward pass fit ``budget`` with the least recompute. The matmul
policies (``save-matmuls``, ``save-matmuls-no-batch``) and ``save-everything``
are weighed as whole alternatives, since JAX cannot combine them with names.

Every number in a :class:`Plan` is measured by the residual analyzer on a
program traced once; none is predicted. Recompute is the analyzer's matmul
FLOPs, so recomputing elementwise work counts as free and, among choices of
equal FLOPs, the one keeping fewer bytes wins. The search has three stages:

1. Measure the named policies, the whole alternatives and each name kept on
   its own.
2. Add the per-name effects up into a model, solve it exactly (a dynamic
   programme over predicted bytes and FLOPs), and measure its best
   predictions, cheapest first, until the model predicts nothing better than
   what was measured. Names interact (keeping two tensors can spare a
   recompute that neither spares alone), so a prediction can be wrong; the
   measurement decides.
3. Repair or prove the result by a best-first branch and bound over real
   evaluations. It relies on two facts of JAX's partial evaluation: keeping
   more names never recomputes more, and a residual kept when *every*
   undecided name is kept (a name already kept, or a region input) is kept
   whatever the undecided names become. So measuring "keep every undecided
   name" gives, at once, the least recompute below a node (and its optimum,
   if it fits) and a lower bound on its bytes.

Stages 2 and 3 share ``max_evaluations``; :attr:`Plan.optimal` says whether
stage 3 finished, which proves that no choice of names and no whole
alternative recomputes less within the budget.

Offloading is costed in FLOP-equivalents: an offloaded residual crosses the
host link twice (out in the forward pass, back in the backward pass), and
``2 * bytes / host_bandwidth`` seconds is converted at ``device_flops``
FLOP/s. Transfers that overlap with compute cost less in practice, so this
errs towards recomputing.

With ``bounds="peak"`` the budget bounds the training step's predicted peak
(:func:`remat_toolkit.peak` on the same trace, no re-tracing), which does not
add up over names. The kept-bytes limit is bisected instead
(:func:`~remat_toolkit._src.planning.search.largest_fitting`): each limit's
plan is the search above, its step's peak is predicted once per plan, and
the largest limit whose plan fits wins, against the named policies that fit
as they are; with ``compile=True`` XLA's figure of the winner must fit too.

This module plans; what a choice of names means and how it is measured is
in :mod:`~remat_toolkit._src.planning.choices`, the search itself works on
numbers alone (:mod:`~remat_toolkit._src.planning.search`), the result is data
(:mod:`~remat_toolkit._src.results.planning`, rendered by
:mod:`~remat_toolkit._src.display`), per-region plans are measured by
:mod:`~remat_toolkit._src.planning.per_region` and made here, per-device figures in
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

import hashlib
import json
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar
from typing import cast

import jax

from remat_toolkit._src.analysis.breakdown import resolve_optimizer
from remat_toolkit._src.analysis.diagnose import region_warnings
from remat_toolkit._src.analysis.peak import StepBuilder
from remat_toolkit._src.analysis.peak import program_peak
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.core import compat
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.core.format import parse_bytes
from remat_toolkit._src.planning.choices import MODES
from remat_toolkit._src.planning.choices import OFFLOAD_MODES
from remat_toolkit._src.planning.choices import OFFLOADING
from remat_toolkit._src.planning.choices import Evaluator
from remat_toolkit._src.planning.choices import choice_label
from remat_toolkit._src.planning.choices import choice_policy
from remat_toolkit._src.planning.choices import decisions
from remat_toolkit._src.planning.choices import describe
from remat_toolkit._src.planning.choices import describe_bound
from remat_toolkit._src.planning.choices import describe_choice
from remat_toolkit._src.planning.choices import model_id
from remat_toolkit._src.planning.groups import DEFAULT_GROUP_SIZES
from remat_toolkit._src.planning.groups import GroupsLike
from remat_toolkit._src.planning.groups import layouts
from remat_toolkit._src.planning.groups import plan_groups
from remat_toolkit._src.planning.knapsack import Mix
from remat_toolkit._src.planning.per_device import check_per_device
from remat_toolkit._src.planning.per_region import Candidate
from remat_toolkit._src.planning.per_region import RegionPlanner
from remat_toolkit._src.planning.search import AdditiveModel
from remat_toolkit._src.planning.search import Choice
from remat_toolkit._src.planning.search import Limits
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.planning.search import OutOfEvaluations
from remat_toolkit._src.planning.search import Search
from remat_toolkit._src.planning.search import drop_useless
from remat_toolkit._src.planning.search import largest_fitting
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import region_inputs
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.policy import unrunnable_reason
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.peak import Peak
from remat_toolkit._src.results.planning import ESTIMATED_PEAK
from remat_toolkit._src.results.planning import KEPT_ACTIVATIONS
from remat_toolkit._src.results.planning import PEAK
from remat_toolkit._src.results.planning import GroupEstimate
from remat_toolkit._src.results.planning import NamedFit
from remat_toolkit._src.results.planning import Plan
from remat_toolkit._src.results.planning import RegionPlan
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
# Most model predictions measured before the branch and bound starts.
_MODEL_CANDIDATES = 8

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
    _check_rates(allow_offload, host_bandwidth, device_flops)
    check_per_device(per_device)
    # bounds="peak" bounds the optax train step when given one.
    self._optimizer = None if optimizer is None else resolve_optimizer(optimizer)
    program = TracedProgram(fn, args)
    self.per_device = check_per_device(per_device, program)
    if program.regions == 0:
      raise ValueError("There is nothing to plan: "
                       + region_warnings(program)[0])
    self.program = program
    self.warnings: tuple[str, ...] = tuple(
        region_warnings(program)
        + ([] if program.ambient_names else [_NO_NAMES])
        + ([Finding(program.layout.note, "note")] if program.layout.note
           else []))
    self.allow_offload = allow_offload
    self.host_bandwidth = float(host_bandwidth)
    self.device_flops = float(device_flops)
    # Measures choices and policies, cached; shared with per-region plans.
    self.evaluate = Evaluator(program, self.device_flops / self.host_bandwidth,
                              per_device)
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
    self._model: AdditiveModel | None = None
    self._regions: RegionPlanner | None = None
    # The training step's peak under each policy (bounds="peak"), predicted
    # and compiled, built on this trace when first asked for.
    self._num_params = len(jax.tree_util.tree_leaves(args[0])) if args else 0
    self._step: StepBuilder | None = None
    self._peaks: dict[Policy, Peak] = {}
    self._xla_peaks: dict[Policy, Peak] = {}
    self._peak_labels: dict[Policy, str] = {}

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
    """The :class:`Peak` of ``policy``'s training step (``jax.grad`` of the
    first argument) on this trace, cached; ``compile`` adds XLA's figure.

    Args:
      policy: what the regions that read the ambient policy take.
      outcome: its measurement (its kept bytes are the Peak's).
      label: how an error names it (default: the policy's name).
      compile: also compile the step (``xla_bytes``).
    """
    cache = self._xla_peaks if compile else self._peaks
    found = cache.get(policy)
    if found is None:
      if self._step is None:
        self._step = StepBuilder(self.program, self._num_params,
                                 self._optimizer)
      found = cache[policy] = program_peak(
          self._step, policy, compile=compile,
          kept_bytes=outcome.report.activation_bytes)
      self._peak_labels.setdefault(policy, label or policy.name)
      if compile:  # the compiled Peak carries the prediction too
        self._peaks.setdefault(policy, found)
    return found

  def least_peak(self) -> int | None:
    """The least predicted step peak computed so far (None: none yet)."""
    return min((p.bytes for p in self._peaks.values()), default=None)

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
    host = _check_search(self.allow_offload, host_budget, max_evaluations)
    _check_flag("per_layer", per_layer)
    _check_peak_options(check_bounds(bounds), compile, self.per_device)
    if bounds == PEAK:
      return self._plan_peak(limit, host, max_evaluations, per_layer, compile)
    peak = bounds == ESTIMATED_PEAK
    device = min(self.peak_limit(limit), limit) if peak else limit
    limits = Limits(device=device, host=math.inf if host is None else host)
    if per_layer:
      return plan_per_region(self, limit, limits, bounds, host)
    best, complete = self._solve(limits, max_evaluations)
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
      best, done = self._solve(Limits(device=kept, host=hosts),
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
    cached = _cached_solve(solve, lambda o: o.device_bytes)
    best = self.search_peak(
        cached,
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

  def search_peak(self, solve: Callable[[int], _Found | None],
                  describe_found: Callable[[_Found], tuple[Outcome, Policy,
                                                           str]],
                  lo: int, hi: int, limit: int, compile: bool,
                  others: Sequence[_Found] = ()) -> _Found | None:
    """The least-recompute candidate whose step peak fits ``limit``.

    ``solve(kept)`` is the least-recompute plan keeping at most ``kept``
    bytes; :func:`~remat_toolkit._src.planning.search.largest_fitting`
    bisects the kept limit in ``[lo, hi]`` with the predicted peak as the
    test, and ``others`` (the named policies) compete with its result. With
    ``compile``, the winner is compiled; while XLA's figure is over
    ``limit`` the kept limit is bisected again below it with XLA's figure
    as the test, so XLA's figure of what is returned fits.

    Args:
      solve: kept-bytes limit -> candidate or None.
      describe_found: candidate -> (its outcome, its policy, its label).
      lo: the least kept limit to try.
      hi: the greatest.
      limit: the peak budget.
      compile: check XLA's figure.
      others: candidates that compete as they are.
    """
    def peak(found: _Found, compiled: bool = False) -> Peak:
      outcome, policy, label = describe_found(found)
      return self.step_peak(policy, outcome, label, compile=compiled)

    def kept(found: _Found) -> int:
      return describe_found(found)[0].device_bytes

    def predicted(found: _Found) -> int:
      return peak(found).bytes

    def xla(found: _Found) -> int:
      return cast(int, peak(found, True).xla_bytes)  # compiled: XLA's figure

    best = largest_fitting(solve, predicted, kept, lo, hi, limit)
    fitting = [c for c in others if predicted(c) <= limit]
    if best is not None:
      fitting.append(best)
    best = min(fitting, key=lambda c: describe_found(c)[0].key(),
               default=None)
    if compile and best is not None and xla(best) > limit:
      best = largest_fitting(solve, xla, kept, lo, kept(best) - 1, limit)
    return best

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

  def _additive_model(self) -> AdditiveModel:
    if self._model is None:
      singles = {n: self.evaluate(Choice(save=frozenset({n})))
                 for n in self.names}
      self._model = AdditiveModel(self.boundary, singles,
                                   self.evaluate.transfer, self.allow_offload)
    return self._model

  def _solve(self, limits: Limits, max_evaluations: int
             ) -> tuple[Outcome | None, bool]:
    """The least-cost fitting outcome, and whether the search proved it.

    The additive model's predictions are measured cheapest first until the
    model predicts nothing better than what was measured (this repairs a
    prediction that interactions between names made wrong); the branch and
    bound then proves the result over real evaluations, or improves it, with
    at most ``max_evaluations`` analyzer evaluations for both stages.
    """
    search = Search(self.evaluate, self.names, limits, self.allow_offload)
    # Whatever already fits (named policies, whole alternatives) competes.
    for o in list(self.evaluate.outcomes()):
      search.offer(o)
    if search.best is None or search.best.cost > self._least_cost():
      self._search(search, limits, max_evaluations)
    # else nothing recomputes less than what already fits: no search needed.
    best = search.best
    if best is not None and not best.chosen().mode:
      best = drop_useless(self.evaluate, best, limits)
    return best, search.complete

  def _search(self, search: Search, limits: Limits,
              max_evaluations: int) -> None:
    model = self._additive_model()
    self.evaluate.limit = self.evaluate.evaluations + max_evaluations
    try:
      for predicted, choice in model.ranked(limits, _MODEL_CANDIDATES):
        if search.best is not None and predicted >= search.best.cost:
          break
        search.offer(self.evaluate(choice))
      search.run()
    except OutOfEvaluations:
      search.complete = False
    finally:
      self.evaluate.limit = None

  def _least_cost(self) -> float:
    # Keeping every name (or a whole alternative) recomputes the least.
    return min(o.cost for o in [self._every_name, *self._whole.values()])

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
      return self._no_peak_fits(budget, why)
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

  def _no_peak_fits(self, budget: int, why: str) -> ValueError:
    if not self._peaks:  # no candidate within the host budget to predict
      return ValueError(
          f"No policy fits the peak budget of {format_bytes(budget)} "
          f"({budget} bytes){why}: none fits the host budget; raise "
          "host_budget.")
    least = min(self._peaks, key=lambda p: self._peaks[p].bytes)
    peak = self._peaks[least]
    compiled = ""
    if self._xla_peaks:
      # Each compiled peak has XLA's figure.
      figures = {p: cast(int, k.xla_bytes) for p, k in self._xla_peaks.items()}
      xla = min(figures, key=figures.__getitem__)
      figure = figures[xla]
      compiled = (f"; the least XLA figure compiled is {format_bytes(figure)} "
                  f"({figure} bytes, {self._peak_labels[xla]})")
    return ValueError(
        f"No policy fits the peak budget of {format_bytes(budget)} ({budget} "
        f"bytes){why}: the least predicted peak of the training step "
        f"({peak.step}: parameters, inputs, gradients and what is live at "
        f"its worst moment) is {format_bytes(peak.bytes)} ({peak.bytes} "
        f"bytes, {self._peak_labels[least]}){compiled}. Raise the budget to "
        "at least that, use a smaller micro-batch, larger remat groups, or "
        "(jax_remat3 off) allow_offload=True.")


# A candidate plan of the peak search: an Outcome (uniform) or a measured
# per-region mix.
_Found = TypeVar("_Found")


def _label(choice: Choice) -> str:
  """How an error names a choice: its mode, its names, or boundary-only."""
  return choice.mode or choice_label(choice) or "boundary-only"


def _cached_solve(solve: Callable[[int], _Found | None],
                  kept: Callable[[_Found], int]
                  ) -> Callable[[int], _Found | None]:
  """``solve`` over kept-bytes limits, remembering what each answer covers:
  the plan found at ``limit`` keeping ``k`` bytes is the plan at every limit
  in ``[k, limit]``, and nothing at ``limit`` is nothing below it."""
  known: list[tuple[float, int, Any]] = []

  def cached(limit: int) -> _Found | None:
    for low, high, found in known:
      if low <= limit <= high:
        return found
    found = solve(limit)
    known.append((-math.inf if found is None else kept(found), limit, found))
    return found

  return cached


def _check_peak_options(bounds: str, compile: Any, per_device: bool,
                        optimizer: Any = None) -> None:
  _check_flag("compile", compile)
  if optimizer is not None:
    resolve_optimizer(optimizer)  # a clear error for a bad one, first
    if bounds != PEAK:
      raise ValueError(
          f"optimizer= bounds the train step's peak; it needs bounds='peak' "
          f"(got bounds={bounds!r}): the other bounds leave the optimizer "
          "state out of the budget.")
  if compile and bounds != PEAK:
    raise ValueError(
        f"compile=True checks the plan's compiled training step against a "
        f"peak budget; it needs bounds='peak' (got bounds={bounds!r}).")
  if bounds == PEAK and per_device:
    raise ValueError(
        "bounds='peak' with per_device=True is not supported yet: the step's "
        "peak is predicted for the whole step, not per device. Plan the "
        "kept activations per device (bounds='kept activations') and check "
        "the step with rt.peak.")


def _region_executions(program: TracedProgram, everything: Outcome) -> int:
  # For a chain of identical blocks: regions in the jaxpr, times the scan
  # length their residuals are stacked over.
  stacked = max((r.stacked for r in everything.report.activations), default=1)
  return max(program.regions * stacked, 1)


def _check_flag(label: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"{label} must be True or False, got {value!r}.")


def _check_rates(allow_offload: Any, host_bandwidth: Any,
                 device_flops: Any) -> None:
  if not isinstance(allow_offload, bool):
    raise TypeError(f"allow_offload must be True or False, got {allow_offload!r}.")
  if allow_offload and unrunnable_reason(OFFLOADING) is not None:
    raise ValueError(
        f"allow_offload=True cannot be planned: {compat.offloading_refusal()}; "
        "or plan without offloading.")
  for label, value in (("host_bandwidth", host_bandwidth),
                       ("device_flops", device_flops)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < math.inf):
      raise ValueError(f"{label} must be a positive number, got {value!r}.")


def _check_search(allow_offload: bool, host_budget: Any,
                  max_evaluations: Any) -> int | None:
  if host_budget is not None and not allow_offload:
    raise ValueError(
        f"host_budget={host_budget!r} only matters with allow_offload=True; "
        "pass allow_offload=True or drop host_budget.")
  if (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
      or max_evaluations < 0):
    raise ValueError(
        f"max_evaluations must be a non-negative integer, got "
        f"{max_evaluations!r}.")
  return None if host_budget is None else parse_bytes(host_budget)



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
  _check_rates(allow_offload, host_bandwidth, device_flops)
  _check_search(allow_offload, host_budget, max_evaluations)
  check_per_device(per_device)
  _check_flag("per_layer", per_layer)
  _check_peak_options(bounds, compile, per_device, optimizer)
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


_NOT_ADDITIVE = Finding(
    "the regions' measured effects do not add up to the whole program's "
    "(regions interact), so the per-region plan is the best of the mixes "
    "measured, not proven optimal; its figures are measured.", "not-additive")


def plan_per_region(planner: Planner, limit: int, limits: Limits, bounds: str,
                    host: int | None) -> Plan:
  """The per-region plan for one budget (what ``Planner.plan(per_layer=True)``
  returns).

  The cheapest mixes predicted to fit are measured on the whole program,
  cheapest first, until one measures as predicted (then it is the optimum
  over the candidates) or :data:`MIXES_MEASURED` were tried (then the best
  that fits is taken, marked not optimal).

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


# A measured per-region mix: its outcome, the mix, and whether it measured
# as predicted.
_Measured = tuple[Outcome, Mix, bool]


def _region_best(planner: Planner, limits: Limits) -> _Measured | None:
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


def _region_plan(planner: Planner, found: _Measured, limit: int,
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


def plan_per_region_peak(planner: Planner, limit: int, host: int | None,
                         compile: bool) -> Plan:
  """The per-region plan whose predicted step peak fits ``limit`` (what
  ``Planner.plan(per_layer=True, bounds="peak")`` returns).

  The kept-bytes limit is bisected over the exact per-region front's range
  (``Planner.search_peak``), each limit planned as
  :func:`plan_per_region` plans it; with ``compile`` the winner's XLA
  figure must fit too.

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
  cached = _cached_solve(lambda kept: _region_best(planner, Limits(kept, hosts)),
                         lambda found: found[0].device_bytes)
  best = planner.search_peak(cached, describe_found, min(devices), max(devices),
                             limit, compile)
  if best is None:
    raise planner.infeasible(limit, True, PEAK)
  peak = planner.step_peak(describe_found(best)[1], best[0], compile=compile)
  return _region_plan(
      planner, best, limit,
      planner.named_fits(Limits(device=math.inf, host=hosts), limit), PEAK,
      host, peak)


def region_policy(planner: Planner, assignment: Sequence[tuple[str, Candidate]],
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
