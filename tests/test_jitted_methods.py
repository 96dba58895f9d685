"""The ambient policy reaches regions behind jitted functions and methods.

Production models jit their own methods (gemma wraps ``Transformer.__call__``
in ``nn.jit``) and users jit their train step once. The ambient policy is
part of JAX's jit cache key, so each of these is traced again under a new
policy, and not again under an equal one. The reference is JAX's own
``saved_residuals`` of the same model without the jit.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from shared_helpers import cheap_init
from shared_helpers import jax_activation_bytes

import remat_toolkit as rt

pytestmark = pytest.mark.usefixtures("quick_compiles")

D = 8
X = jax.random.normal(jax.random.key(1), (2, 4, D))
# Switched back and forth: a stale trace shows as the previous figure.
ORDER = ("save-ffn", "boundary-only", "save-everything", "boundary-only",
         "save-ffn", "save-everything", "save-ffn")


class Block(nn.Module):
  """LayerNorm, Dense(4d), gelu, Dense(d), residual: the issue's block."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(4 * D, name="fc1")(h))
    return x + nn.Dense(D, name="fc2")(h)


class JittedModel(nn.Module):
  """Two blocks behind an ``nn.jit``-wrapped ``__call__``, as gemma has."""

  def setup(self):
    self.blocks = [Block(name=f"layer_{i}") for i in range(2)]

  @functools.partial(nn.jit, static_argnames=("self",))
  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


class PlainModel(JittedModel):
  """The same model without the jit: the reference."""

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def _linen_loss(model):
  params = model.init(jax.random.key(0), X)
  return (lambda p, x: jnp.sum(model.apply(p, x) ** 2)), params


def _saved(loss, params, policy):
  return jax_activation_bytes(loss, (params, X), policy)


def test_nn_jit_method_takes_each_policy(remat_mode):
  jitted, params = _linen_loss(rt.remat_modules(JittedModel()))
  plain, _ = _linen_loss(rt.remat_modules(PlainModel()))
  expected = {p: _saved(plain, params, p) for p in set(ORDER)}
  assert len(set(expected.values())) == 3, expected
  for policy in ORDER:
    assert _saved(jitted, params, policy) == expected[policy], policy


def test_remat_summary_sees_regions_behind_nn_jit(remat_mode):
  model = rt.remat_modules(JittedModel())
  loss, params = _linen_loss(model)
  for policy in ("boundary-only", "boundary-only", "save-ffn"):
    _saved(loss, params, policy)
    summary = rt.remat_summary(model)
    assert summary.regions == ("layer_0", "layer_1"), str(summary)


def test_analyze_reports_each_policy_behind_nn_jit(remat_mode):
  loss, params = _linen_loss(rt.remat_modules(JittedModel()))
  for policy in ORDER:
    report = rt.analyze(loss, params, X, policy=policy)
    assert report.activation_bytes == _saved(loss, params, policy), policy
    assert not any("own polic" in w for w in report.warnings), report.warnings


class NNXBlock(nnx.Module):

  def __init__(self, rngs):
    self.fc1 = nnx.Linear(D, 4 * D, kernel_init=cheap_init, rngs=rngs)
    self.fc2 = nnx.Linear(4 * D, D, kernel_init=cheap_init, rngs=rngs)

  def __call__(self, x):
    return x + self.fc2(nnx.gelu(self.fc1(x)))


class NNXModel(nnx.Module):

  def __init__(self, rngs):
    self.layers = nnx.List([NNXBlock(rngs) for _ in range(2)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def _nnx_losses():
  model = rt.remat_modules(NNXModel(nnx.Rngs(0)))
  graphdef, state = nnx.split(model)

  @nnx.jit
  def forward(m, x):
    return m(x)

  def jitted(s, x):
    return jnp.sum(forward(nnx.merge(graphdef, s), x) ** 2)

  def plain(s, x):
    return jnp.sum(nnx.merge(graphdef, s)(x) ** 2)

  return jitted, plain, state


def test_nnx_jit_call_takes_each_policy(remat_mode):
  jitted, plain, state = _nnx_losses()
  expected = {p: _saved(plain, state, p) for p in set(ORDER)}
  # Under remat3 on some releases save-everything keeps what save-ffn does.
  assert len(set(expected.values())) >= 2, expected
  for policy in ORDER:
    assert _saved(jitted, state, policy) == expected[policy], policy


def _region_loss():
  w = jnp.full((D, 4 * D), 0.1)
  region = rt.remat(lambda w, x: jnp.sin(rt.tag(jnp.sin(x @ w), "ffn.up")).sum())
  return region, w


def test_jax_jit_closure_takes_each_policy(remat_mode):
  region, w = _region_loss()
  x = X.reshape(-1, D)
  jitted = jax.jit(lambda w: region(w, x))
  expected = {p: jax_activation_bytes(lambda w: region(w, x), (w,), p)
              for p in set(ORDER)}
  assert len(set(expected.values())) >= 2, expected
  for policy in ORDER:
    assert jax_activation_bytes(jitted, (w,), policy) == expected[policy]


def test_jit_built_in_one_policy_runs_under_the_calling_one(remat_mode):
  region, w = _region_loss()
  x = X.reshape(-1, D)
  with rt.use_policy("boundary-only"):
    loss = jax.jit(lambda w: region(w, x))
    inside = jax_activation_bytes(loss, (w,), "boundary-only")
  # The policy active when the function is traced (called) wins, not the
  # one around jax.jit.
  for policy in ("save-everything", "boundary-only", "save-ffn"):
    expected = jax_activation_bytes(lambda w: region(w, x), (w,), policy)
    assert jax_activation_bytes(loss, (w,), policy) == expected, policy
  assert inside == jax_activation_bytes(loss, (w,), "boundary-only")


def test_same_policy_again_does_not_retrace(remat_mode):
  traces = []

  @jax.jit
  def step(w, x):
    traces.append(rt.current_policy().name)
    return jax.grad(lambda w: region(w, x))(w)

  region, w = _region_loss()
  x = X.reshape(-1, D)
  for policy in ("save-ffn", "save-ffn", "boundary-only", "save-ffn",
                 "boundary-only"):
    with rt.use_policy(policy):
      step(w, x).block_until_ready()
  assert traces == ["save-ffn", "boundary-only"]


def test_equal_per_region_and_raw_policies_share_a_trace(remat_mode):
  traces = []

  @jax.jit
  def f(x):
    traces.append(None)
    return x * 2

  plan = rt.Policy(name="per", regions={"#0": "save-ffn", "*": "boundary-only"})
  again = rt.Policy(name="per", regions={"#0": "save-ffn", "*": "boundary-only"})
  for policy in (plan, again, jax.checkpoint_policies.dots_saveable,
                 jax.checkpoint_policies.dots_saveable):
    with rt.use_policy(policy):
      f(1.0)
  assert len(traces) == 2
