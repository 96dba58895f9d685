"""Where an argument leaf sits in a model: its pytree key path as a module path.

Results name a residual that is one of the function's arguments (a weight
kept for the backward pass) after the module holding it, and ``rt.repolicy``
keys a region after the modules whose variables it reads; both read it here,
from the leaf's key path: a linen variables dict
(``['params']['layers_0']['mlp']['kernel']``), an NNX state
(``['layers'][0]['mlp']['kernel'].value``), a dataclass pytree
(``.layers[0].weight``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit._src.core.arg_paths import argument_module_paths
  >>> params = {"params": {"layers_0": {"mlp": {"kernel": jnp.ones(2)}}}}
  >>> argument_module_paths((params, jnp.ones(3)))
  [('layers_0', 'mlp'), ()]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["argument_module_paths", "module_path_of"]

#: Dict keys that name a collection, not a module (linen's variables sit
#: under it; its scope paths leave it out).
_COLLECTIONS = frozenset({"params"})
#: Attributes that hold a variable's payload (an NNX ``Variable``'s value).
_PAYLOADS = frozenset({"value", "raw_value"})


def module_path_of(entries: Sequence[Any]) -> tuple[str, ...]:
  """The module path of the leaf at key-path ``entries`` (inside one
  argument): the names of its entries, a collection key and a variable's
  payload attribute left out, and the variable's own name (the last)
  dropped; ``()`` for a bare array."""
  names = []
  for entry in entries:
    if isinstance(entry, jax.tree_util.GetAttrKey):
      if entry.name not in _PAYLOADS:
        names.append(str(entry.name))
    elif isinstance(entry, jax.tree_util.DictKey):
      if entry.key not in _COLLECTIONS:
        names.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.SequenceKey):
      names.append(str(entry.idx))
    else:
      names.append(str(getattr(entry, "key", entry)))
  return tuple(names[:-1])


def argument_module_paths(args: Sequence[Any]) -> list[tuple[str, ...]]:
  """Per leaf of the arguments ``args`` (flattened as
  ``jax.tree_util.tree_flatten`` does), its module path
  (:func:`module_path_of`)."""
  return [module_path_of(path[1:]) for path, _ in
          jax.tree_util.tree_flatten_with_path(tuple(args))[0]]
