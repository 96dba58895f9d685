"""What a benchmark trains: a loss, its parameters and batch, an optimizer.

:func:`build_workload` turns what :func:`~remat_toolkit.bench` and
:func:`~remat_toolkit.largest_batch` were given (a built-in model's name or
config with its build options, or a user ``loss_fn(params, batch)`` with its
arguments) into a :class:`Workload`, checking the options on the way.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit._src.bench import workload
  >>> loss = lambda w, b: jnp.mean((b @ w) ** 2)
  >>> args = (jax.ShapeDtypeStruct((4, 4), jnp.float32),
  ...         jax.ShapeDtypeStruct((8, 4), jnp.float32))
  >>> work = workload.build_workload(loss, args, batch=None, build={},
  ...                                optimizer=None, seed=0,
  ...                                tokens_per_example=None, abstract=True)
  >>> work.batch_size, work.resized(2).shape
  (8, (2, 4))
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from remat_toolkit._src.analysis.breakdown import resolve_optimizer
from remat_toolkit._src.core import inputs

__all__ = ["Workload", "Model", "DEFAULT_MODEL", "build_workload",
           "build_options", "check_positive_int", "grad_accum_values",
           "check_divides"]

#: The model of a run without arguments: milliseconds per step on a CPU.
DEFAULT_MODEL = "tiny"
_DEFAULT_LEARNING_RATE = 1e-3

Model = Any  # a config name, a GPTConfig, a loss function or (loss_fn, args)


@dataclasses.dataclass(frozen=True)
class Workload:
  """A loss, its arguments, and what a step of it processes."""

  loss_fn: Callable[..., jax.Array]
  params: Any
  batch: Any
  optimizer: optax.GradientTransformation
  description: str
  tokens_per_example: int

  @property
  def batch_size(self) -> int:
    return _leading_size(self.batch)

  def resized(self, size: int) -> Any:
    """An abstract batch with ``size`` examples."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)[1:]), x.dtype),
        self.batch)


def build_workload(model: Model, args: tuple, *, batch: int | None,
                   build: Mapping[str, Any],
                   optimizer: optax.GradientTransformation | str | None,
                   seed: int,
                   tokens_per_example: int | None, abstract: bool = False,
                   default_batch: Callable[[int], int] = lambda b: b
                   ) -> Workload:
  """What to train: a built-in model built with ``build`` options, or a user loss.

  Args:
    model: a built-in config name or ``GPTConfig``, a ``loss_fn(params,
      batch)``, or a ``(loss_fn, (params, batch))`` pair.
    args: ``(params, batch)`` for a user loss, else empty.
    batch: built-in models only: examples per step.
    build: built-in models only: ``models.build_loss`` options.
    optimizer: an optax ``GradientTransformation`` or a name
      (``"adam"``, ``"sgd"``: :func:`remat_toolkit.memory_breakdown`'s);
      default ``optax.adamw(1e-3)``.
    seed: seeds a built-in model's parameters and tokens.
    tokens_per_example: user models: tokens in one example.
    abstract: keep the arguments abstract (nothing will run).
    default_batch: a built-in model's batch from its config's.

  Raises:
    TypeError: a model, argument or optimizer of the wrong kind.
    ValueError: options that do not apply, or a batch without a batch axis.
  """
  optimizer = (optax.adamw(_DEFAULT_LEARNING_RATE) if optimizer is None
               else resolve_optimizer(optimizer)[0])
  if _is_builtin(model):
    if args:
      raise TypeError(
          f"A built-in model ({model!r}) takes no positional arguments; "
          "choose its size with batch=, seq= and dtype=.")
    if batch is not None:
      check_positive_int("batch", batch)
    if build.get("seq") is not None:
      check_positive_int("seq", build["seq"])
    return _builtin_workload(model, batch=batch, build=build,
                             optimizer=optimizer, seed=seed,
                             default_batch=default_batch, abstract=abstract)
  return _user_workload(model, args, optimizer=optimizer,
                        tokens_per_example=tokens_per_example,
                        options={"batch": batch, **build}, abstract=abstract)


def build_options(**options: Any) -> dict[str, Any]:
  """The ``models.build_loss`` options given (None means "the config's")."""
  return {k: v for k, v in options.items() if v is not None}


# ================================================================ built-in

def _models() -> Any:
  """The built-in models, imported when first asked for: they load flax
  (about 0.5 s of ``import remat_toolkit``), which a user's model does not
  need."""
  from remat_toolkit import models
  return models


def _is_builtin(model: Any) -> bool:
  # A GPTConfig exists only once the built-in models are imported.
  configs = sys.modules.get("remat_toolkit.models.configs")
  return isinstance(model, str) or (
      configs is not None and isinstance(model, configs.GPTConfig))


def _builtin_workload(model: Any, *, batch: int | None,
                      build: Mapping[str, Any],
                      optimizer: optax.GradientTransformation, seed: int,
                      default_batch: Callable[[int], int], abstract: bool
                      ) -> Workload:
  models = _models()
  config = models.get_config(model)
  size = batch if batch is not None else default_batch(config.batch_size)
  options = dict(build, batch=size, seed=seed)
  loss_fn, (params, data) = models.build_loss(config, abstract=True, **options)
  if not abstract:
    # One compiled initialisation instead of hundreds of eager ops.
    params, data = jax.jit(
        lambda: models.build_loss(config, abstract=False, **options)[1])()
  config = models.get_config(config, batch_size=size,
                             seq_len=build.get("seq") or config.seq_len,
                             dtype=build.get("dtype") or config.dtype)
  scan = build.get("scan")
  layout = "scanned" if (config.scan_layers if scan is None else scan) else "unrolled"
  framework = build.get("framework") or "linen"
  attention = ("" if config.attention == "naive"
               else f", {config.attention} attention")
  description = (f"{config.name} ({framework}, {config.num_layers} layers "
                 f"{layout}, d_model {config.d_model}, seq {config.seq_len}, "
                 f"{config.dtype}{attention})")
  return Workload(loss_fn, params, data, optimizer, description,
                  config.seq_len)


# ================================================================ user loss

def _user_workload(model: Any, args: tuple, *, options: Mapping[str, Any],
                   optimizer: optax.GradientTransformation,
                   tokens_per_example: int | None, abstract: bool
                   ) -> Workload:
  model, args = _loss_and_arguments(model, args)
  given = sorted(k for k, v in options.items() if v is not None)
  if given:
    raise ValueError(
        f"{given} apply to built-in models only; for your own loss, build "
        "params and batch with the size, sequence length and dtype you want.")
  params, batch = args
  _leading_size(batch)
  synthetic = not abstract and any(isinstance(x, jax.ShapeDtypeStruct)
                                   for x in jax.tree.leaves(args))
  if synthetic:
    # The step must run: abstract inputs (as every other verb takes) get
    # synthetic values; step time and memory do not depend on the values.
    params, batch = inputs.random_tree(params, 0), inputs.random_tree(batch, 1)
  tokens = (tokens_per_example if tokens_per_example is not None
            else _tokens_per_example(batch))
  name = getattr(model, "__name__", type(model).__name__)
  what = "user model, synthetic values" if synthetic else "user model"
  return Workload(_unwrap_jit(model), params, batch, optimizer,
                  f"{name} ({what})", tokens)


def _loss_and_arguments(model: Any, args: tuple) -> tuple[Callable, tuple]:
  if isinstance(model, tuple):
    if args or len(model) != 2 or not isinstance(model[1], (tuple, list)):
      raise TypeError(
          "A model given as a tuple must be (loss_fn, (params, batch)), as "
          "models.build_loss returns, with no further positional arguments.")
    model, args = model[0], tuple(model[1])
  if not callable(model):
    raise TypeError(
        f"model must be a built-in config name, a GPTConfig, a "
        f"loss_fn(params, batch) or a (loss_fn, (params, batch)) pair, got "
        f"{model!r}.")
  if len(args) != 2:
    raise TypeError(
        f"A user model is bench(loss_fn, params, batch); got {len(args)} "
        "argument(s) after loss_fn. Close over anything else in loss_fn.")
  return model, args


def _leading_size(batch: Any) -> int:
  leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
  if not leaves:
    raise ValueError("The batch has no arrays; pass loss_fn(params, batch) "
                     "a batch with a leading batch axis.")
  sizes = {}
  for path, leaf in leaves:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
          f"Batch leaf {jax.tree_util.keystr(path) or '(root)'} is a scalar; "
          "every batch leaf needs a leading batch axis (close over other "
          "values in loss_fn).")
    sizes[jax.tree_util.keystr(path)] = shape[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
        f"Batch leaves disagree on the batch size (leading axis): {sizes}; "
        "every leaf must have the examples on axis 0.")
  return next(iter(sizes.values()))


def _tokens_per_example(batch: Any) -> int:
  # Token ids are the first integer [batch, seq, ...] leaf; else count examples.
  for leaf in jax.tree.leaves(batch):
    if len(np.shape(leaf)) >= 2 and jnp.issubdtype(leaf.dtype, jnp.integer):
      return int(np.shape(leaf)[1])
  return 1


def _unwrap_jit(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  # A jitted loss caches its trace, so it would keep the first policy it saw;
  # the whole step is jitted here anyway.
  if hasattr(loss_fn, "lower") and hasattr(loss_fn, "__wrapped__"):
    return loss_fn.__wrapped__
  return loss_fn


# ================================================================ checks

def check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
  """Raises unless ``value`` is an integer of at least ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an integer, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def grad_accum_values(grad_accum: int | Sequence[int]) -> tuple[int, ...]:
  """The distinct ``grad_accum`` values asked for, in order."""
  values = ((grad_accum,) if isinstance(grad_accum, (int, np.integer))
            else tuple(grad_accum))
  if not values:
    raise ValueError("grad_accum must name at least one value, e.g. 1 or [1, 4].")
  for v in values:
    check_positive_int("grad_accum", v)
  return tuple(dict.fromkeys(int(v) for v in values))


def check_divides(batch_size: int, grad_accum: Sequence[int]) -> None:
  """Raises unless every ``grad_accum`` value divides ``batch_size``."""
  bad = [k for k in grad_accum if batch_size % k]
  if bad:
    raise ValueError(
        f"A batch of {batch_size} examples cannot be split into {bad} equal "
        "micro-batches; choose a batch size that each grad_accum value divides.")
