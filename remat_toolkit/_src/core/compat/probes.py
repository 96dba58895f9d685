"""What this JAX release does, found by tracing or compiling tiny programs.

Each probe answers once (memoised) a question no version number does:
whether remat3 calls a hand-written policy, offloads, keeps un-named values
under ``everything_saveable``, sees inside a ``custom_vjp`` forward rule;
whether ``dots_saveable`` keeps convolutions; whether XLA merges a
parameter's casts or converts a loop's 16-bit input whole.
``tests/test_compat.py`` pins each answer per release.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.ad_checkpoint  # used below; jax loads it, naming it declares it
import jax.numpy as jnp

from remat_toolkit._src.core.compat.flags import custom_vjp3_enabled
from remat_toolkit._src.core.compat.flags import has_custom_vjp3_flag
from remat_toolkit._src.core.compat.flags import has_remat3_flag
from remat_toolkit._src.core.compat.flags import remat3
from remat_toolkit._src.core.compat.flags import remat3_enabled
from remat_toolkit._src.core.compat.jaxpr_types import name_p
from remat_toolkit._src.core.compat.jaxpr_types import saved_residuals

__all__ = [
    "remat3_calls_policies", "remat3_offloads", "remat3_everything_keeps_unnamed",
    "dots_saveable_keeps_convs", "remat3_sees_into_custom_vjp", "custom_vjp_alignment",
    "xla_merges_parameter_casts", "xla_converts_loop_inputs_whole",
]


def _probe(fn: Callable, avals: tuple[Any, ...], policy: Any) -> list[str]:
  """JAX's residual descriptions for ``fn`` checkpointed with ``policy``."""
  return [d for _, d in saved_residuals(jax.checkpoint(fn, policy=policy), *avals)]


def _probe_residuals(policy: Any) -> list[str]:
  """JAX's residual descriptions for a tiny function with one named value."""
  def fn(x):
    a = jax.ad_checkpoint.checkpoint_name(jax.numpy.sin(x), "a")
    return jax.numpy.sum(jax.numpy.cos(a))

  return _probe(fn, (jax.ShapeDtypeStruct((3,), jax.numpy.float32),), policy)


def _probe_saved(policy: Any) -> int:
  return len(_probe_residuals(policy))


@functools.cache
def remat3_calls_policies() -> bool:
  """Whether ``jax_remat3`` calls an arbitrary policy function.

  jax 0.10 and 0.11 under remat3 honour only JAX's own policy classes (a
  hand-written callable silently becomes full remat); jax 0.12 calls every
  policy. Probed once on a tiny function.
  """
  if not has_remat3_flag():
    return False
  def custom(prim, *_, **params):
    return prim is name_p and params.get("name") == "a"
  with remat3(True):
    return _probe_saved(custom) > _probe_saved(
        jax.checkpoint_policies.nothing_saveable)


@functools.cache
def remat3_offloads() -> bool:
  """Whether ``jax_remat3`` honours offloading policies (moves to host).

  Probed on a tiny function: under releases that ignore them an offloading
  policy silently recomputes everything instead.
  """
  if not has_remat3_flag():
    return False
  policy = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=["a"],
      offload_src="device", offload_dst="pinned_host")
  try:
    with remat3(True):
      return _probe_saved(policy) > _probe_saved(
          jax.checkpoint_policies.nothing_saveable)
  except Exception:  # noqa: BLE001 - a release that refuses it cannot offload
    return False


@functools.cache
def remat3_everything_keeps_unnamed() -> bool:
  """Whether ``everything_saveable`` under ``jax_remat3`` keeps un-named values.

  jax 0.10's remat3 keeps only named values under it (and recomputes the
  rest); later releases keep everything, as remat2 does.
  """
  if not has_remat3_flag():
    return True
  with remat3(True):
    found = _probe_residuals(jax.checkpoint_policies.everything_saveable)
  return any(d.startswith("output of") for d in found)


@functools.cache
def _dots_saveable_keeps_convs(remat3_on: bool) -> bool:
  def fn(w, x):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.numpy.sum(jax.numpy.sin(y))

  avals = (jax.ShapeDtypeStruct((3, 3, 2, 2), jax.numpy.float32),
           jax.ShapeDtypeStruct((1, 4, 4, 2), jax.numpy.float32))
  with remat3(remat3_on):
    dots, nothing = (len(_probe(fn, avals, p)) for p in (
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.nothing_saveable))
  return dots > nothing


def dots_saveable_keeps_convs() -> bool:
  """Whether ``dots_saveable`` keeps a convolution's output in the active mode.

  JAX documents ``dots_saveable`` as keeping ``dot_general`` and convolution
  outputs; jax 0.10's remat3 keeps only ``dot_general`` ones, so on a conv
  net it keeps nothing beyond the region inputs. Probed once per remat mode
  on a tiny convolution.
  """
  return _dots_saveable_keeps_convs(remat3_enabled())


# ---------------------------------------------------------------- custom_vjp

def _saves_name_inside_custom_vjp() -> bool:
  @jax.custom_vjp
  def kernel(x):
    return jax.numpy.sin(x) * 2

  def kernel_fwd(x):
    s = jax.ad_checkpoint.checkpoint_name(jax.numpy.sin(x), "kernel.res")
    return s * 2, (s, jax.numpy.cos(x))

  kernel.defvjp(kernel_fwd, lambda res, g: (2 * res[1] * g,))
  policy = jax.checkpoint_policies.save_only_these_names("kernel.res")
  avals = (jax.ShapeDtypeStruct((3,), jax.numpy.float32),)
  found = _probe(lambda x: jax.numpy.sum(kernel(jax.numpy.tanh(x))), avals,
                 policy)
  return any("kernel.res" in d for d in found)


@functools.cache
def _remat3_sees_into_custom_vjp(custom_vjp3: bool) -> bool:
  if not has_remat3_flag():
    return True
  if custom_vjp3 and not has_custom_vjp3_flag():
    return False
  before = custom_vjp3_enabled()
  if has_custom_vjp3_flag():
    jax.config.update("jax_custom_vjp3", custom_vjp3)
  try:
    with remat3(True):
      return _saves_name_inside_custom_vjp()
  finally:
    if has_custom_vjp3_flag():
      jax.config.update("jax_custom_vjp3", before)


def remat3_sees_into_custom_vjp(custom_vjp3: bool | None = None) -> bool:
  """Whether ``jax_remat3``'s policies see inside a ``custom_vjp`` forward rule.

  With ``jax_remat3`` off JAX traces the forward rule inline, so a policy
  keeps the names and matmuls inside it; remat3 re-binds the kernel whole
  (names and matmuls inside are ignored) unless ``jax_custom_vjp3`` is on
  and this JAX honours it (jax 0.12 does, 0.10 does not). Probed once per
  ``custom_vjp3`` value (None: the current setting) on a tiny kernel.
  """
  if custom_vjp3 is None:
    custom_vjp3 = custom_vjp3_enabled()
  return _remat3_sees_into_custom_vjp(bool(custom_vjp3))


def custom_vjp_alignment() -> str:
  """The setting under which both remat modes keep a ``custom_vjp`` kernel's
  residuals alike on this JAX, as the line of code that sets it."""
  if has_custom_vjp3_flag() and remat3_sees_into_custom_vjp(True):
    return "jax.config.update('jax_custom_vjp3', True)"
  return "jax.config.update('jax_remat3', False)"


# ---------------------------------------------------------------- XLA

def _cast_layer(w: Any, x: Any) -> Any:
  return jnp.tanh(x @ w.astype(jnp.bfloat16)).astype(jnp.float32)


def _cast_layers(ws: list[Any], x: Any) -> Any:
  for w in ws:
    x = jax.checkpoint(_cast_layer)(w, x) + x
  return x.sum()


@functools.cache
def xla_merges_parameter_casts() -> bool:
  """Whether XLA computes a parameter's cast once for both passes of a remat
  region on the default backend (the jax 0.10 XLA:CPU does; the jax 0.12 one
  casts again in the backward pass).

  Probed by compiling a two-layer step and counting the instructions that
  read the first layer's parameter: one when the casts are merged.
  """
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)
  try:
    text = jax.jit(jax.grad(_cast_layers)).lower([w, w], x).compile().as_text()
  except Exception:  # noqa: BLE001 - a backend that cannot say: not merged
    return False
  entry = (text or "").split("ENTRY", 1)[-1]
  found = re.search(r"%(\S+) = \S+ parameter\(0\)", entry)
  if found is None:
    return False
  operand = re.compile(rf"%{re.escape(found.group(1))}\b(?!\s*=)")
  return sum(len(operand.findall(line)) for line in entry.splitlines()) == 1


def _scanned_matmul(w: Any, xs: Any) -> Any:
  def body(carry: Any, x: Any) -> tuple[Any, None]:
    return carry + (x @ w.astype(jnp.bfloat16)).astype(jnp.float32), None
  return jax.lax.scan(body, jnp.zeros(xs.shape[1:], jnp.float32), xs)[0]


@functools.cache
def xla_converts_loop_inputs_whole() -> bool:
  """Whether XLA, on the default backend, converts a loop's 16-bit stacked
  inputs its body reads to float32 whole, before the loop (the jax 0.10
  XLA:CPU does, for a matmul's operand and for elementwise math alike; the
  jax 0.12 one converts the 16-bit slices in the loop).

  Probed by compiling a scan of a bfloat16 matmul and looking for the
  float32 copy of its stacked input outside the loop.
  """
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  xs = jax.ShapeDtypeStruct((12, 16, 128), jnp.bfloat16)
  try:
    text = jax.jit(_scanned_matmul).lower(w, xs).compile().as_text()
  except Exception:  # noqa: BLE001 - a backend that cannot say: not converted
    return False
  return "f32[12,16,128]" in (text or "").split("ENTRY", 1)[-1]
