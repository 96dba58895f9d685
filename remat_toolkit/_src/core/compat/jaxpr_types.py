"""Jaxpr classes and primitives, and what a tracer says of its value.

The classes and primitives of ``jax.extend.core`` (hijax's call primitive,
through which remat3 runs, where this JAX has it); a jaxpr's constants,
evaluation and dead-code elimination on either representation (from jax
0.11 ``ClosedJaxpr`` is ``Jaxpr`` itself); JAX's own list of residuals; and
what the tracer beneath the transformations says of a value: whether the
traced function computed it, whose remat body is being traced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src.interpreters import partial_eval as _pe
from jax.extend import core as _ext_core

# Declared before the import that may fail, so the name's type admits the
# None a release without it leaves.
_call_hi_primitive_p: _core.Primitive | None

try:  # remat3 runs through hijax's call primitive; older releases lack it.
  from jax._src.hijax import call_hi_primitive_p as _call_hi_primitive_p
except ImportError:  # pragma: no cover - depends on the JAX release
  _call_hi_primitive_p = None

__all__ = [
    "Jaxpr", "ClosedJaxpr", "JaxprEqn", "Var", "Literal", "DropVar", "name_p",
    "remat_p", "close_jaxpr", "jaxpr_consts", "eval_jaxpr", "dce_jaxpr",
    "saved_residuals", "inner_jaxpr", "rewrap_jaxpr", "is_jaxpr_value", "abstractify",
    "is_tracer", "is_computed", "is_nested_jit_argument", "enclosing_remat",
]


Jaxpr = _ext_core.Jaxpr
#: From jax 0.11 on this is ``Jaxpr`` itself: a jaxpr carries its constants.
ClosedJaxpr = _ext_core.ClosedJaxpr
JaxprEqn = _ext_core.JaxprEqn
Var = _ext_core.Var
Literal = _ext_core.Literal
DropVar = _ext_core.DropVar

name_p = _ext_core.primitives.name_p
remat_p = _ext_core.primitives.remat_p


def close_jaxpr(jaxpr: Jaxpr, consts: list[Any]) -> ClosedJaxpr:
  """``jaxpr`` with ``consts`` attached, on either jaxpr representation."""
  return ClosedJaxpr(jaxpr, list(consts))


def jaxpr_consts(value: Any) -> list[Any]:
  """The constants a (closed) jaxpr carries; ``[]`` for an open one."""
  return list(getattr(value, "consts", None) or [])


def eval_jaxpr(jaxpr: Jaxpr, consts: list[Any], *args: Any) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` with its constants bound to ``consts``."""
  return _core.eval_jaxpr(jaxpr, consts, *args)


def dce_jaxpr(jaxpr: Jaxpr, used_outputs: list[bool]) -> Jaxpr:
  """``jaxpr`` without the equations no used output depends on."""
  live, _ = _pe.dce_jaxpr(jaxpr, used_outputs, instantiate=True)
  return live


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[Any, str]]:
  """JAX's own list of residuals (aval, description) for ``fn(*args)``.

  The data source of the public ``jax.ad_checkpoint.print_saved_residuals``.
  """
  return _ad_checkpoint.saved_residuals(fn, *args)


def inner_jaxpr(value: Any) -> Jaxpr:
  """The open jaxpr of a jaxpr-valued equation parameter."""
  return value.jaxpr if isinstance(value, ClosedJaxpr) else value


def rewrap_jaxpr(old: Any, new_inner: Jaxpr) -> Any:
  """``new_inner`` in the form ``old`` had (closed with its consts, or open)."""
  if ClosedJaxpr is Jaxpr:  # jax >= 0.11: one class, constants ride along
    consts = jaxpr_consts(old)
    if jaxpr_consts(new_inner) or not consts:
      return new_inner
    return close_jaxpr(new_inner, consts)
  if isinstance(old, ClosedJaxpr):
    return close_jaxpr(new_inner, old.consts)
  return new_inner


def is_jaxpr_value(value: Any) -> bool:
  """Whether an equation parameter is a (closed) jaxpr."""
  return isinstance(value, (Jaxpr, ClosedJaxpr))


# ---------------------------------------------------------------- tracers

def abstractify(x: Any) -> Any:
  """The abstract value (shape, dtype, weak type) of an array or tracer."""
  from jax import api_util
  return api_util.shaped_abstractify(x)


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is a value of some ongoing trace."""
  return isinstance(x, jax.core.Tracer)


def _is_remat_body(traced_for: str) -> bool:
  """Whether a trace's ``traced_for`` is a ``jax.checkpoint`` body's (it
  reads ``remat3`` with ``jax_remat3`` on)."""
  return traced_for.startswith("checkpoint") or traced_for == "remat3"


def _traced_for(tracer: Any) -> str:
  info = getattr(getattr(tracer._trace, "frame", None), "debug_info", None)
  return str(getattr(info, "traced_for", ""))


def _inner_value(tracer: Any) -> Any:
  """The value a transformation's tracer carries one level down (a JVP or
  linearize tracer's primal, a batch tracer's batched value), or None."""
  if hasattr(tracer, "primal"):
    return tracer.primal
  if type(tracer).__name__ == "BatchTracer":
    return tracer.val
  return None


def is_computed(x: Any) -> bool:
  """Whether ``x`` is a value the traced function computed.

  False for a value the function was given: an argument of the ``jit`` (or
  of the ``jax.checkpoint``) being traced, a closed-over constant, a plain
  array. A loop's carry or a branch's operand is taken as computed (the
  trace cannot tell which), and so is anything this module cannot see
  into: the answer decides whether a region's input is worth moving to the
  host, and moving a computed one is what every release did before.

  Read from the tracer beneath the transformations (``jax.grad``,
  ``jax.vmap``): the equation that produced it, or the frame it is an input
  of; detected, so a JAX without these answers True.
  """
  if not isinstance(x, jax.core.Tracer):
    return False
  base = x
  while not isinstance(base, _pe.DynamicJaxprTracer):
    base = _inner_value(base)
    if base is None:
      return True
    if not isinstance(base, jax.core.Tracer):
      return True  # eager differentiation: no program to be an input of
  parent = getattr(base, "parent", True)
  if parent is not None:
    return True
  frame = getattr(base._trace, "frame", None)
  if not any(v is base.val for v in getattr(frame, "invars", ())):
    return False  # a constant the trace closed over
  traced_for = _traced_for(base)
  return not (traced_for == "jit" or _is_remat_body(traced_for))


def is_nested_jit_argument(x: Any) -> bool:
  """Whether ``x`` is an argument of a ``jax.jit`` that a program being
  traced calls (a jitted layer inside the traced function).

  :func:`is_computed` answers False for it, as for any argument of the
  ``jit`` being traced; but here its caller may have computed it, and JAX
  traces the jitted function once for every call with the same types, so
  which cannot be seen from inside. Only a program that has computed
  something by then counts: a jit traced before its caller's program holds
  any equation (``make_jaxpr`` of a jitted step, ``jax.grad`` of a jitted
  loss inside a jitted step) can only be given the caller's own arguments.
  Detected: False where the traces carry no parent.
  """
  if not isinstance(x, jax.core.Tracer):
    return False
  base = x
  while not isinstance(base, _pe.DynamicJaxprTracer):
    base = _inner_value(base)
    if base is None or not isinstance(base, jax.core.Tracer):
      return False
  frame = getattr(base._trace, "frame", None)
  if (getattr(base, "parent", None) is not None or _traced_for(base) != "jit"
      or not any(v is base.val for v in getattr(frame, "invars", ()))):
    return False
  outer = getattr(base._trace, "parent_trace", None)
  while outer is not None:  # through grad/vmap traces to the programs'
    frame = getattr(outer, "frame", None)
    if (isinstance(outer, _pe.DynamicJaxprTrace)
        and getattr(frame, "tracing_eqns", True)):
      return True
    outer = getattr(outer, "parent_trace", None)
  return False


def enclosing_remat() -> str | None:
  """The function (``name at file:line``) whose remat body is being traced
  right now, or None: the innermost trace is a ``jax.checkpoint`` body's
  (``nn.remat`` and ``nnx.remat`` trace through it) in either remat mode.

  Only the innermost trace is seen: a region inside a loop inside a remat
  body is not.
  """
  trace = getattr(getattr(_core, "trace_ctx", None), "trace", None)
  info = getattr(getattr(trace, "frame", None), "debug_info", None)
  traced_for = str(getattr(info, "traced_for", ""))
  if not _is_remat_body(traced_for):
    return None
  return str(getattr(info, "func_src_info", None) or "a remat body")
