"""The budget planner: the policy with the least recompute that fits a budget.

:func:`plan` decides, for every checkpoint name in the model (each name
selects all its instances across layers), whether to keep it on device,
offload it to host memory or recompute it, so that the activation bytes kept
for the backward pass fit ``budget`` with the least recompute. The matmul
policies (``save-matmuls``, ``save-matmuls-no-batch``) and ``save-everything``
are weighed as whole alternatives, since JAX cannot combine them with names.

Every number in a :class:`Plan` is measured by the residual analyzer on a
program traced once; none is predicted. Recompute is the analyzer's matmul
FLOPs, so recomputing elementwise work counts as free and, among choices of
equal FLOPs, the one keeping fewer bytes wins. The search has three stages:

1. Measure the named policies, the whole alternatives and each name kept on
   its own.
2. Add the per-name effects up into a model, solve it exactly (a dynamic
   programme over predicted bytes and FLOPs), and measure its best
   predictions, cheapest first, until the model predicts nothing better than
   what was measured. Names interact (keeping two tensors can spare a
   recompute that neither spares alone), so a prediction can be wrong; the
   measurement decides.
3. Repair or prove the result by a best-first branch and bound over real
   evaluations. It relies on two facts of JAX's partial evaluation: keeping
   more names never recomputes more, and a residual kept when *every*
   undecided name is kept (a name already kept, or a region input) is kept
   whatever the undecided names become. So measuring "keep every undecided
   name" gives, at once, the least recompute below a node (and its optimum,
   if it fits) and a lower bound on its bytes.

Stages 2 and 3 share ``max_evaluations``; :attr:`Plan.optimal` says whether
stage 3 finished, which proves that no choice of names and no whole
alternative recomputes less within the budget.

Offloading is costed in FLOP-equivalents: an offloaded residual crosses the
host link twice (out in the forward pass, back in the backward pass), and
``2 * bytes / host_bandwidth`` seconds is converted at ``device_flops``
FLOP/s. Transfers that overlap with compute cost less in practice, so this
errs towards recomputing.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def block(w, x):
  ...   h = rt.tag(x @ w, "ffn.up")  # 2 KiB, a matmul to redo
  ...   return rt.tag(jnp.tanh(h), "ffn.act") @ w.T  # 2 KiB, cheap to redo
  >>> loss = lambda w, x: block(w, x).sum()
  >>> args = (jax.ShapeDtypeStruct((16, 64), jnp.float32),
  ...         jax.ShapeDtypeStruct((8, 16), jnp.float32))
  >>> p = rt.plan(loss, *args, budget="2KiB")
  >>> p.policy.save, p.activation_bytes, p.recompute_flops
  (('ffn.up',), 2048, 0)
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import html
import itertools
import json
import math
import os
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat_toolkit._src import analysis
from remat_toolkit._src import catalog
from remat_toolkit._src import compat as compat
from remat_toolkit._src.analysis import ResidualReport
from remat_toolkit._src.analysis import TracedProgram
from remat_toolkit._src.format import format_bytes
from remat_toolkit._src.format import format_flops
from remat_toolkit._src.format import html_table
from remat_toolkit._src.format import parse_bytes
from remat_toolkit._src.format import text_table
from remat_toolkit._src.format import warnings_html
from remat_toolkit._src.policy import Policy

__all__ = ["plan", "Plan", "Planner", "frontier", "Frontier", "FrontierPoint",
           "NamedFit", "GroupEstimate", "DEFAULT_HOST_BANDWIDTH",
           "DEFAULT_DEVICE_FLOPS", "DEFAULT_GROUP_SIZES"]

#: Bytes per second each way between device and pinned host memory
#: (PCIe 4.0 x16 in practice).
DEFAULT_HOST_BANDWIDTH: float = 25e9
#: FLOP/s a recompute runs at, to convert transfer time to FLOP-equivalents
#: (about 40% of an H100's dense bf16 peak).
DEFAULT_DEVICE_FLOPS: float = 400e12
#: Group sizes weighed when ``groups`` is a callable (``"sqrt"``: about
#: sqrt(layers), as the built-in models read it).
DEFAULT_GROUP_SIZES: tuple[int | str, ...] = (1, 2, 4, "sqrt")
#: Analyzer evaluations the repair and proof stages may take per plan; past
#: them the best plan measured is returned, marked not proven optimal.
DEFAULT_MAX_EVALUATIONS = 48
# Most model predictions measured before the branch and bound starts.
_MODEL_CANDIDATES = 8

_NO_NAMES = (
    "no remat region that reads the ambient policy holds a checkpoint name, "
    "so the plan could only choose between boundary-only and the whole-model "
    "alternatives (save-everything, save-matmuls, save-matmuls-no-batch); tag "
    "the tensors worth keeping with remat_toolkit.tag(x, name) to let it keep "
    "some and recompute the rest.")

# Whole alternatives: policies JAX cannot combine with checkpoint names.
_MODES: dict[str, dict[str, Any]] = {
    "save-everything": {"save_everything": True},
    "save-matmuls": {"matmuls": "all"},
    "save-matmuls-no-batch": {"matmuls": "no-batch"},
    "offload-matmuls-no-batch": {"matmuls": "offload-no-batch"},
}
_OFFLOAD_MODES = frozenset({"offload-matmuls-no-batch"})
_GLOB_ESCAPES = {"*": "[*]", "?": "[?]", "[": "[[]"}


# ==================================================================== choices

@dataclasses.dataclass(frozen=True)
class _Choice:
  """What a candidate policy does: names kept/offloaded, or a whole mode."""

  save: frozenset[str] = frozenset()
  offload: frozenset[str] = frozenset()
  mode: str = ""

  def policy(self, name: str, description: str = "") -> Policy:
    if self.mode:
      return Policy(name=name, description=description, **_MODES[self.mode])
    return Policy(name=name, description=description,
                  save=tuple(_literal(n) for n in sorted(self.save)),
                  offload=tuple(_literal(n) for n in sorted(self.offload)))

  def digest(self) -> str:
    text = json.dumps([self.mode, sorted(self.save), sorted(self.offload)])
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def _model_id(fn: Callable[..., Any], program: TracedProgram) -> str:
  """A short digest of what was planned for: the function and its inputs.

  Plan names carry it, so plans for two models never share a name when
  both are loaded into one catalogue.
  """
  name = getattr(fn, "__qualname__", None) or type(fn).__name__
  inputs = [f"{x.dtype}{list(x.shape)}" for x in program._leaves]
  text = json.dumps([name, inputs, sorted(program.names), program.regions])
  return hashlib.sha1(text.encode()).hexdigest()[:6]


def _literal(name: str) -> str:
  # A checkpoint name is matched as a glob pattern if it has * ? or [;
  # escape them so the plan selects exactly that name.
  return "".join(_GLOB_ESCAPES.get(c, c) for c in name)


@dataclasses.dataclass(frozen=True)
class _Outcome:
  """A choice as the analyzer measured it."""

  choice: _Choice
  report: ResidualReport
  device_bytes: int
  host_bytes: int
  recompute_flops: int
  cost: float
  device_by_name: Mapping[str, int]

  def key(self) -> tuple[float, int, int]:
    return (self.cost, self.device_bytes, self.host_bytes)


class _Evaluator:
  """Real measurements of choices on one traced program, cached."""

  def __init__(self, program: TracedProgram, transfer_flops_per_byte: float):
    self.program = program
    self.transfer = transfer_flops_per_byte
    self.evaluations = 0
    self.limit: int | None = None
    self._cache: dict[_Choice, _Outcome] = {}

  def __call__(self, choice: _Choice) -> _Outcome:
    found = self._cache.get(choice)
    if found is not None:
      return found
    if self.limit is not None and self.evaluations >= self.limit:
      raise _OutOfEvaluations
    self.evaluations += 1
    report = self.program.report(choice.policy("plan-candidate"))
    by_name: dict[str, int] = {}
    for r in report.activations:
      if r.memory_kind == "device" and r.name is not None:
        by_name[r.name] = by_name.get(r.name, 0) + r.nbytes
    outcome = _Outcome(
        choice=choice, report=report, device_bytes=report.activation_bytes,
        host_bytes=report.offloaded_bytes,
        recompute_flops=report.recompute_flops,
        cost=report.recompute_flops + 2 * report.offloaded_bytes * self.transfer,
        device_by_name=by_name)
    self._cache[choice] = outcome
    return outcome

  def outcomes(self) -> Iterable[_Outcome]:
    return self._cache.values()


class _OutOfEvaluations(Exception):
  pass


# ==================================================================== search

@dataclasses.dataclass
class _Limits:
  device: float
  host: float

  def fit(self, o: _Outcome) -> bool:
    return o.device_bytes <= self.device and o.host_bytes <= self.host


class _Search:
  """Best-first branch and bound over keep / offload / recompute per name.

  A node fixes some names as kept, offloaded or recomputed and leaves the
  rest undecided; its *top* is the choice that keeps every undecided name.
  The top's recompute is the least of any completion, and its residuals that
  are not undecided names are held by every completion: so the top gives a
  lower bound (cost, bytes) and, when it fits, the node's optimum. Nodes are
  expanded least bound first; a child's top is evaluated only when the child
  is reached, so the search evaluates few choices beyond those whose bound
  beats the optimum.
  """

  def __init__(self, evaluate: _Evaluator, names: Sequence[str],
               limits: _Limits, allow_offload: bool):
    self.evaluate = evaluate
    self.names = tuple(sorted(names))
    self.limits = limits
    self.allow_offload = allow_offload
    self.best: _Outcome | None = None
    self.complete = True
    self._heap: list[tuple] = []
    self._count = itertools.count()

  def offer(self, o: _Outcome) -> None:
    if self.limits.fit(o) and (self.best is None or o.key() < self.best.key()):
      self.best = o

  def run(self) -> None:
    """Searches until proven; raises _OutOfEvaluations at the limit."""
    self.complete = False
    self._push((-math.inf, 0), frozenset(), frozenset(), self.names)
    while self._heap:
      bound, _, saved, offloaded, undecided = heapq.heappop(self._heap)
      if self._dominated(bound):
        break  # every other node's bound is at least as large
      self._expand(bound, saved, offloaded, undecided)
    self.complete = True

  def _push(self, bound, saved, offloaded, undecided) -> None:
    heapq.heappush(self._heap, (bound, next(self._count), saved, offloaded,
                                undecided))

  def _dominated(self, bound: tuple[float, float]) -> bool:
    # Only recompute is proven; ties in bytes are settled by _drop_useless.
    return self.best is not None and bound[0] >= self.best.cost

  def _expand(self, bound, saved, offloaded, undecided) -> None:
    top = self.evaluate(_Choice(saved | frozenset(undecided), offloaded))
    free = sum(top.device_by_name.get(n, 0) for n in undecided)
    forced = top.device_bytes - free
    if forced > self.limits.device or top.host_bytes > self.limits.host:
      return
    exact = (top.cost, forced)
    if self._dominated(exact):
      return
    if exact > bound:  # the evaluated bound is tighter: wait for its turn
      self._push(exact, saved, offloaded, undecided)
      return
    if self.limits.fit(top):
      self.offer(top)
      return
    # Branch on the undecided name holding the most bytes: it decides fit.
    name = max(undecided, key=lambda n: (top.device_by_name.get(n, 0), n))
    rest = tuple(n for n in undecided if n != name)
    kept = top.device_by_name.get(name, 0)
    self._push((top.cost, forced + kept), saved | {name}, offloaded, rest)
    if self.allow_offload:
      self._push(exact, saved, offloaded | {name}, rest)
    self._push(exact, saved, offloaded, rest)


def _drop_useless(evaluate: _Evaluator, best: _Outcome, limits: _Limits
                  ) -> _Outcome:
  """Drops kept names whose removal costs no recompute and no bytes."""
  for name in sorted(best.choice.save,
                     key=lambda n: -best.device_by_name.get(n, 0)):
    trial = evaluate(dataclasses.replace(best.choice,
                                         save=best.choice.save - {name}))
    if (limits.fit(trial) and trial.cost <= best.cost
        and trial.device_bytes <= best.device_bytes):
      best = trial
  return best


class _AdditiveModel:
  """Predicted bytes and recompute per name, from one measurement each.

  Each name is measured alone against ``boundary-only``; the model adds
  those effects up. It is exact when names do not interact and only guides
  the search otherwise: every prediction it makes is measured before use.
  """

  def __init__(self, base: _Outcome, singles: Mapping[str, _Outcome],
               transfer_flops_per_byte: float, allow_offload: bool):
    self.base = base
    self.transfer = transfer_flops_per_byte
    self.allow_offload = allow_offload
    # (name, added device bytes, recompute saved) of names that do anything.
    self.items = [(n, o.device_bytes - base.device_bytes, base.cost - o.cost)
                  for n, o in sorted(singles.items())
                  if (o.device_bytes, o.cost) != (base.device_bytes, base.cost)]

  def ranked(self, limits: _Limits, count: int
             ) -> list[tuple[float, _Choice]]:
    """Up to ``count`` (predicted cost, choice) predicted to fit, cheapest first.

    An exact dynamic programme over the predicted (device, host, cost)
    states, dropping states another state beats on all three.
    """
    states = [(self.base.device_bytes, 0, self.base.cost, frozenset(),
               frozenset())]
    shrink = [0] * (len(self.items) + 1)  # most bytes the rest could free
    for i in range(len(self.items) - 1, -1, -1):
      shrink[i] = shrink[i + 1] + max(-self.items[i][1], 0)
    for i, (name, nbytes, saved) in enumerate(self.items):
      grown = []
      for dev, host, cost, keep, off in states:
        grown.append((dev, host, cost, keep, off))
        grown.append((dev + nbytes, host, cost - saved, keep | {name}, off))
        if self.allow_offload and nbytes > 0:
          grown.append((dev, host + nbytes,
                        cost - saved + 2 * nbytes * self.transfer, keep,
                        off | {name}))
      states = _undominated(
          [s for s in grown if s[0] - shrink[i + 1] <= limits.device
           and s[1] <= limits.host])
    fitting = sorted((s for s in states if s[0] <= limits.device),
                     key=lambda s: (s[2], s[0], s[1]))
    return [(s[2], _Choice(save=s[3], offload=s[4])) for s in fitting[:count]]


def _undominated(states: list[tuple]) -> list[tuple]:
  states.sort(key=lambda s: (s[0], s[1], s[2]))
  kept: list[tuple] = []
  for s in states:
    if not any(k[0] <= s[0] and k[1] <= s[1] and k[2] <= s[2] for k in kept):
      kept.append(s)
  return kept


# ==================================================================== results

@dataclasses.dataclass(frozen=True)
class NamedFit:
  """A catalogue policy measured against the budget.

  Attributes:
    name: the policy's name.
    activation_bytes: device bytes it keeps.
    offloaded_bytes: host bytes it moves.
    recompute_flops: FLOPs it recomputes.
    recompute_percent: the same, in percent of a no-remat step.
    cost: recompute FLOPs plus transfer FLOP-equivalents.
    fits: whether it fits the budget.
  """

  name: str
  activation_bytes: int
  offloaded_bytes: int
  recompute_flops: int
  recompute_percent: float
  cost: float
  fits: bool


@dataclasses.dataclass(frozen=True)
class GroupEstimate:
  """One group size (blocks per remat region) weighed by the planner.

  Attributes:
    group: the group size as given (None: ``fn`` as passed to :func:`plan`).
    regions: remat region executions per step (scan iterations included).
    boundary_bytes: activations under ``boundary-only``: region boundaries.
    everything_bytes: the most activations any measured policy keeps (every
      region's internals).
    workspace_bytes: one region's internals, materialised while it is
      recomputed in the backward pass under this layout's plan.
    activation_bytes: activations the plan keeps.
    estimated_peak: ``activation_bytes + workspace_bytes``.
    recompute_flops: the plan's recompute FLOPs.
    policy: the plan's policy name ("" if nothing fits).
    fits: whether the estimated peak fits the budget.
    note: why the layout was skipped or does not fit.
  """

  group: Any
  regions: int
  boundary_bytes: int
  everything_bytes: int
  workspace_bytes: int
  activation_bytes: int
  estimated_peak: int
  recompute_flops: int
  policy: str
  fits: bool
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
  """The policy with the least recompute that fits a budget, and its numbers.

  Attributes:
    policy: the planned :class:`Policy` (usable with ``rt.use_policy``; by
      name after :meth:`register` or :meth:`save` + ``rt.load_policies``).
    budget: the budget in bytes.
    bounds: what the budget bounds: ``"kept activations"``, or
      ``"estimated peak"`` when planned with ``groups`` (or ``peak=True``).
    activation_bytes: device bytes the policy keeps (measured).
    offloaded_bytes: bytes it moves to host memory (measured).
    recompute_flops: matmul FLOPs it recomputes (measured).
    recompute_percent: the same, in percent of a no-remat step.
    cost: ``recompute_flops`` plus transfer FLOP-equivalents (see the module
      docstring).
    decisions: checkpoint name -> ``"save"``, ``"offload"`` or
      ``"recompute"`` (empty when a whole alternative won).
    named: every catalogue policy measured on the same program.
    report: the analyzer's :class:`ResidualReport` of the plan.
    optimal: whether the branch and bound finished, which proves that no
      choice of names and no whole alternative recomputes less within the
      budget; False when it stopped at ``max_evaluations`` (the plan is then
      the best measured).
    evaluations: analyzer evaluations made on the model so far (named
      policies and per-name measurements included).
    smallest_bytes: the least activation memory any evaluated policy kept.
    workspace_bytes: one region's internals while it is recomputed.
    estimated_peak: ``activation_bytes + workspace_bytes``.
    group: the chosen group size when ``groups`` was given.
    groups: the estimate for each group size weighed.
    host_budget: host bytes allowed for offloading (None: offloading off or
      unlimited).
    host_bandwidth: bytes/s used to cost transfers.
    device_flops: FLOP/s used to convert transfer time to FLOPs.
    warnings: what limited the search without failing it: regions with
      their own policy (they keep what they keep, whatever the plan), or no
      checkpoint name to decide on.
  """

  policy: Policy
  budget: int
  activation_bytes: int
  offloaded_bytes: int
  recompute_flops: int
  recompute_percent: float
  cost: float
  decisions: Mapping[str, str]
  named: tuple[NamedFit, ...]
  report: ResidualReport
  optimal: bool
  evaluations: int
  smallest_bytes: int
  workspace_bytes: int
  estimated_peak: int
  bounds: str = "kept activations"
  group: Any = None
  groups: tuple[GroupEstimate, ...] = ()
  host_budget: int | None = None
  host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
  device_flops: float = DEFAULT_DEVICE_FLOPS
  warnings: tuple[str, ...] = ()

  @property
  def closest_builtins(self) -> tuple[NamedFit, ...]:
    """The catalogue policies that fit, least recompute first (at most 3)."""
    fitting = sorted((f for f in self.named if f.fits),
                     key=lambda f: (f.cost, f.activation_bytes, f.name))
    return tuple(fitting[:3])

  @property
  def best_builtin(self) -> NamedFit | None:
    """The fitting catalogue policy with the least recompute, if any."""
    closest = self.closest_builtins
    return closest[0] if closest else None

  # ------------------------------------------------------------ use it
  def register(self, *, override: bool = False) -> Policy:
    """Adds the policy to the catalogue, so it is usable by name.

    Plans are not registered on their own, to keep the catalogue to what
    the user chose.
    """
    return catalog.register_policy(self.policy, override=override)

  def save(self, path: str | os.PathLike) -> Path:
    """Writes the policy as a TOML file that ``rt.load_policies`` reads.

    Returns:
      The path written.
    """
    path = Path(path)
    if path.is_dir():
      raise ValueError(
          f"plan.save needs a file path, got the folder {str(path)!r}; write "
          f"e.g. {str(path / (self.policy.name + '.toml'))!r}.")
    path.write_text(self.toml(), encoding="utf-8")
    return path

  def toml(self) -> str:
    """The policy file's text, with the plan's numbers as comments."""
    head = [
        "# Written by remat_toolkit.plan.",
        f"# budget {format_bytes(self.budget)} ({self.bounds}): keeps "
        f"{format_bytes(self.activation_bytes)} on device, recomputes "
        f"{format_flops(self.recompute_flops)} "
        f"({self.recompute_percent:.1f}% of a no-remat step)"
        + (f"; group size {self.group}" if self.group is not None else ""),
    ]
    return "\n".join(head + [_policy_toml(self.policy), ""])

  # ------------------------------------------------------------ display
  def summary_lines(self) -> list[str]:
    lines = [
        f"{self.policy.name}: budget {format_bytes(self.budget)} "
        f"({self.bounds})"
        + (f", group size {self.group}" if self.group is not None else ""),
        f"  keeps {format_bytes(self.activation_bytes)} on device"
        + (f", offloads {format_bytes(self.offloaded_bytes)} to host"
           if self.offloaded_bytes else "")
        + f"; recomputes {format_flops(self.recompute_flops)} "
        f"({self.recompute_percent:.1f}% of a no-remat step)",
        f"  estimated peak {format_bytes(self.estimated_peak)} (kept "
        f"activations + {format_bytes(self.workspace_bytes)} while one region "
        "is recomputed)",
        ("  proven optimal: the branch and bound finished" if self.optimal
         else "  best measured, not proven optimal: the search stopped at "
         "max_evaluations")
        + f" ({self.evaluations} analyzer evaluations)",
    ]
    if self.decisions:
      for what in ("save", "offload", "recompute"):
        names = [n for n, d in self.decisions.items() if d == what]
        if names:
          lines.append(f"  {what:<9} {', '.join(names)}")
    else:
      lines.append(f"  policy: {self.policy.keeps_summary()}")
    lines.extend(f"  warning: {w}" for w in self.warnings)
    return lines

  def _named_rows(self) -> tuple[list[str], list[list[str]]]:
    rows = sorted(self.named, key=lambda f: (not f.fits, f.cost,
                                             f.activation_bytes))
    body = [[f.name, format_bytes(f.activation_bytes),
             format_bytes(f.offloaded_bytes) if f.offloaded_bytes else "-",
             f"{f.recompute_percent:.1f}%", "yes" if f.fits else "no"]
            for f in rows]
    return ["named policy", "activations", "offloaded", "recompute", "fits"], body

  def _group_rows(self) -> tuple[list[str], list[list[str]]]:
    body = []
    for g in self.groups:
      label = "as given" if g.group is None else str(g.group)
      if not g.regions:  # skipped: the layout could not be built
        body.append([label, *["-"] * 6, "no", g.note])
        continue
      body.append([label, str(g.regions), format_bytes(g.boundary_bytes),
                   format_bytes(g.workspace_bytes),
                   format_bytes(g.activation_bytes),
                   format_bytes(g.estimated_peak),
                   format_flops(g.recompute_flops), "yes" if g.fits else "no",
                   g.note])
    return ["group", "regions", "boundaries", "workspace", "kept", "est. peak",
            "recompute", "fits", "note"], body

  def __str__(self) -> str:
    out = list(self.summary_lines())
    if self.groups:
      headers, body = self._group_rows()
      out += ["", "group sizes (estimated peak = kept activations + one "
              "region's workspace):",
              text_table(headers, body, right=[h not in ("group", "fits", "note")
                                                for h in headers])]
    headers, body = self._named_rows()
    out += ["", text_table(headers, body,
                           right=[False, True, True, True, False])]
    best = self.best_builtin
    if best is not None:
      out.append(f"\nbest named policy that fits: {best.name} "
                 f"({best.recompute_percent:.1f}% recompute)")
    out.append(f"use: `with rt.use_policy(plan.policy):`, or plan.register() / "
               f"plan.save('{self.policy.name}.toml')")
    return "\n".join(out)

  def _repr_html_(self) -> str:
    summary = "<br>".join(html.escape(line.strip(), quote=False)
                          for line in self.summary_lines())
    headers, body = self._named_rows()
    named = html_table(headers, body, caption="Named policies on the same model",
                       highlight=[row[4] == "yes" for row in body])
    groups = ""
    if self.groups:
      headers, gbody = self._group_rows()
      groups = html_table(headers, gbody, caption="Group sizes",
                          highlight=[g.group == self.group for g in self.groups])
    return (f"<div><p style='font-family:monospace'>{summary}</p>"
            f"{groups}{named}</div>")

  def to_dict(self) -> dict[str, Any]:
    """Plain data: the policy, the numbers, the named policies, the groups."""
    return {
        "policy": _policy_record(self.policy),
        "budget": self.budget,
        "bounds": self.bounds,
        "activation_bytes": self.activation_bytes,
        "offloaded_bytes": self.offloaded_bytes,
        "recompute_flops": self.recompute_flops,
        "recompute_percent": self.recompute_percent,
        "cost": self.cost,
        "decisions": dict(self.decisions),
        "optimal": self.optimal,
        "evaluations": self.evaluations,
        "smallest_bytes": self.smallest_bytes,
        "workspace_bytes": self.workspace_bytes,
        "estimated_peak": self.estimated_peak,
        "group": self.group,
        "groups": [dataclasses.asdict(g) for g in self.groups],
        "closest_builtins": [f.name for f in self.closest_builtins],
        "named": [dataclasses.asdict(f) for f in self.named],
        "host_budget": self.host_budget,
        "host_bandwidth": self.host_bandwidth,
        "device_flops": self.device_flops,
        "warnings": list(self.warnings),
    }

  def to_json(self, **kwargs: Any) -> str:
    """:meth:`to_dict` as JSON."""
    return json.dumps(self.to_dict(), default=str, **kwargs)


def _policy_record(policy: Policy) -> dict[str, Any]:
  return {"name": policy.name, "description": policy.description,
          "save": list(policy.save), "offload": list(policy.offload),
          "matmuls": policy.matmuls, "save_everything": policy.save_everything,
          "offload_src": policy.offload_src, "offload_dst": policy.offload_dst}


def _toml_string(text: str) -> str:
  # JSON string escapes (\" \\ \n \uXXXX) are valid TOML basic strings.
  return json.dumps(text)


def _toml_list(items: Sequence[str]) -> str:
  return "[\n" + "".join(f"  {_toml_string(i)},\n" for i in items) + "]"


def _policy_toml(policy: Policy) -> str:
  lines = [f"name = {_toml_string(policy.name)}",
           f"description = {_toml_string(policy.description)}"]
  if policy.aliases:
    lines.append(f"aliases = {_toml_list(policy.aliases)}")
  if policy.save:
    lines.append(f"save = {_toml_list(policy.save)}")
  if policy.offload:
    lines.append(f"offload = {_toml_list(policy.offload)}")
  if policy.matmuls != "none":
    lines.append(f"matmuls = {_toml_string(policy.matmuls)}")
  if policy.save_everything:
    lines.append("save_everything = true")
  if policy.offload_src != "device":
    lines.append(f"offload_src = {_toml_string(policy.offload_src)}")
  if policy.offload_dst != "pinned_host":
    lines.append(f"offload_dst = {_toml_string(policy.offload_dst)}")
  return "\n".join(lines)


# ==================================================================== planner

class Planner:
  """Plans on one traced model, for as many budgets as asked.

  The trace, the named policies and the per-name measurements are shared
  between budgets, so each further budget costs only its own search.
  :func:`plan` and :func:`frontier` are built on it.

  Args:
    fn: returns a scalar loss; see :func:`plan`.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees.
    allow_offload: also consider host offloading (needs ``jax_remat3`` off).
    host_bandwidth: bytes/s each way between device and host.
    device_flops: FLOP/s, to convert transfer time into FLOP-equivalents.

  Raises:
    ValueError: ``fn`` has no remat region that reads the ambient policy,
      offloading under ``jax_remat3``, or a rate that is not positive.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> from remat_toolkit._src.planner import Planner
    >>> @rt.remat
    ... def block(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
    >>> planner = Planner(lambda w, x: block(w, x).sum(),
    ...                   jax.ShapeDtypeStruct((16, 64), jnp.float32),
    ...                   jax.ShapeDtypeStruct((8, 16), jnp.float32))
    >>> [planner.plan(b).recompute_flops for b in (0, "2KiB")]
    [16384, 0]
  """

  def __init__(self, fn: Callable[..., Any], *args: Any,
               allow_offload: bool = False,
               host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
               device_flops: float = DEFAULT_DEVICE_FLOPS):
    _check_rates(allow_offload, host_bandwidth, device_flops)
    program = TracedProgram(fn, args)
    if program.regions == 0:
      raise ValueError("There is nothing to plan: "
                       + analysis.region_warnings(program)[0])
    self.program = program
    self.warnings: tuple[str, ...] = tuple(
        analysis.region_warnings(program)
        + ([] if program.ambient_names else [_NO_NAMES]))
    self.allow_offload = allow_offload
    self.host_bandwidth = float(host_bandwidth)
    self.device_flops = float(device_flops)
    self._evaluate = _Evaluator(program, self.device_flops / self.host_bandwidth)
    self.names: tuple[str, ...] = tuple(sorted(program.names))
    self.model_id = _model_id(fn, program)
    self._named = self._catalogue()
    self._whole = {m: self._evaluate(_Choice(mode=m)) for m in _MODES
                   if allow_offload or m not in _OFFLOAD_MODES}
    self._boundary = self._evaluate(_Choice())
    self._every_name = self._evaluate(_Choice(save=frozenset(self.names)))
    # What recomputing a region can materialise again: the most any measured
    # policy keeps (under jax_remat3 save-everything still recomputes
    # unnamed values, so it is not always the largest).
    self._everything = max([self._every_name, *self._whole.values()],
                           key=lambda o: o.device_bytes)
    self.region_executions = _region_executions(program, self._everything)
    self._model: _AdditiveModel | None = None

  # ------------------------------------------------------------ facts
  @property
  def evaluations(self) -> int:
    """Analyzer evaluations made so far."""
    return self._evaluate.evaluations

  @property
  def boundary_only_bytes(self) -> int:
    """Activations under ``boundary-only``."""
    return self._boundary.device_bytes

  @property
  def save_everything_bytes(self) -> int:
    """Activations under ``save-everything``."""
    return self._whole["save-everything"].device_bytes

  @property
  def everything_bytes(self) -> int:
    """The most activations any measured policy keeps."""
    return self._everything.device_bytes

  def workspace_bytes(self, kept: int) -> int:
    """One region's internals, materialised again while it is recomputed,
    when ``kept`` activation bytes are kept (a chain of identical regions)."""
    return max(self.everything_bytes - kept, 0) // self.region_executions

  def peak_limit(self, budget: int) -> int:
    """The most kept bytes whose estimated peak fits ``budget`` (-1: none).

    The peak ``kept + workspace_bytes(kept)`` never falls as ``kept`` grows,
    so a bisection finds the limit.
    """
    lo, hi = -1, budget
    while lo < hi:
      mid = (lo + hi + 1) // 2
      if mid + self.workspace_bytes(mid) <= budget:
        lo = mid
      else:
        hi = mid - 1
    return lo

  # ------------------------------------------------------------ planning
  def plan(self, budget: int | str, *, host_budget: int | str | None = None,
           max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
           peak: bool = False) -> Plan:
    """The plan for one budget; see :func:`plan` for the arguments.

    Args:
      budget: device bytes for kept activations (int or ``"8GiB"``).
      host_budget: host bytes offloading may use (default: unlimited).
      max_evaluations: analyzer evaluations for this budget's search.
      peak: bound the estimated peak (kept activations plus one region's
        workspace) instead of the kept activations.
    """
    limit = parse_bytes(budget)
    host = _check_search(self.allow_offload, host_budget, max_evaluations)
    device = min(self.peak_limit(limit), limit) if peak else limit
    limits = _Limits(device=device, host=math.inf if host is None else host)
    best, complete = self._solve(limits, max_evaluations)
    if best is None:
      raise self._infeasible(limit, complete, peak)
    choice = best.choice
    policy = choice.policy(f"plan-{self.model_id}-{choice.digest()}",
                           _describe(choice, limit, best, peak))
    workspace = self.workspace_bytes(best.device_bytes)
    return Plan(
        policy=policy, budget=limit, activation_bytes=best.device_bytes,
        offloaded_bytes=best.host_bytes, recompute_flops=best.recompute_flops,
        recompute_percent=best.report.recompute_percent, cost=best.cost,
        decisions=_decisions(choice, self.names),
        named=self._named_fits(limits), report=best.report,
        optimal=complete, evaluations=self.evaluations,
        smallest_bytes=self._smallest().device_bytes,
        workspace_bytes=workspace, estimated_peak=best.device_bytes + workspace,
        bounds="estimated peak" if peak else "kept activations",
        host_budget=host, host_bandwidth=self.host_bandwidth,
        device_flops=self.device_flops, warnings=self.warnings)

  def measure(self, policy: str | Policy) -> ResidualReport:
    """The analyzer's report of a catalogue policy or :class:`Policy`
    (cached with every other evaluation of this planner)."""
    return self._evaluate(self._as_choice(catalog.get_policy(policy))).report

  # ------------------------------------------------------------ internals
  def _catalogue(self) -> dict[str, _Outcome]:
    out = {}
    for name in catalog.list_policies():
      policy = catalog.get_policy(name)
      if policy.offloads and not self.allow_offload:
        continue
      out[policy.name] = self._evaluate(self._as_choice(policy))
    return out

  def _as_choice(self, policy: Policy) -> _Choice:
    if policy.save_everything:
      return _Choice(mode="save-everything")
    modes = {"all": "save-matmuls", "no-batch": "save-matmuls-no-batch",
             "offload-no-batch": "offload-matmuls-no-batch"}
    if policy.matmuls in modes:
      return _Choice(mode=modes[policy.matmuls])
    saved, offloaded = policy.expand(self.names)
    present = frozenset(self.names)
    return _Choice(save=saved & present, offload=offloaded & present)

  def _additive_model(self) -> _AdditiveModel:
    if self._model is None:
      singles = {n: self._evaluate(_Choice(save=frozenset({n})))
                 for n in self.names}
      self._model = _AdditiveModel(self._boundary, singles,
                                   self._evaluate.transfer, self.allow_offload)
    return self._model

  def _solve(self, limits: _Limits, max_evaluations: int
             ) -> tuple[_Outcome | None, bool]:
    """The least-cost fitting outcome, and whether the search proved it.

    The additive model's predictions are measured cheapest first until the
    model predicts nothing better than what was measured (this repairs a
    prediction that interactions between names made wrong); the branch and
    bound then proves the result over real evaluations, or improves it, with
    at most ``max_evaluations`` analyzer evaluations for both stages.
    """
    search = _Search(self._evaluate, self.names, limits, self.allow_offload)
    # Whatever already fits (named policies, whole alternatives) competes.
    for o in list(self._evaluate.outcomes()):
      search.offer(o)
    if search.best is None or search.best.cost > self._least_cost():
      self._search(search, limits, max_evaluations)
    # else nothing recomputes less than what already fits: no search needed.
    best = search.best
    if best is not None and not best.choice.mode:
      best = _drop_useless(self._evaluate, best, limits)
    return best, search.complete

  def _search(self, search: _Search, limits: _Limits,
              max_evaluations: int) -> None:
    model = self._additive_model()
    self._evaluate.limit = self._evaluate.evaluations + max_evaluations
    try:
      for predicted, choice in model.ranked(limits, _MODEL_CANDIDATES):
        if search.best is not None and predicted >= search.best.cost:
          break
        search.offer(self._evaluate(choice))
      search.run()
    except _OutOfEvaluations:
      search.complete = False
    finally:
      self._evaluate.limit = None

  def _least_cost(self) -> float:
    # Keeping every name (or a whole alternative) recomputes the least.
    return min(o.cost for o in [self._every_name, *self._whole.values()])

  def _smallest(self) -> _Outcome:
    return min(self._evaluate.outcomes(),
               key=lambda o: (o.device_bytes, o.cost))

  def _named_fits(self, limits: _Limits) -> tuple[NamedFit, ...]:
    return tuple(NamedFit(name=n, activation_bytes=o.device_bytes,
                          offloaded_bytes=o.host_bytes,
                          recompute_flops=o.recompute_flops,
                          recompute_percent=o.report.recompute_percent,
                          cost=o.cost, fits=limits.fit(o))
                 for n, o in self._named.items())

  def _infeasible(self, budget: int, complete: bool, peak: bool) -> ValueError:
    small = self._smallest()
    label = small.choice.mode or _choice_label(small.choice) or "boundary-only"
    why = "" if complete else (
        " (the search stopped at its evaluation limit; raise max_evaluations)")
    what = "peak budget" if peak else "activation budget"
    return ValueError(
        f"No policy fits the {what} of {format_bytes(budget)} ({budget} "
        f"bytes){why}: the least activation memory measured is "
        f"{format_bytes(small.device_bytes)} ({small.device_bytes} bytes, "
        f"{label}). Raise the budget to at least that, use a smaller "
        "micro-batch, larger remat groups, or (jax_remat3 off) "
        "allow_offload=True.")


def _region_executions(program: TracedProgram, everything: _Outcome) -> int:
  # For a chain of identical blocks: regions in the jaxpr, times the scan
  # length their residuals are stacked over.
  stacked = max((r.stacked for r in everything.report.activations), default=1)
  return max(program.regions * stacked, 1)


def _decisions(choice: _Choice, names: Sequence[str]) -> dict[str, str]:
  if choice.mode:
    return {}
  return {n: "save" if n in choice.save else
          "offload" if n in choice.offload else "recompute" for n in names}


def _describe(choice: _Choice, budget: int, o: _Outcome, peak: bool) -> str:
  if choice.mode:
    what = f"the whole-model alternative {choice.mode}"
  elif choice.save or choice.offload:
    what = "keeps " + (", ".join(sorted(choice.save)) or "no tagged tensor")
    if choice.offload:
      what += "; offloads " + ", ".join(sorted(choice.offload))
  else:
    what = "keeps only region inputs"
  bound = "an estimated peak" if peak else "kept activations"
  return (f"Planned by remat_toolkit.plan for {bound} of at most "
          f"{format_bytes(budget)}: {what}; recomputes the rest "
          f"({o.report.recompute_percent:.1f}% of a no-remat step).")


def _choice_label(choice: _Choice) -> str:
  parts = []
  if choice.save:
    parts.append("save " + ", ".join(sorted(choice.save)))
  if choice.offload:
    parts.append("offload " + ", ".join(sorted(choice.offload)))
  return "; ".join(parts)


def _check_rates(allow_offload: Any, host_bandwidth: Any,
                 device_flops: Any) -> None:
  if not isinstance(allow_offload, bool):
    raise TypeError(f"allow_offload must be True or False, got {allow_offload!r}.")
  if allow_offload and compat.offloading_unsupported():
    raise ValueError(
        f"allow_offload=True cannot be planned: {compat.offloading_refusal()}; "
        "or plan without offloading.")
  for label, value in (("host_bandwidth", host_bandwidth),
                       ("device_flops", device_flops)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < math.inf):
      raise ValueError(f"{label} must be a positive number, got {value!r}.")


def _check_search(allow_offload: bool, host_budget: Any,
                  max_evaluations: Any) -> int | None:
  if host_budget is not None and not allow_offload:
    raise ValueError(
        f"host_budget={host_budget!r} only matters with allow_offload=True; "
        "pass allow_offload=True or drop host_budget.")
  if (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
      or max_evaluations < 0):
    raise ValueError(
        f"max_evaluations must be a non-negative integer, got "
        f"{max_evaluations!r}.")
  return None if host_budget is None else parse_bytes(host_budget)


GroupsLike = (Mapping[Any, tuple[Callable[..., Any], Sequence[Any]]]
              | Callable[[Any], tuple[Callable[..., Any], Sequence[Any]]])


def _layouts(groups: Any, sizes: Sequence[Any] | None
             ) -> list[tuple[Any, Callable[[], Any]]]:
  if isinstance(groups, Mapping):
    if sizes is not None:
      raise ValueError("group_sizes only applies when groups is a callable; "
                       "with a mapping its keys are the group sizes.")
    return [(g, (lambda v=v: v)) for g, v in groups.items()]
  if callable(groups):
    chosen = DEFAULT_GROUP_SIZES if sizes is None else tuple(sizes)
    if not chosen:
      raise ValueError("group_sizes is empty; give at least one group size.")
    return [(g, (lambda g=g: groups(g))) for g in chosen]
  raise TypeError(
      f"groups must be a mapping group size -> (fn, args) or a callable "
      f"group size -> (fn, args), got {groups!r}.")


def _unpack_layout(group: Any, value: Any) -> tuple[Callable[..., Any], tuple]:
  if (not isinstance(value, (tuple, list)) or len(value) != 2
      or not callable(value[0]) or not isinstance(value[1], (tuple, list))):
    raise TypeError(
        f"groups[{group!r}] must be a pair (fn, args) with args a tuple of "
        f"fn's arguments, got {value!r}.")
  return value[0], tuple(value[1])


def plan(fn: Callable[..., Any], *args: Any, budget: int | str,
         allow_offload: bool = False, host_budget: int | str | None = None,
         host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
         device_flops: float = DEFAULT_DEVICE_FLOPS,
         groups: GroupsLike | None = None,
         group_sizes: Sequence[Any] | None = None,
         max_evaluations: int = DEFAULT_MAX_EVALUATIONS) -> Plan:
  """The policy with the least recompute whose activations fit ``budget``.

  Args:
    fn: returns a scalar loss; its remat regions built with ``policy=None``
      take the candidate policies.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).
    budget: device bytes for the activations kept for the backward pass, as
      an int or a string such as ``"8GiB"``. Parameters, gradients and
      optimizer state are not included (see :func:`rt.memory_breakdown`).
    allow_offload: also consider moving names to host memory (needs
      ``jax_remat3`` off).
    host_budget: host bytes offloading may use (default: unlimited).
    host_bandwidth: bytes/s each way between device and host, to cost
      transfers.
    device_flops: FLOP/s, to convert transfer seconds into FLOP-equivalents.
    groups: other layouts of the same model, by group size (blocks per remat
      region): a mapping ``group -> (fn, args)`` or a callable
      ``group -> (fn, args)``. With groups, the budget bounds the
      *estimated peak* (kept activations plus one region's internals while it
      is recomputed) of every layout, ``fn`` itself included as "as given",
      and the plan takes the layout with the least recompute.
    group_sizes: the sizes passed to a callable ``groups`` (default
      :data:`DEFAULT_GROUP_SIZES`); a size the callable rejects with
      ``ValueError`` is reported and skipped.
    max_evaluations: analyzer evaluations the repair and proof may take
      (the named policies and one measurement per name come on top); past
      it the best plan measured is returned with ``optimal=False``.

  Returns:
    A :class:`Plan`; its ``warnings`` (each raised once as a ``UserWarning``)
    say what limited the search.

  Raises:
    ValueError: a budget below the least any policy keeps (the message says
      how much that is), a malformed size, ``fn`` without remat regions, or
      offloading under ``jax_remat3``.
    TypeError: malformed ``groups``.
  """
  limit = parse_bytes(budget)
  _check_rates(allow_offload, host_bandwidth, device_flops)
  _check_search(allow_offload, host_budget, max_evaluations)
  rates = dict(allow_offload=allow_offload, host_bandwidth=host_bandwidth,
               device_flops=device_flops)
  search = dict(host_budget=host_budget, max_evaluations=max_evaluations)
  if groups is None:
    result = Planner(fn, *args, **rates).plan(limit, **search)
  else:
    layouts = [(None, lambda: (fn, args))] + _layouts(groups, group_sizes)
    result = _plan_groups(layouts, limit, rates, search)
  analysis.warn_once(result.warnings)
  return result


def _plan_groups(layouts, limit: int, rates: dict, search: dict) -> Plan:
  plans: list[Plan] = []
  estimates: list[GroupEstimate] = []
  for group, build in layouts:
    try:
      fn, args = _unpack_layout(group, build())
      planner = Planner(fn, *args, **rates)
    except ValueError as e:
      estimates.append(GroupEstimate(group, 0, 0, 0, 0, 0, 0, 0, "", False,
                                     f"skipped: {e}"))
      continue
    facts = (group, planner.region_executions, planner.boundary_only_bytes,
             planner.everything_bytes)
    try:
      p = planner.plan(limit, peak=True, **search)
    except ValueError:
      kept = planner.boundary_only_bytes
      workspace = planner.workspace_bytes(kept)
      estimates.append(GroupEstimate(
          *facts, workspace, kept, kept + workspace,
          planner.measure("boundary-only").recompute_flops, "", False,
          "nothing fits"))
      continue
    plans.append(dataclasses.replace(p, group=group))
    estimates.append(GroupEstimate(
        *facts, p.workspace_bytes, p.activation_bytes, p.estimated_peak,
        p.recompute_flops, p.policy.name, True))
  if not plans:
    peaks = [e.estimated_peak for e in estimates if e.estimated_peak]
    least = (f"; the smallest estimated peak of any layout is "
             f"{format_bytes(min(peaks))} ({min(peaks)} bytes)") if peaks else ""
    raise ValueError(
        f"No group size fits the peak budget of {format_bytes(limit)} "
        f"({limit} bytes){least}. Raise the budget or use a smaller "
        "micro-batch.")
  best = min(plans, key=lambda p: (p.cost, p.estimated_peak))
  return dataclasses.replace(best, groups=tuple(estimates))


# ==================================================================== frontier

@dataclasses.dataclass(frozen=True)
class FrontierPoint:
  """One policy on the memory-vs-recompute plane.

  Attributes:
    label: the policy's name, or ``plan@SIZE`` for a plan.
    source: ``"named"`` (from the catalogue or given) or ``"plan"``.
    policy: the :class:`Policy`.
    activation_bytes: device bytes kept.
    offloaded_bytes: host bytes moved.
    recompute_flops: FLOPs recomputed.
    recompute_percent: the same, in percent of a no-remat step.
    budget: the plan's budget (None for named policies).
    on_frontier: no other point keeps fewer bytes with no more recompute
      (or the same bytes with less).
  """

  label: str
  source: str
  policy: Policy
  activation_bytes: int
  offloaded_bytes: int
  recompute_flops: int
  recompute_percent: float
  budget: int | None
  on_frontier: bool


@dataclasses.dataclass(frozen=True)
class Frontier:
  """The memory-vs-recompute Pareto frontier of named policies and plans.

  Attributes:
    points: every point, least memory first.
    warnings: what limited the plans (see :attr:`Plan.warnings`).
  """

  points: tuple[FrontierPoint, ...]
  warnings: tuple[str, ...] = ()

  @property
  def frontier(self) -> tuple[FrontierPoint, ...]:
    """The Pareto-optimal points, least memory first."""
    return tuple(p for p in self.points if p.on_frontier)

  def rows(self) -> list[dict[str, Any]]:
    """One record per point (the table's data)."""
    return [{"label": p.label, "source": p.source,
             "activation_bytes": p.activation_bytes,
             "offloaded_bytes": p.offloaded_bytes,
             "recompute_flops": p.recompute_flops,
             "recompute_percent": p.recompute_percent, "budget": p.budget,
             "on_frontier": p.on_frontier} for p in self.points]

  def _table(self) -> tuple[list[str], list[list[str]]]:
    body = [[p.label, p.source, format_bytes(p.activation_bytes),
             format_bytes(p.offloaded_bytes) if p.offloaded_bytes else "-",
             f"{p.recompute_percent:.1f}%", "*" if p.on_frontier else ""]
            for p in self.points]
    return ["policy", "source", "activations", "offloaded", "recompute",
            "frontier"], body

  def __str__(self) -> str:
    headers, body = self._table()
    return (text_table(headers, body,
                       right=[False, False, True, True, True, False])
            + "\n* = Pareto-optimal (no point keeps fewer bytes with no more "
            "recompute)" + "".join(f"\nwarning: {w}" for w in self.warnings))

  def _repr_html_(self) -> str:
    headers, body = self._table()
    return html_table(headers, body, caption="Memory vs recompute (bold: frontier)",
                      highlight=[p.on_frontier for p in self.points]
                      ) + warnings_html(self.warnings)

  def to_dict(self) -> dict[str, Any]:
    return {"points": self.rows(), "warnings": list(self.warnings)}

  def to_json(self, **kwargs: Any) -> str:
    return json.dumps(self.to_dict(), **kwargs)

  def to_dataframe(self):
    """One row per point (needs pandas)."""
    try:
      import pandas as pd
    except ImportError:
      raise ImportError("Frontier.to_dataframe needs pandas; install it with "
                        "`pip install 'remat-toolkit[display]'`.") from None
    return pd.DataFrame(self.rows())

  def plot(self, ax=None):
    """Recompute vs memory, frontier joined, plans marked (needs matplotlib)."""
    try:
      import matplotlib.pyplot as plt
    except ImportError:
      raise ImportError("Frontier.plot needs matplotlib; install it with "
                        "`pip install 'remat-toolkit[display]'`.") from None
    if ax is None:
      _, ax = plt.subplots(figsize=(7, 4.5))
    for source, marker in (("named", "o"), ("plan", "^")):
      pts = [p for p in self.points if p.source == source]
      ax.scatter([p.activation_bytes / 2**20 for p in pts],
                 [p.recompute_percent for p in pts], marker=marker,
                 c=["tab:red" if p.on_frontier else "tab:gray" for p in pts],
                 label=source)
    for p in self.points:
      if p.source == "named":
        ax.annotate(p.label, (p.activation_bytes / 2**20, p.recompute_percent),
                    fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = self.frontier
    ax.step([p.activation_bytes / 2**20 for p in front],
            [p.recompute_percent for p in front], where="post",
            color="tab:red", lw=1)
    ax.set_xlabel("activation memory kept (MiB)")
    ax.set_ylabel("recompute FLOPs (% of a no-remat step)")
    ax.set_title("remat: memory vs recompute")
    ax.legend()
    return ax


def _pareto(points: Sequence[tuple[int, float]]) -> list[bool]:
  return [not any(b2 <= b and c2 <= c and (b2 < b or c2 < c)
                  for b2, c2 in points) for b, c in points]


def frontier(fn: Callable[..., Any], *args: Any,
             policies: Sequence[str | Policy] | None = None,
             budgets: Sequence[int | str] | int | None = None,
             max_evaluations: int = DEFAULT_MAX_EVALUATIONS) -> Frontier:
  """The memory-vs-recompute frontier over named policies and plans.

  The model is traced once; plans at different budgets share evaluations.

  Args:
    fn: returns a scalar loss; see :func:`plan`.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees.
    policies: names or Policies to place (default: every catalogue policy
      that does not offload; offloading is a third axis).
    budgets: activation budgets to plan at, or how many, spread evenly from
      ``boundary-only`` to ``save-everything`` (default 8).
    max_evaluations: per plan; see :func:`plan`.

  Returns:
    A :class:`Frontier`.
  """
  planner = Planner(fn, *args)
  named = _frontier_named(planner, policies)
  plans = _frontier_plans(planner, budgets, max_evaluations)
  items = named + plans
  flags = _pareto([(p.activation_bytes, p.recompute_flops) for p in items])
  points = [dataclasses.replace(p, on_frontier=f)
            for p, f in zip(items, flags, strict=True)]
  points.sort(key=lambda p: (p.activation_bytes, p.recompute_flops, p.label))
  result = Frontier(points=tuple(points), warnings=planner.warnings)
  analysis.warn_once(result.warnings)
  return result


def _point(label: str, source: str, policy: Policy, report: ResidualReport,
           budget: int | None) -> FrontierPoint:
  return FrontierPoint(label=label, source=source, policy=policy,
                       activation_bytes=report.activation_bytes,
                       offloaded_bytes=report.offloaded_bytes,
                       recompute_flops=report.recompute_flops,
                       recompute_percent=report.recompute_percent,
                       budget=budget, on_frontier=False)


def _frontier_named(planner: Planner, policies) -> list[FrontierPoint]:
  if policies is None:
    chosen = [catalog.get_policy(n) for n in catalog.list_policies()]
    chosen = [p for p in chosen if not p.offloads]
  else:
    if isinstance(policies, (str, Policy)):
      raise TypeError(f"policies must be a list of names, got {policies!r}; "
                      f"write policies=[{policies!r}].")
    chosen = [catalog.get_policy(p) for p in policies]
  out = []
  for policy in chosen:
    if policy.offloads and compat.offloading_unsupported():
      raise ValueError(
          f"Policy {policy.name!r} offloads, but {compat.offloading_refusal()}"
          "; or leave it out of policies.")
    out.append(_point(policy.name, "named", policy, planner.measure(policy),
                      None))
  return out


def _frontier_budgets(planner: Planner, budgets) -> list[int]:
  if budgets is None or (isinstance(budgets, int) and not isinstance(budgets, bool)):
    count = 8 if budgets is None else budgets
    if count < 1:
      raise ValueError(f"budgets must be a positive count or a list of sizes, "
                       f"got {budgets!r}.")
    lo, hi = planner.boundary_only_bytes, planner.save_everything_bytes
    if count == 1:
      return [hi]
    return sorted({lo + (hi - lo) * i // (count - 1) for i in range(count)})
  if isinstance(budgets, (str, bytes)):
    raise TypeError(f"budgets must be a list of sizes or a count, got "
                    f"{budgets!r}; write budgets=[{budgets!r}].")
  return [parse_bytes(b) for b in budgets]


def _frontier_plans(planner: Planner, budgets, max_evaluations: int
                    ) -> list[FrontierPoint]:
  out: list[FrontierPoint] = []
  for budget in _frontier_budgets(planner, budgets):
    try:
      p = planner.plan(budget, max_evaluations=max_evaluations)
    except ValueError:  # nothing fits this budget: no point to draw
      continue
    out.append(_point(f"plan@{format_bytes(budget)}", "plan", p.policy,
                      p.report, budget))
  return out
