"""Concrete arrays for abstract arguments, deterministic in a seed.

Every verb takes ``jax.ShapeDtypeStruct`` leaves; those that must run the
program (the gradient check of ``verify``, the training steps of ``bench``)
get values here, from one rule, so that a seed means the same inputs
everywhere.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit._src.core import inputs
  >>> tree = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32),
  ...         "ids": jax.ShapeDtypeStruct((2, 5), jnp.int32)}
  >>> values = inputs.random_tree(tree, seed=0)
  >>> values["w"].dtype, values["ids"].tolist()
  (dtype('float32'), [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["random_inputs", "random_tree", "concrete_leaves"]


def random_inputs(leaves: Sequence[Any], seed: int = 0) -> list[Any]:
  """Concrete arrays for abstract argument leaves, deterministic in ``seed``.

  Floating leaves are ``N(0, 1) / sqrt(fan_in)`` with ``fan_in`` the
  second-to-last dimension (1 for vectors and scalars), so activations stay
  of order one through matmuls; integer and boolean leaves are zeros (always
  valid token ids, indices and masks); PRNG key leaves are split from
  ``jax.random.key(seed)``. Leaves with a sharding are placed with it.

  Args:
    leaves: arrays (returned unchanged) or ``jax.ShapeDtypeStruct`` s.
    seed: the random seed.

  Returns:
    One array per leaf.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from remat_toolkit._src.core.inputs import random_inputs
    >>> x, = random_inputs([jax.ShapeDtypeStruct((4, 3), jnp.float32)])
    >>> x.shape, x.dtype
    ((4, 3), dtype('float32'))
  """
  keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
  out = []
  for key, leaf in zip(keys, leaves, strict=False):  # one key to spare if none
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      out.append(leaf)
      continue
    value = _random_leaf(key, leaf.shape, leaf.dtype)
    sharding = getattr(leaf, "sharding", None)
    out.append(jax.device_put(value, sharding) if sharding is not None else value)
  return out


def random_tree(tree: Any, seed: int = 0) -> Any:
  """``tree`` with its ``jax.ShapeDtypeStruct`` leaves made concrete.

  The leaves are those of :func:`random_inputs` for the flattened tree.
  """
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, random_inputs(leaves, seed))


def concrete_leaves(args: Sequence[Any], seed: int) -> tuple[list[Any], str]:
  """The leaves of ``args`` as arrays, and where their values came from.

  Returns:
    ``(leaves, "given")`` when no leaf is abstract; otherwise every abstract
    leaf is made by :func:`random_inputs`, and ``"random (seed=...)"``.
  """
  leaves = jax.tree_util.tree_leaves(args)
  if not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
    return [jnp.asarray(x) if not isinstance(x, jax.Array) else x
            for x in leaves], "given"
  return random_inputs(leaves, seed), f"random (seed={seed})"


def _random_leaf(key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return jax.random.split(key, max(1, math.prod(shape))).reshape(shape)
  if jnp.issubdtype(dtype, jnp.inexact):
    fan_in = shape[-2] if len(shape) >= 2 else 1
    scale = 1.0 / math.sqrt(max(fan_in, 1))
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
  return jnp.zeros(shape, dtype)
