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
from jax._src.interpreters import partial_eval as _pe

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


_PACKAGE_DIR = __import__("os").path.dirname(__file__) + __import__("os").sep
_MODELS_DIR = _PACKAGE_DIR + "models" + __import__("os").sep


def _is_toolkit_plumbing(file_name: str) -> bool:
  # Frames of the toolkit's own wrappers (tag, remat, ...) say nothing about
  # where in the model a value was made; the built-in models do.
  return file_name.startswith(_PACKAGE_DIR) and not file_name.startswith(_MODELS_DIR)


def source_of(eqn: JaxprEqn) -> str:
  """``file:line (function)`` of the user frame that made ``eqn``."""
  for frame in _source_info_util.user_frames(eqn.source_info.traceback):
    if not _is_toolkit_plumbing(frame.file_name):
      return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
  return ""


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


# ====================================================================
# Analysis: trace once, swap region policies, walk residuals and FLOPs.
# ====================================================================

import dataclasses as _dataclasses
import math as _math

import numpy as _np


def trace_program(fn: Callable, leaves: list[Any]) -> tuple[ClosedJaxpr, Any]:
  """``make_jaxpr`` of ``fn`` over flat leaves; returns (jaxpr, out shape)."""
  return jax.make_jaxpr(fn, return_shape=True)(*leaves)


def names_in(jaxpr: Jaxpr) -> frozenset[str]:
  """Every checkpoint name in ``jaxpr`` and the jaxprs nested in it."""
  found: set[str] = set()
  stack = [jaxpr]
  while stack:
    j = stack.pop()
    for eqn in j.eqns:
      name = checkpoint_name_of(eqn)
      if name is not None:
        found.add(name)
      stack.extend(sub_jaxprs(eqn))
  return frozenset(found)


def count_remat_regions(jaxpr: Jaxpr, marker: Any = None) -> int:
  """Remat regions in ``jaxpr`` (only those with policy ``marker`` if given)."""
  total = 0
  for eqn in jaxpr.eqns:
    if is_remat(eqn) and (marker is None or remat_policy_of(eqn) is marker):
      total += 1
    for sub in sub_jaxprs(eqn):
      total += count_remat_regions(sub, marker)
  return total


def substitute_policy(jaxpr: Jaxpr, marker: Any,
                      choose: Callable[[frozenset[str]], Any]) -> Jaxpr:
  """Replaces the policy of every remat region whose policy is ``marker``.

  ``choose(names_in_region)`` gives the JAX policy for each such region. The
  rest of the program is shared, not re-traced.
  """
  cache: dict[int, Jaxpr] = {}

  def visit(j: Jaxpr) -> Jaxpr:
    if id(j) in cache:
      return cache[id(j)]
    new_eqns = []
    changed = False
    for eqn in j.eqns:
      new = eqn
      if is_remat(eqn):
        body = remat_body_of(eqn)
        new_body = visit(body)
        policy = remat_policy_of(eqn)
        if policy is marker:
          policy = choose(names_in(body))
        if new_body is not body or policy is not remat_policy_of(eqn):
          new = with_remat(eqn, new_body, policy)
      else:
        new = map_sub_jaxprs(eqn, visit)
      changed |= new is not eqn
      new_eqns.append(new)
    out = j.replace(eqns=new_eqns) if changed else j
    cache[id(j)] = out
    return out

  return visit(jaxpr)


@_dataclasses.dataclass(frozen=True)
class TracedStep:
  """Forward pass with residuals, plus what the backward pass costs.

  ``jaxpr`` has outvars ``[loss, *residuals]``; ``backward_flops`` counts the
  matmul FLOPs of the backward pass, recomputation included.
  """

  jaxpr: ClosedJaxpr
  num_residuals: int
  backward_flops: int


def trace_training_step(jaxpr: Jaxpr, consts: list[Any], leaves: list[Any],
                        forward_flops: int) -> TracedStep:
  """Traces ``jax.vjp`` of ``jaxpr`` and measures its backward pass.

  Under remat2 the backward cost is read off the linearized jaxpr JAX keeps
  in the VJP (each linear matmul transposes to one matmul of equal cost, and
  remat regions carry their recomputation), so the backward pass is never
  traced. remat3 hides its linear program inside an opaque primitive, so
  there the backward pass is traced and dead code dropped.
  """
  evaluate = eval_jaxpr if remat3_enabled() else eval_with_jitted_regions

  def loss(*xs):
    return evaluate(jaxpr, consts, *xs)[0]

  captured: list[Any] = []

  def forward(*xs):
    out, vjp_fn = jax.vjp(loss, *xs)
    captured.append(vjp_fn)
    return out, jax.tree_util.tree_leaves(vjp_fn)

  closed = jax.make_jaxpr(forward)(*leaves)
  num_res = len(closed.jaxpr.outvars) - 1
  linear = getattr(captured[0], "jaxpr", None)
  if linear is not None and not remat3_enabled():
    return TracedStep(closed, num_res, count_matmul_flops(linear))
  return TracedStep(closed, num_res,
                    _traced_step_flops(loss, leaves) - forward_flops)


def _traced_step_flops(loss: Callable, leaves: list[Any]) -> int:
  def step(*xs):
    out, vjp_fn = jax.vjp(loss, *xs)
    return out, vjp_fn(jax.numpy.ones_like(out))

  closed = jax.make_jaxpr(step)(*leaves)
  # remat3 leaves dead recomputation in the traced program (XLA drops it).
  live, _ = _pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars),
                          instantiate=True)
  return count_matmul_flops(live)


@_dataclasses.dataclass(frozen=True)
class ResidualOrigin:
  """Where one residual comes from, as read off the step jaxpr."""

  aval: Any
  kind: str            # "argument" | "activation"
  name: str | None
  primitive: str
  module_path: str
  source: str
  memory_kind: str
  stacked: int
  arg_index: int | None


def _producers(jaxpr: Jaxpr) -> dict[Any, JaxprEqn]:
  return {v: e for e in jaxpr.eqns for v in e.outvars if is_jaxpr_var(v)}


def _trace_origin(var: Any, jaxpr: Jaxpr, prefix: str, stacked: int,
                  host: bool, producers_cache: dict[int, dict]) -> dict:
  """Follows ``var`` through scan/jit/remat bodies to its named producer."""
  if id(jaxpr) not in producers_cache:
    producers_cache[id(jaxpr)] = _producers(jaxpr)
  eqn = producers_cache[id(jaxpr)].get(var)
  if eqn is None:  # an input of the enclosing body: the region/loop input
    return dict(name=None, primitive="input", module_path=prefix,
                source="", stacked=stacked, host=host)
  path = _join(prefix, module_path(eqn))
  name = checkpoint_name_of(eqn)
  if name is not None:
    return dict(name=name, primitive=_named_primitive(eqn, producers_cache,
                                                      jaxpr),
                module_path=path, source=source_of(eqn), stacked=stacked,
                host=host)
  prim = eqn.primitive.name
  if prim == "reduce_precision" or (prim == "device_put"
                                    and len(eqn.invars) == 1):
    host = host or offload_destination(eqn) == "host"
    inner = eqn.invars[0]
    if is_jaxpr_var(inner):
      return _trace_origin(inner, jaxpr, prefix, stacked, host, producers_cache)
  if prim == "device_put" and len(eqn.invars) > 1:
    host = host or offload_destination(eqn) == "host"
    inner = eqn.invars[eqn.outvars.index(var)]
    if is_jaxpr_var(inner):
      return _trace_origin(inner, jaxpr, prefix, stacked, host, producers_cache)
  index = eqn.outvars.index(var)
  if prim == "scan":
    body = eqn.params["jaxpr"].jaxpr
    n_carry = eqn.params["num_carry"]
    if index >= n_carry:  # stacked output: per-iteration value in the body
      inner = body.outvars[index]
      if is_jaxpr_var(inner):
        return _trace_origin(inner, body, path, stacked * scan_length(eqn),
                             host, producers_cache)
  elif prim in ("pjit", "jit", "closed_call", "core_call") or is_remat(eqn):
    subs = sub_jaxprs(eqn)
    if len(subs) == 1 and len(subs[0].outvars) == len(eqn.outvars):
      inner = subs[0].outvars[index]
      if is_jaxpr_var(inner):
        found = _trace_origin(inner, subs[0], path, stacked, host,
                              producers_cache)
        if found["primitive"] != "input":
          return found
  return dict(name=None, primitive=prim, module_path=path,
              source=source_of(eqn), stacked=stacked, host=host)


def _named_primitive(eqn: JaxprEqn, cache: dict, jaxpr: Jaxpr) -> str:
  """The primitive that produced the value a checkpoint name was put on."""
  inner = eqn.invars[0] if eqn.invars else None
  if is_jaxpr_var(inner):
    producer = cache[id(jaxpr)].get(inner)
    if producer is not None:
      return producer.primitive.name
  return "name"


def _join(prefix: str, path: str) -> str:
  if not prefix:
    return path
  if not path or path == prefix or path.startswith(prefix + "/"):
    return path or prefix
  return f"{prefix}/{path}"


def residual_origins(step: ClosedJaxpr, num_out: int, num_res: int
                     ) -> list[ResidualOrigin]:
  """One :class:`ResidualOrigin` per residual of a traced training step.

  Mirrors ``jax.ad_checkpoint.saved_residuals`` (same residual set, same
  order of categories) but follows names into scan, jit and remat bodies.
  """
  jaxpr = step.jaxpr
  res_vars = jaxpr.outvars[num_out:num_out + num_res]
  subst = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
           if e.primitive.name == "reduce_precision"}
  invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
  cache: dict[int, dict] = {}
  origins = []
  seen: set[Any] = set()
  for v in res_vars:
    if isinstance(v, Literal):
      origins.append(ResidualOrigin(v.aval, "activation", None, "literal", "",
                                    "", "device", 1, None))
      continue
    base = subst.get(v, v)
    if base in seen:
      continue
    seen.add(base)
    if base in invar_index or base in jaxpr.constvars:
      origins.append(ResidualOrigin(
          base.aval, "argument", None, "argument", "", "",
          memory_kind_of(base.aval), 1, invar_index.get(base)))
      continue
    found = _trace_origin(base, jaxpr, "", 1, False, cache)
    kind = "host" if found["host"] or memory_kind_of(v.aval) == "host" else "device"
    origins.append(ResidualOrigin(
        v.aval, "activation", found["name"], found["primitive"],
        found["module_path"], found["source"], kind, found["stacked"], None))
  return origins


def aval_nbytes(aval: Any) -> int:
  """Bytes of an abstract value (all of it, stacked axes included)."""
  return int(_math.prod(aval.shape)) * _np.dtype(aval.dtype).itemsize


# ---------------------------------------------------------------- FLOPs

def _dot_flops(eqn: JaxprEqn) -> int:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval
  out = eqn.outvars[0].aval
  k = _math.prod(lhs.shape[d] for d in lhs_contract)
  return 2 * int(_math.prod(out.shape)) * int(k)


def _conv_flops(eqn: JaxprEqn) -> int:
  rhs = eqn.invars[1].aval
  out = eqn.outvars[0].aval
  dn = eqn.params["dimension_numbers"]
  rhs_spec = dn.rhs_spec  # (out feature, in feature, *spatial)
  kernel = _math.prod(rhs.shape[d] for d in rhs_spec[2:])
  in_per_group = rhs.shape[rhs_spec[1]]
  return 2 * int(_math.prod(out.shape)) * int(kernel) * int(in_per_group)


def count_matmul_flops(jaxpr: Jaxpr) -> int:
  """Matmul and convolution FLOPs of ``jaxpr``, scan bodies times trip count.

  ``cond`` counts its most expensive branch; a ``while`` body counts once
  (its trip count is not known statically).
  """
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      total += _dot_flops(eqn)
    elif name == "conv_general_dilated":
      total += _conv_flops(eqn)
    elif name == "cond":
      total += max((count_matmul_flops(b.jaxpr)
                    for b in eqn.params["branches"]), default=0)
    else:
      subs = sub_jaxprs(eqn)
      if subs:
        inner = sum(count_matmul_flops(s) for s in subs)
        total += inner * scan_length(eqn)
  return total


def inline_regions(jaxpr: Jaxpr, marker: Any) -> Jaxpr:
  """``jaxpr`` with every remat region whose policy is ``marker`` inlined.

  The result is the program without those regions: what a training step
  costs with no remat at all (under remat3, ``everything_saveable`` still
  recomputes un-named values, so it is not that baseline).
  """
  cache: dict[int, Jaxpr] = {}

  def visit(j: Jaxpr) -> Jaxpr:
    if id(j) in cache:
      return cache[id(j)]
    env: dict[Any, Any] = {}

    def sub(a):
      return env.get(a, a) if is_jaxpr_var(a) else a

    new_eqns = []
    for eqn in j.eqns:
      if is_remat(eqn) and remat_policy_of(eqn) is marker and _inlinable(eqn):
        body = visit(remat_body_of(eqn))
        benv = dict(zip(body.invars, map(sub, eqn.invars), strict=True))
        for be in body.eqns:
          outs = [v if isinstance(v, _core.DropVar) else Var(v.aval)
                  for v in be.outvars]
          benv.update(zip(be.outvars, outs, strict=True))
          new_eqns.append(be.replace(
              invars=[benv.get(a, a) if is_jaxpr_var(a) else a
                      for a in be.invars], outvars=outs))
        for ov, bv in zip(eqn.outvars, body.outvars, strict=True):
          env[ov] = benv.get(bv, bv) if is_jaxpr_var(bv) else bv
        continue
      if is_remat(eqn):
        new = with_remat(eqn, visit(remat_body_of(eqn)), remat_policy_of(eqn))
      else:
        new = map_sub_jaxprs(eqn, visit)
      new_eqns.append(new.replace(invars=[sub(a) for a in new.invars]))
    out = j.replace(eqns=new_eqns, outvars=[sub(v) for v in j.outvars])
    cache[id(j)] = out
    return out

  return visit(jaxpr)


def _inlinable(eqn: JaxprEqn) -> bool:
  if eqn.primitive is remat_p:
    return True
  return not eqn.params["_prim"].params["jaxpr"].consts


# ====================================================================
# Verification and sharding: effects in regions, trace identity,
# remat-free reference programs, residual variables.
# ====================================================================

#: Host-callback primitives: their Python function runs again whenever the
#: region around them is recomputed (``pure_callback`` carries no effect).
CALLBACK_PRIMITIVES: frozenset[str] = frozenset(
    {"debug_callback", "debug_print", "io_callback", "pure_callback",
     "callback"})


@_dataclasses.dataclass(frozen=True)
class EffectSite:
  """An effectful or host-callback equation found inside a remat region."""

  primitive: str
  effects: tuple[str, ...]
  module_path: str
  source: str


def _effect_names(eqn: JaxprEqn) -> tuple[str, ...]:
  return tuple(sorted(type(e).__name__ for e in eqn.effects))


def _sites_in(jaxpr: Jaxpr, out: list[EffectSite]) -> None:
  for eqn in jaxpr.eqns:
    if eqn.effects or eqn.primitive.name in CALLBACK_PRIMITIVES:
      subs = sub_jaxprs(eqn)
      if not subs:  # the effect itself, not a call/scan that carries it
        out.append(EffectSite(eqn.primitive.name, _effect_names(eqn),
                              module_path(eqn), source_of(eqn)))
    for sub in sub_jaxprs(eqn):
      _sites_in(sub, out)


def effects_in_remat_regions(jaxpr: Jaxpr) -> list[EffectSite]:
  """Effectful and host-callback equations inside any remat region.

  Each runs once in the forward pass and again whenever the backward pass
  recomputes its region (``jax.debug.print`` prints twice). Nested regions
  are searched once, from the outermost.
  """
  found: list[EffectSite] = []
  for eqn in jaxpr.eqns:
    if is_remat(eqn):
      _sites_in(remat_body_of(eqn), found)
    else:
      for sub in sub_jaxprs(eqn):
        found.extend(effects_in_remat_regions(sub))
  return found


_ADDRESS = __import__("re").compile(r"0x[0-9a-fA-F]+")


def _param_text(value: Any, emit: Callable[[Jaxpr, str], None], indent: str
                ) -> str:
  """A deterministic rendering of one equation parameter."""
  if isinstance(value, ClosedJaxpr):
    emit(value.jaxpr, indent)
    return f"<closed jaxpr, consts {_consts_text(value.consts)}>"
  if isinstance(value, Jaxpr):
    emit(value, indent)
    return "<jaxpr>"
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(_param_text(v, emit, indent) for v in value) + ")"
  inner = getattr(value, "params", None)
  if isinstance(inner, dict):  # remat3's RematTraced / CheckpointName
    fields = ", ".join(f"{k}={_param_text(v, emit, indent)}"
                       for k, v in sorted(inner.items()))
    return f"{type(value).__name__}({fields})"
  return _ADDRESS.sub("0x?", repr(value))


def _consts_text(consts: Any) -> str:
  import hashlib
  parts = []
  for c in consts:
    x = _np.asarray(c)
    digest = hashlib.sha1(x.tobytes()).hexdigest()[:12]
    parts.append(f"{x.dtype}{list(x.shape)}#{digest}")
  return "[" + ", ".join(parts) + "]"


def canonical_lines(closed: ClosedJaxpr) -> list[str]:
  """``closed`` as text lines that depend only on its structure and values.

  Variables are numbered by first appearance in their jaxpr, nested jaxprs are written
  inline at each use (JAX's printer hoists shared ones in an order that
  depends on its caches), object addresses are masked and constants are
  written as dtype, shape and a hash of their bytes.
  """
  lines: list[str] = []

  def emit(jaxpr: Jaxpr, indent: str) -> None:
    names: dict[Any, int] = {}  # a jaxpr's variables are local to it

    def ref(v: Any) -> str:
      if isinstance(v, Literal):
        return f"{_np.asarray(v.val).tolist()!r}:{v.aval.str_short()}"
      if v not in names:
        names[v] = len(names)
      return f"v{names[v]}"

    lines.append(f"{indent}in " + " ".join(
        f"{ref(v)}:{v.aval.str_short()}" for v in [*jaxpr.constvars,
                                                   *jaxpr.invars]))
    for eqn in jaxpr.eqns:
      params = ", ".join(f"{k}={_param_text(val, emit, indent + '  ')}"
                         for k, val in sorted(eqn.params.items()))
      outs = " ".join(f"{ref(v)}:{v.aval.str_short()}" for v in eqn.outvars)
      ins = " ".join(ref(v) for v in eqn.invars)
      lines.append(f"{indent}{outs} = {eqn.primitive.name}[{params}] {ins}")
    lines.append(f"{indent}out " + " ".join(ref(v) for v in jaxpr.outvars))

  emit(closed.jaxpr, "")
  lines.append(f"consts {_consts_text(closed.consts)}")
  return lines


def trace_difference(a: ClosedJaxpr, b: ClosedJaxpr) -> str | None:
  """How two traces of one function differ; None when structurally equal.

  Compares :func:`canonical_lines` of both and names the first difference.
  """
  lines_a, lines_b = canonical_lines(a), canonical_lines(b)
  for la, lb in zip(lines_a, lines_b):
    if la != lb:
      return f"{_clip(la)!r} became {_clip(lb)!r}"
  if len(lines_a) != len(lines_b):
    return (f"the first trace has {len(lines_a)} equations and lines, the "
            f"second {len(lines_b)}")
  return None


def _clip(text: str, limit: int = 160) -> str:
  text = text.strip()
  return text if len(text) <= limit else text[:limit] + "..."


def _set_every_region_policy(jaxpr: Jaxpr, policy: Any) -> Jaxpr:
  cache: dict[int, Jaxpr] = {}

  def visit(j: Jaxpr) -> Jaxpr:
    if id(j) not in cache:
      eqns = [with_remat(e, visit(remat_body_of(e)), policy) if is_remat(e)
              else map_sub_jaxprs(e, visit) for e in j.eqns]
      cache[id(j)] = j.replace(eqns=eqns)
    return cache[id(j)]

  return visit(jaxpr)


def strip_remat(jaxpr: Jaxpr) -> tuple[Jaxpr, int]:
  """``jaxpr`` without any remat region: the program with no recomputation.

  Every region (ambient or with its own policy) is inlined. A remat3 region
  whose body captured constants cannot be inlined; it gets
  ``everything_saveable`` instead (which under remat3 still recomputes
  un-named values, so it is counted).

  Returns:
    ``(jaxpr, regions_left)``.
  """
  marker = SaveOnlyTheseNames(frozenset({"__remat_toolkit_strip__"}))
  inlined = inline_regions(_set_every_region_policy(jaxpr, marker), marker)
  left = count_remat_regions(inlined, marker)
  if left:
    inlined = substitute_policy(inlined, marker,
                                lambda _: _ad_checkpoint.everything_saveable)
  return inlined, left


def float_dtypes_in(jaxpr: Jaxpr) -> frozenset[Any]:
  """The floating-point dtypes computed anywhere in ``jaxpr``."""
  found: set[Any] = set()
  stack = [jaxpr]
  while stack:
    j = stack.pop()
    for eqn in j.eqns:
      for v in eqn.outvars:
        dtype = getattr(v.aval, "dtype", None)
        if dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact):
          found.add(_np.dtype(dtype))
      stack.extend(sub_jaxprs(eqn))
  return frozenset(found)


def residual_vars(step: ClosedJaxpr, num_out: int, num_res: int) -> list[Any]:
  """The step's residual variables, one per :func:`residual_origins` entry.

  Same order and de-duplication as :func:`residual_origins` (a
  ``reduce_precision`` copy counts as its input), so the i-th variable is
  the i-th residual.
  """
  jaxpr = step.jaxpr
  subst = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
           if e.primitive.name == "reduce_precision"}
  out: list[Any] = []
  seen: set[Any] = set()
  for v in jaxpr.outvars[num_out:num_out + num_res]:
    if isinstance(v, Literal):
      out.append(v)
      continue
    base = subst.get(v, v)
    if base in seen:
      continue
    seen.add(base)
    out.append(base if (base in jaxpr.invars or base in jaxpr.constvars) else v)
  return out


def residual_shardings(step: ClosedJaxpr, variables: list[Any],
                       leaves: list[Any]) -> list[Any]:
  """The sharding XLA gives each of ``variables`` of the traced step.

  Compiles the step's forward part with those variables as outputs, the
  arguments sharded as ``leaves`` say (their ``sharding``), and the output
  shardings left to XLA's sharding propagation: what a jitted training step
  holds on each device. A literal gets ``None``.
  """
  outs = [v for v in variables if not isinstance(v, Literal)]
  forward, _ = _pe.dce_jaxpr(step.jaxpr.replace(outvars=outs),
                             [True] * len(outs), instantiate=True)
  consts = step.consts

  def run(*xs):
    return eval_jaxpr(forward, consts, *xs)

  compiled = jax.jit(run).lower(*leaves).compile()
  shardings = iter(compiled.output_shardings)
  return [None if isinstance(v, Literal) else next(shardings) for v in variables]


def share_identical_regions(jaxpr: Jaxpr, marker: Any) -> Jaxpr:
  """Makes structurally identical remat bodies one shared jaxpr object.

  The unrolled layers of a model trace to equal bodies that differ only in
  their module scope (``layers_3/...``). Moving that scope onto the remat
  equation and sharing one body lets JAX's own per-jaxpr caches (JVP,
  partial evaluation) serve every layer, so analysing another policy costs
  one layer's work instead of one per layer. Module paths are unchanged:
  JAX prefixes the equation's name stack when it evaluates the body.
  """
  if remat3_enabled():
    return jaxpr  # remat3 re-traces regions itself; sharing buys nothing.
  shared: dict[str, Jaxpr] = {}

  def visit(j: Jaxpr) -> Jaxpr:
    new_eqns = []
    changed = False
    for eqn in j.eqns:
      new = eqn
      if (eqn.primitive is remat_p and eqn.params["policy"] is marker
          and not eqn.params["jaxpr"].constvars):
        new = _share_body(eqn, shared)
      else:
        new = map_sub_jaxprs(eqn, visit)
      changed |= new is not eqn
      new_eqns.append(new)
    return j.replace(eqns=new_eqns) if changed else j

  return visit(jaxpr)


def _share_body(eqn: JaxprEqn, shared: dict[str, Jaxpr]) -> JaxprEqn:
  body = eqn.params["jaxpr"]
  prefix = _common_scopes(body)
  if prefix:
    body = body.replace(eqns=[
        e.replace(source_info=e.source_info.replace(
            name_stack=_source_info_util.NameStack(
                e.source_info.name_stack.stack[len(prefix):])))
        for e in body.eqns])
  key = str(body)
  canonical = shared.setdefault(key, body)
  stack = eqn.source_info.name_stack.stack + prefix
  return eqn.replace(
      params={**eqn.params, "jaxpr": canonical},
      source_info=eqn.source_info.replace(
          name_stack=_source_info_util.NameStack(stack)))


def _common_scopes(body: Jaxpr) -> tuple[Any, ...]:
  """The leading name-stack scopes every equation of ``body`` shares."""
  stacks = [e.source_info.name_stack.stack for e in body.eqns]
  if not stacks:
    return ()
  prefix = []
  for items in zip(*stacks):
    first = items[0]
    if not isinstance(first, _source_info_util.Scope) or any(
        it != first for it in items[1:]):
      break
    prefix.append(first)
  return tuple(prefix)


def eval_with_jitted_regions(jaxpr: Jaxpr, consts: list[Any], *args: Any
                             ) -> list[Any]:
  """``eval_jaxpr``, but each top-level remat region runs as a jitted call.

  JAX linearizes a jitted call once per distinct jaxpr and caches it, so
  regions that share a body (see :func:`share_identical_regions`) cost one
  region's work when a policy is analysed, not one per layer.
  """
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    name_stack = (_source_info_util.current_name_stack()
                  + eqn.source_info.name_stack)
    with _source_info_util.user_context(eqn.source_info.traceback,
                                        name_stack=name_stack):
      if eqn.primitive is remat_p:
        outs = _jitted_region(eqn.params["jaxpr"], eqn.params["policy"],
                              eqn.params["prevent_cse"])(*map(read, eqn.invars))
      else:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
    if not eqn.primitive.multiple_results and eqn.primitive is not remat_p:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


_JITTED: "weakref.WeakKeyDictionary[Jaxpr, dict]" = None  # set below


def _jitted_region(body: Jaxpr, policy: Any, prevent_cse: Any) -> Callable:
  per_body = _JITTED.setdefault(body, {})
  fn = per_body.get((policy, prevent_cse))
  if fn is None:
    def region(*xs):
      return remat_p.bind(*xs, jaxpr=body, prevent_cse=prevent_cse,
                          differentiated=False, policy=policy)
    fn = per_body[(policy, prevent_cse)] = jax.jit(region)
  return fn


import weakref as _weakref  # noqa: E402

_JITTED = _weakref.WeakKeyDictionary()


def count_host_offloads(jaxpr: Jaxpr) -> int:
  """``device_put`` equations to host memory in ``jaxpr`` and nested jaxprs."""
  total = 0
  for eqn in jaxpr.eqns:
    if offload_destination(eqn) == "host":
      total += 1
    for sub in sub_jaxprs(eqn):
      total += count_host_offloads(sub)
  return total
