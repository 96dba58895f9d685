"""A model calling cuDNN attention, analysed on a machine without a GPU.

JAX cannot trace ``jax.nn.dot_product_attention(implementation="cudnn")``
without cuDNN; the analyzer says so and names what to do instead, rather
than passing JAX's RuntimeError through.
"""

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import jax_activation_bytes

import remat_toolkit as rt

pytestmark = pytest.mark.skipif(
    any(d.platform == "gpu" for d in jax.devices()),
    reason="a GPU traces cuDNN attention")


def _cudnn_loss(q):
  attend = rt.remat(lambda x: jax.nn.dot_product_attention(
      x, x, x, implementation="cudnn"))
  return attend(q).astype(jnp.float32).sum()


QUERY = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)


@pytest.mark.parametrize("entry", [
    lambda: rt.analyze(_cudnn_loss, QUERY),
    lambda: rt.compare(_cudnn_loss, QUERY,
                       policies=["boundary-only", "save-everything"]),
], ids=["analyze", "compare"])
def test_cudnn_attention_is_refused_with_the_fix(entry):
  with pytest.raises(ValueError, match="implementation='cudnn'") as caught:
    entry()
  assert "implementation='xla'" in str(caught.value)
  assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_xla_implementation_of_the_same_model_is_analysed():
  def loss(q):
    attend = rt.remat(lambda x: jax.nn.dot_product_attention(
        x, x, x, implementation="xla"))
    return attend(q).astype(jnp.float32).sum()

  report = rt.analyze(loss, QUERY, policy="save-everything")
  assert report.activation_bytes == jax_activation_bytes(
      loss, (QUERY,), "save-everything")
