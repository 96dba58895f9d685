"""The residual analyzer: what a policy keeps for the backward pass, and its cost.

The model is traced once (:mod:`remat_toolkit._src.analysis.trace`). Every remat
region that reads the ambient policy is then given each policy in turn inside
the traced program, so comparing many policies re-traces no Python code.
Where the pieces live: the results as data in :mod:`~remat_toolkit._src.results.analysis`,
their text and HTML in :mod:`~remat_toolkit._src.display`, the warnings they
carry in :mod:`~remat_toolkit._src.analysis.diagnose`, composed with the
measurements by :mod:`~remat_toolkit._src.analysis.report` (once per program,
once per policy), and each residual's bytes in
:mod:`~remat_toolkit._src.analysis.residuals`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def block(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
  >>> loss = lambda w, x: block(w, x).sum()
  >>> args = (jax.ShapeDtypeStruct((8, 8), jnp.float32),
  ...         jax.ShapeDtypeStruct((4, 8), jnp.float32))
  >>> rt.analyze(loss, *args, policy="save-ffn").activation_bytes
  128
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from remat_toolkit._src.analysis import report as _report
from remat_toolkit._src.analysis.peak import StepBuilder
from remat_toolkit._src.analysis.peak import program_peak
from remat_toolkit._src.analysis.peak import require_float_leaf
from remat_toolkit._src.analysis.trace import PolicyRefused
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_once
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.results.analysis import Comparison
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.peak import Peak

__all__ = ["analyze", "compare"]

def analyze(fn: Callable[..., Any], *args: Any, policy: PolicyLike = None,
            compile: bool = False) -> ResidualReport:
  """Which residuals ``fn``'s backward pass keeps under ``policy``.

  Args:
    fn: returns a scalar loss, e.g. ``loss(params, batch)``; its remat regions
      built with ``policy=None`` take the analysed policy.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).
    policy: a name, a :class:`Policy`, a raw ``jax.checkpoint_policies``
      policy, or None for the ambient policy.
    compile: also lower ``jit(grad(fn))`` and add XLA's memory analysis.

  Returns:
    A :class:`ResidualReport`; its ``warnings`` say when the figures are not
    the policy's own (each is also raised once as a ``UserWarning``).

  Raises:
    ValueError: unknown policy name, an offloading policy this JAX cannot
      run now (under ``jax_remat3``), non-scalar loss, no float argument.
    TypeError: a policy of the wrong type, a non-array argument, or
      ``compile`` not True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, x: block(w, x).sum()
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> report = rt.analyze(loss, w, x, policy="save-ffn")
    >>> report.activation_bytes, [r.name for r in report.activations]
    (128, ['ffn.up'])
    >>> rt.analyze(loss, w, x, policy=jax.checkpoint_policies.dots_saveable
    ...            ).activation_bytes
    128
  """
  check_flag("compile", compile)
  resolved = resolve.require_runnable(resolve.resolve_policy(policy))
  report = _report.build_report(TracedProgram(fn, args), resolved,
                                compile=compile)
  warn_once(report.warnings)
  return report


def compare(fn: Callable[..., Any], *args: Any,
            policies: Sequence[PolicyLike] | None = None,
            compile: bool = False, peak: bool = False) -> Comparison:
  """Analyses ``fn`` under several policies, tracing the model once.

  Args:
    fn: returns a scalar loss; see :func:`analyze`.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees.
    policies: a list of what :func:`analyze` takes as ``policy`` (names,
      Policies, raw JAX policies); default: every policy in the catalogue.
    compile: add XLA's memory analysis per policy (slow: one compile each;
      with ``peak``, one more for XLA's figure of the step's peak).
    peak: also predict the peak device bytes of one ``jax.grad`` step per
      policy, as :func:`remat_toolkit.peak` does, on the same traced program
      (in the Comparison's ``peaks``, its rows' ``peak_bytes`` and its
      table's "peak" column); with ``compile`` too, XLA's own figure beside
      it (``xla_peak_bytes``, "XLA peak").

  Returns:
    A :class:`Comparison`; its ``warnings`` (each raised once as a
    ``UserWarning``) name the policies whose figures are not their own, and
    with ``peak`` the peaks' findings (XLA's own remat, a prediction off
    XLA's figure...).
    Policies this JAX cannot run now (offloading under ``jax_remat3``; with
    it off, one that keeps a value JAX will not round, such as a complex
    one) are in its ``skipped``, each with the reason, also raised once.

  Raises:
    ValueError: an unknown policy name, non-scalar loss, no float argument
      (with ``peak``: no floating-point leaf in the first argument).
    TypeError: ``policies`` is one policy rather than a list, or holds
      something that is not a policy; ``peak`` without arguments;
      ``compile`` or ``peak`` not True or False.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, x: block(w, x).sum()
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> c = rt.compare(loss, w, x, policies=["boundary-only", "save-ffn"])
    >>> {name: r.activation_bytes for name, r in c.reports.items()}
    {'boundary-only': 0, 'save-ffn': 128}
    >>> [row["policy"] for row in c.rows() if row["pareto"]]
    ['boundary-only', 'save-ffn']
    >>> c = rt.compare(loss, w, x, policies=["boundary-only"], peak=True)
    >>> c.peaks["boundary-only"].bytes == rt.peak(
    ...     loss, w, x, policy="boundary-only").bytes
    True
  """
  check_flag("compile", compile)
  check_flag("peak", peak)
  if peak and not args:
    raise TypeError("compare(fn, *args, peak=True) needs fn's arguments: the "
                    "parameters first, e.g. rt.compare(loss, params, batch, "
                    "peak=True).")
  if peak:
    require_float_leaf(args[0])
  chosen = resolve.resolve_policies(policies)
  runnable, skipped = resolve.split_runnable(chosen)
  program = TracedProgram(fn, args)
  # Diagnosed once for the program and once per policy; every report and
  # the comparison's own warnings are composed from these.
  found = _report.program_findings(program)
  measured = {}
  for p in list(runnable):
    try:
      measured[p.name] = program.measure(p, compile=compile)
    except PolicyRefused as refused:  # JAX's limit under this policy alone
      runnable.remove(p)
      skipped[p.name] = Finding(str(refused), "unrunnable", p.name)
  said = {p.name: _report.policy_findings(program, p, measured[p.name])
          for p in runnable}
  reports = {p.name: _report.compose_report(program, p, measured[p.name],
                                            found, said[p.name])
             for p in runnable}
  peaks = (_peaks(program, len(jax.tree_util.tree_leaves(args[0])), runnable,
                  reports, compile=compile) if peak else None)
  # The comparison words the regions' finding for no one policy.
  warnings = [*found.about_regions(),
              *(w for s in said.values() for w in s.selection),
              *(w for s in said.values() for w in s.kernels)]
  # A compiled peak's finding about the machine (XLA:CPU's scheduler) is
  # the same sentence under every policy: listed once.
  warnings += dict.fromkeys(w for p in (peaks or {}).values()
                            for w in p.warnings)
  comparison = Comparison(
      reports=reports, skipped=skipped, regions=program.regions,
      warnings=tuple(warnings),
      baseline=_baseline(program, runnable, reports, found), peaks=peaks)
  warn_once([*skipped.values(), *comparison.warnings])
  return comparison


def _peaks(program: TracedProgram, num_params: int,
           compared: Sequence[Policy], reports: dict[str, ResidualReport], *,
           compile: bool) -> dict[str, Peak]:
  """Each policy's :class:`Peak` on the traced program: one step builder
  for all, and the kept bytes its report has already counted."""
  builder = StepBuilder(program, num_params)
  return {p.name: program_peak(builder, p, compile=compile,
                               kept_bytes=reports[p.name].activation_bytes)
          for p in compared}


def _baseline(program: TracedProgram, compared: Sequence[Policy],
              reports: dict[str, ResidualReport],
              found: _report.ProgramFindings) -> ResidualReport | None:
  """The built-in save-everything's report, when that policy is compared.

  Measured with :data:`resolve.SAVE_EVERYTHING`, not the catalogue's entry,
  so a user's ``save-everything.toml`` cannot move the percentages.
  """
  baseline = resolve.SAVE_EVERYTHING
  same_name = [p for p in compared if p.key == baseline.key]
  if not same_name:
    return None
  if program.lowered(same_name[0]) == program.lowered(baseline):
    return reports[same_name[0].name]
  return _report.build_report(program, baseline, found=found)
