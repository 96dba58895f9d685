"""Helpers shared by the transform tests."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from remat_toolkit._src import compat as compat

#: The running JAX's minor release ("0.10", "0.11", "0.12"): pins of JAX bugs
#: and behaviours that no feature probe covers are stated per release.
JAX_RELEASE = ".".join(jax.__version__.split(".")[:2])


def residuals(fn, *args):
  """What is saved, as a sorted list of (shape, dtype, what) records."""
  out = []
  for aval, desc in compat.saved_residuals(fn, *args):
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


def cheap_init(key, shape, dtype=jnp.float32):
  """Weights from a NumPy constant scaled by the key: traceable, like any
  initialiser, but without the many random-number operations JAX's
  initialisers would compile in each remat mode."""
  base = np.random.RandomState(sum(shape)).normal(size=shape) / np.sqrt(
      shape[0])
  scale = 1 + (jax.random.key_data(key)[-1] % 8).astype(dtype) / 8
  return (jnp.asarray(base, dtype) * scale).astype(dtype)


class NNXMlp(nnx.Module):
  """A two-layer NNX feed-forward block (``fc1``, ``fc2``) of width ``d``."""

  def __init__(self, d, rngs):
    self.fc1 = nnx.Linear(d, 2 * d, kernel_init=cheap_init, rngs=rngs)
    self.fc2 = nnx.Linear(2 * d, d, kernel_init=cheap_init, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.gelu(self.fc1(x)))
