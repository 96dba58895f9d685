"""Benchmarks of a real training step under each remat policy.

Static analysis says what a policy keeps; only a real step says what it costs
on this machine. :func:`bench` compiles and runs a training step (optax AdamW
by default, ``jax.jit``, the train state donated) of a built-in model or of
your own loss under each policy, and reports compile time, step time, tokens
per second and memory, each relative to ``save-everything`` from the same run.
:func:`largest_batch` finds, per policy, the largest micro-batch whose compiled
step fits a memory budget (compile only, nothing runs).

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

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def layer(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
  >>> loss = lambda w, batch: jnp.mean(layer(w, batch["x"]) ** 2)
  >>> w, batch = jnp.ones((4, 4)) / 4, {"x": jnp.ones((8, 4))}
  >>> result = rt.bench(loss, w, batch, policies=["boundary-only"], steps=2,
  ...                   warmup=1, progress=False)
  >>> [r.policy for r in result.records]
  ['save-everything', 'boundary-only']
  >>> result.record("save-everything").relative_step_time
  1.0
"""

from __future__ import annotations

import csv
import dataclasses
import html
import io
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax

from remat_toolkit._src import analysis
from remat_toolkit._src import catalog
from remat_toolkit._src import compat as compat
from remat_toolkit._src import context
from remat_toolkit._src.format import format_bytes
from remat_toolkit._src.format import html_table
from remat_toolkit._src.format import parse_bytes
from remat_toolkit._src.format import text_table
from remat_toolkit._src.format import warnings_html
from remat_toolkit._src.policy import Policy

__all__ = ["bench", "BenchRecord", "BenchResult", "largest_batch", "BatchFit",
           "BatchSearch", "make_train_step", "step_memory", "DEFAULT_MODEL",
           "DEFAULT_POLICIES", "DEFAULT_STEPS", "DEFAULT_WARMUP", "BASELINE"]

#: Every figure is relative to this policy, run in the same call.
BASELINE = "save-everything"
#: The model of a run without arguments: milliseconds per step on a CPU.
DEFAULT_MODEL = "tiny"
#: Policies of a run that names none: the two extremes and selective
#: recomputation (each compile takes seconds on a CPU, and the default run
#: must stay under a minute on two cores).
DEFAULT_POLICIES: tuple[str, ...] = (
    "save-everything", "boundary-only", "recompute-attention-core")
#: Timed steps per policy, and untimed steps before them.
DEFAULT_STEPS = 5
DEFAULT_WARMUP = 2
_DEFAULT_LEARNING_RATE = 1e-3
_DEFAULT_MAX_BATCH = 4096
_MEMORY_FIGURE = ("argument + output + temp - alias bytes of the compiled "
                  "training step (XLA memory_analysis)")

Model = Any  # a config name, a GPTConfig, a loss function or (loss_fn, args)


# ================================================================ the step

def _accumulator_dtype(dtype: Any) -> Any:
  # Summing micro-batch gradients in bf16 loses bits a single batch keeps.
  return jnp.promote_types(dtype, jnp.float32)


def _split_micro_batches(batch: Any, grad_accum: int) -> Any:
  return jax.tree.map(
      lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]),
      batch)


def _loss_and_grads(loss_fn: Callable[..., jax.Array], params: Any,
                    batch: Any, grad_accum: int) -> tuple[jax.Array, Any]:
  """Mean loss and gradients over ``grad_accum`` equal micro-batches."""
  grad_fn = jax.value_and_grad(loss_fn)
  if grad_accum == 1:
    return grad_fn(params, batch)

  def accumulate(carry, micro):
    loss_sum, grad_sum = carry
    loss, grads = grad_fn(params, micro)
    grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
    return (loss_sum + loss.astype(jnp.float32), grad_sum), None

  zeros = jax.tree.map(
      lambda p: jnp.zeros(p.shape, _accumulator_dtype(p.dtype)), params)
  init = (jnp.zeros((), jnp.float32), zeros)
  (loss_sum, grad_sum), _ = jax.lax.scan(
      accumulate, init, _split_micro_batches(batch, grad_accum))
  grads = jax.tree.map(lambda s, p: (s / grad_accum).astype(p.dtype),
                       grad_sum, params)
  return loss_sum / grad_accum, grads


def make_train_step(loss_fn: Callable[..., jax.Array],
                    optimizer: optax.GradientTransformation, *,
                    grad_accum: int = 1) -> Callable[..., Any]:
  """One optimizer update: ``step((params, opt_state), batch) -> (state, loss)``.

  With ``grad_accum > 1`` the batch's leading axis is split into that many
  equal micro-batches, processed one after another with ``lax.scan``; their
  mean gradient makes one update, equal to one update on the whole batch
  when the loss is a mean over examples. The step is not jitted: remat
  regions read the ambient policy when it is traced, so jit it inside
  ``rt.use_policy``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    optimizer: an optax transformation, e.g. ``optax.adamw(1e-3)``.
    grad_accum: micro-batches per update.

  Returns:
    The step function.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> step = make_train_step(lambda w, b: jnp.mean((b * w[None]) ** 2),
    ...                        optax.sgd(0.1), grad_accum=2)
    >>> w = jnp.ones(3)
    >>> (w, _), loss = step((w, optax.sgd(0.1).init(w)), jnp.ones((4, 3)))
    >>> float(loss), [round(v, 4) for v in w.tolist()]
    (1.0, [0.9333, 0.9333, 0.9333])
  """
  _check_positive_int("grad_accum", grad_accum)

  def step(state: tuple[Any, Any], batch: Any) -> tuple[tuple[Any, Any], jax.Array]:
    params, opt_state = state
    loss, grads = _loss_and_grads(loss_fn, params, batch, grad_accum)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _compile_step(workload: _Workload, policy: Policy, grad_accum: int,
                  batch: Any) -> tuple[Any, float]:
  """The jitted, donated step compiled under ``policy``, and its compile time."""
  step = make_train_step(workload.loss_fn, workload.optimizer,
                         grad_accum=grad_accum)
  params = _abstract(workload.params)
  state = (params, jax.eval_shape(workload.optimizer.init, params))
  start = time.perf_counter()
  # A fresh function per policy: jit caches traces by function, and the
  # ambient policy is read only while tracing.
  with context.use_policy(policy):
    compiled = jax.jit(step, donate_argnums=0).lower(state, _abstract(batch)).compile()
  return compiled, time.perf_counter() - start


def _memory_figures(compiled: Any) -> dict[str, int]:
  stats = compiled.memory_analysis()
  out = {
      "argument_bytes": int(stats.argument_size_in_bytes),
      "output_bytes": int(stats.output_size_in_bytes),
      "temp_bytes": int(stats.temp_size_in_bytes),
      "alias_bytes": int(stats.alias_size_in_bytes),
      "host_temp_bytes": int(getattr(stats, "host_temp_size_in_bytes", 0) or 0),
  }
  out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"]
                       + out["temp_bytes"] - out["alias_bytes"])
  return out


# ================================================================ workloads

@dataclasses.dataclass(frozen=True)
class _Workload:
  """A loss, its arguments, and what a step of it processes."""

  loss_fn: Callable[..., jax.Array]
  params: Any
  batch: Any
  optimizer: optax.GradientTransformation
  description: str
  tokens_per_example: int

  @property
  def batch_size(self) -> int:
    return _leading_size(self.batch)

  def resized(self, size: int) -> Any:
    """An abstract batch with ``size`` examples."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)[1:]), x.dtype),
        self.batch)


def _leading_size(batch: Any) -> int:
  leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
  if not leaves:
    raise ValueError("The batch has no arrays; pass loss_fn(params, batch) "
                     "a batch with a leading batch axis.")
  sizes = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
          f"Batch leaf {jax.tree_util.keystr(path) or '(root)'} is a scalar; "
          "every batch leaf needs a leading batch axis (close over other "
          "values in loss_fn).")
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
        f"Batch leaves disagree on the batch size (leading axis): {sizes}; "
        "every leaf must have the examples on axis 0.")
  return next(iter(sizes.values()))


def _tokens_per_example(batch: Any) -> int:
  # Token ids are the first integer [batch, seq, ...] leaf; else count examples.
  for leaf in jax.tree.leaves(batch):
    if len(np.shape(leaf)) >= 2 and jnp.issubdtype(leaf.dtype, jnp.integer):
      return int(np.shape(leaf)[1])
  return 1


def _unwrap_jit(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  # A jitted loss caches its trace, so it would keep the first policy it saw;
  # the whole step is jitted here anyway.
  if hasattr(loss_fn, "lower") and hasattr(loss_fn, "__wrapped__"):
    return loss_fn.__wrapped__
  return loss_fn


def _is_builtin(model: Any) -> bool:
  from remat_toolkit.models.configs import GPTConfig
  return isinstance(model, (str, GPTConfig))


def _builtin_workload(model: Any, *, batch: int | None,
                      build: Mapping[str, Any],
                      optimizer: optax.GradientTransformation, seed: int,
                      default_batch: Callable[[int], int], abstract: bool
                      ) -> _Workload:
  from remat_toolkit import models
  config = models.get_config(model)
  size = batch if batch is not None else default_batch(config.batch_size)
  options = dict(build, batch=size, seed=seed)
  loss_fn, (params, data) = models.build_loss(config, abstract=True, **options)
  if not abstract:
    # One compiled initialisation instead of hundreds of eager ops.
    params, data = jax.jit(
        lambda: models.build_loss(config, abstract=False, **options)[1])()
  config = models.get_config(config, batch_size=size,
                             seq_len=build.get("seq") or config.seq_len,
                             dtype=build.get("dtype") or config.dtype)
  scan = build.get("scan")
  layout = "scanned" if (config.scan_layers if scan is None else scan) else "unrolled"
  framework = build.get("framework") or "linen"
  description = (f"{config.name} ({framework}, {config.num_layers} layers "
                 f"{layout}, d_model {config.d_model}, seq {config.seq_len}, "
                 f"{config.dtype})")
  return _Workload(loss_fn, params, data, optimizer, description,
                   config.seq_len)


def _user_workload(model: Any, args: tuple, *, options: Mapping[str, Any],
                   optimizer: optax.GradientTransformation,
                   tokens_per_example: int | None, abstract: bool
                   ) -> _Workload:
  if isinstance(model, tuple):
    if args or len(model) != 2 or not isinstance(model[1], (tuple, list)):
      raise TypeError(
          "A model given as a tuple must be (loss_fn, (params, batch)), as "
          "models.build_loss returns, with no further positional arguments.")
    model, args = model[0], tuple(model[1])
  if not callable(model):
    raise TypeError(
        f"model must be a built-in config name, a GPTConfig, a "
        f"loss_fn(params, batch) or a (loss_fn, (params, batch)) pair, got "
        f"{model!r}.")
  if len(args) != 2:
    raise TypeError(
        f"A user model is bench(loss_fn, params, batch); got {len(args)} "
        "argument(s) after loss_fn. Close over anything else in loss_fn.")
  given = sorted(k for k, v in options.items() if v is not None)
  if given:
    raise ValueError(
        f"{given} apply to built-in models only; for your own loss, build "
        "params and batch with the size, sequence length and dtype you want.")
  params, batch = args
  _leading_size(batch)
  synthetic = not abstract and any(isinstance(x, jax.ShapeDtypeStruct)
                                   for x in jax.tree.leaves(args))
  if synthetic:
    # The step must run: abstract inputs (as every other verb takes) get
    # synthetic values; step time and memory do not depend on the values.
    params, batch = _materialise(params, 0), _materialise(batch, 1)
  tokens = (tokens_per_example if tokens_per_example is not None
            else _tokens_per_example(batch))
  name = getattr(model, "__name__", type(model).__name__)
  what = "user model, synthetic values" if synthetic else "user model"
  return _Workload(_unwrap_jit(model), params, batch, optimizer,
                   f"{name} ({what})", tokens)


def _materialise(tree: Any, seed: int) -> Any:
  """Arrays for the ``jax.ShapeDtypeStruct`` leaves of ``tree``.

  Floating-point leaves are small normal values (like an initialised model),
  integer and boolean leaves zeros (valid token ids and masks).
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
  out = []
  for key, leaf in zip(keys, leaves, strict=False):  # one key to spare if none
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      out.append(leaf)
    elif jnp.issubdtype(leaf.dtype, jnp.floating):
      out.append((0.02 * jax.random.normal(key, leaf.shape)).astype(leaf.dtype))
    else:
      out.append(jnp.zeros(leaf.shape, leaf.dtype))
  return jax.tree.unflatten(treedef, out)


def _build_options(**options: Any) -> dict[str, Any]:
  """The ``models.build_loss`` options given (None means "the config's")."""
  return {k: v for k, v in options.items() if v is not None}


def _workload(model: Model, args: tuple, *, batch: int | None,
              build: Mapping[str, Any],
              optimizer: optax.GradientTransformation | None, seed: int,
              tokens_per_example: int | None, abstract: bool = False,
              default_batch: Callable[[int], int] = lambda b: b) -> _Workload:
  """What to train: a built-in model built with ``build`` options, or a user loss."""
  optimizer = optimizer or optax.adamw(_DEFAULT_LEARNING_RATE)
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
        f"optimizer must be an optax.GradientTransformation, got {optimizer!r}; "
        "e.g. optimizer=optax.adamw(1e-3).")
  if _is_builtin(model):
    if args:
      raise TypeError(
          f"A built-in model ({model!r}) takes no positional arguments; "
          "choose its size with batch=, seq= and dtype=.")
    if batch is not None:
      _check_positive_int("batch", batch)
    if build.get("seq") is not None:
      _check_positive_int("seq", build["seq"])
    return _builtin_workload(model, batch=batch, build=build,
                             optimizer=optimizer, seed=seed,
                             default_batch=default_batch, abstract=abstract)
  return _user_workload(model, args, optimizer=optimizer,
                        tokens_per_example=tokens_per_example,
                        options={"batch": batch, **build}, abstract=abstract)


# ================================================================ checks

def _check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an integer, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _grad_accum_values(grad_accum: int | Sequence[int]) -> tuple[int, ...]:
  values = ((grad_accum,) if isinstance(grad_accum, (int, np.integer))
            else tuple(grad_accum))
  if not values:
    raise ValueError("grad_accum must name at least one value, e.g. 1 or [1, 4].")
  for v in values:
    _check_positive_int("grad_accum", v)
  return tuple(dict.fromkeys(int(v) for v in values))


def _check_divides(batch_size: int, grad_accum: Sequence[int]) -> None:
  bad = [k for k in grad_accum if batch_size % k]
  if bad:
    raise ValueError(
        f"A batch of {batch_size} examples cannot be split into {bad} equal "
        "micro-batches; choose a batch size that each grad_accum value divides.")


def _resolve_policies(policies: Sequence[str | Policy] | None,
                      default: Sequence[str]) -> list[Policy]:
  """The policies to run, the baseline first, without duplicates."""
  if isinstance(policies, (str, Policy)):
    raise TypeError(f"policies must be a list, got {policies!r}; write "
                    f"policies=[{policies!r}].")
  names = list(default) if policies is None else list(policies)
  for p in names:
    if not isinstance(p, (str, Policy)):
      raise TypeError(
          f"policies must hold policy names or remat_toolkit.Policy values, "
          f"got {p!r}; see remat_toolkit.list_policies().")
  chosen = [catalog.get_policy(BASELINE)] + [catalog.get_policy(p) for p in names]
  unique: dict[str, Policy] = {}
  for p in chosen:
    unique.setdefault(p.name, p)
  return list(unique.values())


def _runnable(policies: Sequence[Policy]) -> tuple[list[Policy], dict[str, str]]:
  runnable, skipped = [], {}
  for p in policies:
    if p.offloads and compat.offloading_unsupported():
      skipped[p.name] = ("offloads to host memory, but "
                         + compat.offloading_refusal())
    else:
      runnable.append(p)
  return runnable, skipped


# ================================================================ progress

class _Progress:
  """``[i/n] policy: what`` lines on stderr; rewritten in place on a terminal."""

  def __init__(self, total: int, enabled: bool, stream: TextIO | None = None):
    self.total, self.enabled = total, enabled
    self.stream = stream or sys.stderr
    self.count = 0
    self.inline = enabled and getattr(self.stream, "isatty", lambda: False)()

  def start(self, label: str, what: str) -> None:
    self.count += 1
    self.update(label, what)

  def update(self, label: str, what: str, *, detail: bool = False) -> None:
    if not self.enabled or (detail and not self.inline):
      return
    text = f"[{self.count}/{self.total}] {label}: {what}"
    if self.inline:
      self.stream.write("\r\033[K" + text)
    else:
      self.stream.write(text + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.inline:
      self.stream.write("\r\033[K")
      self.stream.flush()


# ================================================================ records

@dataclasses.dataclass(frozen=True)
class BenchRecord:
  """One policy's training step, measured.

  Attributes:
    policy: the policy's name.
    grad_accum: micro-batches per optimizer update.
    micro_batch: examples per forward/backward pass.
    global_batch: examples per optimizer update.
    tokens_per_step: tokens per optimizer update.
    compile_time_s: lowering plus XLA compilation, seconds.
    step_time_s: median step time after warm-up, seconds.
    step_time_min_s: fastest timed step.
    step_time_max_s: slowest timed step.
    tokens_per_s: ``tokens_per_step / step_time_s``.
    peak_bytes: the compiled step's memory, arguments + outputs + temporaries
      - donated buffers (XLA ``memory_analysis``); the per-policy figure.
    argument_bytes: parameters, optimizer state and batch.
    output_bytes: the new state and the loss.
    temp_bytes: XLA temporaries, activations kept for backward among them.
    alias_bytes: outputs written in place of donated arguments.
    host_temp_bytes: temporaries in host memory (offloading policies).
    device_peak_bytes: ``memory_stats()['peak_bytes_in_use']`` after the run
      (process-wide; None on CPU).
    device_reserved_bytes: reserved device bytes after the run (peak if the
      backend reports it; None on CPU).
    host_peak_rss_bytes: the process's peak resident set size after the run.
    measured_peak_is_own: the process-wide high-water mark (device if
      reported, else host RSS) rose during this record's run.
    loss_first: loss of the first step.
    loss_last: loss of the last step.
    run_order: 1 for the policy run first.
    relative_step_time: ``step_time_s`` over the baseline's.
    relative_tokens_per_s: ``tokens_per_s`` over the baseline's.
    relative_peak_bytes: ``peak_bytes`` over the baseline's.
    relative_compile_time: ``compile_time_s`` over the baseline's.
    relative_device_peak_bytes: ``device_peak_bytes`` over the baseline's.
    is_baseline: this is the record the others are relative to.
  """

  policy: str
  grad_accum: int
  micro_batch: int
  global_batch: int
  tokens_per_step: int
  compile_time_s: float
  step_time_s: float
  step_time_min_s: float
  step_time_max_s: float
  tokens_per_s: float
  peak_bytes: int
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  host_temp_bytes: int
  device_peak_bytes: int | None
  device_reserved_bytes: int | None
  host_peak_rss_bytes: int | None
  measured_peak_is_own: bool
  loss_first: float
  loss_last: float
  run_order: int
  relative_step_time: float | None = None
  relative_tokens_per_s: float | None = None
  relative_peak_bytes: float | None = None
  relative_compile_time: float | None = None
  relative_device_peak_bytes: float | None = None
  is_baseline: bool = False

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


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


def _fmt_ratio(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}x"


def _fmt_opt_bytes(value: int | None) -> str:
  return "-" if value is None else format_bytes(value)


@dataclasses.dataclass(frozen=True)
class BenchResult:
  """Every policy's measured training step, from one run.

  Attributes:
    records: one per (policy, grad_accum), in the order asked for; the
      baseline (``save-everything`` at the first ``grad_accum``) first.
    model: what was trained.
    steps: timed steps per policy.
    warmup: untimed steps before them.
    backend: JAX's default backend (``cpu``, ``gpu``, ``tpu``).
    device_kind: the device that ran the steps.
    xla_flags: the ``XLA_FLAGS`` environment variable during the run.
    jax_remat3: whether JAX's remat3 implementation was on.
    skipped: policy name -> why it did not run.
    load_average: the host's 1-minute load average after the run, if known
      (above the core count, CPU step times are noisy).
    warnings: why some policies' figures may not be their own: no remat
      region reads the ambient policy, regions with their own policy, or a
      policy that keeps none of its names in this model.
  """

  records: tuple[BenchRecord, ...]
  model: str
  steps: int
  warmup: int
  backend: str
  device_kind: str
  xla_flags: str
  jax_remat3: bool
  skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)
  load_average: float | None = None
  warnings: tuple[str, ...] = ()

  @property
  def baseline(self) -> BenchRecord:
    return next(r for r in self.records if r.is_baseline)

  def record(self, policy: str, grad_accum: int | None = None) -> BenchRecord:
    """The record of ``policy`` (at ``grad_accum``, default the first run).

    Raises:
      KeyError: if that policy did not run.
    """
    name = catalog.get_policy(policy).name
    for r in self.records:
      if r.policy == name and grad_accum in (None, r.grad_accum):
        return r
    raise KeyError(f"No record for policy {name!r}"
                   + (f" at grad_accum={grad_accum}" if grad_accum else "")
                   + f"; ran {sorted({r.policy for r in self.records})}.")

  def rows(self) -> list[dict[str, Any]]:
    """One dict per record (the JSON and CSV data)."""
    return [r.to_dict() for r in self.records]

  def to_json(self, **kwargs: Any) -> str:
    """The records as a JSON list."""
    return json.dumps(self.rows(), **kwargs)

  def to_dict(self) -> dict[str, Any]:
    """The records with what the run was, what it skipped and its warnings."""
    return {"model": self.model, "records": self.rows(),
            "skipped": dict(self.skipped), "warnings": list(self.warnings)}

  def to_csv(self) -> str:
    """The records as CSV, one line per record after a header."""
    out = io.StringIO()
    fields = [f.name for f in dataclasses.fields(BenchRecord)]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(self.rows())
    return out.getvalue()

  def to_dataframe(self):
    """One row per record (needs pandas)."""
    try:
      import pandas as pd
    except ImportError as e:  # pragma: no cover - pandas is optional
      raise ImportError("to_dataframe needs pandas: pip install "
                        "'remat-toolkit[display]'.") from e
    return pd.DataFrame(self.rows())

  def _table(self) -> tuple[list[str], list[list[str]]]:
    accum = any(r.grad_accum > 1 for r in self.records)
    device = any(r.device_peak_bytes is not None for r in self.records)
    headers = ["policy", "compile", "step (median)", "tokens/s", "step vs base",
               "compiled peak", "peak vs base", "XLA temp",
               "device peak" if device else "host RSS peak", "loss"]
    if accum:
      headers.insert(1, "accum x micro")
    body = []
    for r in self.records:
      measured = r.device_peak_bytes if device else r.host_peak_rss_bytes
      row = [r.policy + (" (base)" if r.is_baseline else ""),
             f"{r.compile_time_s:.1f} s", f"{r.step_time_s * 1e3:.1f} ms",
             f"{r.tokens_per_s:,.0f}", _fmt_ratio(r.relative_step_time),
             format_bytes(r.peak_bytes), _fmt_ratio(r.relative_peak_bytes),
             format_bytes(r.temp_bytes),
             _fmt_opt_bytes(measured) + ("" if r.measured_peak_is_own else " *"),
             f"{r.loss_last:.4f}"]
      if accum:
        row.insert(1, f"{r.grad_accum} x {r.micro_batch}")
      body.append(row)
    return headers, body

  def notes(self) -> list[str]:
    """What the figures mean and how they were taken, then the warnings."""
    return self._figure_notes() + [f"warning: {w}" for w in self.warnings]

  def _figure_notes(self) -> list[str]:
    b = self.baseline
    out = [
        f"{self.model}; {b.global_batch} examples x "
        f"{b.tokens_per_step // b.global_batch} "
        f"tokens per step; median of {self.steps} steps after {self.warmup} "
        f"warm-up; {self.device_kind} ({self.backend}); "
        f"XLA_FLAGS={self.xla_flags or '(unset)'}; jax_remat3={self.jax_remat3}.",
        f"compiled peak: {_MEMORY_FIGURE}, per policy; XLA temp: its "
        "temporaries, where the activations kept for the backward pass live. "
        "Measured peaks are process-wide high-water marks (policies ran in "
        "ascending compiled peak; * = the mark did not rise during that "
        "policy's run, so it is not its own).",
    ]
    if self.backend == "cpu":
      from remat_toolkit._src.analysis import cpu_scheduler_setting
      out.append(
          "CPU figures: step times are XLA:CPU's and do not predict an "
          "accelerator's. XLA:CPU's compiled memory follows the policy "
          "mainly for layers under scan (built-in models: scan=True, "
          "--scan). XLA:CPU scheduler: " + cpu_scheduler_setting() + ".")
      cores = os.cpu_count() or 1
      if self.load_average is not None and self.load_average > cores:
        out.append(
            f"The host was busy (load average {self.load_average:.1f} on "
            f"{cores} cores): step times are noisy.")
    for name, why in self.skipped.items():
      out.append(f"skipped {name}: {why}")
    return out

  def to_markdown(self) -> str:
    """The table as Markdown (for a README), without the notes."""
    headers, body = self._table()
    rule = ["---" if h == "policy" else "---:" for h in headers]
    return "\n".join("| " + " | ".join(row) + " |"
                     for row in [headers, rule, *body])

  def __str__(self) -> str:
    headers, body = self._table()
    right = [h != "policy" for h in headers]
    return "\n".join([text_table(headers, body, right=right), "",
                      *self.notes()])

  def _repr_html_(self) -> str:
    headers, body = self._table()
    notes = "".join(f"<p>{html.escape(n)}</p>" for n in self._figure_notes())
    return (html_table(headers, body, caption="Training step per policy")
            + notes + warnings_html(self.warnings))


# ================================================================ running

def _device_memory(device: Any) -> dict[str, int] | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  reserved = stats.get("peak_bytes_reserved", stats.get("bytes_reserved"))
  return {"peak": int(stats["peak_bytes_in_use"]),
          "reserved": None if reserved is None else int(reserved)}


def _host_peak_rss() -> int | None:
  try:
    import resource
  except ImportError:  # Windows
    return None
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports KiB, macOS bytes.
  return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _timed_steps(compiled: Any, state: Any, batch: Any, *, steps: int,
                 warmup: int, progress: _Progress, label: str
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


def _run_one(item: _Compiled, workload: _Workload, init_state: Callable,
             *, steps: int, warmup: int, progress: _Progress, order: int
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
    own = after["peak"] > before["peak"]
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
      device_peak_bytes=after and after["peak"],
      device_reserved_bytes=after and after["reserved"],
      host_peak_rss_bytes=rss_after, measured_peak_is_own=own,
      loss_first=losses[0], loss_last=losses[-1], run_order=order)


def _label(item: _Compiled) -> str:
  return item.policy.name + (f" (accum {item.grad_accum})"
                             if item.grad_accum > 1 else "")


def _state_factory(workload: _Workload) -> Callable[[], Any]:
  # Every policy starts from the same parameters. They wait on the host so
  # that device memory between runs holds only what the next run allocates.
  host_params = jax.device_get(workload.params)
  init_opt = jax.jit(workload.optimizer.init)

  def init_state():
    params = jax.device_put(host_params)
    return params, init_opt(params)

  return init_state


def _lcm(values: Sequence[int]) -> int:
  return math.lcm(*values)


class _Deadline:
  """Whether a run's time limit has passed (never, without one)."""

  def __init__(self, limit_s: float | None):
    if limit_s is not None and (isinstance(limit_s, bool) or not isinstance(
        limit_s, (int, float)) or limit_s <= 0):
      raise ValueError(f"time_limit_s must be a positive number of seconds "
                       f"or None, got {limit_s!r}.")
    self.limit_s = limit_s
    self.start = time.perf_counter()

  @property
  def reason(self) -> str:
    return f"the time limit of {self.limit_s:g} s was reached before it started"

  def expired(self) -> bool:
    return (self.limit_s is not None
            and time.perf_counter() - self.start > self.limit_s)


def bench(model: Model = DEFAULT_MODEL, *args: Any,
          policies: Sequence[str | Policy] | None = None,
          batch: int | None = None, seq: int | None = None,
          dtype: str | None = None, scan: bool | None = None,
          group: int | str | None = None, framework: str | None = None,
          steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
          grad_accum: int | Sequence[int] = 1,
          optimizer: optax.GradientTransformation | None = None,
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
    policies: names or Policies; ``save-everything`` is added as the
      baseline. Default: :data:`DEFAULT_POLICIES`.
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
    optimizer: default ``optax.adamw(1e-3)``.
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
    TypeError: a model or argument of the wrong kind.
  """
  _check_positive_int("steps", steps)
  _check_positive_int("warmup", warmup, minimum=0)
  deadline = _Deadline(time_limit_s)
  accums = _grad_accum_values(grad_accum)
  chosen = _resolve_policies(policies, DEFAULT_POLICIES)
  build = _build_options(seq=seq, dtype=dtype, scan=scan, group=group,
                         framework=framework)
  workload = _workload(model, args, batch=batch, build=build,
                       optimizer=optimizer, seed=seed,
                       tokens_per_example=tokens_per_example,
                       default_batch=lambda b: b * _lcm(accums))
  _check_divides(workload.batch_size, accums)
  runnable, skipped = _runnable(chosen)
  findings, silent = _policy_findings(workload, runnable)
  plan = [(p, k) for k in accums for p in runnable]
  tracker = _Progress(2 * len(plan), progress)
  try:
    compiled = list(_compile_all(plan, workload, tracker, deadline, skipped,
                                 silent))
    records = _run_all(compiled, workload, tracker, steps=steps, warmup=warmup,
                       skipped=skipped)
  finally:
    tracker.close()
  base = records[0]
  device = jax.devices()[0]
  result = BenchResult(
      records=tuple(_with_relative(r, base) for r in records),
      model=workload.description, steps=steps, warmup=warmup,
      backend=jax.default_backend(), device_kind=device.device_kind,
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      jax_remat3=compat.remat3_enabled(), skipped=skipped,
      load_average=_load_average(), warnings=tuple(findings))
  analysis.warn_once(result.warnings)
  return result


def _policy_findings(workload: _Workload, policies: Sequence[Policy]
                     ) -> tuple[list[str], frozenset[str]]:
  """The analyzer's warnings for the run, and the policies keeping no name.

  One trace of the loss (no compile) says whether the regions take the
  policies at all, before minutes of compiling say nothing.
  """
  program = analysis.TracedProgram(workload.loss_fn,
                                   (workload.params, workload.batch))
  found = analysis.region_warnings(program)
  silent = set()
  for policy in policies:
    unmatched = analysis.unmatched_names_warning(program, policy)
    if unmatched:
      found.append(unmatched)
      silent.add(policy.name)
  return found, frozenset(silent)


def _load_average() -> float | None:
  try:
    return os.getloadavg()[0]
  except (AttributeError, OSError):  # not on Windows
    return None


def _compile_all(plan: Sequence[tuple[Policy, int]], workload: _Workload,
                 tracker: _Progress, deadline: _Deadline,
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
      with analysis.trace_time_name_warnings_silenced(policy.name in silent):
        item.executable, item.compile_time_s = _compile_step(
            workload, policy, accum, workload.batch)
    except Exception as e:  # noqa: BLE001 - one policy must not sink the run
      if not i:
        raise
      skipped[_label(item)] = f"failed to compile: {_one_line(e)}"
      tracker.total -= 1
      continue
    item.memory = _memory_figures(item.executable)
    yield item


def _one_line(error: Exception) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _run_all(compiled: Sequence[_Compiled], workload: _Workload,
             tracker: _Progress, *, steps: int, warmup: int,
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
      skipped[_label(compiled[i])] = f"failed to run: {_one_line(e)}"
  return [records[i] for i in sorted(records)]


# ================================================================ largest batch

def step_memory(model: Model = DEFAULT_MODEL, *args: Any,
                policy: str | Policy = BASELINE, batch: int | None = None,
                seq: int | None = None, dtype: str | None = None,
                scan: bool | None = None, group: int | str | None = None,
                framework: str | None = None,
                optimizer: optax.GradientTransformation | None = None
                ) -> dict[str, int]:
  """XLA's memory figures of one compiled training step (nothing runs).

  Args:
    model: as for :func:`bench`.
    *args: ``params, batch`` for a user loss.
    policy: the policy the step is compiled under.
    batch: examples in the step (default: the model's).
    seq: built-in models only: sequence length.
    dtype: built-in models only: activation dtype.
    scan: built-in models only: scan the layers.
    group: built-in models only: blocks per remat region, or ``"sqrt"``.
    framework: built-in models only: ``"linen"`` (default) or ``"nnx"``.
    optimizer: default ``optax.adamw(1e-3)``.

  Returns:
    ``argument_bytes``, ``output_bytes``, ``temp_bytes``, ``alias_bytes``,
    ``host_temp_bytes`` and ``peak_bytes`` (arguments + outputs + temp -
    alias).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> loss = lambda w, b: jnp.mean((b @ w) ** 2)
    >>> args = (jax.ShapeDtypeStruct((4, 4), jnp.float32),
    ...         jax.ShapeDtypeStruct((8, 4), jnp.float32))
    >>> step_memory(loss, *args, batch=16)["argument_bytes"] >= 16 * 4 * 4
    True
  """
  build = _build_options(seq=seq, dtype=dtype, scan=scan, group=group,
                         framework=framework)
  workload = _workload(model, args, batch=None, build=build,
                       optimizer=optimizer, seed=0, tokens_per_example=None,
                       abstract=True)
  size = workload.batch_size if batch is None else batch
  _check_positive_int("batch", size)
  return _step_memory(workload, catalog.get_policy(policy), size)


def _step_memory(workload: _Workload, policy: Policy, size: int) -> dict[str, int]:
  compiled, _ = _compile_step(workload, policy, 1, workload.resized(size))
  return _memory_figures(compiled)


@dataclasses.dataclass(frozen=True)
class BatchFit:
  """The largest micro-batch of one policy under a memory budget.

  Attributes:
    policy: the policy's name.
    batch: the largest micro-batch that fits (0 if even 1 does not).
    bytes: the compared figure at ``batch`` (None if ``batch`` is 0).
    over_batch: the smallest size tried that did not fit (None if the cap
      was reached first).
    over_bytes: the compared figure at ``over_batch``.
    hit_cap: the search stopped at ``max_batch`` with it still fitting.
    tries: every ``(micro-batch, bytes)`` compiled, in order.
  """

  policy: str
  batch: int
  bytes: int | None
  over_batch: int | None
  over_bytes: int | None
  hit_cap: bool
  tries: tuple[tuple[int, int], ...]

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["tries"] = [list(t) for t in self.tries]
    return out


@dataclasses.dataclass(frozen=True)
class BatchSearch:
  """Per policy, the largest micro-batch whose compiled step fits a budget.

  Attributes:
    fits: policy name -> :class:`BatchFit`, in the order asked for.
    budget_bytes: the memory budget.
    figure: what was compared with the budget.
    model: what was compiled.
    backend: JAX's default backend.
    xla_flags: the ``XLA_FLAGS`` environment variable.
    max_batch: the search's cap.
    skipped: policy name -> why it was not searched.
  """

  fits: Mapping[str, BatchFit]
  budget_bytes: int
  figure: str
  model: str
  backend: str
  xla_flags: str
  max_batch: int
  skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def rows(self) -> list[dict[str, Any]]:
    return [f.to_dict() for f in self.fits.values()]

  def to_json(self, **kwargs: Any) -> str:
    return json.dumps(self.rows(), **kwargs)

  def to_csv(self) -> str:
    out = io.StringIO()
    fields = [f.name for f in dataclasses.fields(BatchFit) if f.name != "tries"]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n",
                            extrasaction="ignore")
    writer.writeheader()
    writer.writerows(self.rows())
    return out.getvalue()

  def __str__(self) -> str:
    base = self.fits.get(BASELINE)
    headers = ["policy", "largest micro-batch", "vs save-everything",
               "compiled bytes", "first over budget", "compiles"]
    body = []
    for f in self.fits.values():
      over = ("cap reached" if f.hit_cap else
              f"{f.over_batch} ({format_bytes(f.over_bytes)})")
      ratio = (f"{f.batch / base.batch:.2f}x" if base and base.batch else "-")
      body.append([f.policy, str(f.batch), ratio, _fmt_opt_bytes(f.bytes),
                   over, str(len(f.tries))])
    lines = [text_table(headers, body, right=[h != "policy" for h in headers]),
             "", f"{self.model}; budget {format_bytes(self.budget_bytes)} "
             f"compared with the {self.figure}; search capped at "
             f"{self.max_batch}; {self.backend}; "
             f"XLA_FLAGS={self.xla_flags or '(unset)'}."]
    if self.backend == "cpu":
      from remat_toolkit._src.analysis import cpu_scheduler_setting
      lines.append("XLA:CPU scheduler: " + cpu_scheduler_setting() + ".")
    lines += [f"skipped {n}: {why}" for n, why in self.skipped.items()]
    return "\n".join(lines)

  def _repr_html_(self) -> str:
    return f"<pre>{html.escape(str(self))}</pre>"


def _affine_crossing(a: tuple[int, int], b: tuple[int, int], budget: int
                     ) -> int | None:
  """The largest size under ``budget`` on the line through two probes."""
  (n1, m1), (n2, m2) = sorted((a, b))
  if n2 == n1 or m2 <= m1:
    return None
  return n1 + (budget - m1) * (n2 - n1) // (m2 - m1)


def _search(measure: Callable[[int], int], budget: int, max_batch: int
            ) -> tuple[int, int | None, list[tuple[int, int]]]:
  """The largest size in ``[1, max_batch]`` whose bytes fit ``budget``.

  Assumes bytes grow with the size. Sizes at least double until one does
  not fit; a straight line through the last two probes (compiled memory is
  close to affine in the batch) lets the search jump to just past the
  predicted limit, then probe the line's crossing inside the bracket, with
  a bisection step whenever a probe did not halve the bracket. Returns
  (largest fit or 0, smallest miss or None at the cap, every probe).
  """
  tries: list[tuple[int, int]] = []

  def fits(size: int) -> bool:
    tries.append((size, measure(size)))
    return tries[-1][1] <= budget

  if not fits(1):
    return 0, 1, tries
  good, bad = 1, None
  while bad is None and good < max_batch:
    fitted = [t for t in tries if t[1] <= budget]
    guess = (_affine_crossing(fitted[-2], fitted[-1], budget)
             if len(fitted) > 1 else None)
    size = min(max_batch, max(2 * good, (guess or 0) + 1))
    if fits(size):
      good = size
    else:
      bad = size
  halved = True
  while bad is not None and bad - good > 1:
    measured = dict(tries)
    guess = _affine_crossing((good, measured[good]), (bad, measured[bad]), budget)
    size = guess if halved and guess is not None else (good + bad) // 2
    size = min(max(size, good + 1), bad - 1)
    width = bad - good
    if fits(size):
      good = size
    else:
      bad = size
    halved = 2 * (bad - good) <= width
  return good, bad, tries


def largest_batch(model: Model = DEFAULT_MODEL, *args: Any,
                  budget: int | str,
                  policies: Sequence[str | Policy] | None = None,
                  seq: int | None = None, dtype: str | None = None,
                  scan: bool | None = None, group: int | str | None = None,
                  framework: str | None = None,
                  max_batch: int = _DEFAULT_MAX_BATCH,
                  optimizer: optax.GradientTransformation | None = None,
                  time_limit_s: float | None = None,
                  progress: bool = True) -> BatchSearch:
  """Per policy, the largest micro-batch whose compiled step fits ``budget``.

  Each candidate is compiled, never run: the training step (as in
  :func:`bench`, one micro-batch, no accumulation) is lowered with a batch
  of that many examples and its ``argument + output + temp - alias`` bytes
  (XLA ``memory_analysis``) are compared with ``budget``. Sizes double from
  1 until one does not fit (or ``max_batch`` is reached), then the bracket
  is searched; both phases jump ahead along a straight line through the
  last two probes, so a few compiles usually suffice.

  Args:
    model: as for :func:`bench`; a user batch's leaves are resized on their
      leading axis.
    *args: ``params, batch`` for a user loss (``jax.ShapeDtypeStruct`` is
      enough: nothing is allocated).
    budget: bytes, or a size such as ``"2GiB"``.
    policies: names or Policies (``save-everything`` is added). Default:
      :data:`DEFAULT_POLICIES`.
    seq: built-in models only: sequence length.
    dtype: built-in models only: activation dtype.
    scan: built-in models only: scan the layers.
    group: built-in models only: blocks per remat region, or ``"sqrt"``.
    framework: built-in models only: ``"linen"`` (default) or ``"nnx"``.
    max_batch: the largest size tried.
    optimizer: default ``optax.adamw(1e-3)``.
    time_limit_s: start no further policy's search once this many seconds
      have passed (the baseline's always runs); the rest are listed in
      ``skipped``. Default: no limit.
    progress: print progress lines on stderr.

  Returns:
    A :class:`BatchSearch`.

  Raises:
    ValueError: a budget that is not a size, an unknown policy, or
      ``max_batch < 1``.
    TypeError: a model or argument of the wrong kind.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> loss = lambda w, b: jnp.mean((b @ w) ** 2)
    >>> args = (jax.ShapeDtypeStruct((4, 4), jnp.float32),
    ...         jax.ShapeDtypeStruct((1, 4), jnp.float32))
    >>> search = largest_batch(loss, *args, budget="2KiB", max_batch=64,
    ...                        policies=[], progress=False)
    >>> fit = search.fits["save-everything"]
    >>> fit.bytes <= 2048 < fit.over_bytes
    True
  """
  budget_bytes = parse_bytes(budget)
  _check_positive_int("max_batch", max_batch)
  deadline = _Deadline(time_limit_s)
  chosen = _resolve_policies(policies, DEFAULT_POLICIES)
  build = _build_options(seq=seq, dtype=dtype, scan=scan, group=group,
                         framework=framework)
  workload = _workload(model, args, batch=None, build=build,
                       optimizer=optimizer, seed=0, tokens_per_example=None,
                       abstract=True)
  runnable, skipped = _runnable(chosen)
  tracker = _Progress(len(runnable), progress)
  fits: dict[str, BatchFit] = {}
  try:
    for i, policy in enumerate(runnable):
      if i and deadline.expired():
        skipped[policy.name] = deadline.reason
        continue
      tracker.start(policy.name, "searching...")
      try:
        fits[policy.name] = _fit_policy(workload, policy, budget_bytes,
                                        max_batch, tracker)
      except Exception as e:  # noqa: BLE001 - one policy must not sink the run
        if not i:
          raise
        skipped[policy.name] = f"failed to compile: {_one_line(e)}"
  finally:
    tracker.close()
  return BatchSearch(fits=fits, budget_bytes=budget_bytes,
                     figure=_MEMORY_FIGURE, model=workload.description,
                     backend=jax.default_backend(),
                     xla_flags=os.environ.get("XLA_FLAGS", ""),
                     max_batch=max_batch, skipped=skipped)


def _fit_policy(workload: _Workload, policy: Policy, budget: int,
                max_batch: int, tracker: _Progress) -> BatchFit:
  def measure(size: int) -> int:
    tracker.update(policy.name, f"compiling micro-batch {size}", detail=True)
    return _step_memory(workload, policy, size)["peak_bytes"]

  good, bad, tries = _search(measure, budget, max_batch)
  measured = dict(tries)
  return BatchFit(policy=policy.name, batch=good,
                  bytes=measured.get(good), over_batch=bad,
                  over_bytes=None if bad is None else measured[bad],
                  hit_cap=bad is None, tries=tuple(tries))
