"""What ``rt.remat_summary`` returns: the remat regions a model has.

Data only; :mod:`remat_toolkit._src.display` renders it. The discovery is in
:mod:`remat_toolkit._src.transform.discovery`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from remat_toolkit._src.results.base import Result

__all__ = ["RematSummary"]


@dataclasses.dataclass(frozen=True)
class RematSummary(Result):
  """What :func:`remat_modules` made remat regions of; ``print`` it.

  Attributes:
    model: the model's class name.
    auto: True when the blocks were found automatically (no rules given).
    classes: the class names of the region modules, in order of first region.
    regions: the module path of each region (``transformer/h/0``), in call
      order (linen) or graph order (NNX).
    ran: False for a linen model that has not run yet: its submodules, and so
      its regions, are known at its first ``init`` / ``apply``.
    applications: how many times each region ran in the latest call, in the
      order of ``regions`` (linen; a shared layer applied N times is one
      region module and N applications, as JAX counts); () when unknown
      (NNX: one per region module).
  """

  model: str
  auto: bool
  classes: tuple[str, ...] = ()
  regions: tuple[str, ...] = ()
  ran: bool = True
  applications: tuple[int, ...] = ()

  @property
  def total_applications(self) -> int:
    """Region applications in one call: what JAX counts as remat regions."""
    return sum(self.applications) if self.applications else len(self.regions)

  def to_dict(self) -> dict[str, Any]:
    """Plain data: every field and the total applications."""
    out = dataclasses.asdict(self)
    out["total_applications"] = self.total_applications
    return out
