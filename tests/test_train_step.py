"""White-box: the training step ``rt.bench`` compiles, with gradient accumulation.

``make_train_step`` builds the step from a loss and an optax optimizer; the
public ``rt.bench`` shows only its losses, so that an accumulated update
equals one big batch's (the parameters, not just the loss) is checked here
through the module's ``__all__``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from shared_helpers import scanned_mlp_args as make_args
from shared_helpers import scanned_mlp_loss as scanned_loss

from remat_toolkit._src.bench.train_step import make_train_step


def test_accumulation_splits_the_batch_into_micro_batches():
  seen = []

  def loss(w, batch):
    seen.append(batch.shape)
    return jnp.mean((batch @ w) ** 2)

  w = jnp.ones((3, 2))
  step = make_train_step(loss, optax.sgd(0.1), grad_accum=4)
  jax.jit(step)((w, optax.sgd(0.1).init(w)), jnp.ones((8, 3)))
  assert seen == [(2, 3)]


@pytest.mark.parametrize("optimizer", [optax.sgd(0.05), optax.adamw(1e-2)],
                         ids=["sgd", "adamw"])
def test_accumulation_equals_one_big_batch(optimizer):
  params, batch = make_args(batch_size=8)
  state = (params, optimizer.init(params))
  outs = {}
  for k in (1, 4):
    step = jax.jit(make_train_step(scanned_loss, optimizer, grad_accum=k))
    (new_params, _), loss = step(state, batch)
    outs[k] = (float(loss), new_params)
  assert outs[4][0] == pytest.approx(outs[1][0], rel=1e-6)
  np.testing.assert_allclose(outs[4][1]["w"], outs[1][1]["w"],
                             rtol=1e-5, atol=1e-7)
  # The update is real (a step that returned params unchanged would pass).
  assert not np.allclose(outs[1][1]["w"], params["w"])
