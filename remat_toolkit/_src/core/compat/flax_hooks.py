"""Flax's private hooks: linen's lifted transforms, NNX's split and merge.

What the toolkit's own remat needs from Flax to lift ``jax.checkpoint`` the
way ``nn.remat`` and ``nnx.remat`` do, and to recognise their work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "flax_lift_pack", "linen_scope_path", "linen_lift_transform", "is_linen_remat",
    "linen_decorator_lift_transform", "nnx_split_inputs", "nnx_merge_inputs",
    "is_nnx_node_states",
]


def flax_lift_pack(inner: Callable[..., Any], name: str) -> Callable[..., Any]:
  """``flax.core.lift.pack`` over every variable and rng collection."""
  from flax.core import lift
  return lift.pack(inner, (True,), (True,), (True,), name=name,
                   enable_kwargs=True)


def linen_scope_path(scope_tree: Any) -> tuple[str, ...]:
  """The module path of the module a linen lifted transform is applied to.

  Flax passes the scopes of module arguments and attributes first and the
  module's own scope last (``linen.transforms.get_module_scopes``).
  """
  from flax.core import Scope
  scopes = [s for s in jax.tree_util.tree_leaves(
      scope_tree, is_leaf=lambda x: isinstance(x, Scope))
            if isinstance(s, Scope)]
  return tuple(str(p) for p in scopes[-1].path) if scopes else ()


def linen_lift_transform(transform: Callable[..., Any], target: Any,
                         **kwargs: Any) -> Any:
  """Flax linen's ``lift_transform`` (a lifted transform of a Module class)."""
  from flax.linen import transforms as linen_transforms
  return linen_transforms.lift_transform(transform, target, **kwargs)


def is_linen_remat(module: Any) -> bool:
  """Whether ``module`` was made by Flax's ``nn.remat`` / ``nn.checkpoint``.

  Flax's lifted transforms subclass the module class they lift and name the
  subclass after the transform (``nn.remat(Block)`` is ``CheckpointBlock``);
  detected by that shape, so it holds for every linen release we support.
  """
  bases = type(module).__mro__[1:2]
  return bool(bases) and type(module).__name__ == "Checkpoint" + bases[0].__name__


def linen_decorator_lift_transform(transform: Callable[..., Any],
                                   method: Callable[..., Any],
                                   **kwargs: Any) -> Callable[..., Any]:
  """Flax linen's ``decorator_lift_transform`` (a lifted method)."""
  from flax.linen import transforms as linen_transforms
  return linen_transforms.decorator_lift_transform(transform, method, **kwargs)


def nnx_split_inputs(f: Callable[..., Any], ctxtag: str) -> Callable[..., Any]:
  """Flax NNX's ``split_inputs``: graph nodes in, graph updates written back.

  With :func:`nnx_merge_inputs` inside a JAX transform it lifts that
  transform the way ``nnx.remat`` lifts ``jax.checkpoint``, so attribute,
  Variable and structure updates made inside reach the caller's modules.
  """
  from flax.nnx.transforms import general
  return general.split_inputs(f, ctxtag=ctxtag)


def nnx_merge_inputs(f: Callable[..., Any], ctxtag: str) -> Callable[..., Any]:
  """Flax NNX's ``merge_inputs``, the inner half of :func:`nnx_split_inputs`."""
  from flax.nnx.transforms import general
  return general.merge_inputs(f, ctxtag=ctxtag)


def is_nnx_node_states(x: Any) -> bool:
  """Whether ``x`` is the pytree ``nnx_split_inputs`` puts for a graph node."""
  from flax.nnx import extract
  return isinstance(x, extract.NodeStates)
