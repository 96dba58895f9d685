"""Jaxpr utilities: one walk, one rewrite, and what is built on them.

Every read of a traced program goes through :func:`walk` (each equation,
nested jaxprs included) and every change through :func:`rewrite` (a copy
with some equations replaced or inlined, shared bodies rewritten once). JAX
specifics come from :mod:`remat_toolkit._src.core.compat`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
import pathlib
import re
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import cast

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
  model after :func:`share_identical_regions`) is rewritten once and stays
  shared. Unchanged jaxprs are returned as the same object.
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

  def visit(j: Jaxpr) -> None:
    for eqn in j.eqns:
      for v, position in _into_bodies(
          eqn, [found.get(a) if is_jaxpr_var(a) else None for a in eqn.invars]):
        found.setdefault(v, position)
      for sub in sub_jaxprs(eqn):
        visit(sub)

  visit(jaxpr)
  return found


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


def region_signature(eqn: JaxprEqn) -> str:
  """Text equal for remat regions that compute the same thing anywhere.

  The body with the module scopes all its equations share dropped (the
  unrolled layers of a model differ only there), and the region's input
  types.
  """
  body = compat.remat_body_of(eqn)
  prefix = _common_scopes(body)
  if prefix:
    body = body.replace(eqns=[compat.drop_leading_scopes(e, len(prefix))
                              for e in body.eqns])
  inputs = " ".join(v.aval.str_short() for v in eqn.invars)
  return f"{inputs}\n{body}"


def count_remat_regions(jaxpr: Jaxpr, markers: Any = None) -> int:
  """Remat regions in ``jaxpr`` (only those whose policy is ``in markers``,
  if given: a container of placeholder policies)."""
  return sum(1 for e in walk(jaxpr) if compat.is_remat(e) and (
      markers is None or compat.remat_policy_of(e) in markers))


def count_shadowed_regions(jaxpr: Jaxpr, markers: Any) -> int:
  """Regions whose policy is ``in markers`` nested inside a remat region
  with a policy of its own: the outer policy decides what they save."""
  count = 0
  for eqn in jaxpr.eqns:
    if compat.is_remat(eqn) and compat.remat_policy_of(eqn) not in markers:
      count += count_remat_regions(compat.remat_body_of(eqn), markers)
      continue
    count += sum(count_shadowed_regions(sub, markers)
                 for sub in sub_jaxprs(eqn))
  return count


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


# remat_toolkit/, and its built-in models (whose frames are the model's own).
_PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parents[2]) + os.sep
_MODELS_DIR = _PACKAGE_DIR + "models" + os.sep


@functools.lru_cache(maxsize=1)
def _flax_lifting_files() -> tuple[str, ...]:
  spec = importlib.util.find_spec("flax")
  if spec is None or not spec.origin:
    return ()
  nnx_dir = os.path.join(os.path.dirname(spec.origin), "nnx") + os.sep
  return (nnx_dir + "transforms" + os.sep, nnx_dir + "graph.py",
          nnx_dir + "graphlib.py", nnx_dir + "extract.py")


def _is_toolkit_plumbing(file_name: str) -> bool:
  # Frames of the toolkit's own wrappers (tag, remat, ...) say nothing about
  # where in the model a value was made; the built-in models do. NNX regions
  # are lifted through Flax's split/merge helpers, which say nothing either.
  if file_name.startswith(_PACKAGE_DIR):
    return not file_name.startswith(_MODELS_DIR)
  return file_name.startswith(_flax_lifting_files())


def source_of(eqn: JaxprEqn) -> str:
  """``file:line (function)`` of the user frame that made ``eqn``."""
  return compat.user_source(eqn, _is_toolkit_plumbing)


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


# ---------------------------------------------------------------- FLOPs

# A matmul's or a convolution's operands are arrays, whose avals have shapes.

def _dot_flops(eqn: JaxprEqn) -> int:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = cast("jax.core.ShapedArray", eqn.invars[0].aval)
  out = cast("jax.core.ShapedArray", eqn.outvars[0].aval)
  k = np.prod([lhs.shape[d] for d in lhs_contract], dtype=np.int64)
  return 2 * int(np.prod(out.shape, dtype=np.int64)) * int(k)


def _conv_flops(eqn: JaxprEqn) -> int:
  rhs = cast("jax.core.ShapedArray", eqn.invars[1].aval)
  out = cast("jax.core.ShapedArray", eqn.outvars[0].aval)
  rhs_spec = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
  kernel = int(np.prod([rhs.shape[d] for d in rhs_spec[2:]], dtype=np.int64))
  in_per_group = rhs.shape[rhs_spec[1]]
  return 2 * int(np.prod(out.shape, dtype=np.int64)) * kernel * int(in_per_group)


def count_matmul_flops(jaxpr: Jaxpr, _counted: dict | None = None) -> int:
  """Matmul and convolution FLOPs of ``jaxpr``, scan bodies times trip count.

  ``cond`` counts its most expensive branch; a ``while`` body counts once
  (its trip count is not known statically). This is a fold rather than a
  :func:`walk`: nested bodies are weighted by their trip count. A body
  shared by many equations (the layers of a model) is counted once.
  """
  counted = {} if _counted is None else _counted
  if id(jaxpr) in counted:
    return counted[id(jaxpr)][1]
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "conv_general_dilated"):
      total += _matmul_flops(eqn)
    elif name == "cond":
      total += max((count_matmul_flops(b, counted) for b in sub_jaxprs(eqn)),
                   default=0)
    elif compat.is_pallas_call(eqn):
      total += pallas_flops(eqn, counted)
    else:
      inner = sum(count_matmul_flops(s, counted) for s in sub_jaxprs(eqn))
      total += inner * scan_length(eqn)
  # The jaxpr is kept beside its count so that its id is not reused.
  counted[id(jaxpr)] = (jaxpr, total)
  return total


def pallas_flops(eqn: JaxprEqn, _counted: dict | None = None) -> int:
  """FLOPs of one ``pallas_call``: its ``cost_estimate`` where it declares
  one, else its body's matmul FLOPs times the number of grid steps."""
  declared = compat.pallas_cost_flops(eqn)
  if declared is not None:
    return declared
  body = sum(count_matmul_flops(s, _counted) for s in sub_jaxprs(eqn))
  return body * compat.pallas_grid_size(eqn)


@dataclasses.dataclass(frozen=True)
class MatmulCounts:
  """How many matmul equations of each kind a set of remat regions holds.

  The kinds are those JAX's matmul policies tell apart: ``dots_saveable``
  looks at ``dot_general`` and convolutions, ``dots_with_no_batch_dims_saveable``
  only at ``dot_general`` equations without batch dimensions.
  """

  unbatched_dots: int = 0
  batched_dots: int = 0
  convs: int = 0


def count_region_matmuls(jaxpr: Jaxpr, in_region: Callable[[JaxprEqn], bool]
                         ) -> MatmulCounts:
  """Matmul equations inside the remat regions ``in_region`` accepts.

  A body shared by many regions (identical layers) is counted once: the
  counts say which kinds are present, not how often they run.
  """
  seen: set[int] = set()
  total = MatmulCounts()
  for region in walk(jaxpr):
    if not (compat.is_remat(region) and in_region(region)):
      continue
    body = compat.remat_body_of(region)
    if id(body) in seen:
      continue
    seen.add(id(body))
    found = _matmul_counts(body)
    total = MatmulCounts(*(a + b for a, b in zip(
        dataclasses.astuple(total), dataclasses.astuple(found), strict=True)))
  return total


# ---------------------------------------------------------------- kernels

def mark_kernels(jaxpr: Jaxpr) -> Jaxpr:
  """``jaxpr`` with every outermost kernel equation marked with its name.

  Kernels are ``custom_vjp`` calls and ``pallas_call`` equations
  (:func:`compat.kernel_name`); one inside another (a custom_vjp's
  pallas_call) is the outer kernel's work. The mark
  (:func:`compat.mark_kernel`) rides on everything JAX makes from the
  equation when it differentiates the program, which :func:`kernel_work`
  counts.
  """
  def on_eqn(eqn, recurse):
    del recurse
    name = compat.kernel_name(eqn)
    return None if name is None else compat.mark_kernel(eqn, name)

  return rewrite(jaxpr, on_eqn)


@dataclasses.dataclass
class KernelWork:
  """The work one kernel does at one place of a program.

  Attributes:
    flops: matmul FLOPs of its equations (a ``pallas_call`` counted by
      :func:`pallas_flops`), every scan iteration included.
    launches: how many times its ``pallas_call`` equations run.
    calls: how many times the kernel is called (its marked kernel equation
      runs); in a differentiated program, where the kernel's work is
      spread over other equations, only the calls left whole are counted.
  """

  flops: int = 0
  launches: int = 0
  calls: int = 0


def _matmul_flops(eqn: JaxprEqn) -> int:
  if eqn.primitive.name == "dot_general":
    return _dot_flops(eqn)
  if eqn.primitive.name == "conv_general_dilated":
    return _conv_flops(eqn)
  return 0


def kernel_work(jaxpr: Jaxpr) -> dict[tuple[str, str], KernelWork]:
  """The work of the marked kernels (:func:`mark_kernels`) in ``jaxpr``.

  Keyed by ``(kernel name, module path)``; the path is where the kernel was
  called (the scopes above its mark). A ``cond`` counts its most expensive
  branch, as :func:`count_matmul_flops` does.
  """
  found: dict[tuple[str, str], KernelWork] = {}
  counted: dict = {}

  def visit(j: Jaxpr, trips: int, prefix: list[str], owner) -> None:
    for eqn in j.eqns:
      here = owner
      if here is None:
        mark = compat.kernel_mark_of(eqn)
        if mark is not None:
          here = (mark[0], "/".join(prefix + mark[1]))
          if compat.kernel_name(eqn) is not None:
            found.setdefault(here, KernelWork()).calls += trips
      if here is not None:
        work = found.setdefault(here, KernelWork())
        if compat.is_pallas_call(eqn):
          work.flops += pallas_flops(eqn, counted) * trips
          work.launches += trips
          continue
        work.flops += _matmul_flops(eqn) * trips
      subs = sub_jaxprs(eqn)
      if eqn.primitive.name == "cond" and subs:
        subs = [max(subs, key=lambda b: count_matmul_flops(b, counted))]
      scopes = prefix + compat.module_scopes(eqn)
      for sub in subs:
        visit(sub, trips * scan_length(eqn), scopes, here)

  visit(jaxpr, 1, [], None)
  return found


@dataclasses.dataclass(frozen=True)
class KernelForward:
  """What the forward rule of one ``custom_vjp`` kernel holds.

  Attributes:
    kernel: the kernel's name.
    module_path: where it is called.
    names: checkpoint names inside its forward rule.
    matmuls: its forward rule's matmuls, by the kinds policies tell apart.
  """

  kernel: str
  module_path: str
  names: frozenset[str]
  matmuls: MatmulCounts


def _seen_by_policies(eqn: JaxprEqn) -> bool:
  """Whether a remat policy sees the equations nested in ``eqn``: not those
  of a Pallas kernel's body, which runs as one opaque call."""
  return not compat.is_pallas_call(eqn)


def _matmul_counts(jaxpr: Jaxpr) -> MatmulCounts:
  kinds = {"unbatched_dots": 0, "batched_dots": 0, "convs": 0}
  for eqn in walk(jaxpr, descend=_seen_by_policies):
    if eqn.primitive.name == "conv_general_dilated":
      kinds["convs"] += 1
    elif eqn.primitive.name == "dot_general":
      (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
      kinds["batched_dots" if lhs_batch else "unbatched_dots"] += 1
  return MatmulCounts(**kinds)


def custom_vjp_forwards(jaxpr: Jaxpr, in_region: Callable[[JaxprEqn], bool]
                        ) -> list[KernelForward]:
  """The ``custom_vjp`` kernels inside the remat regions ``in_region``
  accepts, with what their forward rules hold, once per call site."""
  found: dict[tuple[str, str], KernelForward] = {}

  def visit(j: Jaxpr, prefix: list[str], inside: bool) -> None:
    for eqn in j.eqns:
      scopes = prefix + compat.module_scopes(eqn)
      if inside and compat.is_custom_vjp_call(eqn):
        name = compat.kernel_name(eqn) or "custom_vjp"
        key = (name, "/".join(scopes))
        # Tracing the forward rule is the cost: once per call site.
        forward = None if key in found else compat.custom_vjp_forward(eqn)
        if forward is not None:
          found[key] = KernelForward(name, key[1], names_in(forward),
                                     _matmul_counts(forward))
        continue
      region = compat.is_remat(eqn) and in_region(eqn)
      for sub in sub_jaxprs(eqn):
        visit(sub, scopes, inside or region)

  visit(jaxpr, [], False)
  return list(found.values())


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
        visit(body)
        found.update(o for v, o in zip(body.outvars, eqn.outvars, strict=True)
                     if held(v) and is_jaxpr_var(o))
        continue
      _pass_into_bodies(eqn, [held(a) for a in eqn.invars], found)
      for sub in sub_jaxprs(eqn):
        visit(sub)

  visit(jaxpr)
  return found


def multiplies_activations(eqn: JaxprEqn, parameters: set[Any]) -> bool:
  """Whether ``eqn`` is a ``dot_general`` of two activations: neither
  operand is a parameter or constant (:func:`parameter_vars`) or a literal."""
  return eqn.primitive.name == "dot_general" and not any(
      not is_jaxpr_var(a) or a in parameters for a in eqn.invars[:2])


# ---------------------------------------------------------------- rewrites

def substitute_policy(jaxpr: Jaxpr, markers: Any,
                      choose: Callable[[Any, frozenset[str]], Any],
                      body_for: Callable[[Any, Jaxpr], Jaxpr] | None = None
                      ) -> Jaxpr:
  """Replaces the policy of every remat region whose policy is ``in markers``.

  ``choose(marker, names_in_region)`` gives the JAX policy for each such
  region, and ``body_for(marker, body)`` (if given) its body. The rest of
  the program is shared, not re-traced.
  """
  def on_eqn(eqn, recurse):
    policy = compat.remat_policy_of(eqn) if compat.is_remat(eqn) else None
    if policy is not None and policy in markers:
      body = compat.remat_body_of(eqn)
      new_body = recurse(body)
      if body_for is not None:
        new_body = body_for(policy, new_body)
      return compat.with_remat(eqn, new_body, choose(policy, names_in(body)))
    return None

  return rewrite(jaxpr, on_eqn)


def set_every_region_policy(jaxpr: Jaxpr, policy: Any) -> Jaxpr:
  """Gives every remat region, at any depth, ``policy``."""
  def on_eqn(eqn, recurse):
    if compat.is_remat(eqn):
      return compat.with_remat(eqn, recurse(compat.remat_body_of(eqn)), policy)
    return None

  return rewrite(jaxpr, on_eqn)


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


def inline_regions(jaxpr: Jaxpr, markers: Any) -> Jaxpr:
  """``jaxpr`` with every remat region whose policy is ``in markers`` inlined.

  The result is the program without those regions: what a training step
  costs with no remat at all (under jax 0.10's remat3, ``everything_saveable`` still
  recomputes un-named values, so it is not that baseline). A remat3 region
  whose body captured constants stays a region.
  """
  def on_eqn(eqn, recurse):
    if not (compat.is_remat(eqn) and compat.remat_policy_of(eqn) in markers
            and not compat.remat_body_consts(eqn)):
      return None
    body = recurse(compat.remat_body_of(eqn))
    benv = dict(zip(body.invars, eqn.invars, strict=True))
    eqns = []
    for be in body.eqns:
      outs = [v if isinstance(v, compat.DropVar) else Var(v.aval)
              for v in be.outvars]
      # Out of the region, each keeps the module scopes JAX would prefix.
      eqns.append(compat.nest_scopes(be, eqn).replace(
          invars=[benv.get(a, a) if is_jaxpr_var(a) else a for a in be.invars],
          outvars=outs))
      benv.update(zip(be.outvars, outs, strict=True))
    return Inline(eqns, [benv.get(v, v) if is_jaxpr_var(v) else v
                         for v in body.outvars])

  return rewrite(jaxpr, on_eqn)


def strip_remat(jaxpr: Jaxpr) -> tuple[Jaxpr, int]:
  """``jaxpr`` without any remat region: the program with no recomputation.

  Every region (ambient or with its own policy) is inlined. A remat3 region
  whose body captured constants cannot be inlined; it gets
  ``everything_saveable`` instead (which under jax 0.10's remat3 recomputes
  un-named values, so it is counted).

  Returns:
    ``(jaxpr, regions_left)``.
  """
  markers = (compat.policy_marker("strip"),)
  inlined = inline_regions(set_every_region_policy(jaxpr, markers[0]), markers)
  left = count_remat_regions(inlined, markers)
  if left:
    inlined = substitute_policy(
        inlined, markers,
        lambda *_: jax.checkpoint_policies.everything_saveable)
  return inlined, left


def share_identical_regions(jaxpr: Jaxpr, markers: Any) -> Jaxpr:
  """Makes structurally identical remat bodies one shared jaxpr object.

  The unrolled layers of a model trace to equal bodies that differ only in
  their module scope (``layers_3/...``). Moving that scope onto the remat
  equation and sharing one body lets JAX's own per-jaxpr caches (JVP,
  partial evaluation) serve every layer, so analysing another policy costs
  one layer's work instead of one per layer. Module paths are unchanged:
  JAX prefixes the equation's name stack when it evaluates the body.
  """
  if compat.remat3_enabled():
    return jaxpr  # remat3 re-traces regions itself; sharing buys nothing.
  shared: dict[Any, Jaxpr] = {}

  def on_eqn(eqn, recurse):
    if (eqn.primitive is compat.remat_p
        and compat.remat_policy_of(eqn) in markers
        and not compat.remat_body_of(eqn).constvars):
      return _share_body(eqn, shared)
    return None

  return rewrite(jaxpr, on_eqn)


def _share_body(eqn: JaxprEqn, shared: dict[Any, Jaxpr]) -> JaxprEqn:
  body = compat.remat_body_of(eqn)
  prefix = _common_scopes(body)
  if prefix:
    body = body.replace(eqns=[
        compat.drop_leading_scopes(e, min(len(prefix),
                                          len(compat.leading_scopes(e))))
        for e in body.eqns])
  # A jaxpr's text leaves out its name stacks: two bodies are one only if
  # every equation also sits in the same module below the region.
  key = (str(body), tuple(compat.leading_scopes(e) for e in body.eqns))
  canonical = shared.setdefault(key, body)
  moved = compat.prefix_scopes(eqn, prefix)
  return compat.with_remat(moved, canonical, compat.remat_policy_of(eqn))


def _common_scopes(body: Jaxpr) -> tuple[Any, ...]:
  """The leading module scopes of ``body``: the region's own module.

  An equation whose whole name stack lies above the others' (a region's
  input named before the module's scope is entered) sits at the region's
  root, so it does not shorten the prefix.
  """
  stacks = [compat.leading_scopes(e) for e in body.eqns]
  deep = [s for s in stacks
          if not any(len(o) > len(s) and o[:len(s)] == s for o in stacks)]
  prefix = _shared_prefix(deep)
  for s in stacks:
    if prefix[:len(s)] != s:
      prefix = _shared_prefix([prefix, s])
  return prefix


def _shared_prefix(stacks: list[tuple[Any, ...]]) -> tuple[Any, ...]:
  """The leading scope items all of ``stacks`` share."""
  prefix = []
  for items in zip(*stacks, strict=False):  # up to the shortest
    first = items[0]
    if not compat.is_scope(first) or any(it != first for it in items[1:]):
      break
    prefix.append(first)
  return tuple(prefix)


# ---------------------------------------------------------------- evaluating

def eval_with_jitted_regions(jaxpr: Jaxpr, consts: list[Any], *args: Any
                             ) -> list[Any]:
  """``eval_jaxpr``, but each top-level remat2 region runs as a jitted call.

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
    with compat.eval_context(eqn):
      if eqn.primitive is compat.remat_p:
        outs = _jitted_region(compat.remat_body_of(eqn),
                              compat.remat_policy_of(eqn),
                              eqn.params["prevent_cse"])(*map(read, eqn.invars))
      else:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        if not eqn.primitive.multiple_results:
          outs = [outs]
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _jitted_region(body: Jaxpr, policy: Any, prevent_cse: Any) -> Callable:
  per_body = _JITTED.setdefault(body, {})
  key = (id(policy), prevent_cse)
  entry = per_body.get(key)
  if entry is None or entry[0] is not policy:
    def region(*xs):
      return compat.bind_remat(body, policy, prevent_cse, *xs)
    entry = per_body[key] = (policy, jax.jit(region))
  return entry[1]


# ---------------------------------------------------------------- effects

#: Host-callback primitives: their Python function runs again whenever the
#: region around them is recomputed (``pure_callback`` carries no effect).
CALLBACK_PRIMITIVES: frozenset[str] = frozenset(
    {"debug_callback", "debug_print", "io_callback", "pure_callback",
     "callback"})


@dataclasses.dataclass(frozen=True)
class EffectSite:
  """An effectful or host-callback equation found inside a remat region."""

  primitive: str
  effects: tuple[str, ...]
  module_path: str
  source: str


def effects_in_remat_regions(jaxpr: Jaxpr) -> list[EffectSite]:
  """Effectful and host-callback equations inside any remat region.

  Each runs once in the forward pass and again whenever the backward pass
  recomputes its region (``jax.debug.print`` prints twice). Nested regions
  are searched once, from the outermost.
  """
  found: list[EffectSite] = []
  outermost = (e for e in walk(jaxpr, descend=lambda e: not compat.is_remat(e))
               if compat.is_remat(e))
  for region in outermost:
    for eqn in walk(compat.remat_body_of(region)):
      if ((eqn.effects or eqn.primitive.name in CALLBACK_PRIMITIVES)
          and not sub_jaxprs(eqn)):  # the effect, not a call carrying it
        found.append(EffectSite(
            eqn.primitive.name,
            tuple(sorted(type(e).__name__ for e in eqn.effects)),
            module_path(eqn), source_of(eqn)))
  return found


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
