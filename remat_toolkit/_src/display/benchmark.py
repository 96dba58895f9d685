"""Text, HTML, Markdown and DataFrames of benchmarks and batch searches."""

from __future__ import annotations

import os
from html import escape as _escape_html
from typing import Any

from remat_toolkit._src.analysis.trace import cpu_scheduler_setting
from remat_toolkit._src.bench.measure import BASELINE
from remat_toolkit._src.bench.train_step import MEMORY_FIGURE
from remat_toolkit._src.core import format as fmt
from remat_toolkit._src.display.common import require
from remat_toolkit._src.results.base import summary_lines
from remat_toolkit._src.results.base import table
from remat_toolkit._src.results.base import to_dataframe
from remat_toolkit._src.results.base import to_html
from remat_toolkit._src.results.base import to_text
from remat_toolkit._src.results.bench import BatchSearch
from remat_toolkit._src.results.bench import BenchResult

# ==================================================== BenchResult, BatchSearch



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


@summary_lines.register
def bench_notes(result: BenchResult) -> list[str]:
  """What a benchmark's figures mean and how they were taken, then its warnings."""
  return _bench_figure_notes(result) + [f"warning: {w}" for w in result.warnings]


@table.register
def bench_markdown(result: BenchResult) -> str:
  """A benchmark's table as Markdown (for a README), without the notes: the
  one table form a benchmark has besides its text."""
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
            f"{f.over_batch} ({_bytes_or_dash(f.over_bytes)})")
    ratio = (f"{f.batch / base.batch:.2f}x" if base and base.batch else "-")
    body.append([f.policy, str(f.batch), ratio, _bytes_or_dash(f.bytes),
                 over, str(len(f.tries))])
  lines = [fmt.text_table(headers, body, right=[h != "policy" for h in headers]),
           "", f"{search.model}; budget {fmt.format_bytes(search.budget_bytes)} "
           f"compared with the {search.figure}; search capped at "
           f"{search.max_batch}; {search.backend}; "
           f"XLA_FLAGS={search.xla_flags or '(unset)'}."]
  if search.backend == "cpu":
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


