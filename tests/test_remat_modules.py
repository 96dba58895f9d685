"""rt.remat_modules on models built from Flax's own layers, linen and NNX.

The reference for what must be saved is the same model wrapped by hand: plain
``nn.remat`` / ``nnx.remat`` with the JAX constructor written out, and the
submodule outputs tagged by hand with the names ``tag_outputs`` promises.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat_toolkit as rt

cp = jax.checkpoint_policies
D, HEADS = 8, 2
X = jax.random.normal(jax.random.key(1), (2, 4, D))
DROPOUT_KEY = jax.random.key(7, impl="rbg")

ATTN_NAMES = ("attn", "attn/query", "attn/key", "attn/value", "attn/out")
MLP_NAMES = ("mlp", "mlp/fc1", "mlp/fc2")
# Each built-in policy, as a user would write it by hand for this model.
HAND_WRITTEN = {
    "boundary-only": cp.nothing_saveable,
    "save-attention": cp.save_only_these_names(*ATTN_NAMES),
    "save-ffn": cp.save_only_these_names(*MLP_NAMES),
    "save-matmuls": cp.dots_saveable,
    "save-everything": cp.everything_saveable,
    # Names only vocabulary tags, none of which an untagged model has.
    "recompute-attention-core": cp.nothing_saveable,
}
POLICIES = sorted(HAND_WRITTEN)


# ---------------------------------------------------------------- helpers

import shared_helpers  # noqa: E402
from shared_helpers import NNXMlp  # noqa: E402
from shared_helpers import cheap_init  # noqa: E402
from shared_helpers import count_remat_regions  # noqa: E402
from shared_helpers import grad_of  # noqa: E402
from shared_helpers import named  # noqa: E402
from shared_helpers import residuals  # noqa: E402
from shared_helpers import run_on_simulated_devices  # noqa: E402

assert_trees_close = functools.partial(shared_helpers.assert_trees_close,
                                       atol=1e-5)




# ---------------------------------------------------------------- linen model

class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(2 * D, kernel_init=cheap_init, name="fc1")(x)
    return nn.Dense(D, kernel_init=cheap_init, name="fc2")(nn.gelu(h))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    h = nn.LayerNorm(name="ln1")(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=HEADS, kernel_init=cheap_init, dropout_rate=0.5,
        deterministic=not train, name="attn")(h)
    return x + Mlp(name="mlp")(nn.LayerNorm(name="ln2")(x))


class Model(nn.Module):
  block: type = Block

  @nn.compact
  def __call__(self, x, train=False):
    for i in range(2):
      x = self.block(name=f"Block_{i}")(x, train)  # Flax's own auto-names
    return x


VARIABLES = Model().init(jax.random.key(0), X)


def linen_loss(model, train=False):
  def loss(params):
    y = model.apply(params, X, train, rngs={"dropout": DROPOUT_KEY})
    return jnp.sin(y).sum()
  return loss


def tag_relative_to_blocks(next_fun, args, kwargs, ctx):
  """The hand-written reference for tag_outputs: name submodule outputs by
  their path below ``Block_i``."""
  out = next_fun(*args, **kwargs)
  path = ctx.module.path
  if ctx.method_name == "__call__" and len(path) > 1 and path[0].startswith(
      "Block_"):
    out = rt.tag(out, "/".join(path[1:]))
  return out


def linen_reference_loss(jax_policy, train=False):
  model = Model(nn.remat(Block, policy=jax_policy, static_argnums=(2,)))
  inner = linen_loss(model, train)

  def loss(params):
    with nn.intercept_methods(tag_relative_to_blocks):
      return inner(params)
  return loss


def test_linen_same_variables_and_outputs():
  model = rt.remat_modules(Model(), {"Block_*": "save-attention"})
  assert type(model).__name__ == "Model" and isinstance(model, Model)
  variables = model.init(jax.random.key(0), X)
  assert_trees_close(variables, VARIABLES)
  assert_trees_close(model.apply(VARIABLES, X), Model().apply(VARIABLES, X))
  _, state = model.init_with_output(jax.random.key(0), X)
  assert jax.tree.structure(state) == jax.tree.structure(VARIABLES)


def test_linen_policies(remat_mode, fresh_trace_warnings):
  plain = grad_of(linen_loss(Model()), VARIABLES)
  for policy in POLICIES:
    model = rt.remat_modules(Model(), {"Block_*": policy})
    loss = linen_loss(model)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      assert_trees_close(grad_of(loss, VARIABLES), plain)
      ours = residuals(loss, VARIABLES)
    assert ours == residuals(linen_reference_loss(HAND_WRITTEN[policy]),
                             VARIABLES), policy
    unmatched = [w for w in caught if "keeps none of its names" in str(
        w.message)]
    assert bool(unmatched) == (policy == "recompute-attention-core"), policy
  # The module-name patterns of the built-ins matched the generated tags.
  model = rt.remat_modules(Model(), {"Block": "save-attention"})
  assert {"attn/query", "attn/key", "attn/value"} <= named(
      residuals(linen_loss(model), VARIABLES)) <= set(ATTN_NAMES)


def test_linen_dropout_masks_repeat(remat_mode):
  model = rt.remat_modules(Model(), {"Block": "boundary-only"})
  assert_trees_close(grad_of(linen_loss(model, train=True), VARIABLES),
                     grad_of(linen_loss(Model(), train=True), VARIABLES))
  assert residuals(linen_loss(model, train=True), VARIABLES) == residuals(
      linen_reference_loss(cp.nothing_saveable, train=True), VARIABLES)


def count_regions(model, variables):
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, X))(variables).jaxpr
  return count_remat_regions(jaxpr)


def test_linen_rule_forms_and_precedence():
  by_class = rt.remat_modules(Model(), {"MultiHeadDotProductAttention": None})
  by_path = rt.remat_modules(Model(), {"*/attn": None})
  assert count_regions(by_class, VARIABLES) == 2
  assert count_regions(by_path, VARIABLES) == 2
  # The first matching rule wins, and regions do not nest: the attention
  # inside each block is part of the block's region.
  both = rt.remat_modules(Model(), {"Block_*": "save-ffn",
                                    "*/attn": "save-attention"})
  assert count_regions(both, VARIABLES) == 2
  assert named(residuals(linen_loss(both), VARIABLES)) <= set(MLP_NAMES)


def test_linen_ambient_policy():
  model = rt.remat_modules(Model(), {"Block": None})
  with rt.use_policy("save-ffn"):
    kept = named(residuals(linen_loss(model), VARIABLES))
  assert "mlp/fc1" in kept and kept <= set(MLP_NAMES)
  assert named(residuals(linen_loss(model), VARIABLES)) == set()


def test_linen_without_tag_outputs_warns(fresh_trace_warnings):
  model = rt.remat_modules(Model(), {"Block": "save-attention"},
                           tag_outputs=False)
  with pytest.warns(UserWarning, match="save-attention.*there is no checkpoint name in"):
    kept = named(residuals(linen_loss(model), VARIABLES))
  assert kept == set()


def test_linen_mutable_collection():
  class NormBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.BatchNorm(use_running_average=False, name="bn")(x)
      self.sow("intermediates", "h", h)
      return nn.Dense(D, kernel_init=cheap_init, name="mlp")(h)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return NormBlock()(x)

  variables = Net().init(jax.random.key(0), X)
  results = []
  for model in (rt.remat_modules(Net(), {"NormBlock": "save-ffn"}), Net()):
    def loss(params, model=model):
      y, updates = model.apply({**variables, "params": params}, X,
                               mutable=["batch_stats", "intermediates"])
      return jnp.sin(y).sum(), updates
    results.append(jax.value_and_grad(loss, has_aux=True)(
        variables["params"]))
  assert_trees_close(results[0], results[1])
  assert len(results[0][0][1]["intermediates"]["NormBlock_0"]["h"]) == 1


def test_linen_unmatched_rule_lists_what_exists():
  model = rt.remat_modules(Model(), {"Blok_*": "save-ffn", "Block": None})
  with pytest.warns(UserWarning, match=r"\['Blok_\*'\] match no module.*"
                    r"'MultiHeadDotProductAttention'.*'Block_0/attn'"):
    model.apply(VARIABLES, X)
  strict = rt.remat_modules(Model(), {"Blok_*": "save-ffn"}, strict=True)
  with pytest.raises(ValueError, match="Blok_.*classes.*'Block'"):
    strict.apply(VARIABLES, X)


# ---------------------------------------------------------------- NNX model

class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        HEADS, D, decode=False, dropout_rate=0.5, kernel_init=cheap_init,
        rngs=rngs)
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.mlp = NNXMlp(D, rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class NNXModel(nnx.Module):
  def __init__(self, rngs, block_cls=NNXBlock):
    self.blocks = nnx.List([block_cls(rngs) for _ in range(2)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def nnx_model(block_cls=NNXBlock, train=False):
  model = NNXModel(nnx.Rngs(0, dropout=DROPOUT_KEY), block_cls)
  model.train() if train else model.eval()
  return model


def nnx_loss_and_args(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest):
    rest = jax.tree.map(lambda a: a, rest)  # fresh Variables in this trace
    return jnp.sin(nnx.merge(graphdef, params, rest)(X)).sum()
  return loss, params, rest


class Tagged(nnx.Module):
  """Hand-written tagging for the reference model."""

  def __init__(self, inner, name):
    self.inner, self.name = inner, name

  def __call__(self, *args, **kwargs):
    return rt.tag(self.inner(*args, **kwargs), self.name)


def nnx_reference(jax_policy, train=False):
  class RefBlock(NNXBlock):
    @nnx.remat(policy=jax_policy)
    def __call__(self, x):
      return NNXBlock.__call__(self, x)

  model = nnx_model(RefBlock, train)
  for block in model.blocks:
    for sub in ("query", "key", "value", "out"):
      setattr(block.attn, sub, Tagged(getattr(block.attn, sub), f"attn/{sub}"))
    for sub in ("fc1", "fc2"):
      setattr(block.mlp, sub, Tagged(getattr(block.mlp, sub), f"mlp/{sub}"))
    for sub in ("ln1", "attn", "ln2", "mlp"):
      setattr(block, sub, Tagged(getattr(block, sub), sub))
  return model


def test_nnx_policies(remat_mode, fresh_trace_warnings):
  plain_loss, params, rest = nnx_loss_and_args(nnx_model())
  plain = grad_of(plain_loss, params, rest)
  for policy in POLICIES:
    if policy == "recompute-attention-core":
      with pytest.warns(UserWarning, match="keeps none of its names"):
        model = rt.remat_modules(nnx_model(), {"blocks/*": policy})
        loss, _, _ = nnx_loss_and_args(model)
        residuals(loss, params, rest)
    model = rt.remat_modules(nnx_model(), {"blocks/*": policy})
    loss, params_, rest_ = nnx_loss_and_args(model)
    assert jax.tree.structure((params_, rest_)) == jax.tree.structure(
        (params, rest))
    assert_trees_close(grad_of(loss, params, rest), plain)
    ref_loss, ref_params, ref_rest = nnx_loss_and_args(
        nnx_reference(HAND_WRITTEN[policy]))
    assert residuals(loss, params, rest) == residuals(
        ref_loss, ref_params, ref_rest), policy


def test_nnx_dropout_masks_repeat(remat_mode):
  model = rt.remat_modules(nnx_model(train=True), {"NNXBlock": "boundary-only"})
  loss, params, rest = nnx_loss_and_args(model)
  plain_loss, _, _ = nnx_loss_and_args(nnx_model(train=True))
  assert_trees_close(grad_of(loss, params, rest),
                     grad_of(plain_loss, params, rest))
  ref_loss, ref_params, ref_rest = nnx_loss_and_args(
      nnx_reference(cp.nothing_saveable, train=True))
  assert residuals(loss, params, rest) == residuals(ref_loss, ref_params,
                                                    ref_rest)


def test_nnx_returns_a_copy_and_rngs_advance():
  original = nnx_model(train=True)
  before = nnx.state(original)
  model = rt.remat_modules(original, {"blocks/*": "save-attention"})
  assert type(original.blocks[0].attn) is nnx.MultiHeadAttention
  assert isinstance(model.blocks[0].attn, nnx.MultiHeadAttention)
  assert_trees_close(nnx.state(model), before)
  plain = nnx.clone(original)
  np.testing.assert_allclose(model(X), plain(X), rtol=1e-5)
  # The dropout rng counters were written back from inside the regions.
  assert_trees_close(nnx.state(model, nnx.RngCount),
                     nnx.state(plain, nnx.RngCount))
  assert_trees_close(nnx.state(original), before)


def test_nnx_unmatched_rule():
  with pytest.warns(UserWarning,
                    match=r"\['Blok'\].*'NNXBlock'.*'blocks/0/attn'"):
    rt.remat_modules(nnx_model(), {"Blok": None, "NNXBlock": None})
  with pytest.raises(ValueError, match="Blok"):
    rt.remat_modules(nnx_model(), {"Blok": None}, strict=True)


# ---------------------------------------------------------------- bad input

def test_bad_input():
  with pytest.raises(TypeError, match="rules must map"):
    rt.remat_modules(Model(), ["Block"])
  with pytest.raises(ValueError, match="rules is empty"):
    rt.remat_modules(Model(), {})
  with pytest.raises(ValueError, match="Did you mean 'save-ffn'"):
    rt.remat_modules(Model(), {"Block": "save-fnn"})
  with pytest.raises(TypeError, match="rule keys"):
    rt.remat_modules(Model(), {3: "save-ffn"})
  with pytest.raises(TypeError, match="got 'model' of type str"):
    rt.remat_modules("model", {"Block": None})
  bound = Model().bind(VARIABLES)
  with pytest.raises(TypeError, match="unbound linen Module"):
    rt.remat_modules(bound, {"Block": None})


_FIRST_CALL_SCRIPT = r"""
import json
import jax, jax.numpy as jnp
import flax.linen as nn
import remat_toolkit as rt
from shared_helpers import jax_activation_bytes

class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, name="attn")(x)
    return x + nn.Dense(x.shape[-1], name="mlp")(jnp.tanh(h))

class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(name=f"h_{i}")(x)
    return x

x = jnp.ones((64, 32))
params = Model().init(jax.random.key(0), x)  # the unwrapped model's
model = rt.remat_modules(Model(), {"Block": "save-attention"})
loss = lambda p, x: model.apply(p, x).sum()
first = rt.analyze(loss, params, x).activation_bytes
theirs = jax_activation_bytes(loss, (params, x), "boundary-only")
print(json.dumps([first, theirs]))
"""


@pytest.mark.slow
def test_the_first_analysis_in_a_fresh_process_counts_every_region():
  # A region with its own pattern policy used to expand its patterns against
  # the names tagged so far in the process: on the first trace the first
  # block's names were not yet known, and its residuals were dropped.
  ours, theirs = run_on_simulated_devices(_FIRST_CALL_SCRIPT, count=1)
  assert ours == theirs > 0


# --------------------------------------------- inside the model's own remat

class _SelfRematted(nn.Module):
  """Blocks the model already wraps in nn.remat (Hugging Face's
  gradient_checkpointing, recurrentgemma's default)."""
  remat_blocks: bool = True

  @nn.compact
  def __call__(self, x):
    block = nn.remat(Mlp) if self.remat_blocks else Mlp
    for i in range(2):
      x = block(name=f"layers_{i}")(x)
    return x


def _shadow_warnings(model, policy):
  model = rt.remat_modules(model)
  params = model.init(jax.random.key(0), X)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with rt.use_policy(policy):
      jax.grad(lambda p: model.apply(p, X).sum())(params)
  return [str(w.message) for w in caught if "model's own remat" in str(w.message)]


def test_training_inside_the_models_own_remat_warns_once(remat_mode,
                                                         fresh_trace_warnings):
  """The policy changes nothing inside nn.remat: said at trace time, once,
  naming the model's region and the fix."""
  said = _shadow_warnings(_SelfRematted(), "save-everything")
  assert len(said) == 1
  assert "'layers_0'" in said[0] and "CheckpointMlp" in said[0]
  assert "rt.repolicy" in said[0] and "'save-everything'" in said[0]
  assert not _shadow_warnings(_SelfRematted(), "save-everything")  # once


def test_no_shadow_warning_without_the_models_remat_or_with_boundary_only(
    remat_mode, fresh_trace_warnings):
  assert not _shadow_warnings(_SelfRematted(remat_blocks=False), "save-everything")
  assert not _shadow_warnings(_SelfRematted(), "boundary-only")


def _enclosed_warnings(loss, policy):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with rt.use_policy(policy):
      jax.jit(jax.grad(loss))(jnp.eye(4), jnp.ones((2, 4)))
  return [str(w.message) for w in caught
          if "remat region the program makes itself" in str(w.message)]


_TOOLKIT_REGION = rt.remat(lambda w, x: jnp.tanh(x @ w) + x)


def _two_regions(w, x):
  return _TOOLKIT_REGION(w, _TOOLKIT_REGION(w, x))


def test_a_region_inside_a_foreign_jax_checkpoint_or_nnx_remat_warns_once(
    remat_mode, fresh_trace_warnings):
  """A toolkit region traced inside the program's own jax.checkpoint or
  nnx.remat: the outer region recomputes it by its own policy, so the
  policy asked for changes nothing; said at trace time, once, naming the
  outer region's function and the fix."""
  def under_checkpoint(w, x):
    return jax.checkpoint(_two_regions)(w, x).sum()

  def under_nnx_remat(w, x):
    return nnx.remat(lambda w, x: _two_regions(w, x))(w, x).sum()

  for loss, outer in [(under_checkpoint, "_two_regions at"),
                      (under_nnx_remat, "<lambda> at")]:
    said = _enclosed_warnings(loss, "save-everything")
    assert len(said) == 1, said
    assert outer in said[0] and "test_remat_modules.py" in said[0]
    assert "rt.repolicy" in said[0] and "'save-everything'" in said[0]
  assert not _enclosed_warnings(under_checkpoint, "save-everything")  # once


def test_no_enclosed_warning_for_the_toolkits_own_nesting_or_boundary_only(
    remat_mode, fresh_trace_warnings):
  def nested(w, x):
    return rt.remat(_two_regions)(w, x).sum()

  def under_checkpoint(w, x):
    return jax.checkpoint(_two_regions)(w, x).sum()

  assert not _enclosed_warnings(nested, "save-everything")
  assert not _enclosed_warnings(lambda w, x: _two_regions(w, x).sum(),
                                "save-everything")
  assert not _enclosed_warnings(under_checkpoint, "boundary-only")
