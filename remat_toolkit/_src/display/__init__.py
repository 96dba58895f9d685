"""Renders every result as text, HTML or a pandas DataFrame.

Results hold data; this package is the one place that turns them into
something to read. Each result class's ``__str__``, ``_repr_html_`` and
``to_dataframe`` call :func:`to_text`, :func:`to_html` and
:func:`to_dataframe` here. Formatting primitives (bytes, FLOPs, tables) are
in :mod:`remat_toolkit._src.format`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src import display
  >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum())
  >>> report = rt.analyze(f, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> display.to_text(report) == str(report)
  True
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["to_text", "to_html", "to_dataframe", "require", "plot",
           "residual_report_summary", "residual_table", "breakdown_summary",
           "verification_summary", "plan_summary_lines", "bench_notes",
           "bench_markdown"]


def require(module: str, what: str) -> Any:
  """Imports an optional dependency, or says how to install it."""
  try:
    return __import__(module)
  except ImportError:
    raise ImportError(f"{what} needs {module}; install it with "
                      f"`pip install {module}`.") from None


@functools.singledispatch
def to_text(result: Any) -> str:
  """The result as terminal text (what ``print(result)`` shows)."""
  raise TypeError(f"no text rendering for {type(result).__name__}")


@functools.singledispatch
def to_html(result: Any) -> str:
  """The result as HTML (what a notebook shows)."""
  raise TypeError(f"no HTML rendering for {type(result).__name__}")


@functools.singledispatch
def to_dataframe(result: Any) -> Any:
  """The result's rows as a pandas DataFrame (needs pandas)."""
  raise TypeError(f"no DataFrame for {type(result).__name__}")


# The renderers live in this package's modules, one per family of results,
# each registering on the functions above; importing them here registers all.
from remat_toolkit._src.display import analysis as _analysis  # noqa: E402, F401
from remat_toolkit._src.display import benchmark as _benchmark  # noqa: E402, F401
from remat_toolkit._src.display import planning as _planning  # noqa: E402, F401
from remat_toolkit._src.display import plot as _plot  # noqa: E402, F401
from remat_toolkit._src.display.analysis import breakdown_summary  # noqa: E402
from remat_toolkit._src.display.analysis import residual_report_summary  # noqa: E402
from remat_toolkit._src.display.analysis import residual_table  # noqa: E402
from remat_toolkit._src.display.analysis import verification_summary  # noqa: E402
from remat_toolkit._src.display.benchmark import bench_markdown  # noqa: E402
from remat_toolkit._src.display.benchmark import bench_notes  # noqa: E402
from remat_toolkit._src.display.planning import plan_summary_lines  # noqa: E402
from remat_toolkit._src.display.plot import plot  # noqa: E402
