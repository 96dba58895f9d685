"""One path for a policy: what every ``policy=`` argument accepts.

Every entry point (the transforms, the analyzer, the planner, the benchmark,
the checks and the command line) turns what the user gave into a
:class:`Policy` here, so a name, a Policy and a raw JAX policy are accepted
alike everywhere, and refused with the same message.

The baselines results are measured against are constants of the code, not
catalogue entries: a user file called ``save-everything.toml`` cannot change
what "% of save-everything" means.

Example:
  >>> from remat_toolkit._src import resolve
  >>> resolve.resolve_policy("save_qkv_proj").name
  'save-qkv'
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src import catalog
from remat_toolkit._src import context
from remat_toolkit._src.policy import Policy
from remat_toolkit._src.policy import unrunnable_reason

__all__ = ["SAVE_EVERYTHING", "BOUNDARY_ONLY", "PolicyLike", "resolve_policy",
           "resolve_policies", "require_runnable", "split_runnable",
           "unrunnable_reason"]

#: The reference every "% of save-everything" figure is relative to.
SAVE_EVERYTHING = Policy(
    name="save-everything", save_everything=True,
    description="keep every residual: no recomputation, the most memory")

#: The least a remat region can keep: its inputs.
BOUNDARY_ONLY = Policy(
    name="boundary-only",
    description="keep only each region's inputs: the least memory, the most "
                "recomputation")

#: What every ``policy=`` argument accepts (a plan from ``rt.plan`` too).
PolicyLike = str | Policy | Callable[..., Any] | Any | None

_ACCEPTED = ("a policy name (see remat_toolkit.list_policies()), a "
             "remat_toolkit.Policy, a plan from remat_toolkit.plan, a "
             "jax.checkpoint_policies policy or None (the ambient policy)")


def resolve_policy(policy: PolicyLike, *, argument: str = "policy") -> Policy:
  """The :class:`Policy` meant by ``policy``.

  Args:
    policy: a catalogue name or alias, a :class:`Policy`, a plan (its
      policy), a raw JAX policy (wrapped by :meth:`Policy.from_jax`), or
      None for the ambient policy.
    argument: the parameter's name, for the error message.

  Returns:
    The resolved :class:`Policy`.

  Raises:
    ValueError: for an unknown name (listing the closest ones).
    TypeError: for anything else.
  """
  if policy is None:
    return context.current_policy()
  if isinstance(policy, (str, Policy)):
    return catalog.get_policy(policy)
  planned = _planned_policy(policy)
  if planned is not None:
    return planned
  if callable(policy):
    return Policy.from_jax(policy)
  raise TypeError(f"{argument} must be {_ACCEPTED}, got {policy!r}; e.g. "
                  f"{argument}='save-attention'.")


def _planned_policy(value: Any) -> Policy | None:
  """The policy of a plan (what ``rt.plan`` returns), else None."""
  from remat_toolkit._src.plan_result import Plan  # results import resolve
  return value.policy if isinstance(value, Plan) else None


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
  if isinstance(policies, (str, Policy)) or _planned_policy(policies) or (
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
    if item is None or not (isinstance(item, (str, Policy)) or callable(item)
                            or _planned_policy(item) is not None):
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
  runnable, skipped = [], {}
  for p in policies:
    reason = unrunnable_reason(p)
    if reason is None:
      runnable.append(p)
    else:
      skipped[p.name] = reason
  return runnable, skipped
