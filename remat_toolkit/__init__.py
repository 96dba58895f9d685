"""remat-toolkit: choose, apply and inspect remat policies for JAX and Flax.

Example:
  >>> import remat_toolkit as rt
  >>> rt.get_policy("save-attention").matmuls
  'none'
"""

from remat_toolkit.analysis import Comparison
from remat_toolkit.analysis import Residual
from remat_toolkit.analysis import ResidualReport
from remat_toolkit.analysis import analyze
from remat_toolkit.analysis import compare
from remat_toolkit.bench import BatchFit
from remat_toolkit.bench import BatchSearch
from remat_toolkit.bench import BenchRecord
from remat_toolkit.bench import BenchResult
from remat_toolkit.bench import bench
from remat_toolkit.bench import largest_batch
from remat_toolkit.breakdown import Breakdown
from remat_toolkit.breakdown import memory_breakdown
from remat_toolkit.catalog import get_policy
from remat_toolkit.catalog import list_policies
from remat_toolkit.catalog import load_policies
from remat_toolkit.catalog import register_policy
from remat_toolkit.context import current_policy
from remat_toolkit.context import use_policy
from remat_toolkit.grouping import nnx_scan_layers
from remat_toolkit.grouping import remat_chain
from remat_toolkit.grouping import scan_layers
from remat_toolkit.planner import Frontier
from remat_toolkit.planner import Plan
from remat_toolkit.planner import frontier
from remat_toolkit.planner import plan
from remat_toolkit.policy import Policy
from remat_toolkit.rules import RematSummary
from remat_toolkit.rules import remat_modules
from remat_toolkit.rules import remat_summary
from remat_toolkit.tags import MAXTEXT_NAMES
from remat_toolkit.tags import VOCABULARY
from remat_toolkit.tags import tag
from remat_toolkit.transform import remat
from remat_toolkit.verify import Verification
from remat_toolkit.verify import verify

__version__ = "0.1.0"

__all__ = [
    "Comparison",
    "Residual",
    "ResidualReport",
    "analyze",
    "compare",
    "BatchFit",
    "BatchSearch",
    "BenchRecord",
    "BenchResult",
    "bench",
    "largest_batch",
    "Breakdown",
    "memory_breakdown",
    "Frontier",
    "Plan",
    "frontier",
    "plan",
    "MAXTEXT_NAMES",
    "Policy",
    "VOCABULARY",
    "current_policy",
    "get_policy",
    "list_policies",
    "load_policies",
    "nnx_scan_layers",
    "register_policy",
    "remat",
    "remat_modules",
    "remat_summary",
    "RematSummary",
    "remat_chain",
    "scan_layers",
    "tag",
    "use_policy",
    "Verification",
    "verify",
]
