"""Property-based tests over random built-in model shapes and every policy.

Hypothesis draws a GPT shape (layers, width, heads, dtype, scan or not, remat
group size, FFN and position variants, dropout), a framework (linen or NNX) and a remat
implementation, then checks, for every built-in policy that runs there:

* gradients equal those of the same model built without remat (a few
  drawn policies per example, and every built-in on one fixed shape);
* the analyzer's residual counts and bytes equal JAX's own accounting
  (``saved_residuals`` under ``rt.use_policy``);
* device activation bytes are ordered wherever the policies' kept name sets
  are nested (computed from the policies, on the names the model has).

Examples are few and small: each one compiles or traces the model for every
policy in the catalogue (two dozen). They are derandomised, so every run draws
the same ones and a failure reproduces: each test runs one pinned ``@example``
case chosen to cover what the draws may not (NNX, scan with grouping, SwiGLU
and RoPE, bfloat16, dropout, remat3) plus its derandomised draws (the first is
Hypothesis's simplest example; the others change when the test's source does).
"""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from shared_helpers import GRADIENT_RTOL
from shared_helpers import QUICK_XLA
from shared_helpers import assert_gradients_close
from shared_helpers import checkpoint_names
from shared_helpers import concrete
from shared_helpers import jax_accounting
from shared_helpers import remat3 as jax_remat3
from shared_helpers import runnable_policies

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit.names import VOCABULARY

# Each test draws or fixes the remat mode itself, so the JAX_REMAT3=1 pass skips them.
pytestmark = pytest.mark.both_modes

# derandomize: the draws are a function of the test's source and this
# Hypothesis release, the same on every run and machine.
_SETTINGS = dict(deadline=None, database=None, derandomize=True,
                 print_blob=True, suppress_health_check=[HealthCheck.too_slow])


def tiny_gpt(*, layers=1, heads=1, head_dim=4, scan=False, group=1,
             swiglu=False, d_ff=16, seq=4, batch=1, dropout=0.0,
             dtype="float32"):
  """A tiny GPT config from the fields :func:`gpt_configs` draws."""
  return models.get_config(
      "tiny", num_layers=layers, num_heads=heads, d_model=heads * head_dim,
      d_ff=d_ff, seq_len=seq, batch_size=batch, vocab_size=16,
      dropout_rate=dropout, dtype=dtype, scan_layers=scan, remat_group=group,
      ffn="swiglu" if swiglu else "gelu",
      positions="rope" if swiglu else "learned",
      norm="rmsnorm" if swiglu else "layernorm",
      use_bias=not swiglu, tie_embeddings=not swiglu)


@st.composite
def gpt_configs(draw):
  """A tiny GPT config; every field the built-ins vary is drawn."""
  layers = draw(st.integers(1, 2), label="layers")
  scan = draw(st.booleans(), label="scan")
  sizes = [g for g in range(1, layers + 1) if not scan or layers % g == 0]
  return tiny_gpt(
      layers=layers, scan=scan,
      heads=draw(st.sampled_from([1, 2]), label="heads"),
      head_dim=draw(st.sampled_from([4, 8]), label="head_dim"),
      group=draw(st.sampled_from(sizes + ["sqrt"]), label="group"),
      swiglu=draw(st.booleans(), label="swiglu"),
      d_ff=draw(st.sampled_from([16, 32]), label="d_ff"),
      seq=draw(st.sampled_from([4, 8]), label="seq"),
      batch=draw(st.sampled_from([1, 2]), label="batch"),
      dropout=draw(st.sampled_from([0.0, 0.2]), label="dropout"),
      dtype=draw(st.sampled_from(["float32", "bfloat16"]), label="dtype"))


# The pinned cases: the model variants the built-ins differ on (scan with
# grouping, SwiGLU/RoPE/RMSNorm, bfloat16, dropout; a sqrt grouping of wider
# layers), which Hypothesis's simplest draw, a one-layer float32 GELU, lacks.
SCANNED_SWIGLU = tiny_gpt(layers=2, heads=2, scan=True, group=2, swiglu=True,
                          dropout=0.2, dtype="bfloat16")
UNROLLED_GELU_SQRT = tiny_gpt(layers=2, heads=2, group="sqrt", d_ff=32,
                              seq=8, batch=2)


frameworks = st.sampled_from(["linen", "nnx"])


# ------------------------------------------------------------ gradients

def gradients_per_policy(config, framework, policies):
  """(no-remat value and grads, [value and grads per policy]) in one program."""
  # With dropout on, the recompute must draw the masks the forward drew.
  dropout = config.dropout_rate > 0
  fn, args = models.build_loss(config, framework=framework, dropout=dropout)
  reference, _ = models.build_loss(config, remat=False, framework=framework,
                                   dropout=dropout)
  params, batch = concrete(args, seed=0)

  def every_policy(params, batch):
    # One program for all policies: one compilation.
    out = [jax.value_and_grad(reference)(params, batch)]
    for name in policies:
      with rt.use_policy(name):
        out.append(jax.value_and_grad(fn)(params, batch))
    return out

  first, *rest = jax.jit(every_policy).lower(params, batch).compile(
      QUICK_XLA)(params, batch)
  return first, rest


def assert_same_gradients(config, policies, reference, results):
  rtol = GRADIENT_RTOL[np.dtype(config.activation_dtype).name]
  for name, result in zip(policies, results, strict=True):
    assert_gradients_close(result, reference, rtol, name)


@settings(max_examples=1, **_SETTINGS)
@given(config=gpt_configs(), framework=frameworks, remat3=st.booleans(),
       policies=st.lists(st.sampled_from(rt.list_policies()), min_size=1,
                         max_size=2, unique=True))
@example(config=SCANNED_SWIGLU, framework="nnx", remat3=True,
         policies=["save-attention", "recompute-attention-core"])
def test_gradients_equal_no_remat(config, framework, remat3, policies):
  # A few policies per example keep compilation short; every built-in is
  # checked on one shape by the test below.
  with jax_remat3(remat3):
    policies = [p for p in policies if p in runnable_policies()]
    reference, results = gradients_per_policy(config, framework, policies)
  assert_same_gradients(config, policies, reference, results)


def test_gradients_equal_no_remat_for_every_builtin():
  # remat2 runs every built-in (offloading included); the drawn examples
  # above cover remat3.
  remat3 = False
  config = models.get_config("tiny", num_layers=1, d_model=8, num_heads=2,
                             d_ff=16, seq_len=4, batch_size=1, vocab_size=16,
                             dropout_rate=0.2)
  with jax_remat3(remat3):
    policies = runnable_policies()
    reference, results = gradients_per_policy(config, "linen", policies)
  assert_same_gradients(config, policies, reference, results)


# ------------------------------------------------------------ bytes

@settings(max_examples=1, **_SETTINGS)
@given(config=gpt_configs(), framework=frameworks, remat3=st.booleans())
@example(config=SCANNED_SWIGLU, framework="linen", remat3=False)
def test_analyzer_bytes_equal_jax_accounting(config, framework, remat3):
  with jax_remat3(remat3):
    fn, args = models.build_loss(config, framework=framework)
    comparison = rt.compare(fn, *args, policies=runnable_policies())
    for name, report in comparison.reports.items():
      count, act_bytes, _ = jax_accounting(fn, args, name)
      assert len(report.residuals) == count, name
      assert report.activation_bytes + report.offloaded_bytes == act_bytes, name


# ------------------------------------------------------------ ordering

def kept_names(policy: rt.Policy, names: frozenset[str]) -> frozenset[str] | None:
  """The names a plain save-list policy keeps on device; None otherwise."""
  if policy.save_everything or policy.offloads or policy.matmuls != "none":
    return None
  return frozenset(n for n in names if policy.matches(n))


def nested_pairs(names: frozenset[str]) -> list[tuple[str, str]]:
  """(a, b) with a's kept names a subset of b's, from the policy files."""
  kept = {n: kept_names(rt.get_policy(n), names) for n in rt.list_policies()}
  kept = {n: k for n, k in kept.items() if k is not None}
  return [(a, b) for a in kept for b in kept if a != b and kept[a] <= kept[b]]


@settings(max_examples=2, **_SETTINGS)
@given(config=gpt_configs(), framework=frameworks, remat3=st.booleans())
@example(config=UNROLLED_GELU_SQRT, framework="nnx", remat3=True)
def test_activation_bytes_are_ordered_where_kept_sets_are_nested(
    config, framework, remat3):
  with jax_remat3(remat3):
    fn, args = models.build_loss(config, framework=framework)
    pairs = nested_pairs(checkpoint_names(jax.make_jaxpr(fn)(*args).jaxpr))
    needed = sorted({p for pair in pairs for p in pair} | {"save-everything"})
    comparison = rt.compare(fn, *args, policies=needed)
    kept = {n: r.activation_bytes for n, r in comparison.reports.items()}
  # This chain of built-ins, each keeping what the one before keeps and more, is
  # among the nested pairs on this model.
  chain = ["boundary-only", "save-qkv", "save-attention",
           "save-projections-and-context", "recompute-attention-core"]
  assert set(zip(chain, chain[1:], strict=False)) <= set(pairs)
  for small, large in pairs:
    assert kept[small] <= kept[large], (small, large, kept)
  if not remat3:  # remat3's everything_saveable drops un-named values
    assert all(v <= kept["save-everything"] for v in kept.values()), kept


def test_nesting_is_read_from_the_policy_files():
  names = frozenset(VOCABULARY)
  pairs = set(nested_pairs(names))
  assert ("save-qkv", "save-attention") in pairs
  assert ("save-attention", "save-qkv") not in pairs
  # save-ffn and save-attention keep disjoint names: neither is nested.
  assert ("save-ffn", "save-attention") not in pairs
  assert ("save-attention", "save-ffn") not in pairs
  assert all(("boundary-only", b) in pairs for _, b in pairs
             if b != "boundary-only")


@pytest.mark.parametrize("remat3", [False, True], ids=["remat2", "remat3"])
def test_the_chain_is_strictly_increasing_on_the_tiny_model(remat3):
  # Guards the ordering property against a model where every policy keeps
  # the same bytes (it would hold vacuously).
  with jax_remat3(remat3):
    fn, args = models.build_loss("tiny")
    comparison = rt.compare(fn, *args, policies=[
        "boundary-only", "save-qkv", "save-attention",
        "save-projections-and-context", "recompute-attention-core"])
  kept = [r.activation_bytes for r in comparison.reports.values()]
  assert kept == sorted(kept) and len(set(kept)) == len(kept)
