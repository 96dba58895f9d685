"""Where a policy is lowered: the one path from a region's policy to JAX's.

Every remat region calls :func:`region_jax_policy` when it is traced; the
result is what ``jax.checkpoint(policy=...)`` gets. The analyzer uses the one
documented hook, :func:`substitute_ambient`, to trace a model once and read it
under every policy: inside it, regions that read the ambient policy lower to
the given JAX policy (a marker the analyzer later replaces), while regions
with a policy of their own lower as always.

Example:
  >>> import jax
  >>> from remat_toolkit._src import lowering
  >>> lowering.region_jax_policy("save-everything", names=())
  ... # doctest: +ELLIPSIS
  <function everything_saveable at ...>
  >>> with lowering.substitute_ambient(jax.checkpoint_policies.dots_saveable):
  ...   lowering.region_jax_policy(None) is jax.checkpoint_policies.dots_saveable
  True
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

from remat_toolkit._src import resolve
from remat_toolkit._src.resolve import PolicyLike

__all__ = ["region_jax_policy", "substitute_ambient", "ambient_substituted",
           "warn_if_unmatched", "silence_unmatched_warnings",
           "reset_unmatched_warnings"]

_substitute: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "remat_toolkit_ambient_substitute", default=None)
_silenced: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remat_toolkit_unmatched_warnings_silenced", default=False)
_warned: set[tuple[str, frozenset[str]]] = set()


def region_jax_policy(policy: PolicyLike, names: Iterable[str] | None = None
                      ) -> Any:
  """The JAX policy object for one remat region, decided at trace time.

  Args:
    policy: the region's own policy (anything
      :func:`~remat_toolkit._src.resolve.resolve_policy` accepts), or None
      for the ambient one.
    names: checkpoint names present in the region, to expand glob patterns
      against (default: every name known).

  Returns:
    An object accepted by ``jax.checkpoint(policy=...)``.
  """
  if policy is None and _substitute.get() is not None:
    return _substitute.get()
  return resolve.resolve_policy(policy).to_jax(names)


@contextlib.contextmanager
def substitute_ambient(jax_policy: Any) -> Iterator[None]:
  """Regions reading the ambient policy lower to ``jax_policy`` inside.

  The analyzer's hook: it traces a model once with a marker here, then
  replaces the marker by each policy's lowering on the traced program.
  """
  token = _substitute.set(jax_policy)
  try:
    yield
  finally:
    _substitute.reset(token)


def ambient_substituted() -> bool:
  """Whether :func:`substitute_ambient` is active (the analyzer is tracing)."""
  return _substitute.get() is not None


def reset_unmatched_warnings() -> None:
  """Forgets which unmatched-name warnings were given, so they warn again."""
  _warned.clear()


def warn_if_unmatched(policy: PolicyLike, names: Iterable[str],
                      where: str = "a remat region") -> None:
  """Warns once when a policy's name patterns match nothing present.

  A policy whose names are all absent from a region keeps nothing: a silent
  no-op is the failure users hit most.
  """
  if _silenced.get() or (policy is None and ambient_substituted()):
    return
  resolved = resolve.resolve_policy(policy)
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


@contextlib.contextmanager
def silence_unmatched_warnings(active: bool = True) -> Iterator[None]:
  """:func:`warn_if_unmatched` says nothing inside (when ``active``).

  For entry points whose result already carries the same finding (see
  :func:`remat_toolkit._src.findings.unmatched_names_warning`), so that it
  is raised once, not again each time a region is traced.
  """
  token = _silenced.set(bool(active) or _silenced.get())
  try:
    yield
  finally:
    _silenced.reset(token)
