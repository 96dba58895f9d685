"""The peak of a training step, predicted from its jaxpr as XLA would lay it out.

:func:`predict_peak` walks the whole step (forward and backward, or a train
step with its optimizer update) in program order and keeps the bytes of every
buffer alive between the equation that makes it and its last use. What XLA
does to buffers is modelled from the program alone, nothing is compiled:

- **Fusion.** An elementwise value (add, convert, broadcast, reshape, ...)
  whose every consumer is elementwise or a reduction is fused into them and
  never stored, except a cast read again by the other pass (the backward
  pass reading a forward cast), which is stored. A transpose that only
  feeds matmuls becomes the matmul's operand layout.
- **Common subexpressions.** Where XLA merges them (the jax 0.10 XLA:CPU
  does, across remat's optimization barriers; ``merge_argument_casts``), an
  elementwise function or transpose of the step's arguments alone (a
  parameter cast to bfloat16) is computed once for both passes, so it lives
  from its first use to its last; elsewhere each pass casts again.
- **In place.** A value an elementwise op turns into an output (a
  gradient's last sum, its cast to the parameter's dtype) and that dies
  there is written in the output's buffer, as XLA shares an operand's
  buffer with its result.
- **Names and barriers.** ``checkpoint_name``, ``optimization_barrier`` and
  the ``reduce_precision`` JAX puts after a name (it keeps every bit) are
  identities: the named value is the value.
- **Loops and branches** (``scan``, ``while``, ``cond``): their outputs are
  allocated when they start, and the largest transient set of one iteration
  (or branch) is added while they run. A scan of length 1 is its body, run
  once inline: XLA's loop simplifier removes a loop of one trip.
- **Packing.** XLA lays the step's temporaries out in one block, each
  buffer at an offset that no buffer live at the same time holds: the
  larger (or the longer-lived) first, each in the tightest gap that fits
  (its heap simulator, the better of the two orders). Gaps left between
  buffers of other sizes make the block larger than what is live at once;
  the difference is listed as ``packing``.
- **Arguments and outputs** are held for the whole step, as XLA allocates
  them (its ``memory_analysis()`` counts ``argument + output + temp``),
  except an argument the step never reads (a batch field the loss ignores, a
  parameter it does not use): ``jax.jit`` drops it from the compiled program.
- **XLA:CPU** computes 16-bit matmuls in float32: each 16-bit operand is
  stored again in float32 and the product comes out in float32 (a product
  the other pass reads is kept in 16 bits; an operand it reads waits in 16
  bits too unless XLA merges the two passes' conversions) and, where XLA
  does (``convert_loop_inputs``), a 16-bit stacked input a loop's body
  reads is converted whole before the loop, the 16-bit original freed
  there when the loop is its last reader
  (``upcast_low_precision_matmuls``).

Where XLA's passes differ between releases (the merged casts, the loop's
conversions), ``compat`` probes the backend once with a tiny program and the
model follows what it finds. The walk follows the program's order, which
XLA's scheduler keeps closely enough on the shapes measured
(``benchmarks/peak_accuracy.py``); the known gaps are in the docs' "Predict
the step's peak" page.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit._src.analysis.liveness import predict_peak
  >>> f = lambda w, x: jnp.tanh(x @ w).sum()
  >>> step = jax.make_jaxpr(jax.grad(f))(jnp.ones((64, 64)), jnp.ones((8, 64)))
  >>> peak = predict_peak(step.jaxpr, ["parameter", "input"])
  >>> peak.bytes  # w, x, dw and x @ w (dw is made in its output's buffer)
  36864
  >>> sorted({v.phase for v in peak.live})
  ['forward transient', 'gradient', 'input', 'parameter']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from remat_toolkit._src.analysis.packing import PACKED_MIN_BYTES
from remat_toolkit._src.analysis.packing import packed_bytes
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr
from remat_toolkit._src.core.compat import Jaxpr
from remat_toolkit._src.core.compat import JaxprEqn

__all__ = ["LiveValue", "LivenessPeak", "predict_peak", "PHASES"]

#: What a value live at the peak is, in the order results list them.
PHASES = ("parameter", "input", "optimizer state", "gradient", "output",
          "kept residual", "forward transient", "backward transient")

# Primitives XLA fuses into their consumers (loop fusion): no buffer of their
# own when every consumer fuses them too.
_ELEMENTWISE = frozenset("""
add add_any sub mul div rem neg abs sign floor ceil round is_finite max min
exp exp2 expm1 log log1p tanh logistic sqrt rsqrt cbrt pow integer_pow square
sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh erf erfc erf_inv
lgamma digamma select_n clamp convert_element_type reduce_precision
eq ne lt le gt ge and or not xor shift_left shift_right_logical
shift_right_arithmetic population_count nextafter real imag conj complex
broadcast_in_dim reshape squeeze expand_dims iota stop_gradient copy copy_p
one_minus_square
""".split())
# Consumers an elementwise producer fuses into as well (input fusion).
_REDUCTIONS = frozenset("""
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin cumsum cumlogsumexp cummax cummin
""".split())
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
# Casts and layout changes.
_CHEAP = frozenset("""
convert_element_type broadcast_in_dim reshape squeeze expand_dims iota
reduce_precision copy copy_p neg stop_gradient transpose
""".split())
# Identities for buffers: the value out is the value in (JAX's
# reduce_precision after a checkpoint name keeps every bit, and XLA drops it).
_IDENTITIES = frozenset({"optimization_barrier", "reduce_precision"})


@dataclasses.dataclass(frozen=True)
class LiveValue:
  """One buffer live at the predicted peak.

  Attributes:
    shape: its shape.
    dtype: its dtype name (the stored one: ``float32`` for a 16-bit matmul
      operand XLA:CPU upcasts).
    nbytes: bytes it holds.
    phase: one of :data:`PHASES`.
    module_path: the module that made it (argument path for an argument).
    name: its checkpoint name, if it has one.
    primitive: the primitive that made it (``"argument"`` for an argument).
    index: for an argument or output, its position in the step's arguments
      or outputs.
  """

  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  phase: str
  module_path: str
  name: str | None
  primitive: str
  index: int | None = None


@dataclasses.dataclass(frozen=True)
class LivenessPeak:
  """The predicted peak: its bytes, what is live then, and where it falls.

  Attributes:
    bytes: the sum of ``live``.
    live: every buffer live at the peak, arguments and outputs included.
    primitive: the primitive running at the peak.
    module_path: the module it belongs to.
    backward: whether it belongs to the backward pass.
  """

  bytes: int
  live: tuple[LiveValue, ...]
  primitive: str
  module_path: str
  backward: bool


@dataclasses.dataclass
class _Op:
  primitive: str
  ins: list[int | None]
  outs: list[int]
  eqn: JaxprEqn | None
  inner: int = 0  # the largest transient set of a loop body or branch
  inner_live: tuple[LiveValue, ...] = ()  # that set
  # Inputs a loop reads through a float32 copy made before it: one the loop
  # reads last is freed once copied, so the copy takes its place.
  converted: tuple[int, ...] = ()
  path: str = ""  # module path, the enclosing calls' included
  backward: bool = False


@dataclasses.dataclass
class _Value:
  aval: Any
  nbytes: int
  op: int | None = None  # index of the producing op; None for an input
  name: str | None = None


def nbytes_of(aval: Any) -> int:
  """Device bytes of an abstract value (0 in host memory, or without a shape)."""
  if _jaxpr.memory_kind_of(aval) != "device":
    return 0
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  try:
    itemsize = np.dtype(dtype).itemsize
  except TypeError:  # extended dtypes (PRNG keys): their base array
    itemsize = getattr(dtype, "itemsize", 4) or 4
  return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def _is_low_precision(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  if dtype is None:
    return False
  try:
    return np.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
  except TypeError:
    return False


class _Program:
  """A step flattened to one list of ops: call-like bodies inlined, loops
  and branches kept whole with the transient peak of their bodies."""

  def __init__(self, upcast: bool, merge: bool, convert_loop_inputs: bool):
    self.ops: list[_Op] = []
    self.values: list[_Value] = []
    self.upcast = upcast
    self.merge = merge
    self.convert_loop_inputs = convert_loop_inputs
    # Casts and layout changes of the step's arguments, computed once
    # (XLA's common subexpressions, across remat's barriers too).
    self._merged: dict[tuple, list[int]] = {}
    self._of_arguments: set[int] = set()

  def new_value(self, aval: Any, op: int | None) -> int:
    self.values.append(_Value(aval, nbytes_of(aval), op))
    return len(self.values) - 1

  def add(self, jaxpr: Jaxpr, env: dict[Any, int], path: str = "",
          backward: bool = False) -> None:
    for eqn in jaxpr.eqns:
      ins = [env.get(a) if _jaxpr.is_jaxpr_var(a) else None for a in eqn.invars]
      name = compat.checkpoint_name_of(eqn)
      if ((name is not None or eqn.primitive.name in _IDENTITIES)
          and len(eqn.invars) == len(eqn.outvars)):
        for o, i in zip(eqn.outvars, ins, strict=True):
          if i is not None:
            env[o] = i
            self.values[i].name = self.values[i].name or name
        continue
      here = _join(path, _jaxpr.module_path(eqn))
      back = backward or _is_backward(eqn)
      body = compat.call_body(eqn)
      if body is None:
        body = _single_iteration_body(eqn)
      if body is not None:
        self._inline(eqn, body, ins, env, here, back)
        continue
      self._add_eqn(eqn, ins, env, here, back)

  def _inline(self, eqn: JaxprEqn, body: Jaxpr, ins: list[int | None],
              env: dict[Any, int], path: str, backward: bool) -> None:
    inner = {v: i for v, i in zip(body.invars, ins, strict=True) if i is not None}
    self.add(body, inner, path, backward)
    for o, b in zip(eqn.outvars, body.outvars, strict=True):
      if _jaxpr.is_jaxpr_var(b) and b in inner:
        env[o] = inner[b]
      else:  # a literal or constant output: a small buffer of its own
        op = len(self.ops)
        env[o] = self.new_value(o.aval, op)
        self.ops.append(_Op("literal", [], [env[o]], eqn, path=path,
                            backward=backward))

  def _add_eqn(self, eqn: JaxprEqn, ins: list[int | None],
               env: dict[Any, int], path: str, backward: bool) -> None:
    prim = eqn.primitive.name
    subs = _jaxpr.sub_jaxprs(eqn)
    key = self._merge_key(eqn, ins) if not subs else None
    if key is not None and key in self._merged:
      for o, v in zip(eqn.outvars, self._merged[key], strict=True):
        env[o] = v
      return
    op = len(self.ops)
    outs = [self.new_value(o.aval, op) for o in eqn.outvars]
    for o, v in zip(eqn.outvars, outs, strict=True):
      env[o] = v
    inner: tuple[LiveValue, ...] = ()
    for sub in subs:
      found = _body_peak(sub, self, path, backward)
      if sum(v.nbytes for v in found) > sum(v.nbytes for v in inner):
        inner = found
    converted: tuple[int, ...] = ()
    if compat.is_scan(eqn):
      copies, converted = self._loop_copies(eqn, ins, path, backward)
      inner += copies
    self.ops.append(_Op(prim, ins, outs, eqn, inner=sum(v.nbytes for v in inner),
                        inner_live=inner, converted=converted, path=path,
                        backward=backward))
    if key is not None:
      self._merged[key] = outs
      self._of_arguments.update(outs)

  def _merge_key(self, eqn: JaxprEqn, ins: list[int | None]) -> tuple | None:
    """What identifies an elementwise function of the step's arguments alone
    (a parameter cast to bfloat16), which XLA computes once for both passes."""
    if (not self.merge or not ins
        or eqn.primitive.name not in _ELEMENTWISE | {"transpose"}):
      return None
    if not all(i is not None and (self.values[i].op is None
                                  or i in self._of_arguments) for i in ins):
      return None
    params = repr(sorted((k, repr(v)) for k, v in eqn.params.items()))
    return (eqn.primitive.name, tuple(ins), params)

  def _loop_copies(self, eqn: JaxprEqn, ins: list[int | None], path: str,
                   backward: bool) -> tuple[tuple[LiveValue, ...], tuple[int, ...]]:
    """Buffers XLA adds around a loop, and the inputs they stand for: on
    XLA:CPU, where it does, every 16-bit stacked input the body reads (a
    matmul operand, or a value its elementwise math computes on in float32)
    is converted to float32 whole, before the loop."""
    if not (self.upcast and self.convert_loop_inputs):
      return (), ()
    body = _jaxpr.sub_jaxprs(eqn)[0]
    read = {v for e in body.eqns for v in e.invars if _jaxpr.is_jaxpr_var(v)}
    first_xs = compat.scan_num_consts(eqn) + compat.scan_num_carry(eqn)
    copies: list[LiveValue] = []
    converted: list[int] = []
    for k in range(first_xs, len(eqn.invars)):
      aval = eqn.invars[k].aval
      if body.invars[k] in read and _is_low_precision(aval):
        copies.append(LiveValue(_shape(aval), "float32", 2 * nbytes_of(aval),
                                "backward transient" if backward else
                                "forward transient", path, None,
                                "convert_element_type"))
        source = ins[k]
        if source is not None:
          converted.append(source)
    return tuple(copies), tuple(converted)


def _single_iteration_body(eqn: JaxprEqn) -> Jaxpr | None:
  """The body of a scan that runs once, which XLA inlines (its loop
  simplifier removes a loop of one trip): each slice the body reads is its
  whole stacked input, each output it stacks is the output itself."""
  if not compat.is_scan(eqn) or eqn.params.get("length") != 1:
    return None
  subs = _jaxpr.sub_jaxprs(eqn)
  if len(subs) != 1:
    return None
  body = subs[0]
  if (body.constvars or len(body.invars) != len(eqn.invars)
      or len(body.outvars) != len(eqn.outvars)):
    return None
  pairs = [*zip(body.invars, eqn.invars, strict=True),
           *zip(body.outvars, eqn.outvars, strict=True)]
  if any(nbytes_of(a.aval) != nbytes_of(b.aval) for a, b in pairs):
    return None
  return body


def _join(prefix: str, path: str) -> str:
  """The module path of an equation inside a call made at ``prefix``: a body
  traced apart from its call site (a jitted function) holds paths relative
  to it, a region's body (remat, JAX's own call of a transposed region)
  holds whole paths."""
  if not prefix or not path:
    return path or prefix
  if prefix.split("/")[-1] in path.split("/"):
    return path
  return f"{prefix}/{path}"


def _body_peak(body: Jaxpr, outer: _Program, path: str, backward: bool
               ) -> tuple[LiveValue, ...]:
  """The largest set of transients one run of ``body`` holds at once."""
  program = _Program(outer.upcast, outer.merge, outer.convert_loop_inputs)
  env = {v: program.new_value(v.aval, None)
         for v in [*body.constvars, *body.invars]}
  program.add(body, env, path, backward)
  return tuple(_transients(_Simulation(program, outputs=set())))


class _Simulation:
  """Liveness of one flattened program, under the buffer model above."""

  def __init__(self, program: _Program, outputs: set[int],
               own_buffers: set[int] | frozenset[int] = frozenset()):
    self.program = program
    self.outputs = outputs
    # Outputs with a buffer of their own (not a donated argument's), which
    # a value can be written in (see _write_into_outputs).
    self.own_buffers = own_buffers
    ops, values = program.ops, program.values
    self.consumers: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
      for i in op.ins:
        if i is not None:
          self.consumers.setdefault(i, []).append(k)
    self.last = {v: max(cs) for v, cs in self.consumers.items()}
    self.size = [v.nbytes for v in values]
    if program.upcast:
      self._upcast_matmul_operands()
    self._stored: dict[int, bool] = {}
    self._write_into_outputs()
    (self.peak_transients, self.peak_at, self.peak_set,
     self.intervals) = self._run()

  def _source(self, v: int | None) -> int | None:
    """The stored value behind a chain of transposes feeding a matmul."""
    values, ops = self.program.values, self.program.ops
    while v is not None:
      op = values[v].op
      if op is None or ops[op].primitive != "transpose":
        break
      v = ops[op].ins[0]
    return v

  def _upcast_matmul_operands(self) -> None:
    values, ops = self.program.values, self.program.ops
    for op in ops:
      if op.primitive not in _MATMULS:
        continue
      for i in op.ins:
        src = self._source(i)
        # An operand the other pass reads waits in 16 bits, each pass
        # converting it for itself, unless XLA merges the two conversions.
        if (src is not None and values[src].op is not None
            and _is_low_precision(values[src].aval)
            and (self.program.merge or not self._crosses(src))):
          self.size[src] = 2 * values[src].nbytes
      for o in op.outs:
        # A product the other pass reads is kept as the program types it;
        # its float32 form lives only while this pass uses it.
        if _is_low_precision(values[o].aval) and not self._crosses(o):
          self.size[o] = 2 * values[o].nbytes

  def _crosses(self, v: int) -> bool:
    """Whether the other pass reads ``v``."""
    ops, producer = self.program.ops, self.program.values[v].op
    backward = producer is not None and ops[producer].backward
    return any(ops[c].backward != backward for c in self.consumers.get(v, []))

  def _write_into_outputs(self) -> None:
    """A value an elementwise op (or a transpose) turns into an output (a
    gradient's last sum) is written in that output's buffer when it dies
    there: XLA shares an operand's buffer with the result."""
    values = self.program.values
    for o in self.own_buffers:
      path = self._into(o, values[o].nbytes, 0)
      for v in path:
        self.size[v] = 0

  def _into(self, o: int, room: int, depth: int) -> list[int]:
    """The values along the chain of in-place producers of ``o`` with the
    most stored bytes."""
    values, ops = self.program.values, self.program.ops
    k = values[o].op
    if k is None or depth > 8:
      return []
    op = ops[k]
    if op.primitive not in _ELEMENTWISE | {"transpose"} or len(op.outs) != 1:
      return []
    elements = np.prod(_shape(values[o].aval))
    best: list[int] = []
    for i in op.ins:
      if (i is None or values[i].op is None or i in self.outputs
          or self.last.get(i) != k or self.size[i] > room
          or np.prod(_shape(values[i].aval)) != elements):
        continue
      path = [i, *self._into(i, room, depth + 1)]
      if sum(self.size[v] for v in path) > sum(self.size[v] for v in best):
        best = path
    return best

  def stored(self, v: int) -> bool:
    """Whether XLA gives value ``v`` a buffer (it is not fused away)."""
    if v not in self._stored:
      self._stored[v] = self._decide_stored(v)
    return self._stored[v]

  def _decide_stored(self, v: int) -> bool:
    values, ops = self.program.values, self.program.ops
    producer = values[v].op
    consumers = self.consumers.get(v, [])
    if producer is None or v in self.outputs or not consumers:
      return v in self.outputs or producer is None
    prim = ops[producer].primitive
    # A cast the other pass reads again is stored (JAX's reduce_precision
    # after a checkpoint name, a residual's bfloat16 copy); XLA computes
    # an expensive value again from its stored operands instead.
    if prim in _CHEAP and self._crosses(v):
      return True
    if prim == "transpose":
      return not all(ops[c].primitive in _ELEMENTWISE | _REDUCTIONS | _MATMULS
                     for c in consumers)
    if prim not in _ELEMENTWISE:
      return True
    return not all(
        ops[c].primitive in _ELEMENTWISE | _REDUCTIONS
        or (ops[c].primitive == "transpose" and not self.stored(ops[c].outs[0]))
        for c in consumers)

  def _run(self) -> tuple[int, int, dict[int, int], list[tuple[int, int, int]]]:
    """The largest live sum, the op it falls at and what is live then, and
    every temporary's (first op, last op, bytes), for packing."""
    ops, last = self.program.ops, self.last
    live: dict[int, int] = {}
    current = peak = 0
    peak_at, peak_set = -1, {}
    spans: dict[int, list[int]] = {}  # by value: [first op, last op, bytes]
    intervals: list[tuple[int, int, int]] = []
    for k, op in enumerate(ops):
      born = {o: self.size[o] for o in op.outs
              if o not in self.outputs and o in self.consumers and self.stored(o)}
      # An input the loop reads through its float32 copy, and reads last,
      # is freed once copied: the copy (in op.inner) takes its place.
      copied = {i for i in op.converted if last.get(i) == k and i in live}
      for c in copied & spans.keys():
        spans[c][1] = k - 1
      spans.update({o: [k, last.get(o, k), b] for o, b in born.items() if b})
      intervals.extend((k, k, v.nbytes) for v in op.inner_live if v.nbytes)
      now = (current + sum(born.values()) + op.inner
             - sum(live[i] for i in copied))
      if now > peak:
        peak, peak_at = now, k
        peak_set = {i: b for i, b in {**live, **born}.items() if i not in copied}
      live.update(born)
      current += sum(born.values())
      for i in set(op.ins):
        if i is not None and last.get(i) == k and i in live:
          current -= live.pop(i)
    intervals.extend((first, end, b) for first, end, b in spans.values())
    return peak, peak_at, peak_set, intervals

  def packed_bytes(self) -> int:
    """The size of the block XLA lays this program's temporaries out in:
    the packing of those of :data:`PACKED_MIN_BYTES` or more (smaller ones
    fill its gaps), and at least their largest live sum
    (:attr:`peak_transients`)."""
    big = [t for t in self.intervals if t[2] >= PACKED_MIN_BYTES]
    return max(packed_bytes(big), self.peak_transients)


def predict_peak(jaxpr: Jaxpr, arg_phases: Sequence[str], *,
                 out_phases: Sequence[str] | None = None,
                 arg_paths: Sequence[str] | None = None,
                 out_paths: Sequence[str] | None = None,
                 donated: Sequence[bool] | None = None,
                 upcast_low_precision_matmuls: bool = False,
                 merge_argument_casts: bool = False,
                 convert_loop_inputs: bool = False) -> LivenessPeak:
  """The peak bytes of ``jaxpr`` as one XLA program, and what is live then.

  Args:
    jaxpr: the whole step (its constvars, the arrays it closes over, are
      the compiled program's constants: not counted, as XLA's figure does
      not count them).
    arg_phases: the phase of each invar (``"parameter"``, ``"input"``,
      ``"optimizer state"``).
    out_phases: the phase of each outvar (default ``"gradient"``).
    arg_paths: a label per invar (its pytree path).
    out_paths: a label per outvar (the parameter a gradient is of).
    donated: per invar, whether the step donates it (an output of its type
      then reuses its buffer, as ``memory_analysis()``'s alias bytes say).
    upcast_low_precision_matmuls: XLA:CPU's float32 matmuls (see above).
    merge_argument_casts: whether XLA computes a cast of an argument once
      for both passes (see above; ``compat.xla_merges_parameter_casts``).
    convert_loop_inputs: whether XLA converts the 16-bit stacked inputs a
      loop reads to float32 whole (``compat.xla_converts_loop_inputs_whole``).
  """
  program = _Program(upcast_low_precision_matmuls, merge_argument_casts,
                     convert_loop_inputs)
  env: dict[Any, int] = {}
  for v in jaxpr.constvars:
    env[v] = program.new_value(v.aval, None)
  inputs = [program.new_value(v.aval, None) for v in jaxpr.invars]
  env.update(zip(jaxpr.invars, inputs, strict=True))
  program.add(jaxpr, env)
  outputs = [env.get(v) if _jaxpr.is_jaxpr_var(v) else None
             for v in jaxpr.outvars]
  read = _read_inputs(jaxpr)
  kept = _outputs(jaxpr, out_phases, out_paths,
                  [bool(d) and k in read for k, d in enumerate(donated or ())])
  held: dict[int, LiveValue] = {}
  for k, value in kept.items():
    out = outputs[k]
    if out is not None and out not in inputs:
      held[out] = value
  # memory_analysis() counts every output for the whole step; XLA lays
  # temporaries in an output's buffer before the output is written only
  # some of the time, which this model leaves out.
  sim = _Simulation(program, outputs={o for o in outputs if o is not None},
                    own_buffers=set(held))
  live = _arguments(jaxpr, arg_phases, arg_paths, read)
  live += list(held.values()) + [v for k, v in kept.items()
                                 if outputs[k] is None or outputs[k] in inputs]
  transients = _transients(sim)
  live += transients
  gap = sim.packed_bytes() - sum(v.nbytes for v in transients)
  if gap > 0:
    live.append(LiveValue((), "", gap, "packing", "", None, "packing"))
  op = program.ops[sim.peak_at] if 0 <= sim.peak_at < len(program.ops) else None
  return LivenessPeak(
      bytes=sum(v.nbytes for v in live), live=tuple(live),
      primitive=op.primitive if op is not None else "",
      module_path=op.path if op is not None else "",
      backward=op is not None and op.backward)


def _read_inputs(jaxpr: Jaxpr) -> set[int]:
  """The positions of the inputs the (dead-code-free) step reads or
  returns: the arguments ``jax.jit`` keeps in the compiled program."""
  used = {v for e in jaxpr.eqns for v in e.invars if _jaxpr.is_jaxpr_var(v)}
  used.update(v for v in jaxpr.outvars if _jaxpr.is_jaxpr_var(v))
  return {k for k, v in enumerate(jaxpr.invars) if v in used}


def _arguments(jaxpr: Jaxpr, phases: Sequence[str],
               paths: Sequence[str] | None, read: set[int]) -> list[LiveValue]:
  # Closed-over arrays (constvars) are constants of the compiled program,
  # outside the argument, output and temporary bytes: not counted.
  out: list[LiveValue] = []
  for k, v in enumerate(jaxpr.invars):
    if k not in read:
      continue
    out.append(LiveValue(_shape(v.aval), _dtype(v.aval), nbytes_of(v.aval),
                         phases[k], paths[k] if paths else "", None,
                         "argument", k))
  return out


def _outputs(jaxpr: Jaxpr, phases: Sequence[str] | None,
             paths: Sequence[str] | None, donated: Sequence[bool] | None
             ) -> dict[int, LiveValue]:
  """The outputs that need buffers of their own, by position (an output of
  a donated argument's type reuses that argument's buffer)."""
  free = [k for k, d in enumerate(donated or ()) if d]
  out = {}
  for k, v in enumerate(jaxpr.outvars):
    phase = phases[k] if phases else "gradient"
    size = nbytes_of(v.aval)
    # A donated argument of the same type is reused for this output.
    match = next((a for a in free if _same(jaxpr.invars[a].aval, v.aval)), None)
    if match is not None:
      free.remove(match)
      continue
    out[k] = LiveValue(_shape(v.aval), _dtype(v.aval), size, phase,
                       paths[k] if paths else "", None, "output", k)
  return out


def _same(a: Any, b: Any) -> bool:
  return (getattr(a, "shape", None) == getattr(b, "shape", None)
          and getattr(a, "dtype", None) == getattr(b, "dtype", None))


def _transients(sim: _Simulation) -> list[LiveValue]:
  values, ops = sim.program.values, sim.program.ops
  out: list[LiveValue] = []
  for v, size in sorted(sim.peak_set.items(), key=lambda kv: -kv[1]):
    if not size:  # written in an output's buffer
      continue
    value = values[v]
    op = ops[value.op] if value.op is not None else None
    if op is not None and op.backward:
      phase = "backward transient"
    elif v in sim.last and ops[sim.last[v]].backward:
      phase = "kept residual"
    else:
      phase = "forward transient"
    dtype = _dtype(value.aval)
    if size == 2 * value.nbytes and _is_low_precision(value.aval):
      dtype = "float32"
    out.append(LiveValue(
        _shape(value.aval), dtype, size, phase,
        op.path if op is not None else "", value.name,
        op.primitive if op is not None else "argument"))
  if 0 <= sim.peak_at < len(ops):
    out.extend(ops[sim.peak_at].inner_live)
  return out


def _is_backward(eqn: JaxprEqn) -> bool:
  return "transpose(" in str(eqn.source_info.name_stack)


def _shape(aval: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(aval, "shape", ()))


def _dtype(aval: Any) -> str:
  return str(getattr(aval, "dtype", ""))
