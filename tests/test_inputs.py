"""White-box: the synthetic inputs ``rt.verify`` and ``rt.bench`` make for
abstract arguments.

One rule serves both (``random_inputs`` for leaves, ``random_tree`` for a
pytree): deterministic in the seed, floats ``N(0, 1/fan_in)``, integers and
booleans zero, keys split from the seed, concrete leaves passed through. The
public results say only that inputs were random, so the values are checked
here, through the module's ``__all__``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from remat_toolkit._src.core.inputs import random_inputs
from remat_toolkit._src.core.inputs import random_tree

S = jax.ShapeDtypeStruct


def test_random_inputs_are_deterministic_in_the_seed_for_every_dtype():
  tree = {"w": S((8, 4), jnp.float32), "h": S((3,), jnp.bfloat16),
          "ids": S((2, 5), jnp.int32), "mask": S((2, 5), jnp.bool_),
          "given": jnp.arange(3)}
  a, b = random_tree(tree, seed=3), random_tree(tree, seed=3)
  c = random_tree(tree, seed=4)
  for key in tree:
    assert a[key].shape == tree[key].shape and a[key].dtype == tree[key].dtype
    np.testing.assert_array_equal(a[key], b[key])
  assert a["given"] is tree["given"]
  # Integer and boolean leaves are zeros: valid token ids and masks.
  assert not a["ids"].any() and not a["mask"].any()
  # Floats vary with the seed, scaled by 1/sqrt(fan_in) (fan_in: axis -2).
  assert not np.array_equal(a["w"], c["w"])
  assert 0.1 < float(jnp.std(a["w"])) * np.sqrt(8) < 3.0
  # The tree helper and the leaf helper agree (one rule for verify and bench).
  leaves, treedef = jax.tree.flatten(tree)
  flat = jax.tree.unflatten(treedef, random_inputs(leaves, seed=3))
  for key in tree:
    np.testing.assert_array_equal(flat[key], a[key])


def test_random_leaves_are_seeded():
  args = [S((8, 8), jnp.float32), S((4, 8), jnp.float32)]
  a = random_inputs(args, seed=3)
  b = random_inputs(args, seed=3)
  c = random_inputs(args, seed=4)
  assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
  assert not np.array_equal(a[0], c[0])
  # N(0, 1/fan_in): fan_in is the second-to-last dimension.
  assert 0.1 < float(jnp.std(a[0])) * np.sqrt(8) < 3.0


def test_random_inputs_for_integer_and_key_leaves():
  x = jnp.ones((4, 8))
  tokens, key, given = random_inputs(
      [S((2, 3), jnp.int32), S((2,), jax.random.key(0).dtype), x])
  assert tokens.dtype == jnp.int32 and not tokens.any()
  assert key.shape == (2,) and jax.dtypes.issubdtype(key.dtype,
                                                     jax.dtypes.prng_key)
  assert given is x
