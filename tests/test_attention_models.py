"""Built-in models with a choice of attention core, and naming a kernel's residuals.

The three cores (naive, ``jax.nn.dot_product_attention``, the blockwise flash
kernel) compute the same loss and gradients; what each keeps under a policy is
what JAX's ``saved_residuals`` says, and the analyzer agrees. The flash kernel
names its output and log-sum-exp ``attn.context`` with ``rt.tag_residuals``,
so policies that keep the context keep them and the kernel does not run again
in the backward pass (with ``jax_remat3`` off; under it a ``custom_vjp`` is
opaque unless ``jax_custom_vjp3`` lets it see inside, on the releases where
it does).
"""

import contextlib
import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_helpers import assert_trees_close
from shared_helpers import grad_of
from shared_helpers import has_custom_vjp3_flag
from shared_helpers import jax_activation_bytes
from shared_helpers import named
from shared_helpers import remat3
from shared_helpers import residuals
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit.models import common
from remat_toolkit.models import flash

pytestmark = pytest.mark.usefixtures("quick_compiles")

cp = jax.checkpoint_policies
POLICIES = ["boundary-only", "save-attention", "save-ffn", "save-matmuls",
            "save-everything"]


@contextlib.contextmanager
def custom_vjp3(enabled):
  """Sets ``jax_custom_vjp3`` for the block (skips where JAX has no flag)."""
  if not has_custom_vjp3_flag():
    if enabled:
      pytest.skip("this JAX has no jax_custom_vjp3")
    yield
    return
  before = jax.config.jax_custom_vjp3
  jax.config.update("jax_custom_vjp3", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_custom_vjp3", before)


def qkv(seq, *, batch=2, heads=2, head_dim=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (batch, seq, heads, head_dim)
  return tuple(jax.random.normal(k, shape) for k in keys)


def backward_scans(fn, args, policy=None):
  """``scan`` equations in the backward pass of ``fn`` (under ``policy``).

  Traced on abstract ``args``: the pullback's jaxpr is taken inside the
  trace. The flash kernel's forward and backward are one scan each: a
  backward pass with two per kernel call runs the kernel's forward again.
  """
  found = []

  def probe(*args):
    def loss(first):
      with rt.use_policy(policy) if policy else contextlib.nullcontext():
        return fn(first, *args[1:])
    _, pullback = jax.vjp(loss, args[0])
    found.append(str(jax.make_jaxpr(pullback)(jnp.float32(1.0))))
    return jnp.float32(0.0)

  jax.eval_shape(probe, *args)
  return found[0].count("scan[")


# ---------------------------------------------------------------- the kernel

@pytest.mark.parametrize("seq, block", [(16, 4), (13, 4), (16, 128)],
                         ids=["4-blocks", "padded", "one-block"])
def test_flash_kernel_equals_the_naive_core(seq, block):
  q, k, v, g = qkv(seq)

  def naive(q, k, v):
    return common.attention_core(q, k, v, dropout=lambda p: p)

  def blockwise(q, k, v):
    out = flash.flash_attention(q, k, v, block_size=block)
    return out.reshape(*out.shape[:2], -1)

  def weighted(core):
    return lambda q, k, v: jnp.sum(core(q, k, v) * g.reshape(2, seq, -1))

  np.testing.assert_allclose(blockwise(q, k, v), naive(q, k, v),
                             rtol=1e-5, atol=1e-6)
  assert_trees_close(jax.grad(weighted(blockwise), (0, 1, 2))(q, k, v),
                     jax.grad(weighted(naive), (0, 1, 2))(q, k, v),
                     rtol=1e-4, atol=1e-5)


def test_flash_kernel_without_the_causal_mask_equals_jax():
  q, k, v, g = qkv(13)
  reference = functools.partial(jax.nn.dot_product_attention, is_causal=False)
  blockwise = functools.partial(flash.flash_attention, block_size=5,
                                causal=False)
  np.testing.assert_allclose(blockwise(q, k, v), reference(q, k, v),
                             rtol=1e-5, atol=1e-6)
  assert_trees_close(
      jax.grad(lambda *a: jnp.sum(blockwise(*a) * g), (0, 1, 2))(q, k, v),
      jax.grad(lambda *a: jnp.sum(reference(*a) * g), (0, 1, 2))(q, k, v),
      rtol=1e-4, atol=1e-5)


def test_flash_kernel_keeps_q_k_v_output_and_log_sum_exp(remat_mode):
  q = jax.ShapeDtypeStruct((2, 12, 3, 8), jnp.bfloat16)
  kernel = rt.tag_residuals(flash.make_flash_kernel(block_size=4), "kernel")

  def f(x):  # q, k, v made inside the region, kept under their own names
    q, k, v = (jax.ad_checkpoint.checkpoint_name(op(x), n)
               for op, n in ((jnp.sin, "q"), (jnp.cos, "k"), (jnp.tanh, "v")))
    return kernel(q, k, v).astype(jnp.float32).sum()

  f = jax.checkpoint(f, policy=cp.save_only_these_names("q", "k", "v",
                                                        "kernel"))
  kept = [r for r in residuals(f, q) if r[2] != "argument"]
  inputs = [((2, 12, 3, 8), "bfloat16", f"named {n}") for n in "kqv"]
  if remat_mode:
    assert kept == sorted(inputs)  # the kernel is opaque: its residuals redone
  else:
    assert kept == sorted(inputs + [
        ((2, 12, 3, 8), "bfloat16", "named kernel"),    # the output
        ((2, 3, 12), "float32", "named kernel")])        # the log-sum-exp


def test_flash_kernel_traces_on_abstract_inputs():
  q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)
  out = jax.eval_shape(jax.grad(
      lambda q: flash.flash_attention(q, q, q).astype(jnp.float32).sum()), q)
  assert (out.shape, out.dtype) == (q.shape, q.dtype)


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(block_size=2.5), "block_size must be a positive integer"),
    (dict(k=jnp.ones((1, 5, 1, 2))), "one shape"),
])
def test_flash_attention_rejects_bad_arguments(bad, message):
  args = dict(q=jnp.ones((1, 4, 1, 2)), k=jnp.ones((1, 4, 1, 2)),
              v=jnp.ones((1, 4, 1, 2)))
  args.update(bad)
  with pytest.raises(ValueError, match=message):
    flash.flash_attention(**args)


# ---------------------------------------------------------------- the models

@pytest.mark.slow
@pytest.mark.parametrize("framework", models.FRAMEWORKS)
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_loss_and_gradients_equal_across_attention_cores(framework, scan):
  options = dict(scan=scan, framework=framework, group=2 if scan else 1)
  # The cores have no parameters: one set of values serves all three.
  _, args = models.build_loss("tiny", abstract=False, **options)
  results = {}
  for attention in models.ATTENTION_KINDS:
    # Four key blocks of the flash kernel in the sequence of 16.
    config = models.get_config("tiny", attention=attention, flash_block_size=4)
    fn, _ = models.build_loss(config, **options)
    results[attention] = (fn(*args), grad_of(fn, *args))
  for attention in ("dot_product", "flash"):
    assert_trees_close(results[attention], results["naive"], rtol=1e-5,
                       atol=1e-6)


def _context_residuals(fn, args, policy):
  def under(*a):
    with rt.use_policy(policy):
      return fn(*a)
  return sorted(r for r in residuals(under, *args)
                if r[2] == "named attn.context")


def _hand_named_kernel_keeps_its_name():
  """Whether a name inside a custom_vjp forward is kept, as JAX runs now."""
  @jax.custom_vjp
  def kernel(x):
    return jnp.sin(x)

  def fwd(x):
    return jnp.sin(x), (jax.ad_checkpoint.checkpoint_name(jnp.cos(x), "r"),)

  kernel.defvjp(fwd, lambda res, g: (res[0] * g,))
  f = jax.checkpoint(lambda x: kernel(jnp.tanh(x)).sum(),
                     policy=cp.save_only_these_names("r"))
  return "r" in named(residuals(f, jnp.ones(3)))


@pytest.mark.parametrize("with_custom_vjp3", [False, True],
                         ids=["custom_vjp", "custom_vjp3"])
def test_save_attention_keeps_the_flash_output_and_statistics(
    remat_mode, with_custom_vjp3):
  cfg = models.get_config("tiny")
  b, s, h, d = cfg.batch_size, cfg.seq_len, cfg.num_heads, cfg.head_dim
  with custom_vjp3(with_custom_vjp3):
    fn, args = models.build_loss(cfg, attention="flash")
    kept = _context_residuals(fn, args, "save-attention")
    honoured = _hand_named_kernel_keeps_its_name()
    assert rt.analyze(fn, *args, policy="save-attention").activation_bytes == (
        jax_activation_bytes(fn, args, "save-attention"))
  per_layer = [((b, h, s), "float32", "named attn.context"),   # log-sum-exp
               ((b, s, h, d), "float32", "named attn.context")]  # output
  # Exactly as a kernel with the name written inside its forward rule.
  assert kept == (sorted(per_layer * cfg.num_layers) if honoured else [])
  if not remat_mode:
    assert honoured  # the default implementation traces the rule inline
  elif not with_custom_vjp3:
    assert not honoured  # remat3 treats a custom_vjp as opaque


@pytest.mark.pins_mode
def test_every_policy_that_keeps_the_context_keeps_the_kernel_statistics():
  keeping = [p for p in rt.list_policies()
             if "attn.context" in rt.get_policy(p).expand()[0]]
  assert {"save-attention", "praxis-save-context"} <= set(keeping)
  # Some of them name nothing else this model has: the analyzer's warning
  # that they keep nothing is wrong here (the xfail test below).
  with remat3(False), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fn, args = models.build_loss("tiny", attention="flash")
    for policy in keeping:
      # The output and the log-sum-exp of each of the two layers.
      assert len(_context_residuals(fn, args, policy)) == 4, policy


@pytest.mark.pins_mode
def test_a_policy_naming_only_the_context_is_not_reported_as_keeping_nothing():
  # The names a custom_vjp's forward rule holds count as the region's names.
  with remat3(False), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fn, args = models.build_loss("tiny", attention="flash")
    report = rt.analyze(fn, *args, policy="praxis-save-context")
    assert report.activation_bytes > rt.analyze(
        fn, *args, policy="boundary-only").activation_bytes
    assert not [w for w in report.warnings if "keeps none of its names" in w]


@pytest.mark.pins_mode
def test_the_flash_forward_is_not_run_again_under_save_attention():
  with remat3(False):
    fn, args = models.build_loss("tiny", attention="flash")
    # One backward scan per layer; boundary-only adds the forward's again.
    assert backward_scans(fn, args, "save-attention") == 2
    assert backward_scans(fn, args, "boundary-only") == 4


@pytest.mark.pins_mode
@pytest.mark.parametrize("inside", [True, False],
                         ids=["named-inside", "output-named"])
def test_only_names_inside_the_forward_spare_the_kernel_a_rerun(inside):
  x = qkv(8)[0]

  def attention(x):
    if inside:
      return flash.flash_attention(x, x, x, block_size=4, residual_name="ctx")
    return rt.tag(flash.flash_attention(x, x, x, block_size=4), "ctx")

  with remat3(False):  # jax 0.10 picks the mode at jax.checkpoint
    f = jax.checkpoint(lambda x: jnp.sin(attention(x)).sum(),
                       policy=cp.save_only_these_names("ctx"))
    scans = backward_scans(f, (x,))
  # The backward rule reads the log-sum-exp its own forward made: named only
  # on the output, the statistics are not kept and the forward runs again.
  assert scans == (1 if inside else 2)


@pytest.mark.parametrize("attention, framework, scan, block", [
    ("naive", "linen", False, 128),
    ("dot_product", "linen", False, 128),
    ("flash", "linen", False, 128),
    ("flash", "nnx", True, 4),
], ids=["naive", "dot_product", "flash", "flash-nnx-scan-blocks"])
def test_analyzer_bytes_equal_jax_for_each_attention_core(
    remat_mode, attention, framework, scan, block):
  del remat_mode
  config = models.get_config("tiny", attention=attention,
                             flash_block_size=block)
  fn, args = models.build_loss(config, framework=framework, scan=scan)
  comparison = rt.compare(fn, *args, policies=POLICIES)
  for policy in POLICIES:
    assert comparison.reports[policy].activation_bytes == (
        jax_activation_bytes(fn, args, policy)), policy


def test_dot_product_attention_output_is_the_named_context(remat_mode):
  del remat_mode
  cfg = models.get_config("tiny")
  fn, args = models.build_loss(cfg, attention="dot_product")
  context = ((cfg.batch_size, cfg.seq_len, cfg.d_model), "float32",
             "named attn.context")
  assert _context_residuals(fn, args, "save-attention") == (
      [context] * cfg.num_layers)


@pytest.mark.parametrize("bad, message", [
    (dict(attention="fast"), r"one of \['naive', 'dot_product', 'flash'\]"),
    (dict(attention="flash", dropout=True), r"attention='naive'"),
    (dict(attention="dot_product", dropout=True), r"dropout_rate=0\.0"),
])
def test_build_loss_rejects_bad_attention_choices(bad, message):
  with pytest.raises(ValueError, match=message):
    models.build_loss("tiny", **bad)


def test_config_attention_and_block_size_are_checked():
  assert models.get_config("tiny", attention="flash").attention == "flash"
  with pytest.raises(ValueError, match=r"GPTConfig.attention.*'naive'"):
    models.get_config("tiny", attention="splash")
  with pytest.raises(ValueError, match="flash_block_size"):
    models.get_config("tiny", flash_block_size=0)


def test_a_kernel_without_probabilities_takes_dropout_off():
  # dropout=True with a zero rate drops nothing, so every core accepts it.
  config = models.get_config("tiny", dropout_rate=0.0)
  fn, args = models.build_loss(config, attention="flash", dropout=True)
  assert jax.eval_shape(fn, *args).shape == ()


# ---------------------------------------------------------------- tag_residuals

@jax.custom_vjp
def _sin2(x):
  return jnp.sin(x) * 2


def _sin2_bwd(res, g):
  return (2 * res[0] * g,)


_sin2.defvjp(lambda x: (jnp.sin(x) * 2, (jnp.cos(x),)), _sin2_bwd)


@jax.custom_vjp
def _sin2_named_inside(x):
  return jnp.sin(x) * 2


_sin2_named_inside.defvjp(
    lambda x: (jnp.sin(x) * 2,
               (jax.ad_checkpoint.checkpoint_name(jnp.cos(x), "kernel.res"),)),
    _sin2_bwd)


def _region(kernel, *names):
  return jax.checkpoint(lambda x: kernel(jnp.tanh(x)).sum(),
                        policy=cp.save_only_these_names(*names))


def test_tag_residuals_keeps_what_a_name_inside_the_forward_keeps(remat_mode):
  x = jnp.linspace(0.0, 1.0, 5)
  tagged = residuals(_region(rt.tag_residuals(_sin2, "kernel.res"),
                             "kernel.res"), x)
  by_hand = residuals(_region(_sin2_named_inside, "kernel.res"), x)
  assert tagged == by_hand
  assert ("kernel.res" in named(tagged)) is (not remat_mode or
                                             _hand_named_kernel_keeps_its_name())
  np.testing.assert_allclose(
      jax.grad(_region(rt.tag_residuals(_sin2, "kernel.res"), "kernel.res"))(x),
      jax.grad(_region(_sin2, "kernel.res"))(x), rtol=1e-6)


@jax.custom_vjp
def _exp(x):
  return jnp.exp(x)


def _exp_fwd(x):
  out = jnp.exp(x)
  return out, (x, out)  # the input, passed through, and the output


_exp.defvjp(_exp_fwd, lambda res, g: (res[1] * g,))


def test_inputs_are_not_named_and_the_output_is_kept_once():
  x = jnp.linspace(0.0, 1.0, 5)
  tagged = rt.tag_residuals(_exp, "kernel.res")
  with remat3(False):  # jax 0.10 picks the mode at jax.checkpoint
    # sin needs the kernel's output in the backward pass as well.
    f = jax.checkpoint(lambda x: jnp.sin(tagged(jnp.tanh(x))).sum(),
                       policy=cp.save_only_these_names("kernel.res"))
    kept = residuals(f, x)
    _, pullback = jax.vjp(f, x)
    backward = str(jax.make_jaxpr(pullback)(jnp.float32(1.0)))
  # The kernel's input tanh(x) is not named (so not kept): only the output.
  assert kept == [((5,), "float32", "argument"),
                  ((5,), "float32", "named kernel.res")]
  # The caller's sin reads the named output: the kernel is not run again.
  assert " exp " not in backward and "tanh" in backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _power_of_sin(n, x):
  return jnp.sin(x) ** n


def _power_of_sin_fwd(n, x):
  s = jnp.sin(x)
  return s ** n, (s, jnp.cos(x))


def _power_of_sin_bwd(n, res, g):
  s, c = res
  return (n * s ** (n - 1) * c * g,)


_power_of_sin.defvjp(_power_of_sin_fwd, _power_of_sin_bwd)


def test_tag_residuals_keeps_nondiff_argnums():
  x = jnp.linspace(0.1, 1.0, 5)
  tagged = rt.tag_residuals(_power_of_sin, "kernel.res")
  with remat3(False):
    f = jax.checkpoint(lambda x: tagged(3, jnp.tanh(x)).sum(),
                       policy=cp.save_only_these_names("kernel.res"))
    g = jax.checkpoint(lambda x: _power_of_sin(3, jnp.tanh(x)).sum(),
                       policy=cp.save_only_these_names("kernel.res"))
    assert sorted(r[2] for r in residuals(f, x)) == [
        "argument", "named kernel.res", "named kernel.res"]
    np.testing.assert_allclose(jax.grad(f)(x), jax.grad(g)(x), rtol=1e-6)
  np.testing.assert_allclose(tagged(2, x), _power_of_sin(2, x))


def test_tag_residuals_takes_a_kernel_made_under_custom_vjp3(remat_mode):
  x = jnp.linspace(0.1, 1.0, 5)
  with custom_vjp3(True):
    kernel = flash.make_flash_kernel(block_size=2)
    tagged = rt.tag_residuals(kernel, "kernel.res")
    q, k, v, _ = qkv(6, batch=1, heads=1, head_dim=5)
    assert_trees_close(jax.grad(lambda q: tagged(q, k, v).sum())(q),
                       jax.grad(lambda q: kernel(q, k, v).sum())(q))
    f = _region(rt.tag_residuals(_sin2, "kernel.res"), "kernel.res")
    assert residuals(f, x) == residuals(
        _region(_sin2_named_inside, "kernel.res"), x)


@pytest.mark.parametrize("kernel, name, error, message", [
    (jnp.sin, "r", TypeError, r"takes a jax\.custom_vjp function"),
    (jax.jit(_sin2), "r", TypeError, r"not a function or jit that calls it"),
    (jax.custom_jvp(jnp.sin), "r", TypeError, r"jax\.custom_vjp"),
    (jax.custom_vjp(jnp.sin), "r", TypeError, r"kernel\.defvjp\(fwd, bwd\)"),
    (_sin2, 3, TypeError, r"must be a string, got 3"),
    (_sin2, "", ValueError, r"non-empty.*got ''"),
    (_sin2, "  ", ValueError, r"non-empty.*got '  '"),
], ids=["function", "jit", "custom_jvp", "no-rule", "int-name", "empty-name",
        "blank-name"])
def test_tag_residuals_rejects_bad_input(kernel, name, error, message):
  with pytest.raises(error, match=message):
    rt.tag_residuals(kernel, name)


# ---------------------------------------------------------------- CLI

def test_cli_attention_option_builds_that_core():
  status, out, _ = run_cli("analyze", "--model", "tiny", "--attention",
                           "flash", "--policy", "save-attention", "--json")
  assert status == 0
  fn, args = models.build_loss("tiny", attention="flash")
  expected = rt.analyze(fn, *args, policy="save-attention").activation_bytes
  assert json.loads(out)["activation_bytes"] == expected
  status, out, _ = run_cli("compare", "--model", "tiny", "--attention",
                           "dot_product", "save-ffn")
  assert status == 0 and "attention dot_product" in out.splitlines()[0]


def test_cli_attention_option_refuses_an_unknown_core():
  status, _, err = run_cli("analyze", "--model", "tiny", "--attention", "fast")
  assert status == 2
  assert "'fast'" in err and "flash" in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_bench_attention_option_reaches_the_workload():
  status, out, _ = run_cli("bench", "--model", "tiny", "--attention", "flash",
                           "--steps", "1", "--warmup", "0", "--seq", "8",
                           "--quiet", "save-everything")
  assert status == 0
  assert "seq 8, float32, flash attention)" in out
