"""Every use of JAX internals in remat-toolkit lives here.

JAX's remat implementations, jaxpr structure and private helpers move between
releases; keeping them in one module means a JAX release changes one file, and
``tests/test_jax_internals.py`` pins the behaviour relied on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import core as jax_core
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src import source_info_util as _source_info_util

try:  # remat3 lives behind hijax's call primitive; older releases lack it.
  from jax._src.hijax import call_hi_primitive_p as _call_hi_primitive_p
except ImportError:  # pragma: no cover - depends on the JAX release
  _call_hi_primitive_p = None

Jaxpr = _core.Jaxpr
ClosedJaxpr = _core.ClosedJaxpr
JaxprEqn = _core.JaxprEqn
Var = _core.Var
Literal = _core.Literal

name_p = _ad_checkpoint.name_p
remat_p = _ad_checkpoint.remat_p
SaveOnlyTheseNames = _ad_checkpoint.SaveOnlyTheseNames
DotsSaveable = _ad_checkpoint.DotsSaveable
_CheckpointName = getattr(_ad_checkpoint, "CheckpointName", None)
_RematTraced = getattr(_ad_checkpoint, "RematTraced", None)

#: JAX's own policy classes that ``jax_remat3`` honours (by type, not call).
REMAT3_POLICY_TYPES: tuple[type, ...] = (
    _ad_checkpoint.SaveOnlyTheseNames,
    _ad_checkpoint.SaveAnyNamesButThese,
    _ad_checkpoint.DotsSaveable,
)


# ---------------------------------------------------------------- remat3 flag

def remat3_enabled() -> bool:
  """Whether ``jax_remat3`` (the incoming remat implementation) is on."""
  return bool(jax.config.jax_remat3)


@contextlib.contextmanager
def remat3(enabled: bool) -> Iterator[None]:
  """Sets ``jax_remat3`` for the duration of the block, then restores it."""
  before = remat3_enabled()
  jax.config.update("jax_remat3", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_remat3", before)


def remat3_honours(policy: Any) -> bool:
  """Whether ``policy`` keeps its meaning under ``jax_remat3``.

  Under remat3 only JAX's own policy classes and the two plain functions
  ``everything_saveable`` / ``nothing_saveable`` are understood; any other
  callable silently becomes full recomputation.
  """
  return (isinstance(policy, REMAT3_POLICY_TYPES)
          or policy is _ad_checkpoint.everything_saveable
          or policy is _ad_checkpoint.nothing_saveable)


# ---------------------------------------------------------------- equations

def checkpoint_name_of(eqn: JaxprEqn) -> str | None:
  """The checkpoint name an equation attaches, under either remat mode."""
  if eqn.primitive is name_p:
    return eqn.params["name"]
  if (_call_hi_primitive_p is not None and eqn.primitive is _call_hi_primitive_p
      and _CheckpointName is not None
      and isinstance(eqn.params.get("_prim"), _CheckpointName)):
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
  """The policy of a remat equation."""
  if eqn.primitive is remat_p:
    return eqn.params["policy"]
  return eqn.params["_prim"].params["policy"]


def remat_body_of(eqn: JaxprEqn) -> Jaxpr:
  """The body jaxpr of a remat equation."""
  if eqn.primitive is remat_p:
    return eqn.params["jaxpr"]
  return eqn.params["_prim"].params["jaxpr"].jaxpr


def with_remat(eqn: JaxprEqn, body: Jaxpr, policy: Any) -> JaxprEqn:
  """A copy of remat equation ``eqn`` with another body and policy."""
  if eqn.primitive is remat_p:
    return eqn.replace(params={**eqn.params, "jaxpr": body, "policy": policy})
  old = eqn.params["_prim"].params["jaxpr"]
  prim = _RematTraced(ClosedJaxpr(body, old.consts), policy)
  return eqn.replace(params={**eqn.params, "_prim": prim})


def _subjaxpr_items(eqn: JaxprEqn) -> Iterator[tuple[str, int | None, Any]]:
  for key, value in eqn.params.items():
    if isinstance(value, (Jaxpr, ClosedJaxpr)):
      yield key, None, value
    elif isinstance(value, tuple) and value and all(
        isinstance(v, (Jaxpr, ClosedJaxpr)) for v in value):
      for i, v in enumerate(value):
        yield key, i, v


def sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
  """The jaxprs nested in ``eqn`` (scan/cond/pjit/remat/custom rules)."""
  if is_remat(eqn) and eqn.primitive is not remat_p:
    return [remat_body_of(eqn)]
  return [v.jaxpr if isinstance(v, ClosedJaxpr) else v
          for _, _, v in _subjaxpr_items(eqn)]


def map_sub_jaxprs(eqn: JaxprEqn, fn: Callable[[Jaxpr], Jaxpr]) -> JaxprEqn:
  """A copy of ``eqn`` whose nested jaxprs went through ``fn``."""
  params = dict(eqn.params)
  changed = False
  for key, index, value in _subjaxpr_items(eqn):
    inner = value.jaxpr if isinstance(value, ClosedJaxpr) else value
    new_inner = fn(inner)
    if new_inner is inner:
      continue
    changed = True
    new_value = (ClosedJaxpr(new_inner, value.consts)
                 if isinstance(value, ClosedJaxpr) else new_inner)
    if index is None:
      params[key] = new_value
    else:
      items = list(params[key])
      items[index] = new_value
      params[key] = tuple(items)
  return eqn.replace(params=params) if changed else eqn


def scan_length(eqn: JaxprEqn) -> int:
  """Trip count of a ``scan`` equation, 1 for anything else."""
  if eqn.primitive.name == "scan":
    return int(eqn.params["length"])
  return 1


def scan_layout(eqn: JaxprEqn) -> tuple[int, int, int]:
  """``(num_consts, num_carry, num_xs)`` of a scan equation."""
  num_consts = eqn.params["num_consts"]
  num_carry = eqn.params["num_carry"]
  return num_consts, num_carry, len(eqn.invars) - num_consts - num_carry


def module_path(eqn: JaxprEqn) -> str:
  """The name-stack scopes of ``eqn`` (Flax module path), transforms dropped."""
  stack = eqn.source_info.name_stack.stack
  return "/".join(s.name for s in stack
                  if isinstance(s, _source_info_util.Scope))


def source_of(eqn: JaxprEqn) -> str:
  """``file:line (function)`` of the user frame that made ``eqn``."""
  return _source_info_util.summarize(eqn.source_info)


def memory_kind_of(aval: Any) -> str:
  """``"device"`` or a host memory kind, read from an abstract value."""
  space = getattr(aval, "memory_space", None)
  text = str(space).lower() if space is not None else ""
  return "host" if "host" in text else "device"


def offload_destination(eqn: JaxprEqn) -> str | None:
  """The memory kind a ``device_put`` moves to, if it moves to host memory."""
  if eqn.primitive.name != "device_put":
    return None
  for dev in eqn.params.get("devices", ()):
    kind = getattr(dev, "memory_kind", None) or str(dev)
    if "host" in str(kind).lower():
      return "host"
  return None


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[Any, str]]:
  """JAX's own list of residuals (aval, description) for ``fn(*args)``."""
  return _ad_checkpoint.saved_residuals(fn, *args)


def is_jaxpr_var(x: Any) -> bool:
  return isinstance(x, Var) and not isinstance(x, Literal)


def eval_jaxpr(jaxpr: Jaxpr, consts: list[Any], *args: Any) -> list[Any]:
  return jax_core.eval_jaxpr(jaxpr, consts, *args)
