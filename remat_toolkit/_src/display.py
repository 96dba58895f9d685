"""Renders every result as text, HTML or a pandas DataFrame.

Results hold data; this module is the one place that turns them into
something to read. Each result class's ``__str__``, ``_repr_html_`` and
``to_dataframe`` call :func:`to_text`, :func:`to_html` and
:func:`to_dataframe` here. Formatting primitives (bytes, FLOPs, tables) are
in :mod:`remat_toolkit._src.format`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src import display
  >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum())
  >>> report = rt.analyze(f, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> display.to_text(report) == str(report)
  True
"""

from __future__ import annotations

import functools
from typing import Any

from remat_toolkit._src import format as fmt

__all__ = ["to_text", "to_html", "to_dataframe", "require"]


def require(module: str, what: str) -> Any:
  """Imports an optional dependency, or says how to install it."""
  try:
    return __import__(module)
  except ImportError:
    raise ImportError(f"{what} needs {module}; install it with "
                      f"`pip install {module}`.") from None


@functools.singledispatch
def to_text(result: Any) -> str:
  """The result as terminal text (what ``print(result)`` shows)."""
  raise TypeError(f"no text rendering for {type(result).__name__}")


@functools.singledispatch
def to_html(result: Any) -> str:
  """The result as HTML (what a notebook shows)."""
  raise TypeError(f"no HTML rendering for {type(result).__name__}")


@functools.singledispatch
def to_dataframe(result: Any) -> Any:
  """The result's rows as a pandas DataFrame (needs pandas)."""
  raise TypeError(f"no DataFrame for {type(result).__name__}")


# Renderers are registered below, one section per result, each with
# ``@to_text.register`` / ``@to_html.register`` / ``@to_dataframe.register``
# on a function whose first parameter is annotated with the result class
# (imported inside the section from where the class lives). ``fmt`` holds the
# shared primitives.
_ = fmt

# ================================================= ResidualReport, Comparison

import dataclasses  # noqa: E402
import html  # noqa: E402

from remat_toolkit._src.report import Comparison  # noqa: E402
from remat_toolkit._src.report import ResidualReport  # noqa: E402
from remat_toolkit._src.report import module_prefix  # noqa: E402


def residual_report_summary(report: ResidualReport) -> list[str]:
  """A report's headline figures and warnings, one line each."""
  lines = [
      f"policy {report.policy}: {len(report.activations)} activation "
      f"residuals, {fmt.format_bytes(report.activation_bytes)} on device"
      + (f", {fmt.format_bytes(report.offloaded_bytes)} offloaded to host"
         if report.offloaded_bytes else "")
      + f"; arguments held for backward {fmt.format_bytes(report.argument_bytes)}",
      f"FLOPs: forward {fmt.format_flops(report.forward_flops)}, backward "
      f"{fmt.format_flops(report.backward_flops)}, recompute "
      f"{fmt.format_flops(report.recompute_flops)} "
      f"({report.recompute_percent:.1f}% of a no-remat step)",
  ]
  if report.per_device_activation_bytes is not None:
    lines.append(f"per device ({report.devices} devices): "
                 f"{fmt.format_bytes(report.per_device_activation_bytes)} "
                 "activations")
  if report.xla:
    lines.append("XLA: " + ", ".join(
        f"{k} {fmt.format_bytes(v) if isinstance(v, int) else v}"
        for k, v in report.xla.items()))
  lines.extend(f"warning: {w}" for w in report.warnings)
  return lines


def residual_table(report: ResidualReport, *, depth: int | None = 2,
                   limit: int = 40) -> str:
  """Per-module, per-name table of a report's activation residuals."""
  rows: dict[tuple[str, str], list] = {}
  for r in report.activations:
    module = module_prefix(r.module_path, depth)
    row = rows.setdefault((module, r.what), [0, 0, r.memory_kind, r.stacked])
    row[0] += 1
    row[1] += r.nbytes
  ordered = sorted(rows.items(), key=lambda kv: -kv[1][1])
  total = max(report.activation_bytes + report.offloaded_bytes, 1)
  body = [[m, w, n, fmt.format_bytes(b), f"{100 * b / total:.1f}%", mk,
           s if s > 1 else ""]
          for (m, w), (n, b, mk, s) in ordered[:limit]]
  if len(ordered) > limit:
    rest = sum(v[1] for _, v in ordered[limit:])
    body.append(["...", f"{len(ordered) - limit} more", "",
                 fmt.format_bytes(rest), f"{100 * rest / total:.1f}%", "", ""])
  return fmt.text_table(["module", "residual", "count", "bytes", "share",
                         "memory", "stacked"], body,
                        right=[False, False, True, True, True, False, True])


@to_text.register
def _(report: ResidualReport) -> str:
  return "\n".join(residual_report_summary(report) + ["", residual_table(report)])


@to_html.register
def _(report: ResidualReport) -> str:
  summary = "<br>".join(html.escape(line, quote=False)
                        for line in residual_report_summary(report))
  modules = fmt.html_table(["module", "bytes"], [
      [m, fmt.format_bytes(b)] for m, b in report.by_module(depth=2).items()],
      caption="Activation bytes by module")
  names = fmt.html_table(["residual", "bytes"], [
      [n, fmt.format_bytes(b)] for n, b in report.by_name().items()],
      caption="Activation bytes by name")
  return (f"<div><p style='font-family:monospace'>{summary}</p>"
          f"<div style='display:flex;gap:2em'>{modules}{names}</div></div>")


@to_dataframe.register
def _(report: ResidualReport) -> Any:
  pd = require("pandas", "to_dataframe")
  return pd.DataFrame([dataclasses.asdict(r) for r in report.residuals])


def _comparison_table(comparison: Comparison
                      ) -> tuple[list[str], list[list[str]], list[bool]]:
  """Headers, body and Pareto flags of a comparison's table."""
  headers = ["policy", "activations", "% of save-everything", "offloaded",
             "recompute", "residuals", "largest", "pareto"]
  reports = comparison.reports.values()
  has_xla = any(r.xla for r in reports)
  sharded = any(r.devices > 1 for r in reports)
  if sharded:
    headers.insert(2, "per device")
  if has_xla:
    headers.insert(len(headers) - 1, "XLA temp")
  body, pareto = [], []
  for row in comparison.rows():
    mark = " !" if row["keeps_none_of_its_names"] else ""
    percent = row["percent_of_save_everything"]
    line = [row["policy"] + mark, fmt.format_bytes(row["activation_bytes"]),
            "" if percent is None else f"{percent:.1f}%",
            (fmt.format_bytes(row["offloaded_bytes"])
             if row["offloaded_bytes"] else "-"),
            f"{row['recompute_percent']:.1f}%", str(row["num_residuals"]),
            ", ".join(row["largest"]), "*" if row["pareto"] else ""]
    if sharded:
      line.insert(2, fmt.format_bytes(row["activation_bytes_per_device"]))
    if has_xla:
      line.insert(len(line) - 1, fmt.format_bytes(row["xla_temp_bytes"] or 0))
    body.append(line)
    pareto.append(row["pareto"])
  return headers, body, pareto


_SILENT_NOTE = "! = keeps none of its names in this model (see warnings)"


@to_text.register
def _(comparison: Comparison) -> str:
  headers, body, _ = _comparison_table(comparison)
  right = [h not in ("policy", "largest") for h in headers]
  lines = [fmt.text_table(headers, body, right=right)]
  if comparison.baseline:
    b = comparison.baseline
    lines.append(
        f"\nforward {fmt.format_flops(b.forward_flops)}, no-remat step "
        f"{fmt.format_flops(b.baseline_step_flops)} (matmul FLOPs); "
        f"{comparison.regions} remat regions; largest = biggest residuals this "
        "policy keeps that not every policy keeps; * = Pareto-optimal (no "
        "policy is as good on device bytes, recompute and offload, and "
        "better on one)")
  for name, why in comparison.skipped.items():
    lines.append(f"skipped {name}: {why}")
  if comparison.silent_policies():
    lines.append(_SILENT_NOTE)
  lines.extend(f"warning: {w}" for w in comparison.warnings)
  return "\n".join(lines)


@to_html.register
def _(comparison: Comparison) -> str:
  headers, body, pareto = _comparison_table(comparison)
  notes = "".join(f"<p>skipped {html.escape(n)}: {html.escape(w)}</p>"
                  for n, w in comparison.skipped.items())
  if comparison.silent_policies():
    notes += f"<p>{_SILENT_NOTE}</p>"
  return (fmt.html_table(headers, body,
                         caption="Policies compared (bold: Pareto-optimal)",
                         highlight=pareto)
          + notes + fmt.warnings_html(comparison.warnings))


@to_dataframe.register
def _(comparison: Comparison) -> Any:
  pd = require("pandas", "to_dataframe")
  return pd.DataFrame(comparison.rows())

# ================================================================ Breakdown

from remat_toolkit._src.breakdown import Breakdown  # noqa: E402


def _breakdown_table(breakdown: Breakdown) -> tuple[list[str], list[list[str]]]:
  body = [[r["category"], fmt.format_bytes(r["bytes"]), f"{r['share']:.1f}%",
           r["note"]] for r in breakdown.rows()]
  body.append(["total", fmt.format_bytes(breakdown.total_bytes), "100.0%",
               "before XLA's temporaries"])
  return ["category", "bytes", "share", "note"], body


def breakdown_summary(breakdown: Breakdown) -> list[str]:
  """A breakdown's headline figures and warnings, one line each."""
  b = breakdown
  lines = [f"dominant: {b.dominant}",
           f"activations under {b.policy}: "
           f"{fmt.format_bytes(b.activation_bytes)}, recompute "
           f"{b.recompute_percent:.1f}% of a no-remat step",
           f"remat range: boundary-only {fmt.format_bytes(b.boundary_only_bytes)}"
           f" .. save-everything {fmt.format_bytes(b.save_everything_bytes)}"]
  if b.xla_temp_bytes is not None:
    lines.append(f"XLA temporaries (compiled): {fmt.format_bytes(b.xla_temp_bytes)}"
                 + (f" [{b.xla_note}]" if b.xla_note else ""))
  lines.extend(f"warning: {w}" for w in b.warnings)
  return lines


@to_text.register
def _(breakdown: Breakdown) -> str:
  headers, body = _breakdown_table(breakdown)
  table = fmt.text_table(headers, body, right=[False, True, True, False])
  return "\n".join([table, "", *breakdown_summary(breakdown), "",
                    breakdown.verdict])


@to_html.register
def _(breakdown: Breakdown) -> str:
  headers, body = _breakdown_table(breakdown)
  bold = [row[0] == breakdown.dominant for row in body]
  table = fmt.html_table(headers, body, caption="Memory of one training step",
                         highlight=bold)
  lines = "<br>".join(html.escape(line, quote=False)
                      for line in breakdown_summary(breakdown))
  return (f"<div>{table}<p style='font-family:monospace'>{lines}</p>"
          f"<p>{html.escape(breakdown.verdict, quote=False)}</p></div>")


@to_dataframe.register
def _(breakdown: Breakdown) -> Any:
  pd = require("pandas", "to_dataframe")
  return pd.DataFrame(breakdown.rows())

# ============================================================= Verification

from remat_toolkit._src.verify import Verification  # noqa: E402


def verification_summary(verification: Verification) -> list[str]:
  """What verify found, one line each (the text form)."""
  v = verification
  lines = [f"verify {v.policy}: {'PASSED' if v.passed else 'PROBLEMS FOUND'}"]
  if v.ok is None:
    lines.append("  gradients: not checked")
  else:
    lines.append(
        f"  gradients: {'equal' if v.ok else 'DIFFERENT'}; max abs diff "
        f"{v.max_abs_diff:.3g}, max rel diff {v.max_rel_diff:.3g} "
        f"(rtol {v.rtol:g}, atol {v.atol:g}; inputs {v.inputs})")
  lines.append(f"  reference: {v.reference}")
  lines.append(f"  remat regions taking the policy: {v.regions}; keeps "
               f"{v.activation_bytes} activation bytes on device"
               + (f", {v.offloaded_bytes} on host" if v.offloaded_bytes else ""))
  lines.append("  no-op: " + (f"yes, keeps what {v.no_op!r} keeps"
                              if v.no_op else "no"))
  lines.extend(f"  warning: {w}" for w in v.warnings)
  return lines


@to_text.register
def _(verification: Verification) -> str:
  return "\n".join(verification_summary(verification))


@to_html.register
def _(verification: Verification) -> str:
  text = html.escape("\n".join(verification_summary(verification)), quote=False)
  return f"<pre>{text}</pre>"

# ============================================================= RematSummary

import html as _html  # noqa: E402

from remat_toolkit._src.discovery import INDEXED as _INDEXED  # noqa: E402
from remat_toolkit._src.discovery import RematSummary  # noqa: E402


def _abbreviate_regions(regions: tuple[str, ...]) -> str:
  """``h/0, h/1`` as is; a run of three or more indexed siblings as
  ``h/0 .. h/11``."""
  runs: list[list[str]] = []
  previous = None
  for region in regions:
    parent, _, name = region.rpartition("/")
    match = _INDEXED.fullmatch(name)
    key = (parent, match.group(1), int(match.group(2))) if match else None
    if (key and previous and key[:2] == previous[:2]
        and key[2] == previous[2] + 1):
      runs[-1].append(region)
    else:
      runs.append([region])
    previous = key
  return ", ".join(run[0] + " .. " + run[-1] if len(run) > 2
                   else ", ".join(run) for run in runs)


def _summary_headline(summary: RematSummary) -> str | None:
  """The sentence for a summary without regions; None when it has some."""
  if not summary.ran:
    return (f"remat_modules has not chosen regions of {summary.model} yet: a "
            f"linen model's submodules are known when it runs; call its "
            f"init or apply first.")
  if summary.regions:
    return None
  if summary.auto:
    return (f"remat_modules found no repeated blocks in {summary.model}: no "
            f"remat regions. Pass rules, e.g. "
            f"rt.remat_modules(model, {{'MyBlock': None}}).")
  return (f"remat_modules rules matched no module of {summary.model}: no "
          f"remat regions.")


def _summary_verb(summary: RematSummary) -> str:
  return "chose" if summary.auto else "rules matched"


@to_text.register
def _remat_summary_text(summary: RematSummary) -> str:
  headline = _summary_headline(summary)
  if headline is not None:
    return headline
  count = len(summary.regions)
  return (f"remat_modules {_summary_verb(summary)} "
          f"{', '.join(summary.classes)} ({count} "
          f"region{'' if count == 1 else 's'}: "
          f"{_abbreviate_regions(summary.regions)})")


@to_html.register
def _remat_summary_html(summary: RematSummary) -> str:
  headline = _summary_headline(summary)
  if headline is not None:
    return f"<p style='font-family:monospace'>{_html.escape(headline)}</p>"
  caption = (f"remat_modules {_summary_verb(summary)} "
             f"{', '.join(summary.classes)} in {summary.model}")
  return fmt.html_table(("#", "region"), list(enumerate(summary.regions)),
                        caption=caption)

# ============================================================ Plan, Frontier

from remat_toolkit._src.frontier import Frontier  # noqa: E402
from remat_toolkit._src.plan_result import Plan  # noqa: E402


def plan_summary_lines(plan: Plan) -> list[str]:
  """A plan's headline: budget and what it bounds, numbers, proof, choices."""
  fb, ff = fmt.format_bytes, fmt.format_flops
  lines = [
      f"{plan.policy.name}: budget {fb(plan.budget)} ({plan.bounds})"
      + (f", group size {plan.group}" if plan.group is not None else ""),
      f"  keeps {fb(plan.activation_bytes)} on device"
      + (f", offloads {fb(plan.offloaded_bytes)} to host"
         if plan.offloaded_bytes else "")
      + f"; recomputes {ff(plan.recompute_flops)} "
      f"({plan.recompute_percent:.1f}% of a no-remat step)",
      f"  estimated peak {fb(plan.estimated_peak)} (kept activations + "
      f"{fb(plan.workspace_bytes)} while one region is recomputed)",
      ("  proven optimal: the branch and bound finished" if plan.optimal
       else "  best measured, not proven optimal: the search stopped at "
       "max_evaluations")
      + f" ({plan.evaluations} analyzer evaluations)",
  ]
  if plan.decisions:
    for what in ("save", "offload", "recompute"):
      names = [n for n, d in plan.decisions.items() if d == what]
      if names:
        lines.append(f"  {what:<9} {', '.join(names)}")
  else:
    lines.append(f"  policy: {plan.policy.keeps_summary()}")
  lines.extend(f"  warning: {w}" for w in plan.warnings)
  return lines


def _plan_named_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
  rows = sorted(plan.named, key=lambda f: (not f.fits, f.cost,
                                           f.activation_bytes))
  body = [[f.name, fmt.format_bytes(f.activation_bytes),
           fmt.format_bytes(f.offloaded_bytes) if f.offloaded_bytes else "-",
           f"{f.recompute_percent:.1f}%", "yes" if f.fits else "no"]
          for f in rows]
  return ["named policy", "activations", "offloaded", "recompute", "fits"], body


def _plan_group_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
  body = []
  for g in plan.groups:
    label = "as given" if g.group is None else str(g.group)
    if not g.regions:  # skipped: the layout could not be built
      body.append([label, *["-"] * 6, "no", g.note])
      continue
    body.append([label, str(g.regions), fmt.format_bytes(g.boundary_bytes),
                 fmt.format_bytes(g.workspace_bytes),
                 fmt.format_bytes(g.activation_bytes),
                 fmt.format_bytes(g.estimated_peak),
                 fmt.format_flops(g.recompute_flops), "yes" if g.fits else "no",
                 g.note])
  return ["group", "regions", "boundaries", "workspace", "kept", "est. peak",
          "recompute", "fits", "note"], body


@to_text.register
def _(plan: Plan) -> str:
  out = plan_summary_lines(plan)
  if plan.groups:
    headers, body = _plan_group_rows(plan)
    out += ["", "group sizes (estimated peak = kept activations + one "
            "region's workspace):",
            fmt.text_table(headers, body, right=[
                h not in ("group", "fits", "note") for h in headers])]
  headers, body = _plan_named_rows(plan)
  out += ["", fmt.text_table(headers, body,
                             right=[False, True, True, True, False])]
  best = plan.best_builtin
  if best is not None:
    out.append(f"\nbest named policy that fits: {best.name} "
               f"({best.recompute_percent:.1f}% recompute)")
  out.append(f"use: `with rt.use_policy(plan.policy):`, or plan.register() / "
             f"plan.save('{plan.policy.name}.toml')")
  return "\n".join(out)


@to_html.register
def _(plan: Plan) -> str:
  summary = "<br>".join(html.escape(line.strip(), quote=False)
                        for line in plan_summary_lines(plan))
  headers, body = _plan_named_rows(plan)
  named = fmt.html_table(headers, body,
                         caption="Named policies on the same model",
                         highlight=[row[4] == "yes" for row in body])
  groups = ""
  if plan.groups:
    headers, gbody = _plan_group_rows(plan)
    groups = fmt.html_table(headers, gbody, caption="Group sizes",
                            highlight=[g.group == plan.group for g in plan.groups])
  return (f"<div><p style='font-family:monospace'>{summary}</p>"
          f"{groups}{named}</div>")


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


# ==================================================== BenchResult, BatchSearch

import os  # noqa: E402
from html import escape as _escape_html  # noqa: E402

from remat_toolkit._src.batch_search import BatchSearch  # noqa: E402
from remat_toolkit._src.bench import BASELINE  # noqa: E402
from remat_toolkit._src.bench import BenchResult  # noqa: E402
from remat_toolkit._src.train_step import MEMORY_FIGURE  # noqa: E402


def _ratio_or_dash(value: float | None) -> str:
  return "-" if value is None else f"{value:.2f}x"


def _bytes_or_dash(value: int | None) -> str:
  return "-" if value is None else fmt.format_bytes(value)


def _bench_table(result: BenchResult) -> tuple[list[str], list[list[str]]]:
  accum = any(r.grad_accum > 1 for r in result.records)
  device = any(r.device_peak_bytes is not None for r in result.records)
  headers = ["policy", "compile", "step (median)", "tokens/s", "step vs base",
             "compiled peak", "peak vs base", "XLA temp",
             "device peak" if device else "host RSS peak", "loss"]
  if accum:
    headers.insert(1, "accum x micro")
  body = []
  for r in result.records:
    measured = r.device_peak_bytes if device else r.host_peak_rss_bytes
    row = [r.policy + (" (base)" if r.is_baseline else ""),
           f"{r.compile_time_s:.1f} s", f"{r.step_time_s * 1e3:.1f} ms",
           f"{r.tokens_per_s:,.0f}", _ratio_or_dash(r.relative_step_time),
           fmt.format_bytes(r.peak_bytes), _ratio_or_dash(r.relative_peak_bytes),
           fmt.format_bytes(r.temp_bytes),
           _bytes_or_dash(measured) + ("" if r.measured_peak_is_own else " *"),
           f"{r.loss_last:.4f}"]
    if accum:
      row.insert(1, f"{r.grad_accum} x {r.micro_batch}")
    body.append(row)
  return headers, body


def _bench_figure_notes(result: BenchResult) -> list[str]:
  b = result.baseline
  out = [
      f"{result.model}; {b.global_batch} examples x "
      f"{b.tokens_per_step // b.global_batch} "
      f"tokens per step; median of {result.steps} steps after {result.warmup} "
      f"warm-up; {result.device_kind} ({result.backend}); "
      f"XLA_FLAGS={result.xla_flags or '(unset)'}; jax_remat3={result.jax_remat3}.",
      f"compiled peak: {MEMORY_FIGURE}, per policy; XLA temp: its "
      "temporaries, where the activations kept for the backward pass live. "
      "Measured peaks are process-wide high-water marks (policies ran in "
      "ascending compiled peak; * = the mark did not rise during that "
      "policy's run, so it is not its own).",
  ]
  if result.backend == "cpu":
    out += _cpu_notes(result.load_average)
  out += [f"skipped {name}: {why}" for name, why in result.skipped.items()]
  return out


def _cpu_notes(load_average: float | None) -> list[str]:
  from remat_toolkit._src.analysis import cpu_scheduler_setting
  out = [
      "CPU figures: step times are XLA:CPU's and do not predict an "
      "accelerator's. XLA:CPU's compiled memory follows the policy "
      "mainly for layers under scan (built-in models: scan=True, "
      "--scan). XLA:CPU scheduler: " + cpu_scheduler_setting() + "."]
  cores = os.cpu_count() or 1
  if load_average is not None and load_average > cores:
    out.append(f"The host was busy (load average {load_average:.1f} on "
               f"{cores} cores): step times are noisy.")
  return out


def bench_notes(result: BenchResult) -> list[str]:
  """What a benchmark's figures mean and how they were taken, then its warnings."""
  return _bench_figure_notes(result) + [f"warning: {w}" for w in result.warnings]


def bench_markdown(result: BenchResult) -> str:
  """A benchmark's table as Markdown (for a README), without the notes."""
  headers, body = _bench_table(result)
  rule = ["---" if h == "policy" else "---:" for h in headers]
  return "\n".join("| " + " | ".join(row) + " |"
                   for row in [headers, rule, *body])


@to_text.register(BenchResult)
def _bench_text(result: BenchResult) -> str:
  headers, body = _bench_table(result)
  right = [h != "policy" for h in headers]
  return "\n".join([fmt.text_table(headers, body, right=right), "",
                    *bench_notes(result)])


@to_html.register(BenchResult)
def _bench_html(result: BenchResult) -> str:
  headers, body = _bench_table(result)
  notes = "".join(f"<p>{_escape_html(n)}</p>" for n in _bench_figure_notes(result))
  return (fmt.html_table(headers, body, caption="Training step per policy")
          + notes + fmt.warnings_html(result.warnings))


@to_dataframe.register(BenchResult)
def _bench_dataframe(result: BenchResult) -> Any:
  pd = require("pandas", "BenchResult.to_dataframe")
  return pd.DataFrame(result.rows())


@to_text.register(BatchSearch)
def _batch_search_text(search: BatchSearch) -> str:
  base = search.fits.get(BASELINE)
  headers = ["policy", "largest micro-batch", "vs save-everything",
             "compiled bytes", "first over budget", "compiles"]
  body = []
  for f in search.fits.values():
    over = ("cap reached" if f.hit_cap else
            f"{f.over_batch} ({fmt.format_bytes(f.over_bytes)})")
    ratio = (f"{f.batch / base.batch:.2f}x" if base and base.batch else "-")
    body.append([f.policy, str(f.batch), ratio, _bytes_or_dash(f.bytes),
                 over, str(len(f.tries))])
  lines = [fmt.text_table(headers, body, right=[h != "policy" for h in headers]),
           "", f"{search.model}; budget {fmt.format_bytes(search.budget_bytes)} "
           f"compared with the {search.figure}; search capped at "
           f"{search.max_batch}; {search.backend}; "
           f"XLA_FLAGS={search.xla_flags or '(unset)'}."]
  if search.backend == "cpu":
    from remat_toolkit._src.analysis import cpu_scheduler_setting
    lines.append("XLA:CPU scheduler: " + cpu_scheduler_setting() + ".")
  lines += [f"skipped {n}: {why}" for n, why in search.skipped.items()]
  return "\n".join(lines)


@to_html.register(BatchSearch)
def _batch_search_html(search: BatchSearch) -> str:
  return f"<pre>{_escape_html(to_text(search))}</pre>"


@to_dataframe.register(BatchSearch)
def _batch_search_dataframe(search: BatchSearch) -> Any:
  pd = require("pandas", "BatchSearch.to_dataframe")
  return pd.DataFrame(search.rows())


# ======================================================== the one plot
# (html, dataclasses and Comparison are imported in the sections above.)


@dataclasses.dataclass(frozen=True)
class PlotPoint:
  """One policy on the memory-vs-recompute chart."""

  label: str
  activation_bytes: int
  recompute_percent: float
  on_front: bool
  planned: bool = False


@functools.singledispatch
def plot_points(result: Any) -> list[PlotPoint]:
  """The points :func:`plot` draws for ``result`` (Frontier: see the
  Plan, Frontier section)."""
  raise TypeError(f"no memory-vs-recompute chart for {type(result).__name__}")


@plot_points.register
def _(comparison: Comparison) -> list[PlotPoint]:
  return [PlotPoint(r["policy"], r["activation_bytes"], r["recompute_percent"],
                    r["pareto"]) for r in comparison.rows()]


@plot_points.register
def _(frontier: Frontier) -> list[PlotPoint]:
  return [PlotPoint(p.label, p.activation_bytes, p.recompute_percent,
                    p.on_frontier, planned=p.source == "plan")
          for p in frontier.points]


def plot(result: Any, ax: Any = None) -> Any:
  """Memory kept (x, MiB) vs recompute (y, % of a no-remat step).

  Pareto-optimal points are red and joined by a step line (from each, the
  least recompute affordable until the next); plans, when present, are
  triangles. Named policies are labelled. Needs matplotlib.

  Returns:
    The matplotlib axes drawn on (a new figure's when ``ax`` is None).
  """
  require("matplotlib", "plot")
  import matplotlib.pyplot as plt
  if ax is None:
    _, ax = plt.subplots(figsize=(7, 4.5))
  points = plot_points(result)
  for planned, marker, label in ((False, "o", "named policy"),
                                 (True, "^", "plan")):
    group = [p for p in points if p.planned == planned]
    if group:
      ax.scatter([p.activation_bytes / 2**20 for p in group],
                 [p.recompute_percent for p in group], marker=marker,
                 c=["tab:red" if p.on_front else "tab:gray" for p in group],
                 label=label)
  for p in points:
    if not p.planned:
      ax.annotate(p.label, (p.activation_bytes / 2**20, p.recompute_percent),
                  fontsize=7, xytext=(3, 3), textcoords="offset points")
  front = sorted((p.activation_bytes / 2**20, p.recompute_percent)
                 for p in points if p.on_front)
  if front:
    ax.step(*zip(*front, strict=True), where="post", color="tab:red", lw=1)
  ax.set_xlabel("activation memory kept (MiB)")
  ax.set_ylabel("recompute FLOPs (% of a no-remat step)")
  ax.set_title("remat: memory vs recompute")
  if any(p.planned for p in points):
    ax.legend()
  return ax
