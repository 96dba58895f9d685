"""Checks that a remat policy is correct and does what its name says.

:func:`verify` answers three questions about ``fn`` under one policy:

* **Gradients**: are they the gradients of the same program with no remat at
  all? The reference inlines every remat region (what "without remat" means
  under both remat implementations: under jax 0.10's ``jax_remat3``,
  ``everything_saveable`` still recomputes un-named values, so it is no
  baseline).
* **No-op**: does the policy keep exactly what ``save-everything`` or
  ``boundary-only`` keeps, although it names something else? (JAX's stubbed
  ``save_anything_except_these_names`` saves everything;
  ``dots_with_no_batch_dims_saveable`` saves nothing under ``vmap``; a
  policy whose names are absent from the model keeps only region inputs.)
* **Warnings**: effects inside a remat region run again when it is
  recomputed (``jax.debug.print``, ``jax.debug.callback``, ``io_callback``,
  ``pure_callback``), and a function whose trace differs between two traces
  reads Python-side state.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def block(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
  >>> loss = lambda w, x: block(w, x).sum()
  >>> w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
  >>> result = rt.verify(loss, w, x, policy="save-ffn")
  >>> result.ok, result.no_op, result.warnings
  (True, None, ())
  >>> rt.verify(loss, w, x, policy="save-attention").no_op
  'boundary-only'
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from remat_toolkit._src.analysis import regions as _regions
from remat_toolkit._src.analysis.report import policy_findings
from remat_toolkit._src.analysis.report import program_findings
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.inputs import concrete_leaves as _concrete_leaves
from remat_toolkit._src.core.inputs import random_inputs
from remat_toolkit._src.policies import findings
from remat_toolkit._src.policies import lowering
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.results.analysis import Residual
from remat_toolkit._src.results.analysis import Verification
from remat_toolkit._src.results.analysis import kept_bytes
from remat_toolkit._src.transform import trace_cache

__all__ = ["verify", "default_tolerances", "random_inputs", "compare_values"]

#: ``(rtol, atol)`` by the narrowest floating dtype the program computes in.
#: Two compilations of one program may fuse and reduce in another order, so
#: the check is norm-wise: ``max|g - g_ref| <= atol + rtol * scale``, where
#: ``scale`` is the largest gradient entry of any leaf (``|loss|`` for the loss).
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 0.0),
    "float32": (1e-5, 0.0),
    "float16": (1e-2, 0.0),
    "bfloat16": (1e-2, 0.0),
}

# ================================================================ the result


# ================================================================ policies

def _names_something(policy: Policy) -> bool:
  """Whether the policy claims to keep something other than all or nothing."""
  if policy.is_jax_policy:
    cp = jax.checkpoint_policies
    return policy.jax_policy not in (cp.everything_saveable, cp.nothing_saveable)
  if policy.save_everything:
    return False
  return bool(policy.save or policy.offload) or policy.matmuls != "none"


def default_tolerances(dtypes: Iterable[Any]) -> tuple[float, float]:
  """``(rtol, atol)`` for the narrowest of ``dtypes`` (see :data:`TOLERANCES`).

  Example:
    >>> import jax.numpy as jnp
    >>> from remat_toolkit._src.analysis.verify import default_tolerances
    >>> default_tolerances([jnp.float32, jnp.bfloat16])
    (0.01, 0.0)
  """
  found = [TOLERANCES.get(np.dtype(d).name, TOLERANCES["float32"])
           for d in dtypes]
  return max(found, default=TOLERANCES["float32"])


# ================================================================ gradients

#: XLA options of the two gradient programs: LLVM optimisation off compiles
#: two to three times faster on CPU; the HLO passes (fusion, CSE, remat's
#: optimisation barriers) run as usual.
COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0,
                                    "xla_llvm_disable_expensive_passes": True}


def _compiled_value_and_grad(loss: Callable[..., Any], leaves: list[Any],
                             diff: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
  step = jax.jit(jax.value_and_grad(loss, argnums=diff))
  return step.lower(*leaves).compile(COMPILER_OPTIONS)(*leaves)


@dataclasses.dataclass(frozen=True)
class _Diff:
  ok: bool
  max_abs: float
  max_rel: float
  worst: str


def _max_abs(x: Any) -> float:
  x = np.asarray(x, np.float64)
  return float(np.max(np.abs(x[np.isfinite(x)]), initial=0.0))


def compare_values(got: Sequence[Any], want: Sequence[Any], labels: Sequence[str],
             rtol: float, atol: float) -> _Diff:
  """Norm-wise comparison, each leaf against the scale of its group.

  ``got[0]``/``want[0]`` are the losses (their own scale); the rest are
  gradient leaves, measured against the largest gradient entry of all
  leaves, so a leaf whose exact gradient is zero (a key bias) does not turn
  rounding noise into a large relative error.
  """
  grad_scale = max((_max_abs(b) for b in want[1:]), default=0.0)
  ok, max_abs, max_rel, worst = True, 0.0, 0.0, labels[0]
  for i, (a, b, label) in enumerate(zip(got, want, labels, strict=True)):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    same_finite = np.array_equal(np.isfinite(a), np.isfinite(b))
    mask = np.isfinite(a) & np.isfinite(b)
    diff = float(np.max(np.abs(a - b)[mask], initial=0.0)) if same_finite else math.inf
    scale = _max_abs(b) if i == 0 else grad_scale
    rel = diff / scale if scale else (0.0 if diff == 0 else math.inf)
    ok &= diff <= atol + rtol * scale
    max_abs = max(max_abs, diff)
    if rel > max_rel:
      max_rel, worst = rel, label
  return _Diff(bool(ok), max_abs, max_rel, worst)


# ================================================================ findings

def _residual_signature(residuals: Sequence[Residual]) -> collections.Counter:
  return collections.Counter(
      (r.shape, r.dtype, r.kind, r.name, r.primitive, r.module_path,
       r.memory_kind, r.stacked) for r in residuals)


def _no_op(program: TracedProgram, policy: Policy,
           kept: collections.Counter) -> str | None:
  if not _names_something(policy) or program.regions == 0:
    return None
  # Nothing first: where save-everything keeps no more than region inputs
  # (jax 0.10's remat3 everything_saveable recomputes un-named values), a policy
  # that names tensors and keeps none of them is still a no-op.
  nothing, everything = resolve.BOUNDARY_ONLY, resolve.SAVE_EVERYTHING
  if kept == _residual_signature(program.residuals(nothing)):
    return nothing.name
  if kept == _residual_signature(program.residuals(everything)) and _leaves_out(
      policy, program.ambient_names):
    return everything.name
  return None


def _leaves_out(policy: Policy, present: frozenset[str]) -> bool:
  """Whether the policy means to leave out something the regions contain.

  Keeping what save-everything keeps is the policy's job when it selects
  every checkpoint name present (jax 0.10's remat3 everything_saveable keeps
  only named values); it is a no-op when the policy excludes something.
  """
  if policy.is_jax_policy:
    saveable = getattr(policy.jax_policy, "saveable_names", None)
    return saveable is None or not present <= frozenset(saveable)
  if policy.matmuls != "none":
    return True
  return any(not policy.matches(name) for name in present)


def _effect_warnings(program: TracedProgram) -> list[Finding]:
  out = []
  for site in _regions.effects_in_remat_regions(program.jaxpr.jaxpr):
    where = site.source or site.module_path or "the traced function"
    text = (f"{site.primitive} at {where} is inside a remat region: it runs "
            "in the forward pass and again each time the backward pass "
            "recomputes the region")
    if site.primitive == "io_callback":
      text += ("; move the io_callback out of the region (with jax_remat3 off "
               "JAX refuses to differentiate a region with an IO effect)")
    elif site.primitive == "pure_callback":
      text += "; harmless only if the callback really is pure"
    else:
      text += "; move it out of the region or expect it to repeat"
    out.append(Finding(text + ".", "effects"))
  return out


def _retrace_warning(fn: Callable[..., Any], args: Sequence[Any],
                     program: TracedProgram) -> Finding | None:
  leaves, treedef = jax.tree_util.tree_flatten(args)
  del leaves

  def flat_fn(*xs):
    return fn(*jax.tree_util.tree_unflatten(treedef, xs))

  # Regions cache their traces; the second trace must run the Python again.
  with lowering.substitute_ambient(program.marker), \
      trace_cache.fresh_traces():
    second, _ = _jaxpr.trace_program(flat_fn, program.leaves)
  difference = _jaxpr.trace_difference(program.jaxpr, second)
  if difference is None:
    return None
  return Finding(
      f"fn traced differently the second time ({difference}): it reads "
      "Python-side state (a counter, random.random(), a global) while "
      "tracing, so every retrace under jit bakes in other values; pass that "
      "state as an argument instead.", "traced-differently")


def _remat3_warning(policy: Policy) -> Finding | None:
  if (policy.is_jax_policy and compat.remat3_enabled()
      and not compat.remat3_honours(policy.jax_policy)):
    return Finding(
        f"jax_remat3 is on and jax {jax.__version__}'s remat3 does not honour "
        f"the JAX policy {policy.name!r} (only JAX's own policy classes, "
        "everything_saveable and nothing_saveable): every region recomputes "
        "everything; use a named remat_toolkit policy.", "ignored-by-remat3",
        policy.name)
  return None


# ================================================================ verify

def _check_options(rtol: Any, atol: Any, seed: Any) -> None:
  for label, value in (("rtol", rtol), ("atol", atol)):
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise TypeError(
          f"{label} must be a number or None (chosen by dtype), got "
          f"{value!r}; e.g. {label}=1e-5.")
    if not value >= 0:  # also rejects NaN
      raise ValueError(
          f"{label} must be >= 0, got {value!r}; e.g. {label}=1e-5.")
  if isinstance(seed, bool) or not isinstance(seed, int):
    raise TypeError(f"seed must be an int, got {seed!r}; e.g. seed=0.")


def verify(fn: Callable[..., Any], *args: Any, policy: PolicyLike = None,
           strict: bool = False, rtol: float | None = None,
           atol: float | None = None, check_values: bool = True,
           seed: int = 0) -> Verification:
  """Checks ``fn``'s gradients, residuals and effects under ``policy``.

  Args:
    fn: returns a scalar loss; its remat regions built with ``policy=None``
      take ``policy``.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees. Abstract leaves get
      :func:`random_inputs` (seeded with ``seed``) for the gradient check.
    policy: a policy name, :class:`Policy`, a raw ``jax.checkpoint_policies``
      policy, or None for the ambient policy.
    strict: raise instead of returning when a problem is found.
    rtol: relative tolerance of the gradient check (default by dtype, see
      :data:`TOLERANCES`).
    atol: absolute tolerance (default by dtype).
    check_values: False skips computing gradients (``ok`` is then None).
    seed: seed of the random inputs built for abstract arguments.

  Returns:
    A :class:`Verification`. Its warnings about regions that do not take the
    policy, and a policy that keeps none of its names, are also raised once
    as a ``UserWarning`` (unless ``strict`` raises).

  Raises:
    ValueError: unknown policy name, non-scalar loss, no float argument, an
      offloading policy under ``jax_remat3``, or (``strict=True``) any
      problem found, all listed.
    TypeError: a policy of the wrong type, a non-array argument,
      tolerances that are not numbers, or ``strict`` or ``check_values``
      not True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, x: block(w, x).sum()
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> v = rt.verify(loss, w, x, policy="save-ffn")
    >>> v.passed, v.ok, v.inputs, v.activation_bytes
    (True, True, 'random (seed=0)', 128)
  """
  _check_options(rtol, atol, seed)
  check_flag("strict", strict)
  check_flag("check_values", check_values)
  resolved = resolve.require_runnable(resolve.resolve_policy(policy))
  program = TracedProgram(fn, args)
  # Per-device shares are no part of a check (they may compile).
  measured = program.measure(resolved, device_shares=False)
  residuals = measured.residuals
  kept = _residual_signature(residuals)

  # Shared with every other entry point: regions that do not take the
  # policy, and a policy that keeps none of its names.
  said = policy_findings(program, resolved, measured)
  regions = program_findings(program).about_regions(
      resolved.name, asked=policy is not None)
  unheard = [*regions, *said.selection, *said.per_region]
  warnings: list[Finding] = list(unheard)
  for extra in (_remat3_warning(resolved), _retrace_warning(fn, args, program)):
    if extra:
      warnings.append(extra)
  warnings.extend(_effect_warnings(program))
  # What the report finds about kernels and attention, said here too.
  warnings.extend(said.kernels)

  default = default_tolerances(_jaxpr.float_dtypes_in(program.jaxpr.jaxpr))
  rtol = default[0] if rtol is None else float(rtol)
  atol = default[1] if atol is None else float(atol)
  reference, left = _regions.strip_remat(program.jaxpr.jaxpr)
  reference_text = "the same program with every remat region inlined"
  if left:
    reference_text += (f" ({left} region(s) that captured constants kept "
                       "with everything_saveable)")

  diff, inputs = None, "not checked"
  if check_values:
    # When the result says the policy keeps none of its names, tracing
    # fn's regions again must not raise that a second time.
    with findings.quiet(said.keeps_none):
      diff, inputs = _check_gradients(fn, args, program, resolved, reference,
                                      rtol, atol, seed, warnings)
  result = Verification(
      policy=resolved.name,
      ok=None if diff is None else diff.ok,
      max_abs_diff=None if diff is None else diff.max_abs,
      max_rel_diff=None if diff is None else diff.max_rel,
      worst_leaf="" if diff is None else diff.worst,
      rtol=rtol, atol=atol, inputs=inputs, reference=reference_text,
      no_op=_no_op(program, resolved, kept), warnings=tuple(warnings),
      regions=program.regions,
      activation_bytes=kept_bytes(residuals),
      offloaded_bytes=kept_bytes(residuals, "host"))
  if strict and result.problems:
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(result.problems, 1))
    raise ValueError(
        f"verify found {len(result.problems)} problem(s) with policy "
        f"{result.policy!r}: {listed}. Call verify(..., strict=False) to "
        "inspect the Verification.")
  warn_once(unheard)
  return result


def _check_gradients(fn: Callable[..., Any], args: Sequence[Any],
                     program: TracedProgram,
                     policy: Policy, reference: Any, rtol: float,
                     atol: float, seed: int, warnings: list[Finding]
                     ) -> tuple[_Diff | None, str]:
  """Gradients of ``fn`` as users run it under ``policy`` vs the reference.

  The remat side calls ``fn`` itself (its regions traced as in training,
  the transform's own code paths included); the reference is the analyzer's
  trace of ``fn`` with every region inlined.
  """
  leaves, inputs = _concrete_leaves(args, seed)
  treedef = jax.tree_util.tree_structure(args)
  diff_idx = tuple(i for i, x in enumerate(leaves)
                   if jnp.issubdtype(x.dtype, jnp.inexact))

  def remat_loss(*xs):
    with _ambient(policy):
      return fn(*jax.tree_util.tree_unflatten(treedef, xs))

  def reference_loss(*xs):
    return compat.eval_jaxpr(reference, program.jaxpr.consts, *xs)[0]

  try:
    loss, grads = _compiled_value_and_grad(remat_loss, leaves, diff_idx)
  except NotImplementedError as e:
    if "ffects" not in str(e):
      raise
    warnings.append(Finding(
        f"gradients could not be computed with remat: JAX refused an effect "
        f"inside a remat region ({e}).", "not-checked"))
    return None, "not checked"
  ref_loss, ref_grads = _compiled_value_and_grad(reference_loss, leaves,
                                                 diff_idx)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(args)[0]]
  labels = ["loss"] + [paths[i] or f"argument {i}" for i in diff_idx]
  return compare_values([loss, *grads], [ref_loss, *ref_grads], labels, rtol,
                  atol), inputs


def _ambient(policy: Policy):
  """Makes ``policy`` the one every ambient region takes while tracing."""
  return resolve.use_policy(policy)
