"""Checkpoint-name vocabulary for transformer blocks, and :func:`tag`.

A *tag* is a ``jax.ad_checkpoint.checkpoint_name``: an identity in the forward
pass that gives a tensor a name a remat policy can select. Tagging the same
tensors the same way in every model lets one catalogue of named policies work
on all of them.

Example:
  >>> import jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> y = rt.tag(jnp.ones(3), "ffn.up")
  >>> "ffn.up" in rt.names.VOCABULARY
  True
"""

from __future__ import annotations

import threading
from typing import Any

from jax.ad_checkpoint import checkpoint_name

__all__ = ["VOCABULARY", "MAXTEXT_NAMES", "tag", "known_names"]

VOCABULARY: dict[str, str] = {
    "block.input": "input of a block (the residual stream entering it)",
    "block.output": "output of a block",
    "attn.norm": "normalised input of the attention sub-block",
    "attn.q": "query projection",
    "attn.k": "key projection",
    "attn.v": "value projection",
    "attn.qkv": "fused query/key/value projection",
    "attn.scores": "attention logits, q @ k^T (seq x seq per head)",
    "attn.probs": "attention probabilities after softmax (and dropout)",
    "attn.context": "probs @ v, before the output projection",
    "attn.out": "attention output projection",
    "ffn.norm": "normalised input of the feed-forward sub-block",
    "ffn.up": "feed-forward up projection",
    "ffn.gate": "feed-forward gate projection (SwiGLU/GeGLU)",
    "ffn.act": "feed-forward activation output",
    "ffn.down": "feed-forward down projection",
}
"""Names for the tensors of a transformer block, with what each one is."""

MAXTEXT_NAMES: tuple[str, ...] = (
    "decoder_layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
    "qkv_proj",
    "kv_proj",
    "out_proj",
    "context",
    "attention_out",
    "mlpwi",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    # Mixture of experts: stacked on the dense names (mlpwi_0, ..., mlpwo).
    "moe_mlpwi_0",
    "moe_mlpwi_1",
    "moe_mlpwo",
    # Multi-head latent attention: the low-rank q and kv projections, and
    # the normalised latents.
    "query_wa_proj",
    "kv_wa_proj",
    "mla_q",
    "mla_kv",
)
"""Checkpoint names used by MaxText models; built-in policies match them too."""

_seen_lock = threading.Lock()
_seen_names: set[str] = set()


def tag(x: Any, name: str) -> Any:
  """Names ``x`` (an array or pytree of arrays) so that policies can select it.

  Args:
    x: the value to name; returned unchanged.
    name: a checkpoint name, ideally one of :data:`VOCABULARY`.

  Returns:
    ``x``, carrying the name in the traced program.

  Raises:
    TypeError: if ``name`` is not a non-empty string.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> f = lambda x: jnp.sin(rt.tag(x * 2, "ffn.up")).sum()
    >>> float(jax.grad(f)(jnp.zeros(())))
    2.0
  """
  if not isinstance(name, str) or not name:
    raise TypeError(
        f"tag name must be a non-empty string, got {name!r}; "
        "use one of remat_toolkit.names.VOCABULARY, e.g. 'ffn.up'.")
  with _seen_lock:
    _seen_names.add(name)
  return checkpoint_name(x, name)


def known_names() -> frozenset[str]:
  """Every name a policy pattern can be expanded against without a trace.

  The vocabulary, the MaxText names and every name :func:`tag` has been
  called with in this process.
  """
  with _seen_lock:
    seen = frozenset(_seen_names)
  return frozenset(VOCABULARY) | frozenset(MAXTEXT_NAMES) | seen
