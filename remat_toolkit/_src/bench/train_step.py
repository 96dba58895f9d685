"""The training step the benchmark compiles: loss, gradients, one update.

:func:`make_train_step` is the step (with gradient accumulation over
micro-batches); :func:`compile_step` jits, donates and compiles it under one
policy; :func:`memory_figures` reads XLA's memory analysis of the result.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from remat_toolkit._src.bench.train_step import make_train_step
  >>> sgd = optax.sgd(0.5)
  >>> step = make_train_step(lambda w, b: jnp.mean((b * w[None]) ** 2), sgd)
  >>> w = jnp.ones(2)
  >>> (w, _), loss = step((w, sgd.init(w)), jnp.ones((1, 2)))
  >>> float(loss), w.tolist()
  (1.0, [0.5, 0.5])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from remat_toolkit._src.bench.workload import Workload
from remat_toolkit._src.bench.workload import check_positive_int
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import Policy

__all__ = ["make_train_step", "compile_step", "memory_figures", "MEMORY_FIGURE"]

#: What ``peak_bytes`` is, for the notes of every result that reports it.
MEMORY_FIGURE = ("argument + output + temp - alias bytes of the compiled "
                 "training step (XLA memory_analysis)")


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
  check_positive_int("grad_accum", grad_accum)

  def step(state: tuple[Any, Any], batch: Any) -> tuple[tuple[Any, Any], jax.Array]:
    params, opt_state = state
    loss, grads = _loss_and_grads(loss_fn, params, batch, grad_accum)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def compile_step(workload: Workload, policy: Policy, grad_accum: int,
                 batch: Any) -> tuple[Any, float]:
  """The jitted, donated step compiled under ``policy``, and its compile time.

  Args:
    workload: the loss, parameters and optimizer.
    policy: the ambient policy while the step is traced.
    grad_accum: micro-batches per update.
    batch: the (abstract or concrete) batch the step is lowered for.
  """
  step = make_train_step(workload.loss_fn, workload.optimizer,
                         grad_accum=grad_accum)
  params = _abstract(workload.params)
  state = (params, jax.eval_shape(workload.optimizer.init, params))
  start = time.perf_counter()
  # A fresh function per policy: jit caches traces by function, and the
  # ambient policy is read only while tracing.
  with resolve.use_policy(policy):
    compiled = jax.jit(step, donate_argnums=0).lower(state, _abstract(batch)).compile()
  return compiled, time.perf_counter() - start


def memory_figures(compiled: Any) -> dict[str, int]:
  """XLA's memory analysis of a compiled step, with ``peak_bytes`` added.

  ``peak_bytes`` is :data:`MEMORY_FIGURE`.
  """
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


def _accumulator_dtype(dtype: Any) -> Any:
  # Summing micro-batch gradients in bf16 loses bits a single batch keeps.
  return jnp.promote_types(dtype, jnp.float32)


def _split_micro_batches(batch: Any, grad_accum: int) -> Any:
  return jax.tree.map(
      lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]),
      batch)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
