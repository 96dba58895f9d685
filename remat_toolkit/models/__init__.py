"""A built-in GPT-style decoder, in linen and NNX, tagged for remat policies.

:func:`build_loss` is the entry point used by the analyzer, the CLI and the
benchmarks: it returns a next-token loss and its arguments, abstract
(``jax.ShapeDtypeStruct``) by default so that even ``llama-7b`` is analysed
without allocating it. Its ``attention=`` chooses the attention core: the
naive softmax, ``jax.nn.dot_product_attention`` or a blockwise flash kernel
(:mod:`remat_toolkit.models.flash`).

Example:
  >>> import jax
  >>> from remat_toolkit import models
  >>> loss_fn, (params, batch) = models.build_loss("tiny")
  >>> batch["inputs"].shape
  (2, 16)
  >>> jax.eval_shape(loss_fn, params, batch).dtype
  dtype('float32')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import cast

import jax
import jax.numpy as jnp

from remat_toolkit.models import flash as flash  # the kernel module, public
from remat_toolkit.models.common import check_attention_dropout
from remat_toolkit.models.common import next_token_loss
from remat_toolkit.models.configs import ATTENTION_KINDS
from remat_toolkit.models.configs import CONFIGS
from remat_toolkit.models.configs import GPTConfig
from remat_toolkit.models.configs import get_config
from remat_toolkit.models.configs import list_configs
from remat_toolkit.models.flash import flash_attention
from remat_toolkit.models.flash import make_flash_kernel
from remat_toolkit.models.gpt_linen import GPT
from remat_toolkit.models.gpt_linen import MLP
from remat_toolkit.models.gpt_linen import Attention
from remat_toolkit.models.gpt_linen import Block
from remat_toolkit.models.gpt_nnx import NNXGPT
from remat_toolkit.models.gpt_nnx import NNXMLP
from remat_toolkit.models.gpt_nnx import NNXAttention
from remat_toolkit.models.gpt_nnx import NNXBlock
from remat_toolkit.models.gpt_nnx import reseed_dropout

__all__ = [
    "ATTENTION_KINDS",
    "CONFIGS",
    "GPT",
    "GPTConfig",
    "MLP",
    "NNXGPT",
    "NNXMLP",
    "NNXAttention",
    "NNXBlock",
    "Attention",
    "Block",
    "FRAMEWORKS",
    "build_loss",
    "flash_attention",
    "get_config",
    "list_configs",
    "make_flash_kernel",
    "next_token_loss",
    "reseed_dropout",
]

FRAMEWORKS: tuple[str, ...] = ("linen", "nnx")
"""Values of ``build_loss(framework=...)``."""

LossFn = Callable[..., jax.Array]


def build_loss(config: str | GPTConfig, *, batch: int | None = None,
               seq: int | None = None, dtype: str | None = None,
               scan: bool | None = None, group: int | str | None = None,
               remat: bool = True, framework: str = "linen",
               abstract: bool = True, seed: int = 0, dropout: bool = False,
               attention: str | None = None
               ) -> tuple[LossFn, tuple[Any, Any]]:
  """A next-token cross-entropy loss of a built-in model, and its arguments.

  Args:
    config: a config name (see :func:`list_configs`) or a :class:`GPTConfig`.
    batch: batch size (default: the config's).
    seq: sequence length (default: the config's).
    dtype: activation dtype, e.g. ``"bfloat16"`` (default: the config's).
    scan: scan the blocks (default: the config's ``scan_layers``).
    group: blocks per remat region, or ``"sqrt"`` (default: the config's).
    remat: False builds the no-remat baseline (no remat region at all).
    framework: ``"linen"`` or ``"nnx"``.
    abstract: True gives ``jax.ShapeDtypeStruct`` arguments (parameters from
      ``jax.eval_shape``; nothing is allocated); False real arrays.
    seed: seeds the parameters and the token batch.
    dropout: apply dropout (the config's ``dropout_rate``); the batch then
      carries ``"dropout_key"``, raw ``uint32[2]`` key data from which every
      dropout mask of the step is derived. Otherwise the model is
      deterministic.
    attention: the attention core (default: the config's, ``"naive"`` in
      every built-in config): ``"naive"`` (the full ``seq x seq`` softmax,
      its logits and probabilities tagged), ``"dot_product"``
      (``jax.nn.dot_product_attention``, XLA's path) or ``"flash"`` (a
      blockwise ``custom_vjp`` kernel that keeps only q, k, v, the output
      and the log-sum-exp, the latter two named ``attn.context``). The two
      kernels have no attention dropout: with ``dropout=True`` they need a
      config whose ``dropout_rate`` is 0.

  Returns:
    ``(loss_fn, (params, batch))`` with ``loss_fn(params, batch)`` a float32
    scalar. ``params`` is the linen ``params`` collection or the NNX
    ``nnx.State`` of ``nnx.Param`` variables; ``batch`` is a dict with
    ``"inputs"`` and ``"targets"``, int32 ``[batch, seq]``. Either way both
    are pytrees of arrays (or ShapeDtypeStructs).

  Raises:
    ValueError: for an unknown config, framework or attention core, bad
      overrides, or dropout with an attention core that has none.

  Example:
    >>> import jax
    >>> from remat_toolkit import models
    >>> loss_fn, (params, batch) = models.build_loss(
    ...     "tiny", framework="nnx", dropout=True)
    >>> sorted(batch), batch["dropout_key"].dtype
    (['dropout_key', 'inputs', 'targets'], dtype('uint32'))
    >>> loss_fn, args = models.build_loss("tiny", attention="flash")
    >>> jax.eval_shape(loss_fn, *args).shape
    ()
  """
  if framework not in FRAMEWORKS:
    raise ValueError(
        f"framework must be one of {list(FRAMEWORKS)}, got {framework!r}.")
  if attention is not None and attention not in ATTENTION_KINDS:
    raise ValueError(
        f"attention must be one of {list(ATTENTION_KINDS)}, got "
        f"{attention!r}.")
  cfg = _configure(config, batch=batch, seq=seq, dtype=dtype, scan=scan,
                   group=group, remat=remat, attention=attention)
  check_attention_dropout(cfg, deterministic=not dropout)
  build = _build_linen if framework == "linen" else _build_nnx
  loss_fn, params = build(cfg, abstract=abstract, seed=seed, dropout=dropout)
  return loss_fn, (params, _batch(cfg, abstract=abstract, seed=seed,
                                  dropout=dropout))


def _configure(config: str | GPTConfig, *, batch: int | None, seq: int | None,
               dtype: str | None, scan: bool | None, group: int | str | None,
               remat: bool, attention: str | None) -> GPTConfig:
  overrides: dict[str, Any] = {"remat": bool(remat)}
  if batch is not None:
    overrides["batch_size"] = batch
  if seq is not None:
    overrides["seq_len"] = seq
  if dtype is not None:
    overrides["dtype"] = dtype
  if scan is not None:
    overrides["scan_layers"] = bool(scan)
  if group is not None:
    overrides["remat_group"] = group
  if attention is not None:
    overrides["attention"] = attention
  return get_config(config, **overrides)


def _batch(cfg: GPTConfig, *, abstract: bool, seed: int, dropout: bool
           ) -> dict[str, Any]:
  shape = (cfg.batch_size, cfg.seq_len)
  if abstract:
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32)
    out: dict[str, Any] = {"inputs": tokens, "targets": tokens}
    if dropout:
      out["dropout_key"] = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return out
  data_key, dropout_key = jax.random.split(jax.random.key(seed + 1))
  stream = jax.random.randint(data_key, (cfg.batch_size, cfg.seq_len + 1), 0,
                              cfg.vocab_size, dtype=jnp.int32)
  out = {"inputs": stream[:, :-1], "targets": stream[:, 1:]}
  if dropout:
    out["dropout_key"] = jax.random.key_data(dropout_key)
  return out


def _dummy_tokens(cfg: GPTConfig) -> jax.Array:
  return jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)


def _build_linen(cfg: GPTConfig, *, abstract: bool, seed: int, dropout: bool
                 ) -> tuple[LossFn, Any]:
  model = GPT(cfg)

  def init():
    return model.init(jax.random.key(seed), _dummy_tokens(cfg))["params"]

  params = jax.eval_shape(init) if abstract else jax.jit(init)()

  def loss_fn(params: Any, batch: dict[str, Any]) -> jax.Array:
    rngs = ({"dropout": jax.random.wrap_key_data(batch["dropout_key"])}
            if dropout else None)
    # No mutable collections: apply returns the output alone.
    logits = cast(jax.Array, model.apply({"params": params}, batch["inputs"],
                                         deterministic=not dropout, rngs=rngs))
    return next_token_loss(logits, batch["targets"])

  return loss_fn, params


def _build_nnx(cfg: GPTConfig, *, abstract: bool, seed: int, dropout: bool
               ) -> tuple[LossFn, Any]:
  from flax import nnx

  def create():
    return NNXGPT(cfg, rngs=nnx.Rngs(params=seed, dropout=seed + 1))

  model = nnx.eval_shape(create) if abstract else nnx.jit(create)()
  graphdef, *states = nnx.split(model, nnx.Param, ...)
  params, rest = states  # one state per filter
  if abstract:
    # Rng streams (a few keys and counters) must be real values for the
    # transforms inside the model; parameters stay abstract.
    rest = jax.tree_util.tree_map(_materialize, rest)

  def loss_fn(params: Any, batch: dict[str, Any]) -> jax.Array:
    live = nnx.merge(graphdef, params, rest, copy=True)
    if dropout:
      reseed_dropout(live, jax.random.wrap_key_data(batch["dropout_key"]))
    logits = live(batch["inputs"], deterministic=not dropout)
    return next_token_loss(logits, batch["targets"])

  return loss_fn, params


def _materialize(leaf: Any) -> Any:
  if not isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    keys = jax.random.split(jax.random.key(0), max(1, math.prod(leaf.shape)))
    return keys.reshape(leaf.shape)
  return jnp.zeros(leaf.shape, leaf.dtype)
