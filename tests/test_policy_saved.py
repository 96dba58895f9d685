"""Every built-in policy saves exactly what its hand-written JAX policy saves.

The function below has a remat region holding every vocabulary tag, several
MaxText names, unbatched projections and one batched attention dot. For each
built-in policy the residuals JAX reports with ``rt.get_policy(name).to_jax()``
(names, shapes, memory kind, total bytes) must equal those of the JAX
constructor written out by hand here, under ``jax_remat3`` off and on.
"""

import collections

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import checkpoint_name_of
from shared_helpers import jax_residuals
from shared_helpers import remat3
from shared_helpers import remat3_offloads
from shared_helpers import sub_jaxprs

import remat_toolkit as rt

cp = jax.checkpoint_policies

S, D, H, F = 4, 8, 2, 16  # sequence, model width, heads, FFN width

# ------------------------------------------------------------ the function


def _norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def _heads(x):
  return x.reshape(S, H, D // H).transpose(1, 0, 2)


def _block(x, p):
  t = rt.tag
  h = t(jnp.sin(x), "block.input")
  n = t(_norm(h), "attn.norm")
  qkv = t(n @ p["wqkv"], "attn.qkv")
  q = t(jnp.tanh(qkv[:, :D]) @ p["wq"], "attn.q")
  k = t(n @ p["wk"], "attn.k")
  v = t(n @ p["wv"], "attn.v")
  # The one batched dot (batch dim: heads).
  scores = t(jnp.einsum("hqd,hkd->hqk", _heads(q), _heads(k)), "attn.scores")
  probs = t(jax.nn.softmax(scores, -1), "attn.probs")
  ctx = jnp.einsum("hqk,hkd->hqd", probs, _heads(v))
  ctx = t(ctx.transpose(1, 0, 2).reshape(S, D), "attn.context")
  h2 = h + t(ctx @ p["wo"], "attn.out")
  f = t(_norm(h2), "ffn.norm")
  up = t(f @ p["wup"], "ffn.up")
  gate = t(f @ p["wgate"], "ffn.gate")
  act = t(jax.nn.silu(gate) * up, "ffn.act")
  # tanh: the backward needs ffn.down itself, even when block.output is kept.
  y = t(h2 + jnp.tanh(t(act @ p["wdown"], "ffn.down")), "block.output")
  # A second, MaxText-tagged part.
  m = t(jnp.cos(y), "decoder_layer_input")
  qp = t(m @ p["mq"], "query_proj")
  mctx = t(jnp.tanh(qp), "context")
  op = t(mctx @ p["mo"], "out_proj")
  wi = t(op @ p["mi"], "mlpwi")
  wo = t(jax.nn.gelu(wi) @ p["mw"], "mlpwo")
  return jnp.sum(jnp.sin(wo))


_SHAPES = dict(wqkv=(D, 3 * D), wq=(D, D), wk=(D, D), wv=(D, D), wo=(D, D),
               wup=(D, F), wgate=(D, F), wdown=(F, D), mq=(D, D), mo=(D, D),
               mi=(D, F), mw=(F, D))
_KEYS = jax.random.split(jax.random.key(0), len(_SHAPES) + 1)
PARAMS = {k: 0.1 * jax.random.normal(key, shape)
          for (k, shape), key in zip(_SHAPES.items(), _KEYS, strict=False)}
X = jax.random.normal(_KEYS[-1], (S, D))

# ------------------------------------------------------------ by hand

QKV = ("attn.q", "attn.k", "attn.v", "attn.qkv", "query_proj", "key_proj",
       "value_proj", "qkv_proj")
OUT = ("attn.out", "out_proj")
CONTEXT = ("attn.context", "context")
FFN = ("ffn.up", "ffn.gate", "ffn.down", "mlpwi", "mlpwi_0", "mlpwi_1",
       "mlpwo")
DOWN = ("ffn.down", "mlpwo")
OFFLOAD_ATTENTION = QKV + CONTEXT + OUT
OFFLOAD_PROJECTIONS = QKV + OUT + FFN
OFFLOAD_QKV = QKV
# MaxText offloads its separate q/k/v projections only.
OFFLOAD_MAXTEXT_QKV = ("attn.q", "attn.k", "attn.v", "query_proj", "key_proj",
                       "value_proj")

SAVED_NAMES = {
    "save-qkv": QKV,
    "save-out-proj": OUT,
    "save-out-proj-and-ffn-down": OUT + DOWN,
    "save-attention": QKV + CONTEXT + OUT,
    "save-attention-and-ffn-down": QKV + CONTEXT + OUT + DOWN,
    "save-ffn": FFN,
    "save-projections": QKV + OUT + FFN,
    "save-projections-and-context": QKV + CONTEXT + OUT + FFN,
    "maxtext-save-dot-except-mlp": QKV + OUT,
    "maxtext-save-dot-with-context": QKV + CONTEXT + OUT,
    "maxtext-save-dot-except-mlpwi": QKV + OUT + DOWN,
    "praxis-save-qkv-out-proj": (
        "attn.qkv", "combined_qkv_proj", "attn.out", "out_proj"),
    "praxis-save-context": CONTEXT,
    "praxis-save-encoded-and-out-proj": CONTEXT + OUT,
    "recompute-attention-core": (
        "block.input", "block.output", "attn.norm", "attn.q", "attn.k",
        "attn.v", "attn.qkv", "attn.context", "attn.out", "ffn.norm", "ffn.up",
        "ffn.gate", "ffn.act", "ffn.down", "decoder_layer_input", "query_proj",
        "key_proj", "value_proj", "qkv_proj", "kv_proj", "out_proj", "context",
        "attention_out", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"),
}

# MaxText's decoder_layer_input=offload, and the name every region gives
# its inputs under it.
OFFLOAD_BOUNDARIES = ("block.input", "decoder_layer_input")

HAND_WRITTEN = {
    "boundary-only": cp.nothing_saveable,
    "save-everything": cp.everything_saveable,
    "save-matmuls": cp.dots_saveable,
    "save-matmuls-no-batch": cp.dots_with_no_batch_dims_saveable,
    **{name: cp.save_only_these_names(*names)
       for name, names in SAVED_NAMES.items()},
    "offload-attention": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(OFFLOAD_ATTENTION),
        offload_src="device", offload_dst="pinned_host"),
    "offload-projections": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(OFFLOAD_PROJECTIONS),
        offload_src="device", offload_dst="pinned_host"),
    "offload-qkv": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(OFFLOAD_QKV),
        offload_src="device", offload_dst="pinned_host"),
    "maxtext-qkv-proj-offloaded": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(OFFLOAD_MAXTEXT_QKV),
        offload_src="device", offload_dst="pinned_host"),
    "offload-matmuls-no-batch": cp.offload_dot_with_no_batch_dims(
        "device", "pinned_host"),
    "offload-boundaries": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(OFFLOAD_BOUNDARIES),
        offload_src="device", offload_dst="pinned_host"),
}
OFFLOADED_NAMES = {"offload-attention": OFFLOAD_ATTENTION,
                   "offload-projections": OFFLOAD_PROJECTIONS,
                   "offload-qkv": OFFLOAD_QKV,
                   "maxtext-qkv-proj-offloaded": OFFLOAD_MAXTEXT_QKV,
                   "offload-boundaries": OFFLOAD_BOUNDARIES}
OFFLOADING = sorted([*OFFLOADED_NAMES, "offload-matmuls-no-batch"])
SAVING = sorted(set(HAND_WRITTEN) - set(OFFLOADING))
NAME_LISTS = sorted(SAVED_NAMES)

# ------------------------------------------------------------ measuring

Residual = collections.namedtuple("Residual",
                                  "dtype shape memory kind name description")


def _residuals(jax_policy):
  fn = jax.checkpoint(_block, policy=jax_policy)
  return sorted(Residual(r.dtype, r.shape, r.memory_kind, r.kind, r.name or "",
                         r.description)
                for r in jax_residuals(fn, X, PARAMS))


def _names(residuals):
  return collections.Counter(r.name for r in residuals if r.name)


def _nbytes(residuals):
  return sum(jnp.dtype(r.dtype).itemsize * _size(r.shape) for r in residuals)


def _size(shape):
  out = 1
  for d in shape:
    out *= d
  return out


def _summary(residuals):
  return (_names(residuals), sorted(r.shape for r in residuals),
          _nbytes(residuals))


def _tag_shapes():
  """Checkpoint name -> shape, read from the traced function itself."""
  jaxpr = jax.make_jaxpr(_block)(X, PARAMS).jaxpr
  return {checkpoint_name_of(e): tuple(e.outvars[0].aval.shape)
          for e in jaxpr.eqns if checkpoint_name_of(e)}


def _dot_batch_dims(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
      yield len(lhs_batch)
    for sub in sub_jaxprs(eqn):
      yield from _dot_batch_dims(sub)


# ------------------------------------------------------------ tests


def test_the_function_has_what_the_policies_select():
  names = set(_tag_shapes())
  assert set(rt.names.VOCABULARY) <= names
  assert len(names & set(rt.names.MAXTEXT_NAMES)) >= 4
  batch_dims = list(_dot_batch_dims(jax.make_jaxpr(_block)(X, PARAMS).jaxpr))
  assert any(b > 0 for b in batch_dims), "needs a batched dot"
  assert sum(b == 0 for b in batch_dims) >= 2, "needs unbatched dots"


def test_every_builtin_policy_is_covered(fresh_catalogue):
  assert set(rt.list_policies()) == set(HAND_WRITTEN)


@pytest.mark.parametrize("name", SAVING)
def test_saves_what_the_hand_written_jax_policy_saves(name, remat_mode):
  ours = _residuals(rt.get_policy(name).to_jax())
  theirs = _residuals(HAND_WRITTEN[name])
  assert _summary(ours) == _summary(theirs)
  assert ours == theirs


@pytest.mark.parametrize("name", NAME_LISTS)
def test_name_policies_save_exactly_their_names(name, remat_mode):
  present = set(_tag_shapes())
  expected = set(SAVED_NAMES[name]) & present
  saved = _names(_residuals(rt.get_policy(name).to_jax()))
  assert expected, f"{name} selects nothing in the test function"
  assert set(saved) == expected
  assert all(count == 1 for count in saved.values())


def test_policies_really_differ(remat_mode):
  def nbytes(name):
    return _nbytes(_residuals(rt.get_policy(name).to_jax()))

  assert (nbytes("boundary-only") < nbytes("save-qkv")
          < nbytes("save-attention") < nbytes("recompute-attention-core")
          < nbytes("save-everything"))
  assert nbytes("save-out-proj") < nbytes("save-projections")
  assert nbytes("save-projections") < nbytes("save-projections-and-context")
  # The batched attention dots are what tells the two matmul policies apart.
  assert (nbytes("boundary-only") < nbytes("save-matmuls-no-batch")
          < nbytes("save-matmuls"))


def test_boundary_only_keeps_only_region_inputs(remat_mode):
  residuals = _residuals(rt.get_policy("boundary-only").to_jax())
  assert all(r.kind == "argument" for r in residuals)
  assert len(residuals) == 1 + len(PARAMS)


@pytest.mark.parametrize("name", OFFLOADING)
def test_offload_policies_under_remat3_run_or_refuse_by_release(name):
  # jax 0.10/0.11's remat3 ignores offloading (silently full remat), so the
  # policy refuses to lower; jax 0.12's offloads, so it keeps its meaning.
  with remat3(True):
    if remat3_offloads():
      assert (_residuals(rt.get_policy(name).to_jax())
              == _residuals(HAND_WRITTEN[name]))
    else:
      with pytest.raises(ValueError, match=f"jax {jax.__version__}"):
        rt.get_policy(name).to_jax()


@pytest.mark.parametrize("name", OFFLOADING)
def test_offload_policies_offload_what_jax_offloads(name):
  with remat3(False):
    ours = _residuals(rt.get_policy(name).to_jax())
    theirs = _residuals(HAND_WRITTEN[name])
    inputs_only = _residuals(cp.nothing_saveable)
  assert ours == theirs
  host = [r for r in ours if r.memory == "host"]
  device = [r for r in ours if r.memory == "device"]
  assert host, f"{name} offloads nothing on this backend"
  assert device == inputs_only


@pytest.mark.parametrize("name", sorted(OFFLOADED_NAMES))
def test_offloaded_residuals_are_the_named_tensors(name):
  shapes = _tag_shapes()
  expected = sorted(shapes[n] for n in OFFLOADED_NAMES[name] if n in shapes)
  with remat3(False):
    host = [r for r in _residuals(rt.get_policy(name).to_jax())
            if r.memory == "host"]
  assert sorted(r.shape for r in host) == expected


def test_offload_matmuls_no_batch_moves_the_unbatched_dots_to_host():
  with remat3(False):
    host = [r for r in
            _residuals(rt.get_policy("offload-matmuls-no-batch").to_jax())
            if r.memory == "host"]
    kept = [r for r in
            _residuals(rt.get_policy("save-matmuls-no-batch").to_jax())
            if r.kind != "argument"]
  assert sorted(r.shape for r in host) == sorted(r.shape for r in kept)


@pytest.mark.pins_mode
def test_offloaded_gradients_run_on_this_backend():
  with remat3(False):
    policy = rt.get_policy("offload-projections").to_jax()
    grads = jax.grad(jax.checkpoint(_block, policy=policy), argnums=1)(X, PARAMS)
  expected = jax.grad(_block, argnums=1)(X, PARAMS)
  for key in PARAMS:
    assert jnp.allclose(grads[key], expected[key], atol=1e-6), key
