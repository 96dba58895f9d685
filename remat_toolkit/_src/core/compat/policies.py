"""JAX's checkpoint policies: built once, used as markers, and read.

Every JAX policy the toolkit lowers to is built here (:func:`jax_policy`),
as are the markers only identity tells apart; what a policy of JAX's own
does (whether it offloads), and whether a policy keeps its meaning under
``jax_remat3`` on this release.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
from jax._src import ad_checkpoint as _ad_checkpoint

from remat_toolkit._src.core.compat.flags import remat3_enabled
from remat_toolkit._src.core.compat.probes import remat3_calls_policies
from remat_toolkit._src.core.compat.probes import remat3_offloads

__all__ = [
    "jax_policy", "policy_marker", "jax_policy_offloads", "offloading_unsupported",
    "offloading_refusal", "remat3_honours",
]


#: Public constructor names of ``jax.checkpoint_policies`` the package uses.
_CONSTRUCTORS = frozenset({
    "everything_saveable", "nothing_saveable", "dots_saveable",
    "dots_with_no_batch_dims_saveable", "save_only_these_names",
    "save_any_names_but_these", "save_and_offload_only_these_names",
    "offload_dot_with_no_batch_dims"})


@functools.cache
def jax_policy(constructor: str, *args: Any) -> Any:
  """One of JAX's own checkpoint policies, the same object for equal args.

  JAX 0.10 and 0.11 build policies as classes with value equality; 0.12
  returns a fresh closure on each call. Memoising the construction gives
  every release the identity and equality the analyzer's caches (and JAX's
  own, keyed on the policy) rely on.

  Args:
    constructor: a name in ``jax.checkpoint_policies``. A constant policy
      (``dots_saveable``) takes no ``args``; a constructor takes positional
      ``args``, or for ``save_and_offload_only_these_names`` the four
      keyword values in order (saved, offloaded, src, dst).

  Returns:
    The policy object to pass as ``jax.checkpoint(policy=...)``.
  """
  if constructor not in _CONSTRUCTORS:
    raise ValueError(f"{constructor!r} is not a checkpoint policy constructor "
                     f"remat-toolkit lowers to; use one of "
                     f"{sorted(_CONSTRUCTORS)}.")
  cp = jax.checkpoint_policies
  value = getattr(cp, constructor)
  if constructor == "save_and_offload_only_these_names":
    saved, offloaded, src, dst = args
    return value(names_which_can_be_saved=list(saved),
                 names_which_can_be_offloaded=list(offloaded),
                 offload_src=src, offload_dst=dst)
  if constructor in ("save_only_these_names", "save_any_names_but_these",
                     "offload_dot_with_no_batch_dims"):
    return value(*args)
  if args:
    raise ValueError(f"{constructor} takes no arguments, got {args!r}.")
  return value


def policy_marker(label: str) -> Any:
  """A fresh policy object to mark regions with, accepted by every JAX.

  A ``save_only_these_names`` policy naming a name no program uses: both
  remat implementations of every supported release store it on the region
  untouched, and it behaves as ``nothing_saveable`` if it is ever run.
  Two calls never return the same object, so identity tells markers apart.
  """
  return jax.checkpoint_policies.save_only_these_names(
      f"__remat_toolkit_{label}_{os.urandom(6).hex()}__")


def jax_policy_offloads(policy: Any) -> bool:
  """Whether a policy of JAX's own moves residuals to host memory.

  Known from the constructor it came from: a class up to jax 0.11, a
  closure named after its constructor from 0.12.
  """
  names = (type(policy).__name__, getattr(policy, "__qualname__", "") or "")
  return any("offload" in n.lower() for n in names)


def offloading_unsupported() -> bool:
  """Whether an offloading policy would silently do nothing right now.

  True while ``jax_remat3`` is on and this JAX's remat3 ignores offloading.
  """
  return remat3_enabled() and not remat3_offloads()


def offloading_refusal() -> str:
  """Why offloading cannot run now, naming this JAX and what to do."""
  return (f"jax_remat3 is on and jax {jax.__version__}'s remat3 ignores "
          "offloading policies (it would silently recompute everything); turn "
          "it off with jax.config.update('jax_remat3', False), or use a JAX "
          "whose remat3 offloads")


def _policy_classes() -> tuple[type, ...]:
  names = ("SaveOnlyTheseNames", "SaveAnyNamesButThese", "DotsSaveable",
           "SaveAndOffloadOnlyTheseNames", "OffloadDotWithNoBatchDims")
  return tuple(t for t in (getattr(_ad_checkpoint, n, None) for n in names)
               if isinstance(t, type))


def remat3_honours(policy: Any) -> bool:
  """Whether ``policy`` keeps its meaning under ``jax_remat3`` on this JAX.

  Where remat3 calls policies (jax 0.12), every policy does. Elsewhere only
  JAX's own policy classes and ``everything_saveable`` / ``nothing_saveable``
  are understood; any other callable silently becomes full recomputation.
  """
  if policy is None or remat3_calls_policies():
    return True
  cp = jax.checkpoint_policies
  return (isinstance(policy, _policy_classes())
          or policy is cp.everything_saveable
          or policy is cp.nothing_saveable)
