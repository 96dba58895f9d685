"""What the planner measures: a choice of names as a policy, and its outcome.

A :class:`~remat_toolkit._src.planning.search.Choice` (keep, offload or recompute
per checkpoint name, or a whole alternative such as ``save-matmuls``) becomes
the :class:`Policy` that does what it says (:func:`choice_policy`), and the
:class:`Evaluator` measures it with the analyzer on one traced program,
cached, as an :class:`~remat_toolkit._src.planning.search.Outcome`. Uniform plans
(:mod:`~remat_toolkit._src.planning.planner`) and per-region plans
(:mod:`~remat_toolkit._src.planning.per_region`) share one evaluator per model.

Example:
  >>> from remat_toolkit._src.planning.choices import choice_policy, choice_label
  >>> from remat_toolkit._src.planning.search import Choice
  >>> choice = Choice(save=frozenset({"attn.q", "ffn.*"}))
  >>> choice_policy(choice, "p").save, choice_label(choice)
  (('attn.q', 'ffn.[*]'), 'save attn.q, ffn.*')
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from remat_toolkit._src.analysis.report import ProgramFindings
from remat_toolkit._src.analysis.report import build_report
from remat_toolkit._src.analysis.report import program_findings
from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.core.globs import escape_glob
from remat_toolkit._src.planning.per_device import device_figures
from remat_toolkit._src.planning.search import Choice
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.planning.search import OutOfEvaluations
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.planning import ESTIMATED_PEAK
from remat_toolkit._src.results.planning import PEAK

__all__ = ["MODES", "OFFLOAD_MODES", "OFFLOADING", "Evaluator", "choice_policy",
           "choice_label", "describe", "describe_choice", "describe_bound",
           "decisions", "model_id"]

# Whole alternatives: policies JAX cannot combine with checkpoint names.
MODES: dict[str, dict[str, Any]] = {
    "save-everything": {"save_everything": True},
    "save-matmuls": {"matmuls": "all"},
    "save-matmuls-no-batch": {"matmuls": "no-batch"},
    "offload-matmuls-no-batch": {"matmuls": "offload-no-batch"},
}
OFFLOAD_MODES = frozenset({"offload-matmuls-no-batch"})

def choice_policy(choice: Choice, name: str, description: str = "") -> Policy:
  """The :class:`Policy` that does what ``choice`` says."""
  if choice.mode:
    return Policy(name=name, description=description, **MODES[choice.mode])
  return Policy(name=name, description=description,
                save=tuple(escape_glob(n) for n in sorted(choice.save)),
                offload=tuple(escape_glob(n) for n in sorted(choice.offload)))


# What allow_offload=True would run: asked of the same decision as every
# offloading policy, so the planner refuses exactly when they cannot run.
OFFLOADING = choice_policy(Choice(mode="offload-matmuls-no-batch"),
                             "allow_offload")


def model_id(fn: Callable[..., Any], program: TracedProgram) -> str:
  """A short digest of what was planned for: the function and its inputs.

  Plan names carry it, so plans for two models never share a name when
  both are loaded into one catalogue.
  """
  name = getattr(fn, "__qualname__", None) or type(fn).__name__
  inputs = [f"{x.dtype}{list(x.shape)}" for x in program._leaves]
  text = json.dumps([name, inputs, sorted(program.names), program.regions])
  return hashlib.sha1(text.encode()).hexdigest()[:6]


class Evaluator:
  """Real measurements of choices on one traced program, cached.

  Every report it makes shares the program's findings (``found``, found
  here when not given): a candidate diagnoses only its own policy.
  """

  def __init__(self, program: TracedProgram, transfer_flops_per_byte: float,
               per_device: bool = False, found: ProgramFindings | None = None):
    self.program = program
    self.findings = program_findings(program) if found is None else found
    self.transfer = transfer_flops_per_byte
    self.per_device = per_device
    self.evaluations = 0
    self.limit: int | None = None
    self._cache: dict[Choice, Outcome] = {}
    self._policies: dict[Policy, Outcome] = {}

  def __call__(self, choice: Choice) -> Outcome:
    found = self._cache.get(choice)
    if found is not None:
      return found
    if self.limit is not None and self.evaluations >= self.limit:
      raise OutOfEvaluations
    self.evaluations += 1
    report = build_report(self.program, choice_policy(choice, "plan-candidate"),
                          found=self.findings)
    self._cache[choice] = outcome = self._outcome(choice, report)
    return outcome

  def policy(self, policy: Policy) -> Outcome:
    """Any policy measured as given (a per-region one too), cached; it is
    not a candidate of the uniform search."""
    found = self._policies.get(policy)
    if found is None:
      self.evaluations += 1
      found = self._policies[policy] = self._outcome(
          None, build_report(self.program, policy, found=self.findings))
    return found

  def _outcome(self, choice: Choice | None, report: ResidualReport) -> Outcome:
    device, by_name = device_figures(report, self.per_device)
    return Outcome(
        choice=choice, device_bytes=device,
        host_bytes=report.offloaded_bytes,
        recompute_flops=report.recompute_flops,
        cost=report.recompute_flops + 2 * report.offloaded_bytes * self.transfer,
        device_by_name=by_name, report=report)

  def outcomes(self) -> list[Outcome]:
    return list(self._cache.values())


def decisions(choice: Choice, names: Sequence[str]) -> dict[str, str]:
  if choice.mode:
    return {}
  return {n: "save" if n in choice.save else
          "offload" if n in choice.offload else "recompute" for n in names}


def describe_choice(choice: Choice) -> str:
  if choice.mode:
    return f"the whole-region alternative {choice.mode}"
  return (choice_label(choice) or "keep only the region inputs") + (
      "; recompute the rest")


def describe_bound(bounds: str, per_device: bool = False,
                   compiled: bool = False) -> str:
  """What a plan's budget bounded, for its policy's description."""
  if bounds == PEAK:
    bound = "a predicted step peak" + (
        " (and XLA's figure)" if compiled else "")
  elif bounds == ESTIMATED_PEAK:
    bound = "an estimated peak"
  else:
    bound = "kept activations"
  return bound + (" per device" if per_device else "")


def describe(choice: Choice, budget: int, o: Outcome, bounds: str,
             per_device: bool = False, compiled: bool = False) -> str:
  if choice.mode:
    what = f"the whole-model alternative {choice.mode}"
  elif choice.save or choice.offload:
    what = "keeps " + (", ".join(sorted(choice.save)) or "no tagged tensor")
    if choice.offload:
      what += "; offloads " + ", ".join(sorted(choice.offload))
  else:
    what = "keeps only region inputs"
  bound = describe_bound(bounds, per_device, compiled)
  return (f"Planned by remat_toolkit.plan for {bound} of at most "
          f"{format_bytes(budget)}: {what}; recomputes the rest "
          f"({o.report.recompute_percent:.1f}% of a no-remat step).")


def choice_label(choice: Choice) -> str:
  parts = []
  if choice.save:
    parts.append("save " + ", ".join(sorted(choice.save)))
  if choice.offload:
    parts.append("offload " + ", ".join(sorted(choice.offload)))
  return "; ".join(parts)
