"""The report builder: a traced program's measurements composed into results.

A :class:`~remat_toolkit._src.analysis.trace.TracedProgram` only measures
(residuals, FLOPs, kernels run again, per-device shares, XLA's figures).
What a result says about those figures, and why they may mislead
(:mod:`~remat_toolkit._src.analysis.diagnose`), is found here, in the two
steps the findings depend on: once per program (:func:`program_findings`:
its regions, how its per-device figures are measured) and once per policy
(:func:`policy_findings`: names the regions lack, matmuls the policy passes
over, kernels it makes run again). :func:`build_report` composes them with a
policy's :class:`~remat_toolkit._src.analysis.trace.Measurement` into a
:class:`ResidualReport`.

Entry points reading many policies of one program (``compare``, the
planner) find the program's findings once and hand them to every report, so
nothing is diagnosed twice and no repeated finding needs dropping.

Example:
  >>> import jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.analysis import report
  >>> from remat_toolkit._src.analysis.trace import TracedProgram
  >>> program = TracedProgram(lambda x: jnp.sin(x).sum(), (jnp.ones(4),))
  >>> found = report.program_findings(program)
  >>> [f.kind for f in found.about_regions()]
  ['no-region']
  >>> r = report.build_report(program, rt.get_policy("save-ffn"), found=found)
  >>> [f.kind for f in r.warnings], r.warnings[0].policy
  (['no-region'], 'save-ffn')
"""

from __future__ import annotations

import dataclasses

from remat_toolkit._src.analysis import diagnose
from remat_toolkit._src.analysis.trace import Measurement
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.analysis import ResidualReport

__all__ = ["ProgramFindings", "PolicyFindings", "program_findings",
           "policy_findings", "compose_report", "build_report"]


@dataclasses.dataclass(frozen=True)
class ProgramFindings:
  """What is found once per traced program, whatever the policy.

  The facts the region findings read (a
  :class:`~remat_toolkit._src.analysis.diagnose.Regions`), read off the
  program once, and how its figures are measured; each result words them
  for its own policy (:meth:`about_regions`).

  Attributes:
    regions: remat regions that read the ambient policy.
    own_policy_regions: ``(where, policy)`` of each remat region with a
      policy of its own.
    shadowed_regions: regions reading the ambient policy that sit inside a
      region with a policy of its own.
    notes: how the per-device figures are measured, when the arguments are
      sharded.
  """

  regions: int
  own_policy_regions: tuple[tuple[str, str], ...]
  shadowed_regions: int
  notes: tuple[Finding, ...] = ()

  def about_regions(self, policy: str | None = None, *, asked: bool = True
                    ) -> list[Finding]:
    """Why ``policy`` may not shape the figures: no region takes it, or only
    some do.

    Args:
      policy: the policy's name; None for a result on many policies.
      asked: False when the caller did not choose the policy (the function
        is examined as it is): regions with their own policy are then
        expected, and only a function with no region at all is said.

    Example:
      >>> from remat_toolkit._src.analysis.report import ProgramFindings
      >>> found = ProgramFindings(regions=0, own_policy_regions=(),
      ...                         shadowed_regions=0)
      >>> found.about_regions("save-ffn")[0][:48]
      "fn has no remat region at all, so policy 'save-f"
      >>> ProgramFindings(1, (("mlp", "'save-ffn'"),), 0).about_regions(
      ...     asked=False)
      []
    """
    if not asked and (self.regions or self.own_policy_regions):
      return []
    return diagnose.region_warnings(self, policy)


def program_findings(program: TracedProgram) -> ProgramFindings:
  """The findings of ``program`` that no policy changes, found once."""
  own = tuple(program.own_policy_regions)
  # Only a region of the model's own can shadow one: no walk without them.
  shadowed = program.shadowed_regions if own and program.regions else 0
  note = program.layout.note
  return ProgramFindings(
      regions=program.regions, own_policy_regions=own,
      shadowed_regions=shadowed,
      notes=(Finding(note, "note"),) if note else ())


@dataclasses.dataclass(frozen=True)
class PolicyFindings:
  """What is found once per policy on a traced program.

  Attributes:
    selection: why the policy keeps less than it promises here: names the
      regions lack, matmuls of a kind its rule passes over.
    per_region: what a per-region policy leaves out in this model, and the
      regions it names that the model lacks.
    kernels: kernels whose forward runs again, remat modes that keep a
      kernel's residuals differently, S x S matmul outputs a matmul policy
      keeps (empty when found without a measurement).
  """

  selection: tuple[Finding, ...] = ()
  per_region: tuple[Finding, ...] = ()
  kernels: tuple[Finding, ...] = ()

  @property
  def keeps_none(self) -> bool:
    """Whether the policy keeps none of its names here (said also by each
    region when it is traced, unless silenced)."""
    return any(f.kind == "keeps-none" for f in self.selection)


def policy_findings(program: TracedProgram, policy: Policy,
                    measured: Measurement | None = None) -> PolicyFindings:
  """The findings of ``policy`` on ``program``, found once.

  Args:
    program: the traced function.
    policy: the policy every ambient region takes.
    measured: ``program.measure(policy)``; without it, nothing is said about
      kernels and attention (which need the training step traced).

  Example:
    >>> import jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> from remat_toolkit._src.analysis.report import policy_findings
    >>> from remat_toolkit._src.analysis.trace import TracedProgram
    >>> f = rt.remat(lambda x: jnp.sin(rt.tag(jnp.sin(x), "ffn.up")).sum())
    >>> program = TracedProgram(f, (jnp.ones(4),))
    >>> said = policy_findings(program, rt.get_policy("save-qkv"))
    >>> said.keeps_none, [f.kind for f in said.selection]
    (True, ['keeps-none'])
  """
  kernels = () if measured is None else tuple(diagnose.kernel_warnings(
      program, policy, measured.residuals, measured.activation_matmuls,
      measured.recomputed_kernels))
  return PolicyFindings(
      selection=tuple(diagnose.selection_warnings(program, policy)),
      per_region=tuple(diagnose.per_region_warnings(program, policy)),
      kernels=kernels)


def compose_report(program: TracedProgram, policy: Policy,
                   measured: Measurement, found: ProgramFindings,
                   said: PolicyFindings) -> ResidualReport:
  """The :class:`ResidualReport` of ``policy``, from what was measured and
  found: ``program.measure(policy)``, ``program_findings(program)`` and
  ``policy_findings(program, policy, measured)``."""
  base = program.baseline_step_flops
  return ResidualReport(
      policy=policy.name, residuals=measured.residuals,
      forward_flops=program.forward_flops,
      backward_flops=measured.backward_flops,
      recompute_flops=program.recompute_flops(policy), baseline_step_flops=base,
      remat_regions=program.regions, xla=measured.xla,
      devices=program.layout.devices,
      per_device_activation_bytes=measured.per_device_activation_bytes,
      warnings=(*found.about_regions(policy.name), *said.selection,
                *said.per_region, *said.kernels, *found.notes),
      per_device_method=program.layout.method,
      recomputed_kernels=measured.recomputed_kernels)


def build_report(program: TracedProgram, policy: Policy, *,
                 compile: bool = False,
                 found: ProgramFindings | None = None) -> ResidualReport:
  """The :class:`ResidualReport` of ``policy`` on ``program``.

  Args:
    program: the traced function.
    policy: the policy every ambient region takes.
    compile: also add XLA's memory analysis (one compile).
    found: ``program_findings(program)``, when the caller reads several
      policies of the program (found anew otherwise).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> from remat_toolkit._src.analysis.report import build_report
    >>> from remat_toolkit._src.analysis.trace import TracedProgram
    >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum())
    >>> program = TracedProgram(f, (jax.ShapeDtypeStruct((4,), jnp.float32),))
    >>> r = build_report(program, rt.get_policy("boundary-only"))
    >>> r.activation_bytes, r.recompute_flops, r.warnings
    (0, 0, ())
  """
  measured = program.measure(policy, compile=compile)
  return compose_report(
      program, policy, measured,
      program_findings(program) if found is None else found,
      policy_findings(program, policy, measured))
