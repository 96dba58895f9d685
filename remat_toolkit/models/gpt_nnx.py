"""The GPT-style decoder in Flax NNX, the twin of :mod:`.gpt_linen`.

Same submodule names (``layers[3].attn.query``), same tags, same parameter
shapes; the blocks live in an ``nnx.List`` or, scanned, in one stacked
module (``layers.blocks``). Dropout draws from the model's ``dropout`` rng
stream (see :func:`reseed_dropout`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from remat_toolkit import models
  >>> model = models.NNXGPT(models.get_config("tiny"), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 64)
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from remat_toolkit._src.policies.tags import tag
from remat_toolkit._src.transform.grouping import remat_chain
from remat_toolkit._src.transform.grouping import scan_layers
from remat_toolkit._src.transform.nnx_paths import name_nnx_modules
from remat_toolkit.models import common
from remat_toolkit.models.configs import GPTConfig

__all__ = ["NNXGPT", "NNXBlock", "NNXAttention", "NNXMLP", "reseed_dropout"]

_init = nnx.initializers.normal(common.INIT_STDDEV)


def _linear(config: GPTConfig, d_in: int, d_out: int, rngs: nnx.Rngs,
            use_bias: bool = True) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=use_bias and config.use_bias,
                    kernel_init=_init, dtype=config.activation_dtype,
                    param_dtype=config.parameter_dtype, rngs=rngs)


def _norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
  cls = nnx.LayerNorm if config.norm == "layernorm" else nnx.RMSNorm
  return cls(config.d_model, epsilon=config.norm_eps,
             dtype=config.activation_dtype,
             param_dtype=config.parameter_dtype, rngs=rngs)


class NNXAttention(nnx.Module):
  """Causal multi-head self-attention with separate q/k/v projections.

  The core between the projections is ``config.attention`` (naive,
  ``dot_product`` or ``flash``; see :func:`remat_toolkit.models.common.attend`).
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    d = config.d_model
    self.query = _linear(config, d, d, rngs)
    self.key = _linear(config, d, d, rngs)
    self.value = _linear(config, d, d, rngs)
    self.out = _linear(config, d, d, rngs)
    self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    cfg = self.config
    heads = functools.partial(common.split_heads, num_heads=cfg.num_heads)
    q = tag(heads(self.query(x)), "attn.q")
    k = tag(heads(self.key(x)), "attn.k")
    v = tag(heads(self.value(x)), "attn.v")
    if cfg.positions == "rope":
      q, k = common.rotary(q), common.rotary(k)
    common.check_attention_dropout(cfg, deterministic)
    context = common.attend(
        q, k, v, cfg,
        dropout=lambda p: self.dropout(p, deterministic=deterministic))
    return tag(self.out(context), "attn.out")


class NNXMLP(nnx.Module):
  """GELU MLP or SwiGLU, as :class:`remat_toolkit.models.MLP`."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.up = _linear(config, config.d_model, config.d_ff, rngs)
    self.gate = (_linear(config, config.d_model, config.d_ff, rngs)
                 if config.ffn == "swiglu" else None)
    self.down = _linear(config, config.d_ff, config.d_model, rngs)

  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    del deterministic  # dropout is applied on the residual branch
    up = tag(self.up(x), "ffn.up")
    gate = None if self.gate is None else tag(self.gate(x), "ffn.gate")
    return tag(self.down(common.ffn_activation(up, gate)), "ffn.down")


class NNXBlock(nnx.Module):
  """Pre-norm decoder block, as :class:`remat_toolkit.models.Block`."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.ln1 = _norm(config, rngs)
    self.attn = NNXAttention(config, rngs=rngs)
    self.ln2 = _norm(config, rngs)
    self.mlp = NNXMLP(config, rngs=rngs)
    self.attn_dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)
    self.mlp_dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

  def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
    x = tag(x, "block.input")
    h = self.attn(tag(self.ln1(x), "attn.norm"), deterministic)
    x = x + self.attn_dropout(h, deterministic=deterministic)
    h = self.mlp(tag(self.ln2(x), "ffn.norm"), deterministic)
    x = x + self.mlp_dropout(h, deterministic=deterministic)
    return tag(x, "block.output")


class NNXGPT(nnx.Module):
  """Token (+ learned position) embedding, blocks, final norm, LM head.

  Blocks are ``layers[0] .. layers[L-1]`` (an ``nnx.List``), or one scanned
  module ``layers`` whose ``blocks`` hold stacked state when
  ``config.scan_layers``. Remat layout and policy as in
  :class:`remat_toolkit.models.GPT`.

  Args:
    config: the model's :class:`GPTConfig`.
    rngs: ``nnx.Rngs`` with a ``params`` stream and, for dropout, a
      ``dropout`` stream.
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype, param_dtype = config.activation_dtype, config.parameter_dtype
    self.embed = nnx.Embed(config.vocab_size, config.d_model,
                           embedding_init=_init, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
    self.pos_embed = (
        nnx.Embed(config.seq_len, config.d_model, embedding_init=_init,
                  dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.positions == "learned" else None)
    self.embed_dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)
    if config.scan_layers:
      stack = scan_layers(NNXBlock, config.num_layers,
                              policy=config.remat_policy,
                              group=config.remat_group, remat=config.remat)
      self.layers = stack(config, rngs=rngs)
    else:
      self.layers = nnx.List(
          [NNXBlock(config, rngs=rngs) for _ in range(config.num_layers)])
    self.ln_f = _norm(config, rngs)
    self.lm_head = (None if config.tie_embeddings else
                    _linear(config, config.d_model, config.vocab_size, rngs,
                            use_bias=False))
    # NNX pushes no module scopes; this gives the analyzer linen's paths
    # (``layers/0/attn/query`` like ``layers_0/attn/query``).
    name_nnx_modules(self)

  def __call__(self, tokens: jax.Array, deterministic: bool = True
               ) -> jax.Array:
    x = self.embed(tokens)
    if self.pos_embed is not None:
      x = x + self.pos_embed(jnp.arange(tokens.shape[1]))[None]
    x = self.embed_dropout(x, deterministic=deterministic)
    x = self._blocks(x, deterministic)
    x = self.ln_f(x)
    if self.lm_head is None:
      return self.embed.attend(x)
    return self.lm_head(x)

  def _blocks(self, x: jax.Array, deterministic: bool) -> jax.Array:
    cfg = self.config
    if cfg.scan_layers:
      return self.layers(x, deterministic)
    if cfg.remat:
      return remat_chain(list(self.layers), x, group=cfg.remat_group,
                         policy=cfg.remat_policy, deterministic=deterministic)
    for block in self.layers:
      x = block(x, deterministic)
    return x


def _path_keyed(path: tuple[Any, ...], key: jax.Array,
                shape: tuple[int, ...]) -> jax.Array:
  # One key per stream: fold in a stable hash of the stream's path, then
  # split for stacked (scanned) streams.
  salt = zlib.crc32("/".join(str(p) for p in path).encode()) & 0x7FFFFFFF
  key = jax.random.fold_in(key, salt)
  if not shape:
    return key
  return jax.random.split(key, math.prod(shape)).reshape(shape)


def reseed_dropout(model: nnx.Module, key: jax.Array) -> None:
  """Re-keys every ``dropout`` stream of ``model`` from one key.

  Each stream gets its own key derived from ``key`` and the stream's path
  (stacked streams of scanned blocks are split per layer), so one key fixes
  every dropout mask of a step. Used by :func:`build_loss` with
  ``dropout=True``.

  Args:
    model: an NNX module.
    key: a ``jax.random.key``.
  """
  nnx.reseed(model, dropout=key, policy=_path_keyed)
