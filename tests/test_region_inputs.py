"""Region inputs are named ``block.input`` where a policy offloads them.

Every region the toolkit makes (``rt.remat``, ``rt.remat_modules``) names
its floating-point inputs when its policy offloads ``block.input`` (the
built-in ``offload-boundaries``), on models that tag nothing themselves, so
region boundaries move to the host as MaxText's ``decoder_layer_input``
does. Under every other policy the region is the ``jax.checkpoint`` a user
writes by hand, and the analyzer counts what JAX keeps in both cases.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from shared_helpers import jax_residuals
from shared_helpers import remat3
from shared_helpers import remat3_offloads

import remat_toolkit as rt

cp = jax.checkpoint_policies
OFFLOAD_BOUNDARIES = cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["block.input", "decoder_layer_input"],
    offload_src="device", offload_dst="pinned_host")


def _layer(w, x):
  return jnp.tanh(jnp.sin(x) @ w) + x


def _kept(fn, *args):
  """(shape, memory, what) of what JAX keeps, sources left out."""
  return sorted((r.shape, r.memory_kind, r.what) for r in jax_residuals(fn, *args))


def _host(fn, *args):
  """What JAX keeps in host memory."""
  return [r for r in jax_residuals(fn, *args) if r.memory_kind == "host"]


W = jnp.full((4, 4), 0.1)
X = jnp.ones((2, 4))


_REGION = rt.remat(_layer)


def _loss(w, x):
  return _REGION(w, _REGION(w, x)).sum()


def _ours(policy, loss=_loss):
  """``loss`` with its regions under ``policy``, as a training step runs it."""
  def under(*args):
    with rt.use_policy(policy):
      return loss(*args)
  return under


def _by_hand(jax_policy, named):
  """The two regions written with ``jax.checkpoint``; ``named``: the second
  names its input (the first region's output) as a boundary; the weight
  and the first input are the function's arguments, held anyway."""
  def body(w, x, name_x):
    if name_x:
      x = checkpoint_name(x, "block.input")
    return _layer(w, x)
  first = jax.checkpoint(lambda w, x: body(w, x, False), policy=jax_policy)
  second = jax.checkpoint(lambda w, x: body(w, x, named), policy=jax_policy)
  return lambda w, x: second(w, first(w, x)).sum()


def test_offload_boundaries_moves_computed_region_inputs_to_the_host():
  with remat3(False):
    ours = _kept(_ours("offload-boundaries"), W, X)
    assert ours == _kept(_by_hand(OFFLOAD_BOUNDARIES, named=True), W, X)
    host = [k for k in ours if k[1] == "host"]
    # The first region's output only: the weight and x are arguments.
    assert [k[0] for k in host] == [X.shape]
    report = rt.analyze(_loss, W, X, policy="offload-boundaries")
    assert report.offloaded_bytes == X.size * X.dtype.itemsize == sum(
        r.nbytes for r in _host(_ours("offload-boundaries"), W, X))
    assert report.activation_bytes == 0


def _repeated(w, x):
  for _ in range(3):
    x = _REGION(w, x)
  return x.sum()


def _repeated_by_hand(w, x):
  for _ in range(3):
    x = jax.checkpoint(_layer)(w, x)
  return x.sum()


def test_offload_boundaries_never_moves_arguments_or_constants():
  """A plain function's region is told a parameter from an activation by
  where the value comes from: an argument of the traced function and a
  closed-over array stay on the device, as ``rt.repolicy`` leaves them."""
  w_const = jnp.full((4, 4), 0.2)

  def closed(x):
    return _repeated(w_const, x)

  with remat3(False):
    for fn, args in [(_repeated, (W, X)), (closed, (X,))]:
      host = _host(_ours("offload-boundaries", fn), *args)
      assert [r.shape for r in host] == [X.shape] * 2  # layers 2 and 3
      report = rt.analyze(fn, *args, policy="offload-boundaries")
      assert report.offloaded_bytes == 2 * X.size * X.dtype.itemsize
    by_hand = rt.analyze(rt.repolicy(_repeated_by_hand), W, X,
                         policy="offload-boundaries")
    assert by_hand.offloaded_bytes == 2 * X.size * X.dtype.itemsize
    # Inside a jit of the step, as training runs it: two copies out, two back.
    step = jax.jit(jax.grad(_ours("offload-boundaries", _repeated)))
    assert str(jax.make_jaxpr(step)(W, X)).count("device_put[") == 4


_JITTED_REGION = jax.jit(_REGION)


def _jitted_layers(w, x):
  for _ in range(3):
    x = _JITTED_REGION(w, jnp.sin(x))
  return x.sum()


def test_inputs_arriving_through_a_jit_stay_on_the_device_and_it_is_said():
  """A region inside a jitted layer sees its inputs as the jit's arguments,
  traced once for every caller: computed or given cannot be seen there. They
  stay on the device (JAX moves nothing), and the trace and the report say
  so, naming rt.repolicy; a jitted loss called outside any trace says
  nothing."""
  import warnings
  with remat3(False):
    # First (a trace-time finding is raised once): the jitted region called
    # by a differentiated, untraced loss is given the step's own arguments,
    # held anyway, and nothing is said (another shape: the jit traces anew).
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      jax.grad(_ours("offload-boundaries",
                     lambda w, x: _JITTED_REGION(w, x).sum()))(W, X[:1])
    with pytest.warns(UserWarning, match=r"inside a jax.jit the program "
                      r"calls, and 2 of its input\(s\)") as caught:
      host = _host(_ours("offload-boundaries", _jitted_layers), W, X)
    assert host == []
    assert [w.message.args[0].kind for w in caught
            if "jax.jit" in str(w.message)] == ["inputs-unseen"]
    report = rt.analyze(_jitted_layers, W, X, policy="offload-boundaries")
    assert report.offloaded_bytes == 0
    said = [w for w in report.warnings if w.kind == "inputs-unseen"]
    assert len(said) == 1 and "rt.repolicy" in said[0]
    # A policy that moves no input says nothing of them.
    assert not [w for w in rt.analyze(_jitted_layers, W, X,
                                      policy="save-matmuls").warnings
                if w.kind == "inputs-unseen"]
    # rt.repolicy reads the whole program: the three computed inputs move,
    # and nothing is unseen.
    whole = rt.analyze(rt.repolicy(_jitted_layers), W, X,
                       policy="offload-boundaries")
    assert whole.offloaded_bytes == 3 * X.size * X.dtype.itemsize
    assert not [w for w in whole.warnings if w.kind == "inputs-unseen"]


@pytest.mark.pins_mode
def test_a_region_fed_only_arguments_does_not_warn_it_matched_nothing():
  import warnings
  with remat3(False), warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.grad(_ours("offload-boundaries", lambda w, x: _REGION(w, x).sum()))(W, X)


@pytest.mark.parametrize("policy, jax_policy", [
    ("save-everything", cp.everything_saveable),
    ("boundary-only", cp.nothing_saveable),
    ("save-matmuls", cp.dots_saveable),
])
def test_other_policies_leave_region_inputs_unnamed(remat_mode, policy,
                                                    jax_policy):
  ours = _kept(_ours(policy), W, X)
  assert ours == _kept(_by_hand(jax_policy, named=False), W, X)
  assert not any("block.input" in k[2] for k in ours)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(4)(nn.gelu(nn.Dense(16)(nn.LayerNorm()(x))))


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = _Block(name=f"layer_{i}")(x)
    return x


@pytest.mark.pins_mode
def test_a_model_that_tags_nothing_offloads_its_layer_inputs():
  model = rt.remat_modules(_Model())
  params = model.init(jax.random.key(0), X)

  def loss(p, x):
    return model.apply(p, x).sum()

  with remat3(False):
    host = _host(_ours("offload-boundaries", loss), params, X)
    # One per layer but the first, whose input is the function's argument.
    assert [r.shape for r in host] == [X.shape] * 2
    report = rt.analyze(loss, params, X, policy="offload-boundaries")
    assert report.offloaded_bytes == 2 * X.size * X.dtype.itemsize
    named = [r for r in report.residuals if r.name == "block.input"]
    assert len(named) == 2 and all(r.memory_kind == "host" for r in named)
    # Analysed under another policy, the same trace has no input names.
    other = rt.analyze(loss, params, X, policy="save-everything")
    assert not any(r.name == "block.input" for r in other.residuals)


def test_offload_boundaries_refuses_under_remat3_where_jax_cannot_offload():
  if remat3_offloads():
    pytest.skip("this JAX offloads under jax_remat3")
  with remat3(True), pytest.raises(ValueError, match="remat3"):
    jax.grad(_ours("offload-boundaries"))(W, X)


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(4)(nn.gelu(nn.Dense(16)(x)))


@pytest.mark.pins_mode
def test_scanned_layers_offload_their_stacked_inputs():
  model = rt.scan_layers(_ScanBlock, 3)()
  params = model.init(jax.random.key(0), X)

  def loss(p, x):
    return model.apply(p, x).sum()

  with remat3(False):
    kept = [r for r in jax_residuals(_ours("offload-boundaries", loss), params, X)
            if r.kind != "argument"]
    assert [(r.shape, r.memory_kind) for r in kept] == [
        ((3, *X.shape), "host")]  # one input per layer, stacked by the scan
    report = rt.analyze(loss, params, X, policy="offload-boundaries")
    assert report.offloaded_bytes == 3 * X.size * X.dtype.itemsize
    assert report.activation_bytes == 0


class _SelfRematModel(nn.Module):
  """Remats its own layers, as recurrentgemma's nn.remat does."""

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.remat(_Block)(name=f"layer_{i}")(x)
    return x


@pytest.mark.pins_mode
def test_repolicy_names_the_inputs_of_a_model_that_remats_itself():
  model = _SelfRematModel()
  params = model.init(jax.random.key(0), X)

  def loss(p, x):
    return model.apply(p, x).sum()

  with remat3(False):
    offloading = rt.repolicy(loss, "offload-boundaries")
    host = _host(offloading, params, X)
    # The layers' computed inputs; not the weights nn.remat passes in, nor
    # the first layer's input x: arguments the caller holds anyway.
    assert [r.shape for r in host] == [X.shape] * 2
    report = rt.analyze(rt.repolicy(loss), params, X, policy="offload-boundaries")
    named = [r for r in report.residuals if r.name == "block.input"]
    assert [r.module_path for r in named] == ["layer_1", "layer_2"]
    assert report.offloaded_bytes == sum(r.nbytes for r in host)
    # The same regions under another policy are the model's own, unnamed.
    plain = jax_residuals(rt.repolicy(loss, "boundary-only"), params, X)
    assert not any(r.name == "block.input" for r in plain)


@pytest.mark.pins_mode
def test_the_planner_offloads_region_inputs_to_meet_a_budget():
  model = rt.remat_modules(_Model())
  params = model.init(jax.random.key(0), X)

  def loss(p, x):
    return model.apply(p, x).sum()

  with remat3(False):
    # boundary-only keeps the two computed layer inputs on the device.
    with pytest.raises(ValueError, match="allow_offload=True"):
      rt.plan(loss, params, X, budget=0)
    plan = rt.plan(loss, params, X, budget=0, allow_offload=True)
  assert plan.activation_bytes == 0
  # Every layer's computed input moves; not the first one (x, an argument).
  assert plan.offloaded_bytes == 2 * X.size * X.dtype.itemsize
  assert "block.input" in plan.policy.offload


def test_repolicy_offloads_a_scan_carry_not_the_scanned_weights():
  """MaxText's scanned decoder: a rematted body under lax.scan over stacked
  weights. The carry is computed at every step; each step's weight slice is
  the function's argument, held anyway."""
  def loss(ws, x):
    layer = jax.checkpoint(lambda c, w: (_layer(w, c), None))
    return jax.lax.scan(layer, x, ws)[0].sum()

  ws = jnp.stack([W] * 3)
  with remat3(False):
    host = _host(rt.repolicy(loss, "offload-boundaries"), ws, X)
  assert [r.shape for r in host] == [(3, *X.shape)]  # one carry per step, stacked by the scan
