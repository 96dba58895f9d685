"""Where in the user's code an equation was made.

The first frame of an equation's traceback that is neither the toolkit's
own plumbing nor Flax's lifting helpers: the line a finding or a residual
points to.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib

from remat_toolkit._src.core import compat
from remat_toolkit._src.core.compat import JaxprEqn

__all__ = ["source_of"]


# remat_toolkit/, and its built-in models (whose frames are the model's own).
_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parents[2]) + os.sep
_MODELS_DIR = _PACKAGE_DIR + "models" + os.sep


@functools.lru_cache(maxsize=1)
def _flax_lifting_files() -> tuple[str, ...]:
  spec = importlib.util.find_spec("flax")
  if spec is None or not spec.origin:
    return ()
  nnx_dir = os.path.join(os.path.dirname(spec.origin), "nnx") + os.sep
  return (nnx_dir + "transforms" + os.sep, nnx_dir + "graph.py",
          nnx_dir + "graphlib.py", nnx_dir + "extract.py")


def _is_toolkit_plumbing(file_name: str) -> bool:
  # Frames of the toolkit's own wrappers (tag, remat, ...) say nothing about
  # where in the model a value was made; the built-in models do. NNX regions
  # are lifted through Flax's split/merge helpers, which say nothing either.
  if file_name.startswith(_PACKAGE_DIR):
    return not file_name.startswith(_MODELS_DIR)
  return file_name.startswith(_flax_lifting_files())


def source_of(eqn: JaxprEqn) -> str:
  """``file:line (function)`` of the user frame that made ``eqn``."""
  return compat.user_source(eqn, _is_toolkit_plumbing)
