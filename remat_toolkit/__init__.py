"""remat-toolkit: choose, apply and inspect remat policies for JAX and Flax.

The names here are the whole public surface, with two modules beside them:
:mod:`remat_toolkit.results` (the classes results come back as) and
:mod:`remat_toolkit.names` (the checkpoint-name vocabulary). Everything under
``remat_toolkit._src`` is implementation and may change without notice.

Example:
  >>> import remat_toolkit as rt
  >>> rt.get_policy("save-attention").matmuls
  'none'
"""

from remat_toolkit._src.analysis.analyze import analyze
from remat_toolkit._src.analysis.analyze import compare
from remat_toolkit._src.analysis.breakdown import memory_breakdown
from remat_toolkit._src.analysis.peak import peak
from remat_toolkit._src.analysis.verify import verify
from remat_toolkit._src.bench.batch_search import largest_batch
from remat_toolkit._src.bench.measure import bench
from remat_toolkit._src.planning.frontier import frontier
from remat_toolkit._src.planning.planner import plan
from remat_toolkit._src.policies.catalog import get_policy
from remat_toolkit._src.policies.catalog import list_policies
from remat_toolkit._src.policies.catalog import load_policies
from remat_toolkit._src.policies.catalog import register_policy
from remat_toolkit._src.policies.catalog import save_policy
from remat_toolkit._src.policies.kernels import tag_residuals
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.resolve import current_policy
from remat_toolkit._src.policies.resolve import use_policy
from remat_toolkit._src.policies.tags import tag
from remat_toolkit._src.transform.grouping import remat_chain
from remat_toolkit._src.transform.grouping import scan_layers
from remat_toolkit._src.transform.nnx_paths import name_nnx_modules
from remat_toolkit._src.transform.remat import remat
from remat_toolkit._src.transform.repolicy import repolicy
from remat_toolkit._src.transform.rules import remat_modules
from remat_toolkit._src.transform.rules import remat_summary
from remat_toolkit._src.transform.scan_runs import restack

__version__ = "0.1.0"

__all__ = [
    # policies
    "Policy",
    "get_policy",
    "list_policies",
    "load_policies",
    "register_policy",
    "save_policy",
    "tag",
    "tag_residuals",
    "use_policy",
    "current_policy",
    # applying them
    "remat",
    "remat_modules",
    "remat_summary",
    "remat_chain",
    "repolicy",
    "scan_layers",
    "restack",
    "name_nnx_modules",
    # inspecting them
    "analyze",
    "compare",
    "memory_breakdown",
    "peak",
    "plan",
    "frontier",
    "verify",
    "bench",
    "largest_batch",
]

# The renderers of every result, registered on import (results never import them).
from remat_toolkit import names as names  # noqa: E402  (public modules, loaded last)
from remat_toolkit import results as results  # noqa: E402
from remat_toolkit._src import display as _display  # noqa: E402, F401
