"""Built-in policies on the naming conventions of production model libraries.

Each model here reproduces one library's module paths (gemma, DistilBERT,
recurrentgemma), MaxText's checkpoint names (mixture of experts, latent
attention) or MaxText's llama2 decoder layer. ``rt.remat_modules`` tags
submodule outputs by their path below the block; every built-in must keep
exactly what JAX's ``save_only_these_names`` keeps when given, by hand, the
names that built-in promises, under both remat modes. "Attention" globs must
not select a squeeze-and-excitation gate (Hugging Face RegNet).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_helpers import cheap_init  # noqa: E402
from shared_helpers import checkpoint_names
from shared_helpers import named  # noqa: E402
from shared_helpers import residuals  # noqa: E402

import remat_toolkit as rt

cp = jax.checkpoint_policies
D = 8
X = jnp.asarray(np.random.RandomState(0).standard_normal((2, 4, D)),
                jnp.float32)


def under(fn, policy):
  def run(*args):
    with rt.use_policy(policy):
      return fn(*args)
  return run


def kept(fn, args, policy):
  return residuals(under(fn, policy), *args)


def by_hand(names):
  return rt.Policy.from_jax(cp.save_only_these_names(*sorted(names)))


def names_in(fn, *args):
  return set(checkpoint_names(jax.make_jaxpr(fn)(*args).jaxpr))


def selected(policy, names):
  return set(rt.get_policy(policy).expand(names)[0]) & set(names)


# ====================================================== module-path conventions

class Attention(nn.Module):
  """Projections (each feeding a nonlinearity, so the backward pass needs
  it), a context, and an output projection."""
  projections: tuple[str, ...]
  out: str

  @nn.compact
  def __call__(self, x):
    z = sum(jnp.tanh(nn.Dense(D, kernel_init=cheap_init, name=n)(x))
            for n in self.projections)
    return nn.Dense(D, kernel_init=cheap_init, name=self.out)(jnp.sin(z))


class FeedForward(nn.Module):
  up: str
  down: str

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(2 * D, kernel_init=cheap_init, name=self.up)(x))
    return nn.Dense(D, kernel_init=cheap_init, name=self.down)(h)


class Block(nn.Module):
  attention: str
  projections: tuple[str, ...]
  out: str
  ffn: str
  up: str
  down: str

  @nn.compact
  def __call__(self, x):
    a = Attention(self.projections, self.out, name=self.attention)(
        nn.LayerNorm()(x))
    x = x + jnp.tanh(a)
    f = FeedForward(self.up, self.down, name=self.ffn)(nn.LayerNorm()(x))
    return x + jnp.tanh(f)


#: library -> (attention module, q/k/v projections, output projection,
#: feed-forward module, up projection, down projection), as it names them.
CONVENTIONS = {
    "gemma": ("attn", ("q_einsum", "kv_einsum"), "attn_vec_einsum",
              "mlp", "gating_einsum", "linear"),
    "gemma-fused": ("attn", ("qkv_einsum",), "attn_vec_einsum",
                    "mlp", "gating_einsum", "linear"),
    "distilbert": ("attention", ("q_lin", "k_lin", "v_lin"), "out_lin",
                   "ffn", "lin1", "lin2"),
    "recurrentgemma": ("attention_block", ("proj_q", "proj_k", "proj_v"),
                       "proj_final", "mlp_block", "ffw_up", "ffw_down"),
}


class Model(nn.Module):
  convention: str

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(*CONVENTIONS[self.convention], name=f"layers_{i}")(x)
    return x


def promised(convention):
  """What each built-in promises to keep, written out by hand."""
  attn, qkv, out, ffn, up, down = CONVENTIONS[convention]
  qkv = {f"{attn}/{p}" for p in qkv}
  out, up, down = f"{attn}/{out}", f"{ffn}/{up}", f"{ffn}/{down}"
  return {
      "save-qkv": qkv,
      "save-out-proj": {out},
      "save-attention": {attn, *qkv, out},
      "save-ffn": {ffn, up, down},
      "save-projections": {*qkv, out, up, down},
      "save-out-proj-and-ffn-down": {out, down},
  }


def _model_loss(convention):
  model = rt.remat_modules(Model(convention), {"Block": None})
  params = jax.eval_shape(Model(convention).init, jax.random.key(0), X)
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.1, s.dtype), params)
  return (lambda p: jnp.sin(model.apply(p, X)).sum()), params


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
def test_builtins_select_the_convention_names(convention):
  loss, params = _model_loss(convention)
  names = names_in(loss, params)
  for policy, names_promised in promised(convention).items():
    assert selected(policy, names) == names_promised, policy


@pytest.mark.parametrize("convention", sorted(CONVENTIONS))
@pytest.mark.parametrize("policy", ["save-qkv", "save-attention", "save-ffn",
                                    "save-projections"])
def test_builtins_save_what_jax_saves_by_hand(convention, policy, remat_mode):
  del remat_mode
  loss, params = _model_loss(convention)
  names_promised = promised(convention)[policy]
  ours = kept(loss, (params,), policy)
  assert ours == kept(loss, (params,), by_hand(names_promised))
  # Not vacuous: the promised tensors are among what is saved.
  assert {n.split("/")[0] for n in named(ours)} == {
      n.split("/")[0] for n in names_promised}


# ======================================================= MaxText MoE and MLA

def moe_mla_block(x, p):
  """MaxText's latent attention and mixture-of-experts names, alone (a
  model with only these, no dense q/k/v or FFN names)."""
  name = jax.ad_checkpoint.checkpoint_name
  q = name(jnp.tanh(name(x @ p["qa"], "query_wa_proj")), "mla_q")
  kv = name(jnp.tanh(name(x @ p["kva"], "kv_wa_proj")), "mla_kv")
  h = x + jnp.tanh(jnp.tanh(q) @ p["qb"] + jnp.tanh(kv) @ p["qb"])
  e0 = name(h @ p["ei0"], "moe_mlpwi_0")
  e1 = name(h @ p["ei1"], "moe_mlpwi_1")
  eo = name((jax.nn.silu(e0) * e1) @ p["eo"], "moe_mlpwo")
  return jnp.sum(jnp.sin(h + jnp.tanh(eo)))


_SHAPES = dict(qa=(D, 4), kva=(D, 4), qb=(4, D), ei0=(D, 16), ei1=(D, 16),
               eo=(16, D))
PARAMS = {k: jnp.full(s, 0.1, jnp.float32) for k, s in _SHAPES.items()}
MLA = {"query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv"}
MOE_UP, MOE_DOWN = {"moe_mlpwi_0", "moe_mlpwi_1"}, {"moe_mlpwo"}


@pytest.mark.parametrize("policy,names_promised", [
    ("save-attention", MLA),
    ("save-ffn", MOE_UP | MOE_DOWN),
    ("save-attention-and-ffn-down", MLA | MOE_DOWN),
    ("save-out-proj-and-ffn-down", MOE_DOWN),
])
def test_maxtext_moe_and_mla_names(policy, names_promised, remat_mode):
  del remat_mode
  fn = rt.remat(moe_mla_block)
  ours = kept(fn, (X[0], PARAMS), policy)
  assert ours == kept(fn, (X[0], PARAMS), by_hand(names_promised))
  assert named(ours) == names_promised


def test_maxtext_moe_and_mla_names_are_known():
  assert MLA | MOE_UP | MOE_DOWN <= set(rt.names.MAXTEXT_NAMES)


# ================================================== MaxText's llama2 layer

class AttentionOp(nn.Module):
  """MaxText's dot-product path: ``context`` is named inside the op; the
  op's output (heads merged) is another tensor, held by the output
  projection's weight gradient."""

  @nn.compact
  def __call__(self, q, k, v):
    name = jax.ad_checkpoint.checkpoint_name
    probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
    context = name(jnp.einsum("bhqk,bkhd->bqhd", probs, v), "context")
    return context.reshape(*context.shape[:2], -1)


class LlamaAttention(nn.Module):
  @nn.compact
  def __call__(self, x):
    name = jax.ad_checkpoint.checkpoint_name

    def proj(label, ckpt):
      y = nn.DenseGeneral((2, D // 2), kernel_init=cheap_init, name=label)(x)
      return jnp.tanh(name(y, ckpt))
    q = proj("query", "query_proj")
    k = proj("key", "key_proj")
    v = proj("value", "value_proj")
    out = AttentionOp(name="attention_op")(q, k, v)
    return name(nn.Dense(D, kernel_init=cheap_init, name="out")(out),
                "out_proj")


class LlamaMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    name = jax.ad_checkpoint.checkpoint_name
    wi0 = name(nn.Dense(16, kernel_init=cheap_init, name="wi_0")(x), "mlpwi_0")
    wi1 = name(nn.Dense(16, kernel_init=cheap_init, name="wi_1")(x), "mlpwi_1")
    return name(nn.Dense(D, kernel_init=cheap_init, name="wo")(
        nn.silu(wi0) * wi1), "mlpwo")


class LlamaDecoderLayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    name = jax.ad_checkpoint.checkpoint_name
    x = name(x, "decoder_layer_input")
    h = x + jnp.tanh(LlamaAttention(name="self_attention")(
        nn.RMSNorm(name="pre_self_attention_layer_norm")(x)))
    return h + jnp.tanh(LlamaMlp(name="mlp")(
        nn.RMSNorm(name="post_self_attention_layer_norm")(h)))


class LlamaDecoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = LlamaDecoderLayer(name=f"layers_{i}")(x)
    return x


#: MaxText's save_dot_with_context_except_mlp, as MaxText writes it.
MAXTEXT_SAVE_DOT_WITH_CONTEXT = cp.save_only_these_names(
    "query_proj", "value_proj", "key_proj", "qkv_proj", "context", "out_proj")


def _llama_loss():
  model = rt.remat_modules(LlamaDecoder(), {"LlamaDecoderLayer": None})
  params = jax.eval_shape(LlamaDecoder().init, jax.random.key(0), X)
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.1, s.dtype), params)
  return (lambda p: jnp.sin(model.apply(p, X)).sum()), params


def test_maxtext_alias_saves_what_maxtext_saves(remat_mode):
  del remat_mode
  loss, params = _llama_loss()
  ours = kept(loss, (params,), "save_dot_with_context_except_mlp")
  theirs = kept(loss, (params,), rt.Policy.from_jax(
      MAXTEXT_SAVE_DOT_WITH_CONTEXT))
  assert ours == theirs
  assert "context" in named(ours)


def test_one_meaning_of_context(remat_mode):
  """Every built-in keeping the context keeps the named one, not the
  attention op's output as well."""
  del remat_mode
  loss, params = _llama_loss()
  for policy in ("save-attention", "save-projections-and-context",
                 "praxis-save-context", "save_dot_with_context_except_mlp"):
    saved = named(kept(loss, (params,), policy))
    assert "context" in saved, policy
    assert not any("attention_op" in n for n in saved), (policy, saved)


# ==================================================== squeeze-and-excitation

def _regnet():
  transformers = pytest.importorskip("transformers")
  config = transformers.RegNetConfig(
      num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
      groups_width=8, layer_type="y")
  module = transformers.FlaxRegNetModel(config, _do_init=False).module
  pixels = jnp.asarray(np.random.RandomState(0).standard_normal(
      (1, 16, 16, 3)), jnp.float32)
  model = rt.remat_modules(module, {"FlaxRegNetYLayer": None})
  params = jax.eval_shape(module.init, jax.random.key(0), pixels)

  def loss(p):
    return jnp.mean(jnp.square(model.apply(p, pixels)[0]))
  return loss, params


@pytest.mark.slow
def test_save_attention_keeps_no_squeeze_and_excitation_gate(remat_mode):
  del remat_mode
  loss, params = _regnet()
  names = names_in(loss, params)
  gates = {n for n in names if "attention" in n}
  assert gates, "the model must have the gate this test is about"
  assert not selected("save-attention", names)
  assert kept(loss, (params,), "save-attention") == kept(
      loss, (params,), "boundary-only")
