"""Renders every result as text, HTML or a pandas DataFrame.

Results hold data; this module is the one place that turns them into
something to read. Each result class's ``__str__``, ``_repr_html_`` and
``to_dataframe`` call :func:`to_text`, :func:`to_html` and
:func:`to_dataframe` here. Formatting primitives (bytes, FLOPs, tables) are
in :mod:`remat_toolkit._src.format`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src import display
  >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)))
  >>> report = rt.analyze(f, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> display.to_text(report) == str(report)
  True
"""

from __future__ import annotations

import functools
from typing import Any

from remat_toolkit._src import format as fmt

__all__ = ["to_text", "to_html", "to_dataframe", "require"]


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


# Renderers are registered below, one section per result, each with
# ``@to_text.register`` / ``@to_html.register`` / ``@to_dataframe.register``
# on a function whose first parameter is annotated with the result class
# (imported inside the section from where the class lives). ``fmt`` holds the
# shared primitives.
_ = fmt

# ================================================= ResidualReport, Comparison

# ================================================================ Breakdown

# ============================================================= Verification

# ============================================================= RematSummary

# ============================================================ Plan, Frontier

# ==================================================== BenchResult, BatchSearch

# ======================================================== the one plot
