"""The checkpoint-name vocabulary policies select from.

Example:
  >>> from remat_toolkit import names
  >>> "attn.context" in names.VOCABULARY
  True
"""

from remat_toolkit._src.policies.tags import MAXTEXT_NAMES
from remat_toolkit._src.policies.tags import VOCABULARY

__all__ = ["VOCABULARY", "MAXTEXT_NAMES"]
