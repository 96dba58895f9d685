"""Benchmarks of a real training step under each remat policy.

Static analysis says what a policy keeps; only a real step says what it costs
on this machine. :func:`bench` compiles and runs a training step (optax AdamW
by default, ``jax.jit``, the train state donated) of a built-in model or of
your own loss under each policy, and reports compile time, step time, tokens
per second and memory, each relative to ``save-everything`` from the same run.
The step is in :mod:`~remat_toolkit._src.bench.train_step`, what it trains in
:mod:`~remat_toolkit._src.bench.workload`, and the largest-batch search in
:mod:`~remat_toolkit._src.bench.batch_search`; results are printed by
:mod:`~remat_toolkit._src.display`.

Memory figures:
  * ``peak_bytes``, the per-policy figure: what the compiled step needs,
    arguments + outputs + temporaries - donated (aliased) buffers, from XLA's
    ``compiled.memory_analysis()``. It is a property of the compiled program,
    so one run can hold it for many policies.
  * measured high-water marks: on GPU/TPU ``device.memory_stats()``
    (``peak_bytes_in_use``, ``bytes_reserved``), and the host process's peak
    RSS (``resource.getrusage``). Both are process-wide and cannot be reset,
    so the policies run in ascending order of ``peak_bytes``, and a record's
    ``measured_peak_is_own`` says whether the mark rose during its own run.
    Compilation (all policies compile before any runs) counts too.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import optax

from remat_toolkit._src.analysis import report
from remat_toolkit._src.analysis import trace
from remat_toolkit._src.bench import train_step
from remat_toolkit._src.bench.workload import DEFAULT_MODEL
from remat_toolkit._src.bench.workload import Model
from remat_toolkit._src.bench.workload import Workload
from remat_toolkit._src.bench.workload import build_options
from remat_toolkit._src.bench.workload import build_workload
from remat_toolkit._src.bench.workload import check_divides
from remat_toolkit._src.bench.workload import check_positive_int
from remat_toolkit._src.bench.workload import grad_accum_values
from remat_toolkit._src.core import compat
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.progress import Deadline
from remat_toolkit._src.core.progress import Progress
from remat_toolkit._src.core.progress import one_line
from remat_toolkit._src.policies import findings
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.bench import BenchRecord
from remat_toolkit._src.results.bench import BenchResult

__all__ = ["bench", "DEFAULT_MODEL", "DEFAULT_POLICIES", "DEFAULT_STEPS",
           "DEFAULT_WARMUP", "BASELINE", "policies_to_run"]

#: Every figure is relative to this policy (:data:`resolve.SAVE_EVERYTHING`),
#: run in the same call.
BASELINE = resolve.SAVE_EVERYTHING.name
#: Policies of a run that names none: the two extremes and selective
#: recomputation (each compile takes seconds on a CPU, and the default run
#: must stay under a minute on two cores).
DEFAULT_POLICIES: tuple[str, ...] = (
    "save-everything", "boundary-only", "recompute-attention-core")
#: Timed steps per policy, and untimed steps before them.
DEFAULT_STEPS = 5
DEFAULT_WARMUP = 2


# ================================================================ policies

def policies_to_run(policies: Sequence[resolve.PolicyLike] | None
                    ) -> list[Policy]:
  """The baseline, then ``policies`` (default :data:`DEFAULT_POLICIES`).

  An empty list runs the baseline alone; repeats are dropped.

  Raises:
    TypeError: a single policy instead of a list, or something not a policy.
    ValueError: an unknown policy name.
  """
  if isinstance(policies, Sequence) and not isinstance(policies, str) and not policies:
    return [resolve.SAVE_EVERYTHING]
  chosen = resolve.resolve_policies(policies, default=DEFAULT_POLICIES)
  return resolve.resolve_policies([resolve.SAVE_EVERYTHING, *chosen])


# ================================================================ records


def _ratio(value: float | None, base: float | None) -> float | None:
  if value is None or not base:
    return None
  return value / base


def _with_relative(record: BenchRecord, base: BenchRecord) -> BenchRecord:
  return dataclasses.replace(
      record,
      relative_step_time=_ratio(record.step_time_s, base.step_time_s),
      relative_tokens_per_s=_ratio(record.tokens_per_s, base.tokens_per_s),
      relative_peak_bytes=_ratio(record.peak_bytes, base.peak_bytes),
      relative_compile_time=_ratio(record.compile_time_s, base.compile_time_s),
      relative_device_peak_bytes=_ratio(record.device_peak_bytes,
                                        base.device_peak_bytes),
      is_baseline=record is base)


# ================================================================ running

def bench(model: Model = DEFAULT_MODEL, *args: Any,
          policies: Sequence[resolve.PolicyLike] | None = None,
          batch: int | None = None, seq: int | None = None,
          dtype: str | None = None, scan: bool | None = None,
          group: int | str | None = None, framework: str | None = None,
          steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
          grad_accum: int | Sequence[int] = 1,
          optimizer: optax.GradientTransformation | str | None = None,
          tokens_per_example: int | None = None, seed: int = 0,
          time_limit_s: float | None = None,
          progress: bool = True) -> BenchResult:
  """Compiles and runs a training step under each policy and measures it.

  Every policy's step is compiled first (timed), then the steps run in
  ascending order of compiled memory: ``warmup`` untimed steps, then
  ``steps`` timed ones, each waited for with ``block_until_ready``. Each run
  starts from the same parameters and a fresh optimizer state.

  Args:
    model: a built-in config name (``"tiny"``, ``"gpt2-small"``, ...) or
      ``GPTConfig``; a ``loss_fn(params, batch)`` followed by ``params`` and
      ``batch`` in ``args``; or a ``(loss_fn, (params, batch))`` pair. The
      loss's remat regions must read the ambient policy (``policy=None``).
    *args: ``params, batch`` for a user loss.
    policies: names, Policies or JAX policies; ``save-everything`` is added
      as the baseline. Default: :data:`DEFAULT_POLICIES`. One that cannot
      run on this JAX (offloading under ``jax_remat3``) is listed in
      ``skipped`` and warned about.
    batch: built-in models only: examples per optimizer update (default:
      the config's batch size times the lcm of ``grad_accum``).
    seq: built-in models only: sequence length.
    dtype: built-in models only: activation dtype, e.g. ``"bfloat16"``.
    scan: built-in models only: scan the layers (default: the config's).
    group: built-in models only: blocks per remat region, or ``"sqrt"``.
    framework: built-in models only: ``"linen"`` (default) or ``"nnx"``.
    steps: timed steps per policy (the median is reported).
    warmup: untimed steps before them.
    grad_accum: micro-batches per update, or several values to compare
      (each runs every policy on the same global batch).
    optimizer: an optax ``GradientTransformation`` or a name
      (``"adam"``, ``"sgd"``: :func:`remat_toolkit.memory_breakdown`'s);
      default ``optax.adamw(1e-3)``.
    tokens_per_example: user models: tokens in one example (default: axis 1
      of the first integer ``[batch, seq]`` leaf, else 1).
    seed: seeds a built-in model's parameters and tokens.
    time_limit_s: compile no further policy once this many seconds have
      passed (the baseline always runs); the rest are listed in
      ``skipped``. Default: no limit.
    progress: print ``[i/n] policy: ...`` lines on stderr.

  Returns:
    A :class:`BenchResult`; its ``warnings`` (each raised once as a
    ``UserWarning``) come from one trace of the loss by the analyzer.

  Raises:
    ValueError: an unknown policy, ``steps < 1``, ``warmup < 0``, a batch
      that ``grad_accum`` does not divide, or options that do not apply.
    TypeError: a model or argument of the wrong kind, or ``progress`` not
      True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def layer(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, batch: jnp.mean(layer(w, batch["x"]) ** 2)
    >>> w, batch = jnp.ones((4, 4)) / 4, {"x": jnp.ones((8, 4))}
    >>> result = rt.bench(loss, w, batch, policies=["boundary-only"], steps=1,
    ...                   warmup=0, progress=False)
    >>> [r.policy for r in result.records]
    ['save-everything', 'boundary-only']
    >>> result.record("save-everything").relative_step_time
    1.0
  """
  check_positive_int("steps", steps)
  check_positive_int("warmup", warmup, minimum=0)
  check_flag("progress", progress)
  deadline = Deadline(time_limit_s)
  accums = grad_accum_values(grad_accum)
  chosen = policies_to_run(policies)
  build = build_options(seq=seq, dtype=dtype, scan=scan, group=group,
                        framework=framework)
  workload = build_workload(model, args, batch=batch, build=build,
                            optimizer=optimizer, seed=seed,
                            tokens_per_example=tokens_per_example,
                            default_batch=lambda b: b * math.lcm(*accums))
  check_divides(workload.batch_size, accums)
  runnable, unrunnable = resolve.split_runnable(chosen)
  skipped = dict(unrunnable)
  notes, silent = _policy_findings(workload, runnable)
  records = _compile_and_run(workload, runnable, accums, steps=steps,
                             warmup=warmup, deadline=deadline, skipped=skipped,
                             silent=silent, progress=progress)
  result = BenchResult(
      records=tuple(_with_relative(r, records[0]) for r in records),
      model=workload.description, steps=steps, warmup=warmup,
      backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      jax_remat3=compat.remat3_enabled(), skipped=skipped,
      load_average=_load_average(), warnings=tuple(notes))
  # A policy that cannot run here is listed in ``skipped`` and raised once.
  findings.warn_once([*unrunnable.values(), *result.warnings])
  return result


def _compile_and_run(workload: Workload, policies: Sequence[Policy],
                     accums: Sequence[int], *, steps: int, warmup: int,
                     deadline: Deadline, skipped: dict[str, str],
                     silent: frozenset[str], progress: bool
                     ) -> list[BenchRecord]:
  """Every (policy, grad_accum) compiled, then run; failures go to ``skipped``."""
  plan = [(p, k) for k in accums for p in policies]
  tracker = Progress(2 * len(plan), progress)
  try:
    compiled = list(_compile_all(plan, workload, tracker, deadline, skipped,
                                 silent))
    return _run_all(compiled, workload, tracker, steps=steps, warmup=warmup,
                    skipped=skipped)
  finally:
    tracker.close()


def _policy_findings(workload: Workload, policies: Sequence[Policy]
                     ) -> tuple[list[findings.Finding], frozenset[str]]:
  """The analyzer's warnings for the run, and the policies keeping no name.

  One trace of the loss (no compile) says whether the regions take the
  policies at all, before minutes of compiling say nothing.
  """
  program = trace.TracedProgram(workload.loss_fn,
                                   (workload.params, workload.batch))
  found = report.program_findings(program).about_regions()
  silent = set()
  for policy in policies:
    # Without a measurement: what the policy selects, not what it recomputes.
    said = report.policy_findings(program, policy)
    found.extend(said.selection)
    if said.keeps_none:
      silent.add(policy.name)
  return found, frozenset(silent)


def _compile_all(plan: Sequence[tuple[Policy, int]], workload: Workload,
                 tracker: Progress, deadline: Deadline,
                 skipped: dict[str, str],
                 silent: frozenset[str] = frozenset()) -> Iterator[_Compiled]:
  for i, (policy, accum) in enumerate(plan):
    item = _Compiled(policy, accum, None, 0.0, {})
    if i and deadline.expired():
      skipped[_label(item)] = deadline.reason
      tracker.total -= 2
      continue
    tracker.start(_label(item), "compiling...")
    try:
      # The result raises a policy's absent names once; tracing would again.
      with findings.quiet(policy.name in silent):
        item.executable, item.compile_time_s = train_step.compile_step(
            workload, policy, accum, workload.batch)
    except Exception as e:  # noqa: BLE001 - one policy must not sink the run
      if not i:
        raise
      skipped[_label(item)] = f"failed to compile: {one_line(e)}"
      tracker.total -= 1
      continue
    item.memory = train_step.memory_figures(item.executable)
    yield item


def _run_all(compiled: Sequence[_Compiled], workload: Workload,
             tracker: Progress, *, steps: int, warmup: int,
             skipped: dict[str, str]) -> list[BenchRecord]:
  """Runs every compiled step; a policy that fails (e.g. out of memory) is
  listed in ``skipped``, except the baseline, whose failure is raised."""
  init_state = _state_factory(workload)
  # Ascending compiled memory, so that each rise of a process-wide
  # high-water mark most likely belongs to the policy that just ran.
  order = sorted(range(len(compiled)), key=lambda i: compiled[i].memory["peak_bytes"])
  records: dict[int, BenchRecord] = {}
  for rank, i in enumerate(order, start=1):
    tracker.start(_label(compiled[i]), "running...")
    try:
      records[i] = _run_one(compiled[i], workload, init_state, steps=steps,
                            warmup=warmup, progress=tracker, order=rank)
    except Exception as e:  # noqa: BLE001 - one policy must not sink the run
      if not i:
        raise
      skipped[_label(compiled[i])] = f"failed to run: {one_line(e)}"
  return [records[i] for i in sorted(records)]


class _DeviceMemory(NamedTuple):
  """A device's high-water marks (``memory_stats()``); not every backend
  reports what it reserved."""

  peak: int
  reserved: int | None


def _device_memory(device: Any) -> _DeviceMemory | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  reserved = stats.get("peak_bytes_reserved", stats.get("bytes_reserved"))
  return _DeviceMemory(peak=int(stats["peak_bytes_in_use"]),
                       reserved=None if reserved is None else int(reserved))


def _host_peak_rss() -> int | None:
  try:
    import resource
  except ImportError:  # Windows
    return None
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports KiB, macOS bytes.
  return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _timed_steps(compiled: Any, state: Any, batch: Any, *, steps: int,
                 warmup: int, progress: Progress, label: str
                 ) -> tuple[list[float], list[float]]:
  times, losses = [], []
  for i in range(warmup + steps):
    what = (f"warm-up {i + 1}/{warmup}" if i < warmup
            else f"step {i - warmup + 1}/{steps}")
    progress.update(label, what, detail=True)
    start = time.perf_counter()
    state, loss = compiled(state, batch)
    jax.block_until_ready((state, loss))
    elapsed = time.perf_counter() - start
    losses.append(float(loss))
    if i >= warmup:
      times.append(elapsed)
  del state
  return times, losses


@dataclasses.dataclass
class _Compiled:
  policy: Policy
  grad_accum: int
  executable: Any
  compile_time_s: float
  memory: dict[str, int]


def _run_one(item: _Compiled, workload: Workload, init_state: Callable,
             *, steps: int, warmup: int, progress: Progress, order: int
             ) -> BenchRecord:
  device = jax.devices()[0]
  before = _device_memory(device)
  rss_before = _host_peak_rss()
  state = init_state()
  batch = jax.device_put(workload.batch)
  times, losses = _timed_steps(item.executable, state, batch, steps=steps,
                               warmup=warmup, progress=progress,
                               label=_label(item))
  after = _device_memory(device)
  rss_after = _host_peak_rss()
  if after is not None and before is not None:
    own = after.peak > before.peak
  else:
    own = rss_after is not None and rss_before is not None and rss_after > rss_before
  median = statistics.median(times)
  size = workload.batch_size
  tokens = size * workload.tokens_per_example
  return BenchRecord(
      policy=item.policy.name, grad_accum=item.grad_accum,
      micro_batch=size // item.grad_accum, global_batch=size,
      tokens_per_step=tokens, compile_time_s=item.compile_time_s,
      step_time_s=median, step_time_min_s=min(times),
      step_time_max_s=max(times), tokens_per_s=tokens / median,
      peak_bytes=item.memory["peak_bytes"],
      argument_bytes=item.memory["argument_bytes"],
      output_bytes=item.memory["output_bytes"],
      temp_bytes=item.memory["temp_bytes"],
      alias_bytes=item.memory["alias_bytes"],
      host_temp_bytes=item.memory["host_temp_bytes"],
      device_peak_bytes=None if after is None else after.peak,
      device_reserved_bytes=None if after is None else after.reserved,
      host_peak_rss_bytes=rss_after, measured_peak_is_own=own,
      loss_first=losses[0], loss_last=losses[-1], run_order=order)


def _label(item: _Compiled) -> str:
  return item.policy.name + (f" (accum {item.grad_accum})"
                             if item.grad_accum > 1 else "")


def _state_factory(workload: Workload) -> Callable[[], Any]:
  # Every policy starts from the same parameters. They wait on the host so
  # that device memory between runs holds only what the next run allocates.
  host_params = jax.device_get(workload.params)
  init_opt = jax.jit(workload.optimizer.init)

  def init_state():
    params = jax.device_put(host_params)
    return params, init_opt(params)

  return init_state


def _load_average() -> float | None:
  try:
    return os.getloadavg()[0]
  except (AttributeError, OSError):  # not on Windows
    return None


