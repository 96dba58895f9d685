"""rt.remat_modules without rules: finding the repeated blocks itself.

The reference is the same model with the explicit rule ``{BLOCK_CLASS: None}``
(tested against hand-written remat in test_remat_modules.py): discovery must
make exactly those regions, so the residuals JAX saves are the same under any
ambient policy.
"""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import third_party_models as tp
from flax import nnx
from shared_helpers import NNXMlp
from shared_helpers import assert_trees_close
from shared_helpers import concrete
from shared_helpers import count_remat_regions
from shared_helpers import residuals

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit.results import RematSummary

POLICIES = ("save-attention", "save-ffn")


def filled(shapes, seed=0):
  """Small real values for abstract params, without running initialisers."""
  rng = np.random.RandomState(seed)
  return jax.tree.map(lambda s: jnp.asarray(
      rng.normal(size=s.shape) * 0.1, s.dtype), shapes)


# ---------------------------------------------------------------- Hugging Face

@pytest.fixture
def hf_numpy_rules():
  """Hugging Face's Flax models rely on NumPy rank promotion, which the
  suite otherwise turns into an error."""
  with jax.numpy_rank_promotion("allow"):
    yield


EXPECTED_REGIONS = {
    "gpt2": ["transformer/h/0", "transformer/h/1"],
    "bert": ["encoder/layer/0", "encoder/layer/1"],
    "t5": ["encoder/block/0", "encoder/block/1",
           "decoder/block/0", "decoder/block/1"],
    "llama": ["model/layers/0", "model/layers/1"],
}


@pytest.mark.usefixtures("hf_numpy_rules")
@pytest.mark.parametrize("name", sorted(tp.BUILDERS))
def test_hugging_face_blocks_found(name):
  m = tp.BUILDERS[name]()
  auto = rt.remat_modules(m.module)
  assert not rt.remat_summary(auto).ran
  assert "call its init or apply first" in str(rt.remat_summary(auto))
  params = jax.eval_shape(m.init)
  assert jax.tree.structure(jax.eval_shape(lambda: m.init(auto))) == (
      jax.tree.structure(params))
  summary = rt.remat_summary(auto)
  block = tp.BLOCK_CLASSES[name]
  assert (summary.auto, summary.classes) == (True, (block,))
  assert list(summary.regions) == EXPECTED_REGIONS[name]
  assert str(summary) == (
      f"remat_modules chose {block} ({len(summary.regions)} regions: "
      f"{', '.join(summary.regions)})")
  explicit = rt.remat_modules(m.module, {block: None})
  for policy in POLICIES:
    with rt.use_policy(policy):
      assert residuals(m.loss(auto), params) == residuals(
          m.loss(explicit), params), policy


@pytest.mark.usefixtures("hf_numpy_rules")
def test_hugging_face_gradients_unchanged():
  m = tp.gpt2()
  params = filled(jax.eval_shape(m.init))
  auto = rt.remat_modules(m.module)
  with rt.use_policy("save-attention"):
    got, want = jax.jit(lambda p: (jax.grad(m.loss(auto))(p),
                                   jax.grad(m.loss())(p)))(params)
  assert_trees_close(got, want)


# ---------------------------------------------------------------- built-in GPT

CONFIG = dataclasses.replace(models.get_config("tiny"), remat=False)
TOKENS = jax.ShapeDtypeStruct((2, CONFIG.seq_len), jnp.int32)


def linen_gpt_loss(model):
  return lambda params, tokens: jnp.mean(
      model.apply({"params": params}, tokens) ** 2)


def test_builtin_linen_gpt():
  auto = rt.remat_modules(models.GPT(CONFIG))
  params = jax.eval_shape(auto.init, jax.random.key(0), TOKENS)["params"]
  assert str(rt.remat_summary(auto)) == (
      "remat_modules chose Block (2 regions: layers_0, layers_1)")
  explicit = rt.remat_modules(models.GPT(CONFIG), {"Block": None})
  for policy in POLICIES:
    with rt.use_policy(policy):
      assert residuals(linen_gpt_loss(auto), params, TOKENS) == residuals(
          linen_gpt_loss(explicit), params, TOKENS), policy


def nnx_loss(model):
  """``(params, tokens) -> scalar`` and the params; the rest of the state
  (rng keys and counts) is made real, as build_loss does."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rest = concrete(rest)

  def loss(params, tokens):
    live = nnx.merge(graphdef, params, rest, copy=True)
    return jnp.mean(live(tokens) ** 2)
  return loss, params


def test_builtin_nnx_gpt():
  # Discovery reads the graph only: an abstract model will do.
  model = nnx.eval_shape(lambda: models.NNXGPT(CONFIG, rngs=nnx.Rngs(0)))
  auto = rt.remat_modules(model)
  assert str(rt.remat_summary(auto)) == (
      "remat_modules chose NNXBlock (2 regions: layers/0, layers/1)")
  auto_loss, params = nnx_loss(auto)
  explicit_loss, _ = nnx_loss(rt.remat_modules(model, {"NNXBlock": None}))
  for policy in POLICIES:
    with rt.use_policy(policy):
      assert residuals(auto_loss, params, TOKENS) == residuals(
          explicit_loss, params, TOKENS), policy


class NNXStack(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([NNXMlp(4, rngs) for _ in range(3)])

  def __call__(self, x):
    for block in self.blocks:
      x = x + block(x)
    return x


def test_nnx_gradients_unchanged():
  plain = NNXStack(nnx.Rngs(0))
  auto = rt.remat_modules(plain)
  assert rt.remat_summary(auto).regions == ("blocks/0", "blocks/1", "blocks/2")
  x = jnp.linspace(-1, 1, 8).reshape(2, 4)

  def grad(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return jax.grad(lambda p: jnp.sum(jnp.sin(
        nnx.merge(graphdef, p, rest, copy=True)(x))))(params)

  with rt.use_policy("boundary-only"):
    got, want = jax.jit(lambda: (grad(auto), grad(plain)))()
  assert_trees_close(got, want)


# ---------------------------------------------------------------- nothing found

X = jnp.ones((2, 4))


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(4, name="mlp")(jnp.tanh(x))


class OneBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(Block()(nn.Dense(4)(x)))


class TwoBlocks(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Block()(Block()(x))


def count_regions(model, variables):
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, X))(variables).jaxpr
  return count_remat_regions(jaxpr)


def test_linen_nothing_found_warns_once():
  model = rt.remat_modules(OneBlock())
  with pytest.warns(UserWarning, match=r"no repeated blocks in OneBlock.*"
                    r"Pass rules.*\{'Block': None\}"):
    variables = model.init(jax.random.key(0), X)
  summary = rt.remat_summary(model)
  assert (summary.ran, summary.regions) == (True, ())
  assert "found no repeated blocks in OneBlock" in str(summary)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = model.apply(variables, X)
    assert count_regions(model, variables) == 0
  np.testing.assert_allclose(out, OneBlock().apply(variables, X))
  strict = rt.remat_modules(OneBlock(), strict=True)
  with pytest.raises(ValueError, match="no repeated blocks in OneBlock"):
    strict.init(jax.random.key(0), X)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.mlp = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return x + self.mlp(x)


class NNXOneBlock(nnx.Module):
  def __init__(self, rngs):
    self.block, self.head = NNXBlock(rngs), nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.block(x))


def test_nnx_nothing_found_warns():
  with pytest.warns(UserWarning, match=r"no repeated blocks in NNXOneBlock.*"
                    r"\{'NNXBlock': None\}"):
    model = rt.remat_modules(NNXOneBlock(nnx.Rngs(0)))
  assert "found no repeated blocks" in str(rt.remat_summary(model))
  with pytest.raises(ValueError, match="no repeated blocks"):
    rt.remat_modules(NNXOneBlock(nnx.Rngs(0)), strict=True)


# ---------------------------------------------------------------- rules win

def test_explicit_rules_win():
  variables = jax.eval_shape(TwoBlocks().init, jax.random.key(0), X)
  by_rule = rt.remat_modules(TwoBlocks(), {"*/mlp": None})
  assert count_regions(by_rule, variables) == 2
  assert str(rt.remat_summary(by_rule)) == (
      "remat_modules rules matched Dense (2 regions: Block_0/mlp, "
      "Block_1/mlp)")
  auto = rt.remat_modules(TwoBlocks())
  assert count_regions(auto, variables) == 2
  assert rt.remat_summary(auto).regions == ("Block_0", "Block_1")

  class NNXTwo(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])

  nnx_rule = rt.remat_modules(NNXTwo(nnx.Rngs(0)), {"*/mlp": None})
  assert rt.remat_summary(nnx_rule).regions == ("blocks/0/mlp", "blocks/1/mlp")
  nnx_auto = rt.remat_modules(NNXTwo(nnx.Rngs(0)))
  assert rt.remat_summary(nnx_auto).regions == ("blocks/0", "blocks/1")


def test_summary_of_other_models_and_long_stacks():
  with pytest.raises(TypeError, match="returned by rt.remat_modules"):
    rt.remat_summary(TwoBlocks())
  summary = RematSummary(
      model="T5", auto=True, classes=("Layer",),
      regions=tuple(f"encoder/block/{i}" for i in range(12)) + (
          "decoder/block/0", "decoder/block/1"))
  assert str(summary) == (
      "remat_modules chose Layer (14 regions: encoder/block/0 .. "
      "encoder/block/11, decoder/block/0, decoder/block/1)")


def test_summary_in_a_notebook_is_a_table_of_regions():
  summary = RematSummary(model="GPT", auto=False, classes=("Block",),
                         regions=("h/0", "h/1"))
  html = summary._repr_html_()
  assert "<pre>" not in html and "rules matched Block in GPT" in html
  assert html.count("<tr>") == 3  # the header and one row per region
  assert ">h/1</td>" in html
  not_run = RematSummary(model="GPT", auto=True, ran=False)
  assert not_run._repr_html_().startswith("<p")
  assert "call its init or apply first" in not_run._repr_html_()


# ---------------------------------------------------------------- along the depth

def variables_of(module, inputs):
  """Abstract variables (params and batch_stats) of a linen module."""
  return jax.eval_shape(lambda: module.init(jax.random.key(0), **inputs))


def loss_of(module, inputs):
  def loss(variables):
    out = module.apply(variables, **inputs)
    first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    return jnp.mean(jnp.square(first))
  return loss


def region_count(loss, variables):
  return count_remat_regions(jax.make_jaxpr(loss)(variables).jaxpr)


DEPTH_EXPECTED = {
    "resnet": ("FlaxResNetBottleNeckLayer",
               [f"encoder/stages/{s}/layers/{i}" for s in (0, 1)
                for i in (0, 1)], None),
    "regnet": ("FlaxRegNetYLayer",
               [f"encoder/stages/{s}/layers/{i}" for s in (0, 1)
                for i in (0, 1)], None),
    "wav2vec2": ("FlaxWav2Vec2EncoderLayerStableLayerNorm",
                 ["encoder/layers/0", "encoder/layers/1"], None),
    "albert": ("FlaxAlbertLayerCollections",
               ["encoder/albert_layer_groups/0"], (2,)),
}


@pytest.mark.usefixtures("hf_numpy_rules")
@pytest.mark.parametrize("name", sorted(tp.DEPTH_BUILDERS))
def test_hugging_face_depth_blocks_found(name):
  m = tp.DEPTH_BUILDERS[name]()
  block, regions, applications = DEPTH_EXPECTED[name]
  auto = rt.remat_modules(m.module)
  variables = variables_of(auto, m.inputs)
  summary = rt.remat_summary(auto)
  assert (summary.classes, list(summary.regions)) == ((block,), regions)
  applied = applications or (1,) * len(regions)
  assert summary.applications == applied
  # JAX sees one remat region per application, and saves the same as the
  # explicit rule naming the block.
  assert region_count(loss_of(auto, m.inputs), variables) == sum(applied)
  explicit = rt.remat_modules(m.module, {block: None})
  with rt.use_policy("boundary-only"):
    assert residuals(loss_of(auto, m.inputs), variables) == residuals(
        loss_of(explicit, m.inputs), variables)


@pytest.mark.usefixtures("hf_numpy_rules")
def test_hugging_face_albert_summary_counts_applications():
  m = tp.albert()
  model = rt.remat_modules(m.module, {"FlaxAlbertLayer": None})
  variables = variables_of(model, m.inputs)
  summary = rt.remat_summary(model)
  assert summary.regions == (
      "encoder/albert_layer_groups/0/albert_layers/0",)
  assert (summary.applications, summary.total_applications) == ((2,), 2)
  assert region_count(loss_of(model, m.inputs), variables) == 2
  assert "1 region module applied 2 times, so 2 regions per call" in str(
      summary)


@pytest.mark.usefixtures("hf_numpy_rules")
def test_hugging_face_conv_feature_extractor_when_asked():
  m = tp.wav2vec2()
  model = rt.remat_modules(m.module,
                           {"FlaxWav2Vec2LayerNormConvLayer": None})
  variables_of(model, m.inputs)
  assert rt.remat_summary(model).regions == (
      "feature_extractor/conv_layers/0", "feature_extractor/conv_layers/1")


class ResidualLayer(nn.Module):
  """Conv, relu, conv, plus the input: a ResNet basic layer."""

  @nn.compact
  def __call__(self, x):
    h = nn.Conv(4, (3, 3), name="conv_0")(x)
    return x + nn.Conv(4, (3, 3), name="conv_1")(jax.nn.relu(h))


class Stage(nn.Module):
  depth: int = 2

  @nn.compact
  def __call__(self, x):
    for i in range(self.depth):
      x = ResidualLayer(name=f"layers_{i}")(x)
    return x


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), name="stem")(x)
    for i in range(2):
      x = Stage(name=f"stages_{i}")(x)
    return jnp.mean(x, axis=(1, 2))


class Expert(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(jax.nn.relu(nn.Dense(8)(x)))


class ExpertsBlock(nn.Module):
  """Nothing but experts applied side by side: the block, not a stage."""

  @nn.compact
  def __call__(self, x):
    return x + sum(Expert(name=f"experts_{j}")(x) for j in range(2))


class MoEStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = ExpertsBlock(name=f"layers_{i}")(x)
    return x


class SharedLayerModel(nn.Module):
  """One layer module applied three times (ALBERT's pattern)."""

  def setup(self):
    self.embed = nn.Dense(4)
    self.layer = Block()

  def __call__(self, x):
    x = self.embed(x)
    for _ in range(3):
      x = self.layer(x)
    return x


class ConvLayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(jax.nn.gelu(nn.Conv(4, (3,), strides=2)(x)))


class SpeechModel(nn.Module):
  """A convolutional feature extractor, then two dense layers (Wav2Vec2)."""

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = ConvLayer(name=f"conv_layers_{i}")(x)
    for i in range(2):
      x = Block(name=f"layers_{i}")(x)
    return x


IMAGES = jnp.linspace(-1, 1, 2 * 8 * 8 * 4).reshape(2, 8, 8, 4)
SOUND = jnp.linspace(-1, 1, 2 * 16 * 4).reshape(2, 16, 4)


def boundaries(module, x):
  """JAX's saved residuals under boundary-only, less the parameters and the
  closed-over input: with a linear loss, the region inputs."""
  variables = jax.eval_shape(module.init, jax.random.key(0), x)

  def loss(v):
    return jnp.sum(module.apply(v, x))
  with rt.use_policy("boundary-only"):
    return [r for r in residuals(loss, variables)
            if r[2] not in ("argument", "constant")]


def test_stages_of_residual_layers_give_the_layers(remat_mode):
  model = rt.remat_modules(ConvNet())
  found = boundaries(model, IMAGES)
  summary = rt.remat_summary(model)
  assert summary.regions == tuple(f"stages_{s}/layers_{i}" for s in (0, 1)
                                  for i in (0, 1))
  assert summary.classes == ("ResidualLayer",)
  # One region input per layer; regions of whole stages save half as many.
  assert found == [((2, 8, 8, 4), "float32", "output of add")] * 4
  stages = rt.remat_modules(ConvNet(), {"Stage": None})
  assert len(boundaries(stages, IMAGES)) == 2


def test_experts_side_by_side_are_not_a_stage():
  model = rt.remat_modules(MoEStack())
  jax.eval_shape(model.init, jax.random.key(0), X)
  assert rt.remat_summary(model).regions == ("layers_0", "layers_1")


def test_shared_layer_applied_n_times_is_found(remat_mode):
  model = rt.remat_modules(SharedLayerModel())
  found = boundaries(model, X)
  summary = rt.remat_summary(model)
  assert (summary.classes, summary.regions) == (("Block",), ("layer",))
  assert (summary.applications, summary.total_applications) == ((3,), 3)
  assert str(summary) == ("remat_modules chose Block (1 region module "
                          "applied 3 times, so 3 regions per call: layer)")
  # The input of each application.
  assert found == [((2, 4), "float32", "output of add")] * 3


def test_conv_feature_extractor_only_when_asked(remat_mode):
  model = rt.remat_modules(SpeechModel())
  found = boundaries(model, SOUND)
  assert rt.remat_summary(model).regions == ("layers_0", "layers_1")
  assert found == boundaries(rt.remat_modules(SpeechModel(), {"Block": None}),
                             SOUND)
  asked = rt.remat_modules(SpeechModel(), {"ConvLayer": None, "Block": None})
  # Each region's input, but the first: the closed-over input itself.
  assert len(boundaries(asked, SOUND)) == 3
  assert rt.remat_summary(asked).regions == (
      "conv_layers_0", "conv_layers_1", "layers_0", "layers_1")


class Embeddings(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(nn.Dense(4)(x))


class Transformer(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.Dense(4, name="query")(h) * nn.Dense(4, name="key")(h)
    return x + nn.Dense(4, name="out")(nn.Dense(8, name="mlp")(h))


class Unrepeated(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Transformer()(Embeddings()(x))


def test_advice_names_the_likely_block_not_the_first_class():
  model = rt.remat_modules(Unrepeated())
  with pytest.warns(UserWarning, match=r"no repeated blocks in Unrepeated.*"
                    r"\{'Transformer': None\}\) \(the likeliest block\)"):
    jax.eval_shape(model.init, jax.random.key(0), X)
