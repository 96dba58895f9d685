"""The JAX and Flax boundary: the only module that touches their internals.

JAX's remat implementations, jaxpr classes and checkpoint-policy objects move
between releases (jax 0.10 keeps ``ClosedJaxpr`` apart from ``Jaxpr`` and
builds policies as classes; 0.11 makes ``ClosedJaxpr`` an alias of
``Jaxpr``; 0.12 returns policies as plain functions again). Everything else
in the package goes through the names defined here, so a JAX release changes
this one file. Public or ``jax.extend`` APIs come first; what a release can
do is detected by probing it, never by comparing version numbers.
``tests/test_compat.py`` pins each behaviour relied on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import jax
import jax.ad_checkpoint  # used below; jax loads it, naming it declares it
import jax.numpy as jnp
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util
from jax._src.interpreters import partial_eval as _pe
from jax.extend import core as _ext_core
from jax.extend import source_info_util as _ext_source_info

# Declared before the imports that may fail, so each name's type admits the
# None a release without it leaves.
_call_hi_primitive_p: _core.Primitive | None
_CustomVJPTraced: type[Any] | None
_custom_vjp_call_p: _core.Primitive | None
_custom_lin_p: _core.Primitive | None

try:  # remat3 runs through hijax's call primitive; older releases lack it.
  from jax._src.hijax import call_hi_primitive_p as _call_hi_primitive_p
except ImportError:  # pragma: no cover - depends on the JAX release
  _call_hi_primitive_p = None

try:  # a custom_vjp call with jax_custom_vjp3 on (jax 0.12)
  from jax._src.hijax import CustomVJPTraced as _CustomVJPTraced
except ImportError:  # pragma: no cover - depends on the JAX release
  _CustomVJPTraced = None

try:  # the call of a jax.custom_vjp function, and its linearized form
  from jax._src.custom_derivatives import custom_vjp_call_p as _custom_vjp_call_p
  from jax._src.interpreters.ad import custom_lin_p as _custom_lin_p
except ImportError:  # pragma: no cover - depends on the JAX release
  _custom_vjp_call_p = _custom_lin_p = None

__all__ = [
    "Jaxpr", "ClosedJaxpr", "JaxprEqn", "Var", "Literal", "DropVar",
    "name_p", "remat_p", "close_jaxpr", "jaxpr_consts", "eval_jaxpr",
    "dce_jaxpr", "saved_residuals", "is_computed", "enclosing_remat", "remat3_enabled", "remat3",
    "has_remat3_flag", "has_custom_vjp3_flag", "custom_vjp3_enabled",
    "is_cudnn_unavailable", "remat3_calls_policies", "remat3_offloads",
    "remat3_honours", "remat3_everything_keeps_unnamed", "offloading_unsupported",
    "offloading_refusal", "jax_policy_offloads",
    "jax_policy", "policy_marker", "checkpoint_name_of",
    "is_remat", "is_scan", "scan_num_carry", "remat_policy_of", "remat_body_of", "with_remat",
    "bind_remat", "is_scope", "module_scopes", "drop_leading_scopes", "nest_scopes",
    "prefix_scopes", "eval_context", "user_source", "flax_lift_pack",
    "linen_scope_path",
    "linen_lift_transform", "linen_decorator_lift_transform",
    "call_body", "hidden_jaxprs", "kernel_name", "is_custom_vjp_call", "is_pallas_call",
    "pallas_grid_size", "pallas_cost_flops", "custom_vjp_forward",
    "has_python_transpose", "mark_kernel", "kernel_mark_of",
    "remat3_sees_into_custom_vjp", "custom_vjp_alignment",
    "ShardingTypeError", "aval_sharding", "pickle_exported", "unpickle_exported",
    "has_trace_key_context", "trace_key", "trace_key_part", "fresh_trace_key",
    "CustomVJPRules", "custom_vjp_rules",
]

# ---------------------------------------------------------------- jaxpr types

Jaxpr = _ext_core.Jaxpr
#: From jax 0.11 on this is ``Jaxpr`` itself: a jaxpr carries its constants.
ClosedJaxpr = _ext_core.ClosedJaxpr
JaxprEqn = _ext_core.JaxprEqn
Var = _ext_core.Var
Literal = _ext_core.Literal
DropVar = _ext_core.DropVar

name_p = _ext_core.primitives.name_p
remat_p = _ext_core.primitives.remat_p

_CheckpointName = getattr(_ad_checkpoint, "CheckpointName", None)
_CheckpointNameFwd = getattr(_ad_checkpoint, "CheckpointNameFwd", None)
# Any: a private class, probed because a release may not have it.
_RematTraced: Any = getattr(_ad_checkpoint, "RematTraced", None)
_NAME_PRIMS = tuple(t for t in (_CheckpointName, _CheckpointNameFwd)
                    if t is not None)


def close_jaxpr(jaxpr: Jaxpr, consts: list[Any]) -> ClosedJaxpr:
  """``jaxpr`` with ``consts`` attached, on either jaxpr representation."""
  return ClosedJaxpr(jaxpr, list(consts))


def jaxpr_consts(value: Any) -> list[Any]:
  """The constants a (closed) jaxpr carries; ``[]`` for an open one."""
  return list(getattr(value, "consts", None) or [])


def eval_jaxpr(jaxpr: Jaxpr, consts: list[Any], *args: Any) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args`` with its constants bound to ``consts``."""
  return _core.eval_jaxpr(jaxpr, consts, *args)


def dce_jaxpr(jaxpr: Jaxpr, used_outputs: list[bool]) -> Jaxpr:
  """``jaxpr`` without the equations no used output depends on."""
  live, _ = _pe.dce_jaxpr(jaxpr, used_outputs, instantiate=True)
  return live


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[Any, str]]:
  """JAX's own list of residuals (aval, description) for ``fn(*args)``.

  The data source of the public ``jax.ad_checkpoint.print_saved_residuals``.
  """
  return _ad_checkpoint.saved_residuals(fn, *args)


def abstractify(x: Any) -> Any:
  """The abstract value (shape, dtype, weak type) of an array or tracer."""
  from jax import api_util
  return api_util.shaped_abstractify(x)


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is a value of some ongoing trace."""
  return isinstance(x, jax.core.Tracer)


def _is_remat_body(traced_for: str) -> bool:
  """Whether a trace's ``traced_for`` is a ``jax.checkpoint`` body's (it
  reads ``remat3`` with ``jax_remat3`` on)."""
  return traced_for.startswith("checkpoint") or traced_for == "remat3"


def _traced_for(tracer: Any) -> str:
  info = getattr(getattr(tracer._trace, "frame", None), "debug_info", None)
  return str(getattr(info, "traced_for", ""))


def _inner_value(tracer: Any) -> Any:
  """The value a transformation's tracer carries one level down (a JVP or
  linearize tracer's primal, a batch tracer's batched value), or None."""
  if hasattr(tracer, "primal"):
    return tracer.primal
  if type(tracer).__name__ == "BatchTracer":
    return tracer.val
  return None


def is_computed(x: Any) -> bool:
  """Whether ``x`` is a value the traced function computed.

  False for a value the function was given: an argument of the ``jit`` (or
  of the ``jax.checkpoint``) being traced, a closed-over constant, a plain
  array. A loop's carry or a branch's operand is taken as computed (the
  trace cannot tell which), and so is anything this module cannot see
  into: the answer decides whether a region's input is worth moving to the
  host, and moving a computed one is what every release did before.

  Read from the tracer beneath the transformations (``jax.grad``,
  ``jax.vmap``): the equation that produced it, or the frame it is an input
  of; detected, so a JAX without these answers True.
  """
  if not isinstance(x, jax.core.Tracer):
    return False
  base = x
  while not isinstance(base, _pe.DynamicJaxprTracer):
    base = _inner_value(base)
    if base is None:
      return True
    if not isinstance(base, jax.core.Tracer):
      return True  # eager differentiation: no program to be an input of
  parent = getattr(base, "parent", True)
  if parent is not None:
    return True
  frame = getattr(base._trace, "frame", None)
  if not any(v is base.val for v in getattr(frame, "invars", ())):
    return False  # a constant the trace closed over
  traced_for = _traced_for(base)
  return not (traced_for == "jit" or _is_remat_body(traced_for))


def enclosing_remat() -> str | None:
  """The function (``name at file:line``) whose remat body is being traced
  right now, or None: the innermost trace is a ``jax.checkpoint`` body's
  (``nn.remat`` and ``nnx.remat`` trace through it) in either remat mode.

  Only the innermost trace is seen: a region inside a loop inside a remat
  body is not.
  """
  trace = getattr(getattr(_core, "trace_ctx", None), "trace", None)
  info = getattr(getattr(trace, "frame", None), "debug_info", None)
  traced_for = str(getattr(info, "traced_for", ""))
  if not _is_remat_body(traced_for):
    return None
  return str(getattr(info, "func_src_info", None) or "a remat body")


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


# ---------------------------------------------------------------- policies

#: Public constructor names of ``jax.checkpoint_policies`` the package uses.
_CONSTRUCTORS = frozenset({
    "everything_saveable", "nothing_saveable", "dots_saveable",
    "dots_with_no_batch_dims_saveable", "save_only_these_names",
    "save_any_names_but_these", "save_and_offload_only_these_names",
    "offload_dot_with_no_batch_dims"})


@functools.cache
def jax_policy(constructor: str, *args: Any) -> Any:
  """One of JAX's own checkpoint policies, the same object for equal args.

  JAX 0.10 and 0.11 build policies as classes with value equality; 0.12
  returns a fresh closure on each call. Memoising the construction gives
  every release the identity and equality the analyzer's caches (and JAX's
  own, keyed on the policy) rely on.

  Args:
    constructor: a name in ``jax.checkpoint_policies``. A constant policy
      (``dots_saveable``) takes no ``args``; a constructor takes positional
      ``args``, or for ``save_and_offload_only_these_names`` the four
      keyword values in order (saved, offloaded, src, dst).

  Returns:
    The policy object to pass as ``jax.checkpoint(policy=...)``.
  """
  if constructor not in _CONSTRUCTORS:
    raise ValueError(f"{constructor!r} is not a checkpoint policy constructor "
                     f"remat-toolkit lowers to; use one of "
                     f"{sorted(_CONSTRUCTORS)}.")
  cp = jax.checkpoint_policies
  value = getattr(cp, constructor)
  if constructor == "save_and_offload_only_these_names":
    saved, offloaded, src, dst = args
    return value(names_which_can_be_saved=list(saved),
                 names_which_can_be_offloaded=list(offloaded),
                 offload_src=src, offload_dst=dst)
  if constructor in ("save_only_these_names", "save_any_names_but_these",
                     "offload_dot_with_no_batch_dims"):
    return value(*args)
  if args:
    raise ValueError(f"{constructor} takes no arguments, got {args!r}.")
  return value


def policy_marker(label: str) -> Any:
  """A fresh policy object to mark regions with, accepted by every JAX.

  A ``save_only_these_names`` policy naming a name no program uses: both
  remat implementations of every supported release store it on the region
  untouched, and it behaves as ``nothing_saveable`` if it is ever run.
  Two calls never return the same object, so identity tells markers apart.
  """
  return jax.checkpoint_policies.save_only_these_names(
      f"__remat_toolkit_{label}_{os.urandom(6).hex()}__")


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
  input its body multiplies to float32 whole, before the loop (the jax 0.10
  XLA:CPU does; the jax 0.12 one multiplies the 16-bit slices).

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


def offloading_unsupported() -> bool:
  """Whether an offloading policy would silently do nothing right now.

  True while ``jax_remat3`` is on and this JAX's remat3 ignores offloading.
  """
  return remat3_enabled() and not remat3_offloads()


def jax_policy_offloads(policy: Any) -> bool:
  """Whether a policy of JAX's own moves residuals to host memory.

  Known from the constructor it came from: a class up to jax 0.11, a
  closure named after its constructor from 0.12.
  """
  names = (type(policy).__name__, getattr(policy, "__qualname__", "") or "")
  return any("offload" in n.lower() for n in names)


def offloading_refusal() -> str:
  """Why offloading cannot run now, naming this JAX and what to do."""
  return (f"jax_remat3 is on and jax {jax.__version__}'s remat3 ignores "
          "offloading policies (it would silently recompute everything); turn "
          "it off with jax.config.update('jax_remat3', False), or use a JAX "
          "whose remat3 offloads")


def _policy_classes() -> tuple[type, ...]:
  names = ("SaveOnlyTheseNames", "SaveAnyNamesButThese", "DotsSaveable",
           "SaveAndOffloadOnlyTheseNames", "OffloadDotWithNoBatchDims")
  return tuple(t for t in (getattr(_ad_checkpoint, n, None) for n in names)
               if isinstance(t, type))


def remat3_honours(policy: Any) -> bool:
  """Whether ``policy`` keeps its meaning under ``jax_remat3`` on this JAX.

  Where remat3 calls policies (jax 0.12), every policy does. Elsewhere only
  JAX's own policy classes and ``everything_saveable`` / ``nothing_saveable``
  are understood; any other callable silently becomes full recomputation.
  """
  if policy is None or remat3_calls_policies():
    return True
  cp = jax.checkpoint_policies
  return (isinstance(policy, _policy_classes())
          or policy is cp.everything_saveable
          or policy is cp.nothing_saveable)


# ---------------------------------------------------------------- sharding

#: What JAX raises when a program is not written for explicit sharding (e.g.
#: a matmul contracting a sharded dimension without ``out_sharding``). JAX
#: exports no public name for it; a release without it gets a class nothing
#: raises, so ``except ShardingTypeError`` simply never matches there.
ShardingTypeError: type[Exception] = getattr(
    _core, "ShardingTypeError", type("ShardingTypeError", (Exception,), {}))


def aval_sharding(aval: Any) -> Any:
  """The sharding an abstract value carries in its type (``None`` if none).

  With arguments on a mesh of ``Explicit`` axes, every value of the traced
  program carries a ``NamedSharding`` (``jax.typeof(x).sharding`` in user
  code); on ``Auto`` axes the spec is all ``None``.
  """
  return getattr(aval, "sharding", None)


def pickle_exported(exported: Any) -> bytes:
  """A ``jax.export.Exported`` as bytes for another process of this Python.

  ``Exported.serialize()`` needs the optional ``flatbuffers`` package; the
  receiving process runs the same JAX, so a pickle of the dataclass does
  (its only unpicklable field, the lazily built VJP, is dropped: the
  receiver compiles, never differentiates).
  """
  import dataclasses
  import pickle
  return pickle.dumps(dataclasses.replace(exported, _get_vjp=None))


def unpickle_exported(data: bytes) -> Any:
  """The ``jax.export.Exported`` that :func:`pickle_exported` wrote."""
  import pickle
  return pickle.loads(data)


# ---------------------------------------------------------------- equations

def checkpoint_name_of(eqn: JaxprEqn) -> str | None:
  """The checkpoint name an equation attaches, under either remat mode."""
  if eqn.primitive is name_p:
    return eqn.params["name"]
  if (_call_hi_primitive_p is not None and eqn.primitive is _call_hi_primitive_p
      and _NAME_PRIMS and isinstance(eqn.params.get("_prim"), _NAME_PRIMS)):
    return eqn.params["_prim"].params["name"]
  return None


def is_remat(eqn: JaxprEqn) -> bool:
  """Whether ``eqn`` is a remat region (``remat2``, or remat3's primitive)."""
  if eqn.primitive is remat_p:
    return True
  return (_call_hi_primitive_p is not None
          and eqn.primitive is _call_hi_primitive_p
          and _RematTraced is not None
          and isinstance(eqn.params.get("_prim"), _RematTraced))


def remat_policy_of(eqn: JaxprEqn) -> Any:
  """The policy of a remat equation (remat3 stores ``nothing_saveable`` as None)."""
  if eqn.primitive is remat_p:
    return eqn.params["policy"]
  return eqn.params["_prim"].params["policy"]


def remat_body_of(eqn: JaxprEqn) -> Jaxpr:
  """The body jaxpr of a remat equation."""
  if eqn.primitive is remat_p:
    return eqn.params["jaxpr"]
  return eqn.params["_prim"].params["jaxpr"].jaxpr


def remat_body_consts(eqn: JaxprEqn) -> list[Any]:
  """Constants captured by a remat3 region's body (remat2 bodies have none)."""
  if eqn.primitive is remat_p:
    return []
  return jaxpr_consts(eqn.params["_prim"].params["jaxpr"])


def with_remat(eqn: JaxprEqn, body: Jaxpr, policy: Any) -> JaxprEqn:
  """A copy of remat equation ``eqn`` with another body and policy."""
  if eqn.primitive is remat_p:
    return eqn.replace(params={**eqn.params, "jaxpr": body, "policy": policy})
  old = eqn.params["_prim"]
  extra = ({"prevent_cse": old.params["prevent_cse"]}
           if "prevent_cse" in old.params else {})  # stored from jax 0.11 on
  prim = _RematTraced(close_jaxpr(body, jaxpr_consts(old.params["jaxpr"])),
                      policy, **extra)
  return eqn.replace(params={**eqn.params, "_prim": prim})


def bind_remat(body: Jaxpr, policy: Any, prevent_cse: Any, *args: Any
               ) -> list[Any]:
  """Binds a remat2 region with ``body`` and ``policy`` on ``args``."""
  return remat_p.bind(*args, jaxpr=body, prevent_cse=prevent_cse,
                      differentiated=False, policy=policy)


def is_scan(eqn: JaxprEqn) -> bool:
  """Whether ``eqn`` is a scan, or (jax >= 0.12) a linearized scan node.

  jax 0.12 keeps a scan in the VJP's linear program as ``vjp_node[scan]``.
  """
  name = eqn.primitive.name
  return name == "scan" or (name.endswith("[scan]") and "length" in eqn.params)


def scan_num_carry(eqn: JaxprEqn) -> int:
  """How many of a ``scan`` equation's outputs are carries (the rest stack).

  jax 0.10 stores ``num_carry``; from 0.11 the layout is a flat tree
  ``ft_out`` of (carries, stacked outputs).
  """
  if "num_carry" in eqn.params:
    return int(eqn.params["num_carry"])
  carry, _ = eqn.params["ft_out"].update(list(range(len(eqn.outvars)))).unpack()
  return len(list(carry))


def scan_num_consts(eqn: JaxprEqn) -> int:
  """How many of a ``scan`` equation's inputs are loop constants (the
  carries and the scanned inputs follow them).

  jax 0.10 stores ``num_consts``; from 0.11 the layout is a flat tree
  ``ft_in`` of (constants, carries, scanned inputs).
  """
  if "num_consts" in eqn.params:
    return int(eqn.params["num_consts"])
  consts, _, _ = eqn.params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
  return len(list(consts))


def inner_jaxpr(value: Any) -> Jaxpr:
  """The open jaxpr of a jaxpr-valued equation parameter."""
  return value.jaxpr if isinstance(value, ClosedJaxpr) else value


def rewrap_jaxpr(old: Any, new_inner: Jaxpr) -> Any:
  """``new_inner`` in the form ``old`` had (closed with its consts, or open)."""
  if ClosedJaxpr is Jaxpr:  # jax >= 0.11: one class, constants ride along
    consts = jaxpr_consts(old)
    if jaxpr_consts(new_inner) or not consts:
      return new_inner
    return close_jaxpr(new_inner, consts)
  if isinstance(old, ClosedJaxpr):
    return close_jaxpr(new_inner, old.consts)
  return new_inner


def is_jaxpr_value(value: Any) -> bool:
  """Whether an equation parameter is a (closed) jaxpr."""
  return isinstance(value, (Jaxpr, ClosedJaxpr))


# ---------------------------------------------------------------- kernels

def _same_type(a: Any, b: Any) -> bool:
  return (type(a) is type(b) and getattr(a, "shape", None) == getattr(b, "shape", None)
          and getattr(a, "dtype", None) == getattr(b, "dtype", None))


def call_body(eqn: JaxprEqn) -> Jaxpr | None:
  """The body of a call-like equation, None for any other equation.

  Call-like: one nested jaxpr, run once, whose inputs and outputs are the
  equation's own, one to one and of the same types (``jit``,
  ``closed_call``, jax 0.12's ``eval_jaxpr``, ``custom_jvp_call``,
  ``custom_vjp_call``, a remat region). Detected by that shape, not by
  name, so a release that renames or adds such a primitive is followed;
  loops (``scan``), branches and kernels whose body works on refs
  (``pallas_call``) are not call-like.
  """
  if is_leaf(eqn):
    return None
  hidden = hidden_jaxprs(eqn)
  if hidden:
    body = hidden[0]
  else:
    if is_scan(eqn) or "length" in eqn.params:
      return None
    bodies = []
    for value in eqn.params.values():
      if is_jaxpr_value(value):
        bodies.append(value)
      elif isinstance(value, tuple) and any(is_jaxpr_value(v) for v in value):
        return None  # branches
    if len(bodies) != 1:
      return None
    body = inner_jaxpr(bodies[0])
  if (len(body.invars) != len(eqn.invars)
      or len(body.outvars) != len(eqn.outvars)):
    return None
  pairs = [*zip(body.invars, eqn.invars, strict=True),
           *zip(body.outvars, eqn.outvars, strict=True)]
  if not all(_same_type(a.aval, b.aval) for a, b in pairs):
    return None
  return body


def _custom_vjp3_of(eqn: JaxprEqn) -> Any:
  """The hijax primitive of a custom_vjp call made with ``jax_custom_vjp3``."""
  prim = eqn.params.get("_prim")
  if (_call_hi_primitive_p is not None and eqn.primitive is _call_hi_primitive_p
      and _CustomVJPTraced is not None and isinstance(prim, _CustomVJPTraced)):
    return prim
  return None


#: Primitives seen carrying no jaxpr (an add, a dot): a primitive's
#: parameters have one schema, so its other equations carry none either.
#: Walks over a 48-layer step ask this of every equation, for every policy.
_LEAF_PRIMITIVES: set[Any] = set()


def is_leaf(eqn: JaxprEqn) -> bool:
  """Whether ``eqn`` is known to run no nested jaxpr (cheap; False when
  not known yet)."""
  return eqn.primitive in _LEAF_PRIMITIVES


def note_leaf(eqn: JaxprEqn) -> None:
  """Records that ``eqn``'s primitive carries no jaxpr; not the hijax call
  primitive, which one param (``_prim``) makes a remat3 region, a
  custom_vjp3 call or anything else."""
  if eqn.primitive is not _call_hi_primitive_p and "_prim" not in eqn.params:
    _LEAF_PRIMITIVES.add(eqn.primitive)


def hidden_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
  """Jaxprs an equation runs that are no parameter of its own: a remat3
  region's body, a ``jax_custom_vjp3`` call's primal function."""
  if is_leaf(eqn):
    return []
  if is_remat(eqn):
    return [remat_body_of(eqn)]
  prim = _custom_vjp3_of(eqn)
  if prim is not None:
    return [inner_jaxpr(prim.traced.jaxpr)]
  return []


def is_custom_vjp_call(eqn: JaxprEqn) -> bool:
  """Whether ``eqn`` calls a ``jax.custom_vjp`` function (either
  implementation: ``jax_custom_vjp3`` makes it a hijax call)."""
  return ((_custom_vjp_call_p is not None and eqn.primitive is _custom_vjp_call_p)
          or _custom_vjp3_of(eqn) is not None)


def is_pallas_call(eqn: JaxprEqn) -> bool:
  """Whether ``eqn`` runs a Pallas kernel (a body over a grid of blocks)."""
  return "grid_mapping" in eqn.params and is_jaxpr_value(eqn.params.get("jaxpr"))


def _debug_name(value: Any) -> str | None:
  info = getattr(inner_jaxpr(value), "debug_info", None)
  name = getattr(info, "func_name", None)
  return None if not name or name.startswith("<") else name


def kernel_name(eqn: JaxprEqn) -> str | None:
  """The name of a kernel equation, None for any other equation.

  A kernel is a ``jax.custom_vjp`` call (named after the decorated
  function) or a ``pallas_call`` (named by its ``name`` parameter, else
  after its kernel function).
  """
  prim = _custom_vjp3_of(eqn)
  if prim is not None:
    return getattr(prim.traced, "fun_name", None) or "custom_vjp"
  if is_custom_vjp_call(eqn):
    return _debug_name(eqn.params["call_jaxpr"]) or "custom_vjp"
  if is_pallas_call(eqn):
    return eqn.params.get("name") or _debug_name(eqn.params["jaxpr"]) or "pallas_call"
  return None


def pallas_grid_size(eqn: JaxprEqn) -> int:
  """How many times a ``pallas_call``'s body runs: the product of its grid."""
  grid = getattr(eqn.params["grid_mapping"], "grid", ()) or ()
  size = 1
  for g in grid:
    size *= int(g) if isinstance(g, int) else 1  # a dynamic size counts once
  return size


def pallas_cost_flops(eqn: JaxprEqn) -> int | None:
  """The FLOPs a ``pallas_call`` declares in its ``cost_estimate``, if any."""
  cost = eqn.params.get("cost_estimate")
  flops = getattr(cost, "flops", None)
  return None if flops is None else int(flops)


def custom_vjp_forward(eqn: JaxprEqn) -> Jaxpr | None:
  """The forward rule of a ``custom_vjp`` call, traced as a jaxpr.

  JAX traces it lazily (and memoises it) when the call is differentiated;
  the primal program holds only the undifferentiated function, so names and
  matmuls that only the forward rule has are found here. None for other
  equations, or when the rule cannot be traced outside differentiation.
  """
  prim = _custom_vjp3_of(eqn)
  if prim is not None:
    return _custom_vjp3_forward(prim)
  if not is_custom_vjp_call(eqn):
    return None
  thunk = eqn.params.get("fwd_jaxpr_thunk")
  if thunk is None:
    return None
  primals = len(eqn.invars) - int(eqn.params.get("num_consts", 0))
  try:
    fwd, _ = thunk.call_wrapped(*([True] * primals))
  except Exception:  # noqa: BLE001 - a rule that needs differentiation to trace
    return None
  return inner_jaxpr(fwd)


def _custom_vjp3_forward(prim: Any) -> Jaxpr | None:
  """The forward rule of a ``jax_custom_vjp3`` call, traced on its inputs'
  types as JAX's JVP calls it (``vjp_fwd(nonzero_tangents, *args)``).

  jax 0.12 prepends a closure-constants slot that must get no tangent; jax
  0.10 has none: each form is tried in turn.
  """
  def forward(first_nonzero: bool, *flat: Any) -> list[Any]:
    args = jax.tree_util.tree_unflatten(prim.in_tree, flat)
    nonzero = [jax.tree_util.tree_map(lambda _: True, a) for a in args]
    if args and not first_nonzero:
      nonzero[0] = jax.tree_util.tree_map(lambda _: False, args[0])
    return jax.tree_util.tree_leaves(prim.vjp_fwd(tuple(nonzero), *args))

  for first_nonzero in (True, False):
    try:
      return jax.make_jaxpr(functools.partial(forward, first_nonzero))(
          *prim.in_avals_flat).jaxpr
    except Exception:  # noqa: BLE001, S112 - the other form, or untraceable
      continue
  return None


def has_python_transpose(eqn: JaxprEqn) -> bool:
  """Whether a linearized equation is transposed by Python code rather than
  a jaxpr (a ``custom_vjp``'s backward rule): its cost is not in the
  linearized program."""
  return _custom_lin_p is not None and eqn.primitive is _custom_lin_p


#: How a kernel's scope starts in a name stack (:func:`mark_kernel`).
_KERNEL_MARK = "remat_toolkit.kernel:"


def mark_kernel(eqn: JaxprEqn, name: str) -> JaxprEqn:
  """``eqn`` with a scope naming kernel ``name`` at the end of its name stack.

  JAX carries an equation's name stack onto everything differentiating it
  makes, in both remat implementations: the forward rule traced inline,
  a forward run again in the backward pass, the backward rule. So the mark
  finds a kernel's work in the training step where nothing else can (remat3
  re-traces regions with fresh tracebacks). It is no module scope
  (:func:`is_scope`), so module paths leave it out.
  """
  return prefix_scopes(eqn, (_source_info_util.Scope(_KERNEL_MARK + name),))


def _kernel_mark_name(item: Any) -> str | None:
  name = getattr(item, "name", None)
  if isinstance(item, _source_info_util.Scope) and isinstance(name, str) and (
      name.startswith(_KERNEL_MARK)):
    return name[len(_KERNEL_MARK):]
  return None


def kernel_mark_of(eqn: JaxprEqn) -> tuple[str, list[str]] | None:
  """The kernel :func:`mark_kernel` marked ``eqn`` (or what made it) with:
  ``(name, module scopes above the mark)``; None if unmarked."""
  scopes: list[str] = []
  for item in eqn.source_info.name_stack.stack:
    name = _kernel_mark_name(item)
    if name is not None:
      return name, scopes
    if is_scope(item) and item.name not in _JAX_SCOPES:
      scopes.append(item.name)
  return None


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


# ---------------------------------------------------------------- name stacks

def is_scope(item: Any) -> bool:
  """Whether a name-stack item is a module scope (not a transform, nor the
  mark of a kernel: :func:`mark_kernel`)."""
  return (isinstance(item, _source_info_util.Scope)
          and _kernel_mark_name(item) is None)


#: Scopes JAX itself pushes (around a region run again in the backward
#: pass), which name no module of the model.
_JAX_SCOPES = frozenset({"rematted_computation"})


def module_scopes(eqn: JaxprEqn) -> list[str]:
  """The module scopes of ``eqn``'s name stack, transforms and the scopes
  JAX adds itself dropped."""
  return [s.name for s in eqn.source_info.name_stack.stack
          if is_scope(s) and s.name not in _JAX_SCOPES]


def leading_scopes(eqn: JaxprEqn) -> tuple[Any, ...]:
  """The raw name-stack items of ``eqn``."""
  return tuple(eqn.source_info.name_stack.stack)


def drop_leading_scopes(eqn: JaxprEqn, count: int) -> JaxprEqn:
  """``eqn`` with the first ``count`` name-stack items removed."""
  stack = eqn.source_info.name_stack.stack[count:]
  return eqn.replace(source_info=eqn.source_info.replace(
      name_stack=_ext_source_info.NameStack(tuple(stack))))


def nest_scopes(eqn: JaxprEqn, outer: JaxprEqn) -> JaxprEqn:
  """``eqn`` with ``outer``'s name stack in front of its own: an equation of
  a body moved out of the call ``outer`` (whose scopes JAX would prefix)."""
  stack = (tuple(outer.source_info.name_stack.stack)
           + tuple(eqn.source_info.name_stack.stack))
  return eqn.replace(source_info=eqn.source_info.replace(
      name_stack=_ext_source_info.NameStack(stack)))


def prefix_scopes(eqn: JaxprEqn, items: tuple[Any, ...]) -> JaxprEqn:
  """``eqn`` with ``items`` appended to its name stack."""
  stack = tuple(eqn.source_info.name_stack.stack) + tuple(items)
  return eqn.replace(source_info=eqn.source_info.replace(
      name_stack=_ext_source_info.NameStack(stack)))


@contextlib.contextmanager
def eval_context(eqn: JaxprEqn) -> Iterator[None]:
  """Re-binds ``eqn``'s traceback and name stack while it is evaluated."""
  name_stack = (_ext_source_info.current_name_stack()
                + eqn.source_info.name_stack)
  with _ext_source_info.user_context(eqn.source_info.traceback,
                                     name_stack=name_stack):
    yield


def user_source(eqn: JaxprEqn, skip: Callable[[str], bool]) -> str:
  """``file:line (function)`` of the first user frame ``skip`` lets through."""
  for frame in _source_info_util.user_frames(eqn.source_info.traceback):
    if not skip(frame.file_name):
      return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
  return ""


# ---------------------------------------------------------------- flax hooks

def flax_lift_pack(inner: Callable[..., Any], name: str) -> Callable[..., Any]:
  """``flax.core.lift.pack`` over every variable and rng collection."""
  from flax.core import lift
  return lift.pack(inner, (True,), (True,), (True,), name=name,
                   enable_kwargs=True)


def linen_scope_path(scope_tree: Any) -> tuple[str, ...]:
  """The module path of the module a linen lifted transform is applied to.

  Flax passes the scopes of module arguments and attributes first and the
  module's own scope last (``linen.transforms.get_module_scopes``).
  """
  from flax.core import Scope
  scopes = [s for s in jax.tree_util.tree_leaves(
      scope_tree, is_leaf=lambda x: isinstance(x, Scope))
            if isinstance(s, Scope)]
  return tuple(str(p) for p in scopes[-1].path) if scopes else ()


def linen_lift_transform(transform: Callable[..., Any], target: Any,
                         **kwargs: Any) -> Any:
  """Flax linen's ``lift_transform`` (a lifted transform of a Module class)."""
  from flax.linen import transforms as linen_transforms
  return linen_transforms.lift_transform(transform, target, **kwargs)


def is_linen_remat(module: Any) -> bool:
  """Whether ``module`` was made by Flax's ``nn.remat`` / ``nn.checkpoint``.

  Flax's lifted transforms subclass the module class they lift and name the
  subclass after the transform (``nn.remat(Block)`` is ``CheckpointBlock``);
  detected by that shape, so it holds for every linen release we support.
  """
  bases = type(module).__mro__[1:2]
  return bool(bases) and type(module).__name__ == "Checkpoint" + bases[0].__name__


def linen_decorator_lift_transform(transform: Callable[..., Any],
                                   method: Callable[..., Any],
                                   **kwargs: Any) -> Callable[..., Any]:
  """Flax linen's ``decorator_lift_transform`` (a lifted method)."""
  from flax.linen import transforms as linen_transforms
  return linen_transforms.decorator_lift_transform(transform, method, **kwargs)


def nnx_split_inputs(f: Callable[..., Any], ctxtag: str) -> Callable[..., Any]:
  """Flax NNX's ``split_inputs``: graph nodes in, graph updates written back.

  With :func:`nnx_merge_inputs` inside a JAX transform it lifts that
  transform the way ``nnx.remat`` lifts ``jax.checkpoint``, so attribute,
  Variable and structure updates made inside reach the caller's modules.
  """
  from flax.nnx.transforms import general
  return general.split_inputs(f, ctxtag=ctxtag)


def nnx_merge_inputs(f: Callable[..., Any], ctxtag: str) -> Callable[..., Any]:
  """Flax NNX's ``merge_inputs``, the inner half of :func:`nnx_split_inputs`."""
  from flax.nnx.transforms import general
  return general.merge_inputs(f, ctxtag=ctxtag)


def is_nnx_node_states(x: Any) -> bool:
  """Whether ``x`` is the pytree ``nnx_split_inputs`` puts for a graph node."""
  from flax.nnx import extract
  return isinstance(x, extract.NodeStates)


# ---------------------------------------------------------------- custom_vjp

_CustomVJP3: type[Any] | None
try:  # the class jax.custom_vjp returns under jax_custom_vjp3
  from jax._src.hijax import custom_vjp3 as _CustomVJP3
except ImportError:  # pragma: no cover - depends on the JAX release
  _CustomVJP3 = None


class CustomVJPRules(NamedTuple):
  """What a ``jax.custom_vjp`` function is made of, whichever class made it.

  ``fwd`` and ``bwd`` are None until ``defvjp`` is called; ``unsupported``
  names a rule kind beyond ``defvjp`` (jax 0.12's ``defremat``,
  ``defvjp_with_logs``, ...) that a copy made from these parts would lose.
  """

  fun: Callable[..., Any]
  fwd: Callable[..., Any] | None
  bwd: Callable[..., Any] | None
  nondiff_argnums: tuple[int, ...]
  symbolic_zeros: bool
  optimize_remat: bool
  unsupported: str | None


def custom_vjp_rules(fn: Any) -> CustomVJPRules | None:
  """The parts of ``fn`` if it is a ``jax.custom_vjp`` function, else None.

  ``jax.custom_vjp`` returns one of two classes: its own, or, with
  ``jax_custom_vjp3`` on, hijax's ``custom_vjp3``, whose fields are spelt
  differently (``f``, ``static_argnums``, ``symz``, ``opt_remat``).
  """
  if isinstance(fn, jax.custom_vjp):
    return CustomVJPRules(fn.fun, fn.fwd, fn.bwd, tuple(fn.nondiff_argnums),
                          bool(fn.symbolic_zeros), bool(fn.optimize_remat),
                          None)
  if _CustomVJP3 is not None and isinstance(fn, _CustomVJP3):
    extras = [kind for kind, field in (
        ("defremat", "remat_rules"), ("defvjp_with_logs", "with_logs"),
        ("defvjp_with_accums", "with_accums"),
        ("generic batching", "generic_batching")) if getattr(fn, field, None)]
    return CustomVJPRules(fn.f, fn.fwd, fn.bwd, tuple(sorted(fn.static_argnums)),
                          bool(fn.symz), bool(fn.opt_remat),
                          ", ".join(extras) or None)
  return None
