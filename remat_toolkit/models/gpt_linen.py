"""The GPT-style decoder in Flax linen.

Module paths read ``layers_3/attn/query`` (``layers/attn/query`` when the
blocks are scanned); every tensor a policy may keep is tagged with the names
of :data:`remat_toolkit.VOCABULARY`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit import models
  >>> model = models.GPT(models.get_config("tiny"))
  >>> tokens = jnp.zeros((2, 16), jnp.int32)
  >>> params = model.init(jax.random.key(0), tokens)
  >>> model.apply(params, tokens).shape
  (2, 16, 64)
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from remat_toolkit._src.policies.tags import tag
from remat_toolkit._src.transform.grouping import group_size
from remat_toolkit._src.transform.grouping import remat_chain
from remat_toolkit._src.transform.grouping import scan_layers
from remat_toolkit._src.transform.remat import remat
from remat_toolkit.models import common
from remat_toolkit.models.configs import GPTConfig

__all__ = ["GPT", "Block", "Attention", "MLP", "make_norm"]

_init = nn.initializers.normal(common.INIT_STDDEV)


def _dense(config: GPTConfig, features: int, name: str,
           use_bias: bool = True) -> nn.Dense:
  return nn.Dense(features, use_bias=use_bias and config.use_bias,
                  kernel_init=_init, dtype=config.activation_dtype,
                  param_dtype=config.parameter_dtype, name=name)


def make_norm(config: GPTConfig, name: str) -> nn.Module:
  """LayerNorm or RMSNorm as the config says."""
  cls = nn.LayerNorm if config.norm == "layernorm" else nn.RMSNorm
  return cls(epsilon=config.norm_eps, dtype=config.activation_dtype,
             param_dtype=config.parameter_dtype, name=name)


class Attention(nn.Module):
  """Causal multi-head self-attention with separate q/k/v projections.

  The core between the projections is ``config.attention`` (naive,
  ``dot_product`` or ``flash``; see :func:`remat_toolkit.models.common.attend`).
  """

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    cfg = self.config
    heads = functools.partial(common.split_heads, num_heads=cfg.num_heads)
    q = tag(heads(_dense(cfg, cfg.d_model, "query")(x)), "attn.q")
    k = tag(heads(_dense(cfg, cfg.d_model, "key")(x)), "attn.k")
    v = tag(heads(_dense(cfg, cfg.d_model, "value")(x)), "attn.v")
    if cfg.positions == "rope":
      q, k = common.rotary(q), common.rotary(k)
    common.check_attention_dropout(cfg, deterministic)
    dropout = nn.Dropout(cfg.dropout_rate)
    context = common.attend(
        q, k, v, cfg, dropout=lambda p: dropout(p, deterministic=deterministic))
    return tag(_dense(cfg, cfg.d_model, "out")(context), "attn.out")


class MLP(nn.Module):
  """GELU MLP (up, GELU, down) or SwiGLU (``silu(gate) * up``, down)."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    del deterministic  # dropout is applied on the residual branch, in Block
    cfg = self.config
    up = tag(_dense(cfg, cfg.d_ff, "up")(x), "ffn.up")
    gate = None
    if cfg.ffn == "swiglu":
      gate = tag(_dense(cfg, cfg.d_ff, "gate")(x), "ffn.gate")
    act = common.ffn_activation(up, gate)
    return tag(_dense(cfg, cfg.d_model, "down")(act), "ffn.down")


class Block(nn.Module):
  """Pre-norm decoder block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    cfg = self.config
    x = tag(x, "block.input")
    h = tag(make_norm(cfg, "ln1")(x), "attn.norm")
    h = Attention(cfg, name="attn")(h, deterministic)
    x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    h = tag(make_norm(cfg, "ln2")(x), "ffn.norm")
    h = MLP(cfg, name="mlp")(h, deterministic)
    x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    return tag(x, "block.output")


class GPT(nn.Module):
  """Token (+ learned position) embedding, blocks, final norm, LM head.

  The blocks are ``layers_0 .. layers_{L-1}``, or one scanned ``layers``
  module with stacked parameters when ``config.scan_layers``. With
  ``config.remat`` each run of ``config.remat_group`` blocks is one remat
  region whose policy is ``config.remat_policy`` (None: the ambient policy,
  read at trace time). The LM head is the transposed token embedding when
  ``config.tie_embeddings``, else a separate ``lm_head``.

  Dropout needs a ``'dropout'`` rng when ``deterministic=False``.
  """

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, deterministic: bool = True
               ) -> jax.Array:
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init,
                     dtype=cfg.activation_dtype,
                     param_dtype=cfg.parameter_dtype, name="embed")
    x = embed(tokens)
    if cfg.positions == "learned":
      positions = nn.Embed(cfg.seq_len, cfg.d_model, embedding_init=_init,
                           dtype=cfg.activation_dtype,
                           param_dtype=cfg.parameter_dtype, name="pos_embed")
      x = x + positions(jnp.arange(tokens.shape[1]))[None]
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    x = self._blocks(x, deterministic)
    x = make_norm(cfg, "ln_f")(x)
    if cfg.tie_embeddings:
      return embed.attend(x)
    return _dense(cfg, cfg.vocab_size, "lm_head", use_bias=False)(x)

  @nn.nowrap
  def _blocks(self, x: jax.Array, deterministic: bool) -> jax.Array:
    cfg = self.config
    if cfg.scan_layers:
      stack = scan_layers(Block, cfg.num_layers, policy=cfg.remat_policy,
                          group=cfg.remat_group, remat=cfg.remat)
      return stack(cfg, name="layers")(x, deterministic)
    size = group_size(cfg.remat_group, cfg.num_layers)
    if cfg.remat and size == 1:
      # One region per block, lifted on the block class itself: module
      # paths stay ``layers_3/attn``.
      block_cls = remat(Block, cfg.remat_policy)
    else:
      block_cls = Block
    blocks = [block_cls(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
    if cfg.remat and size > 1:
      return remat_chain(blocks, x, group=size, policy=cfg.remat_policy,
                         deterministic=deterministic)
    for block in blocks:
      x = block(x, deterministic)
    return x
