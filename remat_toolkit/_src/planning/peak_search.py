"""Plans bounded by the training step's peak (``bounds="peak"``).

The budget bounds the training step's predicted peak
(:func:`remat_toolkit.peak` on the planner's trace, no re-tracing), which
does not add up over names. The kept-bytes limit is bisected instead
(:func:`~remat_toolkit._src.planning.search.largest_fitting`): each limit's
plan is the planner's search for kept activations, its step's peak is
predicted once per plan, and the largest limit whose plan fits wins, against
the named policies that fit as they are; with ``compile=True`` XLA's figure
of the winner must fit too.

:class:`StepPeaks` predicts (and compiles) the step under each policy, once;
:func:`search_peak` is the bisection, for uniform plans
(:class:`~remat_toolkit._src.planning.planner.Planner`) and per-region ones
(:mod:`~remat_toolkit._src.planning.region_plans`) alike.

Example:
  >>> from remat_toolkit._src.planning.peak_search import cached_solve
  >>> calls = []
  >>> def solve(limit):  # the plan keeping the most bytes <= limit
  ...   calls.append(limit)
  ...   return limit - limit % 10
  >>> cached = cached_solve(solve, lambda kept: kept)
  >>> cached(25), cached(22), cached(31), calls
  (20, 20, 30, [25, 31])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar
from typing import cast

from remat_toolkit._src.analysis.peak import StepBuilder
from remat_toolkit._src.analysis.peak import program_peak
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.planning.search import largest_fitting
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.peak import Peak

__all__ = ["StepPeaks", "search_peak", "cached_solve"]

# A candidate plan of the peak search: an Outcome (uniform) or a measured
# per-region mix.
_Found = TypeVar("_Found")


class StepPeaks:
  """The training step's :class:`Peak` under each policy, on one trace.

  The step (``jax.grad`` of the first argument, or the optax train step
  with an optimizer) is built when first asked for; each policy's peak is
  predicted once, and compiled once when asked to.

  Args:
    program: the planner's trace.
    num_params: leaves of the first argument (the parameters).
    optimizer: the resolved optax optimizer, or None for ``jax.grad``.
  """

  def __init__(self, program: TracedProgram, num_params: int,
               optimizer: Any = None):
    self._program = program
    self._num_params = num_params
    self._optimizer = optimizer
    self._step: StepBuilder | None = None
    self._predicted: dict[Policy, Peak] = {}
    self._compiled: dict[Policy, Peak] = {}
    self._labels: dict[Policy, str] = {}

  def __call__(self, policy: Policy, outcome: Outcome, label: str = "",
               compile: bool = False) -> Peak:
    """The :class:`Peak` of ``policy``'s training step, cached.

    Args:
      policy: what the regions that read the ambient policy take.
      outcome: its measurement (its kept bytes are the Peak's).
      label: how an error names it (default: the policy's name).
      compile: also compile the step (``xla_bytes``).
    """
    cache = self._compiled if compile else self._predicted
    found = cache.get(policy)
    if found is None:
      if self._step is None:
        self._step = StepBuilder(self._program, self._num_params,
                                 self._optimizer)
      found = cache[policy] = program_peak(
          self._step, policy, compile=compile,
          kept_bytes=outcome.report.activation_bytes)
      self._labels.setdefault(policy, label or policy.name)
      if compile:  # the compiled Peak carries the prediction too
        self._predicted.setdefault(policy, found)
    return found

  def least(self) -> int | None:
    """The least predicted step peak computed so far (None: none yet)."""
    return min((p.bytes for p in self._predicted.values()), default=None)

  def none_fits(self, budget: int, why: str) -> ValueError:
    """The error for a peak budget nothing fits, saying the least predicted
    peak (and the least XLA figure compiled); ``why`` is added after the
    budget."""
    if not self._predicted:  # no candidate within the host budget to predict
      return ValueError(
          f"No policy fits the peak budget of {format_bytes(budget)} "
          f"({budget} bytes){why}: none fits the host budget; raise "
          "host_budget.")
    least = min(self._predicted, key=lambda p: self._predicted[p].bytes)
    peak = self._predicted[least]
    compiled = ""
    if self._compiled:
      # Each compiled peak has XLA's figure.
      figures = {p: cast(int, k.xla_bytes) for p, k in self._compiled.items()}
      xla = min(figures, key=figures.__getitem__)
      figure = figures[xla]
      compiled = (f"; the least XLA figure compiled is {format_bytes(figure)} "
                  f"({figure} bytes, {self._labels[xla]})")
    return ValueError(
        f"No policy fits the peak budget of {format_bytes(budget)} ({budget} "
        f"bytes){why}: the least predicted peak of the training step "
        f"({peak.step}: parameters, inputs, gradients and what is live at "
        f"its worst moment) is {format_bytes(peak.bytes)} ({peak.bytes} "
        f"bytes, {self._labels[least]}){compiled}. Raise the budget to "
        "at least that, use a smaller micro-batch, larger remat groups, or "
        "(jax_remat3 off) allow_offload=True.")


def search_peak(peaks: StepPeaks, solve: Callable[[int], _Found | None],
                describe_found: Callable[[_Found], tuple[Outcome, Policy, str]],
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
    peaks: the step's peaks on the trace the candidates were measured on.
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
    return peaks(policy, outcome, label, compile=compiled)

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
  def preference(found: _Found) -> Any:
    return describe_found(found)[0].key()

  best = min(fitting, key=preference, default=None)
  if compile and best is not None and xla(best) > limit:
    # XLA's figure need not grow with the kept bytes (boundary-only keeps
    # least and can have XLA's largest peak): the bisection below the
    # winner competes with every other candidate whose prediction fits,
    # each compiled in turn, the preferred first.
    below = largest_fitting(solve, xla, kept, lo, kept(best) - 1, limit)
    rest = [c for c in fitting if c is not best] + ([below] if below else [])
    best = next((c for c in sorted(rest, key=preference) if xla(c) <= limit),
                None)
  return best


def cached_solve(solve: Callable[[int], _Found | None],
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
