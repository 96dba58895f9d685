"""Built-in policies on models nobody here wrote, and the field's own names.

Part one: Hugging Face Flax GPT-2, BERT, T5 and Llama (see
``third_party_models.py``), the built-in GPT in linen and NNX, and Flax's own
layers in linen and NNX. Each selective built-in must select the tensors its
description promises, by the names these models really give them
(``rt.remat_modules`` tags submodule outputs by their path below the block),
and keep more than ``boundary-only``; ``rt.analyze``'s bytes must equal JAX's
``saved_residuals``; the Hugging Face models' gradients must equal the
unwrapped model's.

Part two: every catalogue name taken from MaxText's ``remat_policy`` or
Praxis's ``AutodiffCheckpointType`` must save exactly the residuals that
framework's own policy of that name saves, on a block tagged with their
checkpoint names, under ``jax_remat3`` off and on.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from shared_helpers import NNXMlp  # noqa: E402
from shared_helpers import cheap_init  # noqa: E402
from shared_helpers import checkpoint_names  # noqa: E402
from shared_helpers import grad_of  # noqa: E402
from shared_helpers import jax_activation_bytes  # noqa: E402
from shared_helpers import jax_residuals  # noqa: E402
from shared_helpers import offloading_unsupported  # noqa: E402
from shared_helpers import reports_of  # noqa: E402

import remat_toolkit as rt
from remat_toolkit import models

cp = jax.checkpoint_policies

SELECTIVE = ("save-qkv", "save-out-proj", "save-attention", "save-ffn",
             "save-projections")


# ================================================================ helpers

def selected(policy, names):
  """The checkpoint names present that ``policy`` keeps (may keep)."""
  return set(rt.get_policy(policy).expand(names)[0]) & set(names)


def names_in(fn, *args):
  return set(checkpoint_names(jax.make_jaxpr(fn)(*args).jaxpr))


def check_bytes(fn, args, names):
  """analyze == saved_residuals (boundary-only, save-attention, save-ffn);
  every selective built-in keeps more than boundary-only, and only names it
  selects (or boundary-only keeps)."""
  # What rt.analyze does, with the program traced once for every policy.
  measured = ("boundary-only", *SELECTIVE)
  reports = dict(zip(measured, reports_of(fn, args, measured), strict=True))
  for policy in ("boundary-only", "save-attention", "save-ffn"):
    assert reports[policy].activation_bytes == jax_activation_bytes(
        fn, args, policy), policy
  base = reports["boundary-only"]
  base_names = {r.name for r in base.activations if r.name}
  for policy in SELECTIVE:
    report = reports[policy]
    assert report.activation_bytes > base.activation_bytes, policy
    kept = {r.name for r in report.activations if r.name}
    assert kept - base_names, f"{policy} keeps nothing of its own"
    assert kept <= selected(policy, names) | base_names, policy
  return reports


def assert_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6), a, b)


def numpy_values(abstract):
  """Concrete values for abstract params, from NumPy: nothing to compile."""
  rng = np.random.RandomState(0)
  return jax.tree.map(
      lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape), s.dtype),
      abstract)


def grads_equal_unwrapped(plain_loss, wrapped_loss, params):
  reference = grad_of(plain_loss, params)
  for policy in ("save-attention", "save-ffn"):
    def under(p, policy=policy):
      with rt.use_policy(policy):
        return wrapped_loss(p)
    assert_close(grad_of(under, params), reference)


# ================================================================ Hugging Face

#: What each selective built-in selects in each model's blocks, by the names
#: tag_outputs gives (the union over the model's block kinds).
HF_SELECTED = {
    "gpt2": {
        "save-qkv": {"attn/c_attn"},
        "save-out-proj": {"attn/c_proj"},
        "save-attention": {"attn", "attn/c_attn", "attn/c_proj",
                           "attn/resid_dropout"},
        "save-ffn": {"mlp", "mlp/c_fc", "mlp/c_proj", "mlp/dropout"},
        "save-projections": {"attn/c_attn", "attn/c_proj", "mlp/c_fc",
                             "mlp/c_proj"},
    },
    "bert": {
        "save-qkv": {"attention/self/query", "attention/self/key",
                     "attention/self/value"},
        "save-out-proj": {"attention/output/dense"},
        "save-attention": {
            "attention", "attention/self", "attention/self/query",
            "attention/self/key", "attention/self/value", "attention/output",
            "attention/output/dense", "attention/output/dropout",
            "attention/output/LayerNorm"},
        # The FFN's down projection is output/dense, not attention/output/dense.
        "save-ffn": {"intermediate", "intermediate/dense", "output",
                     "output/dense", "output/dropout", "output/LayerNorm"},
        "save-projections": {
            "attention/self/query", "attention/self/key",
            "attention/self/value", "attention/output/dense",
            "intermediate/dense", "output/dense"},
    },
    "t5": {
        "save-qkv": {f"layer/{i}/{a}/{w}"
                     for i, a in ((0, "SelfAttention"), (1, "EncDecAttention"))
                     for w in "qkv"},
        "save-out-proj": {"layer/0/SelfAttention/o",
                          "layer/1/EncDecAttention/o"},
        "save-attention": {
            "layer/0/SelfAttention", "layer/1/EncDecAttention",
            "layer/0/SelfAttention/relative_attention_bias",
            *(f"layer/{i}/{a}/{w}"
              for i, a in ((0, "SelfAttention"), (1, "EncDecAttention"))
              for w in "qkvo")},
        # Encoder blocks: layer/1 is the FFN; decoder blocks: layer/2.
        "save-ffn": {f"layer/{i}/DenseReluDense{s}" for i in (1, 2)
                     for s in ("", "/wi", "/wo", "/dropout")},
        "save-projections": {
            *(f"layer/{i}/{a}/{w}"
              for i, a in ((0, "SelfAttention"), (1, "EncDecAttention"))
              for w in "qkvo"),
            *(f"layer/{i}/DenseReluDense/{w}" for i in (1, 2)
              for w in ("wi", "wo"))},
    },
    "llama": {
        "save-qkv": {"self_attn/q_proj", "self_attn/k_proj",
                     "self_attn/v_proj"},
        "save-out-proj": {"self_attn/o_proj"},
        "save-attention": {"self_attn", "self_attn/q_proj", "self_attn/k_proj",
                           "self_attn/v_proj", "self_attn/o_proj",
                           "self_attn/rotary_emb"},
        "save-ffn": {"mlp", "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj"},
        "save-projections": {
            "self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj",
            "self_attn/o_proj", "mlp/gate_proj", "mlp/up_proj",
            "mlp/down_proj"},
    },
}


def _hf(name):
  # Imported here: without transformers only these tests are skipped.
  import third_party_models as tp  # noqa: PLC0415
  m = tp.BUILDERS[name]()
  wrapped = rt.remat_modules(m.module, {tp.BLOCK_CLASSES[name]: None})
  return m, wrapped


@pytest.mark.parametrize("name", sorted(HF_SELECTED))
def test_hf_builtins_select_the_real_tensors(name, third_party_code):
  m, wrapped = _hf(name)
  params = jax.eval_shape(m.init)
  loss = m.loss(wrapped)
  names = names_in(loss, params)
  for policy in SELECTIVE:
    assert selected(policy, names) == HF_SELECTED[name][policy], policy
  # Attention and FFN policies never take each other's tensors.
  assert not selected("save-attention", names) & selected("save-ffn", names)
  check_bytes(loss, (params,), names)


# Slow (op by op on CPU) and the same in both remat modes: once per CI leg.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HF_SELECTED))
def test_hf_gradients_equal_the_unwrapped_model(name, third_party_code):
  m, wrapped = _hf(name)
  params = numpy_values(jax.eval_shape(m.init))
  grads_equal_unwrapped(m.loss(), m.loss(wrapped), params)


# ================================================================ built-in GPT

BUILTIN_SELECTED = {
    "save-qkv": {"attn.q", "attn.k", "attn.v"},
    "save-out-proj": {"attn.out"},
    "save-attention": {"attn.q", "attn.k", "attn.v", "attn.context",
                       "attn.out"},
    "save-ffn": {"ffn.up", "ffn.gate", "ffn.down"},
    "save-projections": {"attn.q", "attn.k", "attn.v", "attn.out", "ffn.up",
                         "ffn.gate", "ffn.down"},
}
CONFIG = models.get_config("tiny-swiglu", num_layers=2, d_model=16,
                           num_heads=2, d_ff=32, seq_len=8, batch_size=2,
                           dropout_rate=0.0)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_builtin_models(framework):
  fn, args = models.build_loss(CONFIG, framework=framework)
  names = names_in(fn, *args)
  for policy in SELECTIVE:
    assert selected(policy, names) == BUILTIN_SELECTED[policy], policy
  # Their gradients are checked against the unwrapped model in
  # test_offload_cpu.py and test_models.py.
  check_bytes(fn, args, names)


# ================================================================ Flax's own

D, HEADS = 8, 2
X = jnp.asarray(np.random.RandomState(1).standard_normal((2, 4, D)),
                jnp.float32)


class MlpBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x)))  # Dense_0, Dense_1


class LinenBlock(nn.Module):
  """Flax's own layers with the names Flax gives them."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x))
    return x + MlpBlock()(nn.LayerNorm()(x))


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = LinenBlock()(x)
    return x


FLAX_ATTENTION = {"MultiHeadDotProductAttention_0",
                  *(f"MultiHeadDotProductAttention_0/{p}"
                    for p in ("query", "key", "value", "out"))}
FLAX_FFN = {"MlpBlock_0", "MlpBlock_0/Dense_0", "MlpBlock_0/Dense_1"}


def test_flax_linen_layers():
  model = LinenModel()
  params = jax.eval_shape(model.init, jax.random.key(0), X)
  wrapped = rt.remat_modules(model, {"LinenBlock": None})

  def loss(model):
    return lambda p: jnp.sin(model.apply(p, X)).sum()
  names = names_in(loss(wrapped), params)
  assert selected("save-qkv", names) == {
      f"MultiHeadDotProductAttention_0/{p}" for p in ("query", "key", "value")}
  assert selected("save-out-proj", names) == {
      "MultiHeadDotProductAttention_0/out"}
  assert selected("save-attention", names) == FLAX_ATTENTION
  assert selected("save-ffn", names) == FLAX_FFN
  assert selected("save-projections", names) == (
      FLAX_ATTENTION | FLAX_FFN) - {"MultiHeadDotProductAttention_0",
                                    "MlpBlock_0"}
  # Gradients through these layers are checked in test_remat_modules.py.
  check_bytes(loss(wrapped), (params,), names)


class NNXBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm1 = nnx.LayerNorm(D, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        HEADS, D, decode=False, kernel_init=cheap_init, rngs=rngs)
    self.norm2 = nnx.LayerNorm(D, rngs=rngs)
    self.mlp = NNXMlp(D, rngs)

  def __call__(self, x):
    x = x + self.attention(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([NNXBlock(rngs) for _ in range(2)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def _nnx_loss(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    return jnp.sin(nnx.merge(graphdef, params, rest)(X)).sum()
  return loss, params


def test_nnx_model():
  wrapped, params = _nnx_loss(rt.remat_modules(NNXModel(nnx.Rngs(0)),
                                               {"blocks/*": None}))
  names = names_in(wrapped, params)
  attention = {"attention", *(f"attention/{p}"
                              for p in ("query", "key", "value", "out"))}
  ffn = {"mlp", "mlp/fc1", "mlp/fc2"}
  assert selected("save-qkv", names) == {
      f"attention/{p}" for p in ("query", "key", "value")}
  assert selected("save-out-proj", names) == {"attention/out"}
  assert selected("save-attention", names) == attention
  assert selected("save-ffn", names) == ffn
  assert selected("save-projections", names) == (
      attention | ffn) - {"attention", "mlp"}
  check_bytes(wrapped, (params,), names)


# ================================================================ MaxText, Praxis

#: MaxText's remat_policy values, written exactly as MaxText writes them in
#: src/maxtext/layers/decoders.py (Decoder.minimal_policy and
#: Decoder.get_remat_policy; "full" is policy=None).
_MAXTEXT_MINIMAL = ("query_proj", "value_proj", "key_proj", "qkv_proj",
                    "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
MAXTEXT = {
    "full": None,
    "minimal": cp.save_only_these_names(*_MAXTEXT_MINIMAL),
    "minimal_with_context": cp.save_only_these_names(
        *_MAXTEXT_MINIMAL, "context"),
    "save_dot_with_context_except_mlp": cp.save_only_these_names(
        "query_proj", "value_proj", "key_proj", "qkv_proj", "context",
        "out_proj"),
    "save_dot_except_mlpwi": cp.save_only_these_names(
        "query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj",
        "mlpwo"),
    "save_dot_except_mlp": cp.save_only_these_names(
        "query_proj", "value_proj", "key_proj", "qkv_proj", "out_proj"),
    "save_qkv_proj": cp.save_only_these_names(
        "query_proj", "value_proj", "key_proj", "qkv_proj"),
    "qkv_proj_offloaded": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["query_proj", "value_proj", "key_proj"],
        offload_src="device", offload_dst="pinned_host"),
    "minimal_offloaded": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(_MAXTEXT_MINIMAL),
        offload_src="device", offload_dst="pinned_host"),
    "save_out_proj": cp.save_only_these_names("out_proj"),
}

#: Praxis's AutodiffCheckpointType values, written exactly as
#: praxis/layers/checkpoint_policy.py (custom_policy) writes them.
PRAXIS = {
    "save_nothing": cp.nothing_saveable,
    "save_everything": cp.everything_saveable,
    "save_dot_only": cp.checkpoint_dots,
    "save_dot_with_no_batch_dims": cp.checkpoint_dots_with_no_batch_dims,
    "save_qkv_out_proj": cp.save_only_these_names(
        "combined_qkv_proj", "out_proj"),
    "save_out_proj": cp.save_only_these_names("out_proj"),
    "save_context": cp.save_only_these_names("context"),
    "save_encoded_and_out_proj": cp.save_only_these_names(
        "context", "out_proj"),
}

#: JAX's own constructor name, as MaxText's older releases spell it.
JAX_NAMES = {"checkpoint_dots_with_no_batch_dims":
             cp.checkpoint_dots_with_no_batch_dims}

FIELD = {**{("maxtext", k): v for k, v in MAXTEXT.items()},
         **{("praxis", k): v for k, v in PRAXIS.items()},
         **{("jax", k): v for k, v in JAX_NAMES.items()}}

S, W, F = 4, 8, 16
_SHAPES = dict(qkv=(W, 3 * W), cqkv=(W, 3 * W), q=(W, W), kv=(W, 2 * W),
               k=(W, W), v=(W, W), o=(W, W), wi=(W, F), wi0=(W, F),
               wi1=(W, F), wo=(F, W), qa=(W, W // 2), kva=(W, W // 2),
               qb=(W // 2, W), ei0=(W, F), ei1=(W, F), eo=(F, W))
_RNG = np.random.RandomState(3)
PARAMS = {k: jnp.asarray(0.2 * _RNG.standard_normal(shape), jnp.float32)
          for k, shape in _SHAPES.items()}
XS = jnp.asarray(_RNG.standard_normal((S, W)), jnp.float32)


def _norm(x):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def maxtext_block(x, p):
  """A decoder layer with every MaxText checkpoint name (and Praxis's fused
  ``combined_qkv_proj``); each tagged value feeds a nonlinearity, so the
  backward pass needs it and a policy that may save it does."""
  name = jax.ad_checkpoint.checkpoint_name
  x = name(jnp.sin(x), "decoder_layer_input")
  n = _norm(x)
  qkv = name(n @ p["qkv"], "qkv_proj")
  combined = name(n @ p["cqkv"], "combined_qkv_proj")
  q = name(jnp.tanh(qkv[:, :W] + combined[:, :W]) @ p["q"], "query_proj")
  kv = name(n @ p["kv"], "kv_proj")
  k = name(jnp.tanh(kv[:, :W]) @ p["k"], "key_proj")
  v = name(jnp.tanh(kv[:, W:]) @ p["v"], "value_proj")
  # Multi-head latent attention: low-rank projections and their latents.
  q_latent = name(_norm(name(n @ p["qa"], "query_wa_proj")), "mla_q")
  kv_latent = name(_norm(name(n @ p["kva"], "kv_wa_proj")), "mla_kv")
  q = q + jnp.tanh(q_latent) @ p["qb"] + jnp.tanh(kv_latent) @ p["qb"]
  probs = jax.nn.softmax(jnp.tanh(q) @ jnp.tanh(k).T, -1)
  context = name(probs @ jnp.tanh(v), "context")
  attention_out = name(jnp.tanh(context), "attention_out")
  out = name(attention_out @ p["o"], "out_proj")
  h = x + jnp.tanh(out)
  f = _norm(h)
  wi = name(f @ p["wi"], "mlpwi")
  wi0 = name(f @ p["wi0"], "mlpwi_0")
  wi1 = name(f @ p["wi1"], "mlpwi_1")
  act = jax.nn.gelu(wi) + jax.nn.silu(wi0) * wi1
  wo = name(act @ p["wo"], "mlpwo")
  # A mixture-of-experts layer names its expert matmuls twice, as MaxText's
  # does: the dense name inside, the moe_ name outside.
  e0 = name(name(f @ p["ei0"], "mlpwi_0"), "moe_mlpwi_0")
  e1 = name(name(f @ p["ei1"], "mlpwi_1"), "moe_mlpwi_1")
  eo = name(name((jax.nn.silu(e0) * e1) @ p["eo"], "mlpwo"), "moe_mlpwo")
  wo = wo + eo
  return jnp.sum(jnp.sin(h + jnp.tanh(wo)))


def field_residuals(fn):
  """(shape, dtype, memory kind, what) of every residual, sorted; what is
  the checkpoint name, "argument", or the primitive that made it."""
  return sorted((r.shape, r.dtype, r.memory_kind, r.name or r.what)
                for r in jax_residuals(fn, XS, PARAMS))


def test_the_block_has_every_maxtext_name():
  names = names_in(maxtext_block, XS, PARAMS)
  assert names == set(rt.names.MAXTEXT_NAMES) | {"combined_qkv_proj"}


@pytest.mark.parametrize("field,alias", sorted(FIELD))
def test_field_names_save_what_the_field_saves(field, alias, remat_mode):
  del remat_mode
  theirs = FIELD[field, alias]
  policy = rt.get_policy(alias)
  ours = rt.remat(maxtext_block, policy=alias)
  if policy.offloads and offloading_unsupported():
    # Where JAX would silently recompute instead of offloading, we refuse.
    with pytest.raises(ValueError, match="jax_remat3"):
      jax_residuals(ours, XS, PARAMS)
    return
  expected = field_residuals(jax.checkpoint(maxtext_block, policy=theirs))
  assert field_residuals(ours) == expected, (policy.name, expected)


# ================================================================ case

def test_matching_ignores_case_and_lowers_to_the_names_present(remat_mode):
  del remat_mode
  name = jax.ad_checkpoint.checkpoint_name

  def f(x):
    q = name(jnp.sin(x), "layer/0/SelfAttention/q")
    up = name(jnp.sin(q), "MLP/Up")
    return jnp.sum(jnp.sin(name(jnp.sin(up), "other")))

  present = ["layer/0/SelfAttention/q", "MLP/Up", "other"]
  policy = rt.Policy(name="p", save=["*attention/Q", "mlp/up"])
  lowered = policy.lowering(present)
  # The exact name is kept as written too; JAX compares names exactly.
  assert lowered.saved_names == {"layer/0/SelfAttention/q", "MLP/Up",
                                 "mlp/up"}
  assert policy.matches("mlp/UP") and not policy.matches("other")
  x = jnp.ones(3)
  ours = field_names(jax.checkpoint(f, policy=policy.to_jax(present)), x)
  assert ours == {"layer/0/SelfAttention/q", "MLP/Up"}


def field_names(fn, *args):
  return {r.name for r in jax_residuals(fn, *args) if r.name}
