"""One path for a policy: what every ``policy=`` argument accepts.

Every entry point (the transforms, the analyzer, the planner, the benchmark,
the checks and the command line) turns what the user gave into a
:class:`Policy` here, so a name, a Policy, a plan and a raw JAX policy are
accepted alike everywhere, and refused with the same message. None means
the ambient policy: the one :func:`use_policy` sets, read when a region is
traced (:data:`BOUNDARY_ONLY` outside any block).

The baselines results are measured against are constants of the code
(:data:`BOUNDARY_ONLY`, :data:`SAVE_EVERYTHING`), which no policy file can
replace.

Example:
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.policies import resolve
  >>> resolve.resolve_policy("save_qkv_proj").name
  'save-qkv'
  >>> rt.current_policy().name
  'boundary-only'
  >>> with rt.use_policy("save-ffn"):
  ...   resolve.resolve_policy(None).name
  'save-ffn'
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Protocol
from typing import TypeGuard

from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import ambient
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.policy import BOUNDARY_ONLY
from remat_toolkit._src.policies.policy import SAVE_EVERYTHING
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.policy import policy_of
from remat_toolkit._src.policies.policy import unrunnable_reason

__all__ = ["SAVE_EVERYTHING", "BOUNDARY_ONLY", "PolicyLike", "CarriesPolicy", "resolve_policy",
           "resolve_policies", "require_runnable", "split_runnable",
           "unrunnable_reason", "use_policy", "current_policy",
           "is_policy_file", "declared_policy"]



#: What every ``policy=`` argument accepts (a plan from ``rt.plan`` too).
class CarriesPolicy(Protocol):
  """What holds a policy: a plan from ``remat_toolkit.plan`` (known by its
  ``policy``, so this layer needs no planner)."""

  @property
  def policy(self) -> Policy: ...


PolicyLike = str | os.PathLike[str] | Policy | CarriesPolicy | Callable[..., Any] | None
"""What every ``policy=`` accepts: a catalogue name or alias
(``"save-ffn"``), the path of a ``.toml`` policy file, a :class:`Policy`, a
plan from ``remat_toolkit.plan`` (its policy), a ``jax.checkpoint_policies``
policy, or None for the ambient policy (``remat_toolkit.use_policy``)."""

_ACCEPTED = ("a policy name (see remat_toolkit.list_policies()), the path of "
             "a .toml policy file, a remat_toolkit.Policy, a plan from "
             "remat_toolkit.plan, a jax.checkpoint_policies policy or None "
             "(the ambient policy)")


def is_policy_file(value: Any) -> TypeGuard[str | os.PathLike]:
  """Whether ``value`` names a policy file rather than a catalogue entry:
  a path object, or a string ending in ``.toml`` or holding a separator."""
  if isinstance(value, os.PathLike):
    return True
  return isinstance(value, str) and (
      value.endswith(".toml") or "/" in value or "\\" in value)


def _read_policy_file(path: str | os.PathLike) -> Policy:
  if not Path(path).is_file():
    raise FileNotFoundError(
        f"Policy file {str(path)!r} does not exist; give a policy name (see "
        "remat_toolkit.list_policies() or `remat-toolkit list`) or the path "
        "of a .toml policy file.")
  return catalog.parse_policy_file(path)


def resolve_policy(policy: PolicyLike, *, argument: str = "policy") -> Policy:
  """The :class:`Policy` meant by ``policy``.

  Args:
    policy: a catalogue name or alias, the path of a ``.toml`` policy file
      (read, not registered), a :class:`Policy`, a plan (its policy), a raw
      JAX policy (wrapped by :meth:`Policy.from_jax`), or None for the
      ambient policy.
    argument: the parameter's name, for the error message.

  Returns:
    The resolved :class:`Policy`.

  Raises:
    ValueError: for an unknown name (listing the closest ones), or a
      malformed policy file.
    FileNotFoundError: for a policy file that does not exist.
    TypeError: for anything else.
  """
  if policy is None:
    return current_policy()
  if is_policy_file(policy):
    return _read_policy_file(policy)
  if isinstance(policy, (str, Policy)):
    return catalog.get_policy(policy)
  planned = policy_of(policy)
  if planned is not None:
    return planned
  if callable(policy):
    return Policy.from_jax(policy)
  raise TypeError(f"{argument} must be {_ACCEPTED}, got {policy!r}; e.g. "
                  f"{argument}='save-attention'.")


def declared_policy(policy: PolicyLike, *, argument: str = "policy"
                    ) -> PolicyLike:
  """What a region declared with ``policy`` holds until it is traced.

  Checks ``policy`` now (as :func:`resolve_policy` does). A name stays a
  name, resolved when the region is traced, since the catalogue may change
  in between; a policy file is read now, once, and its :class:`Policy`
  held, so that no trace reads the file again. None stays None (the
  ambient policy).
  """
  if policy is None:
    return None
  resolved = resolve_policy(policy, argument=argument)
  return resolved if is_policy_file(policy) else policy


def resolve_policies(policies: Sequence[PolicyLike] | None, *,
                     default: Sequence[PolicyLike] | None = None,
                     argument: str = "policies") -> list[Policy]:
  """The policies a many-policy entry point runs, in order, without repeats.

  Args:
    policies: a list of what :func:`resolve_policy` accepts, or None.
    default: used when ``policies`` is None (default: the whole catalogue).
    argument: the parameter's name, for the error message.

  Returns:
    Distinct policies (by name), in the order given.

  Raises:
    TypeError: if ``policies`` is a single policy rather than a list, or
      holds something :func:`resolve_policy` refuses.
    ValueError: for an unknown name, or an empty list.
  """
  if isinstance(policies, (str, Policy)) or policy_of(policies) or (
      policies is not None and callable(policies)):
    raise TypeError(f"{argument} must be a list, got {policies!r}; write "
                    f"{argument}=[{policies!r}].")
  if policies is None:
    policies = catalog.list_policies() if default is None else default
  try:
    items = list(policies)
  except TypeError:
    raise TypeError(f"{argument} must be a list of policies, got "
                    f"{policies!r}; e.g. {argument}=['boundary-only', "
                    "'save-attention'].") from None
  if not items:
    raise ValueError(f"{argument} is empty; give at least one policy, e.g. "
                     f"{argument}=['save-attention'].")
  unique: dict[str, Policy] = {}
  for item in items:
    if item is None or not (isinstance(item, (str, Policy, os.PathLike))
                            or callable(item)
                            or policy_of(item) is not None):
      raise TypeError(
          f"{argument} must hold policy names, remat_toolkit.Policy values, "
          f"plans or jax.checkpoint_policies policies, got {item!r} in "
          f"{items!r}; e.g. "
          f"{argument}=['boundary-only', 'save-attention'].")
    resolved = resolve_policy(item, argument=argument)
    unique.setdefault(resolved.key, resolved)
  return list(unique.values())


def require_runnable(policy: Policy) -> Policy:
  """Returns ``policy``, or raises when it cannot run on this JAX now.

  Raises:
    ValueError: the message of :func:`unrunnable_reason`.
  """
  reason = unrunnable_reason(policy)
  if reason is not None:
    raise ValueError(reason)
  return policy


def split_runnable(policies: Sequence[Policy]
                   ) -> tuple[list[Policy], dict[str, str]]:
  """Splits policies into those that can run now and those that cannot.

  Returns:
    ``(runnable, skipped)``, ``skipped`` mapping each name to the reason of
    :func:`unrunnable_reason`, for the result's table and warnings.
  """
  runnable: list[Policy] = []
  # Each reason is a Finding, typed as the str it is: callers add plain ones.
  skipped: dict[str, str] = {}
  for p in policies:
    reason = unrunnable_reason(p)
    if reason is None:
      runnable.append(p)
    else:
      skipped[p.name] = Finding(reason, "unrunnable", p.name)
  return runnable, skipped


# ------------------------------------------------------------ the ambient policy

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
  resolved = resolve_policy(policy, argument="use_policy's policy")
  _warn_without_trace_key()
  with ambient.entered(policy=resolved), \
      compat.trace_key_part("ambient", resolved):
    yield resolved


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
    :data:`BOUNDARY_ONLY`.

  Example:
    >>> import jax
    >>> import remat_toolkit as rt
    >>> with rt.use_policy(jax.checkpoint_policies.dots_saveable):
    ...   rt.current_policy().is_jax_policy
    True
  """
  return ambient.current().policy or BOUNDARY_ONLY
