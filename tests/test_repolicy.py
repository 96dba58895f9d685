"""rt.repolicy: models that remat themselves, re-policied without editing.

Each model below reproduces a production pattern (MaxText's
``jax.checkpoint(policy=...)`` around each layer, unrolled and around a
scanned body; recurrentgemma's ``nn.remat`` inside its own module; an
``nnx.remat``; a jitted inner function) and is checked against the same model
with the policy written in by hand, under both remat modes.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from shared_helpers import assert_trees_close
from shared_helpers import cheap_init
from shared_helpers import grad_of
from shared_helpers import jax_activation_bytes
from shared_helpers import residuals

import remat_toolkit as rt

cp = jax.checkpoint_policies
D = 4
X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)
WS = jnp.stack([jnp.full((D, 2 * D), 0.1 * (i + 1)) for i in range(2)])
#: The library's own policy, and two to put in its place.
OWN = cp.nothing_saveable
NAMED = cp.save_only_these_names("mlpwi")


def layer(w, x):
  h = checkpoint_name(jnp.sin(x @ w), "mlpwi")
  return x + checkpoint_name(jnp.tanh(h @ w.T), "mlpwo")


def unrolled(policy):
  region = jax.checkpoint(layer, policy=policy)

  def loss(ws, x):
    for i in range(ws.shape[0]):
      x = region(ws[i], x)
    return (x ** 2).sum()
  return loss


def scanned(policy):
  region = jax.checkpoint(layer, policy=policy, prevent_cse=False)

  def loss(ws, x):
    x, _ = jax.lax.scan(lambda c, w: (region(w, c), None), x, ws)
    return (x ** 2).sum()
  return loss


def jitted_inner(policy):
  inner = jax.jit(unrolled(policy))
  return lambda ws, x: inner(ws, x) * 2.0


def held(fn, *args):
  """:func:`residuals` less scalar literals: re-binding a traced program
  folds a Python scalar into its equation, where JAX lists the original's
  as a 4-byte residual "from a literal"."""
  return [r for r in residuals(fn, *args) if r[2] != "literal"]


MODELS = {"unrolled": unrolled, "scanned": scanned, "jitted": jitted_inner}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("policy", [NAMED, cp.everything_saveable],
                         ids=["named", "everything"])
def test_saves_what_the_policy_written_in_by_hand_saves(remat_mode, model,
                                                         policy):
  make = MODELS[model]
  got = held(rt.repolicy(make(OWN), policy), WS, X)
  assert got == held(make(policy), WS, X)
  assert_trees_close(grad_of(rt.repolicy(make(OWN), policy), WS, X),
                     grad_of(make(OWN), WS, X))


def test_ambient_policy_is_read_at_trace_time(remat_mode):
  lib = rt.repolicy(unrolled(OWN))
  with rt.use_policy(NAMED):
    got = residuals(lib, WS, X)
  assert got == residuals(unrolled(NAMED), WS, X)
  assert got != residuals(unrolled(OWN), WS, X)


def test_compiles_to_the_program_written_by_hand():
  by_hand = jax.jit(jax.grad(unrolled(NAMED))).lower(WS, X).as_text()
  re_policied = jax.jit(jax.grad(rt.repolicy(unrolled(OWN), NAMED)))
  assert re_policied.lower(WS, X).as_text() == by_hand


def test_keeps_prevent_cse(remat_mode):
  lib = rt.repolicy(scanned(OWN), NAMED)
  text = str(jax.make_jaxpr(jax.grad(lib))(WS, X))
  assert text == str(jax.make_jaxpr(jax.grad(scanned(NAMED)))(WS, X))


def test_compare_measures_each_policy_on_a_model_that_remats_itself(
    remat_mode):
  lib = rt.repolicy(unrolled(OWN))
  names = ["boundary-only", "save-everything"]
  comparison = rt.compare(lib, WS, X, policies=names)
  figures = [comparison.reports[n].activation_bytes for n in names]
  assert figures == [jax_activation_bytes(lib, (WS, X), n) for n in names]
  assert figures[0] < figures[1]
  assert not any("no region" in w for r in comparison.reports.values()
                 for w in r.warnings)


# ------------------------------------------------------------- Flax models

class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = checkpoint_name(jnp.sin(nn.Dense(2 * D, kernel_init=cheap_init,
                                         name="wi")(x)), "mlpwi")
    return x + nn.Dense(D, kernel_init=cheap_init, name="wo")(h)


class SelfRemattingModel(nn.Module):
  """Like recurrentgemma: the library wraps its own blocks in nn.remat."""
  policy: object = OWN

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = nn.remat(Block, policy=self.policy)(name=f"layers_{i}")(x)
    return (x ** 2).sum()


LINEN_PARAMS = SelfRemattingModel().init(jax.random.key(0), X)


def test_linen_nn_remat_inside_the_librarys_own_module(remat_mode):
  def loss_of(policy):
    return lambda p, x: SelfRemattingModel(policy).apply(p, x)
  got = residuals(rt.repolicy(loss_of(OWN), NAMED), LINEN_PARAMS, X)
  assert got == residuals(loss_of(NAMED), LINEN_PARAMS, X)
  assert got != residuals(loss_of(OWN), LINEN_PARAMS, X)
  assert_trees_close(grad_of(rt.repolicy(loss_of(OWN), NAMED), LINEN_PARAMS, X),
                     grad_of(loss_of(OWN), LINEN_PARAMS, X))


def test_regions_selects_by_module_path(remat_mode):
  def loss_of(policy):
    return lambda p, x: SelfRemattingModel(policy).apply(p, x)
  only_first = rt.repolicy(loss_of(OWN), NAMED, regions="layers_0")
  every = rt.repolicy(loss_of(OWN), NAMED, regions=["layers_*"])
  none = residuals(loss_of(OWN), LINEN_PARAMS, X)
  one = residuals(only_first, LINEN_PARAMS, X)
  both = residuals(every, LINEN_PARAMS, X)
  assert both == residuals(loss_of(NAMED), LINEN_PARAMS, X)
  assert len(none) < len(one) < len(both)


def test_a_glob_matching_no_region_warns(remat_mode):
  lib = rt.repolicy(unrolled(OWN), NAMED, regions="decoder/*")
  with pytest.warns(UserWarning, match="match no remat region") as caught:
    got = residuals(lib, WS, X)
  assert got == residuals(unrolled(OWN), WS, X)
  # The warning lists the keys that exist, so the fix is one copy away.
  message = " ".join(str(w.message) for w in caught)
  assert "its regions: none" not in message
  assert "'#0', '#1'" in message  # two regions, by position


def test_a_function_without_regions_warns():
  with pytest.warns(UserWarning, match="found no remat region"):
    rt.repolicy(lambda x: jnp.sin(x).sum(), NAMED)(X)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.wi = nnx.Linear(D, 2 * D, kernel_init=cheap_init, rngs=rngs)
    self.wo = nnx.Linear(2 * D, D, kernel_init=cheap_init, rngs=rngs)

  def __call__(self, x):
    return x + self.wo(checkpoint_name(jnp.sin(self.wi(x)), "mlpwi"))


def nnx_loss(policy):
  blocks = [NNXBlock(nnx.Rngs(i)) for i in range(2)]
  graphdef, state = nnx.split(blocks)

  def loss(state, x):
    for block in nnx.merge(graphdef, state):
      x = nnx.remat(lambda b, y: b(y), policy=policy)(block, x)
    return (x ** 2).sum()
  return loss, state


def test_nnx_remat(remat_mode):
  lib, state = nnx_loss(OWN)
  by_hand, _ = nnx_loss(NAMED)
  got = residuals(rt.repolicy(lib, NAMED), state, X)
  assert got == residuals(by_hand, state, X)
  assert got != residuals(lib, state, X)
  np.testing.assert_allclose(rt.repolicy(lib, NAMED)(state, X), lib(state, X),
                             rtol=1e-6)


def test_no_warning_when_every_region_is_re_policied():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    rt.repolicy(unrolled(OWN), NAMED)(WS, X)


def test_a_per_region_policy_takes_each_region_by_its_module_path(remat_mode):
  mixed = rt.Policy(name="mixed", regions={"layers_0": "save-everything",
                                           "layers_1": "boundary-only"})
  lib = lambda p, x: SelfRemattingModel().apply(p, x)  # noqa: E731
  by_hand = rt.repolicy(lib, "save-everything", regions="layers_0")
  assert (residuals(rt.repolicy(lib, mixed), LINEN_PARAMS, X)
          == residuals(rt.repolicy(by_hand, "boundary-only", regions="layers_1"),
                       LINEN_PARAMS, X))
  assert (residuals(rt.repolicy(lib, mixed), LINEN_PARAMS, X)
          != residuals(rt.repolicy(lib, "boundary-only"), LINEN_PARAMS, X))


# ------------------------------------- remat_modules inside the model's own

class OuterRematted(nn.Module):
  """A model whose whole stack sits in its own region (outer policy wins)."""

  @nn.compact
  def __call__(self, x):
    def stack(mdl, y):
      for i in range(2):
        y = Block(name=f"layers_{i}")(y)
      return y
    return (nn.remat(stack, policy=OWN)(self, x) ** 2).sum()


def test_remat_modules_inside_the_models_own_region_says_what_happens(
    remat_mode):
  model = rt.remat_modules(OuterRematted(), {"Block": None})
  params = model.init(jax.random.key(0), X)
  loss = model.apply
  with pytest.warns(UserWarning, match="sits inside a remat region the model"):
    comparison = rt.compare(loss, params, X,
                            policies=["boundary-only", "save-everything"])
  text = " ".join(w for r in comparison.reports.values() for w in r.warnings)
  assert "every one of the 2 remat regions" in text
  assert "rt.repolicy" in text or "remat_toolkit.repolicy" in text
  assert "mix policies" not in text
  # What it says is what JAX saves: the outer policy decides, both equal.
  bytes_ = {n: r.activation_bytes for n, r in comparison.reports.items()}
  assert bytes_["boundary-only"] == bytes_["save-everything"]
  # ... and repolicy is the remedy: figures differ once the outer is replaced.
  fixed = rt.repolicy(loss, regions="*")
  names = ["boundary-only", "save-everything"]
  figures = [r.activation_bytes for r in rt.compare(
      fixed, params, X, policies=names).reports.values()]
  assert figures == [jax_activation_bytes(fixed, (params, X), n) for n in names]
  if not remat_mode:  # remat3 keeps nested regions' unnamed values apart
    assert figures[0] < figures[1]


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Block(name="block")(x)


class RematScanModel(nn.Module):
  """Like Flax's own examples: nn.remat_scan over a stack of blocks."""
  policy: object = OWN

  @nn.compact
  def __call__(self, x):
    stack = nn.remat_scan(ScanBlock, lengths=(2, 2), policy=self.policy,
                          variable_axes={"params": 0},
                          split_rngs={"params": True})
    return (stack(name="layers")(x) ** 2).sum()


def test_nn_remat_scan(remat_mode):
  params = RematScanModel().init(jax.random.key(0), X)

  def loss_of(policy):
    return lambda p, x: RematScanModel(policy).apply(p, x)
  got = residuals(rt.repolicy(loss_of(OWN), NAMED), params, X)
  assert got == residuals(loss_of(NAMED), params, X)
  assert got != residuals(loss_of(OWN), params, X)


def test_positions_count_afresh_in_each_call(remat_mode):
  """A region without a module path is '#k', the k-th of its program, on
  every call: a plan keyed by position applies to each trace, not only the
  first of the process."""
  first = rt.repolicy(unrolled(OWN), NAMED, regions="#1")
  want = residuals(first, WS, X)
  assert want != residuals(unrolled(OWN), WS, X)  # '#1' was re-policied
  for _ in range(2):
    assert residuals(rt.repolicy(unrolled(OWN), NAMED, regions="#1"),
                     WS, X) == want


class NNXDecoder(nnx.Module):
  """MaxText's NNX decoder: its layers, each a ``jax.checkpoint`` of the
  layer's state and input, unrolled."""

  def __init__(self, policy, rngs):
    self.policy = policy
    self.layers = nnx.List([NNXBlock(rngs) for _ in range(2)])

  def __call__(self, x):
    for block in self.layers:
      graphdef, state = nnx.split(block)
      run = lambda s, y, g=graphdef: nnx.merge(g, s)(y)  # noqa: E731
      x = jax.checkpoint(run, policy=self.policy)(state, x)
    return x


def nnx_decoder_loss(policy):
  graphdef, state = nnx.split(NNXDecoder(policy, nnx.Rngs(0)))
  return (lambda s, x: (nnx.merge(graphdef, s)(x) ** 2).sum()), state


def nnx_scanned_loss(policy):
  """MaxText's scanned layers: one rematted body over the stacked state."""
  blocks = [NNXBlock(nnx.Rngs(i)) for i in range(2)]
  graphdef = nnx.split(blocks[0])[0]
  stacked = jax.tree.map(lambda *a: jnp.stack(a),
                         *[nnx.split(b)[1] for b in blocks])
  region = jax.checkpoint(lambda s, y: nnx.merge(graphdef, s)(y), policy=policy)

  def loss(params, x):
    x, _ = jax.lax.scan(lambda c, s: (region(s, c), None), x,
                        params["decoder"]["layers"])
    return (x ** 2).sum()
  return loss, {"decoder": {"layers": stacked}}


def _keys_warned(fn, *args):
  with pytest.warns(UserWarning, match="match no remat region") as caught:
    residuals(rt.repolicy(fn, NAMED, regions="no_such_layer"), *args)
  return " ".join(str(w.message) for w in caught)


def test_nnx_regions_are_keyed_by_the_module_path_of_their_weights(remat_mode):
  """An NNX program carries no scopes: a region is keyed by the path its
  weights share in the function's arguments (``layers/1``), so a pattern
  selects a layer of MaxText's NNX decoder by name, unrolled or scanned."""
  lib, state = nnx_decoder_loss(OWN)
  by_hand, _ = nnx_decoder_loss(NAMED)
  assert "'layers/0', 'layers/1'" in _keys_warned(lib, state, X)
  every = residuals(rt.repolicy(lib, NAMED, regions="layers/*"), state, X)
  assert every == residuals(by_hand, state, X)
  one = residuals(rt.repolicy(lib, NAMED, regions="layers/1"), state, X)
  assert len(residuals(lib, state, X)) < len(one) < len(every)
  scan_lib, params = nnx_scanned_loss(OWN)
  assert "'decoder/layers'" in _keys_warned(scan_lib, params, X)
  got = residuals(rt.repolicy(scan_lib, NAMED, regions="decoder/layers"),
                  params, X)
  assert got == residuals(nnx_scanned_loss(NAMED)[0], params, X)


def test_a_function_of_bare_arrays_keys_its_regions_by_position():
  assert "'#0', '#1'" in _keys_warned(unrolled(OWN), WS, X)


def test_a_module_named_value_keys_its_region():
  """Only an NNX variable's ``.value`` attribute is no module: a weights dict
  under a module called ``value`` (attention's V projection) keys its
  region ``attn/value``."""
  def loss(params, x):
    region = jax.checkpoint(lambda p, x: jnp.sin(x @ p["kernel"]))
    return region(params["attn"]["value"], x).sum()

  params = {"attn": {"value": {"kernel": jnp.ones((4, 4))}}}
  assert "'attn/value'" in _keys_warned(loss, params, jnp.ones((2, 4)))

