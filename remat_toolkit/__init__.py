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

from remat_toolkit._src.analysis import analyze
from remat_toolkit._src.analysis import compare
from remat_toolkit._src.batch_search import largest_batch
from remat_toolkit._src.bench import bench
from remat_toolkit._src.breakdown import memory_breakdown
from remat_toolkit._src.catalog import get_policy
from remat_toolkit._src.catalog import list_policies
from remat_toolkit._src.catalog import load_policies
from remat_toolkit._src.catalog import register_policy
from remat_toolkit._src.frontier import frontier
from remat_toolkit._src.grouping import nnx_scan_layers
from remat_toolkit._src.grouping import remat_chain
from remat_toolkit._src.grouping import scan_layers
from remat_toolkit._src.kernels import tag_residuals
from remat_toolkit._src.nnx_paths import name_nnx_modules
from remat_toolkit._src.planner import plan
from remat_toolkit._src.policy import Policy
from remat_toolkit._src.repolicy import repolicy
from remat_toolkit._src.resolve import current_policy
from remat_toolkit._src.resolve import use_policy
from remat_toolkit._src.rules import remat_modules
from remat_toolkit._src.rules import remat_summary
from remat_toolkit._src.scan_runs import restack
from remat_toolkit._src.tags import tag
from remat_toolkit._src.transform import remat
from remat_toolkit._src.verify import verify

__version__ = "0.1.0"

__all__ = [
    # policies
    "Policy",
    "get_policy",
    "list_policies",
    "load_policies",
    "register_policy",
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
    "nnx_scan_layers",
    "restack",
    "name_nnx_modules",
    # inspecting them
    "analyze",
    "compare",
    "memory_breakdown",
    "plan",
    "frontier",
    "verify",
    "bench",
    "largest_batch",
]

from remat_toolkit import names as names  # noqa: E402  (public modules, loaded last)
from remat_toolkit import results as results  # noqa: E402
