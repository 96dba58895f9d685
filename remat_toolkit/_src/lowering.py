"""Where a policy is lowered: the one path from a region's policy to JAX's.

Every remat region calls :func:`region_jax_policy` when it is traced, with
its key (:mod:`~remat_toolkit._src.region_keys`); the result is what
``jax.checkpoint(policy=...)`` gets. A per-region policy lowers the policy of
that key. The analyzer uses the one documented hook,
:func:`substitute_ambient`, to trace a model once and read it under every
policy: inside it, regions that read the ambient policy lower to a marker
(one per region key, :class:`RegionMarkers`) that the analyzer later
replaces, while regions with a policy of their own lower as always.

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

from remat_toolkit._src import compat
from remat_toolkit._src import region_keys
from remat_toolkit._src import resolve
from remat_toolkit._src.resolve import PolicyLike

__all__ = ["region_jax_policy", "substitute_ambient", "ambient_substituted",
           "RegionMarkers", "warn_if_unmatched",
           "silence_unmatched_warnings", "reset_unmatched_warnings"]

_substitute: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "remat_toolkit_ambient_substitute", default=None)
_silenced: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remat_toolkit_unmatched_warnings_silenced", default=False)
_warned: set[tuple[str, frozenset[str]]] = set()


class RegionMarkers:
  """One placeholder JAX policy per region key, made as regions are traced.

  The analyzer traces a model with these standing in for the ambient policy
  (:func:`substitute_ambient`): each region's marker says which key it has,
  so a per-region policy can later be lowered region by region.

  Example:
    >>> from remat_toolkit._src.lowering import RegionMarkers
    >>> markers = RegionMarkers()
    >>> a = markers.marker("layers_0")
    >>> a is markers.marker("layers_0"), a in markers, markers.key_of(a)
    (True, True, 'layers_0')
  """

  def __init__(self):
    self._by_key: dict[str, Any] = {}
    self._keys: dict[int, str] = {}
    self._inputs: dict[str, tuple[bool, ...]] = {}

  def marker(self, key: str) -> Any:
    """The marker of region ``key`` (made on first use)."""
    if key not in self._by_key:
      marker = compat.policy_marker("ambient_region")
      self._by_key[key] = marker
      self._keys[id(marker)] = key
    return self._by_key[key]

  def __contains__(self, policy: Any) -> bool:
    key = self._keys.get(id(policy))
    return key is not None and self._by_key[key] is policy

  def key_of(self, policy: Any) -> str:
    """The region key a marker stands for."""
    return self._keys[id(policy)]

  def note_inputs(self, key: str, mask: tuple[bool, ...]) -> None:
    """Records which inputs region ``key`` names when its policy moves them
    (:mod:`~remat_toolkit._src.region_inputs`)."""
    self._inputs[key] = mask

  def inputs_of(self, key: str) -> tuple[bool, ...] | None:
    """What :meth:`note_inputs` recorded for ``key``, if anything."""
    return self._inputs.get(key)


def region_jax_policy(policy: PolicyLike, names: Iterable[str] | None = None,
                      region: str | None = None,
                      inputs: tuple[bool, ...] | None = None) -> Any:
  """The JAX policy object for one remat region, decided at trace time.

  Args:
    policy: the region's own policy (anything
      :func:`~remat_toolkit._src.resolve.resolve_policy` accepts), or None
      for the ambient one.
    names: checkpoint names present in the region, to expand glob patterns
      against (default: every name known).
    region: the region's key (:func:`region_keys.region_key`); default: the
      next position, as for a region of a plain function.
    inputs: which of the region's inputs it names when its policy moves
      them (:func:`~remat_toolkit._src.region_inputs.input_mask`), recorded
      with the analyzer's marker.

  Returns:
    An object accepted by ``jax.checkpoint(policy=...)``.
  """
  key = region_keys.region_key(None) if region is None else region
  substitute = _substitute.get()
  if policy is None and substitute is not None:
    if isinstance(substitute, RegionMarkers):
      if inputs is not None:
        substitute.note_inputs(key, inputs)
      return substitute.marker(key)
    return substitute
  resolved = resolve.resolve_policy(policy)
  if resolved.is_per_region:
    _warn_if_uncovered(resolved, key)
  return resolved.to_jax(names, region=key)


@contextlib.contextmanager
def substitute_ambient(jax_policy: Any) -> Iterator[None]:
  """Regions reading the ambient policy lower to ``jax_policy`` inside.

  The analyzer's hook: it traces a model once with :class:`RegionMarkers`
  here (each region gets the marker of its key), then replaces the markers
  by each policy's lowering on the traced program. Any other JAX policy is
  given to every region as it is. Regions without a module path are
  numbered from ``#0`` inside.
  """
  token = _substitute.set(jax_policy)
  try:
    with region_keys.counting(), compat.trace_key_part("substitute", jax_policy):
      yield
  finally:
    _substitute.reset(token)


def ambient_substituted() -> bool:
  """Whether :func:`substitute_ambient` is active (the analyzer is tracing)."""
  return _substitute.get() is not None


def _warn_if_uncovered(policy: Any, key: str) -> None:
  """Warns once when a per-region policy has nothing for a region."""
  if _silenced.get() or policy.for_region(key) is not None:
    return
  marker = (f"region:{policy.key}", frozenset({key}))
  if marker in _warned:
    return
  _warned.add(marker)
  keys = [k for k, _ in policy.regions]
  shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more"
                                 if len(keys) > 6 else "")
  why = ""
  if region_keys.is_positional(key):
    why = (" Regions of plain functions are named by position in the order "
           "they are traced inside one use_policy block, so trace each "
           "planned function in a use_policy block of its own.")
  warnings.warn(
      f"Per-region policy {policy.name!r} has no policy for remat region "
      f"{key!r} (it names {shown}), so that region keeps only its inputs, as "
      f"boundary-only does.{why} Plan this model (rt.plan(..., "
      "per_layer=True)) or add a pattern such as '*' to the policy's "
      "regions.", UserWarning, stacklevel=4)


def reset_unmatched_warnings() -> None:
  """Forgets which unmatched-name warnings were given, so they warn again."""
  _warned.clear()


def warn_if_unmatched(policy: PolicyLike, names: Iterable[str],
                      where: str = "a remat region",
                      region: str | None = None) -> None:
  """Warns once when a policy's name patterns match nothing present.

  A policy whose names are all absent from a region keeps nothing: a silent
  no-op is the failure users hit most. A per-region policy is judged by the
  policy of ``region``.
  """
  if _silenced.get() or (policy is None and ambient_substituted()):
    return
  resolved = resolve.resolve_policy(policy)
  if resolved.is_per_region:
    resolved = resolved.for_region(region) if region is not None else None
    if resolved is None:
      return  # _warn_if_uncovered says so when the region is lowered
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
