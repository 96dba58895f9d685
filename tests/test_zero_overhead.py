"""rt.remat costs nothing at run time: the program XLA compiles is the one
hand-written ``nn.remat`` / ``jax.checkpoint`` with JAX's equivalent policy
compiles, for a policy chosen by name and for the ambient form."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import remat_toolkit as rt

cp = jax.checkpoint_policies
D = 16
X = jnp.ones((2, 4, D), jnp.float32)

# Each policy and the JAX constructor a user would write by hand.
EQUIVALENT = {
    "boundary-only": cp.nothing_saveable,
    "save-ffn": cp.save_only_these_names("ffn.up", "ffn.down"),
}


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = rt.tag(nn.Dense(4 * D, name="up")(nn.LayerNorm()(x)), "ffn.up")
    h = rt.tag(nn.Dense(D, name="down")(jax.nn.gelu(h)), "ffn.down")
    return x + jnp.tanh(h)


class Stack(nn.Module):
  block: type

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = self.block(name=f"block_{i}")(x)
    return x


def _compiled_program(block: type) -> str:
  """The optimized HLO of one training gradient, without source metadata."""
  model = Stack(block)
  params = model.init(jax.random.key(0), X)

  def loss(p):
    return jnp.sum(model.apply(p, X) ** 2)
  text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  # Locations and op names say where the Python came from, not what runs.
  text = re.sub(r",? metadata=\{[^}]*\}", "", text)
  text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(.+\n)*",
                "", text, flags=re.M)
  return re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)


@pytest.mark.parametrize("name", sorted(EQUIVALENT))
def test_named_and_ambient_policy_compile_to_the_hand_written_program(
    name, remat_mode):
  by_hand = _compiled_program(nn.remat(Block, policy=EQUIVALENT[name]))
  assert _compiled_program(rt.remat(Block, policy=name)) == by_hand
  ambient = rt.remat(Block)
  with rt.use_policy(name):
    assert _compiled_program(ambient) == by_hand


def test_the_comparison_can_fail():
  # Different policies give different programs, so equality above means
  # something.
  assert (_compiled_program(nn.remat(Block, policy=cp.nothing_saveable))
          != _compiled_program(nn.remat(Block, policy=cp.dots_saveable)))
