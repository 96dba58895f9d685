"""rt.remat: what each way in saves, compared with JAX's and Flax's own remat.

Every case checks two things: gradients equal the no-remat gradients, and the
saved residuals equal those of the same model wrapped in plain ``nn.remat`` /
``nnx.remat`` / ``jax.checkpoint`` with the JAX constructor written by hand.
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
D = 8

# Tags of the test block; recompute-attention-core keeps all but scores/probs.
ALL_TAGS = ("attn.norm", "attn.q", "attn.k", "attn.v", "attn.scores",
            "attn.probs", "attn.context", "attn.out", "ffn.norm", "ffn.up",
            "ffn.act", "ffn.down")

# Each built-in policy and the JAX constructor a user would write by hand.
HAND_WRITTEN = {
    "boundary-only": cp.nothing_saveable,
    "save-attention": cp.save_only_these_names(
        "attn.q", "attn.k", "attn.v", "attn.context", "attn.out"),
    "save-ffn": cp.save_only_these_names("ffn.up", "ffn.down"),
    "save-matmuls": cp.dots_saveable,
    "save-everything": cp.everything_saveable,
    "recompute-attention-core": cp.save_only_these_names(
        *(t for t in ALL_TAGS if t not in ("attn.scores", "attn.probs"))),
}
POLICIES = sorted(HAND_WRITTEN)


# ---------------------------------------------------------------- helpers

import shared_helpers  # noqa: E402
from shared_helpers import cheap_init  # noqa: E402
from shared_helpers import count_remat_regions  # noqa: E402
from shared_helpers import grad_of  # noqa: E402
from shared_helpers import module_path  # noqa: E402
from shared_helpers import named  # noqa: E402
from shared_helpers import remat_bodies  # noqa: E402
from shared_helpers import residuals  # noqa: E402

assert_trees_close = functools.partial(shared_helpers.assert_trees_close,
                                       atol=1e-5)


def check_policies(make_ours, make_ref, plain_loss, *args):
  """For every policy: gradients equal no remat, and the residuals equal the
  hand-written reference's.

  Returns the residual records of ours, by policy.
  """
  plain = grad_of(plain_loss, *args)
  records = {}
  for policy in POLICIES:
    loss = make_ours(policy)
    try:
      assert_trees_close(grad_of(loss, *args), plain)
    except AssertionError as e:
      raise AssertionError(f"gradients differ under {policy}: {e}") from None
    records[policy] = residuals(loss, *args)
    reference = residuals(make_ref(HAND_WRITTEN[policy]), *args)
    assert records[policy] == reference, policy
  return records


def block_math(x, layer, dropout):
  """A pre-norm transformer block, one head, every tensor tagged."""
  h = rt.tag(layer("ln1", x), "attn.norm")
  q = rt.tag(layer("q", h), "attn.q")
  k = rt.tag(layer("k", h), "attn.k")
  v = rt.tag(layer("v", h), "attn.v")
  s = rt.tag(q @ k.swapaxes(-1, -2) / np.sqrt(D), "attn.scores")
  p = rt.tag(dropout(jax.nn.softmax(s)), "attn.probs")
  c = rt.tag(p @ v, "attn.context")
  x = x + rt.tag(layer("o", c), "attn.out")
  h = rt.tag(layer("ln2", x), "ffn.norm")
  u = rt.tag(layer("up", h), "ffn.up")
  a = rt.tag(jax.nn.gelu(u), "ffn.act")
  return x + rt.tag(layer("down", a), "ffn.down")


SIZES = {"q": D, "k": D, "v": D, "o": D, "up": 2 * D, "down": D}
X = jax.random.normal(jax.random.key(1), (2, 4, D))
# The rbg generator: the same masks in forward and recompute as any other,
# and far fewer operations to compile than threefry.
DROPOUT_KEY = jax.random.key(7, impl="rbg")




# ---------------------------------------------------------------- linen

class LinenBlock(nn.Module):
  rate: float = 0.5

  @nn.compact
  def __call__(self, x, train):
    def layer(name, h):
      if name.startswith("ln"):
        return nn.LayerNorm(name=name)(h)
      return nn.Dense(SIZES[name], kernel_init=cheap_init, name=name)(h)
    drop = nn.Dropout(self.rate, deterministic=not train)
    return block_math(x, layer, drop)


class LinenStack(nn.Module):
  block: type = LinenBlock
  depth: int = 1

  @nn.compact
  def __call__(self, x, train):
    for i in range(self.depth):
      x = self.block(name=f"block_{i}")(x, train)
    return x


def numpy_variables(shapes):
  """Concrete values for abstract variables, made by NumPy, not JAX."""
  rng = np.random.RandomState(0)

  def fill(path, leaf):
    if jax.tree_util.keystr(path[-1:]) == "['scale']":
      return jnp.ones(leaf.shape, leaf.dtype)
    values = rng.normal(size=leaf.shape) / np.sqrt(leaf.shape[0])
    return jnp.asarray(values, leaf.dtype)
  return jax.tree_util.tree_map_with_path(fill, shapes)


LINEN_VARIABLES = numpy_variables(jax.eval_shape(
    lambda: LinenStack().init(jax.random.key(0), X, False)))


def linen_losses(model, train=False):
  """The loss of ``model`` (dropout on if ``train``) and its variables."""
  variables = LINEN_VARIABLES

  def loss(params):
    y = model.apply(params, X, train, rngs={"dropout": DROPOUT_KEY})
    return jnp.sin(y).sum()
  return loss, variables


def test_linen_class(remat_mode):
  plain, variables = linen_losses(LinenStack())
  check_policies(
      lambda policy: linen_losses(LinenStack(rt.remat(LinenBlock, policy)))[0],
      # nn.remat counts self: `train` is static_argnums=(2,) there.
      lambda jax_policy: linen_losses(LinenStack(nn.remat(
          LinenBlock, policy=jax_policy, static_argnums=(2,))))[0],
      plain, variables)


def test_linen_class_keeps_nn_remat_variable_names():
  class Auto(nn.Module):  # submodules auto-named after their class
    block: type

    @nn.compact
    def __call__(self, x):
      return self.block()(x, False)

  def names(block):
    shapes = jax.eval_shape(lambda: Auto(block).init(jax.random.key(0), X))
    return jax.tree_util.tree_structure(shapes)
  assert names(rt.remat(LinenBlock)) == names(nn.remat(LinenBlock,
                                                       static_argnums=(2,)))


def linen_method_block(decorator):
  class Block(LinenBlock):
    @decorator
    @nn.compact
    def __call__(self, x, train):
      return LinenBlock.__call__.__wrapped__(self, x, train)
  return Block


def test_linen_method_decorator(remat_mode):
  plain, variables = linen_losses(LinenStack())
  records = check_policies(
      lambda policy: linen_losses(LinenStack(linen_method_block(
          rt.remat(policy=policy))))[0],
      lambda jax_policy: linen_losses(LinenStack(linen_method_block(
          functools.partial(nn.remat, policy=jax_policy,
                            static_argnums=(2,)))))[0],
      plain, variables)
  # Each policy keeps what it names (what the backward pass needs of it).
  assert {"attn.q", "attn.k", "attn.v"} <= named(records["save-attention"])
  assert named(records["save-attention"]) <= set(ALL_TAGS[:8])
  assert named(records["save-ffn"]) == {"ffn.up"}
  assert named(records["boundary-only"]) == set()


def test_bare_decorator_uses_ambient_policy(remat_mode):
  ours, variables = linen_losses(LinenStack(linen_method_block(rt.remat)))
  with rt.use_policy("save-ffn"):
    assert named(residuals(ours, variables)) == {"ffn.up"}  # down: unused
  assert named(residuals(ours, variables)) == set()  # boundary-only


def test_linen_mutable_collections(remat_mode):
  class Block(nn.Module):
    @rt.remat(policy="save-ffn")
    @nn.compact
    def __call__(self, x, train):
      h = nn.BatchNorm(use_running_average=not train)(x)
      h = rt.tag(nn.Dense(D, kernel_init=cheap_init)(h), "ffn.up")
      self.sow("intermediates", "h", h)
      return jnp.tanh(h)

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      return Block.__call__.__wrapped__.__wrapped__(self, x, train)

  variables = numpy_variables(jax.eval_shape(
      lambda: Plain().init(jax.random.key(0), X, False)))
  outs = []
  for model in (Block(), Plain()):
    def loss(params, model=model):
      y, updates = model.apply({**variables, "params": params}, X, True,
                               mutable=["batch_stats", "intermediates"])
      return y.sum(), updates
    (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(
        variables["params"])
    outs.append((value, updates, grads))
  assert_trees_close(outs[0], outs[1])
  assert len(outs[0][1]["intermediates"]["h"]) == 1  # sown once, not twice


# ---------------------------------------------------------------- NNX

class NNXBlock(nnx.Module):
  def __init__(self, rngs, rate=0.5):
    self.layers = nnx.Dict({
        name: nnx.LayerNorm(D, rngs=rngs) if name.startswith("ln")
        else nnx.Linear(D if name != "down" else 2 * D, SIZES[name],
                        kernel_init=cheap_init, rngs=rngs)
        for name in ("ln1", "q", "k", "v", "o", "ln2", "up", "down")})
    self.drop = nnx.Dropout(rate, rngs=rngs)

  def __call__(self, x):
    return block_math(x, lambda name, h: self.layers[name](h), self.drop)


def nnx_losses(block_cls, train=False):
  """The loss of an NNX block (dropout on if ``train``), params, the rest."""
  block = block_cls(nnx.Rngs(0, dropout=DROPOUT_KEY))
  if not train:
    block.eval()
  graphdef, params, rest = nnx.split(block, nnx.Param, ...)

  def loss(params, rest):
    # Fresh Variables in the current trace, so rng counters may advance.
    rest = jax.tree.map(lambda a: a, rest)
    return jnp.sin(nnx.merge(graphdef, params, rest)(X)).sum()
  return loss, params, rest


def nnx_method_block(decorator):
  class Block(NNXBlock):
    @decorator
    def __call__(self, x):
      return NNXBlock.__call__(self, x)
  return Block


def test_nnx_method(remat_mode):
  plain, params, rest = nnx_losses(NNXBlock)
  check_policies(
      lambda policy: nnx_losses(nnx_method_block(rt.remat(policy=policy)))[0],
      lambda jax_policy: nnx_losses(nnx_method_block(nnx.remat(
          policy=jax_policy)))[0],
      plain, params, rest)


def test_nnx_class_and_state_updates(remat_mode):
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.bn = nnx.BatchNorm(D, rngs=rngs)
      self.up = nnx.Linear(D, D, kernel_init=cheap_init, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(jnp.tanh(rt.tag(self.up(self.bn(x)), "ffn.up")))

  remat_cls = rt.remat(Block, "save-ffn")
  assert remat_cls.__name__ == "RematBlock" and issubclass(remat_cls, Block)
  ours = remat_cls(nnx.Rngs(0, dropout=DROPOUT_KEY))
  plain = Block(nnx.Rngs(0, dropout=DROPOUT_KEY))
  grads = [nnx.grad(lambda m: jnp.sin(m(X)).sum())(m) for m in (ours, plain)]
  assert_trees_close(nnx.state(grads[0]), nnx.state(grads[1]))
  # Batch statistics and rng counters were written back, once.
  assert_trees_close(nnx.state(ours), nnx.state(plain))
  loss, params, rest = nnx_losses(lambda rngs: remat_cls(rngs), train=True)
  assert named(residuals(loss, params, rest)) == {"ffn.up"}


# ---------------------------------------------------------------- dropout

def test_dropout_masks_repeat_in_the_recompute(remat_mode):
  # The recompute draws the dropout mask again: gradients equal no remat's
  # only if it is the same mask. rate 0.5, so a different mask cannot pass.
  policy = "boundary-only"
  jax_policy = HAND_WRITTEN[policy]
  linen_cases = (
      linen_losses(LinenStack(rt.remat(LinenBlock, policy)), train=True),
      linen_losses(LinenStack(nn.remat(LinenBlock, policy=jax_policy,
                                       static_argnums=(2,))), train=True),
      linen_losses(LinenStack(), train=True))
  nnx_cases = (
      nnx_losses(nnx_method_block(rt.remat(policy=policy)), train=True),
      nnx_losses(nnx_method_block(nnx.remat(policy=jax_policy)), train=True),
      nnx_losses(NNXBlock, train=True))
  key = DROPOUT_KEY

  def plain_loss(fn):
    return (lambda p: jnp.sin(fn(p, X, key, True)).sum(), init_params())
  fn_cases = (plain_loss(rt.remat(block_fn, policy)),
              plain_loss(jax.checkpoint(block_fn, policy=jax_policy,
                                        static_argnums=(3,))),
              plain_loss(block_fn))
  for ours, ref, plain in (linen_cases, nnx_cases, fn_cases):
    args = ours[1:]
    assert_trees_close(grad_of(ours[0], *args), grad_of(plain[0], *args))
    assert residuals(ours[0], *args) == residuals(ref[0], *args)


# ---------------------------------------------------------------- functions

def init_params():
  keys = iter(jax.random.split(jax.random.key(0), 16))
  params = {n: {"w": jax.random.normal(next(keys), (D if n != "down"
                                                   else 2 * D, SIZES[n])) / 3,
                "b": jnp.zeros(SIZES[n])} for n in SIZES}
  params.update({n: {"scale": jnp.ones(D), "bias": jnp.zeros(D)}
                 for n in ("ln1", "ln2")})
  return params


def block_fn(params, x, key, train):
  def layer(name, h):
    p = params[name]
    if name.startswith("ln"):
      mu = h.mean(-1, keepdims=True)
      sd = jnp.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6)
      return (h - mu) / sd * p["scale"][None, None] + p["bias"][None, None]
    return h @ p["w"] + p["b"][None, None]

  def dropout(p):
    if not train:  # a Python bool: static without static_argnums
      return p
    return p * jax.random.bernoulli(key, 0.5, p.shape) / 0.5
  return block_math(x, layer, dropout)


def test_plain_function(remat_mode):
  key = jax.random.key(5)

  def loss_of(fn):
    return lambda p: jnp.sin(fn(p, X, key, False)).sum()
  check_policies(
      lambda policy: loss_of(rt.remat(block_fn, policy)),
      lambda jax_policy: loss_of(jax.checkpoint(
          block_fn, policy=jax_policy, static_argnums=(3,))),
      loss_of(block_fn), init_params())


# ---------------------------------------------------------------- policies

def test_explicit_policy_wins_over_ambient(remat_mode):
  explicit = rt.remat(block_fn, policy="save-attention")
  ambient = rt.remat(block_fn)  # decorated outside: read when traced
  p, key = init_params(), jax.random.key(0)

  def kept(fn):
    return named(residuals(lambda p: jnp.sin(fn(p, X, key, False)).sum(), p))
  with rt.use_policy("save-ffn"):
    kept_explicit, kept_ambient = kept(explicit), kept(ambient)
  assert {"attn.q", "attn.k", "attn.v"} <= kept_explicit
  assert not any(name.startswith("ffn") for name in kept_explicit)
  assert kept_ambient == {"ffn.up"}
  assert kept(ambient) == set()  # outside the block: boundary-only


def test_policy_object_and_raw_jax_policy(remat_mode):
  p, key = init_params(), jax.random.key(0)
  custom = rt.Policy(name="keep-q", save=["attn.q"])
  for policy in (custom, cp.save_only_these_names("attn.q")):
    f = rt.remat(block_fn, policy=policy)
    assert named(residuals(lambda p: f(p, X, key, False).sum(), p)) == {
        "attn.q"}


def test_glob_matches_names_never_seen_before(remat_mode):
  # Names made up for this test, tagged with rt.tag and with JAX's own
  # checkpoint_name: patterns are expanded against the region's own names.
  def fn(x):
    a = rt.tag(jnp.sin(x), "fresh_tag_a")
    b = jax.ad_checkpoint.checkpoint_name(jnp.sin(a), "fresh_raw_b")
    return jnp.sin(b).sum()
  policy = rt.Policy(name="fresh", save=["fresh_*"])
  records = residuals(rt.remat(fn, policy=policy), X)
  assert named(records) == {"fresh_tag_a", "fresh_raw_b"}


def test_unmatched_patterns_warn_once(fresh_trace_warnings):
  f = rt.remat(lambda x: jnp.sin(rt.tag(x * 2, "ffn.up")).sum(),
               policy="save-attention")
  with pytest.warns(UserWarning, match=r"'save-attention'.*are 'ffn.up'"):
    jax.grad(f)(X)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.grad(f)(X)  # the same region and names: no second warning


def test_auto_static_python_values(remat_mode):
  def fn(x, n, mode, scale):
    for _ in range(n):  # int: static
      x = jnp.sin(x) if mode == "sin" else jnp.cos(x)
    return x * scale if scale is not None else x
  f = rt.remat(fn, policy="boundary-only")
  for args in ((3, "sin", 2.0), (2, "cos", None)):
    np.testing.assert_allclose(jax.grad(lambda x: f(x, *args).sum())(X),
                               jax.grad(lambda x: fn(x, *args).sum())(X),
                               rtol=1e-6)


def test_repeated_calls_trace_the_python_once(remat_mode):
  # Like jax.checkpoint: same shapes, dtypes and static values, one trace;
  # the policy is still read at each call.
  traces = []

  def fn(x, n):
    traces.append(n)
    return jnp.sin(rt.tag(jnp.sin(x) * n, "ffn.up")).sum()
  f = rt.remat(fn)
  for _ in range(5):
    f(X, 2)
  assert len(traces) == 1
  f(X, 3)  # a new static value
  f(X[:1], 3)  # a new shape
  assert len(traces) == 3
  with rt.use_policy("save-ffn"):
    assert named(residuals(lambda x: f(x, 2), X)) == {"ffn.up"}
  assert named(residuals(lambda x: f(x, 2), X)) == set()
  np.testing.assert_allclose(jax.grad(f)(X, 2), jax.grad(fn)(X, 2), rtol=1e-6)


def test_static_argnums_count_call_arguments_not_self(remat_mode):
  class Block(nn.Module):
    @rt.remat(policy="save-ffn", static_argnums=(1,))
    @nn.compact
    def __call__(self, x, config):
      return rt.tag(nn.Dense(config[0])(x), "ffn.up")

  config = (4,)  # a tuple: hashable, so it can be static
  variables = Block().init(jax.random.key(0), X, config)
  assert Block().apply(variables, X, config).shape == (2, 4, 4)


# ---------------------------------------------------------------- contract

def test_one_region_per_call_and_each_takes_the_analysed_policy(remat_mode):
  # The analyzer gives each region reading the ambient policy a marker of
  # its own and swaps it for each policy: a region that lost it would not
  # take the analysed policy.
  variables = numpy_variables(jax.eval_shape(
      lambda: LinenStack(depth=2).init(jax.random.key(0), X, False)))
  linen_model = LinenStack(rt.remat(LinenBlock), depth=2)
  nnx_loss, params, rest = nnx_losses(nnx_method_block(rt.remat), train=True)
  programs = [
      lambda p: rt.remat(block_fn)(p, X, jax.random.key(0), True).sum(),
      lambda v: linen_model.apply(v, X, True,
                                  rngs={"dropout": jax.random.key(0)}),
      nnx_loss,
  ]
  arguments = [(init_params(),), (variables,), (params, rest)]
  regions = [1, 2, 1]
  for program, args, expected in zip(programs, arguments, regions, strict=True):
    jaxpr = jax.make_jaxpr(program)(*args).jaxpr
    assert count_remat_regions(jaxpr) == expected
    report = rt.analyze(lambda *a, f=program: jnp.sum(f(*a)), *args,
                        policy="boundary-only")
    assert report.remat_regions == expected


def test_replayed_region_keeps_module_paths(remat_mode):
  model = LinenStack(rt.remat(LinenBlock, "save-ffn"))
  variables = LINEN_VARIABLES
  jaxpr = jax.make_jaxpr(lambda v: model.apply(v, X, False))(variables).jaxpr
  bodies = remat_bodies(jaxpr)
  assert len(bodies) == 1
  paths = {module_path(e) for e in bodies[0].eqns
           if e.primitive.name == "dot_general"}
  assert any(p.endswith("block_0/up") for p in paths), paths


# ---------------------------------------------------------------- bad input

def test_rejects_what_is_not_a_target():
  with pytest.raises(TypeError, match=r"got 42 \(a int\)"):
    rt.remat(42)
  with pytest.raises(TypeError, match=r"policy=\.\.\."):
    rt.remat("save-ffn")
  with pytest.raises(TypeError, match="module instance"):
    rt.remat(NNXBlock(nnx.Rngs(0)))


def test_rejects_bound_nnx_method():
  block = NNXBlock(nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"bound method NNXBlock.__call__.*"
                     r"rt.remat\(NNXBlock\)"):
    rt.remat(block.__call__)


def test_unknown_policy_fails_at_decoration_with_suggestion():
  with pytest.raises(ValueError, match="Did you mean 'save-ffn'"):
    rt.remat(block_fn, policy="save-fnn")
  with pytest.raises(ValueError, match="Did you mean 'save-ffn'"):
    rt.remat(policy="save_fnn")(block_fn)
  with pytest.raises(TypeError, match=r"^block_fn: policy must be a policy name"):
    rt.remat(block_fn, policy=3)


def test_static_argnums_out_of_range():
  with pytest.raises(ValueError, match=r"static_argnums=\(4,\) is out of range "
                     r"for block_fn.*3: train.*never self"):
    rt.remat(block_fn, static_argnums=4)
  with pytest.raises(ValueError, match="never self"):
    class Block(nn.Module):  # noqa: F841  (the decorator raises)
      @rt.remat(static_argnums=(2,))
      def __call__(self, x, train):
        return x
  with pytest.raises(ValueError, match="non-negative"):
    rt.remat(block_fn, static_argnums=-1)


def test_unhashable_static_argument():
  f = rt.remat(lambda x, sizes: x * len(sizes), static_argnums=(1,))
  with pytest.raises(TypeError, match=r"positional argument 1 .*\[1, 2\].*"
                     "tuple instead of a list"):
    f(X, [1, 2])
  with pytest.raises(TypeError, match="drop it from static_argnums"):
    f(X, jnp.ones(2))


# ---------------------------------------------------------------- NNX updates

class NNXCounter(nnx.Module):
  """Counts its calls in a plain attribute and adds one, as caches do."""

  def __init__(self, rngs):
    self.up = nnx.Linear(D, D, kernel_init=cheap_init, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    self.last_shape = x.shape
    return self.drop(jnp.tanh(rt.tag(self.up(x), "ffn.up")))


def counter_block(decorator):
  class Counter(NNXCounter):
    @decorator
    def __call__(self, x):
      return NNXCounter.__call__(self, x)
  return Counter


def test_nnx_attribute_updates_match_nnx_remat(remat_mode):
  policy = "save-ffn"
  classes = {"ours": counter_block(rt.remat(policy=policy)),
             "nnx": counter_block(nnx.remat(policy=HAND_WRITTEN[policy])),
             "plain": NNXCounter}
  modules = {k: cls(nnx.Rngs(0, dropout=DROPOUT_KEY))
             for k, cls in classes.items()}
  outs = {k: m(X) for k, m in modules.items()}
  grads = {k: nnx.grad(lambda m: jnp.sin(m(X)).sum())(m)
           for k, m in modules.items()}
  for k, m in modules.items():
    # One trace per call, as nnx.remat: the update is seen after each call.
    assert (m.calls, m.last_shape) == (2, X.shape), k
  for k in ("nnx", "plain"):
    assert_trees_close(outs["ours"], outs[k])
    assert_trees_close(nnx.state(grads["ours"]), nnx.state(grads[k]))
    # The dropout rng counter advanced as often.
    assert_trees_close(nnx.state(modules["ours"]), nnx.state(modules[k]))
  saved = [residuals(*nnx_losses(classes[k], train=True))
           for k in ("ours", "nnx")]
  assert saved[0] == saved[1] and named(saved[0]) == {"ffn.up"}


# ---------------------------------------------------------------- NNX paths

class NNXTwoBlocks(nnx.Module):
  def __init__(self, block_cls, rngs):
    self.blocks = nnx.List([block_cls(rngs) for _ in range(2)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def two_block_losses(how):
  """Loss, params, rest of two NNX blocks made regions in one of three ways."""
  rngs = nnx.Rngs(0, dropout=DROPOUT_KEY)
  if how == "rules":
    model = rt.remat_modules(NNXTwoBlocks(NNXBlock, rngs), {"NNXBlock": None},
                             tag_outputs=False)
  else:
    model = NNXTwoBlocks(nnx_method_block(rt.remat), rngs)
    if how == "named":
      rt.name_nnx_modules(model)
  model.eval()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest):
    rest = jax.tree.map(lambda a: a, rest)  # as in nnx_losses
    return jnp.sin(nnx.merge(graphdef, params, rest)(X)).sum()
  return loss, params, rest


@pytest.mark.parametrize("how, blocks", [
    ("named", ["blocks/0", "blocks/1"]), ("rules", ["blocks/0", "blocks/1"]),
    # Without the model at hand a region names its module by its class.
    ("unnamed", ["Block"])])
def test_nnx_residuals_carry_module_paths(remat_mode, how, blocks):
  loss, params, rest = two_block_losses(how)
  with rt.use_policy("save-matmuls"):
    report = rt.analyze(loss, params, rest, policy="save-matmuls")
    assert report.activation_bytes == shared_helpers.jax_activation_bytes(
        loss, (params, rest), "save-matmuls")
    # Names are metadata: what is saved and the values are those of no names.
    plain = two_block_losses("unnamed" if how != "unnamed" else "named")
    assert residuals(loss, params, rest) == residuals(*plain)
    assert_trees_close(grad_of(loss, params, rest), grad_of(*plain))
  dots = {r.module_path for r in report.activations
          if r.primitive == "dot_general" and r.name is None}
  layers = {f"{b}/layers/{n}" for b in blocks
            for n in ("q", "k", "v", "o", "up")}
  assert layers <= dots, dots


# ---------------------------------------------------------------- one policy path

def _resolver_type_error(value):
  """What the one resolver says, as rt.analyze passes it on unprefixed."""
  with pytest.raises(TypeError) as caught:
    rt.analyze(lambda x: jnp.sin(x).sum(), X, policy=value)
  return str(caught.value)


class _TinyLinen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + jnp.tanh(rt.tag(nn.Dense(2, kernel_init=cheap_init)(x),
                               "ffn.up"))


class _TinyNNX(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(rt.tag(self.fc(x), "ffn.up"))


class _TinyNNXModel(nnx.Module):
  def __init__(self, rngs):
    self.first, self.second = _TinyNNX(rngs), _TinyNNX(rngs)

  def __call__(self, x):
    return self.second(self.first(x))


ENTRY_POINTS = {
    "remat": lambda policy: rt.remat(jnp.sin, policy=policy),
    "remat_chain": lambda policy: rt.remat_chain(
        [jnp.sin, jnp.cos], jnp.ones(2), policy=policy),
    "scan_layers": lambda policy: rt.scan_layers(
        _TinyLinen, 2, policy=policy, remat=False),
    "scan_layers (NNX)": lambda policy: rt.scan_layers(
        _TinyNNX, 2, policy=policy),
    "remat_modules": lambda policy: rt.remat_modules(
        _TinyNNXModel(nnx.Rngs(0)), {"_TinyNNX": policy}),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_a_bad_policy_with_the_resolver_text(entry):
  with pytest.raises(TypeError) as caught:
    ENTRY_POINTS[entry](3)
  # Prefixed by where it was given (a rule, a scanned class), then verbatim.
  assert str(caught.value).endswith(_resolver_type_error(3))
  with pytest.raises(TypeError, match=r"got 3; e\.g\. .*'save-attention'"):
    rt.use_policy(3).__enter__()


@pytest.mark.parametrize("policy", [
    "save-ffn", rt.get_policy("save-ffn"), cp.save_only_these_names("ffn.up"),
    None], ids=["name", "Policy", "raw JAX", "ambient"])
def test_every_entry_point_accepts_what_the_resolver_accepts(policy):
  x = jnp.ones((1, 2))
  f = rt.remat(lambda w, x: jnp.tanh(rt.tag(x @ w, "ffn.up")), policy=policy)
  want = jax.grad(lambda w: jnp.tanh(x @ w).sum())(jnp.eye(2))
  assert_trees_close(jax.grad(lambda w: f(w, x).sum())(jnp.eye(2)), want)
  chain = rt.remat_chain([lambda x: rt.tag(jnp.sin(x), "ffn.up"), jnp.cos],
                         jnp.ones(2), group=2, policy=policy)
  assert_trees_close(chain, jnp.cos(jnp.sin(jnp.ones(2))))
  stack = rt.scan_layers(_TinyNNX, 2, policy=policy)(rngs=nnx.Rngs(0))
  assert stack(x).shape == (1, 2)
  model = rt.remat_modules(_TinyNNXModel(nnx.Rngs(0)), {"_TinyNNX": policy})
  assert model(x).shape == (1, 2)
  if policy is not None:
    with rt.use_policy(policy) as ambient:
      assert rt.current_policy() is ambient


def test_a_policy_file_is_read_once_when_the_region_is_declared(tmp_path,
                                                                 remat_mode):
  # Not once per trace: the regions and repolicy hold the file's policy.
  path = tmp_path / "keep-up.toml"
  path.write_text('name = "keep-up"\nsave = ["ffn.up"]\n')
  f = rt.remat(lambda w, x: jnp.tanh(rt.tag(x @ w, "ffn.up")), policy=str(path))
  again = rt.repolicy(jax.checkpoint(lambda w, x: jnp.tanh(
      rt.tag(x @ w, "ffn.up"))), str(path))
  path.unlink()
  x, w = jnp.ones((1, 2)), jnp.eye(2)
  for fn in (f, again):
    assert named(residuals(lambda w: fn(w, x).sum(), w)) == {"ffn.up"}


def test_a_jax_policy_needs_no_name_discovery(fresh_trace_warnings):
  # A raw JAX policy decides what it keeps by itself: a region under it
  # reads no names, so none can be missing (a named policy's can).
  def missing_names(policy, ambient="boundary-only"):
    f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum(), policy=policy)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      with rt.use_policy(ambient):
        jax.make_jaxpr(jax.grad(f))(X)
    return [w for w in caught if "keeps none of its names" in str(w.message)]

  assert not missing_names(cp.dots_saveable)
  assert not missing_names(rt.Policy.from_jax(cp.dots_saveable))
  assert missing_names("save-ffn")
  assert not missing_names(None, ambient=cp.dots_saveable)


def test_name_nnx_modules_refuses_what_is_not_an_nnx_module():
  with pytest.raises(TypeError, match=r"NNX Module instance, got 3 of type int"):
    rt.name_nnx_modules(3)
