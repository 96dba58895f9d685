"""What the renderers share: optional dependencies, loaded when asked for.

Example:
  >>> from remat_toolkit._src.display.common import require
  >>> require("json", "a test").__name__
  'json'
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["require"]


def require(module: str, what: str) -> Any:
  """Imports an optional dependency, or says how to install it.

  Raises:
    ImportError: naming ``what`` needed it and the ``pip install`` to run.
  """
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ImportError(f"{what} needs {module}; install it with "
                      f"`pip install {module}`.") from None
