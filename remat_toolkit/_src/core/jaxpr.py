"""Jaxpr utilities: one walk, one rewrite, and what is built on them.

Every read of a traced program goes through :func:`walk` (each equation,
nested jaxprs included) and every change through :func:`rewrite` (a copy
with some equations replaced or inlined, shared bodies rewritten once). JAX
specifics come from :mod:`remat_toolkit._src.core.compat`.

What is built on them here reads jaxprs, not the toolkit's intent: the
checkpoint names a program holds, the values that hold its arguments and
parameters, memory kinds, literals lifted to inputs, and a text that tells
two traces apart. The analyzer's own readings (FLOPs and kernels, regions
under its placeholder policies, where in the user's code an equation was
made) live in :mod:`remat_toolkit._src.analysis`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from remat_toolkit._src.core import compat
from remat_toolkit._src.core.compat import Jaxpr
from remat_toolkit._src.core.compat import JaxprEqn
from remat_toolkit._src.core.compat import Literal
from remat_toolkit._src.core.compat import Var

# ---------------------------------------------------------------- structure


def _jaxpr_params(eqn: JaxprEqn) -> Iterator[tuple[str, int | None, Any]]:
  for key, value in eqn.params.items():
    if compat.is_jaxpr_value(value):
      yield key, None, value
    elif isinstance(value, tuple) and value and all(
        compat.is_jaxpr_value(v) for v in value):
      for i, v in enumerate(value):
        yield key, i, v


def sub_jaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
  """The jaxprs nested in ``eqn`` (scan/cond/jit/remat/custom rules)."""
  if compat.is_leaf(eqn):
    return []
  hidden = compat.hidden_jaxprs(eqn)
  if hidden:
    return hidden
  found = [compat.inner_jaxpr(v) for _, _, v in _jaxpr_params(eqn)]
  if not found:
    compat.note_leaf(eqn)
  return found


def map_sub_jaxprs(eqn: JaxprEqn, fn: Callable[[Jaxpr], Jaxpr]) -> JaxprEqn:
  """A copy of ``eqn`` whose nested jaxprs went through ``fn``."""
  if compat.is_remat(eqn):
    body = compat.remat_body_of(eqn)
    new = fn(body)
    return eqn if new is body else compat.with_remat(
        eqn, new, compat.remat_policy_of(eqn))
  params = dict(eqn.params)
  changed = False
  for key, index, value in _jaxpr_params(eqn):
    inner = compat.inner_jaxpr(value)
    new_inner = fn(inner)
    if new_inner is inner:
      continue
    changed = True
    new_value = compat.rewrap_jaxpr(value, new_inner)
    if index is None:
      params[key] = new_value
    else:
      items = list(params[key])
      items[index] = new_value
      params[key] = tuple(items)
  return eqn.replace(params=params) if changed else eqn


def walk(jaxpr: Jaxpr, descend: Callable[[JaxprEqn], bool] | None = None
         ) -> Iterator[JaxprEqn]:
  """Every equation of ``jaxpr`` and of the jaxprs nested in it, in order.

  Args:
    jaxpr: the program.
    descend: whether to enter an equation's nested jaxprs (default: always).
  """
  for eqn in jaxpr.eqns:
    yield eqn
    if descend is None or descend(eqn):
      for sub in sub_jaxprs(eqn):
        yield from walk(sub, descend)


def any_eqn(jaxpr: Jaxpr, pred: Callable[[JaxprEqn], bool]) -> bool:
  """``any(map(pred, walk(jaxpr)))`` for a ``pred`` that reads only the
  equation, with a body shared by many equations (the layers of a model)
  read once."""
  seen: dict[int, tuple[Jaxpr, bool]] = {}

  def visit(j: Jaxpr) -> bool:
    hit = seen.get(id(j))
    if hit is not None and hit[0] is j:
      return hit[1]
    found = any(pred(e) or any(visit(s) for s in sub_jaxprs(e))
                for e in j.eqns)
    seen[id(j)] = (j, found)  # the jaxpr kept: its id is not reused
    return found

  return visit(jaxpr)


@dataclasses.dataclass(frozen=True)
class Inline:
  """What a :func:`rewrite` callback returns to replace one equation by many.

  Attributes:
    eqns: the equations that stand for it.
    outs: one atom per output of the replaced equation.
  """

  eqns: list[JaxprEqn]
  outs: list[Any]


#: ``on_eqn(eqn, recurse)``: a replacement equation, an :class:`Inline`, or
#: None to keep ``eqn`` with its nested jaxprs rewritten by ``recurse``.
EqnRewrite = Callable[[JaxprEqn, Callable[[Jaxpr], Jaxpr]],
                      "JaxprEqn | Inline | None"]


def rewrite(jaxpr: Jaxpr, on_eqn: EqnRewrite) -> Jaxpr:
  """A copy of ``jaxpr`` with equations replaced by ``on_eqn``, at any depth.

  A nested jaxpr shared by several equations (the unrolled layers of a
  model, once the analyzer shares identical regions) is rewritten once and
  stays shared. Unchanged jaxprs are returned as the same object.
  """
  cache: dict[int, Jaxpr] = {}

  def visit(j: Jaxpr) -> Jaxpr:
    if id(j) in cache:
      return cache[id(j)]
    env: dict[Any, Any] = {}

    def sub(a: Any) -> Any:
      return env.get(a, a) if is_jaxpr_var(a) else a

    new_eqns: list[JaxprEqn] = []
    changed = False
    for eqn in j.eqns:
      if env:
        eqn = eqn.replace(invars=[sub(a) for a in eqn.invars])
      out = on_eqn(eqn, visit)
      if out is None:
        out = map_sub_jaxprs(eqn, visit)
      if isinstance(out, Inline):
        env.update(zip(eqn.outvars, out.outs, strict=True))
        new_eqns.extend(out.eqns)
        changed = True
        continue
      changed |= out is not eqn
      new_eqns.append(out)
    if not changed and not env:
      result = j
    else:
      result = j.replace(eqns=new_eqns, outvars=[sub(v) for v in j.outvars])
    cache[id(j)] = result
    return result

  return visit(jaxpr)


def is_jaxpr_var(x: Any) -> bool:
  return isinstance(x, Var) and not isinstance(x, Literal)


# ---------------------------------------------------------------- reading

def trace_program(fn: Callable, leaves: list[Any]) -> tuple[Any, Any]:
  """``make_jaxpr`` of ``fn`` over flat leaves; returns (jaxpr, out shape)."""
  return jax.make_jaxpr(fn, return_shape=True)(*leaves)


def argument_vars(jaxpr: Jaxpr) -> set[Any]:
  """The variables, at any depth, that hold an argument or constant of
  ``jaxpr`` as it was passed in: its own inputs, and the inputs of nested
  jaxprs that receive one unchanged (a scan's constants and one slice of a
  scanned argument per step included; its carries are computed).

  A variable of a body shared by several equations counts if any of them
  passes it an argument.
  """
  return set(argument_positions(jaxpr))


def argument_positions(jaxpr: Jaxpr) -> dict[Any, int]:
  """Per variable of :func:`argument_vars`, the position of the input of
  ``jaxpr`` it holds (-1 for a constant); the first one passed wins.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(w, x):
    ...   return jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0]
    >>> j = jax.make_jaxpr(f)(jnp.ones((2, 3, 3)), jnp.ones(3)).jaxpr
    >>> body = j.eqns[0].params["jaxpr"].jaxpr
    >>> [argument_positions(j).get(v) for v in body.invars]  # carry, slice
    [None, 0]
  """
  found: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
  found.update((v, -1) for v in jaxpr.constvars)
  again = _Revisits(found)

  def visit(j: Jaxpr) -> None:
    for eqn in j.eqns:
      for v, position in _into_bodies(
          eqn, [found.get(a) if is_jaxpr_var(a) else None for a in eqn.invars]):
        found.setdefault(v, position)
      for sub in sub_jaxprs(eqn):
        if not again.unchanged(sub):
          visit(sub)

  visit(jaxpr)
  return found


class _Revisits:
  """Which walks of a shared body a propagation over ``found`` may skip.

  :func:`argument_positions` and :func:`parameter_vars` walk a body once
  per equation that runs it (a body JAX shares between the layers of an
  unrolled model is walked once per layer). A walk reads and adds only
  entries for the variables of the body and of the bodies in it, entries
  are only ever added, and what it adds depends on nothing else: a walk
  that starts where the body's previous walk started (as many of those
  variables found) adds what that one added, which was nothing, since
  what was found since includes it. Such a walk is skipped; every other
  walk is made, so the result is the walk-every-time result exactly.
  """

  def __init__(self, found: Any):
    self._found = found  # a set or dict of variables
    self._seen: dict[int, tuple[Any, tuple[Any, ...] | None, int]] = {}

  def unchanged(self, body: Jaxpr) -> bool:
    """Whether walking ``body`` now would add nothing (see the class);
    when not, notes where this walk starts."""
    entry = self._seen.get(id(body))
    if entry is None or entry[0] is not body:
      self._seen[id(body)] = (body, None, -1)  # the first walk: not counted
      return False
    variables = entry[1]
    if variables is None:
      variables = tuple(_variables(body))
    count = sum(map(self._found.__contains__, variables))
    if count == entry[2]:
      return True
    self._seen[id(body)] = (body, variables, count)
    return False


def _variables(jaxpr: Jaxpr) -> Iterator[Any]:
  """Every variable of ``jaxpr`` and of the jaxprs nested in it."""
  yield from jaxpr.constvars
  yield from jaxpr.invars
  for eqn in jaxpr.eqns:
    yield from (v for v in eqn.outvars if is_jaxpr_var(v))
    body = compat.call_body(eqn)
    subs = sub_jaxprs(eqn)
    for sub in subs if body is None or any(s is body for s in subs) else [
        *subs, body]:
      yield from _variables(sub)


def _into_bodies(eqn: JaxprEqn, passed: list[Any]) -> list[tuple[Any, Any]]:
  """(input of one of ``eqn``'s bodies, what ``passed`` says of the input of
  ``eqn`` it receives as it is) for each input whose entry is not None: one
  to one, except a scan's carries, which each step computes anew."""
  if compat.is_scan(eqn):
    consts = compat.scan_num_consts(eqn)
    carries = compat.scan_num_carry(eqn)
    passed = [None if consts <= i < consts + carries else p
              for i, p in enumerate(passed)]
  return [(v, p) for sub in sub_jaxprs(eqn) if len(sub.invars) == len(passed)
          for v, p in zip(sub.invars, passed, strict=True) if p is not None]


def _pass_into_bodies(eqn: JaxprEqn, passed: list[bool], found: set[Any]
                      ) -> None:
  """Adds to ``found`` the inputs of ``eqn``'s bodies that receive an input
  of ``eqn`` flagged in ``passed`` as it is (:func:`_into_bodies`)."""
  found.update(v for v, _ in _into_bodies(eqn, [True if p else None
                                                for p in passed]))


#: names_in per jaxpr: a jaxpr never changes, and reading one traces the
#: forward rules of the kernels in it, once per policy analysed otherwise.
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def names_in(jaxpr: Jaxpr) -> frozenset[str]:
  """Every checkpoint name in ``jaxpr`` and the jaxprs nested in it.

  The forward rules of ``custom_vjp`` kernels count: the names a kernel
  gives its residuals there (splash's ``residual_checkpoint_name``) are in
  no other jaxpr of the primal program.
  """
  names = _NAMES.get(jaxpr)
  if names is None:
    names = _NAMES[jaxpr] = _names_in(jaxpr)
  return names


def _names_in(jaxpr: Jaxpr) -> frozenset[str]:
  found: set[str] = set()
  for eqn in walk(jaxpr):
    name = compat.checkpoint_name_of(eqn)
    if name is not None:
      found.add(name)
    forward = compat.custom_vjp_forward(eqn)
    if forward is not None:
      found |= names_in(forward)
  return frozenset(found)


def walk_with_trips(jaxpr: Jaxpr, trips: int = 1
                    ) -> Iterator[tuple[JaxprEqn, int]]:
  """Like :func:`walk`, with how often each equation runs per call: the
  product of the lengths of the scans around it."""
  for eqn in jaxpr.eqns:
    yield eqn, trips
    for sub in sub_jaxprs(eqn):
      yield from walk_with_trips(sub, trips * scan_length(eqn))


def float_dtypes_in(jaxpr: Jaxpr) -> frozenset[Any]:
  """The floating-point dtypes computed anywhere in ``jaxpr``."""
  found: set[Any] = set()
  for eqn in walk(jaxpr):
    for v in eqn.outvars:
      dtype = getattr(v.aval, "dtype", None)
      if dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        found.add(np.dtype(dtype))
  return frozenset(found)


def count_host_offloads(jaxpr: Jaxpr) -> int:
  """``device_put`` equations to host memory in ``jaxpr`` and nested jaxprs."""
  return sum(1 for e in walk(jaxpr) if offload_destination(e) == "host")


def scan_length(eqn: JaxprEqn) -> int:
  """Trip count of a ``scan`` equation, 1 for anything else."""
  if compat.is_scan(eqn):
    return int(eqn.params["length"])
  return 1


def module_path(eqn: JaxprEqn) -> str:
  """The name-stack scopes of ``eqn`` (Flax module path), transforms dropped."""
  return "/".join(compat.module_scopes(eqn))


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


# ---------------------------------------------------------------- parameters

#: Primitives that pass a value on re-typed or re-laid out: a parameter cast
#: to bfloat16, transposed or sliced from a stack of layers is still one.
_LAYOUT_PRIMITIVES = frozenset({
    "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
    "squeeze", "expand_dims", "copy", "copy_p", "reduce_precision", "slice",
    "dynamic_slice", "sharding_constraint", "device_put", "rev",
    "optimization_barrier"})


def parameter_vars(jaxpr: Jaxpr) -> set[Any]:
  """The variables, at any depth, that hold an argument or constant of
  ``jaxpr``: :func:`argument_vars`, and what only re-types or re-lays one
  out (``w.astype(bf16).T``), through calls and into loop bodies.

  A matmul with an operand among them is a projection by a parameter; one
  with neither operand among them multiplies two activations (attention
  logits, probabilities times values).
  """
  found: set[Any] = argument_vars(jaxpr)

  def held(a: Any) -> bool:
    return is_jaxpr_var(a) and a in found

  def visit(j: Jaxpr) -> None:
    for eqn in j.eqns:
      if (eqn.primitive.name in _LAYOUT_PRIMITIVES and eqn.invars
          and held(eqn.invars[0])):
        found.update(v for v in eqn.outvars if is_jaxpr_var(v))
        continue
      body = compat.call_body(eqn)
      if body is not None:
        found.update(v for v, a in zip(body.invars, eqn.invars, strict=True)
                     if held(a))
        if not again.unchanged(body):
          visit(body)
        found.update(o for v, o in zip(body.outvars, eqn.outvars, strict=True)
                     if held(v) and is_jaxpr_var(o))
        continue
      _pass_into_bodies(eqn, [held(a) for a in eqn.invars], found)
      for sub in sub_jaxprs(eqn):
        if not again.unchanged(sub):
          visit(sub)

  again = _Revisits(found)
  visit(jaxpr)
  return found


def multiplies_activations(eqn: JaxprEqn, parameters: set[Any]) -> bool:
  """Whether ``eqn`` is a ``dot_general`` of two activations: neither
  operand is a parameter or constant (:func:`parameter_vars`) or a literal."""
  return eqn.primitive.name == "dot_general" and not any(
      not is_jaxpr_var(a) or a in parameters for a in eqn.invars[:2])


# ---------------------------------------------------------------- rewrites

#: Primitives whose scalar literal operands are, in a Python trace, values
#: of the trace (a Python scalar that ``jnp`` converted: ``x * 3.0``), which
#: JAX's VJP keeps as residuals. jnp's own constants (``mean``'s divisor) are
#: handed to ``div`` as plain numbers and folded, so ``div`` is not here.
LIFTED_LITERAL_PRIMITIVES = frozenset({"mul"})


def literals_as_invars(jaxpr: Jaxpr) -> tuple[Jaxpr, list[Any]]:
  """``jaxpr`` with the literal operands of some equations new invars.

  The equations are those of :data:`LIFTED_LITERAL_PRIMITIVES`. Returns
  ``(jaxpr, values)``: the new variables come first among the invars and
  take ``values`` in order. Sub-jaxprs keep their literals.
  """
  added: list[Var] = []
  values: list[Any] = []

  def lift(v: Any) -> Any:
    if not isinstance(v, Literal):
      return v
    added.append(Var(v.aval))
    values.append(v.val)
    return added[-1]

  eqns = [e.replace(invars=[lift(v) for v in e.invars])
          if e.primitive.name in LIFTED_LITERAL_PRIMITIVES
          and any(isinstance(v, Literal) for v in e.invars) else e
          for e in jaxpr.eqns]
  return jaxpr.replace(invars=[*added, *jaxpr.invars], eqns=eqns), values


# ---------------------------------------------------------------- text

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _param_text(value: Any, emit: Callable[[Jaxpr, str], None], indent: str
                ) -> str:
  """A deterministic rendering of one equation parameter."""
  if compat.is_jaxpr_value(value):
    emit(compat.inner_jaxpr(value), indent)
    return f"<jaxpr, consts {_consts_text(compat.jaxpr_consts(value))}>"
  if isinstance(value, (tuple, list)):
    return "(" + ", ".join(_param_text(v, emit, indent) for v in value) + ")"
  inner = getattr(value, "params", None)
  if isinstance(inner, dict):  # remat3's RematTraced / CheckpointName
    fields = ", ".join(f"{k}={_param_text(v, emit, indent)}"
                       for k, v in sorted(inner.items()))
    return f"{type(value).__name__}({fields})"
  return _ADDRESS.sub("0x?", repr(value))


def _consts_text(consts: Any) -> str:
  parts = []
  for c in consts:
    x = np.asarray(c)
    digest = hashlib.sha1(x.tobytes()).hexdigest()[:12]
    parts.append(f"{x.dtype}{list(x.shape)}#{digest}")
  return "[" + ", ".join(parts) + "]"


def canonical_lines(closed: Any) -> list[str]:
  """``closed`` as text lines that depend only on its structure and values.

  Variables are numbered by first appearance in their jaxpr, nested jaxprs
  are written inline at each use (JAX's printer hoists shared ones in an
  order that depends on its caches), object addresses are masked and
  constants are written as dtype, shape and a hash of their bytes.
  """
  lines: list[str] = []

  def emit(jaxpr: Jaxpr, indent: str) -> None:
    names: dict[Any, int] = {}  # a jaxpr's variables are local to it

    def ref(v: Any) -> str:
      if isinstance(v, Literal):
        return f"{np.asarray(v.val).tolist()!r}:{v.aval.str_short()}"
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


def trace_difference(a: Any, b: Any) -> str | None:
  """How two traces of one function differ; None when structurally equal.

  Compares :func:`canonical_lines` of both and names the first difference.
  """
  lines_a, lines_b = canonical_lines(a), canonical_lines(b)
  for la, lb in zip(lines_a, lines_b, strict=False):
    if la != lb:
      return f"{_clip(la)!r} became {_clip(lb)!r}"
  if len(lines_a) != len(lines_b):
    return (f"the first trace has {len(lines_a)} equations and lines, the "
            f"second {len(lines_b)}")
  return None


def _clip(text: str, limit: int = 160) -> str:
  text = text.strip()
  return text if len(text) <= limit else text[:limit] + "..."
