"""The classes results come back as: data, rendered by one display module.

Each holds numbers and names; ``str(result)``, ``result._repr_html_()``,
``result.to_dataframe()`` and ``result.to_json()`` render it (text, HTML in
notebooks, pandas, JSON) through the same display code.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit.results import ResidualReport
  >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum())
  >>> isinstance(rt.analyze(f, jax.ShapeDtypeStruct((4,), jnp.float32)),
  ...            ResidualReport)
  True
"""

from remat_toolkit._src.policies.policy import Lowering
from remat_toolkit._src.results.analysis import Comparison
from remat_toolkit._src.results.analysis import RecomputedKernel
from remat_toolkit._src.results.analysis import Residual
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.analysis import Verification
from remat_toolkit._src.results.bench import BatchFit
from remat_toolkit._src.results.bench import BatchSearch
from remat_toolkit._src.results.bench import BenchRecord
from remat_toolkit._src.results.bench import BenchResult
from remat_toolkit._src.results.breakdown import Breakdown
from remat_toolkit._src.results.peak import LiveTensor
from remat_toolkit._src.results.peak import Peak
from remat_toolkit._src.results.peak import XlaBuffer
from remat_toolkit._src.results.planning import Frontier
from remat_toolkit._src.results.planning import FrontierPoint
from remat_toolkit._src.results.planning import Plan
from remat_toolkit._src.results.planning import RegionPlan
from remat_toolkit._src.results.regions import RematSummary

__all__ = [
    "Residual", "RecomputedKernel", "ResidualReport", "Comparison", "Breakdown", "Plan",
    "RegionPlan", "Frontier", "FrontierPoint", "Verification", "BenchRecord", "BenchResult",
    "BatchFit", "BatchSearch", "RematSummary", "Lowering", "Peak", "LiveTensor", "XlaBuffer",
]
