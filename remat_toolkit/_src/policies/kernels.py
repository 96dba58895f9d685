"""Naming a ``custom_vjp`` kernel's residuals from outside: :func:`tag_residuals`.

A memory-efficient kernel (flash attention, a fused loss) is a
``jax.custom_vjp`` whose forward rule returns the residuals its backward rule
reads: for flash attention q, k, v, the output and the softmax statistics.
A remat policy can only keep what carries a name, and a name on the kernel's
*output* does not keep the statistics: the backward rule reads its own
forward's residuals, so the whole forward runs again in the backward pass.
Splash attention solves this with ``residual_checkpoint_name``, a name put on
each residual inside its forward rule; :func:`tag_residuals` does the same for
any ``custom_vjp`` kernel without editing it.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @jax.custom_vjp
  ... def square(x):
  ...   return x * x
  >>> square.defvjp(lambda x: (x * x, (2 * x,)), lambda res, g: (res[0] * g,))
  >>> named = rt.tag_residuals(square, "kernel.res")
  >>> float(jax.grad(named)(3.0))
  6.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import tags

__all__ = ["tag_residuals"]


def tag_residuals(kernel: Callable[..., Any], name: str) -> Callable[..., Any]:
  """A copy of a ``jax.custom_vjp`` kernel whose forward rule names its residuals.

  The copy has the same primal function, backward rule and
  ``nondiff_argnums``; its forward rule calls the kernel's and passes each
  array residual it *computes* through ``checkpoint_name(r, name)``, as
  splash attention's ``residual_checkpoint_name`` does. A policy that keeps
  ``name`` (``save_only_these_names(name)``, or a built-in policy whose
  ``save`` list holds it) then keeps the kernel's residuals, and the kernel's
  forward does not run again in the backward pass. Residuals that are the
  kernel's own inputs are left alone (whoever made an input decides whether
  it is kept), and the kernel's output, when it is also a residual, comes out
  carrying the name, so the value is kept once.

  Which remat implementation sees the names: with ``jax_remat3`` off, a
  policy sees inside the forward rule and honours them. With ``jax_remat3``
  on, JAX treats a ``custom_vjp`` as opaque and ignores names inside it
  unless ``jax_custom_vjp3`` is on (JAX 0.12; on 0.10 not even then). The
  copy is made with ``jax.custom_vjp`` when ``tag_residuals`` is called; on
  releases where ``jax.custom_vjp`` picks its implementation when it is made
  (0.10), the ``jax_custom_vjp3`` setting in force then is the copy's.

  Args:
    kernel: a function decorated with ``jax.custom_vjp`` whose ``defvjp``
      has been called.
    name: the checkpoint name given to the residuals, e.g.
      ``"attn.context"`` (the built-in policies that keep the attention
      context then keep them).

  Returns:
    The named copy, a ``jax.custom_vjp`` function called like ``kernel``.

  Raises:
    TypeError: ``kernel`` is not a ``jax.custom_vjp`` function (or has no
      rule defined with ``defvjp``), or ``name`` is not a string.
    ValueError: ``name`` is empty or blank.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @jax.custom_vjp
    ... def sin2(x):
    ...   return jnp.sin(x) * 2
    >>> def sin2_fwd(x):
    ...   return jnp.sin(x) * 2, (jnp.cos(x),)
    >>> sin2.defvjp(sin2_fwd, lambda res, g: (2 * res[0] * g,))
    >>> named = rt.tag_residuals(sin2, "kernel.res")
    >>> jax.ad_checkpoint.print_saved_residuals(named, jnp.ones(3))
    ... # doctest: +ELLIPSIS
    f32[3] named 'kernel.res' from ...
    >>> float(jax.grad(named)(0.0))
    2.0
  """
  rules, fwd, bwd = _rules_of(kernel)
  _check_name(name)

  def named_fwd(*args: Any) -> tuple[Any, Any]:
    out, residuals = fwd(*args)
    inputs = _input_ids(args)
    named: dict[int, Any] = {}

    def name_one(leaf: Any) -> Any:
      if not _is_array(leaf) or id(leaf) in inputs:
        return leaf
      if id(leaf) not in named:
        named[id(leaf)] = tags.tag(leaf, name)
      return named[id(leaf)]

    residuals = jax.tree.map(name_one, residuals)
    # The output the backward rule reads as a residual is the output the
    # caller uses: one named value, so that keeping it keeps it once.
    out = jax.tree.map(lambda leaf: named.get(id(leaf), leaf), out)
    return out, residuals

  copy = jax.custom_vjp(rules.fun, nondiff_argnums=rules.nondiff_argnums)
  copy.defvjp(named_fwd, bwd, symbolic_zeros=rules.symbolic_zeros,
              optimize_remat=rules.optimize_remat)
  return copy


def _rules_of(kernel: Any) -> tuple[compat.CustomVJPRules, Callable[..., Any],
                                    Callable[..., Any]]:
  """``kernel``'s rules, with its forward and backward rule (both defined)."""
  rules = compat.custom_vjp_rules(kernel)
  if rules is None:
    raise TypeError(
        f"tag_residuals takes a jax.custom_vjp function, got {kernel!r}; "
        "pass the custom_vjp kernel itself (not a function or jit that calls "
        "it), or name a plain function's values with rt.tag inside it.")
  if rules.fwd is None or rules.bwd is None or rules.unsupported:
    how = (f"its rules are defined with {rules.unsupported}"
           if rules.unsupported else "it has no rule yet")
    raise TypeError(
        f"tag_residuals needs a custom_vjp whose rules are defined with "
        f"defvjp(fwd, bwd); {how} ({kernel!r}). Call kernel.defvjp(fwd, bwd) "
        "first, or put checkpoint_name on the residuals inside its forward "
        "rule.")
  return rules, rules.fwd, rules.bwd


def _check_name(name: Any) -> None:
  if not isinstance(name, str):
    raise TypeError(
        f"tag_residuals name must be a string, got {name!r}; e.g. "
        "'attn.context'.")
  if not name.strip():
    raise ValueError(
        f"tag_residuals name must be a non-empty checkpoint name, got "
        f"{name!r}; e.g. 'attn.context', which the built-in attention "
        "policies keep.")


def _input_ids(args: tuple[Any, ...]) -> set[int]:
  """Identities of the arrays the forward rule was called with."""
  ids = set()
  for leaf in jax.tree.leaves(args):
    ids.add(id(leaf))
    # With symbolic_zeros the rule receives CustomVJPPrimal(value, perturbed).
    value = getattr(leaf, "value", None)
    if value is not None:
      ids.add(id(value))
  return ids


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, jax.Array) or compat.is_tracer(leaf)
