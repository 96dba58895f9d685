"""Every residual JAX lists is listed, with its kind and the same bytes.

JAX's ``saved_residuals`` says where each residual comes from: ``from the
argument``, ``from a constant`` (an array the function closes over), ``from a
literal`` (a scalar such as a Python float) or ``named``/``output of``. The
analyzer lists each one with that kind, and ``activation_bytes`` counts all
but the arguments, as JAX's list does.
"""

import dataclasses
import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_helpers import jax_accounting
from shared_helpers import jax_kinds

import remat_toolkit as rt

D = 64
#: A module-level table the model closes over (a rotary or position table in
#: production models): 64 x 64 float32, 16,384 bytes.
TABLE = jnp.asarray(np.linspace(-1.0, 1.0, D * D, dtype=np.float32).reshape(D, D))
X = jax.ShapeDtypeStruct((4, D), jnp.float32)


def region_loss(x):
  """A closed-over array inside an ``rt.remat`` region."""
  return rt.remat(lambda h: jnp.sin(h @ TABLE))(x).sum()


def checkpoint_loss(x):
  """A closed-over array inside the model's own ``jax.checkpoint``."""
  return jax.checkpoint(lambda h: jnp.sin(h @ TABLE))(x).sum()


def literal_loss(x):
  """A Python float the loss scales by: JAX keeps it as a literal."""
  return (rt.remat(jnp.sin)(x) * 3.0).sum()


def _sine_kernel(kept):
  """A ``custom_vjp`` sine whose forward rule keeps ``kept`` arrays."""
  @jax.custom_vjp
  def kernel(x):
    return jnp.sin(x)

  def forward(x):
    return jnp.sin(x), (jnp.cos(x), x, jnp.tanh(x))[:kept]

  def backward(residuals, g):
    return (g * residuals[0],)

  kernel.defvjp(forward, backward)
  return kernel


KEEPS_ONE, KEEPS_THREE = _sine_kernel(1), _sine_kernel(3)


def two_kernels_loss(x, first=KEEPS_ONE, second=KEEPS_THREE):
  """Two regions that print alike but call different kernels (one rule's
  code, closing over different values): each keeps what its own forward
  rule keeps."""
  one = rt.remat(lambda h: first(h @ TABLE))
  other = rt.remat(lambda h: second(h @ TABLE))
  return other(one(x)).sum()


class TableBlock(nn.Module):
  """Linen block that reads a closed-over table, as the library ships it."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D)(x)
    return x + jnp.tanh(h @ TABLE)


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = nn.remat(TableBlock)(name=f"layer_{i}")(x)
    return x


MODEL = Model()
PARAMS = jax.eval_shape(lambda: MODEL.init(jax.random.key(0), jnp.ones(X.shape)))


def linen_loss(params, x):
  return (MODEL.apply(params, x) ** 2).mean()


PROGRAMS = {
    "rt.remat": (region_loss, (X,)),
    "jax.checkpoint": (checkpoint_loss, (X,)),
    "literal": (literal_loss, (X,)),
    "nn.remat": (linen_loss, (PARAMS, X)),
    "two kernels": (two_kernels_loss, (X,)),
    "two kernels, swapped": (
        lambda x: two_kernels_loss(x, KEEPS_THREE, KEEPS_ONE), (X,)),
}


def kinds(report):
  return sorted((r.kind, r.shape, r.nbytes) for r in report.residuals)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("policy", ["boundary-only", "save-everything"])
def test_every_residual_listed_with_jax_kind_and_bytes(remat_mode, program, policy):
  fn, args = PROGRAMS[program]
  report = rt.analyze(fn, *args, policy=policy)
  assert kinds(report) == jax_kinds(fn, args, policy)
  count, act_bytes, n_args = jax_accounting(fn, args, policy)
  assert len(report.residuals) == count
  assert report.activation_bytes + report.offloaded_bytes == act_bytes
  assert sum(r.kind == "argument" for r in report.residuals) == n_args


def test_closed_over_array_counts_in_activation_bytes(remat_mode):
  report = rt.analyze(region_loss, X, policy="boundary-only")
  constants = [r for r in report.residuals if r.kind == "constant"]
  assert [r.nbytes for r in constants] == [TABLE.size * 4] == [16384]
  assert report.activation_bytes == 16384
  assert report.bytes_by_kind() == {"constant": 16384, "argument": X.size * 4}


def test_scalar_literal_is_listed(remat_mode):
  report = rt.analyze(literal_loss, X, policy="boundary-only")
  literals = [r for r in report.residuals if r.kind == "literal"]
  assert [(r.shape, r.nbytes) for r in literals] == [((), 4)]
  assert report.activation_bytes == sum(r.nbytes for r in report.activations)
  assert ("literal", (), 4) in jax_kinds(literal_loss, (X,), "boundary-only")


def test_outputs_show_the_kind():
  report = rt.analyze(region_loss, X, policy="boundary-only")
  text = str(report)
  assert "kind" in text and "constant" in text
  assert "counted with the activations: constant 16.0 KiB" in text
  assert "Residual bytes by kind" in report._repr_html_()
  data = json.loads(report.to_json())
  assert data["bytes_by_kind"]["constant"] == 16384
  assert {r["kind"] for r in data["residuals"]} == {"argument", "constant"}


def test_by_module_and_by_name_sum_to_activation_bytes():
  report = rt.analyze(linen_loss, PARAMS, X, policy="save-everything")
  assert sum(report.by_module().values()) == report.activation_bytes
  assert sum(report.by_name().values()) == report.activation_bytes
  assert sum(report.by_name(kind="argument").values()) == report.argument_bytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Layer:
  weight: jax.Array


def test_an_argument_is_named_after_where_it_sits_in_any_pytree():
  """A weight kept as a residual carries the module path its key path gives:
  a linen variables dict's collection and an NNX variable's ``.value`` left
  out, a dataclass pytree's attributes kept (``layers[1].weight``: ``1``)."""
  def loss(layers, params, x):
    for layer in layers:
      x = rt.remat(lambda w, x: jnp.tanh(x @ w))(layer.weight, x)
    return (x @ params["params"]["head"]["kernel"]).sum()

  layers = [_Layer(jax.ShapeDtypeStruct((D, D), jnp.float32))] * 2
  params = {"params": {"head": {"kernel": jax.ShapeDtypeStruct((D, 2),
                                                               jnp.float32)}}}
  report = rt.analyze(loss, layers, params, X, policy="boundary-only")
  assert {r.label: r.module_path for r in report.residuals
          if r.kind == "argument"} == {
              "[0][0].weight": "0", "[0][1].weight": "1",
              "[1]['params']['head']['kernel']": "head", "[2]": ""}



@rt.remat
def _complex_block(x):
  """A complex value inside a region (as a complex rotary embedding makes)."""
  z = jnp.exp(x.astype(jnp.complex64) * (1 + 2j))
  return jnp.abs(jnp.sin(z))


def complex_loss(x):
  return _complex_block(x).sum()


def test_a_complex_value_inside_a_region_is_analysed(remat_mode):
  """JAX keeps the region's input only under boundary-only: so does the
  report. With remat3 off, JAX refuses save-everything (it rounds each kept
  value with reduce_precision, which refuses complex64): that policy alone
  is refused, with a ValueError naming it, and compare skips it; the rest,
  and the figures relative to no remat, stand."""
  report = rt.analyze(complex_loss, X, policy="boundary-only")
  assert kinds(report) == jax_kinds(complex_loss, (X,), "boundary-only")
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    comparison = rt.compare(complex_loss, X,
                            policies=["boundary-only", "save-everything"])
  assert "boundary-only" in comparison.reports
  if remat_mode:
    assert not comparison.skipped
    return
  assert list(comparison.skipped) == ["save-everything"]
  assert any("reduce_precision" in str(w.message) for w in said)
  with pytest.raises(ValueError, match="'save-everything'.*jax_remat3 on"):
    rt.analyze(complex_loss, X, policy="save-everything")
