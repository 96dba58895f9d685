"""What every result shares: one data protocol, and one rendering entry.

A result is data. Every result class derives from :class:`Result`: it says
what it holds as plain data (:meth:`Result.to_dict`, hence
:meth:`Result.to_json`), and renders as text, notebook HTML and a pandas
DataFrame through the functions here (:func:`to_text`, :func:`to_html`,
:func:`to_dataframe`, and the partial renderings :func:`summary_lines`,
:func:`table` and :func:`plot`). They are ``functools.singledispatch``
functions that :mod:`remat_toolkit._src.display` fills when the package is
imported, as treescope lets an object opt in to a renderer it never
imports: no result imports the display.

Example:
  >>> import dataclasses
  >>> from remat_toolkit._src.results import base
  >>> @dataclasses.dataclass(frozen=True)
  ... class Count(base.Result):
  ...   n: int
  ...   def to_dict(self):
  ...     return {"n": self.n}
  >>> Count(3).to_json()
  '{"n": 3}'
  >>> @base.to_text.register(Count)
  ... def _(result):
  ...   return f"{result.n} things"
  >>> str(Count(3))
  '3 things'
"""

from __future__ import annotations

import functools
import json
from typing import Any

__all__ = ["Result", "to_text", "to_html", "to_dataframe", "summary_lines",
           "table", "plot"]


def _rendering(what: str):
  """A rendering every result type may register an implementation for."""
  @functools.singledispatch
  def render(result: Any, **kwargs: Any) -> Any:
    raise TypeError(f"no {what} for {type(result).__name__}")

  render.__doc__ = f"The result's {what} (registered by the display package)."
  return render


to_text = _rendering("text")
to_html = _rendering("HTML")
to_dataframe = _rendering("DataFrame")
summary_lines = _rendering("summary lines")
table = _rendering("table")
plot = _rendering("plot")


class Result:
  """Base of every result class: data, with its renderings.

  Subclasses are frozen data classes that implement :meth:`to_dict`.
  """

  __slots__ = ()

  def to_dict(self) -> dict[str, Any]:
    """Plain data (numbers, strings, lists and dicts) of the result."""
    raise NotImplementedError(f"{type(self).__name__} defines no to_dict")

  def to_json(self, **kwargs: Any) -> str:
    """:meth:`to_dict` as JSON (``kwargs`` go to ``json.dumps``)."""
    return json.dumps(self.to_dict(), **kwargs)

  def __str__(self) -> str:
    return to_text(self)

  def _repr_html_(self) -> str:
    return to_html(self)

  def to_dataframe(self) -> Any:
    """The result's rows as a pandas DataFrame (needs pandas).

    Raises:
      TypeError: for a result that has no rows to tabulate.
    """
    return to_dataframe(self)
