"""FLOPs and kernels counted on a traced program.

Matmul and convolution FLOPs (scan bodies times their trip count, a Pallas
kernel by its declared cost or its grid), the kinds of matmul inside remat
regions that JAX's matmul policies tell apart, and the kernels
(``custom_vjp`` calls, ``pallas_call`` equations): marked before the step is
differentiated so their work is found in it, and what their forward rules
hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import jax
import numpy as np

from remat_toolkit._src.core import compat
from remat_toolkit._src.core.compat import Jaxpr
from remat_toolkit._src.core.compat import JaxprEqn
from remat_toolkit._src.core.jaxpr import names_in
from remat_toolkit._src.core.jaxpr import rewrite
from remat_toolkit._src.core.jaxpr import scan_length
from remat_toolkit._src.core.jaxpr import sub_jaxprs
from remat_toolkit._src.core.jaxpr import walk

__all__ = [
    "count_matmul_flops", "pallas_flops", "MatmulCounts", "count_region_matmuls",
    "mark_kernels", "KernelWork", "kernel_work", "KernelForward", "custom_vjp_forwards",
    "extra_runs",
]


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


def _matmul_flops(eqn: JaxprEqn) -> int:
  if eqn.primitive.name == "dot_general":
    return _dot_flops(eqn)
  if eqn.primitive.name == "conv_general_dilated":
    return _conv_flops(eqn)
  return 0


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


def extra_runs(extra_flops: int, extra_launches: int,
                once: KernelWork | None) -> float:
  """How many more times a kernel runs, from its extra work and the work of
  its calls in the primal program (``once``): its Pallas launches where it
  has some, else its FLOPs."""
  calls = max(once.calls, 1) if once is not None else 1
  if extra_launches > 0 and once is not None and once.launches:
    return round(extra_launches * calls / once.launches, 2)
  if once is not None and once.flops:
    return round(extra_flops * calls / once.flops, 2)
  return float(max(extra_launches, 1))
