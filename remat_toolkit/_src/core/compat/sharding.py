"""Sharding in a program's types, and exported programs between processes.

JAX's error for a program not written for explicit sharding, the sharding
an abstract value carries, and a ``jax.export.Exported`` pickled for
another process of the same JAX.
"""

from __future__ import annotations

from typing import Any

from jax._src import core as _core

__all__ = [
    "ShardingTypeError", "aval_sharding", "pickle_exported", "unpickle_exported",
]


#: What JAX raises when a program is not written for explicit sharding (e.g.
#: a matmul contracting a sharded dimension without ``out_sharding``). JAX
#: exports no public name for it; a release without it gets a class nothing
#: raises, so ``except ShardingTypeError`` simply never matches there.
ShardingTypeError: type[Exception] = getattr(
    _core, "ShardingTypeError", type("ShardingTypeError", (Exception,), {}))


def aval_sharding(aval: Any) -> Any:
  """The sharding an abstract value carries in its type (``None`` if none).

  With arguments on a mesh of ``Explicit`` axes, every value of the traced
  program carries a ``NamedSharding`` (``jax.typeof(x).sharding`` in user
  code); on ``Auto`` axes the spec is all ``None``.
  """
  return getattr(aval, "sharding", None)


def pickle_exported(exported: Any) -> bytes:
  """A ``jax.export.Exported`` as bytes for another process of this Python.

  ``Exported.serialize()`` needs the optional ``flatbuffers`` package; the
  receiving process runs the same JAX, so a pickle of the dataclass does
  (its only unpicklable field, the lazily built VJP, is dropped: the
  receiver compiles, never differentiates).
  """
  import dataclasses
  import pickle
  return pickle.dumps(dataclasses.replace(exported, _get_vjp=None))


def unpickle_exported(data: bytes) -> Any:
  """The ``jax.export.Exported`` that :func:`pickle_exported` wrote."""
  import pickle
  return pickle.loads(data)
