"""Traces of remat regions, kept per call signature, and their replay.

A region of a plain function is traced once per call signature (tree
structure, static values, avals), as ``jax.checkpoint`` itself re-uses
traces; the policy is not part of the trace, so it is still decided at each
call and ``use_policy`` keeps working; the ambient policy is part of the
key all the same, as it is of JAX's jit keys, since a region may call
jitted functions or nested regions that read it. Replaying a trace re-emits the region
without running the model's Python again, which is how a region whose policy
needs its checkpoint names is traced once (to read them) and checkpointed
once.

Example:
  >>> import jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.transform import trace_cache
  >>> traced = trace_cache.trace(lambda x: rt.tag(x * 2, "ffn.up"),
  ...                            (jnp.ones(3),))
  >>> sorted(traced.names), traced.replay()(jnp.ones(3)).tolist()
  (['ffn.up'], [2.0, 2.0, 2.0])
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr

__all__ = ["Trace", "trace", "call_key", "cached_trace", "fresh_traces",
           "is_array"]

_fresh_traces: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remat_toolkit_fresh_traces", default=False)


@contextlib.contextmanager
def fresh_traces() -> Iterator[None]:
  """Runs every region's Python again inside the block (no cached traces).

  ``verify`` traces twice this way to see whether a function reads Python
  state while it is traced.
  """
  token = _fresh_traces.set(True)
  try:
    yield
  finally:
    _fresh_traces.reset(token)


def is_array(x: Any) -> bool:
  """Whether a call's leaf is traced (an array) rather than static."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class Trace:
  """One traced region: its program, its output structure, its names."""

  closed: Any
  out_tree: Any
  names: frozenset[str]

  def replay(self) -> Callable[..., Any]:
    """The region as a function that re-emits the trace (no model Python)."""

    def replayed(*inputs):
      outs = compat.eval_jaxpr(self.closed.jaxpr, self.closed.consts,
                               *jax.tree_util.tree_leaves(inputs))
      return jax.tree_util.tree_unflatten(self.out_tree, outs)

    return replayed


def trace(body: Callable[..., Any], inputs: tuple) -> Trace:
  """Traces ``body(*inputs)`` once with ``jax.make_jaxpr``.

  Names come from the jaxpr, so tags made with ``rt.tag`` and with JAX's
  own ``checkpoint_name`` are both found, inside nested scans too.
  """
  leaves = jax.tree_util.tree_leaves(inputs)
  in_tree = jax.tree_util.tree_structure(inputs)
  closed, out_shape = jax.make_jaxpr(
      lambda *xs: body(*jax.tree_util.tree_unflatten(in_tree, xs)),
      return_shape=True)(*leaves)
  return Trace(closed, jax.tree_util.tree_structure(out_shape),
               _jaxpr.names_in(closed.jaxpr))


def call_key(args: tuple, kwargs: dict, static_argnums: tuple[int, ...],
             static_argnames: tuple[str, ...]) -> Any:
  """What a region's trace depends on: structure, static values, avals.

  None inside :func:`fresh_traces`, or when a static value cannot be hashed
  (the call is then traced anew).
  """
  if _fresh_traces.get():
    return None
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  whole: tuple[tuple[int | str, Any], ...] = tuple(
      (i, args[i]) for i in static_argnums if i < len(args))
  whole += tuple((k, kwargs[k]) for k in static_argnames if k in kwargs)
  parts = tuple(("array", compat.abstractify(x)) if is_array(x)
                else ("static", type(x), x) for x in leaves)
  # The flag changes what a checkpoint name traces to; the ambient policy
  # (the trace key) what nested regions and jitted calls trace to.
  key = (treedef, whole, parts, compat.remat3_enabled(), compat.trace_key())
  try:
    hash(key)
  except TypeError:
    return None
  return key


def cached_trace(cache: dict, key: Any, body: Callable[..., Any],
                 inputs: tuple) -> Trace:
  """The trace of ``body(*inputs)`` from ``cache`` under ``key``, or a new one.

  A key of None is never cached; nor is a trace that closes over another
  trace's values (an outer ``jit``'s tracers), which would leak them.
  """
  cached = cache.get(key) if key is not None else None
  if cached is not None:
    return cached
  traced = trace(body, inputs)
  if key is not None and not any(map(compat.is_tracer, traced.closed.consts)):
    cache[key] = traced
  return traced
