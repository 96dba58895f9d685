"""The planner's argument checks: each refused with its fix before anything is traced.

:func:`~remat_toolkit._src.planning.planner.plan` runs them all first, so a
malformed argument costs no trace; :class:`~remat_toolkit._src.planning.planner.Planner`
runs those of its own arguments, and those of each budget when it plans one.

Example:
  >>> from remat_toolkit._src.planning.checks import check_search
  >>> check_search(True, "1KiB", 8)
  1024
  >>> check_search(False, None, -1)
  Traceback (most recent call last):
  ...
  ValueError: max_evaluations must be a non-negative integer, got -1.
"""

from __future__ import annotations

import math
from typing import Any

from remat_toolkit._src.analysis.breakdown import resolve_optimizer
from remat_toolkit._src.core import compat
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.format import parse_bytes
from remat_toolkit._src.planning.choices import OFFLOADING
from remat_toolkit._src.policies.policy import unrunnable_reason
from remat_toolkit._src.results.planning import PEAK

__all__ = ["check_rates", "check_search", "check_peak_options"]


def check_rates(allow_offload: Any, host_bandwidth: Any,
                device_flops: Any) -> None:
  """Refuses offloading where it cannot run, and rates that are not positive."""
  check_flag("allow_offload", allow_offload)
  if allow_offload and unrunnable_reason(OFFLOADING) is not None:
    raise ValueError(
        f"allow_offload=True cannot be planned: {compat.offloading_refusal()}; "
        "or plan without offloading.")
  for label, value in (("host_bandwidth", host_bandwidth),
                       ("device_flops", device_flops)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < math.inf):
      raise ValueError(f"{label} must be a positive number, got {value!r}.")


def check_search(allow_offload: bool, host_budget: Any,
                 max_evaluations: Any) -> int | None:
  """The host budget in bytes (None: unlimited), once the search's limits
  are checked."""
  if host_budget is not None and not allow_offload:
    raise ValueError(
        f"host_budget={host_budget!r} only matters with allow_offload=True; "
        "pass allow_offload=True or drop host_budget.")
  if (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
      or max_evaluations < 0):
    raise ValueError(
        f"max_evaluations must be a non-negative integer, got "
        f"{max_evaluations!r}.")
  return None if host_budget is None else parse_bytes(host_budget)


def check_peak_options(bounds: str, compile: Any, per_device: bool,
                       optimizer: Any = None) -> None:
  """Refuses what only ``bounds="peak"`` takes (``compile``, ``optimizer``)
  under other bounds, and ``bounds="peak"`` per device."""
  check_flag("compile", compile)
  if optimizer is not None:
    resolve_optimizer(optimizer)  # a clear error for a bad one, first
    if bounds != PEAK:
      raise ValueError(
          f"optimizer= bounds the train step's peak; it needs bounds='peak' "
          f"(got bounds={bounds!r}): the other bounds leave the optimizer "
          "state out of the budget.")
  if compile and bounds != PEAK:
    raise ValueError(
        f"compile=True checks the plan's compiled training step against a "
        f"peak budget; it needs bounds='peak' (got bounds={bounds!r}).")
  if bounds == PEAK and per_device:
    raise ValueError(
        "bounds='peak' with per_device=True is not supported yet: the step's "
        "peak is predicted for the whole step, not per device. Plan the "
        "kept activations per device (bounds='kept activations') and check "
        "the step with rt.peak.")
