"""Named configurations of the built-in GPT-style decoder.

A :class:`GPTConfig` is a frozen value: it says the model's shape, the dtypes,
and how the layers are laid out for remat (unrolled or scanned, how many
blocks per remat region). :func:`get_config` returns a named one, optionally
with fields overridden.

Example:
  >>> from remat_toolkit import models
  >>> cfg = models.get_config("gpt2-small", seq_len=128)
  >>> cfg.num_layers, cfg.d_model, cfg.seq_len
  (12, 768, 128)
  >>> cfg.head_dim
  64
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax.numpy as jnp

from remat_toolkit.models.flash import DEFAULT_BLOCK_SIZE

__all__ = ["GPTConfig", "CONFIGS", "get_config", "list_configs", "FFN_KINDS",
           "POSITION_KINDS", "NORM_KINDS", "ATTENTION_KINDS"]

#: Feed-forward variants: ``gelu`` (up, GELU, down) or ``swiglu``
#: (``silu(gate) * up``, down).
FFN_KINDS: tuple[str, ...] = ("gelu", "swiglu")
#: Position encodings: learned absolute embeddings or rotary (RoPE) on q and k.
POSITION_KINDS: tuple[str, ...] = ("learned", "rope")
#: Normalisation layers: ``layernorm`` (scale and bias) or ``rmsnorm``.
NORM_KINDS: tuple[str, ...] = ("layernorm", "rmsnorm")
#: Attention cores: ``naive`` (softmax of the full ``seq x seq`` logits,
#: tagged ``attn.scores`` / ``attn.probs`` / ``attn.context``),
#: ``dot_product`` (``jax.nn.dot_product_attention``, its XLA path) or
#: ``flash`` (a blockwise ``custom_vjp`` kernel keeping q, k, v, the output and
#: the log-sum-exp, see :mod:`remat_toolkit.models.flash`).
ATTENTION_KINDS: tuple[str, ...] = ("naive", "dot_product", "flash")
"""Values of ``GPTConfig.attention`` and ``build_loss(attention=...)``: the
full softmax core (``naive``), ``jax.nn.dot_product_attention``
(``dot_product``) and the blockwise kernel of :mod:`remat_toolkit.models.flash`
(``flash``)."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape, dtypes and layer layout of a GPT-style decoder.

  Attributes:
    name: the config's name.
    vocab_size: number of tokens.
    num_layers: number of decoder blocks.
    d_model: hidden size.
    num_heads: attention heads; must divide ``d_model``.
    d_ff: feed-forward hidden size.
    seq_len: default sequence length (also the size of learned positions).
    batch_size: default (micro-)batch size.
    ffn: ``"gelu"`` or ``"swiglu"``.
    positions: ``"learned"`` or ``"rope"``.
    norm: ``"layernorm"`` or ``"rmsnorm"``.
    tie_embeddings: the LM head reuses the token embedding (GPT-2) instead of
      a separate ``lm_head`` projection (LLaMA).
    use_bias: whether the projections have biases (GPT-2) or not (LLaMA).
    dropout_rate: dropout on embeddings, attention probabilities and both
      residual branches; only active when the model is called with
      ``deterministic=False``.
    dtype: activation (computation) dtype, e.g. ``"bfloat16"``.
    param_dtype: parameter dtype.
    scan_layers: apply the blocks with ``scan`` (params stacked) instead of
      a Python loop.
    remat: put the blocks in remat regions; False is the no-remat baseline.
    remat_group: blocks per remat region (``"sqrt"`` for about sqrt(L)).
    remat_policy: the regions' policy name; None reads the ambient policy
      (``rt.use_policy``) at trace time. With ``scan_layers`` it may name a
      per-region policy (a registered per-layer plan of the unrolled model):
      the stack then runs as consecutive scans of equal policy, with one
      parameter stack per run (``layers/run_0``, ...; see
      :func:`remat_toolkit.scan_layers` and :func:`remat_toolkit.restack`).
    norm_eps: epsilon of the normalisation layers.
    attention: the attention core, one of :data:`ATTENTION_KINDS`; dropout
      on the attention probabilities needs ``"naive"``.
    flash_block_size: keys per block of the ``"flash"`` core (capped at
      the sequence length).
  """

  name: str = "custom"
  vocab_size: int = 64
  num_layers: int = 2
  d_model: int = 32
  num_heads: int = 2
  d_ff: int = 128
  seq_len: int = 16
  batch_size: int = 2
  ffn: str = "gelu"
  positions: str = "learned"
  norm: str = "layernorm"
  tie_embeddings: bool = True
  use_bias: bool = True
  dropout_rate: float = 0.0
  dtype: str = "float32"
  param_dtype: str = "float32"
  scan_layers: bool = False
  remat: bool = True
  remat_group: int | str = 1
  remat_policy: str | None = None
  norm_eps: float = 1e-5
  attention: str = "naive"
  flash_block_size: int = DEFAULT_BLOCK_SIZE

  def __post_init__(self):
    for field in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff",
                  "seq_len", "batch_size", "flash_block_size"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"GPTConfig.{field} must be a positive integer, got {value!r}.")
    if self.d_model % self.num_heads:
      raise ValueError(
          f"GPTConfig: num_heads={self.num_heads} must divide "
          f"d_model={self.d_model}.")
    if self.positions == "rope" and self.head_dim % 2:
      raise ValueError(
          f"GPTConfig: rotary positions need an even head_dim, got "
          f"{self.head_dim} (d_model / num_heads).")
    _check_choice("ffn", self.ffn, FFN_KINDS)
    _check_choice("positions", self.positions, POSITION_KINDS)
    _check_choice("norm", self.norm, NORM_KINDS)
    _check_choice("attention", self.attention, ATTENTION_KINDS)
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(
          f"GPTConfig.dropout_rate must be in [0, 1), got "
          f"{self.dropout_rate!r}.")
    for field in ("dtype", "param_dtype"):
      _check_dtype(field, getattr(self, field))
    group = self.remat_group
    positive_count = (isinstance(group, int) and not isinstance(group, bool)
                      and group >= 1)
    if group != "sqrt" and not positive_count:
      raise ValueError(
          f"GPTConfig.remat_group must be a positive integer or 'sqrt', got "
          f"{group!r}.")

  @property
  def head_dim(self) -> int:
    """Size of one attention head."""
    return self.d_model // self.num_heads

  @property
  def activation_dtype(self) -> Any:
    """``dtype`` as a NumPy dtype."""
    return jnp.dtype(self.dtype)

  @property
  def parameter_dtype(self) -> Any:
    """``param_dtype`` as a NumPy dtype."""
    return jnp.dtype(self.param_dtype)

  def replace(self, **overrides: Any) -> GPTConfig:
    """A copy with some fields changed (validated like a new config).

    Raises:
      TypeError: for a field that does not exist.
    """
    fields = [f.name for f in dataclasses.fields(self)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
      raise TypeError(
          f"GPTConfig has no field(s) {unknown}; fields are {fields}.")
    return dataclasses.replace(self, **overrides)


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(
        f"GPTConfig.{field} must be one of {list(choices)}, got {value!r}.")


def _check_dtype(field: str, value: Any) -> None:
  try:
    dtype = jnp.dtype(value)
  except (TypeError, ValueError):
    dtype = None
  if (not isinstance(value, str) or dtype is None
      or not jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(
        f"GPTConfig.{field} must name a floating dtype such as 'float32' or "
        f"'bfloat16', got {value!r}.")


CONFIGS: dict[str, GPTConfig] = {
    c.name: c for c in (
        # For tests: a training step takes milliseconds on a CPU.
        GPTConfig(name="tiny", dropout_rate=0.1),
        GPTConfig(name="tiny-swiglu", ffn="swiglu", positions="rope",
                  norm="rmsnorm", tie_embeddings=False, use_bias=False,
                  d_ff=64,
                  dropout_rate=0.1),
        GPTConfig(name="gpt2-small", vocab_size=50257, num_layers=12,
                  d_model=768, num_heads=12, d_ff=3072, seq_len=1024,
                  batch_size=8, dropout_rate=0.1, dtype="bfloat16"),
        GPTConfig(name="gpt2-xl", vocab_size=50257, num_layers=48,
                  d_model=1600, num_heads=25, d_ff=6400, seq_len=1024,
                  batch_size=4, dropout_rate=0.1, dtype="bfloat16"),
        GPTConfig(name="llama-7b", vocab_size=32000, num_layers=32,
                  d_model=4096, num_heads=32, d_ff=11008, seq_len=4096,
                  batch_size=1, ffn="swiglu", positions="rope",
                  norm="rmsnorm", tie_embeddings=False, use_bias=False,
                  norm_eps=1e-6,
                  dtype="bfloat16", param_dtype="bfloat16"),
        # The worked example of the docs: 24 blocks grouped into regions.
        GPTConfig(name="seed-example", vocab_size=50257, num_layers=24,
                  d_model=4096, num_heads=32, d_ff=16384, seq_len=2048,
                  batch_size=2, dtype="bfloat16", param_dtype="bfloat16"),
    )
}
"""The named configurations, by name: what ``build_loss(config)`` and the CLI's
``--model`` accept (see ``list_configs``)."""


def list_configs() -> list[str]:
  """Names of the built-in configurations."""
  return list(CONFIGS)


def get_config(name: str | GPTConfig, **overrides: Any) -> GPTConfig:
  """A named configuration, with ``overrides`` applied.

  Args:
    name: a name from :func:`list_configs`, or a :class:`GPTConfig`.
    **overrides: fields to change, e.g. ``num_layers=4``.

  Returns:
    The :class:`GPTConfig`.

  Raises:
    ValueError: for an unknown name (the message lists the known ones).
    TypeError: for an override that is not a field.

  Example:
    >>> from remat_toolkit import models
    >>> models.get_config("tiny", num_layers=4).num_layers
    4
  """
  if isinstance(name, GPTConfig):
    config = name
  elif isinstance(name, str) and name in CONFIGS:
    config = CONFIGS[name]
  else:
    close = difflib.get_close_matches(str(name), CONFIGS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown model config {name!r}; known configs are {list(CONFIGS)}."
        f"{hint}")
  return config.replace(**overrides) if overrides else config
