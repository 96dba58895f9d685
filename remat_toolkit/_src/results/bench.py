"""What ``rt.bench`` and ``rt.largest_batch`` return: training steps, measured.

Data only; :mod:`remat_toolkit._src.display` renders it. The measurements
themselves are in :mod:`remat_toolkit._src.bench`.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Mapping
from typing import Any

from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.results import base as render
from remat_toolkit._src.results.base import Result

__all__ = ["BenchRecord", "BenchResult", "BatchFit", "BatchSearch"]


@dataclasses.dataclass(frozen=True)
class BenchRecord:
  """One policy's training step, measured.

  Attributes:
    policy: the policy's name.
    grad_accum: micro-batches per optimizer update.
    micro_batch: examples per forward/backward pass.
    global_batch: examples per optimizer update.
    tokens_per_step: tokens per optimizer update.
    compile_time_s: lowering plus XLA compilation, seconds.
    step_time_s: median step time after warm-up, seconds.
    step_time_min_s: fastest timed step.
    step_time_max_s: slowest timed step.
    tokens_per_s: ``tokens_per_step / step_time_s``.
    peak_bytes: the compiled step's memory, arguments + outputs + temporaries
      - donated buffers (XLA ``memory_analysis``); the per-policy figure.
    argument_bytes: parameters, optimizer state and batch.
    output_bytes: the new state and the loss.
    temp_bytes: XLA temporaries, activations kept for backward among them.
    alias_bytes: outputs written in place of donated arguments.
    host_temp_bytes: temporaries in host memory (offloading policies).
    device_peak_bytes: ``memory_stats()['peak_bytes_in_use']`` after the run
      (process-wide; None on CPU).
    device_reserved_bytes: reserved device bytes after the run (peak if the
      backend reports it; None on CPU).
    host_peak_rss_bytes: the process's peak resident set size after the run.
    measured_peak_is_own: the process-wide high-water mark (device if
      reported, else host RSS) rose during this record's run.
    loss_first: loss of the first step.
    loss_last: loss of the last step.
    run_order: 1 for the policy run first.
    relative_step_time: ``step_time_s`` over the baseline's.
    relative_tokens_per_s: ``tokens_per_s`` over the baseline's.
    relative_peak_bytes: ``peak_bytes`` over the baseline's.
    relative_compile_time: ``compile_time_s`` over the baseline's.
    relative_device_peak_bytes: ``device_peak_bytes`` over the baseline's.
    is_baseline: this is the record the others are relative to.
  """

  policy: str
  grad_accum: int
  micro_batch: int
  global_batch: int
  tokens_per_step: int
  compile_time_s: float
  step_time_s: float
  step_time_min_s: float
  step_time_max_s: float
  tokens_per_s: float
  peak_bytes: int
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  host_temp_bytes: int
  device_peak_bytes: int | None
  device_reserved_bytes: int | None
  host_peak_rss_bytes: int | None
  measured_peak_is_own: bool
  loss_first: float
  loss_last: float
  run_order: int
  relative_step_time: float | None = None
  relative_tokens_per_s: float | None = None
  relative_peak_bytes: float | None = None
  relative_compile_time: float | None = None
  relative_device_peak_bytes: float | None = None
  is_baseline: bool = False

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BenchResult(Result):
  """Every policy's measured training step, from one run.

  Attributes:
    records: one per (policy, grad_accum), in the order asked for; the
      baseline (``save-everything`` at the first ``grad_accum``) first.
    model: what was trained.
    steps: timed steps per policy.
    warmup: untimed steps before them.
    backend: JAX's default backend (``cpu``, ``gpu``, ``tpu``).
    device_kind: the device that ran the steps.
    xla_flags: the ``XLA_FLAGS`` environment variable during the run.
    jax_remat3: whether JAX's remat3 implementation was on.
    skipped: policy name -> why it did not run.
    load_average: the host's 1-minute load average after the run, if known
      (above the core count, CPU step times are noisy).
    warnings: why some policies' figures may not be their own: no remat
      region reads the ambient policy, regions with their own policy, or a
      policy that keeps none of its names in this model.
  """

  records: tuple[BenchRecord, ...]
  model: str
  steps: int
  warmup: int
  backend: str
  device_kind: str
  xla_flags: str
  jax_remat3: bool
  skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)
  load_average: float | None = None
  warnings: tuple[Finding, ...] = ()

  @property
  def baseline(self) -> BenchRecord:
    return next(r for r in self.records if r.is_baseline)

  def record(self, policy: str, grad_accum: int | None = None) -> BenchRecord:
    """The record of ``policy`` (at ``grad_accum``, default the first run).

    Raises:
      KeyError: if that policy did not run.
    """
    name = resolve.resolve_policy(policy).name
    for r in self.records:
      if r.policy == name and grad_accum in (None, r.grad_accum):
        return r
    raise KeyError(f"No record for policy {name!r}"
                   + (f" at grad_accum={grad_accum}" if grad_accum else "")
                   + f"; ran {sorted({r.policy for r in self.records})}.")

  def rows(self) -> list[dict[str, Any]]:
    """One dict per record (the JSON and CSV data)."""
    return [r.to_dict() for r in self.records]

  def to_dict(self) -> dict[str, Any]:
    """The records with what the run was, what it skipped and its warnings."""
    return {"model": self.model, "records": self.rows(),
            "skipped": dict(self.skipped), "warnings": list(self.warnings)}

  def to_csv(self) -> str:
    """The records as CSV, one line per record after a header."""
    out = io.StringIO()
    fields = [f.name for f in dataclasses.fields(BenchRecord)]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(self.rows())
    return out.getvalue()

  def notes(self) -> list[str]:
    """What the figures mean and how they were taken, then the warnings."""
    return render.summary_lines(self)

  def to_markdown(self) -> str:
    """The table as Markdown (for a README), without the notes."""
    return render.table(self)


@dataclasses.dataclass(frozen=True)
class BatchFit:
  """The largest micro-batch of one policy under a memory budget.

  Attributes:
    policy: the policy's name.
    batch: the largest micro-batch that fits (0 if even 1 does not).
    bytes: the compared figure at ``batch`` (None if ``batch`` is 0).
    over_batch: the smallest size tried that did not fit (None if the cap
      was reached first).
    over_bytes: the compared figure at ``over_batch``.
    hit_cap: the search stopped at ``max_batch`` with it still fitting.
    tries: every ``(micro-batch, bytes)`` compiled, in order.
  """

  policy: str
  batch: int
  bytes: int | None
  over_batch: int | None
  over_bytes: int | None
  hit_cap: bool
  tries: tuple[tuple[int, int], ...]

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["tries"] = [list(t) for t in self.tries]
    return out


@dataclasses.dataclass(frozen=True)
class BatchSearch(Result):
  """Per policy, the largest micro-batch whose compiled step fits a budget.

  Attributes:
    fits: policy name -> :class:`BatchFit`, in the order asked for.
    budget_bytes: the memory budget.
    figure: what was compared with the budget.
    model: what was compiled.
    backend: JAX's default backend.
    xla_flags: the ``XLA_FLAGS`` environment variable.
    max_batch: the search's cap.
    skipped: policy name -> why it was not searched.
  """

  fits: Mapping[str, BatchFit]
  budget_bytes: int
  figure: str
  model: str
  backend: str
  xla_flags: str
  max_batch: int
  skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def rows(self) -> list[dict[str, Any]]:
    """One dict per policy's fit (the table, JSON and CSV data)."""
    return [f.to_dict() for f in self.fits.values()]

  def to_dict(self) -> dict[str, Any]:
    """The fits with the budget, the model and what was skipped."""
    return {"budget_bytes": self.budget_bytes, "figure": self.figure,
            "model": self.model, "backend": self.backend,
            "xla_flags": self.xla_flags, "max_batch": self.max_batch,
            "fits": self.rows(), "skipped": dict(self.skipped)}

  def to_csv(self) -> str:
    out = io.StringIO()
    fields = [f.name for f in dataclasses.fields(BatchFit) if f.name != "tries"]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n",
                            extrasaction="ignore")
    writer.writeheader()
    writer.writerows(self.rows())
    return out.getvalue()
