"""Equations of a jaxpr: remat regions, scans and name stacks.

Remat regions under either implementation (``remat2``'s primitive, or
remat3's through hijax's call primitive), the checkpoint names equations
attach, a scan's layout of inputs and outputs across releases, and an
equation's name stack: its module scopes, the scopes moved when a body is
rewritten, and the mark that follows a kernel through differentiation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import source_info_util as _source_info_util
from jax.extend import source_info_util as _ext_source_info

from remat_toolkit._src.core.compat.jaxpr_types import Jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import JaxprEqn
from remat_toolkit._src.core.compat.jaxpr_types import _call_hi_primitive_p
from remat_toolkit._src.core.compat.jaxpr_types import close_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import jaxpr_consts
from remat_toolkit._src.core.compat.jaxpr_types import name_p
from remat_toolkit._src.core.compat.jaxpr_types import remat_p

__all__ = [
    "checkpoint_name_of", "is_remat", "remat_policy_of", "remat_body_of",
    "remat_body_consts", "with_remat", "bind_remat", "is_scan", "scan_num_carry",
    "scan_num_consts", "is_scope", "module_scopes", "leading_scopes",
    "drop_leading_scopes", "nest_scopes", "prefix_scopes", "eval_context",
    "user_source", "mark_kernel", "kernel_mark_of",
]


_CheckpointName = getattr(_ad_checkpoint, "CheckpointName", None)
_CheckpointNameFwd = getattr(_ad_checkpoint, "CheckpointNameFwd", None)
# Any: a private class, probed because a release may not have it.
_RematTraced: Any = getattr(_ad_checkpoint, "RematTraced", None)
_NAME_PRIMS = tuple(t for t in (_CheckpointName, _CheckpointNameFwd)
                    if t is not None)


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


# ---------------------------------------------------------------- kernel marks

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
