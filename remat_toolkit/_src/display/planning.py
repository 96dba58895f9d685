"""Text, HTML and DataFrames of plans and frontiers."""

from __future__ import annotations

import html
from typing import Any

from remat_toolkit._src.core import format as fmt
from remat_toolkit._src.display.common import require
from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.results.base import summary_lines
from remat_toolkit._src.results.base import to_dataframe
from remat_toolkit._src.results.base import to_html
from remat_toolkit._src.results.base import to_text
from remat_toolkit._src.results.planning import Frontier
from remat_toolkit._src.results.planning import Plan

# ============================================================ Plan, Frontier


@summary_lines.register
def plan_summary_lines(plan: Plan) -> list[str]:
  """A plan's headline: budget and what it bounds, numbers, proof, choices."""
  fb, ff = fmt.format_bytes, fmt.format_flops
  where = "on device"
  if plan.per_device:
    where = (f"per device ({plan.devices} devices, {plan.per_device_method}; "
             f"{fb(plan.activation_bytes)} on all together)")
  lines = [
      f"{plan.policy.name}: budget {fb(plan.budget)} ({plan.bounds}"
      + (" per device" if plan.per_device else "") + ")"
      + (f", group size {plan.group}" if plan.group is not None else ""),
      f"  keeps {fb(plan.kept_bytes)} {where}"
      + (f", offloads {fb(plan.offloaded_bytes)} to host"
         if plan.offloaded_bytes else "")
      + f"; recomputes {ff(plan.recompute_flops)} "
      f"({plan.recompute_percent:.1f}% of a no-remat step)",
      f"  estimated peak {fb(plan.estimated_peak)} (kept activations + "
      f"{fb(plan.workspace_bytes)} while one region is recomputed)",
  ]
  if plan.peak_bytes is not None:
    lines.append(
        f"  predicted step peak {fb(plan.peak_bytes)} (parameters, inputs, "
        "gradients and what is live at the step's worst moment)"
        + ("" if plan.xla_peak_bytes is None else
           f"; XLA's figure {fb(plan.xla_peak_bytes)}"))
  lines.append(_proof(plan) + f" ({plan.evaluations} analyzer evaluations)")
  if plan.per_layer:
    lines.append(f"  {plan.policy.keeps_summary()}")
  elif plan.decisions:
    for what in ("save", "offload", "recompute"):
      names = [n for n, d in plan.decisions.items() if d == what]
      if names:
        lines.append(f"  {what:<9} {', '.join(names)}")
  else:
    lines.append(f"  policy: {plan.policy.keeps_summary()}")
  lines.extend(f"  warning: {w}" for w in plan.warnings)
  return lines


def _proof(plan: Plan) -> str:
  if plan.peak_bytes is not None:
    return ("  least recompute found by bisecting the kept-bytes limit on the "
            "step's peak" + (" and XLA's figure" if plan.xla_peak_bytes
                             is not None else "")
            + ", not proven optimal (the peak only roughly grows with the "
            "kept bytes)")
  if plan.per_layer:
    return ("  optimal: the exact per-region solution, measured as predicted"
            if plan.optimal else
            "  best measured, not proven optimal: the regions' measured "
            "effects do not add up")
  return ("  proven optimal: the branch and bound finished" if plan.optimal
          else "  best measured, not proven optimal: the search stopped at "
          "max_evaluations")


def region_runs(plan: Plan) -> list[tuple[str, int, Any]]:
  """Consecutive regions of one kind and one policy, as ``(label, count,
  first row)``: a 48-layer plan reads as a few runs."""
  runs: list[tuple[str, int, Any]] = []
  start = 0
  rows = plan.regions
  for i in range(1, len(rows) + 1):
    if i < len(rows) and (rows[i].policy, rows[i].kind) == (
        rows[start].policy, rows[start].kind):
      continue
    label = rows[start].region if i - start == 1 else (
        f"{rows[start].region} .. {rows[i - 1].region}")
    runs.append((label, i - start, rows[start]))
    start = i
  return runs


def _plan_region_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
  """One row per run of regions; the offload column only where one offloads."""
  runs = region_runs(plan)
  offloads = any(row.offloaded_bytes for _, _, row in runs)
  body = [[label, str(count), row.policy, fmt.format_bytes(row.activation_bytes),
           *([fmt.format_bytes(row.offloaded_bytes) if row.offloaded_bytes
              else "-"] if offloads else []),
           fmt.format_flops(row.recompute_flops)]
          for label, count, row in runs]
  return ["regions", "count", "policy", "keeps",
          *(["offloads"] if offloads else []), "recomputes"], body


def _planned_policies(plan: Plan) -> list[tuple[str, str]]:
  """The policies the planner made (not the catalogue's), and what each
  keeps, so that their names in the table can be read."""
  named = {f.name for f in plan.named}
  made = {sub.name: sub for _, sub in plan.policy.regions
          if sub.name not in named}
  return [(name, sub.description or sub.keeps_summary())
          for name, sub in made.items()]


def _plan_named_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
  rows = sorted(plan.named, key=lambda f: (not f.fits, f.cost,
                                           f.activation_bytes))
  peaks = any(f.peak_bytes is not None for f in rows)
  body = [[f.name, fmt.format_bytes(f.activation_bytes),
           *([fmt.format_bytes(f.peak_bytes) if f.peak_bytes is not None
              else "-"] if peaks else []),
           fmt.format_bytes(f.offloaded_bytes) if f.offloaded_bytes else "-",
           f"{f.recompute_percent:.1f}%", "yes" if f.fits else "no"]
          for f in rows]
  kept = "per device" if plan.per_device else "activations"
  return ["named policy", kept, *(["step peak"] if peaks else []),
          "offloaded", "recompute", "fits"], body


def _plan_group_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
  body = []
  peaks = plan.peak_bytes is not None
  for g in plan.groups:
    label = "as given" if g.group is None else str(g.group)
    if not g.regions:  # skipped: the layout could not be built
      body.append([label, *["-"] * (7 if peaks else 6), "no", g.note])
      continue
    body.append([label, str(g.regions), fmt.format_bytes(g.boundary_bytes),
                 fmt.format_bytes(g.workspace_bytes),
                 fmt.format_bytes(g.activation_bytes),
                 fmt.format_bytes(g.estimated_peak),
                 *([fmt.format_bytes(g.peak_bytes) if g.peak_bytes is not None
                    else "-"] if peaks else []),
                 fmt.format_flops(g.recompute_flops), "yes" if g.fits else "no",
                 g.note])
  return ["group", "regions", "boundaries", "workspace", "kept", "est. peak",
          *(["step peak"] if peaks else []), "recompute", "fits",
          "note"], body


@to_text.register
def _(plan: Plan) -> str:
  out = plan_summary_lines(plan)
  if plan.per_layer:
    headers, body = _plan_region_rows(plan)
    out += ["", "per region (each region's figures; keeps: bytes beyond its "
            "inputs):",
            fmt.text_table(headers, body, right=[
                h not in ("regions", "policy") for h in headers])]
    out += [f"  {name}: {what}" for name, what in _planned_policies(plan)]
  if plan.groups:
    headers, body = _plan_group_rows(plan)
    out += ["", "group sizes (estimated peak = kept activations + one "
            "region's workspace):",
            fmt.text_table(headers, body, right=[
                h not in ("group", "fits", "note") for h in headers])]
  headers, body = _plan_named_rows(plan)
  out += ["", fmt.text_table(headers, body, right=[
      h not in ("named policy", "fits") for h in headers])]
  best = plan.best_builtin
  if best is not None:
    out.append(f"\nbest named policy that fits: {best.name} "
               f"({best.recompute_percent:.1f}% recompute)")
  out.append(f"use: `with rt.use_policy(plan):`, or rt.register_policy(plan) / "
             f"rt.save_policy(plan, '{plan.policy.name}.toml')"
             + (", or rt.remat_modules(model, plan.rules)"
                if plan.per_layer and not _positional(plan) else ""))
  return "\n".join(out)


def _positional(plan: Plan) -> bool:
  """Whether a per-region plan keys regions by position (plain functions),
  which ``plan.rules`` cannot name."""
  return any(region_keys.is_positional(key) for key, _ in plan.policy.regions)


@to_html.register
def _(plan: Plan) -> str:
  summary = "<br>".join(html.escape(line.strip(), quote=False)
                        for line in plan_summary_lines(plan))
  headers, body = _plan_named_rows(plan)
  named = fmt.html_table(headers, body,
                         caption="Named policies on the same model",
                         highlight=[row[-1] == "yes" for row in body])
  groups = ""
  if plan.groups:
    headers, gbody = _plan_group_rows(plan)
    groups = fmt.html_table(headers, gbody, caption="Group sizes",
                            highlight=[g.group == plan.group for g in plan.groups])
  regions = ""
  if plan.per_layer:
    headers, rbody = _plan_region_rows(plan)
    regions = fmt.html_table(headers, rbody, caption="Per region")
  return (f"<div><p style='font-family:monospace'>{summary}</p>"
          f"{regions}{groups}{named}</div>")


def _frontier_table(frontier: Frontier) -> tuple[list[str], list[list[str]]]:
  body = [[p.label, p.source, fmt.format_bytes(p.activation_bytes),
           fmt.format_bytes(p.offloaded_bytes) if p.offloaded_bytes else "-",
           f"{p.recompute_percent:.1f}%", "*" if p.on_frontier else ""]
          for p in frontier.points]
  return ["policy", "source", "activations", "offloaded", "recompute",
          "frontier"], body


def _frontier_note(frontier: Frontier) -> str:
  if any(p.offloaded_bytes for p in frontier.points):
    return ("\n* = Pareto-optimal (no point is as good on device bytes, "
            "recompute and offload, and better on one)")
  return ("\n* = Pareto-optimal (no point keeps fewer bytes with no more "
          "recompute)")


@to_text.register
def _(frontier: Frontier) -> str:
  headers, body = _frontier_table(frontier)
  return (fmt.text_table(headers, body,
                         right=[False, False, True, True, True, False])
          + _frontier_note(frontier)
          + "".join(f"\nskipped {n}: {why}" for n, why in frontier.skipped.items())
          + "".join(f"\nwarning: {w}" for w in frontier.warnings))


@to_html.register
def _(frontier: Frontier) -> str:
  headers, body = _frontier_table(frontier)
  notes = "".join(f"<p>skipped {html.escape(n)}: {html.escape(w)}</p>"
                  for n, w in frontier.skipped.items())
  return (fmt.html_table(headers, body,
                         caption="Memory vs recompute (bold: frontier)",
                         highlight=[p.on_frontier for p in frontier.points])
          + notes + fmt.warnings_html(frontier.warnings))


@to_dataframe.register
def _(frontier: Frontier) -> Any:
  pd = require("pandas", "Frontier.to_dataframe")
  return pd.DataFrame(frontier.rows())


