"""What JAX itself saves for the backward pass, as comparable records."""

import re

from remat_toolkit import _jax_internals as internals


def residuals(fn, *args):
  """What is saved, as a sorted list of (shape, dtype, what) records."""
  out = []
  for aval, desc in internals.saved_residuals(fn, *args):
    named = re.match(r"named '([^']+)'", desc)
    if named:
      what = "named " + named.group(1)
    elif desc.startswith("from the argument"):
      what = "argument"
    elif desc.startswith("from a constant"):
      what = "constant"
    else:
      what = "output of " + desc.split()[2]
    out.append((tuple(aval.shape), str(aval.dtype), what))
  return sorted(out)
