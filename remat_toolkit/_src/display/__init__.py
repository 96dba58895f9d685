"""Renders every result as text, HTML, a pandas DataFrame or a chart.

Results hold data (:mod:`remat_toolkit._src.results`); this package is the
one place that turns them into something to read. Each module here
registers its renderers on the rendering entry of
:mod:`remat_toolkit._src.results.base` (``to_text``, ``to_html``,
``to_dataframe``, ``summary_lines``, ``table``, ``plot``) when it is
imported, which importing this package does. Formatting primitives (bytes,
FLOPs, tables) are in :mod:`remat_toolkit._src.core.format`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.results import base
  >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum())
  >>> report = rt.analyze(f, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> base.to_text(report) == str(report)
  True
"""

# Each module registers the renderers of one family of results.
from remat_toolkit._src.display import analysis as analysis
from remat_toolkit._src.display import benchmark as benchmark
from remat_toolkit._src.display import peak as peak
from remat_toolkit._src.display import planning as planning
from remat_toolkit._src.display import plot as plot

__all__ = ["analysis", "benchmark", "peak", "planning", "plot"]
