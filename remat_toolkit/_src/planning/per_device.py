"""Budgets per device: what the planner bounds when ``per_device=True``.

With sharded arguments, a budget usually means one device's memory. With
``per_device=True`` every byte figure the planner compares (each measured
outcome, each checkpoint name's bytes in the branch and bound, each region's
candidates) is what one device holds, read from the report's per-residual
:attr:`~remat_toolkit._src.results.analysis.Residual.per_device_nbytes`; the analyzer
finds those by the method the shardings allow (see
:mod:`remat_toolkit._src.analysis.sharding`), on meshes larger than this machine too.

Example:
  >>> from remat_toolkit._src.planning.per_device import device_figures
  >>> from remat_toolkit._src.results.analysis import Residual, ResidualReport
  >>> up = Residual(shape=(64, 32), dtype="float32", nbytes=8192,
  ...               kind="activation", name="ffn.up", module_path="",
  ...               primitive="dot_general", source="", memory_kind="device",
  ...               per_device_nbytes=2048)
  >>> report = ResidualReport("p", (up,), 0, 0, 0, 0, 1, devices=4,
  ...                         per_device_activation_bytes=2048)
  >>> device_figures(report, per_device=False)
  (8192, {'ffn.up': 8192})
  >>> device_figures(report, per_device=True)
  (2048, {'ffn.up': 2048})
"""

from __future__ import annotations

from typing import Any

from remat_toolkit._src.results.analysis import ResidualReport

__all__ = ["check_per_device", "device_figures"]


def check_per_device(per_device: Any, program: Any | None = None) -> bool:
  """``per_device`` if it is a bool the arguments allow.

  Args:
    per_device: the value given.
    program: the traced program (its ``layout`` says whether the arguments
      are sharded); None to check the type only.

  Raises:
    TypeError: ``per_device`` is not True or False.
    ValueError: ``per_device=True`` with arguments sharded over no more than
      one device.
  """
  if not isinstance(per_device, bool):
    raise TypeError(
        f"per_device must be True or False, got {per_device!r}: True bounds "
        "each device's share of the activations, False their total.")
  if per_device and program is not None and program.layout.method is None:
    raise ValueError(
        "per_device=True bounds each device's share, but the arguments carry "
        "no sharding over several devices, so every device would hold it all. "
        "Give them one: jax.ShapeDtypeStruct(shape, dtype, sharding="
        "NamedSharding(mesh, P('data', None))) with mesh a "
        "jax.sharding.AbstractMesh((64, 4), ('data', 'model'), axis_types="
        "(AxisType.Explicit,) * 2) (any size, no devices needed) or "
        "jax.make_mesh(...) over this machine's devices; or drop per_device.")
  return per_device


def device_figures(report: ResidualReport, per_device: bool
                   ) -> tuple[int, dict[str, int]]:
  """(device bytes, device bytes per checkpoint name) the planner bounds.

  The total kept on device, or with ``per_device`` one device's share; the
  names' bytes in the same unit, so the branch and bound's lower bounds hold.
  """
  by_name: dict[str, int] = {}
  for r in report.activations:
    if r.memory_kind == "device" and r.name is not None:
      by_name[r.name] = by_name.get(r.name, 0) + (
          r.device_share if per_device else r.nbytes)
  if per_device:
    return report.activation_bytes_per_device, by_name
  return report.activation_bytes, by_name
