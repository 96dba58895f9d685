"""The ambient policy, read at trace time by every region left without one.

Example:
  >>> import remat_toolkit as rt
  >>> rt.current_policy().name
  'boundary-only'
  >>> with rt.use_policy("save-ffn"):
  ...   rt.current_policy().name
  'save-ffn'
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

from remat_toolkit._src import catalog
from remat_toolkit._src import compat
from remat_toolkit._src import region_keys
from remat_toolkit._src import resolve
from remat_toolkit._src.policy import Policy

__all__ = ["use_policy", "current_policy", "DEFAULT_POLICY"]

#: The ambient policy when no ``use_policy`` block is active.
DEFAULT_POLICY = "boundary-only"

_ambient: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "remat_toolkit_ambient_policy", default=None)


@contextlib.contextmanager
def use_policy(policy: str | Policy | Callable[..., Any]) -> Iterator[Policy]:
  """Sets the ambient policy for regions traced inside the block.

  Regions built with ``policy=None`` read it when they are traced, so one
  model can be compared under many policies without editing it. The policy
  is part of JAX's jit cache key, as ``jax.default_matmul_precision`` is: a
  function jitted with ``jax.jit``, ``nn.jit`` or ``nnx.jit`` runs under the
  policy active when it is called, traced again when that policy changes
  and not when an equal one returns. Under a
  per-region policy (a plan made with ``per_layer=True``) each region takes
  the policy of its own key: its module path, or for regions of plain
  functions its position among those traced inside the block (``#0``,
  ``#1``, ...).

  Args:
    policy: a policy name, a :class:`Policy`, a plan from
      :func:`remat_toolkit.plan`, or a raw JAX policy (what every
      ``policy=`` accepts, except None: the ambient policy is what this
      sets).

  Yields:
    The resolved :class:`Policy`.

  Raises:
    ValueError: for an unknown name (before the block runs).
    TypeError: for anything else (None included).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> f = rt.remat(lambda x: jnp.sin(rt.tag(jnp.sin(x), "ffn.up")))
    >>> with rt.use_policy("save-ffn") as policy:
    ...   policy.name, float(jax.grad(f)(0.0))
    ('save-ffn', 1.0)
  """
  if policy is None:
    raise TypeError("use_policy takes a policy name, a remat_toolkit.Policy or "
                    "a jax.checkpoint_policies policy, got None; e.g. "
                    "rt.use_policy('save-ffn').")
  resolved = resolve.resolve_policy(policy, argument="use_policy's policy")
  _warn_without_trace_key()
  token = _ambient.set(resolved)
  try:
    with region_keys.counting(), compat.trace_key_part("ambient", resolved):
      yield resolved
  finally:
    _ambient.reset(token)


def _warn_without_trace_key() -> None:
  """Says once that jitted functions keep the policy of their first trace."""
  global _warned_without_key
  if compat.has_trace_key_context() or _warned_without_key:
    return
  _warned_without_key = True
  warnings.warn(
      "This JAX has no jax.make_user_context, so the ambient policy is not "
      "part of jit cache keys: a function jitted (jax.jit, nn.jit, nnx.jit) "
      "and traced before this use_policy block keeps the policy of its first "
      "trace. Jit it anew inside the block, or upgrade JAX.",
      UserWarning, stacklevel=4)


_warned_without_key = False


def current_policy() -> Policy:
  """The ambient policy (``boundary-only`` unless ``use_policy`` set one).

  Regions built with ``policy=None`` lower this policy when they are traced.

  Returns:
    The :class:`Policy` of the innermost active :func:`use_policy` block, or
    the catalogue's ``boundary-only``.

  Example:
    >>> import jax
    >>> import remat_toolkit as rt
    >>> with rt.use_policy(jax.checkpoint_policies.dots_saveable):
    ...   rt.current_policy().is_jax_policy
    True
  """
  return _ambient.get() or catalog.get_policy(DEFAULT_POLICY)
