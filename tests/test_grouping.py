"""remat_chain and scan_layers: what each region saves, and gradients.

Every layout is checked against the same computation written with JAX's and
Flax's own transforms (``jax.checkpoint`` per group, ``nn.scan(nn.remat(...))``,
``nnx.scan(nnx.remat(...))``) and the equivalent JAX policy constructor,
under ``jax_remat3`` off and on.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from shared_helpers import assert_trees_close
from shared_helpers import checkpoint_name_of
from shared_helpers import jax_residuals
from shared_helpers import module_path
from shared_helpers import remat_bodies

import remat_toolkit as rt

CP = jax.checkpoint_policies
WIDTH = 8
NUM_LAYERS = 4
ARG = "argument"
COMPUTED = "computed"


pytestmark = pytest.mark.usefixtures("quick_compiles")


# ---------------------------------------------------------------- helpers

def residual_kinds(fn, *args) -> list[tuple[str, str]]:
  """Sorted ``(aval, kind)`` per residual; kind: argument, a name, computed."""
  return sorted((r.aval.str_short(),
                 ARG if r.kind == "argument" else r.name or COMPUTED)
                for r in jax_residuals(fn, *args))


def grad(fn):
  return jax.grad(fn)


def value_and_grad(fn):
  return jax.value_and_grad(fn)


def computed_bytes(fn, *args) -> int:
  return sum(r.nbytes for r in jax_residuals(fn, *args) if r.kind != "argument")


def hand_chain(layers, x, size, policy):
  """The reference: one jax.checkpoint per ``size`` layers."""
  for start in range(0, len(layers), size):
    chunk = layers[start:start + size]

    def region(x, chunk=chunk):
      for layer in chunk:
        x = layer(x)
      return x

    x = jax.checkpoint(region, policy=policy)(x)
  return x


def plain_layer(i: int):
  def layer(x):
    return x + jnp.sin(rt.tag(jnp.cos(x) * (i + 1.0), "ffn.up"))
  return layer


def ffn(x: jax.Array, width: int, deterministic: bool) -> jax.Array:
  """Body of the linen test block (call from a compact method)."""
  h = rt.tag(nn.Dense(width, name="fc")(x), "ffn.up")
  h = nn.Dropout(0.5)(h, deterministic=deterministic)
  return x + jnp.tanh(h)


class Layer(nn.Module):
  width: int = WIDTH

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    return ffn(x, self.width, deterministic)


class LayerForScan(nn.Module):
  """The hand-written scan body: Layer returning ``(carry, None)``."""

  width: int = WIDTH

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    return ffn(x, self.width, deterministic), None


class Chain(nn.Module):
  num_layers: int = NUM_LAYERS
  group: Any = 1
  remat: bool = True
  policy: Any = "boundary-only"

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    layers = [Layer(name=f"layers_{i}") for i in range(self.num_layers)]
    if not self.remat:
      for layer in layers:
        x = layer(x, deterministic)
      return x
    return rt.remat_chain(layers, x, group=self.group, policy=self.policy,
                          deterministic=deterministic)


class NNXLayer(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.fc = nnx.Linear(width, width, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, deterministic: bool = True):
    h = self.dropout(rt.tag(self.fc(x), "ffn.up"), deterministic=deterministic)
    return x + jnp.tanh(h)


def x_input():
  return jnp.linspace(-1.0, 1.0, 2 * WIDTH).reshape(2, WIDTH)


@functools.cache
def chain_params():
  return Chain().init(jax.random.key(0), x_input())["params"]


# ---------------------------------------------------------------- plain chain

@pytest.mark.parametrize("group, size, regions", [
    (1, 1, 6), (2, 2, 3), (4, 4, 2), ("sqrt", 2, 3)])
def test_plain_chain_saves_one_boundary_per_region(remat_mode, group, size,
                                                    regions):
  layers = [plain_layer(i) for i in range(6)]
  x = x_input()

  def chained(x):
    return rt.remat_chain(layers, x, group=group, policy="boundary-only").sum()

  def reference(x):
    return hand_chain(layers, x, size, CP.nothing_saveable).sum()

  def no_remat(x):
    for layer in layers:
      x = layer(x)
    return x.sum()

  kinds = residual_kinds(chained, x)
  assert kinds == residual_kinds(reference, x)
  assert [k for _, k in kinds].count(ARG) == 1
  assert [k for _, k in kinds].count(COMPUTED) == regions - 1
  np.testing.assert_allclose(grad(chained)(x), grad(no_remat)(x),
                             rtol=1e-6)


def test_plain_chain_policy_applies_in_every_region(remat_mode):
  layers = [plain_layer(i) for i in range(4)]
  x = x_input()

  def chained(x):
    return rt.remat_chain(layers, x, group=2, policy="save-ffn").sum()

  def reference(x):
    return hand_chain(layers, x, 2, CP.save_only_these_names("ffn.up")).sum()

  kinds = residual_kinds(chained, x)
  assert kinds == residual_kinds(reference, x)
  assert [k for _, k in kinds].count("ffn.up") == 4


def test_chain_reads_the_ambient_policy_at_trace_time():
  layers = [plain_layer(i) for i in range(4)]
  x = x_input()
  chained = lambda x: rt.remat_chain(layers, x, group=2).sum()  # noqa: E731
  assert "ffn.up" not in [k for _, k in residual_kinds(chained, x)]
  with rt.use_policy("save-ffn"):
    assert [k for _, k in residual_kinds(chained, x)].count("ffn.up") == 4


# ---------------------------------------------------------------- linen chain

def linen_reference(params, x, size, policy):
  """Each layer applied as a pure function, one jax.checkpoint per group."""
  layers = [
      (lambda x, p=params[f"layers_{i}"]: Layer().apply({"params": p}, x))
      for i in range(len(params))]
  return hand_chain(layers, x, size, policy)


@pytest.mark.parametrize("group, regions", [(1, 4), (2, 2), ("sqrt", 2), (4, 1)])
def test_linen_chain_boundaries_and_gradients(remat_mode, group, regions):
  x = x_input()
  params = chain_params()
  size = NUM_LAYERS // regions

  def loss(model):
    return lambda p, x: model.apply({"params": p}, x).sum()

  chained = loss(Chain(group=group))
  kinds = residual_kinds(chained, params, x)
  reference = lambda p, x: linen_reference(  # noqa: E731
      p, x, size, CP.nothing_saveable).sum()
  assert kinds == residual_kinds(reference, params, x)
  assert [k for _, k in kinds].count(COMPUTED) == regions - 1
  assert_trees_close(grad(chained)(params, x),
                     grad(loss(Chain(remat=False)))(params, x))


def test_linen_chain_names_regions_in_module_paths():
  x = x_input()
  params = chain_params()
  jaxpr = jax.make_jaxpr(lambda p: Chain(group=2).apply({"params": p}, x))(
      params).jaxpr
  bodies = remat_bodies(jaxpr)
  assert len(bodies) == 2
  paths = sorted({module_path(e) for e in bodies[1].eqns
                  if checkpoint_name_of(e) == "ffn.up"})
  assert paths == ["Chain.remat_group_1/layers_2", "Chain.remat_group_1/layers_3"]


def test_linen_chain_with_dropout_matches_no_remat(remat_mode):
  x = x_input()
  params = chain_params()
  rngs = {"dropout": jax.random.key(7)}

  def loss(model):
    return lambda p: model.apply({"params": p}, x, False, rngs=rngs).sum()

  with_remat = value_and_grad(loss(Chain(group=2)))(params)
  without = value_and_grad(loss(Chain(remat=False)))(params)
  deterministic = Chain(remat=False).apply({"params": params}, x).sum()
  assert not np.isclose(with_remat[0], deterministic)  # dropout is active
  assert_trees_close(with_remat, without)


# ---------------------------------------------------------------- NNX chain

def nnx_layers(n: int = NUM_LAYERS):
  return nnx.List([NNXLayer(WIDTH, rngs=nnx.Rngs(i)) for i in range(n)])


@pytest.mark.parametrize("group, regions", [(1, 4), (2, 2), ("sqrt", 2)])
def test_nnx_chain_boundaries_and_gradients(remat_mode, group, regions):
  graphdef, state, rest = nnx.split(nnx_layers(), nnx.Param, ...)
  x = x_input()
  size = NUM_LAYERS // regions

  def chained(state, x):
    layers = nnx.merge(graphdef, state, rest, copy=True)
    return rt.remat_chain(list(layers), x, group=group,
                          policy="boundary-only").sum()

  def reference(state, x):
    layers = list(nnx.merge(graphdef, state, rest, copy=True))

    @nnx.remat(policy=CP.nothing_saveable)
    def region(chunk, x):
      for layer in chunk:
        x = layer(x)
      return x

    for start in range(0, NUM_LAYERS, size):
      x = region(tuple(layers[start:start + size]), x)
    return x.sum()

  def no_remat(state, x):
    for layer in nnx.merge(graphdef, state, rest, copy=True):
      x = layer(x)
    return x.sum()

  kinds = residual_kinds(chained, state, x)
  assert kinds == residual_kinds(reference, state, x)
  assert [k for _, k in kinds].count(COMPUTED) == regions - 1
  assert_trees_close(grad(chained)(state, x), grad(no_remat)(state, x))


def test_nnx_chain_with_dropout_matches_no_remat():
  graphdef, params, rest = nnx.split(nnx_layers(), nnx.Param, ...)
  x = x_input()

  def loss(remat):
    def fn(params):
      layers = list(nnx.merge(graphdef, params, rest, copy=True))
      if remat:
        return rt.remat_chain(layers, x, group=2, deterministic=False).sum()
      y = x
      for layer in layers:
        y = layer(y, deterministic=False)
      return y.sum()
    return fn

  with_remat = value_and_grad(loss(True))(params)
  y = x
  for layer in nnx.merge(graphdef, params, rest, copy=True):
    y = layer(y)
  assert not np.isclose(with_remat[0], y.sum())  # dropout is active
  assert_trees_close(with_remat, value_and_grad(loss(False))(params))


# ---------------------------------------------------------------- bad input

def test_chain_rejects_bad_layers():
  x = x_input()
  with pytest.raises(ValueError, match="no layers"):
    rt.remat_chain([], x)
  with pytest.raises(TypeError, match="layer 1 is not callable"):
    rt.remat_chain([jnp.sin, 3], x)
  with pytest.raises(ValueError, match="group"):
    rt.remat_chain([jnp.sin, jnp.cos], x, group=0)
  with pytest.raises(ValueError, match="larger than the 2 layers"):
    rt.remat_chain([jnp.sin, jnp.cos], x, group=3)
  with pytest.raises(ValueError, match="'save-everythin'.*Did you mean"):
    rt.remat_chain([jnp.sin, jnp.cos], x, policy="save-everythin")


def test_chain_rejects_mixed_and_unbound_modules():
  x = x_input()
  with pytest.raises(TypeError, match="both linen and NNX"):
    rt.remat_chain([Layer(), NNXLayer(WIDTH, rngs=nnx.Rngs(0))], x)
  with pytest.raises(ValueError, match="unbound linen module Layer"):
    rt.remat_chain([Layer(), Layer()], x)


# ---------------------------------------------------------------- linen scan

class Scanned(nn.Module):
  """``scan_layers`` inside a model, under the name ``layers``."""

  group: Any = 1
  policy: Any = "boundary-only"
  remat: bool = True

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    stack = rt.scan_layers(Layer, NUM_LAYERS, policy=self.policy,
                           group=self.group, remat=self.remat)
    return stack(width=WIDTH, name="layers")(x, deterministic)


def _scan(target, length):
  return nn.scan(target, variable_axes={"params": 0},
                 split_rngs={"params": True, "dropout": True},
                 in_axes=nn.broadcast, length=length)


class HandScanned(nn.Module):
  """The reference: nn.scan(nn.remat(...)) written by hand."""

  group: int = 1
  policy: Any = None

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    body = LayerForScan
    if self.group > 1:
      body = _scan(body, self.group)
    body = nn.remat(body, policy=self.policy, prevent_cse=False,
                    static_argnums=(2,))
    stack = _scan(body, NUM_LAYERS // self.group)
    return stack(width=WIDTH, name="layers")(x, deterministic)[0]


@functools.cache
def scanned_params(group: Any, abstract: bool = False):
  def init():
    return Scanned(group=group).init(jax.random.key(0), x_input())["params"]
  return jax.eval_shape(init) if abstract else init()


def unstack(params, group: int):
  """Stacked scan params -> ``{'layers_i': ...}`` of the unrolled Chain."""
  flat = jax.tree_util.tree_map(
      lambda a: a.reshape((NUM_LAYERS,) + a.shape[1 + (group > 1):]),
      params["layers"])
  return {f"layers_{i}": jax.tree_util.tree_map(lambda a, i=i: a[i], flat)
          for i in range(NUM_LAYERS)}


@pytest.mark.parametrize("group", [1, 2])
def test_scan_layers_stacks_params(group):
  params = scanned_params(group)
  lead = (NUM_LAYERS,) if group == 1 else (NUM_LAYERS // group, group)
  assert params["layers"]["fc"]["kernel"].shape == lead + (WIDTH, WIDTH)
  # Every layer has its own parameters (the params rng is split).
  kernels = params["layers"]["fc"]["kernel"].reshape(NUM_LAYERS, -1)
  assert len({float(k[0]) for k in kernels}) == NUM_LAYERS


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("policy, jax_policy", [
    ("boundary-only", CP.nothing_saveable),
    ("save-ffn", CP.save_only_these_names("ffn.up"))])
def test_scan_layers_saves_what_hand_written_scan_saves(
    remat_mode, group, policy, jax_policy):
  x = x_input()
  params = scanned_params(group, abstract=True)

  def loss(model):
    return lambda p, x: model.apply({"params": p}, x).sum()

  ours = loss(Scanned(group=group, policy=policy))
  reference = loss(HandScanned(group=group, policy=jax_policy))
  assert residual_kinds(ours, params, x) == residual_kinds(reference, params, x)


def test_scan_layers_reads_the_ambient_policy():
  x = x_input()
  params = scanned_params(1, abstract=True)
  ours = lambda p, x: Scanned(policy=None).apply({"params": p}, x).sum()  # noqa: E731
  reference = lambda p, x: HandScanned(  # noqa: E731
      policy=CP.save_only_these_names("ffn.up")).apply({"params": p}, x).sum()
  boundary = residual_kinds(ours, params, x)
  with rt.use_policy("save-ffn"):
    kept = residual_kinds(ours, params, x)
  assert kept == residual_kinds(reference, params, x)
  assert kept != boundary


@pytest.mark.parametrize("group, size", [(1, 1), (2, 2), ("sqrt", 2)])
def test_scan_layers_gradients_equal_unrolled(group, size):
  x = x_input()
  params = scanned_params(group)
  scanned = grad(lambda p: Scanned(group=group).apply({"params": p}, x).sum())
  unrolled = grad(lambda p: Chain(remat=False).apply({"params": p}, x).sum())
  assert_trees_close(unstack(scanned(params), size),
                     unrolled(unstack(params, size)))


def test_nested_scan_saves_fewer_boundary_bytes(remat_mode):
  x = x_input()
  params1 = scanned_params(1, abstract=True)
  params2 = scanned_params(2, abstract=True)

  def loss(group):
    return lambda p, x: Scanned(group=group).apply({"params": p}, x).sum()

  per_block = computed_bytes(loss(1), params1, x)
  nested = computed_bytes(loss(2), params2, x)
  assert nested < per_block
  # One carry per outer step instead of one per block.
  assert per_block - nested == (NUM_LAYERS - NUM_LAYERS // 2) * x.nbytes


def test_scan_layers_with_dropout_matches_no_remat(remat_mode):
  x = x_input()
  params = scanned_params(2)
  rngs = {"dropout": jax.random.key(3)}

  def loss(remat):
    return lambda p: Scanned(group=2, remat=remat).apply(
        {"params": p}, x, False, rngs=rngs).sum()

  assert_trees_close(value_and_grad(loss(True))(params),
                     value_and_grad(loss(False))(params))


def test_scan_layers_rejects_bad_input():
  with pytest.raises(TypeError, match="not an instance"):
    rt.scan_layers(Layer(), 4)
  with pytest.raises(TypeError, match="Module class"):
    rt.scan_layers(lambda x: x, 4)
  with pytest.raises(ValueError, match="length"):
    rt.scan_layers(Layer, 0)
  with pytest.raises(ValueError, match="does not divide"):
    rt.scan_layers(Layer, 4, group=3)
  with pytest.raises(ValueError):
    rt.scan_layers(Layer, 4, policy="no-such-policy")


# ---------------------------------------------------------------- NNX scan

def nnx_stack(group: Any = 1, remat: bool = True, policy="boundary-only"):
  return rt.scan_layers(NNXLayer, NUM_LAYERS, group=group, remat=remat,
                            policy=policy)(WIDTH, rngs=nnx.Rngs(0))


def nnx_unrolled(blocks_state, group: int, x):
  """Applies the stacked blocks one by one (the unrolled model)."""
  flat = jax.tree_util.tree_map(
      lambda a: a.reshape((NUM_LAYERS,) + a.shape[1 + (group > 1):]),
      blocks_state)
  layer_def = nnx.graphdef(NNXLayer(WIDTH, rngs=nnx.Rngs(0)))
  for i in range(NUM_LAYERS):
    layer = nnx.merge(layer_def, jax.tree_util.tree_map(lambda a, i=i: a[i], flat))
    x = layer(x)
  return x


@pytest.mark.parametrize("group", [1, 2])
def test_nnx_scan_layers_stacks_state(group):
  stack = nnx_stack(group)
  lead = (NUM_LAYERS,) if group == 1 else (NUM_LAYERS // group, group)
  assert stack.blocks.fc.kernel.shape == lead + (WIDTH, WIDTH)
  kernels = stack.blocks.fc.kernel[...].reshape(NUM_LAYERS, -1)
  assert len({float(k[0]) for k in kernels}) == NUM_LAYERS


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("policy, jax_policy", [
    ("boundary-only", CP.nothing_saveable),
    ("save-ffn", CP.save_only_these_names("ffn.up"))])
def test_nnx_scan_layers_saves_what_hand_written_scan_saves(
    remat_mode, group, policy, jax_policy):
  x = x_input()
  graphdef, state, rest = nnx.split(nnx_stack(group, policy=policy), nnx.Param,
                                    ...)

  def ours(state, x):
    return nnx.merge(graphdef, state, rest, copy=True)(x).sum()

  def reference(state, x):
    blocks = nnx.merge(graphdef, state, rest, copy=True).blocks

    def one(x, block):
      return block(x)

    body = one
    if group > 1:
      def body(x, blocks):
        return nnx.scan(one, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
            x, blocks)
    body = nnx.remat(body, policy=jax_policy, prevent_cse=False)
    return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(
        x, blocks).sum()

  assert residual_kinds(ours, state, x) == residual_kinds(reference, state, x)


@pytest.mark.parametrize("group", [1, 2])
def test_nnx_scan_layers_gradients_equal_unrolled(group):
  x = x_input()
  graphdef, state, rest = nnx.split(nnx_stack(group), nnx.Param, ...)

  def scanned(state, x):
    return nnx.merge(graphdef, state, rest, copy=True)(x).sum()

  def unrolled(state, x):
    blocks_state = nnx.state(nnx.merge(graphdef, state, rest, copy=True).blocks)
    return nnx_unrolled(blocks_state, group, x).sum()

  assert_trees_close(grad(scanned)(state, x), grad(unrolled)(state, x))


def test_nnx_nested_scan_saves_fewer_boundary_bytes():
  x = x_input()

  def bytes_for(group):
    graphdef, state, rest = nnx.split(nnx_stack(group), nnx.Param, ...)
    return computed_bytes(
        lambda s, x: nnx.merge(graphdef, s, rest, copy=True)(x).sum(), state, x)

  assert bytes_for(1) - bytes_for(2) == (NUM_LAYERS // 2) * x.nbytes


def test_nnx_scan_layers_with_dropout_matches_no_remat():
  x = x_input()

  def run(remat, deterministic=False):
    graphdef, params, rest = nnx.split(nnx_stack(2, remat=remat), nnx.Param,
                                       ...)

    def loss(p):
      return nnx.merge(graphdef, p, rest, copy=True)(x, deterministic).sum()

    return value_and_grad(loss)(params)

  with_remat = run(True)
  assert not np.isclose(with_remat[0], run(True, deterministic=True)[0])
  assert_trees_close(with_remat, run(False))


def test_nnx_scan_layers_rejects_bad_input():
  with pytest.raises(TypeError, match="linen or NNX Module class"):
    rt.scan_layers(NNXLayer(2, rngs=nnx.Rngs(0)), 4)  # an instance
  with pytest.raises(ValueError, match="does not divide"):
    rt.scan_layers(NNXLayer, 4, group=3)
  with pytest.raises(ValueError):
    rt.scan_layers(NNXLayer, 4, policy="no-such-policy")


# ------------------------------------------------ mutable collections

# A grouped scan's mutable collections leave the remat region as stacked scan
# outputs (ys) that get a zero cotangent; jax 0.10.2's remat3 fails on those,
# for a hand-written nn.scan(nn.remat(nn.scan(...))) as well. Minimal case:
# jax.grad(lambda w: jax.checkpoint(lambda w: jax.lax.scan(
#     lambda c, w: (c * w, c * w), 1.0, w))(w)[0])(jnp.ones(2)) under jax_remat3.
from shared_helpers import JAX_RELEASE  # noqa: E402

REMAT3_SCAN_YS_BUG = pytest.mark.xfail(
    strict=True, raises=ValueError,
    reason="jax_remat3 (jax 0.10.2): grad of jax.checkpoint(lax.scan) with "
           "zero-cotangent stacked ys raises 'Expected cotangent type'")


class StatsLayer(nn.Module):
  """A block whose FFN keeps a running mean in the mutable ``stats``."""

  width: int = WIDTH

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    h = rt.tag(nn.Dense(self.width, name="fc")(x), "ffn.up")
    mean = self.variable("stats", "mean", jnp.zeros, (self.width,))
    if not self.is_initializing():
      mean.value = 0.9 * mean.value + 0.1 * h.mean(axis=0)
    return x + jnp.tanh(h)


class StatsModel(nn.Module):
  scan: bool = False
  remat: bool = True

  @nn.compact
  def __call__(self, x):
    if self.scan:
      stack = rt.scan_layers(StatsLayer, NUM_LAYERS, group=2, remat=self.remat)
      return stack(name="layers")(x)
    layers = [StatsLayer(name=f"layers_{i}") for i in range(NUM_LAYERS)]
    if self.remat:
      return rt.remat_chain(layers, x, group=2)
    for layer in layers:
      x = layer(x)
    return x


@pytest.mark.parametrize("scan", [False, True])
def test_linen_mutable_collection_under_remat(request, remat_mode, scan):
  if scan and remat_mode and JAX_RELEASE == "0.10":
    request.applymarker(REMAT3_SCAN_YS_BUG)
  x = x_input()
  variables = StatsModel(scan=scan).init(jax.random.key(0), x)

  def run(remat):
    def loss(params):
      y, updates = StatsModel(scan=scan, remat=remat).apply(
          {**variables, "params": params}, x, mutable=["stats"])
      return y.sum(), updates
    return jax.value_and_grad(loss, has_aux=True)(variables["params"])

  (value, stats), grads = run(True)
  assert not np.allclose(
      jax.tree_util.tree_leaves(stats)[0], 0.0)  # the update happened
  assert_trees_close(((value, stats), grads), run(False))
  boundary = residual_kinds(
      lambda p: StatsModel(scan=scan).apply(
          {**variables, "params": p}, x, mutable=["stats"])[0].sum(),
      variables["params"])
  assert "ffn.up" not in [k for _, k in boundary]


class NNXStatsLayer(nnx.Module):
  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.fc = nnx.Linear(width, width, rngs=rngs)
    self.mean = nnx.BatchStat(jnp.zeros((width,)))

  def __call__(self, x):
    h = rt.tag(self.fc(x), "ffn.up")
    self.mean[...] = 0.9 * self.mean[...] + 0.1 * h.mean(axis=0)
    return x + jnp.tanh(h)


@pytest.mark.parametrize("scan", [False, True])
def test_nnx_mutable_collection_under_remat(request, remat_mode, scan):
  if scan and remat_mode and JAX_RELEASE == "0.10":
    request.applymarker(REMAT3_SCAN_YS_BUG)
  x = x_input()
  if scan:
    model = rt.scan_layers(NNXStatsLayer, NUM_LAYERS, group=2)(
        WIDTH, rngs=nnx.Rngs(0))
    plain = rt.scan_layers(NNXStatsLayer, NUM_LAYERS, group=2,
                               remat=False)(WIDTH, rngs=nnx.Rngs(0))
    apply, apply_plain = model, plain
  else:
    model = nnx.List([NNXStatsLayer(WIDTH, rngs=nnx.Rngs(i))
                      for i in range(NUM_LAYERS)])
    plain = model
    apply = lambda m, x: rt.remat_chain(list(m), x, group=2)  # noqa: E731

    def apply_plain(m, x):
      for layer in m:
        x = layer(x)
      return x

  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
  plain_def = nnx.graphdef(plain)

  def run(graphdef, fn):
    def loss(params):
      live = nnx.merge(graphdef, params, stats, copy=True)
      y = fn(live, x) if fn is not None else live(x)
      return y.sum(), nnx.state(live, nnx.BatchStat)
    return jax.value_and_grad(loss, has_aux=True)(params)

  ours = run(graphdef, None if scan else apply)
  reference = run(plain_def, None if scan else apply_plain)
  assert not np.allclose(jax.tree_util.tree_leaves(ours[0][1])[0], 0.0)
  assert_trees_close(ours, reference)
