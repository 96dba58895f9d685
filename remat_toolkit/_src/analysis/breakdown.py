"""Where a training step's memory goes, and whether remat can help.

Remat only trades activation memory for recomputation. When parameters,
gradients or optimizer state take most of the memory, no policy rescues an
out-of-memory error; :func:`memory_breakdown` says which case you are in, and
how far remat could move the activations (``boundary-only`` to
``save-everything``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def layer(w, x):
  ...   return jnp.tanh(x @ w)
  >>> loss = lambda w, x: layer(w, x).sum()
  >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  >>> x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
  >>> b = rt.memory_breakdown(loss, w, x, optimizer="adamw")
  >>> b.param_bytes, b.optimizer_bytes, b.dominant
  (262144, 524292, 'optimizer state')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from remat_toolkit._src.analysis.report import build_report
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.analysis.trace import cpu_scheduler_setting
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.results.analysis import kept_bytes
from remat_toolkit._src.results.breakdown import Breakdown

__all__ = ["memory_breakdown", "OPTIMIZERS", "resolve_optimizer"]

#: Optimizers accepted by name (``optimizer="adamw"``); the learning rate does
#: not change the state's size.
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adamw": lambda: optax.adamw(1e-3),
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-3),
    "sgd": lambda: optax.sgd(1e-3),
    "momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-3),
}



def resolve_optimizer(optimizer: Any) -> tuple[Any, str]:
  """An optax ``GradientTransformation`` and a display name.

  Args:
    optimizer: a name from :data:`OPTIMIZERS` or anything with an ``init``
      method (an optax ``GradientTransformation``).

  Raises:
    ValueError: for an unknown name.
    TypeError: for anything else.
  """
  if isinstance(optimizer, str):
    key = optimizer.strip().lower().replace("_", "")
    if key not in OPTIMIZERS:
      raise ValueError(
          f"Unknown optimizer {optimizer!r}; known names are "
          f"{sorted(OPTIMIZERS)}, or pass an optax GradientTransformation.")
    return OPTIMIZERS[key](), key
  if callable(getattr(optimizer, "init", None)):
    cls = type(optimizer)
    # optax's transformations are all one NamedTuple class
    # (GradientTransformationExtraArgs): its name says nothing to a user.
    if cls.__module__.split(".")[0] == "optax":
      return optimizer, "optax optimizer"
    return optimizer, cls.__name__
  raise TypeError(
      f"optimizer must be an optax GradientTransformation or a name such as "
      f"'adamw', got {optimizer!r}.")


def _tree_bytes(tree: Any, *, inexact_only: bool = False) -> int:
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      leaf = np.asarray(leaf)
    dtype = np.dtype(leaf.dtype)
    # jnp.issubdtype knows bfloat16 and the float8 types are floating.
    if inexact_only and not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
      continue
    total += int(np.prod(leaf.shape, dtype=np.int64)) * dtype.itemsize
  return total


def memory_breakdown(fn: Callable[..., Any], params: Any, *batch: Any,
                     optimizer: Any = None,
                     policy: PolicyLike = None,
                     compile: bool = False) -> Breakdown:
  """Bytes of parameters, gradients, optimizer state and activations.

  The model is traced once (nothing is allocated: pass
  ``jax.ShapeDtypeStruct`` leaves or ``jax.eval_shape`` results); the same
  trace gives the activations under ``policy``, ``boundary-only`` and
  ``save-everything``.

  Args:
    fn: ``fn(params, *batch)`` returns a scalar loss.
    params: the parameters (gradients are taken of its floating leaves).
    *batch: the other arguments.
    optimizer: an optax ``GradientTransformation`` or a name from
      :data:`OPTIMIZERS` (e.g. ``"adamw"``); its state's size comes from
      ``jax.eval_shape(optimizer.init, params)``.
    policy: a name, a :class:`Policy`, a raw ``jax.checkpoint_policies``
      policy, or None for the ambient policy.
    compile: also compile ``jit(grad(fn))`` for XLA's temporary bytes (slow).

  Returns:
    A :class:`Breakdown` (its ``warnings``, each raised once as a
    ``UserWarning``, are those of :func:`remat_toolkit.analyze`).

  Raises:
    ValueError: unknown policy or optimizer name, an offloading policy this
      JAX cannot run now (under ``jax_remat3``), non-scalar loss.
    TypeError: a policy of the wrong type, a non-array argument, an
      optimizer without ``init``, ``compile`` not True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def layer(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, x: layer(w, x).sum()
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> b = rt.memory_breakdown(loss, w, x, optimizer="sgd", policy="save-ffn")
    >>> b.param_bytes, b.activation_bytes, b.boundary_only_bytes
    (256, 128, 0)
  """
  check_flag("compile", compile)
  resolved = resolve.require_runnable(resolve.resolve_policy(policy))
  opt, opt_name = (None, None) if optimizer is None else resolve_optimizer(optimizer)
  program = TracedProgram(fn, (params, *batch))
  report = build_report(program, resolved, compile=compile)
  # The range remat spans is the built-in constants', whatever the
  # catalogue holds under their names: their kept bytes, nothing to report.
  least = kept_bytes(program.residuals(resolve.BOUNDARY_ONLY))
  most = kept_bytes(program.residuals(resolve.SAVE_EVERYTHING))
  opt_bytes = 0
  if opt is not None:
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    opt_bytes = _tree_bytes(jax.eval_shape(opt.init, abstract))
  xla_temp, note = None, ""
  if compile and report.xla:
    xla_temp = int(report.xla["temp_bytes"])
    note = report.xla.get("backend", "")
    if note == "cpu":
      note = f"cpu, {cpu_scheduler_setting()}"
  result = Breakdown(
      param_bytes=_tree_bytes(params),
      grad_bytes=_tree_bytes(params, inexact_only=True),
      optimizer_bytes=opt_bytes,
      activation_bytes=report.activation_bytes,
      offloaded_bytes=report.offloaded_bytes,
      input_bytes=_tree_bytes(batch),
      boundary_only_bytes=least,
      save_everything_bytes=most,
      recompute_percent=report.recompute_percent,
      policy=resolved.name, optimizer=opt_name,
      remat_regions=program.regions, xla_temp_bytes=xla_temp, xla_note=note,
      warnings=report.warnings)
  warn_once(result.warnings)
  return result
