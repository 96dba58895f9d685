"""Framework-free pieces of the GPT decoder shared by the linen and NNX code.

Each function tags the tensors a remat policy may keep, with the names of
:data:`remat_toolkit.VOCABULARY`, so the two implementations save exactly the
same things under the same policy.

Example:
  >>> import jax.numpy as jnp
  >>> from remat_toolkit.models import common
  >>> logits, targets = jnp.zeros((1, 3, 4)), jnp.zeros((1, 3), jnp.int32)
  >>> round(float(common.next_token_loss(logits, targets)), 4)
  1.3863
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from remat_toolkit._src.policies.tags import tag
from remat_toolkit.models import flash
from remat_toolkit.models.configs import GPTConfig

__all__ = ["attention_core", "attend", "check_attention_dropout", "rotary",
           "next_token_loss", "split_heads", "ffn_activation", "INIT_STDDEV"]

#: Standard deviation of the normal initialiser of every weight (GPT-2).
INIT_STDDEV = 0.02


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
  """``[batch, seq, d_model] -> [batch, seq, heads, head_dim]``."""
  batch, seq, width = x.shape
  return x.reshape(batch, seq, num_heads, width // num_heads)


def rotary(x: jax.Array, *, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding (RoPE) of ``[batch, seq, heads, head_dim]``.

  Positions are ``0 .. seq - 1``; the two halves of ``head_dim`` are rotated
  as pairs. Computed in float32 and returned in ``x.dtype``.
  """
  seq, head_dim = x.shape[1], x.shape[-1]
  half = head_dim // 2
  inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  # [seq, half] -> [1, seq, 1, half]: explicit ranks, no implicit promotion.
  sin = jnp.sin(angles)[None, :, None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, *,
                   dropout: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """Causal softmax attention, tagged ``attn.scores/probs/context``.

  Args:
    q: queries ``[batch, seq, heads, head_dim]``.
    k: keys, same shape.
    v: values, same shape.
    dropout: applied to the probabilities (identity when deterministic).

  Returns:
    The context ``[batch, seq, heads * head_dim]`` in ``q.dtype``.
  """
  batch, seq, heads, head_dim = q.shape
  scale = jnp.asarray(head_dim ** -0.5, q.dtype)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q * scale, k)
  scores = tag(scores, "attn.scores")
  causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
  # Softmax in float32: bf16 logits lose too much precision in exp/sum.
  logits = jnp.where(causal, scores.astype(jnp.float32),
                     jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  probs = tag(dropout(probs), "attn.probs")
  context = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  return tag(context.reshape(batch, seq, heads * head_dim), "attn.context")


def attend(q: jax.Array, k: jax.Array, v: jax.Array, config: GPTConfig, *,
           dropout: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """Causal attention with the core ``config.attention`` names.

  ``naive`` is :func:`attention_core`. ``dot_product`` is
  ``jax.nn.dot_product_attention`` (XLA's path; its internals carry no
  names), its output tagged ``attn.context``. ``flash`` is the blockwise
  kernel of :mod:`remat_toolkit.models.flash` with its computed residuals
  (the output and the log-sum-exp) named ``attn.context`` inside its forward
  rule, so a policy that keeps the context keeps them and the kernel does not
  run again in the backward pass; its output already carries the name.

  Args:
    q: queries ``[batch, seq, heads, head_dim]``.
    k: keys, same shape.
    v: values, same shape.
    config: says the core and the flash kernel's block size.
    dropout: applied to the probabilities; only the naive core has them
      (see :func:`check_attention_dropout`).

  Returns:
    The context ``[batch, seq, heads * head_dim]`` in ``q.dtype``.
  """
  if config.attention == "naive":
    return attention_core(q, k, v, dropout=dropout)
  if config.attention == "dot_product":
    context = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return tag(_merge_heads(context), "attn.context")
  context = flash.flash_attention(q, k, v, block_size=config.flash_block_size,
                                  residual_name="attn.context")
  return _merge_heads(context)


def check_attention_dropout(config: GPTConfig, deterministic: bool) -> None:
  """Refuses attention dropout with a core that has no probabilities to drop.

  Raises:
    ValueError: dropout is on (``deterministic=False`` and a non-zero
      ``dropout_rate``) and ``config.attention`` is not ``"naive"``.
  """
  if config.attention != "naive" and not deterministic and config.dropout_rate:
    raise ValueError(
        f"attention={config.attention!r} has no attention dropout (the kernel "
        f"never forms the probabilities), but dropout is on with dropout_rate="
        f"{config.dropout_rate}; use attention='naive', or turn dropout off "
        "(dropout=False, or dropout_rate=0.0).")


def _merge_heads(x: jax.Array) -> jax.Array:
  """``[batch, seq, heads, head_dim] -> [batch, seq, heads * head_dim]``."""
  batch, seq, heads, head_dim = x.shape
  return x.reshape(batch, seq, heads * head_dim)


def ffn_activation(up: jax.Array, gate: jax.Array | None) -> jax.Array:
  """GELU of ``up``, or SwiGLU ``silu(gate) * up``; tagged ``ffn.act``."""
  if gate is None:
    return tag(jax.nn.gelu(up), "ffn.act")
  return tag(jax.nn.silu(gate) * up, "ffn.act")


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy in float32.

  Args:
    logits: ``[batch, seq, vocab]`` (any float dtype).
    targets: ``[batch, seq]`` integer token ids.

  Returns:
    A float32 scalar.
  """
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32),
                               axis=-1)
  return -jnp.mean(picked)
