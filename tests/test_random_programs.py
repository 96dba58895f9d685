"""Property-based tests over random programs nobody designed for.

Hypothesis draws a remat region's body from the constructs real models use
(dense layers with checkpoint names, attention with batch dimensions, norms,
``custom_jvp`` and ``custom_vjp`` functions, closed-over constants, Python
literals, gathers, ``cond``, nested ``jit``, ``vmap``, convolutions,
concatenate and split), applies it to one or two layers unrolled or under
``scan``, in either remat mode, and checks for every built-in policy that
runs there (two fixed, the others drawn):

* the report lists every residual JAX's own ``saved_residuals`` lists, with
  JAX's kind, shape and bytes (computed, arguments, constants, literals,
  host and device);
* ``rt.repolicy`` of the same layers written with ``jax.checkpoint`` keeps
  what ``jax.checkpoint`` with the policy written by hand keeps;
* gradients equal those of the program without remat;
* ``rt.peak(..., compile=True)`` of the step (``jax.grad``, or an optax
  train step) adds up: its live tensors sum to its prediction, XLA's live
  buffers to XLA's figure, which is ``memory_analysis()`` of the same step
  compiled here, and the prediction holds exactly the arguments XLA's
  compiled program takes (``jax.jit`` drops those the step never reads).

Examples are derandomised (the same draws on every run and machine). CI
draws a few; ``RT_MANY_EXAMPLES=1 pytest tests/test_random_programs.py``
draws many more (minutes), before a release or after a change to the
analyzer's tracing.
"""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from shared_helpers import GRADIENT_RTOL
from shared_helpers import assert_gradients_close
from shared_helpers import jax_kinds
from shared_helpers import remat3 as jax_remat3
from shared_helpers import reports_of
from shared_helpers import residuals
from shared_helpers import runnable_policies
from shared_helpers import xla_step_bytes

import remat_toolkit as rt

# Each test draws the remat mode itself, so the JAX_REMAT3=1 pass skips them.
pytestmark = pytest.mark.both_modes

_SETTINGS = dict(deadline=None, database=None, derandomize=True,
                 print_blob=True, suppress_health_check=[HealthCheck.too_slow])

B, D, H = 4, 8, 2
CONST = np.linspace(0.5, 1.5, B * D, dtype=np.float32).reshape(B, D)
PERMUTATION = np.array([1, 0, 3, 2, 5, 4, 7, 6])


@jax.custom_vjp
def _scaled_tanh(x):
  return jnp.tanh(x) * 0.5


def _scaled_tanh_fwd(x):
  y = jnp.tanh(x)
  return y * 0.5, (y,)


def _scaled_tanh_bwd(res, g):
  (y,) = res
  return (g * 0.5 * (1 - y * y),)


_scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def _attention(w, x):
  q = rt.tag(x @ w, "attn.q").reshape(B, H, D // H)
  k = x.reshape(B, H, D // H)
  p = jax.nn.softmax(jnp.einsum("bhd,chd->hbc", q, k), axis=-1)
  return rt.tag(jnp.einsum("hbc,chd->bhd", p, k).reshape(B, D), "attn.context")


def _norm(x):
  m = x.mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def _conv(w, x):
  y = jax.lax.conv_general_dilated(
      x[:, :, None], w[:3, :1, None], (1,), "SAME",
      dimension_numbers=("NWC", "WIO", "NWC"))
  return y[:, :, 0]


def _split_concat(x):
  a, b = jnp.split(x, 2, axis=1)
  return jnp.concatenate([b * 2.0, a], axis=1)


#: Each construct: (parameters, activation) -> activation of the same shape.
CONSTRUCTS = {
    "dense": lambda w, x: jnp.tanh(rt.tag(x @ w, "ffn.up")),
    "attention": _attention,
    "norm": lambda w, x: _norm(x),
    "custom_jvp": lambda w, x: jax.nn.gelu(x) + jax.nn.relu(x),
    "custom_vjp": lambda w, x: _scaled_tanh(x),
    "constant": lambda w, x: jnp.sin(x * CONST),
    "literal": lambda w, x: jnp.sin(x * 2.5 + 1.0),
    "gather": lambda w, x: jnp.take(x, PERMUTATION, axis=1) * x,
    "cond": lambda w, x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x),
    "jit": lambda w, x: jax.jit(lambda y: jnp.sin(y) * y)(x),
    "vmap": lambda w, x: jax.vmap(lambda r: jnp.tanh(r @ w))(x),
    "conv": lambda w, x: jnp.sin(_conv(w, x)),
    "split_concat": lambda w, x: jnp.sin(_split_concat(x)),
}


@st.composite
def programs(draw):
  """(constructs of the body, layers, layout)."""
  steps = draw(st.lists(st.sampled_from(sorted(CONSTRUCTS)), min_size=1,
                        max_size=3))
  return tuple(steps), draw(st.integers(1, 2)), draw(
      st.sampled_from(["unrolled", "scan"]))


def _body(steps):
  def body(w, x):
    for step in steps:
      x = x + 0.5 * CONSTRUCTS[step](w, x)
    return x
  return body


def build(program, region):
  """``(loss, args)`` with each layer ``region(body)``."""
  steps, layers, layout = program
  layer = region(_body(steps))
  rng = np.random.default_rng(len(steps) * 10 + layers)
  ws = rng.normal(size=(layers, D, D)).astype(np.float32) / np.sqrt(D)
  x = rng.normal(size=(B, D)).astype(np.float32)

  if layout == "scan":
    def loss(ws, x):
      x, _ = jax.lax.scan(lambda x, w: (layer(w, x), None), x, ws)
      return (x ** 2).mean()
    return loss, (jnp.asarray(ws), jnp.asarray(x))

  def loss(ws, x):
    for w in ws:
      x = layer(w, x)
    return (x ** 2).mean()
  return loss, (list(jnp.asarray(ws)), jnp.asarray(x))


def kinds(report):
  return sorted((r.kind, r.shape, r.nbytes) for r in report.residuals)


#: Policies every example checks; the others are drawn (each example traces
#: the program once per policy for JAX's own list).
ALWAYS = ("boundary-only", "save-everything")


def check(program, drawn, remat3):
  with jax_remat3(remat3), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # findings are not these tests' subject
    fn, args = build(program, rt.remat)
    runnable = set(runnable_policies())
    policies = [p for p in dict.fromkeys((*ALWAYS, *drawn)) if p in runnable]
    for policy, report in zip(policies, reports_of(fn, args, policies),
                              strict=True):
      assert kinds(report) == jax_kinds(fn, args, policy), (program, policy)
    # The same layers written with jax.checkpoint, re-policied, keep what
    # the policy written into each jax.checkpoint by hand keeps.
    mine, margs = build(program, jax.checkpoint)
    for jax_policy in (jax.checkpoint_policies.save_any_names_but_these(),
                       jax.checkpoint_policies.dots_saveable):
      by_hand, _ = build(program, lambda f, p=jax_policy: jax.checkpoint(
          f, policy=p))
      assert residuals(rt.repolicy(mine, jax_policy), *margs) == residuals(
          by_hand, *margs), (program, jax_policy)
    # Gradients equal the program's without remat.
    plain, _ = build(program, lambda f: f)
    expected = jax.value_and_grad(plain)(*args)
    for policy in policies:
      with rt.use_policy(policy):
        got = jax.value_and_grad(fn)(*args)
      assert_gradients_close(got, expected, GRADIENT_RTOL["float32"],
                             f"{program} {policy}")


drawn_policies = st.lists(st.sampled_from(rt.list_policies()), min_size=1,
                          max_size=2, unique=True)


@settings(max_examples=3, **_SETTINGS)
@given(program=programs(), drawn=drawn_policies, remat3=st.booleans())
def test_random_programs_match_jax(program, drawn, remat3):
  check(program, drawn, remat3)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("RT_MANY_EXAMPLES"),
                    reason="many examples take minutes: set RT_MANY_EXAMPLES=1")
@settings(max_examples=20, **_SETTINGS)
@given(program=programs(), drawn=drawn_policies, remat3=st.booleans())
def test_many_random_programs_match_jax(program, drawn, remat3):
  check(program, drawn, remat3)



def check_peak(program, policy, remat3, train):
  with jax_remat3(remat3), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # findings are not these tests' subject
    if policy not in runnable_policies():
      return
    fn, args = build(program, rt.remat)
    optimizer = optax.adam(1e-3) if train else None
    p = rt.peak(fn, *args, policy=policy, optimizer=optimizer, compile=True)
    assert sum(t.nbytes for t in p.live) == p.bytes, (program, policy)
    assert sum(b.nbytes for b in p.xla_live) == p.xla_bytes, (program, policy)
    assert p.xla_bytes == xla_step_bytes(fn, args, policy, optimizer), (
        program, policy)
    held = sum(t.nbytes for t in p.live if t.primitive == "argument")
    taken = sum(b.nbytes for b in p.xla_live if b.phase == "argument")
    assert held == taken, (program, policy, train)


drawn_policy = st.sampled_from(rt.list_policies())


@settings(max_examples=3, **_SETTINGS)
@given(program=programs(), policy=drawn_policy, remat3=st.booleans(),
       train=st.booleans())
def test_random_programs_peak_adds_up(program, policy, remat3, train):
  check_peak(program, policy, remat3, train)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("RT_MANY_EXAMPLES"),
                    reason="many examples take minutes: set RT_MANY_EXAMPLES=1")
@settings(max_examples=20, **_SETTINGS)
@given(program=programs(), policy=drawn_policy, remat3=st.booleans(),
       train=st.booleans())
def test_many_random_programs_peak_adds_up(program, policy, remat3, train):
  check_peak(program, policy, remat3, train)
