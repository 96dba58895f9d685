"""The built-in GPT: configs, tags, linen/NNX parity, layouts, dropout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from shared_helpers import assert_trees_close
from shared_helpers import checkpoint_name_of
from shared_helpers import checkpoint_names
from shared_helpers import jax_residuals
from shared_helpers import module_path
from shared_helpers import remat_bodies
from shared_helpers import sub_jaxprs

import remat_toolkit as rt
from remat_toolkit import models

BLOCK_TAGS = frozenset(rt.names.VOCABULARY) - {"attn.qkv"}


pytestmark = pytest.mark.usefixtures("quick_compiles")


def param_count(params) -> int:
  return sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))


def expected_param_count(cfg: models.GPTConfig) -> int:
  """Parameters of a GPT-2 / LLaMA-style decoder, counted from the config."""
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
  bias = int(cfg.use_bias)
  norm = 2 * d if cfg.norm == "layernorm" else d
  attn = 4 * (d * d + bias * d)
  ffn_mats = 3 if cfg.ffn == "swiglu" else 2
  ffn = ffn_mats * d * f + bias * ((ffn_mats - 1) * f + d)
  block = attn + ffn + 2 * norm
  embed = v * d + (cfg.seq_len * d if cfg.positions == "learned" else 0)
  head = 0 if cfg.tie_embeddings else d * v
  return embed + cfg.num_layers * block + norm + head


@functools.cache
def real_loss(config="tiny", framework="linen", scan=False, group=1,
              remat=True, dropout=False):
  return models.build_loss(config, framework=framework, scan=scan, group=group,
                           remat=remat, dropout=dropout, abstract=False)


# ---------------------------------------------------------------- configs

def test_named_configs():
  assert set(models.list_configs()) >= {
      "tiny", "gpt2-small", "gpt2-xl", "llama-7b", "seed-example"}
  shape = lambda c: (c.num_layers, c.d_model, c.num_heads, c.seq_len)  # noqa: E731
  assert shape(models.get_config("gpt2-small")) == (12, 768, 12, 1024)
  assert shape(models.get_config("gpt2-xl")) == (48, 1600, 25, 1024)
  llama = models.get_config("llama-7b")
  assert shape(llama) == (32, 4096, 32, 4096)
  assert (llama.ffn, llama.d_ff, llama.vocab_size, llama.dtype) == (
      "swiglu", 11008, 32000, "bfloat16")
  seed = models.get_config("seed-example")
  assert (shape(seed), seed.batch_size, seed.d_ff, seed.dtype) == (
      (24, 4096, 32, 2048), 2, 4 * 4096, "bfloat16")
  assert models.get_config("tiny", num_layers=3).num_layers == 3


def test_config_errors():
  with pytest.raises(ValueError, match=r"'gpt3'.*known configs are .*'tiny'"):
    models.get_config("gpt3")
  with pytest.raises(TypeError, match="no field"):
    models.get_config("tiny", layers=3)
  with pytest.raises(ValueError, match="num_heads=3 must divide d_model=32"):
    models.get_config("tiny", num_heads=3)
  with pytest.raises(ValueError, match="ffn must be one of"):
    models.get_config("tiny", ffn="relu")
  with pytest.raises(ValueError, match="floating dtype"):
    models.get_config("tiny", dtype="int8")
  with pytest.raises(ValueError, match="remat_group"):
    models.get_config("tiny", remat_group=0)
  with pytest.raises(ValueError, match="framework"):
    models.build_loss("tiny", framework="torch")


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_gpt2_small_has_124m_parameters_without_allocating(framework):
  _, (params, batch) = models.build_loss("gpt2-small", framework=framework)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct)
             for leaf in jax.tree_util.tree_leaves((params, batch)))
  count = param_count(params)
  assert count == expected_param_count(models.get_config("gpt2-small"))
  assert abs(count - 124.44e6) < 0.01e6  # GPT-2 small, tied head


@pytest.mark.parametrize("framework, scan", [("linen", False), ("nnx", True)])
def test_llama_7b_is_analysed_on_abstract_shapes(framework, scan):
  before = sum(a.nbytes for a in jax.live_arrays())
  loss_fn, (params, batch) = models.build_loss("llama-7b", framework=framework,
                                               scan=scan)
  jaxpr = jax.make_jaxpr(loss_fn)(params, batch)
  after = sum(a.nbytes for a in jax.live_arrays())
  assert after - before < 2**20  # nothing of the 13 GB was allocated
  assert param_count(params) == expected_param_count(models.get_config("llama-7b"))
  assert abs(param_count(params) - 6.74e9) < 0.01e9
  assert batch["inputs"].shape == (1, 4096)
  assert jaxpr.out_avals[0].dtype == jnp.float32 and jaxpr.out_avals[0].shape == ()
  leaves = jax.tree_util.tree_leaves(params)
  assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
  assert len(list(remat_bodies(jaxpr.jaxpr))) == (1 if scan else 32)


def test_build_loss_overrides():
  _, (params, batch) = models.build_loss("gpt2-small", batch=3, seq=128,
                                         scan=True)
  assert batch["inputs"].shape == (3, 128)
  assert params["layers"]["attn"]["query"]["kernel"].shape == (12, 768, 768)
  assert params["pos_embed"]["embedding"].shape == (128, 768)


# ---------------------------------------------------------------- tags

@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("config, scan", [
    ("tiny", False), ("tiny-swiglu", False), ("tiny", True)])
def test_every_tag_is_inside_each_remat_region(framework, config, scan):
  loss_fn, args = models.build_loss(config, framework=framework, scan=scan)
  jaxpr = jax.make_jaxpr(loss_fn)(*args).jaxpr
  expected = BLOCK_TAGS - ({"ffn.gate"} if config == "tiny" else set())
  bodies = list(remat_bodies(jaxpr))
  assert len(bodies) == (1 if scan else models.get_config(config).num_layers)
  for body in bodies:
    assert checkpoint_names(body) == expected


def test_no_remat_baseline_has_no_region():
  for scan in (False, True):
    loss_fn, args = models.build_loss("tiny", scan=scan, remat=False)
    jaxpr = jax.make_jaxpr(loss_fn)(*args).jaxpr
    assert list(remat_bodies(jaxpr)) == []
    assert checkpoint_names(jaxpr) >= BLOCK_TAGS - {"ffn.gate"}


def tag_paths(jaxpr, name):
  paths = set()
  for eqn in jaxpr.eqns:
    if checkpoint_name_of(eqn) == name:
      paths.add(module_path(eqn))
    for sub in sub_jaxprs(eqn):
      paths |= tag_paths(sub, name)
  return paths


@pytest.mark.parametrize("scan, group, expected", [
    (False, 1, {"layers_0/attn", "layers_1/attn"}),
    (True, 1, {"layers/attn"}),
    (False, 2, {"GPT.remat_group_0/layers_0/attn",
                "GPT.remat_group_0/layers_1/attn"})])
def test_linen_module_paths(scan, group, expected):
  loss_fn, args = models.build_loss("tiny", scan=scan, group=group)
  assert tag_paths(jax.make_jaxpr(loss_fn)(*args).jaxpr, "attn.q") == expected


def test_policy_selects_tagged_tensors():
  loss_fn, args = models.build_loss("tiny")
  names = sorted(r.name for r in jax_residuals(loss_fn, *args, policy="save-ffn")
                 if r.name)
  # ffn.down may be kept but the backward pass never needs it (a residual
  # add follows); block.output is the second region's input.
  assert names == ["block.output", "ffn.up", "ffn.up"]


# ---------------------------------------------------------------- layouts

def stack_layers(params, num_layers):
  """Unrolled linen params (``layers_i``) -> the scanned layout (``layers``)."""
  layers = [params[f"layers_{i}"] for i in range(num_layers)]
  rest = {k: v for k, v in params.items() if not k.startswith("layers_")}
  return {**rest, "layers": jax.tree_util.tree_map(
      lambda *xs: jnp.stack(xs), *layers)}


def linen_to_nnx(linen_params, nnx_params, *, scan):
  """Copies linen params into an NNX ``nnx.State`` of the same model."""
  pure = dict(linen_params)
  if scan:
    pure["layers"] = {"blocks": pure["layers"]}
  else:
    layer_keys = sorted(k for k in pure if k.startswith("layers_"))
    pure["layers"] = {int(k.split("_")[1]): pure.pop(k) for k in layer_keys}
  state = jax.tree_util.tree_map(lambda x: x, nnx_params)
  from flax import nnx
  nnx.replace_by_pure_dict(state, pure)
  return state


def test_scan_and_unrolled_gradients_are_equal():
  # Layout only (remat is compared with no remat below). NNX: its scanned and
  # unrolled losses both equal linen's (next test).
  unrolled_fn, (params, batch) = real_loss("tiny", "linen", False, remat=False)
  scanned_fn, _ = models.build_loss("tiny", scan=True, remat=False)
  stacked = stack_layers(params, 2)
  unrolled = jax.value_and_grad(unrolled_fn)(params, batch)
  scanned = jax.value_and_grad(scanned_fn)(stacked, batch)
  np.testing.assert_allclose(unrolled[0], scanned[0], rtol=1e-6)
  assert_trees_close(stack_layers(unrolled[1], 2), scanned[1])


@pytest.mark.parametrize("scan", [False, True])
def test_linen_and_nnx_give_the_same_loss(scan):
  linen_fn, (params, batch) = real_loss("tiny", "linen", scan)
  nnx_fn, (nnx_params, _) = models.build_loss("tiny", framework="nnx", scan=scan)
  converted = linen_to_nnx(params, nnx_params, scan=scan)
  np.testing.assert_allclose(linen_fn(params, batch), nnx_fn(converted, batch),
                             rtol=1e-6)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_tiny_trains(framework):
  loss_fn, (params, batch) = real_loss("tiny", framework, False, 1)
  optimizer = optax.adam(1e-2)

  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for _ in range(5):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 0.1, losses


# ---------------------------------------------------------------- remat

# Compiling dropout's random bits is slow on CPU: two layouts here; the
# grouping tests cover the others on smaller blocks.
@pytest.mark.parametrize("framework, scan, group", [
    ("linen", True, 2), ("nnx", False, 2)])
def test_remat_gradients_equal_no_remat_with_dropout(framework, scan, group):
  remat_fn, (params, batch) = real_loss("tiny", framework, scan, group,
                                        dropout=True)
  layout = dict(framework=framework, scan=scan, group=group)
  plain_fn, _ = models.build_loss("tiny", remat=False, dropout=True, **layout)
  deterministic_fn, _ = models.build_loss("tiny", **layout)
  with_remat = jax.value_and_grad(remat_fn)(params, batch)
  assert not np.isclose(with_remat[0], deterministic_fn(params, batch))
  assert_trees_close(with_remat, jax.value_and_grad(plain_fn)(params, batch))


def test_dropout_key_changes_the_masks():
  loss_fn, (params, batch) = real_loss("tiny", "nnx", False, 2, dropout=True)
  other = {**batch, "dropout_key": jax.random.key_data(jax.random.key(9))}
  assert not np.isclose(loss_fn(params, batch), loss_fn(params, other))
  np.testing.assert_allclose(loss_fn(params, batch), loss_fn(params, batch))


def test_boundary_only_keeps_one_input_per_region():
  for group, regions in ((1, 4), (2, 2), (4, 1)):
    cfg = models.get_config("tiny", num_layers=4)
    loss_fn, args = models.build_loss(cfg, group=group)
    boundaries = [r for r in jax_residuals(loss_fn, *args)
                  if r.name == "block.output"]
    assert len(boundaries) == regions - 1  # + the embedding output
