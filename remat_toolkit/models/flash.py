"""Blockwise (flash) attention as a ``jax.custom_vjp`` kernel that runs on a CPU.

The forward pass scans over blocks of keys keeping, per query, a running
maximum and sum of the exponentiated logits (the online softmax of
FlashAttention-2), so no ``seq x seq`` tensor is kept: the residuals are
exactly q, k, v, the output and the float32 log-sum-exp ``[batch, heads,
seq]``. The backward pass scans over the same blocks, recomputing each
block's probabilities from q, k and the log-sum-exp, and returns dq, dk, dv.

Why a ``custom_vjp`` and not Pallas in interpret mode: it traces and runs
with every JAX release this package supports (0.10 to 0.12) and on
``jax.ShapeDtypeStruct`` inputs on a laptop, while Pallas' GPU and TPU
kernels move between releases and only the GPU one runs interpreted; and it
keeps the same residuals as the production kernels (Pallas flash and splash
attention, cuDNN): q, k, v, the output and the log-sum-exp. What a remat
policy keeps of it is therefore what it keeps of theirs.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit.models import flash
  >>> q = jnp.ones((1, 8, 2, 4))  # [batch, seq, heads, head_dim]
  >>> flash.flash_attention(q, q, q, block_size=4).shape
  (1, 8, 2, 4)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from remat_toolkit._src.policies.kernels import tag_residuals

__all__ = ["flash_attention", "make_flash_kernel", "DEFAULT_BLOCK_SIZE"]

#: Keys per block when none is given (FlashAttention-2's usual tile).
DEFAULT_BLOCK_SIZE = 128

Kernel = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                    block_size: int = DEFAULT_BLOCK_SIZE, causal: bool = True,
                    residual_name: str | None = None) -> jax.Array:
  """Softmax attention computed block by block, with a memory-efficient VJP.

  Args:
    q: queries ``[batch, seq, heads, head_dim]``.
    k: keys, same shape.
    v: values, same shape.
    block_size: keys per block; a sequence it does not divide is padded
      (the padded keys are masked out). Capped at the sequence length.
    causal: mask out keys after each query.
    residual_name: a checkpoint name for the residuals the kernel computes
      (the output and the log-sum-exp), as splash attention's
      ``residual_checkpoint_name``; q, k and v are the caller's to name.
      See :func:`remat_toolkit.tag_residuals`.

  Returns:
    The context ``[batch, seq, heads, head_dim]`` in ``q.dtype``.

  Raises:
    ValueError: q, k and v differ in shape or are not rank 4, or
      ``block_size`` is not a positive integer.
  """
  if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
    raise ValueError(
        f"flash_attention takes q, k, v of one shape [batch, seq, heads, "
        f"head_dim], got {q.shape}, {k.shape}, {v.shape}.")
  kernel = make_flash_kernel(block_size=min(_block(block_size), q.shape[1]),
                             causal=causal)
  if residual_name is not None:
    kernel = tag_residuals(kernel, residual_name)
  return kernel(q, k, v)


def make_flash_kernel(*, block_size: int = DEFAULT_BLOCK_SIZE,
                      causal: bool = True) -> Kernel:
  """The ``jax.custom_vjp`` kernel ``(q, k, v) -> context``, unnamed.

  Made anew on each call (:func:`flash_attention` makes one per call): on
  releases where ``jax.custom_vjp`` reads ``jax_custom_vjp3`` when it is
  made (0.10), a kernel made at trace time follows the setting in force
  then.

  Args:
    block_size: keys per block.
    causal: mask out keys after each query.

  Returns:
    The kernel, a ``jax.custom_vjp`` function of q, k, v.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from remat_toolkit.models import flash
    >>> kernel = flash.make_flash_kernel(block_size=2)
    >>> x = jnp.ones((1, 4, 1, 2))
    >>> jax.grad(lambda q: kernel(q, x, x).sum())(x).shape
    (1, 4, 1, 2)
  """
  block_size = _block(block_size)

  @jax.custom_vjp
  def flash_attention_kernel(q, k, v):
    return _forward(q, k, v, block_size, causal)[0]

  def flash_fwd(q, k, v):
    out, lse = _forward(q, k, v, block_size, causal)
    return out, (q, k, v, out, lse)

  def flash_bwd(residuals, g):
    q, k, v, out, lse = residuals
    return _backward(q, k, v, out, lse, g, block_size, causal)

  flash_attention_kernel.defvjp(flash_fwd, flash_bwd)
  return flash_attention_kernel


def _block(block_size: int) -> int:
  if (isinstance(block_size, bool) or not isinstance(block_size, int)
      or block_size < 1):
    raise ValueError(
        f"flash attention block_size must be a positive integer, got "
        f"{block_size!r}.")
  return block_size


def _key_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``[b, s, h, d] -> [blocks, b, block, h, d]``, zero-padded to whole blocks."""
  batch, seq, heads, head_dim = x.shape
  blocks = math.ceil(seq / block_size)
  x = jnp.pad(x, ((0, 0), (0, blocks * block_size - seq), (0, 0), (0, 0)))
  x = x.reshape(batch, blocks, block_size, heads, head_dim)
  return jnp.moveaxis(x, 1, 0)


def _visible(block_index: jax.Array, seq: int, block_size: int,
             causal: bool) -> jax.Array:
  """``[seq, block]``: which keys of the block each query may attend to."""
  keys = block_index * block_size + jnp.arange(block_size)
  visible = (keys < seq)[None, :]  # padded keys are never visible
  if causal:
    visible = visible & (keys[None, :] <= jnp.arange(seq)[:, None])
  return visible[None, None]  # [1, 1, seq, block]: broadcast over b, h


def _logits(q: jax.Array, k_block: jax.Array) -> jax.Array:
  """``[b, h, seq, block]`` float32 logits, scaled by ``head_dim ** -0.5``."""
  scale = q.shape[-1] ** -0.5
  return jnp.einsum("bqhd,bkhd->bhqk", q, k_block,
                    preferred_element_type=jnp.float32) * scale


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, block_size: int,
             causal: bool) -> tuple[jax.Array, jax.Array]:
  batch, seq, heads, head_dim = q.shape
  k_blocks, v_blocks = _key_blocks(k, block_size), _key_blocks(v, block_size)
  lowest = jnp.finfo(jnp.float32).min

  def step(carry, block):
    row_max, row_sum, acc = carry
    index, k_block, v_block = block
    visible = _visible(index, seq, block_size, causal)
    logits = jnp.where(visible, _logits(q, k_block), lowest)
    new_max = jnp.maximum(row_max, logits.max(axis=-1))
    probs = jnp.where(visible, jnp.exp(logits - new_max[..., None]), 0.0)
    rescale = jnp.exp(row_max - new_max)
    row_sum = rescale * row_sum + probs.sum(axis=-1)
    acc = rescale[..., None] * acc + jnp.einsum(
        "bhqk,bkhd->bhqd", probs.astype(v.dtype), v_block,
        preferred_element_type=jnp.float32)
    return (new_max, row_sum, acc), None

  stats = jnp.full((batch, heads, seq), lowest, jnp.float32)
  init = (stats, jnp.zeros_like(stats),
          jnp.zeros((batch, heads, seq, head_dim), jnp.float32))
  indices = jnp.arange(k_blocks.shape[0])
  (row_max, row_sum, acc), _ = jax.lax.scan(
      step, init, (indices, k_blocks, v_blocks))
  out = jnp.einsum("bhqd->bqhd", acc / row_sum[..., None]).astype(q.dtype)
  return out, row_max + jnp.log(row_sum)


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array,
              lse: jax.Array, g: jax.Array, block_size: int, causal: bool
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  seq = q.shape[1]
  scale = q.shape[-1] ** -0.5
  k_blocks, v_blocks = _key_blocks(k, block_size), _key_blocks(v, block_size)
  # FlashAttention-2's D: rowsum(dO * O), [b, h, seq].
  delta = jnp.einsum("bqhd,bqhd->bhq", g.astype(jnp.float32),
                     out.astype(jnp.float32))

  def step(dq, block):
    index, k_block, v_block = block
    visible = _visible(index, seq, block_size, causal)
    probs = jnp.where(visible, jnp.exp(_logits(q, k_block) - lse[..., None]),
                      0.0)
    dv = jnp.einsum("bhqk,bqhd->bkhd", probs.astype(g.dtype), g,
                    preferred_element_type=jnp.float32)
    dprobs = jnp.einsum("bqhd,bkhd->bhqk", g, v_block,
                        preferred_element_type=jnp.float32)
    dlogits = probs * (dprobs - delta[..., None]) * scale
    dq = dq + jnp.einsum("bhqk,bkhd->bqhd", dlogits.astype(k.dtype), k_block,
                         preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhqk,bqhd->bkhd", dlogits.astype(q.dtype), q,
                    preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  indices = jnp.arange(k_blocks.shape[0])
  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(q.shape, jnp.float32),
                              (indices, k_blocks, v_blocks))

  def unblock(x: jax.Array) -> jax.Array:  # [blocks, b, block, h, d]
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :seq]

  return (dq.astype(q.dtype), unblock(dk).astype(k.dtype),
          unblock(dv).astype(v.dtype))
