"""Per-region plans: a policy for each remat region, the least recompute that fits.

A uniform plan (:mod:`~remat_toolkit._src.planning.planner`) gives every region the
same policy, so between two uniform choices the memory/recompute curve jumps.
The residuals a region keeps, and what it recomputes, depend on its own
policy alone, so choosing per region is a multiple-choice knapsack: every
region takes one candidate, the kept bytes must fit the budget, the
recompute is least. It is solved exactly (:mod:`~remat_toolkit._src.planning.knapsack`)
on measured numbers, in three steps:

1. **Measure the candidates of each kind of region.** Regions of one kind
   (the same computation on the same input types, as often per step:
   structurally identical layers) are measured together, once per
   candidate: the candidate on every region of the kind, ``boundary-only``
   on the others; the difference from ``boundary-only`` everywhere, divided
   by the number of regions, is what one region of the kind adds. A kind
   whose difference does not divide evenly is split and its regions are
   measured one by one. The candidates of a kind are: keeping only the
   region's inputs, the whole alternatives (``save-everything``,
   ``save-matmuls``, ``save-matmuls-no-batch``, with offloading
   ``offload-matmuls-no-batch``), every catalogue policy, every checkpoint
   name of the kind kept alone and all of them kept together, and the best
   choices of names an additive model of those predicts at several budgets.
   A kind with at most :data:`EXHAUSTIVE_NAMES` names (with offloading:
   :data:`EXHAUSTIVE_NAMES_OFFLOAD`) has every keep/recompute (/offload)
   choice of its names as candidates instead.
2. **Solve exactly.** The per-region numbers are combined by the exact
   multiple-choice knapsack; its Pareto front is every best mix at once.
3. **Measure the plan.** The chosen per-region policy is analysed on the
   whole program. Its figures are the plan's. When they differ from the sum
   of the per-region numbers (regions interacting), the plan says so
   (``optimal=False``) and the next-best mixes are measured until one fits.

Regions inside one ``scan`` share a body, so they are one region here: a
scanned stack gets one policy. To mix policies along a stack, plan the
unrolled model and build the scan with ``rt.scan_layers(..., policy=plan)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Protocol
from typing import cast

from remat_toolkit._src.analysis.trace import TracedProgram
from remat_toolkit._src.planning.choices import Evaluator
from remat_toolkit._src.planning.knapsack import Mix
from remat_toolkit._src.planning.knapsack import Option
from remat_toolkit._src.planning.knapsack import pareto_mixes
from remat_toolkit._src.planning.search import AdditiveModel
from remat_toolkit._src.planning.search import Choice
from remat_toolkit._src.planning.search import Limits
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.planning import FIELD_PREFIXES

__all__ = ["RegionPlanner", "Candidate", "Measurer", "EXHAUSTIVE_NAMES",
           "EXHAUSTIVE_NAMES_OFFLOAD", "MIXES_MEASURED"]

#: A kind with at most this many checkpoint names gets every keep/recompute
#: choice of them as candidates (2**names).
EXHAUSTIVE_NAMES = 6
#: The same with offloading (3**names keep/offload/recompute choices).
EXHAUSTIVE_NAMES_OFFLOAD = 4
#: Mixes measured, cheapest predicted first, before a plan that does not add
#: up is given as the best of them.
MIXES_MEASURED = 4
# Budgets across a kind's range at which the additive model's best choice
# of names becomes a candidate.
_MODEL_BUDGETS = 6


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One measured choice for the regions of one kind.

  Attributes:
    choice: what the regions keep, offload or recompute.
    policy: the policy a region takes for it.
    option: what one region adds: device bytes beyond its inputs, host
      bytes, and its own cost (recompute plus transfer equivalents).
    recompute_flops: the FLOPs one region recomputes.
  """

  choice: Choice
  policy: Policy
  option: Option
  recompute_flops: int


@dataclasses.dataclass
class _Kind:
  keys: tuple[str, ...]
  names: tuple[str, ...]
  candidates: list[Candidate] = dataclasses.field(default_factory=list)
  boundary: Candidate | None = None  # keeping only the inputs, never pruned


class Measurer(Protocol):
  """What per-region planning takes from the uniform planner: its trace,
  how it measures a choice or a policy, and how it names them
  (:class:`~remat_toolkit._src.planning.planner.Planner` is one)."""

  program: TracedProgram
  boundary: Outcome
  allow_offload: bool
  evaluate: Evaluator

  def as_choice(self, policy: Policy) -> Choice:
    """The choice a catalogue policy makes."""

  def choice_policy(self, choice: Choice) -> Policy:
    """The policy that makes ``choice``."""


class RegionPlanner:
  """Per-region plans on the program a planner traced.

  The candidates are measured once; every further budget only solves and
  measures its plan.

  Args:
    planner: the uniform planner of the model (its trace, evaluator,
      rates and catalogue measurements are shared).
  """

  def __init__(self, planner: Measurer):
    self.planner = planner
    self.program = planner.program
    self._base = planner.boundary
    self._measured: dict[tuple, Outcome] = {}
    self._labels = self._catalogue_choices()
    self.kinds: list[_Kind] = []
    for keys in self.program.region_kinds():
      self.kinds.extend(self._measure_kind(keys))
    self._groups = [(kind, key) for kind in self.kinds for key in kind.keys]
    self._mixes: list[Mix] | None = None

  # ------------------------------------------------------------ candidates
  def _catalogue_choices(self) -> dict[Choice, Policy]:
    """Choice -> the catalogue policy it comes from (first by name)."""
    labels: dict[Choice, Policy] = {Choice(): resolve.BOUNDARY_ONLY}
    # Of equal choices our own preset names are shown, the field's (MaxText,
    # Praxis) only where no preset of ours keeps the same.
    for name in sorted(catalog.list_policies(),
                       key=lambda n: (n.startswith(FIELD_PREFIXES), n)):
      policy = catalog.get_policy(name)
      if (policy.is_jax_policy or policy.is_per_region
          or (policy.offloads and not self.planner.allow_offload)
          or resolve.unrunnable_reason(policy) is not None):
        continue
      labels.setdefault(self.planner.as_choice(policy), policy)
    return labels

  def _kind_outcome(self, keys: tuple[str, ...], choice: Choice) -> Outcome:
    """``choice`` on every region of ``keys``, boundary-only elsewhere."""
    if len(keys) == len(self.program.region_keys):
      return self.planner.evaluate(choice)  # the uniform measurement
    cache_key = (keys, choice)
    if cache_key not in self._measured:
      policy = self.planner.choice_policy(choice)
      per_region = Policy(name="plan-candidate",
                          regions=tuple((k, policy) for k in keys))
      self._measured[cache_key] = self.planner.evaluate.policy(per_region)
    return self._measured[cache_key]

  def _measure_kind(self, keys: tuple[str, ...]) -> list[_Kind]:
    """The kind's candidates, or its regions one by one where they differ."""
    names = tuple(sorted(self.program.region_names(keys[0])))
    kind = _Kind(keys=keys, names=names)
    least = self._kind_outcome(keys, Choice(mode="save-matmuls"))
    for choice in self._choices(kind):
      candidate = self._candidate(kind, choice, least)
      if candidate is None:  # its regions do not change alike: one by one
        if len(keys) == 1:
          raise RuntimeError(  # one region always divides by one
              f"region {keys[0]!r} could not be measured; please report this.")
        return [k for key in keys for k in self._measure_kind((key,))]
      kind.candidates.append(candidate)
    kind.boundary = kind.candidates[0]  # _choices starts with Choice()
    kind.candidates = _front(kind.candidates)
    return [kind]

  def _choices(self, kind: _Kind) -> list[Choice]:
    allow = self.planner.allow_offload
    modes = ["save-everything", "save-matmuls", "save-matmuls-no-batch"]
    if allow:
      modes.append("offload-matmuls-no-batch")
    choices = [Choice()] + [Choice(mode=m) for m in modes]
    present = frozenset(kind.names)
    choices += [Choice(save=c.save & present, offload=c.offload & present)
                for c in self._labels if not c.mode]
    limit = EXHAUSTIVE_NAMES_OFFLOAD if allow else EXHAUSTIVE_NAMES
    if len(kind.names) <= limit:
      choices += _every_choice(kind.names, allow)
    else:
      singles = [Choice(save=frozenset({n})) for n in kind.names]
      choices += singles + [Choice(save=present)]
      choices += self._predicted(kind, singles)
    return list(dict.fromkeys(choices))

  def _predicted(self, kind: _Kind, singles: list[Choice]) -> list[Choice]:
    """The additive model's best choices at budgets across the kind."""
    base = self._kind_outcome(kind.keys, Choice())
    model = AdditiveModel(
        base, {next(iter(c.save)): self._kind_outcome(kind.keys, c)
               for c in singles},
        self.planner.evaluate.transfer, self.planner.allow_offload)
    top = self._kind_outcome(kind.keys, Choice(save=frozenset(kind.names)))
    out = []
    for i in range(1, _MODEL_BUDGETS + 1):
      device = base.device_bytes + (top.device_bytes - base.device_bytes) * i \
          // (_MODEL_BUDGETS + 1)
      ranked = model.ranked(Limits(device=device, host=math.inf), 1)
      out += [choice for _, choice in ranked]
    return out

  def _candidate(self, kind: _Kind, choice: Choice, least: Outcome
                 ) -> Candidate | None:
    """What one region of the kind adds under ``choice`` (None: the
    regions do not add the same)."""
    o = self._kind_outcome(kind.keys, choice)
    n = len(kind.keys)
    device = o.device_bytes - self._base.device_bytes
    host = o.host_bytes - self._base.host_bytes
    flops = o.recompute_flops - least.recompute_flops
    if device % n or host % n or flops % n:
      return None
    transfer = 2 * (host // n) * self.planner.evaluate.transfer
    return Candidate(
        choice=choice, policy=self._policy(choice),
        option=Option(device // n, host // n, flops // n + transfer),
        recompute_flops=flops // n)

  def _policy(self, choice: Choice) -> Policy:
    return self._labels.get(choice) or self.planner.choice_policy(choice)

  # ------------------------------------------------------------ solving
  @property
  def mixes(self) -> list[Mix]:
    """Every undominated mix over the regions (the exact per-region front)."""
    if self._mixes is None:
      self._mixes = pareto_mixes(
          [[c.option for c in kind.candidates] for kind, _ in self._groups])
    return self._mixes

  def predicted(self, mix: Mix) -> tuple[int, int, int, float]:
    """(device bytes, host bytes, recompute FLOPs, cost) of the whole
    program under ``mix``, from the per-region numbers."""
    base = self._base
    picked = self._picked(mix)
    # Set on every kind when it was measured (_measure_kind).
    boundary = [cast(Candidate, kind.boundary) for kind, _ in self._groups]
    flops = base.recompute_flops + sum(
        c.recompute_flops - b.recompute_flops
        for c, b in zip(picked, boundary, strict=True))
    cost = base.cost + mix.cost - sum(b.option.cost for b in boundary)
    return (base.device_bytes + mix.device, base.host_bytes + mix.host, flops,
            cost)

  def _picked(self, mix: Mix) -> list[Candidate]:
    return [kind.candidates[i] for (kind, _), i in
            zip(self._groups, mix.picks, strict=True)]

  def assignment(self, mix: Mix) -> list[tuple[str, Candidate]]:
    """``(region key, candidate)`` of every region, in program order.

    Regions of one kind are interchangeable, so the kind's picks are dealt
    out in candidate order: equal policies sit next to each other, and a
    scanned stack built from the plan runs as few scans as it can.
    """
    picked: dict[str, Candidate] = {}
    start = 0
    for kind in self.kinds:
      picks = sorted(mix.picks[start:start + len(kind.keys)])
      start += len(kind.keys)
      for key, i in zip(kind.keys, picks, strict=True):
        picked[key] = kind.candidates[i]
    return [(key, picked[key]) for key in self.program.region_keys]

  def best(self, device: float, host: float = math.inf) -> list[Mix]:
    """Mixes predicted to fit, cheapest first (at most
    :data:`MIXES_MEASURED`)."""
    base = self._base
    fitting = [m for m in self.mixes
               if base.device_bytes + m.device <= device
               and base.host_bytes + m.host <= host]
    fitting.sort(key=lambda m: (m.cost, m.device, m.host))
    return fitting[:MIXES_MEASURED]


def _every_choice(names: Sequence[str], allow_offload: bool) -> list[Choice]:
  options = ("save", "recompute", "offload") if allow_offload else (
      "save", "recompute")
  out = []
  for combo in itertools.product(options, repeat=len(names)):
    pick = [frozenset(n for n, c in zip(names, combo, strict=True) if c == what)
            for what in ("save", "offload")]
    out.append(Choice(save=pick[0], offload=pick[1]))
  return out


def _front(candidates: list[Candidate]) -> list[Candidate]:
  """Candidates no other beats on device bytes, host bytes and cost; of
  equal ones the first (boundary-only, then catalogue order) stays."""
  out: list[Candidate] = []
  seen: set[tuple] = set()
  for c in candidates:
    key = (c.option.device, c.option.host, c.option.cost)
    if key in seen:
      continue
    if any(o.option.device <= c.option.device and o.option.host <= c.option.host
           and o.option.cost <= c.option.cost for o in out):
      continue
    out = [o for o in out if not (
        c.option.device <= o.option.device and c.option.host <= o.option.host
        and c.option.cost <= o.option.cost)]
    out.append(c)
    seen.add(key)
  # boundary-only first: the knapsack prefers the lowest index on ties.
  out.sort(key=lambda c: (c.choice != Choice(), c.option.device,
                          c.option.cost))
  return out
