"""What every result class shares: it renders through the display package.

Results hold data; :mod:`remat_toolkit._src.display` turns them into text,
HTML and DataFrames. This base gives each result the three methods that
Python, notebooks and users call, so no class repeats them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Rendered"]


class Rendered:
  """Mixin: ``str()``, notebook HTML and ``to_dataframe()`` via display."""

  __slots__ = ()

  def __str__(self) -> str:
    from remat_toolkit._src import display
    return display.to_text(self)

  def _repr_html_(self) -> str:
    from remat_toolkit._src import display
    return display.to_html(self)

  def to_dataframe(self) -> Any:
    """The result's rows as a pandas DataFrame (needs pandas).

    Raises:
      TypeError: for a result that has no rows to tabulate.
    """
    from remat_toolkit._src import display
    return display.to_dataframe(self)
