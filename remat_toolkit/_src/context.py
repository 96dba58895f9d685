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
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

from remat_toolkit._src import catalog
from remat_toolkit._src.policy import Policy

__all__ = ["use_policy", "current_policy", "region_policy", "DEFAULT_POLICY",
           "PolicyLike"]

#: The ambient policy when no ``use_policy`` block is active.
DEFAULT_POLICY = "boundary-only"

#: What every ``policy=`` argument accepts: a name, a Policy, a raw JAX
#: policy callable (passed through untouched), or None for the ambient one.
PolicyLike = str | Policy | Callable[..., Any] | None

_ambient: contextvars.ContextVar[Policy | None] = contextvars.ContextVar(
    "remat_toolkit_ambient_policy", default=None)
# Set by the analyzer: every region that reads the ambient policy gets this
# JAX policy object instead, so the traced program can be re-used per policy.
_region_override: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "remat_toolkit_region_override", default=None)
_warned: set[tuple[str, frozenset[str]]] = set()


def resolve(policy: PolicyLike) -> Policy | Callable[..., Any]:
  """A :class:`Policy` for a name or Policy; a raw JAX policy passes through.

  Raises:
    TypeError: for anything else (``None`` included: resolve it first).
    ValueError: for an unknown name.
  """
  if isinstance(policy, (str, Policy)):
    return catalog.get_policy(policy)
  if callable(policy):
    return policy
  raise TypeError(
      f"policy must be a policy name, a remat_toolkit.Policy or a "
      f"jax.checkpoint_policies policy, got {policy!r}; e.g. "
      "policy='save-attention'.")


@contextlib.contextmanager
def use_policy(policy: str | Policy) -> Iterator[Policy]:
  """Sets the ambient policy for regions traced inside the block.

  Regions built with ``policy=None`` read it when they are traced, so one
  model can be compared under many policies without editing it.

  Args:
    policy: a policy name or :class:`Policy`.

  Yields:
    The resolved :class:`Policy`.

  Raises:
    ValueError: for an unknown name (before the block runs).
    TypeError: for anything that is not a name or Policy.
  """
  if not isinstance(policy, (str, Policy)):
    raise TypeError(
        f"use_policy takes a policy name or remat_toolkit.Policy, got "
        f"{policy!r}; e.g. rt.use_policy('save-ffn').")
  resolved = catalog.get_policy(policy)
  token = _ambient.set(resolved)
  try:
    yield resolved
  finally:
    _ambient.reset(token)


def current_policy() -> Policy:
  """The ambient policy (``boundary-only`` unless ``use_policy`` set one)."""
  return _ambient.get() or catalog.get_policy(DEFAULT_POLICY)


def region_policy(policy: PolicyLike, names: Iterable[str] | None = None) -> Any:
  """The JAX policy object for one remat region, decided at trace time.

  Args:
    policy: the region's explicit policy, or None for the ambient one.
    names: checkpoint names present in the region, if known.

  Returns:
    An object accepted by ``jax.checkpoint(policy=...)``.
  """
  if policy is None:
    override = _region_override.get()
    if override is not None:
      return override
    policy = current_policy()
  resolved = resolve(policy)
  if isinstance(resolved, Policy):
    return resolved.to_jax(names)
  return resolved


@contextlib.contextmanager
def override_ambient_regions(marker: Any) -> Iterator[None]:
  """Gives every ambient region ``marker`` as its JAX policy (for analysis)."""
  token = _region_override.set(marker)
  try:
    yield
  finally:
    _region_override.reset(token)


def warn_if_unmatched(policy: PolicyLike, names: Iterable[str],
                      where: str = "a remat region") -> None:
  """Warns once when a policy's name patterns match nothing present.

  A policy whose names are all absent from a region keeps nothing: a silent
  no-op is the failure users hit most.
  """
  if policy is None:
    if _region_override.get() is not None:
      return
    policy = current_policy()
  if not isinstance(policy, (str, Policy)):
    return
  resolved = catalog.get_policy(policy)
  present = frozenset(names)
  if not resolved.patterns or any(resolved.matches(n) for n in present):
    return
  key = (resolved.key, present)
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(
      f"Policy {resolved.name!r} names {list(resolved.patterns)} but none of "
      f"them is present in {where}, which has "
      f"{sorted(present) if present else 'no checkpoint names'}; the region "
      "will keep only its inputs. Tag tensors with remat_toolkit.tag(x, name) "
      "or choose a policy whose names exist.", UserWarning, stacklevel=3)
