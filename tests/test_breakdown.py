"""memory_breakdown: bytes per category, counted by hand, and the verdict."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from shared_helpers import jax_residuals
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models

S = jax.ShapeDtypeStruct
D, H = 16, 64


def mlp(params, x):
  h = rt.tag(x @ params["w1"] + params["b1"][None, :], "ffn.up")
  return rt.tag(jnp.tanh(h), "ffn.act") @ params["w2"]


def loss_of(region):
  return lambda params, x: (region(params, x) ** 2).mean()


loss = loss_of(rt.remat(mlp))


PARAMS = {"w1": S((D, H), jnp.float32), "b1": S((H,), jnp.float32),
          "w2": S((H, D), jnp.bfloat16)}
PARAM_BYTES = D * H * 4 + H * 4 + H * D * 2


def batch(n):
  return S((n, D), jnp.float32)


def test_parameter_gradient_and_adamw_bytes_by_hand():
  b = rt.memory_breakdown(loss, PARAMS, batch(4), optimizer="adamw")
  assert b.param_bytes == PARAM_BYTES
  assert b.grad_bytes == PARAM_BYTES
  # adamw: mu and nu like the parameters, plus an int32 step count.
  assert b.optimizer_bytes == 2 * PARAM_BYTES + 4
  assert b.input_bytes == 4 * D * 4
  assert b.optimizer == "adamw"
  assert b.total_bytes == sum(b.categories().values())


def test_optax_transformation_and_names():
  momentum = rt.memory_breakdown(loss, PARAMS, batch(4),
                                 optimizer=optax.sgd(0.1, momentum=0.9))
  assert momentum.optimizer_bytes == PARAM_BYTES
  assert momentum.optimizer == "optax optimizer"
  assert "GradientTransformation" not in str(momentum)
  plain = rt.memory_breakdown(loss, PARAMS, batch(4), optimizer="sgd")
  assert plain.optimizer_bytes == 0
  none = rt.memory_breakdown(loss, PARAMS, batch(4))
  assert none.optimizer_bytes == 0 and none.optimizer is None
  with pytest.raises(ValueError, match="Unknown optimizer 'adamx'.*adamw"):
    rt.memory_breakdown(loss, PARAMS, batch(4), optimizer="adamx")
  with pytest.raises(TypeError, match="GradientTransformation"):
    rt.memory_breakdown(loss, PARAMS, batch(4), optimizer=42)


def test_integer_leaves_have_no_gradient():
  params = {**PARAMS, "step": S((), jnp.int32)}
  b = rt.memory_breakdown(loss, params, batch(4))
  assert b.param_bytes == PARAM_BYTES + 4
  assert b.grad_bytes == PARAM_BYTES


def test_activations_are_the_analyzers(remat_mode):
  b = rt.memory_breakdown(loss, PARAMS, batch(32), policy="save-ffn")
  for policy, got in (("save-ffn", b.activation_bytes),
                      ("boundary-only", b.boundary_only_bytes),
                      ("save-everything", b.save_everything_bytes)):
    assert got == rt.analyze(loss, PARAMS, batch(32),
                             policy=policy).activation_bytes
  # save-ffn keeps ffn.up (not ffn.act): what JAX's own constructor keeps.
  by_hand = jax.checkpoint_policies.save_only_these_names("ffn.up")
  found = jax_residuals(loss_of(jax.checkpoint(mlp, policy=by_hand)),
                        PARAMS, batch(32))
  assert b.activation_bytes == sum(r.nbytes for r in found
                                   if r.kind != "argument")
  assert b.boundary_only_bytes < b.activation_bytes < b.save_everything_bytes


def test_dominant_category_and_verdict(remat_mode):
  small = rt.memory_breakdown(loss, PARAMS, batch(2), optimizer="adamw")
  assert small.dominant == "optimizer state" and not small.remat_helps
  assert "cannot rescue an out-of-memory error" in small.verdict
  big = rt.memory_breakdown(loss, PARAMS, batch(4096), optimizer="adamw",
                            policy="save-everything")
  assert big.dominant == "activations" and big.remat_helps
  assert "remat is the right tool" in big.verdict
  assert big.total_with(big.boundary_only_bytes) < big.total_bytes


def test_ambient_policy_is_the_default(remat_mode):
  with rt.use_policy("save-ffn"):
    b = rt.memory_breakdown(loss, PARAMS, batch(8))
  assert b.policy == "save-ffn"
  assert b.activation_bytes == rt.analyze(loss, PARAMS, batch(8),
                                          policy="save-ffn").activation_bytes


def test_no_regions_says_so():
  b = rt.memory_breakdown(lambda p, x: (x @ p).sum(), S((D, D), jnp.float32),
                          batch(4))
  assert b.remat_regions == 0
  assert "no remat region" in b.verdict


def test_compiled_temporaries():
  b = rt.memory_breakdown(loss, PARAMS, batch(8), compile=True)
  assert isinstance(b.xla_temp_bytes, int) and b.xla_temp_bytes > 0
  assert "XLA temporaries" in str(b)


def test_display_and_json():
  b = rt.memory_breakdown(loss, PARAMS, batch(4), optimizer="adamw")
  text = str(b)
  for word in ("parameters", "gradients", "optimizer state", "activations",
               "total", "dominant: optimizer state"):
    assert word in text
  assert "<table" in b._repr_html_()
  data = json.loads(b.to_json())
  assert data["optimizer_bytes"] == b.optimizer_bytes
  assert data["dominant"] == "optimizer state"


# ------------------------------------------------------------------ CLI

@pytest.mark.slow
def test_cli_breakdown_prints_the_table_and_json():
  status, text, _ = run_cli("breakdown", "--model", "tiny", "--optimizer", "adamw")
  assert status == 0
  assert text.startswith("model tiny")
  assert "optimizer state" in text and "adamw" in text
  status, out, _ = run_cli("breakdown", "--model", "tiny", "--optimizer", "adamw",
                           "--policy", "save-ffn", "--json")
  assert status == 0
  data = json.loads(out)
  fn, (params, tokens) = models.build_loss("tiny")
  expected = rt.memory_breakdown(fn, params, tokens, optimizer="adamw",
                                 policy="save-ffn")
  assert data == json.loads(expected.to_json())


def test_cli_breakdown_rejects_unknown_optimizer():
  status, _, err = run_cli("breakdown", "--model", "tiny", "--optimizer", "adamx")
  assert status == 2
  assert "adamx" in err
