"""Text, HTML and DataFrames of the analyzer's results: reports, comparisons,
breakdowns, verifications and remat summaries."""

from __future__ import annotations

import dataclasses
import html
import html as _html
from typing import Any

from remat_toolkit._src.core import format as fmt
from remat_toolkit._src.display.common import require
from remat_toolkit._src.results.analysis import Comparison
from remat_toolkit._src.results.analysis import ResidualReport
from remat_toolkit._src.results.analysis import Verification
from remat_toolkit._src.results.analysis import module_prefix
from remat_toolkit._src.results.base import summary_lines
from remat_toolkit._src.results.base import table
from remat_toolkit._src.results.base import to_dataframe
from remat_toolkit._src.results.base import to_html
from remat_toolkit._src.results.base import to_text
from remat_toolkit._src.results.breakdown import Breakdown
from remat_toolkit._src.results.regions import RematSummary
from remat_toolkit._src.transform.discovery import INDEXED as _INDEXED

# ================================================= ResidualReport, Comparison



@summary_lines.register
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
  if report.recomputed_kernels:
    lines.append("kernels whose forward runs again in the backward pass: "
                 + ", ".join(f"{k.where} ({k.runs:g}x, "
                             f"{fmt.format_flops(k.flops)})"
                             for k in report.recomputed_kernels))
  kernels = report.by_kernel()
  if kernels:
    lines.append("made by kernels: " + ", ".join(
        f"{k} {fmt.format_bytes(b)}" for k, b in kernels.items()))
  others = {k: b for k, b in report.bytes_by_kind().items()
            if k not in ("activation", "argument")}
  if others:
    lines.append("counted with the activations: " + ", ".join(
        f"{k} {fmt.format_bytes(b)}" for k, b in others.items()))
  if report.per_device_activation_bytes is not None:
    how = f"; {report.per_device_method}" if report.per_device_method else ""
    lines.append(f"per device ({report.devices} devices{how}): "
                 f"{fmt.format_bytes(report.per_device_activation_bytes)} "
                 "activations")
  if report.xla:
    lines.append("XLA: " + ", ".join(
        f"{k} {fmt.format_bytes(v) if isinstance(v, int) else v}"
        for k, v in report.xla.items()))
  lines.extend(f"warning: {w}" for w in report.warnings)
  return lines


@table.register
def residual_table(report: ResidualReport, *, depth: int | None = 2,
                   limit: int = 40) -> str:
  """Per-module, per-name table of a report's activation residuals."""
  rows: dict[tuple[str, str, str, str], list] = {}
  for r in report.activations:
    module = module_prefix(r.module_path, depth)
    row = rows.setdefault((module, r.what, r.kind, r.kernel or ""),
                          [0, 0, r.memory_kind, r.stacked])
    row[0] += 1
    row[1] += r.nbytes
  ordered = sorted(rows.items(), key=lambda kv: -kv[1][1])
  total = max(report.activation_bytes + report.offloaded_bytes, 1)
  body = [[m, w, k, n, fmt.format_bytes(b), f"{100 * b / total:.1f}%", mk,
           s if s > 1 else "", kernel]
          for (m, w, k, kernel), (n, b, mk, s) in ordered[:limit]]
  if len(ordered) > limit:
    rest = sum(v[1] for _, v in ordered[limit:])
    body.append(["...", f"{len(ordered) - limit} more", "", "",
                 fmt.format_bytes(rest), f"{100 * rest / total:.1f}%", "", "",
                 ""])
  headers = ["module", "residual", "kind", "count", "bytes", "share", "memory",
             "stacked", "kernel"]
  right = [False, False, False, True, True, True, False, True, False]
  if not any(key[3] for key in rows):  # no kernel: no column
    headers, right = headers[:-1], right[:-1]
    body = [line[:-1] for line in body]
  return fmt.text_table(headers, body, right=right)


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
  kinds = fmt.html_table(["kind", "bytes"], [
      [k, fmt.format_bytes(b)] for k, b in report.bytes_by_kind().items()],
      caption="Residual bytes by kind")
  kernels = ""
  kept, rerun = report.by_kernel(), report.kernel_reruns()
  if kept or rerun:
    kernels = fmt.html_table(["kernel", "residual bytes", "forward runs again"], [
        [name, fmt.format_bytes(kept.get(name, 0)),
         (f"{rerun[name][0]:g}x, {fmt.format_flops(rerun[name][1])}")
         if name in rerun else "no"]
        for name in dict.fromkeys([*kept, *rerun])],
        caption="Kernels")
  return (f"<div><p style='font-family:monospace'>{summary}</p>"
          f"<div style='display:flex;gap:2em'>{modules}{names}{kinds}{kernels}"
          "</div></div>")


@to_dataframe.register
def _(report: ResidualReport) -> Any:
  pd = require("pandas", "to_dataframe")
  # What each residual is (its name, else its primitive or argument path)
  # leads; columns no residual fills (no source, no sharding) are left out.
  frame = pd.DataFrame([{"what": r.what, **dataclasses.asdict(r)}
                        for r in report.residuals])
  empty = [c for c in frame.columns
           if frame[c].isna().all() or (frame[c] == "").all()]
  return frame.drop(columns=empty)


def _comparison_table(comparison: Comparison
                      ) -> tuple[list[str], list[list[str]], list[bool]]:
  """Headers, body and Pareto flags of a comparison's table."""
  headers = ["policy", "activations", "% of save-everything", "offloaded",
             "recompute", "residuals", "largest", "pareto"]
  reports = comparison.reports.values()
  has_xla = any(r.xla for r in reports)
  sharded = any(r.devices > 1 for r in reports)
  reruns = any(r.recomputed_kernels for r in reports)
  if sharded:
    headers.insert(2, "per device")
  if reruns:
    headers.insert(headers.index("residuals"), "kernels re-run")
  if has_xla:
    headers.insert(len(headers) - 1, "XLA temp")
  # Each line is built in these headers' order, its peak cells added last.
  rerun_at = headers.index("kernels re-run") if reruns else 0
  recompute_at = headers.index("recompute")
  # The step's peak beside the kept bytes: after offloaded, before recompute.
  peak_headers = (["peak", "XLA peak"] if comparison.compiled_peaks
                  else ["peak"]) if comparison.peaks is not None else []
  headers[recompute_at:recompute_at] = peak_headers
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
    if reruns:
      line.insert(rerun_at, _rerun_cell(comparison.reports[row["policy"]]))
    if has_xla:
      line.insert(len(line) - 1, fmt.format_bytes(row["xla_temp_bytes"] or 0))
    cells = [fmt.format_bytes(row["peak_bytes"])] if peak_headers else []
    if "XLA peak" in peak_headers:
      cells.append("-" if row["xla_peak_bytes"] is None
                   else fmt.format_bytes(row["xla_peak_bytes"]))
    line[recompute_at:recompute_at] = cells
    body.append(line)
    pareto.append(row["pareto"])
  return headers, body, pareto


def _rerun_cell(report: ResidualReport) -> str:
  """``mha 2x`` per kernel whose forward runs again, ``-`` for none."""
  return ", ".join(f"{n} {runs:g}x" for n, (runs, _) in
                   report.kernel_reruns().items()) or "-"


_SILENT_NOTE = "! = keeps none of its names in this model (see warnings)"
_RERUN_NOTE = ("kernels re-run = kernels whose forward runs again in the "
               "backward pass, times per step (see warnings)")


def _peak_note(comparison: Comparison) -> str:
  """What the peak columns hold (a comparison made with ``peak=True``)."""
  note = ("peak = predicted peak device bytes of one jax.grad step (rt.peak: "
          "parameters, inputs, gradients and what is live at the worst moment)")
  if comparison.compiled_peaks:
    note += ("; XLA peak = XLA's figure of the compiled step (argument + "
             "output + temp - alias)")
  return note


@to_text.register
def _(comparison: Comparison) -> str:
  headers, body, _ = _comparison_table(comparison)
  right = [h not in ("policy", "largest", "kernels re-run") for h in headers]
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
  sharded = [r for r in comparison.reports.values() if r.devices > 1]
  if sharded:
    lines.append(f"per device = what one of {sharded[0].devices} devices "
                 f"holds ({sharded[0].per_device_method})")
  for name, why in comparison.skipped.items():
    lines.append(f"skipped {name}: {why}")
  if comparison.silent_policies():
    lines.append(_SILENT_NOTE)
  if "kernels re-run" in headers:
    lines.append(_RERUN_NOTE)
  if comparison.peaks is not None:
    lines.append(_peak_note(comparison))
  lines.extend(f"warning: {w}" for w in comparison.warnings)
  return "\n".join(lines)


@to_html.register
def _(comparison: Comparison) -> str:
  headers, body, pareto = _comparison_table(comparison)
  notes = "".join(f"<p>skipped {html.escape(n)}: {html.escape(w)}</p>"
                  for n, w in comparison.skipped.items())
  if comparison.silent_policies():
    notes += f"<p>{_SILENT_NOTE}</p>"
  if "kernels re-run" in headers:
    notes += f"<p>{_RERUN_NOTE}</p>"
  if comparison.peaks is not None:
    notes += f"<p>{html.escape(_peak_note(comparison))}</p>"
  return (fmt.html_table(headers, body,
                         caption="Policies compared (bold: Pareto-optimal)",
                         highlight=pareto)
          + notes + fmt.warnings_html(comparison.warnings))


@to_dataframe.register
def _(comparison: Comparison) -> Any:
  pd = require("pandas", "to_dataframe")
  return pd.DataFrame(comparison.rows())

# ================================================================ Breakdown



def _breakdown_table(breakdown: Breakdown) -> tuple[list[str], list[list[str]]]:
  body = [[r["category"], fmt.format_bytes(r["bytes"]), f"{r['share']:.1f}%",
           r["note"]] for r in breakdown.rows()]
  body.append(["total", fmt.format_bytes(breakdown.total_bytes), "100.0%",
               "before XLA's temporaries"])
  return ["category", "bytes", "share", "note"], body


@summary_lines.register
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
  # The summary in the table's own font, the verdict as prose.
  return (f"<div>{table}<p style='font-family:monospace;font-size:inherit'>"
          f"{lines}</p><p>{fmt.prose_html(breakdown.verdict)}</p></div>")


@to_dataframe.register
def _(breakdown: Breakdown) -> Any:
  pd = require("pandas", "to_dataframe")
  return pd.DataFrame(breakdown.rows())

# ============================================================= Verification



@summary_lines.register
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
  return (f"remat_modules {_summary_verb(summary)} "
          f"{', '.join(summary.classes)} ({_summary_counts(summary)}: "
          f"{_abbreviate_regions(summary.regions)})")


def _summary_counts(summary: RematSummary) -> str:
  """``2 regions``; for a shared layer, modules and applications both:
  ``1 region module applied 2 times, so 2 regions per call``."""
  count, applied = len(summary.regions), summary.total_applications
  if applied == count:
    return f"{count} region{'' if count == 1 else 's'}"
  return (f"{count} region module{'' if count == 1 else 's'} applied "
          f"{applied} times, so {applied} regions per call")


@to_html.register
def _remat_summary_html(summary: RematSummary) -> str:
  headline = _summary_headline(summary)
  if headline is not None:
    return f"<p style='font-family:monospace'>{_html.escape(headline)}</p>"
  caption = (f"remat_modules {_summary_verb(summary)} "
             f"{', '.join(summary.classes)} in {summary.model} "
             f"({_summary_counts(summary)})")
  return fmt.html_table(("#", "region"), list(enumerate(summary.regions)),
                        caption=caption)

