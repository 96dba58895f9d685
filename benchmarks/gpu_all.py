"""Every accelerator figure of the documentation in one run, for whoever has a GPU.

Within about ten minutes on one GPU it runs, in order:
  0. ``peak``: ``rt.peak``'s predicted peak and XLA's figure per policy on
     the gpt2-small shape cut to 4 layers (``benchmarks/peak_accuracy.py``'s
     table), against ``memory_stats()['peak_bytes_in_use']`` after a real
     ``jax.jit(jax.grad(loss))`` step; first, while the process's
     high-water mark is still the step's own (GPU only, or ``--smoke``);
  1. ``compare``: the analyzer's table of every policy on ``gpt2-small`` and
     ``seed-example`` (bytes kept and recompute, from the traced program);
  2. ``bench``: a real training step (AdamW, jit, donated state) of
     ``gpt2-small`` in bfloat16, layers under scan, under every policy;
  3. ``largest_batch``: per policy, the largest micro-batch whose compiled
     step fits ``--budget`` (compile only);
  4. ``grad_accum``: remat against gradient accumulation on one global batch.
Each phase gets what is left of ``--time-budget``; a phase that runs out
reports the policies it skipped. The machine, the settings and every phase's
records are written to the JSON path given, after each phase, so a run cut
short keeps what it finished.

The device's allocator is left to grow on demand
(``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless set), so that
``memory_stats()['peak_bytes_in_use']`` is what the steps used.

Usage:
  python benchmarks/gpu_all.py results.json [--budget 16GiB] [--time-budget 540]
  python benchmarks/gpu_all.py smoke.json --smoke   # tiny shapes, any CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

#: Run first, so that a run cut short by its time limit has the most
#: informative policies; the rest of the catalogue follows.
PRIORITY = ("save-everything", "boundary-only", "save-projections",
            "recompute-attention-core", "save-attention", "save-ffn",
            "save-matmuls", "save-qkv")
SEARCHED = ("save-everything", "boundary-only", "save-projections",
            "recompute-attention-core")

FULL = {
    "compare_models": ("gpt2-small", "seed-example"),
    "model": "gpt2-small", "batch": 8, "seq": 1024, "dtype": "bfloat16",
    "steps": 10, "warmup": 3, "max_batch": 512,
    "accum_batch": 32, "accum": (1, 4),
}
# The same phases on shapes a laptop CPU runs in a minute or two: to check
# the script, not to report.
SMOKE = {
    "compare_models": ("tiny", "tiny-swiglu"),
    "model": "tiny", "batch": 2, "seq": 16, "dtype": "float32",
    "steps": 2, "warmup": 1, "max_batch": 64, "accum_batch": 4,
    "accum": (1, 2),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("output", help="where to write the JSON results")
  parser.add_argument("--budget", default="16GiB",
                      help="memory budget of the largest-batch search "
                           "(default: 16GiB)")
  parser.add_argument("--time-budget", type=float, default=540.0,
                      metavar="SECONDS",
                      help="seconds for all phases together (default: 540)")
  parser.add_argument("--unrolled", action="store_true",
                      help="layers in a Python loop instead of scan (much "
                           "longer compiles)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes and every phase, to check the script")
  return parser.parse_args(argv)


def ordered_policies(rt: Any, smoke: bool) -> list[str]:
  names = rt.list_policies()
  first = [p for p in PRIORITY if p in names]
  ordered = first + [p for p in names if p not in first]
  return ordered[:3] if smoke else ordered


# ---------------------------------------------------------------- phases

def phase_peak(rt: Any, settings: dict, left: float) -> dict:
  import jax
  import peak_accuracy

  from remat_toolkit import models
  device = jax.devices()[0]
  if device.platform == "cpu" and not settings["smoke"]:
    return {"skipped": "no GPU (benchmarks/peak_accuracy.py makes the CPU table)"}
  cfg = models.get_config("tiny") if settings["smoke"] else peak_accuracy.shape()
  fn, args = models.build_loss(cfg, scan=settings["scan"], abstract=False)
  policies = list(peak_accuracy.POLICIES[:3] if settings["smoke"]
                  else peak_accuracy.POLICIES)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the table lists the findings
    predicted = {p: rt.peak(fn, *args, policy=p).bytes for p in policies}
  # The high-water mark is process-wide and never falls: run the policies in
  # ascending predicted peak, and say where it did not rise.
  policies.sort(key=predicted.get)
  marks: list[int] = []

  def measured(policy: str) -> int | None:
    with rt.use_policy(policy):
      jax.block_until_ready(jax.jit(jax.grad(fn))(*args))
    mark = (device.memory_stats() or {}).get("peak_bytes_in_use")
    if mark is not None:
      marks.append(mark)
    return mark

  print(f"\n## peak: predicted, XLA's and measured, {cfg.num_layers} layers, "
        f"batch {cfg.batch_size}, seq {cfg.seq_len}, "
        f"{'scan' if settings['scan'] else 'unrolled'}\n")
  rows = peak_accuracy.measure(
      fn, args, policies, measured=measured,
      deadline=time.perf_counter() + max(30.0, 0.3 * left))
  measured_any = any(r.get("measured") for r in rows)
  peak_accuracy.print_table(rows, truth="measured" if measured_any else "xla")
  not_own = [r["policy"] for r, prev in zip(rows[1:], marks, strict=False)
             if r.get("measured") is not None and r["measured"] <= prev]
  if not_own:
    print("the high-water mark did not rise under: " + ", ".join(not_own))
  return {"config": cfg.name, "layers": cfg.num_layers, "rows": [
      dict(r, findings=[str(f) for f in r["findings"]]) for r in rows],
      "measured_not_own": not_own}


def phase_compare(rt: Any, settings: dict, left: float) -> dict:
  from remat_toolkit import models
  out = {}
  for name in settings["compare_models"]:
    loss_fn, args = models.build_loss(name)  # abstract: nothing allocated
    comparison = rt.compare(loss_fn, *args)
    print(f"\n## analyzer: {name} ({models.get_config(name).dtype})\n")
    print(comparison)
    out[name] = comparison.to_dict()
  return out


def _bench_dict(result: Any) -> dict:
  print()
  print(result)
  return {"notes": result.notes(), "skipped": dict(result.skipped),
          "records": result.rows()}


def phase_bench(rt: Any, settings: dict, left: float) -> dict:
  print(f"\n## bench: {settings['model']}, every policy\n")
  result = rt.bench(
      settings["model"], policies=ordered_policies(rt, settings["smoke"]),
      batch=settings["batch"], seq=settings["seq"], dtype=settings["dtype"],
      scan=settings["scan"], steps=settings["steps"],
      warmup=settings["warmup"], time_limit_s=max(1.0, 0.45 * left))
  return _bench_dict(result)


def phase_largest_batch(rt: Any, settings: dict, left: float) -> dict:
  print(f"\n## largest micro-batch under {settings['budget']}\n")
  search = rt.largest_batch(
      settings["model"], budget=settings["budget"], policies=list(SEARCHED),
      seq=settings["seq"], dtype=settings["dtype"], scan=settings["scan"],
      max_batch=settings["max_batch"], time_limit_s=max(1.0, 0.6 * left))
  print(search)
  return {"budget_bytes": search.budget_bytes, "figure": search.figure,
          "skipped": dict(search.skipped), "fits": search.rows()}


def phase_grad_accum(rt: Any, settings: dict, left: float) -> dict:
  print(f"\n## remat or gradient accumulation, {settings['accum_batch']} "
        "examples per update\n")
  result = rt.bench(
      settings["model"], policies=["boundary-only", "save-projections"],
      batch=settings["accum_batch"], grad_accum=list(settings["accum"]),
      seq=settings["seq"], dtype=settings["dtype"], scan=settings["scan"],
      steps=settings["steps"], warmup=settings["warmup"],
      time_limit_s=max(1.0, 0.8 * left))
  return _bench_dict(result)


#: (name, phase, seconds it needs at least to be worth starting)
PHASES: tuple[tuple[str, Callable[..., dict], float], ...] = (
    ("peak", phase_peak, 0.0),
    ("compare", phase_compare, 0.0),
    ("bench", phase_bench, 60.0),
    ("largest_batch", phase_largest_batch, 45.0),
    ("grad_accum", phase_grad_accum, 90.0),
)


# ---------------------------------------------------------------- driver

def write_json(path: str, data: dict) -> None:
  # Write then rename: a run killed mid-write keeps the previous phases.
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2, default=str)
  os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  started = time.perf_counter()
  import _machine

  import remat_toolkit as rt

  settings = dict(SMOKE if args.smoke else FULL, smoke=args.smoke,
                  budget="4MiB" if args.smoke else args.budget,
                  scan=not args.unrolled)
  print(_machine.describe_machine())
  print("command: python benchmarks/gpu_all.py " + " ".join(
      sys.argv[1:] if argv is None else argv))
  results: dict[str, Any] = {
      "machine": _machine.machine_info(),
      "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
      "settings": settings, "phases": {}}
  write_json(args.output, results)
  for name, phase, needs in PHASES:
    left = args.time_budget - (time.perf_counter() - started)
    if left < needs:
      results["phases"][name] = {"skipped": f"{left:.0f} s left, needs {needs:.0f}"}
      print(f"\n## {name}: skipped, {left:.0f} s left")
      continue
    begun = time.perf_counter()
    try:
      data = phase(rt, settings, left)
    except Exception as e:  # keep the other phases' results
      traceback.print_exc()
      data = {"error": f"{type(e).__name__}: {e}"}
    data["seconds"] = round(time.perf_counter() - begun, 1)
    results["phases"][name] = data
    write_json(args.output, results)
  total = time.perf_counter() - started
  results["seconds"] = round(total, 1)
  write_json(args.output, results)
  print(f"\nwrote {args.output} ({total:.0f} s)")
  failed = [n for n, d in results["phases"].items() if "error" in d]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
