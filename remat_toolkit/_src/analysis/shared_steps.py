"""Lowerings that decide alike share one traced step.

Comparing policies traces the training step once per lowering, each a
``jax.vjp`` whose partial evaluation is most of a comparison's time. Under
JAX's default remat (remat2), partial evaluation reads a region's policy
only by calling it on an equation: two lowerings whose JAX policies answer
every question alike, on the same program, trace the same step. A step is
traced with its policies behind an :class:`AskedPolicy` that records what
JAX asked; :meth:`Asked.alike` then tells whether another lowering would
answer the same (on GPT-2, three of the catalogue's 25 policies decide as
another does).

Example:
  >>> import jax
  >>> lowered = (jax.checkpoint_policies.nothing_saveable,) * 2
  >>> asked = Asked.of(lowered, (None, None), sharing(lowered))
  >>> asked.policies[0] is asked.policies[1]  # one recorder per policy object
  True
  >>> asked.alike(lowered, (None, None), sharing(lowered))  # nothing asked yet
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["Asked", "AskedPolicy", "same_answer", "sharing"]


def sharing(lowered: Sequence[Any]) -> tuple[int, ...]:
  """Per region key, the first key given the same JAX policy object."""
  first: dict[int, int] = {}
  return tuple(first.setdefault(id(p), i) for i, p in enumerate(lowered))


class AskedPolicy:
  """A JAX policy that records every question JAX asks it, and its answer."""

  def __init__(self, policy: Any):
    self.policy = policy
    self.asked: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []

  def __call__(self, *args: Any, **params: Any) -> Any:
    answer = self.policy(*args, **params)
    self.asked.append((args, params, answer))
    return answer


def same_answer(a: Any, b: Any) -> bool:
  try:
    return type(a) is type(b) and bool(a == b)
  except Exception:  # noqa: BLE001 - an answer that cannot be compared
    return False


@dataclasses.dataclass(frozen=True)
class Asked:
  """A traced lowering's JAX policies, each behind an :class:`AskedPolicy`
  (one per distinct policy object, shared as the lowering shares it), with
  the inputs its regions name."""

  policies: tuple[Any, ...]
  masks: tuple[tuple[bool, ...] | None, ...]
  shared: tuple[int, ...]

  @classmethod
  def of(cls, lowered: Sequence[Any], masks: tuple[tuple[bool, ...] | None, ...],
         shared: tuple[int, ...]) -> Asked:
    asking: dict[int, AskedPolicy] = {}
    policies = tuple(asking.setdefault(id(p), AskedPolicy(p)) for p in lowered)
    return cls(policies, masks, shared)

  def alike(self, lowered: Sequence[Any],
            masks: tuple[tuple[bool, ...] | None, ...],
            shared: tuple[int, ...]) -> bool:
    """Whether ``lowered`` answers every question this lowering's policies
    were asked as they did, on the same program, shared alike."""
    if masks != self.masks or shared != self.shared:
      return False
    for i, first in enumerate(self.shared):
      if first != i:  # the same objects on both sides: checked at ``first``
        continue
      asked, policy = self.policies[i], lowered[i]
      if policy is asked.policy:
        continue
      for args, params, answer in asked.asked:
        try:
          again = policy(*args, **params)
        except Exception:  # noqa: BLE001 - it would not trace alike
          return False
        if not same_answer(answer, again):
          return False
    return True
