"""``custom_vjp`` and Pallas kernels, and the jaxprs an equation runs.

A ``custom_vjp`` call under either implementation (``jax_custom_vjp3``
makes it a hijax call), its forward rule traced as a jaxpr, the parts of a
``jax.custom_vjp`` function whichever class made it; a ``pallas_call``'s
grid and declared cost. A hijax call keeps its body out of the equation's
parameters, so the jaxprs an equation runs, and whether it is call-like,
are read here too.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
from jax._src import core as _core
from jax._src import linear_util as _lu

from remat_toolkit._src.core.compat.equations import is_remat
from remat_toolkit._src.core.compat.equations import is_scan
from remat_toolkit._src.core.compat.equations import remat_body_of
from remat_toolkit._src.core.compat.jaxpr_types import Jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import JaxprEqn
from remat_toolkit._src.core.compat.jaxpr_types import _call_hi_primitive_p
from remat_toolkit._src.core.compat.jaxpr_types import inner_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import is_jaxpr_value

# Declared before the imports that may fail, so each name's type admits the
# None a release without it leaves.
_CustomVJPTraced: type[Any] | None
_custom_vjp_call_p: _core.Primitive | None
_custom_lin_p: _core.Primitive | None
_CustomVJP3: type[Any] | None

try:  # a custom_vjp call with jax_custom_vjp3 on (jax 0.12)
  from jax._src.hijax import CustomVJPTraced as _CustomVJPTraced
except ImportError:  # pragma: no cover - depends on the JAX release
  _CustomVJPTraced = None

try:  # the call of a jax.custom_vjp function, and its linearized form
  from jax._src.custom_derivatives import custom_vjp_call_p as _custom_vjp_call_p
  from jax._src.interpreters.ad import custom_lin_p as _custom_lin_p
except ImportError:  # pragma: no cover - depends on the JAX release
  _custom_vjp_call_p = _custom_lin_p = None

try:  # the class jax.custom_vjp returns under jax_custom_vjp3
  from jax._src.hijax import custom_vjp3 as _CustomVJP3
except ImportError:  # pragma: no cover - depends on the JAX release
  _CustomVJP3 = None

__all__ = [
    "call_body", "is_leaf", "note_leaf", "hidden_jaxprs", "is_custom_vjp_call",
    "is_pallas_call", "kernel_name", "pallas_grid_size", "pallas_cost_flops",
    "custom_vjp_forward", "has_python_transpose", "CustomVJPRules", "custom_vjp_rules",
    "rule_fingerprint",
]


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


# ---------------------------------------------------------------- custom_vjp functions

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


# ---------------------------------------------------------------- rules

#: How deep :func:`rule_fingerprint` follows functions into closures.
_RULE_DEPTH = 6
_PLAIN = (int, float, bool, str, bytes, type(None))
_RULES = (_lu.WrappedFun, functools.partial, types.FunctionType)


def rule_fingerprint(eqn: JaxprEqn) -> tuple[Any, ...]:
  """What the Python rules ``eqn`` carries compute, as far as its printed
  text does not say: a ``custom_vjp`` call's forward and backward rules, a
  ``custom_jvp`` call's JVP rule, a callback's function. Printed, a jaxpr
  names them (``bwd=flash_bwd``) but does not show them, so two calls of
  two different ``custom_vjp`` functions with one primal print alike.

  A rule is fingerprinted by its code, the values it closes over and its
  default arguments, not by identity: a kernel made anew per layer (a
  ``custom_vjp`` defined inside a function) gives one fingerprint for every
  layer. JAX's own per-call
  wrappers are looked through to the rules they wrap. An object that cannot
  be compared by value counts by identity, so two calls whose rules cannot
  be told apart are never taken for one. Empty for an equation without
  rules.
  """
  found = []
  for key, value in sorted(eqn.params.items()):
    if isinstance(value, _RULES):
      found.append((key, _fingerprint(value, 0)))
  prim = _custom_vjp3_of(eqn)
  if prim is not None:  # a jax_custom_vjp3 call keeps its rules on its primitive
    found.append(("_prim", tuple(
        _fingerprint(getattr(prim, rule, None), 0)
        for rule in ("fwd", "bwd", "remat_rules", "bwd_accums"))))
  return tuple(found)


def _fingerprint(value: Any, depth: int) -> Any:
  if depth > _RULE_DEPTH:
    return ("id", id(value))
  if isinstance(value, _lu.WrappedFun):
    return ("wrapped", _fingerprint(value.f, depth + 1))
  if isinstance(value, functools.partial):
    return ("partial", _fingerprint(value.func, depth + 1),
            tuple(_fingerprint(a, depth + 1) for a in value.args),
            tuple(sorted((k, _fingerprint(v, depth + 1))
                         for k, v in value.keywords.items())))
  if isinstance(value, types.FunctionType):
    cells = []
    for cell in value.__closure__ or ():
      try:
        content = cell.cell_contents
      except ValueError:  # an empty cell
        continue
      if _is_jax_internal(value) and not isinstance(content, _RULES):
        continue  # JAX's per-call state (its trace, avals, caches)
      cells.append(_fingerprint(content, depth + 1))
    defaults = (value.__defaults__ or (), value.__kwdefaults__ or {})
    return ("function", value.__code__, tuple(cells),
            _fingerprint(defaults[0], depth + 1),
            tuple(sorted((k, _fingerprint(v, depth + 1))
                         for k, v in defaults[1].items())))
  if isinstance(value, _PLAIN):
    return ("value", type(value), value)
  if isinstance(value, tuple):
    return ("tuple", tuple(_fingerprint(v, depth + 1) for v in value))
  return ("id", id(value))


def _is_jax_internal(fn: types.FunctionType) -> bool:
  return (getattr(fn, "__module__", "") or "").startswith("jax.")
