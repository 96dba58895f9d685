"""Residual accounting: the training step under a policy, and what it keeps.

This is where a residual's bytes are counted: :func:`aval_nbytes` (every
scan iteration of a stacked residual included) is the one place, used by the
analyzer's reports (:mod:`remat_toolkit._src.analysis.trace`) and the tests alike;
the per-device share of a sharded program is in
:mod:`remat_toolkit._src.analysis.sharding`.

:func:`trace_training_step` traces ``jax.vjp`` of a program and measures its
backward pass; :func:`residual_origins` says, for each residual, where it was
made, under which name, how many bytes and in which memory, and which
variable of the step holds it (for sharding).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import cast

import jax
import numpy as np

from remat_toolkit._src.analysis import flops as _flops
from remat_toolkit._src.analysis import regions as _regions
from remat_toolkit._src.analysis import sources as _sources
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr
from remat_toolkit._src.core.compat import Jaxpr
from remat_toolkit._src.core.compat import JaxprEqn
from remat_toolkit._src.core.compat import Literal


@dataclasses.dataclass(frozen=True)
class TracedStep:
  """Forward pass with residuals, plus what the backward pass costs.

  ``jaxpr`` has outvars ``[loss, *residuals]``; ``backward_flops`` counts the
  matmul FLOPs of the backward pass, recomputation included;
  ``kernel_work`` is the work of each marked kernel over the whole step,
  forward and backward (:func:`_flops.kernel_work`; empty for a program
  without kernels).
  """

  jaxpr: Any
  num_residuals: int
  backward_flops: int
  kernel_work: Mapping[tuple[str, str], _flops.KernelWork] = dataclasses.field(
      default_factory=dict)


def trace_training_step(jaxpr: Jaxpr, consts: list[Any], leaves: list[Any],
                        forward_flops: int, *, kernels: bool = False
                        ) -> TracedStep:
  """Traces ``jax.vjp`` of ``jaxpr`` and measures its backward pass.

  Under remat2 the backward cost is read off the linearized jaxpr JAX keeps
  in the VJP (each linear matmul transposes to one matmul of equal cost, and
  remat regions carry their recomputation), so the backward pass is never
  traced. remat3 hides its linear program inside an opaque primitive, and a
  ``custom_vjp``'s backward rule is Python the linearized jaxpr does not
  hold, so there (and for a program with ``kernels``, whose work is
  counted over the whole step) the backward pass is traced and dead code
  dropped.
  """
  remat3 = compat.remat3_enabled()
  evaluate = compat.eval_jaxpr if remat3 else _regions.eval_with_jitted_regions
  lifted, literals = _jaxpr.literals_as_invars(jaxpr)

  def traced_loss() -> Callable:
    # Tracing the Python function makes each scalar literal a value of the
    # trace, which the VJP keeps as a residual (JAX: "from a literal");
    # evaluating the jaxpr would hand it over as a plain number, folded into
    # the backward program and never listed. So each one enters as a value
    # of the enclosing trace.
    values = [jax.lax.convert_element_type(
                  v, jax.numpy.dtype(cast("jax.core.ShapedArray", a.aval).dtype))
              for v, a in zip(literals, lifted.invars, strict=False)]

    def loss(*xs):
      return evaluate(lifted, consts, *values, *xs)[0]
    return loss

  captured: list[Any] = []

  def forward(*xs):
    out, vjp_fn = jax.vjp(traced_loss(), *xs)
    captured.append(vjp_fn)
    return out, jax.tree_util.tree_leaves(vjp_fn)

  closed = jax.make_jaxpr(forward)(*leaves)
  num_res = len(closed.jaxpr.outvars) - 1
  linear = getattr(captured[0], "jaxpr", None)
  if (linear is not None and not remat3 and not kernels
      and not _jaxpr.any_eqn(linear, compat.has_python_transpose)):
    return TracedStep(closed, num_res, _flops.count_matmul_flops(linear))
  live = _traced_step(traced_loss, leaves)
  return TracedStep(closed, num_res,
                    _flops.count_matmul_flops(live) - forward_flops,
                    _flops.kernel_work(live) if kernels else {})


def _traced_step(traced_loss: Callable[[], Callable], leaves: list[Any]
                 ) -> Jaxpr:
  """The whole training step (forward and backward), dead code dropped."""
  def step(*xs):
    out, vjp_fn = jax.vjp(traced_loss(), *xs)
    return out, vjp_fn(jax.numpy.ones_like(out))

  closed = jax.make_jaxpr(step)(*leaves)
  # remat3 leaves dead recomputation in the traced program (XLA drops it).
  return compat.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))


@dataclasses.dataclass(frozen=True)
class ResidualOrigin:
  """Where one residual comes from, as read off the step jaxpr.

  Attributes:
    aval: its abstract value (shape, dtype, memory space).
    kind: ``"argument"`` (an input of the step), ``"constant"`` (an array
      the function closes over), ``"literal"`` (a scalar compiled into the
      program) or ``"activation"`` (computed by the forward pass): JAX's
      ``from the argument``, ``from a constant``, ``from a literal`` and
      ``named``/``output of`` categories.
    name: its checkpoint name, if any.
    primitive: the primitive that made it.
    module_path: the Flax module path of the equation that made it.
    source: ``file:line (function)`` of the code that made it.
    memory_kind: ``"device"`` or ``"host"``.
    stacked: the scan length it is stacked over.
    arg_index: for arguments, the index of the step's argument.
    var: the step variable holding it (what XLA shards), or a literal.
    kernel: the kernel that made it (a ``custom_vjp`` or ``pallas_call``
      name), if any.
    activation_matmul: whether a ``dot_general`` of two activations made
      it (attention logits: :func:`_jaxpr.multiplies_activations`).
  """

  aval: Any
  kind: str
  name: str | None
  primitive: str
  module_path: str
  source: str
  memory_kind: str
  stacked: int
  arg_index: int | None
  var: Any = None
  kernel: str | None = None
  activation_matmul: bool = False


def _producers(jaxpr: Jaxpr) -> dict[Any, JaxprEqn]:
  return {v: e for e in jaxpr.eqns for v in e.outvars if _jaxpr.is_jaxpr_var(v)}


def _join(prefix: str, path: str) -> str:
  if not prefix:
    return path
  if not path or path == prefix or path.startswith(prefix + "/"):
    return path or prefix
  return f"{prefix}/{path}"


class _OriginTracer:
  """Follows a variable through scan and call bodies to its producer.

  Call-like equations (jit, ``closed_call`` / ``eval_jaxpr``, custom_jvp
  and custom_vjp calls, remat regions: :func:`compat.call_body`) are looked
  through, so a residual is named after the equation that made it rather
  than the call it left by. Each is attributed to the kernel that made it,
  if any: one marked by :func:`_flops.mark_kernels` (the mark rides on what
  JAX derives from it), or a ``pallas_call`` found on the way.
  """

  def __init__(self, parameters: set[Any] | None = None):
    self._producers: dict[int, dict[Any, JaxprEqn]] = {}
    self._parameters = parameters or set()
    # Per equation (kept, so that its id is not reused), its call body: the
    # residuals of one layer all leave by the layer's call.
    self._bodies: dict[int, tuple[JaxprEqn, Jaxpr | None]] = {}

  def producer(self, jaxpr: Jaxpr, var: Any) -> JaxprEqn | None:
    if id(jaxpr) not in self._producers:
      self._producers[id(jaxpr)] = _producers(jaxpr)
    return self._producers[id(jaxpr)].get(var)

  def origin(self, var: Any, jaxpr: Jaxpr, prefix: str = "", stacked: int = 1,
             host: bool = False, kernel: str | None = None) -> dict:
    eqn = self.producer(jaxpr, var)
    if eqn is None:  # an input of the enclosing body: the region/loop input
      return dict(name=None, primitive="input", module_path=prefix,
                  source="", stacked=stacked, host=host, kernel=kernel,
                  activation_matmul=False)
    if kernel is not None:  # inside a kernel: its path is where it was called
      path = prefix
    else:
      mark = compat.kernel_mark_of(eqn)
      if mark is not None:
        kernel, path = mark[0], _join(prefix, "/".join(mark[1]))
      else:
        kernel = compat.kernel_name(eqn)
        path = _join(prefix, _jaxpr.module_path(eqn))
    name = compat.checkpoint_name_of(eqn)
    if name is not None:
      made = self._named_producer(eqn, jaxpr)
      return dict(name=name,
                  primitive=made.primitive.name if made is not None else "name",
                  module_path=path, source=_sources.source_of(eqn),
                  stacked=stacked, host=host,
                  kernel=kernel or (_kernel_of(made) if made else None),
                  activation_matmul=self._multiplies_activations(made))
    prim = eqn.primitive.name
    index = eqn.outvars.index(var)
    if prim in ("reduce_precision", "device_put"):
      # A copy (remat3 rounds saved values; an offload moves them): the
      # residual is the value it copies.
      host = host or _jaxpr.offload_destination(eqn) == "host"
      inner = eqn.invars[index if prim == "device_put" else 0]
      if _jaxpr.is_jaxpr_var(inner):
        return self.origin(inner, jaxpr, prefix, stacked, host, kernel)
    body = self._call_body(eqn)
    if prim == "scan":  # the forward program: never a linearized node
      body = _jaxpr.sub_jaxprs(eqn)[0]
      if index >= compat.scan_num_carry(eqn):  # stacked: one value per step
        inner = body.outvars[index]
        if _jaxpr.is_jaxpr_var(inner):
          return self.origin(inner, body, path,
                             stacked * _jaxpr.scan_length(eqn), host, kernel)
    elif body is not None:
      inner = body.outvars[index]
      if _jaxpr.is_jaxpr_var(inner):
        found = self.origin(inner, body, path, stacked, host, kernel)
        if found["primitive"] != "input":
          return found
    return dict(name=None, primitive=prim, module_path=path,
                source=_sources.source_of(eqn), stacked=stacked, host=host,
                kernel=kernel, activation_matmul=self._multiplies_activations(eqn))

  def _call_body(self, eqn: JaxprEqn) -> Jaxpr | None:
    """:func:`compat.call_body`, read once per equation."""
    hit = self._bodies.get(id(eqn))
    if hit is None or hit[0] is not eqn:
      hit = self._bodies[id(eqn)] = (eqn, compat.call_body(eqn))
    return hit[1]

  def _named_producer(self, eqn: JaxprEqn, jaxpr: Jaxpr) -> JaxprEqn | None:
    """The equation that made the value a checkpoint name was put on."""
    inner = eqn.invars[0] if eqn.invars else None
    if _jaxpr.is_jaxpr_var(inner):
      return self.producer(jaxpr, inner)
    return None

  def _multiplies_activations(self, eqn: JaxprEqn | None) -> bool:
    return eqn is not None and _jaxpr.multiplies_activations(eqn,
                                                            self._parameters)


def _kernel_of(eqn: JaxprEqn) -> str | None:
  """The kernel that made ``eqn``: its mark, else a kernel it is itself."""
  mark = compat.kernel_mark_of(eqn)
  return mark[0] if mark is not None else compat.kernel_name(eqn)


def residual_origins(step: Any, num_out: int, num_res: int
                     ) -> list[ResidualOrigin]:
  """One :class:`ResidualOrigin` per residual of a traced training step.

  Mirrors ``jax.ad_checkpoint.saved_residuals`` (same residual set, same
  order of categories) but follows names into scan, jit and remat bodies.
  A ``reduce_precision`` copy counts as the value it copies, once.
  """
  jaxpr = step.jaxpr
  copies = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns
            if e.primitive.name == "reduce_precision"}
  invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
  tracer = _OriginTracer(_jaxpr.parameter_vars(jaxpr))
  origins = []
  seen: set[Any] = set()
  for v in jaxpr.outvars[num_out:num_out + num_res]:
    if isinstance(v, Literal):
      origins.append(ResidualOrigin(v.aval, "literal", None, "literal", "",
                                    "", "device", 1, None, v))
      continue
    base = copies.get(v, v)
    if base in seen:
      continue
    seen.add(base)
    if base in invar_index or base in jaxpr.constvars:
      kind = "argument" if base in invar_index else "constant"
      origins.append(ResidualOrigin(
          base.aval, kind, None, kind, "", "",
          _jaxpr.memory_kind_of(base.aval), 1, invar_index.get(base), base))
      continue
    found = tracer.origin(base, jaxpr)
    host = found["host"] or _jaxpr.memory_kind_of(v.aval) == "host"
    origins.append(ResidualOrigin(
        v.aval, "activation", found["name"], found["primitive"],
        found["module_path"], found["source"], "host" if host else "device",
        found["stacked"], None, v, kernel=found["kernel"],
        activation_matmul=found["activation_matmul"]))
  return origins


def dtype_itemsize(dtype: Any) -> int:
  """Bytes per element, extended dtypes included (a threefry key is 8).

  Raises:
    TypeError: for a dtype name numpy does not know (pass the dtype object).
  """
  size = getattr(dtype, "itemsize", None)
  return int(size) if size is not None else np.dtype(dtype).itemsize


def aval_nbytes(aval: Any) -> int:
  """Bytes of an abstract value (all of it, stacked axes included)."""
  return int(math.prod(aval.shape)) * dtype_itemsize(aval.dtype)


def residual_program(step: Any, variables: list[Any]
                     ) -> tuple[Callable[..., list[Any]], list[bool], Jaxpr]:
  """The step's forward part with ``variables`` as its outputs.

  Returns ``(run, kept, jaxpr)``: ``run(*arguments)`` computes the variables
  that are not literals, in order; ``kept[i]`` says whether ``variables[i]``
  is one of them (a literal is no output of any program); ``jaxpr`` is what
  ``run`` evaluates, without the equations no output needs.
  """
  kept = [not isinstance(v, Literal) for v in variables]
  outs = [v for v, k in zip(variables, kept, strict=True) if k]
  forward = compat.dce_jaxpr(step.jaxpr.replace(outvars=outs),
                             [True] * len(outs))
  consts = step.consts

  def run(*xs):
    return compat.eval_jaxpr(forward, consts, *xs)

  return run, kept, forward


def residual_shardings(step: Any, variables: list[Any],
                       leaves: list[Any]) -> list[Any]:
  """The sharding XLA gives each of ``variables`` of the traced step.

  Compiles :func:`residual_program` here, the arguments sharded as
  ``leaves`` say (their ``sharding``), and the output shardings left to
  XLA's sharding propagation: what a jitted training step holds on each
  device. A literal gets ``None``.
  """
  run, kept, _ = residual_program(step, variables)
  compiled = jax.jit(run).lower(*leaves).compile()
  shardings = iter(compiled.output_shardings)
  return [next(shardings) if k else None for k in kept]
