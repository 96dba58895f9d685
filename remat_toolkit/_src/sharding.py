"""Per-device figures for sharded programs.

When the analysed arguments carry shardings (sharded ``jax.Array`` s, or
``jax.ShapeDtypeStruct(..., sharding=...)``), each residual's per-device size
is read from the sharding XLA gives it: the traced step's forward part is
compiled with the residuals as its outputs, the arguments sharded as given
and the outputs left to XLA's sharding propagation, and each residual counts
the bytes of its largest shard. This works for meshes with ``Auto`` axes (the
usual ``jit`` + ``NamedSharding`` setup) and ``Explicit`` ones alike, and
agrees with what a jitted training step holds on one device, up to XLA's
freedom to reshard internal values.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit._src import sharding
  >>> sharding.device_count([jax.ShapeDtypeStruct((4,), jnp.float32)])
  1
  >>> sharding.shard_nbytes((8, 4), "float32", None)
  128
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src import residuals as _residuals

__all__ = ["device_count", "activation_bytes_per_device", "shard_nbytes"]


def device_count(leaves: Sequence[Any]) -> int:
  """Devices the arguments are spread over (1 when none carries a sharding)."""
  counts = [len(getattr(getattr(x, "sharding", None), "device_set", ()) or ())
            for x in leaves]
  return max(counts + [1])


def shard_nbytes(shape: Sequence[int], dtype: Any, sharding: Any) -> int:
  """Bytes of the largest shard of a ``shape``/``dtype`` value on one device.

  Args:
    shape: the global shape.
    dtype: its dtype.
    sharding: a ``jax.sharding.Sharding``, or None for a value every device
      holds whole.

  Returns:
    The bytes one device holds.
  """
  local = tuple(shape) if sharding is None else sharding.shard_shape(tuple(shape))
  return int(math.prod(local)) * _residuals.dtype_itemsize(dtype)


def activation_bytes_per_device(residuals: Sequence[Any], leaves: Sequence[Any],
                                step: _residuals.TracedStep
                                ) -> tuple[int, int | None]:
  """``(devices, bytes)``: device activation bytes held by one device.

  Named after :attr:`ResidualReport.activation_bytes_per_device`, which
  reads the figure this computes.

  Args:
    residuals: the report's residuals, in :func:`residual_origins` order.
    leaves: the abstract arguments (with their shardings).
    step: the traced training step the residuals were read from.

  Returns:
    ``(1, None)`` when no argument is sharded over several devices; else
    the device count and the activation bytes (device memory, not host) one
    device holds.
  """
  devices = device_count(leaves)
  if devices <= 1:
    return 1, None
  origins = _residuals.residual_origins(step.jaxpr, 1, step.num_residuals)
  if len(origins) != len(residuals):
    raise RuntimeError(  # an internal inconsistency, not a user mistake
        f"the step has {len(origins)} residuals where the analyzer found "
        f"{len(residuals)}; please report this.")
  shardings = _residuals.residual_shardings(
      step.jaxpr, [o.var for o in origins], list(leaves))
  total = 0
  for residual, origin, sharding in zip(residuals, origins, shardings,
                                       strict=True):
    if residual.kind != "activation" or residual.memory_kind != "device":
      continue
    total += shard_nbytes(residual.shape, origin.aval.dtype, sharding)
  return devices, total
