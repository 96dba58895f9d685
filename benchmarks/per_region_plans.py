"""Per-region plans against uniform ones: the dense frontier, and its speed.

Between two named (catalogue) policies the uniform memory/recompute curve
jumps. For each gap between consecutive Pareto-optimal named policies on the
model (abstract shapes, nothing allocated), this plans at budgets a quarter,
half and three quarters of the way across it and prints, per budget:

* the best named policy that fits (what a user choosing by name gets),
* the best uniform plan (``rt.plan``: one choice of names for every region),
* the per-region plan (``rt.plan(..., per_layer=True)``), its kept bytes and
  how many distinct policies it mixes.

Every figure is the analyzer's measurement of the plan's own policy. Then it
times planning from nothing (building the model, tracing, planning one
budget; Python and the import of remat_toolkit and JAX are timed apart) in
fresh processes, per-region and uniform, on ``--timing`` (the gpt2-xl shape,
48 layers, by default): median of ``--repeats``.

Targets: the per-region plan never recomputes more than the best uniform
plan; a per-region plan of the gpt2-xl shape takes under 10 s on 2 cores.

Run from the repository root::

  python benchmarks/per_region_plans.py
  python benchmarks/per_region_plans.py --config gpt2-small --timing '' --plot frontier.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

import _machine

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.core.format import text_table
from remat_toolkit._src.core.pareto import pareto_flags
from remat_toolkit._src.planning.planner import Planner
from remat_toolkit._src.results.planning import FIELD_PREFIXES

_CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
start = time.perf_counter()
import remat_toolkit as rt
from remat_toolkit import models
imported = time.perf_counter()
config, budget, per_layer = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
fn, args = models.build_loss(config)
p = rt.plan(fn, *args, budget=budget, per_layer=per_layer)
print(json.dumps({"seconds": time.perf_counter() - imported,
                  "import_seconds": imported - start,
                  "evaluations": p.evaluations, "optimal": p.optimal,
                  "recompute_percent": p.recompute_percent}))
"""


def _named_front(planner: Planner) -> list[tuple[str, Any]]:
  """The Pareto-optimal named policies that move nothing to host memory,
  one per distinct point (our presets' names before the field's, shorter
  names first)."""
  names = sorted((n for n in rt.list_policies()
                  if not rt.get_policy(n).offloads),
                 key=lambda n: (n.startswith(FIELD_PREFIXES), len(n), n))
  named = [(n, planner.measure(n)) for n in names]
  flags = pareto_flags([(r.activation_bytes, r.recompute_flops)
                        for _, r in named])
  unique: dict[tuple[int, int], tuple[str, Any]] = {}
  for (n, r), on in zip(named, flags, strict=True):
    if on:
      unique.setdefault((r.activation_bytes, r.recompute_flops), (n, r))
  return sorted(unique.values(), key=lambda item: item[1].activation_bytes)


def _rows(config: str) -> list[dict[str, Any]]:
  fn, args = models.build_loss(config)
  planner = Planner(fn, *args)
  front = _named_front(planner)
  rows = []
  for (low, lo), (high, hi) in zip(front, front[1:], strict=False):
    for quarter in (1, 2, 3):
      budget = lo.activation_bytes + (
          hi.activation_bytes - lo.activation_bytes) * quarter // 4
      uniform = planner.plan(budget)
      per_region = planner.plan(budget, per_layer=True)
      best = uniform.best_builtin
      rows.append({
          "between": f"{low} .. {high}", "budget": budget,
          "best_named": best.name if best else None,
          "best_named_percent": best.recompute_percent if best else None,
          "uniform_percent": uniform.recompute_percent,
          "per_region_percent": per_region.recompute_percent,
          "per_region_bytes": per_region.activation_bytes,
          "policies_mixed": len({r.policy for r in per_region.regions}),
          "proven": per_region.optimal,
          "not_above_uniform": (per_region.recompute_flops
                                <= uniform.recompute_flops),
      })
  return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
  body = [[r["between"], format_bytes(r["budget"], digits=2),
           f"{r['best_named']} {r['best_named_percent']:.1f}%",
           f"{r['uniform_percent']:.1f}%", f"{r['per_region_percent']:.1f}%",
           format_bytes(r["per_region_bytes"], digits=2),
           str(r["policies_mixed"]),
           "yes" if r["proven"] else "no"] for r in rows]
  print(text_table(
      ["between named points", "budget", "best named that fits",
       "uniform plan", "per-region plan", "kept", "policies", "proven"],
      body, right=[False, True, False, True, True, True, True, False]))


def _timing(config: str, repeats: int) -> list[dict[str, Any]]:
  fn, args = models.build_loss(config)
  lo = rt.analyze(fn, *args, policy="boundary-only").activation_bytes
  hi = rt.analyze(fn, *args, policy="save-attention").activation_bytes
  budget = (lo + hi) // 2  # between two named points: names must be chosen
  out = []
  for per_layer in (True, False):
    runs = []
    for _ in range(repeats):
      done = subprocess.run(
          [sys.executable, "-c", _CHILD, config, str(budget),
           "1" if per_layer else "0"],
          check=True, capture_output=True, text=True)
      runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    out.append({"config": config, "planner": "per-region" if per_layer
                else "uniform", "budget": budget,
                "seconds": statistics.median(r["seconds"] for r in runs),
                "import_seconds": statistics.median(
                    r["import_seconds"] for r in runs),
                "evaluations": runs[0]["evaluations"],
                "recompute_percent": runs[0]["recompute_percent"]})
  return out


def _plot(config: str, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  fn, args = models.build_loss(config)
  frontier = rt.frontier(fn, *args, per_layer=True)
  ax = frontier.plot()
  top = max(p.activation_bytes for p in frontier.points
            if p.source != "named") / 2**20
  ax.set_xlim(right=top * 1.15)  # save-everything lies far to the right
  ax.set_title(f"{config}: named policies and per-region plans")
  ax.figure.savefig(path, dpi=110, bbox_inches="tight")
  print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="gpt2-small",
                      help="built-in config for the frontier (default: gpt2-small)")
  parser.add_argument("--timing", default="gpt2-xl",
                      help="config to time planning on (empty: none)")
  parser.add_argument("--repeats", type=int, default=3,
                      help="fresh processes per timing (default: 3)")
  parser.add_argument("--plot", metavar="PATH", help="also draw the frontier")
  parser.add_argument("--json", metavar="PATH", help="also write the results")
  args = parser.parse_args(argv)
  print(_machine.describe_machine())
  cfg = models.get_config(args.config)
  print(f"config {args.config}: {cfg.num_layers} layers x {cfg.d_model}, "
        f"batch {cfg.batch_size}, seq {cfg.seq_len}, {cfg.dtype} activations, "
        "one remat region per block\n")
  rows = _rows(args.config)
  _print_rows(rows)
  worse = [r for r in rows if not r["not_above_uniform"]]
  print(f"\nper-region plan never above the best uniform plan: "
        f"{'yes' if not worse else 'NO, at ' + str([r['budget'] for r in worse])}")
  timings = _timing(args.timing, args.repeats) if args.timing else []
  if timings:
    print(f"\nplanning one budget from nothing ({args.timing}, budget "
          f"{format_bytes(timings[0]['budget'])}): building the model, tracing "
          f"it and planning; median of {args.repeats} fresh processes, after "
          "importing remat_toolkit:")
    print(text_table(
        ["planner", "seconds", "evaluations", "recompute", "import (s)"],
        [[t["planner"], f"{t['seconds']:.1f}", str(t["evaluations"]),
          f"{t['recompute_percent']:.1f}%", f"{t['import_seconds']:.1f}"]
         for t in timings],
        right=[False, True, True, True, True]))
  if args.plot:
    _plot(args.config, args.plot)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"machine": _machine.machine_info(), "rows": rows,
                 "timings": timings}, f, indent=2)
  return 0 if not worse else 1


if __name__ == "__main__":
  sys.exit(main())
