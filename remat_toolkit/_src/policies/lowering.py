"""Where a policy is lowered: the one path from a region's policy to JAX's.

Every remat region decides what it runs under once, when it is traced
(:func:`region_policy`, with its key from :mod:`~remat_toolkit._src.
region_keys`: a per-region policy gives the policy of that key), and carries
that decision to :func:`region_jax_policy`, whose result is what
``jax.checkpoint(policy=...)`` gets. The analyzer uses the one documented hook,
:func:`substitute_ambient`, to trace a model once and read it under every
policy: inside it, regions that read the ambient policy lower to a marker
(one per region key, :class:`RegionMarkers`) that the analyzer later
replaces, while regions with a policy of their own lower as always.

Example:
  >>> import jax
  >>> from remat_toolkit._src.policies import lowering
  >>> region = lowering.region_policy("save-everything", "layers_0")
  >>> lowering.region_jax_policy(region, names=())
  ... # doctest: +ELLIPSIS
  <function everything_saveable at ...>
  >>> with lowering.substitute_ambient(jax.checkpoint_policies.dots_saveable):
  ...   region = lowering.region_policy(None)
  >>> lowering.region_jax_policy(region) is jax.checkpoint_policies.dots_saveable
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import ambient
from remat_toolkit._src.policies import findings
from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import BOUNDARY_ONLY
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.resolve import PolicyLike

__all__ = ["RegionPolicy", "region_policy", "region_jax_policy",
           "substitute_ambient", "RegionMarkers",
           "warn_if_unmatched"]



class RegionMarkers:
  """One placeholder JAX policy per region key, made as regions are traced.

  The analyzer traces a model with these standing in for the ambient policy
  (:func:`substitute_ambient`): each region's marker says which key it has,
  so a per-region policy can later be lowered region by region.

  Example:
    >>> from remat_toolkit._src.policies.lowering import RegionMarkers
    >>> markers = RegionMarkers()
    >>> a = markers.marker("layers_0")
    >>> a is markers.marker("layers_0"), a in markers, markers.key_of(a)
    (True, True, 'layers_0')
  """

  def __init__(self):
    self._by_key: dict[str, Any] = {}
    self._keys: dict[int, str] = {}
    self._inputs: dict[str, tuple[bool, ...]] = {}
    self._unseen: dict[str, int] = {}

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

  def note_inputs(self, key: str, mask: tuple[bool, ...],
                  unseen: int = 0) -> None:
    """Records which inputs region ``key`` names when its policy moves them
    (:mod:`~remat_toolkit._src.policies.region_inputs`), and how many it
    cannot tell (``unseen``: arguments of a ``jax.jit`` the program calls,
    never moved); a later record of the key (``rt.repolicy``'s, made from the
    whole program) replaces an earlier one."""
    self._inputs[key] = mask
    self._unseen[key] = unseen

  def inputs_of(self, key: str) -> tuple[bool, ...] | None:
    """What :meth:`note_inputs` recorded for ``key``, if anything."""
    return self._inputs.get(key)

  def unseen_of(self, key: str) -> int:
    """The ``unseen`` :meth:`note_inputs` recorded for ``key`` (0 if
    nothing)."""
    return self._unseen.get(key, 0)


@dataclasses.dataclass(frozen=True)
class RegionPolicy:
  """What one remat region being traced runs under, decided once.

  Made by :func:`region_policy` when the region is traced and carried to
  everything that needs it (its names, its lowering, its warnings), so a
  policy is resolved once per region trace.

  Attributes:
    key: the region's key (:mod:`~remat_toolkit._src.policies.region_keys`).
    policy: the policy the region runs under (a per-region policy's entry
      for ``key``, ``boundary-only`` when it has none: ``uncovered``); None
      while the analyzer traces it (:func:`substitute_ambient`).
    substitute: the analyzer's stand-in, when it traces the region.
    uncovered: the per-region policy that names no policy for ``key``.
  """

  key: str
  policy: Policy | None
  substitute: Any = None
  uncovered: Policy | None = None

  @property
  def reads_names(self) -> bool:
    """Whether the lowering (or its warning) depends on the region's names:
    a policy of ours with name patterns."""
    return (self.policy is not None and not self.policy.is_jax_policy
            and bool(self.policy.patterns))


def region_policy(policy: PolicyLike, region: str | None = None
                  ) -> RegionPolicy:
  """Decides what a region being traced runs under.

  Args:
    policy: the region's own policy (anything
      :func:`~remat_toolkit._src.policies.resolve.resolve_policy` accepts), or None
      for the ambient one, read now.
    region: the region's key (:func:`region_keys.region_key`); default: the
      next position, as for a region of a plain function.

  Returns:
    The :class:`RegionPolicy`.
  """
  key = region_keys.region_key(None) if region is None else region
  substitute = ambient.current().substitute
  if policy is None and substitute is not None:
    return RegionPolicy(key, None, substitute=substitute)
  resolved = resolve.resolve_policy(policy)
  chosen = resolved.for_region(key)  # itself, unless it is per region
  if chosen is None:
    return RegionPolicy(key, BOUNDARY_ONLY, uncovered=resolved)
  return RegionPolicy(key, chosen)


def region_jax_policy(region: RegionPolicy, names: Iterable[str] | None = None,
                      inputs: tuple[bool, ...] | None = None,
                      unseen: int = 0) -> Any:
  """The JAX policy object for one remat region.

  Args:
    region: what the region runs under (:func:`region_policy`).
    names: checkpoint names present in the region, to expand glob patterns
      against (default: every name known).
    inputs: which of the region's inputs it names when its policy moves
      them (:func:`~remat_toolkit._src.policies.region_inputs.input_mask`), recorded
      with the analyzer's marker.
    unseen: how many of its inputs cannot be told computed or given
      (:func:`~remat_toolkit._src.policies.region_inputs.unseen_inputs`),
      recorded with them.

  Returns:
    An object accepted by ``jax.checkpoint(policy=...)``.
  """
  substitute = region.substitute
  if isinstance(substitute, RegionMarkers):
    if inputs is not None:
      substitute.note_inputs(region.key, inputs, unseen)
    return substitute.marker(region.key)
  if substitute is not None:
    return substitute
  if region.policy is None:  # region_policy leaves it out only for a substitute
    raise RuntimeError(f"region {region.key!r} has neither a policy nor a "
                       "stand-in; please report this.")
  if region.uncovered is not None:
    _warn_if_uncovered(region.uncovered, region.key)
  return region.policy.to_jax(names, region=region.key)


@contextlib.contextmanager
def substitute_ambient(jax_policy: Any) -> Iterator[None]:
  """Regions reading the ambient policy lower to ``jax_policy`` inside.

  The analyzer's hook: it traces a model once with :class:`RegionMarkers`
  here (each region gets the marker of its key), then replaces the markers
  by each policy's lowering on the traced program. Any other JAX policy is
  given to every region as it is. Regions without a module path are
  numbered from ``#0`` inside.
  """
  with ambient.entered(substitute=jax_policy), \
      compat.trace_key_part("substitute", jax_policy):
    yield


def _warn_if_uncovered(policy: Policy, key: str) -> None:
  """Says once when a per-region policy has nothing for a region."""
  findings.warn_at_trace(findings.uncovered_regions(
      policy.name, [key], positional=region_keys.is_positional(key)))


def warn_if_unmatched(region: RegionPolicy, names: Iterable[str],
                      where: str = "a remat region") -> None:
  """Says once when a region's policy's name patterns match nothing present.

  A policy whose names are all absent from a region keeps nothing: a silent
  no-op is the failure users hit most.
  """
  policy = region.policy
  if policy is None:
    return  # the analyzer's trace, or an uncovered region (said apart)
  present = sorted(names)
  if not policy.patterns or any(policy.matches(n) for n in present):
    return
  findings.warn_at_trace(findings.keeps_none(policy.name, policy.patterns,
                                             present, where), stacklevel=4)
