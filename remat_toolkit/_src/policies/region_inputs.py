"""Region inputs named ``block.input``, where the region's policy moves them.

A remat region always keeps its inputs: they are what the backward pass
recomputes from. To move them to the host (MaxText offloads
``decoder_layer_input``), a policy must be able to select them by name, so
every region the toolkit makes names its floating-point array inputs
:data:`INPUT_NAME` as the first thing its body does, on a model nobody here
wrote as on ours. It does so only where the region's lowered policy offloads
that name: anywhere else the name would be a copy that
``everything_saveable`` keeps twice, so a region that does not ask for it is
exactly the ``jax.checkpoint`` a user would write by hand.

The analyzer traces a model once for every policy
(``lowering.substitute_ambient``). There no region names its inputs; each
records which of its inputs it would name (:func:`input_mask`) with its
marker, and the analyzer adds the names to the traced body
(:func:`name_body_inputs`) for the policies that move them: each policy is
analysed on the program it runs, and the one trace is the program every
other policy runs.

Example:
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.policies import region_inputs
  >>> region_inputs.selects_inputs(rt.get_policy("offload-boundaries"))
  True
  >>> region_inputs.selects_inputs(rt.get_policy("save-everything"))
  False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import tags
from remat_toolkit._src.policies.policy import Policy

__all__ = ["INPUT_NAME", "selects_inputs", "input_mask", "unseen_inputs",
           "name_inputs", "name_body_inputs"]

#: The checkpoint name of every region input the toolkit names.
INPUT_NAME = "block.input"


def selects_inputs(policy: Policy | None) -> bool:
  """Whether ``policy`` offloads :data:`INPUT_NAME` by name.

  Keeping a region's input on the device is what every region does
  already, so a policy that only saves the name gains nothing from it, and
  a function argument named inside the region would become a named copy
  JAX counts as a residual of its own; regions name their inputs for
  policies that move them. A policy that keeps everything, a matmul rule
  or a policy of JAX's own selects no name; neither does None (the
  analyzer's trace, which names inputs per policy on the traced body).
  """
  if (policy is None or policy.is_jax_policy or policy.save_everything
      or policy.matmuls != "none" or policy.is_per_region):
    return False
  return INPUT_NAME in policy.expand({INPUT_NAME})[1]


def input_mask(prefix: Any, dynamic: Any) -> tuple[bool, ...]:
  """Which of a region's flattened inputs it names: the floating-point
  arrays of ``dynamic`` the traced function computed; never the ``prefix``
  (a module's variables and rngs, an NNX module's state), an argument of
  the function or a constant (:func:`~remat_toolkit._src.core.compat.is_computed`):
  those are held on the device anyway, so a host copy would save nothing
  and cost a transfer every step."""
  return (tuple(False for _ in jax.tree_util.tree_leaves(prefix))
          + tuple(_is_float_array(x) and compat.is_computed(x)
                  for x in jax.tree_util.tree_leaves(dynamic)))


def unseen_inputs(dynamic: Any) -> int:
  """How many floating-point arrays of ``dynamic`` arrive as arguments of a
  ``jax.jit`` the traced program calls
  (:func:`~remat_toolkit._src.core.compat.is_nested_jit_argument`): whether
  they were computed cannot be seen, and :func:`input_mask` leaves them
  unnamed (on the device)."""
  return sum(_is_float_array(x) and compat.is_nested_jit_argument(x)
             for x in jax.tree_util.tree_leaves(dynamic))


def _is_float_array(x: Any) -> bool:
  return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)


def name_inputs(tree: Any, mask: Sequence[bool] | None = None) -> Any:
  """``tree`` with each floating-point array leaf named :data:`INPUT_NAME`.

  Integer arrays (token ids, masks) and PRNG keys are left as they are: they
  are not activations a policy would move.

  Args:
    tree: the region's inputs.
    mask: per leaf of ``tree``, whether to name it (:func:`input_mask`);
      default: every floating-point array.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if mask is None:
    mask = [_is_float_array(x) for x in leaves]
  return jax.tree_util.tree_unflatten(treedef, [
      tags.tag(x, INPUT_NAME) if n and _is_float_array(x) else x
      for x, n in zip(leaves, mask, strict=True)])


def name_body_inputs(body: Any, mask: Sequence[bool]) -> Any:
  """A remat region's body jaxpr that names its inputs first.

  The body is evaluated again behind :func:`name_inputs`, so it is the body
  the region traces to when its policy moves its inputs.

  Args:
    body: the region's body.
    mask: per input, whether to name it, for the body's last ``len(mask)``
      inputs (the leading ones are values the region closed over).
  """
  if not any(mask):
    return body
  named = [False] * (len(body.invars) - len(mask)) + list(mask)

  def run(*xs):
    given = [name_inputs(x) if n else x for x, n in zip(xs, named, strict=True)]
    return compat.eval_jaxpr(body, [], *given)

  closed = jax.make_jaxpr(run)(*(v.aval for v in body.invars))
  if compat.jaxpr_consts(closed):  # a remat body takes its constants as inputs
    return body
  return compat.inner_jaxpr(closed)
