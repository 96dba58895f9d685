"""The largest micro-batch whose compiled training step fits a memory budget.

:func:`largest_batch` searches, per policy, the micro-batch sizes of the
benchmark's training step (:mod:`~remat_toolkit._src.bench.train_step`),
compiling each candidate and comparing XLA's memory analysis with the
budget; nothing runs. :func:`step_memory` is one such compile. The search
starts where the step's predicted peak (:mod:`~remat_toolkit._src.analysis.
peak`, traced on abstract shapes, never compiled) says the budget ends, so
the compiles only confirm and adjust.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import optax

from remat_toolkit._src.analysis.peak import StepBuilder
from remat_toolkit._src.analysis.peak import program_peak
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.bench import train_step
from remat_toolkit._src.bench.measure import policies_to_run
from remat_toolkit._src.bench.workload import DEFAULT_MODEL
from remat_toolkit._src.bench.workload import Model
from remat_toolkit._src.bench.workload import Workload
from remat_toolkit._src.bench.workload import build_options
from remat_toolkit._src.bench.workload import build_workload
from remat_toolkit._src.bench.workload import check_positive_int
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.format import parse_bytes
from remat_toolkit._src.core.progress import Deadline
from remat_toolkit._src.core.progress import Progress
from remat_toolkit._src.core.progress import one_line
from remat_toolkit._src.policies import findings
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.bench import BatchFit
from remat_toolkit._src.results.bench import BatchSearch

__all__ = ["largest_batch", "step_memory", "search_largest",
           "predicted_batch", "predicted_step_peak"]

_DEFAULT_MAX_BATCH = 4096


def step_memory(model: Model = DEFAULT_MODEL, *args: Any,
                policy: resolve.PolicyLike = resolve.SAVE_EVERYTHING,
                batch: int | None = None,
                seq: int | None = None, dtype: str | None = None,
                scan: bool | None = None, group: int | str | None = None,
                framework: str | None = None,
                optimizer: optax.GradientTransformation | str | None = None
                ) -> dict[str, int]:
  """XLA's memory figures of one compiled training step (nothing runs).

  Args:
    model: as for :func:`bench`.
    *args: ``params, batch`` for a user loss.
    policy: the policy the step is compiled under: a name, a Policy or a
      JAX policy (default: save-everything).
    batch: examples in the step (default: the model's).
    seq: built-in models only: sequence length.
    dtype: built-in models only: activation dtype.
    scan: built-in models only: scan the layers.
    group: built-in models only: blocks per remat region, or ``"sqrt"``.
    framework: built-in models only: ``"linen"`` (default) or ``"nnx"``.
    optimizer: an optax ``GradientTransformation`` or a name
      (``"adam"``, ``"sgd"``: :func:`remat_toolkit.memory_breakdown`'s);
      default ``optax.adamw(1e-3)``.

  Raises:
    ValueError: an unknown policy, or one that cannot run on this JAX.

  Returns:
    ``argument_bytes``, ``output_bytes, ``temp_bytes``, ``alias_bytes``,
    ``host_temp_bytes`` and ``peak_bytes`` (arguments + outputs + temp -
    alias).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> loss = lambda w, b: jnp.mean((b @ w) ** 2)
    >>> args = (jax.ShapeDtypeStruct((4, 4), jnp.float32),
    ...         jax.ShapeDtypeStruct((8, 4), jnp.float32))
    >>> step_memory(loss, *args, batch=16)["argument_bytes"] >= 16 * 4 * 4
    True
  """
  build = build_options(seq=seq, dtype=dtype, scan=scan, group=group,
                         framework=framework)
  workload = build_workload(model, args, batch=None, build=build,
                       optimizer=optimizer, seed=0, tokens_per_example=None,
                       abstract=True)
  size = workload.batch_size if batch is None else batch
  check_positive_int("batch", size)
  policy = resolve.require_runnable(resolve.resolve_policy(policy))
  return _step_memory(workload, policy, size)


def _step_memory(workload: Workload, policy: Policy, size: int) -> dict[str, int]:
  compiled, _ = train_step.compile_step(workload, policy, 1, workload.resized(size))
  return train_step.memory_figures(compiled)


def _affine_crossing(a: tuple[int, int], b: tuple[int, int], budget: int
                     ) -> int | None:
  """The largest size under ``budget`` on the line through two probes."""
  (n1, m1), (n2, m2) = sorted((a, b))
  if n2 == n1 or m2 <= m1:
    return None
  return n1 + (budget - m1) * (n2 - n1) // (m2 - m1)


def search_largest(measure: Callable[[int], int], budget: int, max_batch: int,
                   start: int | None = None
                   ) -> tuple[int, int | None, list[tuple[int, int]]]:
  """The largest size in ``[1, max_batch]`` whose bytes fit ``budget``.

  Assumes bytes grow with the size. Without ``start``, sizes at least
  double from 1 until one does not fit; a straight line through the last
  two probes (compiled memory is close to affine in the batch) lets the
  search jump to just past the predicted limit, then probe the line's
  crossing inside the bracket, with a bisection step whenever a probe did
  not halve the bracket. With ``start`` (a size expected to be the answer,
  e.g. from a predicted peak) that size is probed first, then its
  neighbour (one up if it fits, one down if not): when the guess is right,
  two probes decide. Past them the steps follow the line through the last
  two probes, at least doubling upwards and halving the distance to 1
  downwards whenever the line did not halve it, until a bracket is found
  and searched as above. Returns (largest fit or 0, smallest miss or None
  at the cap, every probe).

  Example:
    >>> measure = lambda n: 1000 + 37 * n
    >>> good, bad, tries = search_largest(measure, 1000 + 37 * 300, 4096,
    ...                                   start=300)
    >>> good, bad, [n for n, _ in tries]
    (300, 301, [300, 301])
  """
  tries: list[tuple[int, int]] = []

  def fits(size: int) -> bool:
    tries.append((size, measure(size)))
    return tries[-1][1] <= budget

  good, bad = 0, None
  size = 1 if start is None else min(max(start, 1), max_batch)
  halved = True
  while True:
    width = None if bad is None else bad - good
    if fits(size):
      good = size
    else:
      bad = size
    if (bad is None and good >= max_batch) or (
        bad is not None and bad - good <= 1):
      return good, bad, tries
    if width is not None:
      halved = 2 * (bad - good) <= width
    if bad is None:
      size = _grow(tries, good, budget, max_batch, start is not None)
    elif not good:
      size = _shrink(tries, bad, budget, halved)
    else:
      measured = dict(tries)
      guess = _affine_crossing((good, measured[good]), (bad, measured[bad]),
                               budget)
      size = guess if halved and guess is not None else (good + bad) // 2
      size = min(max(size, good + 1), bad - 1)


def _grow(tries: list[tuple[int, int]], good: int, budget: int,
          max_batch: int, started: bool) -> int:
  """The next size while every probe fits (``good`` the largest)."""
  fitted = [t for t in tries if t[1] <= budget]
  guess = (_affine_crossing(fitted[-2], fitted[-1], budget)
           if len(fitted) > 1 else None)
  if not started:
    size = max(2 * good, (guess or 0) + 1)
  elif len(fitted) == 1:
    size = good + 1  # the start fits: is it the limit?
  else:
    # Past the line's crossing, and at least twice the last step, so a
    # line too steep to trust costs a few probes, not one per size.
    step = good - fitted[-2][0]
    size = max((guess or good) + 1, good + 2 * step)
  return min(max_batch, max(size, good + 1))


def _shrink(tries: list[tuple[int, int]], bad: int, budget: int,
            halved: bool) -> int:
  """The next size while no probe fits (``bad`` the smallest tried)."""
  over = sorted(t for t in tries if t[1] > budget)
  if len(over) == 1:
    size = bad - 1  # the start does not fit: is the one below the limit?
  else:
    # The line through the start and its neighbour is trusted once; past
    # that, only while it at least halves the distance to 1.
    guess = _affine_crossing(over[0], over[1], budget)
    trusted = halved or len(over) == 2
    size = guess if trusted and guess is not None else bad // 2
  return min(max(size, 1), bad - 1)


def largest_batch(model: Model = DEFAULT_MODEL, *args: Any,
                  budget: int | str,
                  policies: Sequence[resolve.PolicyLike] | None = None,
                  seq: int | None = None, dtype: str | None = None,
                  scan: bool | None = None, group: int | str | None = None,
                  framework: str | None = None,
                  max_batch: int = _DEFAULT_MAX_BATCH,
                  optimizer: optax.GradientTransformation | str | None = None,
                  time_limit_s: float | None = None,
                  progress: bool = True) -> BatchSearch:
  """Per policy, the largest micro-batch whose compiled step fits ``budget``.

  Each candidate is compiled, never run: the training step (as in
  :func:`bench`, one micro-batch, no accumulation) is lowered with a batch
  of that many examples and its ``argument + output + temp - alias`` bytes
  (XLA ``memory_analysis``) are compared with ``budget``. The first size
  compiled is the largest whose *predicted* peak fits (the step traced on
  abstract shapes at two or three sizes, never compiled; see
  :func:`remat_toolkit.peak`), then its neighbour: when the prediction is
  right, two compiles decide. Otherwise the search steps along a straight
  line through the last two compiles (memory is close to affine in the
  batch) until one size fits and the next does not, or ``max_batch`` is
  reached; the compiled figures alone decide, and ``tries`` lists every
  compile. Where the step cannot be predicted, sizes double from 1.

  Args:
    model: as for :func:`bench`; a user batch's leaves are resized on their
      leading axis.
    *args: ``params, batch`` for a user loss (``jax.ShapeDtypeStruct`` is
      enough: nothing is allocated).
    budget: bytes, or a size such as ``"2GiB"``.
    policies: names, Policies or JAX policies (``save-everything`` is
      added). Default: ``bench.DEFAULT_POLICIES``.
    seq: built-in models only: sequence length.
    dtype: built-in models only: activation dtype.
    scan: built-in models only: scan the layers.
    group: built-in models only: blocks per remat region, or ``"sqrt"``.
    framework: built-in models only: ``"linen"`` (default) or ``"nnx"``.
    max_batch: the largest size tried.
    optimizer: an optax ``GradientTransformation`` or a name
      (``"adam"``, ``"sgd"``: :func:`remat_toolkit.memory_breakdown`'s);
      default ``optax.adamw(1e-3)``.
    time_limit_s: start no further policy's search once this many seconds
      have passed (the baseline's always runs); the rest are listed in
      ``skipped``. Default: no limit.
    progress: print progress lines on stderr.

  Returns:
    A :class:`BatchSearch`.

  Raises:
    ValueError: a budget that is not a size, an unknown policy, or
      ``max_batch < 1``. A policy that cannot run on this JAX (offloading
      under ``jax_remat3``) is listed in ``skipped`` and warned about
      instead.
    TypeError: a model or argument of the wrong kind, or ``progress`` not
      True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> loss = lambda w, b: jnp.mean((b @ w) ** 2)
    >>> args = (jax.ShapeDtypeStruct((4, 4), jnp.float32),
    ...         jax.ShapeDtypeStruct((1, 4), jnp.float32))
    >>> search = rt.largest_batch(loss, *args, budget="2KiB", max_batch=64,
    ...                           policies=[], progress=False)
    >>> fit = search.fits["save-everything"]
    >>> fit.bytes <= 2048 < fit.over_bytes
    True
  """
  budget_bytes = parse_bytes(budget)
  check_positive_int("max_batch", max_batch)
  check_flag("progress", progress)
  deadline = Deadline(time_limit_s)
  chosen = policies_to_run(policies)
  build = build_options(seq=seq, dtype=dtype, scan=scan, group=group,
                        framework=framework)
  workload = build_workload(model, args, batch=None, build=build,
                            optimizer=optimizer, seed=0,
                            tokens_per_example=None, abstract=True)
  runnable, unrunnable = resolve.split_runnable(chosen)
  skipped = dict(unrunnable)
  fits = _fit_all(workload, runnable, budget_bytes, max_batch,
                  deadline=deadline, skipped=skipped, progress=progress)
  search = BatchSearch(fits=fits, budget_bytes=budget_bytes,
                       figure=train_step.MEMORY_FIGURE,
                       model=workload.description,
                       backend=jax.default_backend(),
                       xla_flags=os.environ.get("XLA_FLAGS", ""),
                       max_batch=max_batch, skipped=skipped)
  # A policy that cannot run here is listed in ``skipped`` and raised once.
  findings.warn_once(unrunnable.values())
  return search


def _fit_all(workload: Workload, policies: Sequence[Policy], budget: int,
             max_batch: int, *, deadline: Deadline, skipped: dict[str, str],
             progress: bool) -> dict[str, BatchFit]:
  """Each policy's fit, in order; a failure (but the baseline's) is skipped."""
  tracker = Progress(len(policies), progress)
  fits: dict[str, BatchFit] = {}
  try:
    for i, policy in enumerate(policies):
      if i and deadline.expired():
        skipped[policy.name] = deadline.reason
        continue
      tracker.start(policy.name, "searching...")
      try:
        fits[policy.name] = _fit_policy(workload, policy, budget, max_batch,
                                        tracker)
      except Exception as e:  # noqa: BLE001 - one policy must not sink the run
        if not i:
          raise
        skipped[policy.name] = f"failed to compile: {one_line(e)}"
  finally:
    tracker.close()
  return fits


def _fit_policy(workload: Workload, policy: Policy, budget: int,
                max_batch: int, tracker: Progress) -> BatchFit:
  def measure(size: int) -> int:
    tracker.update(policy.name, f"compiling micro-batch {size}", detail=True)
    return _step_memory(workload, policy, size)["peak_bytes"]

  def predict(size: int) -> int:
    tracker.update(policy.name, f"predicting micro-batch {size}", detail=True)
    return predicted_step_peak(workload, policy, size)

  good, bad, tries = search_largest(
      measure, budget, max_batch,
      start=predicted_batch(predict, budget, max_batch))
  measured = dict(tries)
  return BatchFit(policy=policy.name, batch=good,
                  bytes=measured.get(good), over_batch=bad,
                  over_bytes=None if bad is None else measured[bad],
                  hit_cap=bad is None, tries=tuple(tries))


def predicted_step_peak(workload: Workload, policy: Policy, size: int) -> int:
  """The predicted peak of the benchmark's training step with ``size``
  examples (traced on abstract shapes, not compiled).

  It models the step :func:`step_memory` compiles: the gradient of the
  loss, the optimizer's update, parameters and optimizer state donated
  (the loss value it also returns is a scalar, left out).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import remat_toolkit as rt
    >>> from remat_toolkit._src.bench.workload import Workload
    >>> w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    >>> b = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    >>> work = Workload(lambda w, b: jnp.mean((b @ w) ** 2), w, b,
    ...                 optax.sgd(0.1), "example", 1)
    >>> policy = rt.get_policy("boundary-only")
    >>> small, large = (predicted_step_peak(work, policy, n) for n in (1, 256))
    >>> small >= 2 * 64 * 64 * 4 and large > small   # w and its update
    True
  """
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        workload.params)
  program = TracedProgram(workload.loss_fn, (params, workload.resized(size)))
  step = StepBuilder(program, len(jax.tree_util.tree_leaves(params)),
                     (workload.optimizer, "the benchmark's optimizer"))
  # kept_bytes only labels the result; measuring it would cost an analysis.
  return program_peak(step, policy, kept_bytes=0).bytes


def predicted_batch(predict: Callable[[int], int], budget: int,
                    max_batch: int) -> int | None:
  """Where the compiled search starts: the largest size whose predicted
  peak fits ``budget``, from at most three predictions (None when the
  step cannot be predicted: the search then starts at 1).

  The peak is close to affine in the batch, so the sizes 1 and
  ``max_batch`` give a line, its crossing of the budget a guess, and the
  prediction there a second line on the side the guess fell, whose crossing
  is the start. The compiled figures decide the answer; this only saves
  compiles.

  Example:
    >>> predicted_batch(lambda n: 1000 + 37 * n, 1000 + 37 * 300, 4096)
    300
  """
  try:
    low = predict(1)
    if low > budget or max_batch == 1:
      return 1
    high = predict(max_batch)
    if high <= budget:
      return max_batch
    guess = _affine_crossing((1, low), (max_batch, high), budget)
    if guess is None:
      return None
    guess = min(max(guess, 1), max_batch - 1)
    if guess == 1:
      return 1
    middle = predict(guess)
    line = ((guess, middle), (max_batch, high)) if middle <= budget else (
        (1, low), (guess, middle))
    refined = _affine_crossing(*line, budget)
  except Exception:  # noqa: BLE001 - a guess that fails only costs compiles
    return None
  if refined is None:
    return guess if middle <= budget else max(guess - 1, 1)
  return min(max(refined, 1), max_batch)
