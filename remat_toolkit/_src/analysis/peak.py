"""The step's peak: what decides an out-of-memory error, predicted and measured.

A run fits or fails on the peak of its training step: the parameters, the
inputs, the gradients (and optimizer state) and everything live at the worst
moment of the step, as XLA schedules it. Kept bytes alone do not rank
policies the way the peak does: a policy that keeps more can free a larger
transient earlier. :func:`peak` predicts the peak from the program, on
abstract shapes and without compiling (:mod:`~remat_toolkit._src.analysis.
liveness`), lists the tensors live then, and with ``compile=True`` sets XLA's
own figure and buffers beside it (:mod:`~remat_toolkit._src.analysis.
xla_buffers`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def layer(w, x):
  ...   return jnp.tanh(x @ w)
  >>> loss = lambda w, x: layer(w, layer(w, x)).sum()
  >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  >>> p = rt.peak(loss, w, x, policy="boundary-only")
  >>> p.bytes > 2 * 256 * 256 * 4   # w and its gradient, and more
  True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from remat_toolkit._src.analysis import liveness
from remat_toolkit._src.analysis import xla_buffers
from remat_toolkit._src.analysis.breakdown import resolve_optimizer
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.analysis.trace import cpu_scheduler_setting
from remat_toolkit._src.core import compat
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.results.analysis import kept_bytes as _kept_bytes
from remat_toolkit._src.results.peak import PREDICTION_TOLERANCE
from remat_toolkit._src.results.peak import LiveTensor
from remat_toolkit._src.results.peak import Peak
from remat_toolkit._src.results.peak import XlaBuffer

__all__ = ["peak", "program_peak", "StepBuilder", "require_float_leaf"]

_CPU_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def peak(fn: Callable[..., Any], *args: Any, policy: PolicyLike = None,
         optimizer: Any = None, compile: bool = False) -> Peak:
  """The peak device bytes of one training step of ``fn`` under ``policy``.

  The step is ``jax.jit(jax.grad(fn))`` (the gradient of the first
  argument), or with ``optimizer`` the optax train step: gradients, the
  update and the new parameters and optimizer state, with the parameters and
  the state donated as a training loop does. The peak is predicted from the
  program, without compiling, on abstract shapes: a ``llama-7b`` shape takes
  seconds on a laptop.

  Args:
    fn: ``fn(params, *batch)`` returns a scalar loss.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).
    policy: a name, a :class:`Policy`, a raw ``jax.checkpoint_policies``
      policy, or None for the ambient policy.
    optimizer: an optax ``GradientTransformation`` or a name such as
      ``"adamw"`` (see :func:`remat_toolkit.memory_breakdown`).
    compile: also compile the step for XLA's figure (``xla_bytes``) and the
      buffers live at XLA's own peak (``xla_live``).

  Returns:
    A :class:`~remat_toolkit.results.Peak`; its ``live`` tensors sum to its
    ``bytes``, ``when`` says where the peak falls, and its ``warnings``
    (each raised once) say when XLA rematerialized on its own, when XLA:CPU's
    scheduler hides remat, when the peak is above the device's limit, and
    when the prediction is more than 10% off XLA's figure.

  Raises:
    ValueError: unknown policy or optimizer name, an offloading policy this
      JAX cannot run now (under ``jax_remat3``), non-scalar loss, no float
      argument.
    TypeError: a policy of the wrong type, a non-array argument, an
      optimizer without ``init``, ``compile`` not True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def layer(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, x: layer(w, layer(w, x)).sum()
    >>> w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    >>> p = rt.peak(loss, w, x, policy="save-ffn")
    >>> sum(t.nbytes for t in p.live) == p.bytes
    True
    >>> sorted(p.by_phase())[:2]
    ['backward transient', 'gradient']
  """
  check_flag("compile", compile)
  resolved = resolve.require_runnable(resolve.resolve_policy(policy))
  opt = None if optimizer is None else resolve_optimizer(optimizer)
  if not args:
    raise TypeError("peak(fn, *args) needs fn's arguments: the parameters "
                    "first, e.g. rt.peak(loss, params, batch).")
  require_float_leaf(args[0])
  program = TracedProgram(fn, args)
  builder = StepBuilder(program, len(jax.tree_util.tree_leaves(args[0])), opt)
  result = program_peak(builder, resolved, compile=compile)
  warn_once(result.warnings)
  return result


def require_float_leaf(params: Any) -> None:
  """Refuses a first argument with no floating-point leaf before ``fn`` is
  traced: tracing would fail inside ``fn`` (an integer where a matrix is
  multiplied), in JAX's words rather than with the fix. A leaf that is not
  an array is left to the trace, which names it."""
  dtypes = []
  for leaf in jax.tree_util.tree_leaves(params):
    try:
      dtypes.append(jnp.result_type(leaf))
    except TypeError:
      return
  if not any(jnp.issubdtype(d, jnp.inexact) for d in dtypes):
    raise _no_float_leaf()


def _no_float_leaf() -> ValueError:
  return ValueError(
      "The first argument of fn has no floating-point leaf, so the step has "
      "no gradient to take; pass the parameters first "
      "(rt.peak(loss, params, batch)).")


class StepBuilder:
  """The training step of a traced program under any policy: its jaxpr, for
  the prediction, and the same function, for XLA.

  Args:
    program: the traced loss.
    num_params: how many of the program's leaves are the first argument's.
    optimizer: ``(GradientTransformation, name)`` or None.
  """

  def __init__(self, program: TracedProgram, num_params: int,
               optimizer: tuple[Any, str] | None = None):
    self.program = program
    leaves = program.leaves
    self._params = [k for k in range(num_params)
                    if jnp.issubdtype(leaves[k].dtype, jnp.inexact)]
    if not self._params:
      raise _no_float_leaf()
    self._optimizer = optimizer
    self._opt_state = None
    if optimizer is not None:
      abstract = [jax.ShapeDtypeStruct(np.shape(leaves[k]), leaves[k].dtype)
                  for k in self._params]
      self._opt_state = jax.eval_shape(optimizer[0].init, abstract)
    self._num_params = num_params

  @property
  def step_name(self) -> str:
    if self._optimizer is None:
      return "jax.grad of the first argument"
    return f"train step with {self._optimizer[1]} (parameters and state donated)"

  def function(self, policy: Policy) -> tuple[Callable, tuple[Any, ...],
                                              tuple[int, ...]]:
    """``(step, abstract arguments, donated argument numbers)``."""
    jaxpr = self.program.substituted(policy)
    consts = self.program.jaxpr.consts
    leaves = self.program.leaves
    params = self._params
    rest = [k for k in range(len(leaves)) if k not in params]

    def loss(p, others):
      xs = list(leaves)
      for k, v in zip(params, p, strict=True):
        xs[k] = v
      for k, v in zip(rest, others, strict=True):
        xs[k] = v
      return compat.eval_jaxpr(jaxpr, consts, *xs)[0]

    p0 = [leaves[k] for k in params]
    others = [leaves[k] for k in rest]
    if self._optimizer is None:
      return jax.grad(loss), (p0, others), ()
    opt = self._optimizer[0]

    def train_step(p, state, others):
      grads = jax.grad(loss)(p, others)
      updates, state = opt.update(grads, state, p)
      return optax.apply_updates(p, updates), state

    return train_step, (p0, self._opt_state, others), (0, 1)

  def phases(self) -> tuple[list[str], list[str], list[str], list[str],
                            list[bool]]:
    """The step's argument phases and labels, its output phases and labels,
    and which arguments it donates."""
    labels = self.program.paths
    params = self._params
    rest = [k for k in range(len(labels)) if k not in params]
    arg_phases = ["parameter"] * len(params)
    arg_labels = [labels[k] for k in params]
    donated = [self._optimizer is not None] * len(params)
    if self._optimizer is not None:
      n = len(jax.tree_util.tree_leaves(self._opt_state))
      arg_phases += ["optimizer state"] * n
      arg_labels += ["optimizer state"] * n
      donated += [True] * n
    arg_phases += ["parameter" if k < self._num_params else "input"
                   for k in rest]
    arg_labels += [labels[k] for k in rest]
    donated += [False] * len(rest)
    if self._optimizer is None:
      out_phases = ["gradient"] * len(params)
      out_labels = [labels[k] for k in params]
    else:
      n = len(jax.tree_util.tree_leaves(self._opt_state))
      out_phases = ["output"] * len(params) + ["optimizer state"] * n
      out_labels = [labels[k] for k in params] + ["optimizer state"] * n
    return arg_phases, arg_labels, out_phases, out_labels, donated


#: Recomputation under this share of a step's FLOPs is not looked for in
#: XLA's count (its elementwise FLOPs are of that order).
MERGE_MIN_SHARE = 0.05


def program_peak(builder: StepBuilder, policy: Policy, *,
                 compile: bool = False, kept_bytes: int | None = None) -> Peak:
  """The :class:`Peak` of ``policy`` on a traced program (nothing raised)."""
  program = builder.program
  if kept_bytes is None:  # first: a policy JAX refuses is said clearly here
    kept_bytes = _kept_bytes(program.residuals(policy))
  step, args, donate = builder.function(policy)
  closed = jax.make_jaxpr(step)(*args)
  # remat3 leaves dead recomputation in the traced step; XLA drops it.
  jaxpr = compat.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
  arg_phases, labels, out_phases, out_labels, donated = builder.phases()
  backend = jax.default_backend()
  predicted = liveness.predict_peak(
      jaxpr, arg_phases, out_phases=out_phases, arg_paths=labels,
      out_paths=out_labels, donated=donated,
      upcast_low_precision_matmuls=backend == "cpu",
      merge_argument_casts=compat.xla_merges_parameter_casts(),
      convert_loop_inputs=compat.xla_converts_loop_inputs_whole())
  live = tuple(
      LiveTensor(v.shape, v.dtype, v.nbytes, v.phase,
                 v.module_path if v.primitive in ("argument", "output", "constant")
                 else _clean_path(v.module_path, program.root), v.name,
                 v.primitive)
      for v in predicted.live)
  where = _clean_path(predicted.module_path, program.root) or "the top level"
  when = f"{'backward' if predicted.backward else 'forward'} of {where}"
  found: list[Finding] = []
  xla_bytes = xla_live = flags = None
  if compile:
    xla_bytes, xla_live, xla_flops, found = _compiled(step, args, donate,
                                                      policy, program.root)
    flags = os.environ.get("XLA_FLAGS", "")
    found += _merged_recompute(program, policy, xla_flops)
  result = Peak(policy=policy.name, bytes=predicted.bytes, live=live,
                when=when, kept_bytes=kept_bytes, step=builder.step_name,
                backend=backend, xla_bytes=xla_bytes, xla_live=xla_live,
                xla_flags=flags)
  found += _limit_findings(result)
  # An XLA figure (compile=True) is what gives the prediction an error.
  if result.xla_bytes and not result.within_tolerance:
    found.append(Finding(
        f"the predicted peak of {policy.name!r} ({format_bytes(result.bytes)}) "
        f"is {result.error:+.0%} off XLA's figure "
        f"({format_bytes(result.xla_bytes)}), beyond the "
        f"{PREDICTION_TOLERANCE:.0%} the prediction is tested to; plan against "
        "XLA's figure (plan(..., bounds='peak', compile=True)).",
        "prediction-off", policy.name))
  return dataclasses.replace(result, warnings=tuple(found))


def _clean_path(path: str, root: str) -> str:
  """A module path as results show it: the model's root scope dropped, and
  the scopes a call wrote again said once: JAX's op names repeat the path
  of a region around its body (``layers_1/layers_1/mlp``,
  ``transformer/h/0/transformer/h/0/mlp``). Only a repeat of the path's own
  tail goes; a name met again deeper (T5's ``block/0/layer/0``) stays."""
  parts = [p for p in path.split("/") if p and p != root]
  out: list[str] = []
  i = 0
  while i < len(parts):
    repeat = next((len(out) - j for j in range(len(out))
                   if parts[i:i + len(out) - j] == out[j:]), 0)
    if repeat:
      i += repeat
      continue
    out.append(parts[i])
    i += 1
  return "/".join(out)


def _compiled(step: Callable, args: Sequence[Any], donate: tuple[int, ...],
              policy: Policy, root: str
              ) -> tuple[int, tuple[XlaBuffer, ...], float | None, list[Finding]]:
  """XLA's figure, its buffers live at its peak (module paths as ``live``
  gives them), the FLOPs it counts in the compiled step, and what it says of
  itself."""
  lowered = jax.jit(step, donate_argnums=donate).lower(*args)
  compiled, scheduled = xla_buffers.compile_with_buffers(lowered)
  stats = compiled.memory_analysis()
  if stats is None:
    raise ValueError(
        f"compile=True reads XLA's memory analysis, which the "
        f"{jax.default_backend()!r} backend does not provide; drop "
        "compile=True and use the prediction.")
  total = int(stats.argument_size_in_bytes + stats.output_size_in_bytes
              + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  buffers = [b if b.phase == "argument" else
             dataclasses.replace(b, module_path=_clean_path(b.module_path, root))
             for b in scheduled.live]
  listed = sum(b.nbytes for b in buffers)
  if listed != total:
    # So that the list sums to XLA's figure: XLA's temporary allocation holds
    # more than the buffers live at its peak (packing), or less, when XLA
    # lays temporaries in output buffers not yet written (or in donated
    # arguments), which memory_analysis() counts once, as outputs.
    label = ("(packing: temporary allocation beyond the buffers listed)"
             if total > listed else
             "(temporaries laid in output or donated buffers)")
    buffers.append(XlaBuffer(label, "", total - listed, "packing", "", ""))
  found = []
  if scheduled.rematerialized:
    found.append(Finding(
        f"XLA rematerialized {scheduled.rematerialized} instruction(s) of the "
        f"step itself ('.remat' in the compiled program) under "
        f"{policy.name!r}: the program was over the memory limit XLA was "
        "given, so XLA's figure is after its own recomputation.",
        "xla-remat", policy.name))
  if (jax.default_backend() == "cpu"
      and _CPU_FLAG not in os.environ.get("XLA_FLAGS", "")):
    found.append(Finding(
        f"XLA's figure was compiled with XLA:CPU's {cpu_scheduler_setting()}; "
        "the prediction models the scheduler off.", "cpu-scheduler",
        policy.name))
  return total, tuple(buffers), _flops_of(compiled), found


def _flops_of(compiled: Any) -> float | None:
  """The FLOPs XLA's cost analysis counts in a compiled program (a dict, or
  a list of one per program on some releases; None where it has none)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (backends without a cost analysis)
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  flops = cost.get("flops") if isinstance(cost, dict) else None
  return float(flops) if flops is not None else None


def _merged_recompute(program: TracedProgram, policy: Policy,
                      xla_flops: float | None) -> list[Finding]:
  """Where XLA merged the policy's recomputation into the forward pass.

  XLA:CPU (the jax 0.10 one, in plain ``jax.checkpoint`` regions) removes
  remat's optimization barriers and then merges the recomputation with the
  forward pass it repeats: the compiled step keeps what the policy
  recomputes. Its FLOPs say so: about those of a step without remat, not
  those plus the recomputation. A count far under the program's matmuls
  (kernels XLA cannot count) decides nothing.
  """
  if xla_flops is None:
    return []
  baseline = program.baseline_step_flops
  recompute = program.recompute_flops(policy)
  if (baseline <= 0 or recompute < MERGE_MIN_SHARE * baseline
      or xla_flops < (1 - MERGE_MIN_SHARE) * baseline
      or xla_flops >= baseline + recompute / 2):
    return []
  return [Finding(
      f"XLA merged the recomputation of {policy.name!r} into the forward pass: "
      f"the compiled step runs {xla_flops:.3g} FLOPs, about the "
      f"{baseline:.3g} of a step without remat, not the "
      f"{baseline + recompute:.3g} its recomputation implies. The compiled "
      "step keeps what the policy recomputes, so XLA's figure is above the "
      "prediction (which follows the policy) and the policy saves less on "
      "this backend than it says; measure on the device you train on.",
      "xla-merged-recompute", policy.name)]


def _limit_findings(result: Peak) -> list[Finding]:
  """Where the peak passes the device's memory limit (a GPU's allocator
  limit, where XLA starts rematerializing on its own)."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 (backends without memory statistics)
    stats = {}
  limit = stats.get("bytes_limit")
  figure = result.xla_bytes or result.bytes
  if not limit or figure <= limit:
    return []
  return [Finding(
      f"the step's peak under {result.policy!r} ({format_bytes(figure)}) is "
      f"above this device's memory limit ({format_bytes(limit)}, "
      f"{jax.devices()[0].device_kind}): XLA rematerializes on its own from "
      "there, or the step runs out of memory; choose a plan that fits "
      "(plan(..., bounds='peak')).", "device-limit", result.policy)]
