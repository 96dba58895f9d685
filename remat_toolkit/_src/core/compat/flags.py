"""JAX's switches the toolkit reads and sets, and its part of jit cache keys.

The ``jax_remat3`` and ``jax_custom_vjp3`` flags (whether this JAX has each,
whether it is on, ``jax_remat3`` set for a block), the error JAX raises for
a cuDNN kernel on a machine without a GPU, and the user context JAX's trace,
lowering and compile caches key on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

__all__ = [
    "has_remat3_flag", "remat3_enabled", "has_custom_vjp3_flag", "custom_vjp3_enabled",
    "is_cudnn_unavailable", "is_reduce_precision_refusal", "remat3",
    "has_trace_key_context", "trace_key", "trace_key_part", "fresh_trace_key",
]


# ---------------------------------------------------------------- remat3 flag

# JAX's options, read as attributes. Each is a property JAX adds at run time,
# which jax 0.10's Config does not declare to a type checker (later ones do).
_config: Any = jax.config


def has_remat3_flag() -> bool:
  """Whether this JAX has the ``jax_remat3`` flag at all."""
  return hasattr(jax.config, "jax_remat3")


def remat3_enabled() -> bool:
  """Whether ``jax_remat3`` (the incoming remat implementation) is on."""
  return has_remat3_flag() and bool(_config.jax_remat3)


def has_custom_vjp3_flag() -> bool:
  """Whether this JAX has ``jax_custom_vjp3``.

  With it on, jax 0.12's remat3 sees inside a ``custom_vjp`` forward rule
  (names there are honoured); jax 0.10's remat3 still treats the kernel as
  opaque (pinned in the tests).
  """
  return hasattr(jax.config, "jax_custom_vjp3")


def custom_vjp3_enabled() -> bool:
  """Whether ``jax_custom_vjp3`` is on (see :func:`has_custom_vjp3_flag`)."""
  return has_custom_vjp3_flag() and bool(_config.jax_custom_vjp3)


def is_reduce_precision_refusal(err: BaseException) -> bool:
  """Whether ``err`` is remat2 refusing a value a region keeps: JAX rounds
  each kept value with ``reduce_precision`` (so the backward pass reads
  the forward's bits), which takes floating-point values only (a kept
  ``complex64`` fails)."""
  return isinstance(err, TypeError) and "reduce_precision does not accept" in str(err)


def is_cudnn_unavailable(err: BaseException) -> bool:
  """Whether ``err`` is JAX refusing a cuDNN kernel because no GPU is present."""
  return isinstance(err, RuntimeError) and "cuDNN is not detected" in str(err)


@contextlib.contextmanager
def remat3(enabled: bool) -> Iterator[None]:
  """Sets ``jax_remat3`` for the duration of the block, then restores it."""
  if not has_remat3_flag():
    if enabled:
      raise ValueError(
          f"jax {jax.__version__} has no jax_remat3 flag; run with remat3 off.")
    yield
    return
  before = remat3_enabled()
  jax.config.update("jax_remat3", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_remat3", before)


# ---------------------------------------------------------------- jit keys

# A value JAX's trace, lowering and compile caches key on, as they key on
# ``default_matmul_precision``: a jitted function traced under one ambient
# policy is traced again under another instead of keeping the first.
_make_user_context = getattr(jax, "make_user_context", None)
_TRACE_KEY = _make_user_context(()) if _make_user_context is not None else None


def has_trace_key_context() -> bool:
  """Whether this JAX keys its jit caches on a user context value."""
  return _TRACE_KEY is not None


def trace_key() -> tuple[tuple[str, Any], ...]:
  """The toolkit's part of every jit cache key: ``(slot, value)`` pairs."""
  return _TRACE_KEY.value if _TRACE_KEY is not None else ()


@contextlib.contextmanager
def trace_key_part(slot: str, value: Any) -> Iterator[None]:
  """Puts ``value`` under ``slot`` in the jit cache key inside the block.

  ``value`` must be hashable; equal values hit the same cache entries, so a
  function called again under an equal policy is not traced again. Where JAX
  has no user contexts this does nothing (callers warn).
  """
  hash(value)
  if _TRACE_KEY is None:
    yield
    return
  parts = tuple(p for p in _TRACE_KEY.value if p[0] != slot)
  with _TRACE_KEY(parts + ((slot, value),)):
    yield


@contextlib.contextmanager
def fresh_trace_key() -> Iterator[None]:
  """A jit cache key no earlier trace has, so jitted functions run their
  Python again inside the block (to see every module they call)."""
  with trace_key_part("fresh", object()):
    yield
