"""Planner quality: plans against the named policies and the exhaustive optimum.

For each built-in model (abstract shapes, nothing allocated) and 10 activation
budgets spread evenly from ``boundary-only`` to ``save-everything``, it plans
with :class:`remat_toolkit._src.planning.planner.Planner` and compares the plan's recompute
FLOPs with

* the best named (catalogue) policy that fits the same budget, and
* the exhaustive optimum: every subset of the model's checkpoint names, plus
  the whole alternatives (save-everything, save-matmuls,
  save-matmuls-no-batch), each measured with the analyzer (2**names
  evaluations, so only for the models given to ``--exhaustive``).

It also times planning one budget from scratch (building the model, tracing,
planning) on the ``--timing`` models, unrolled and scanned.

Targets: the plan's recompute is never above the best fitting named policy;
it equals the exhaustive optimum where there are at most 16 names; planning
the gpt2-xl shape takes at most 10 s on 2 cores.

Run from the repository root::

  python benchmarks/planner_quality.py
  python benchmarks/planner_quality.py --models tiny,gpt2-small --exhaustive tiny
  python benchmarks/planner_quality.py --json planner_quality.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import _machine

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit._src.core.format import format_bytes
from remat_toolkit._src.core.format import text_table
from remat_toolkit._src.planning.planner import DEFAULT_MAX_EVALUATIONS
from remat_toolkit._src.planning.planner import Planner

DEFAULT_MODELS = "tiny,tiny-swiglu,gpt2-small,gpt2-xl,llama-7b,seed-example"
WHOLE = ({"save_everything": True}, {"matmuls": "all"}, {"matmuls": "no-batch"})
EXHAUSTIVE_LIMIT = 16


def _budgets(planner: Planner, count: int) -> list[int]:
  lo, hi = planner.boundary_only_bytes, planner.save_everything_bytes
  return [lo + (hi - lo) * i // (count - 1) for i in range(count)]


def _exhaustive(planner: Planner) -> list[tuple[int, int]]:
  """(activation bytes, recompute FLOPs) of every name subset and whole mode."""
  names = planner.names
  total = 2 ** len(names)
  out = []
  start = time.perf_counter()
  for i, keep in enumerate(itertools.chain.from_iterable(
      itertools.combinations(names, k) for k in range(len(names) + 1))):
    r = planner.measure(rt.Policy(name="exhaustive", save=list(keep)))
    out.append((r.activation_bytes, r.recompute_flops))
    if i % 512 == 511:
      print(f"  exhaustive: {i + 1}/{total} subsets, "
            f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
  for mode in WHOLE:
    r = planner.measure(rt.Policy(name="exhaustive", **mode))
    out.append((r.activation_bytes, r.recompute_flops))
  return out


def _summary(policy: rt.Policy) -> str:
  if policy.save_everything:
    return "save-everything"
  if policy.matmuls != "none":
    return f"matmuls={policy.matmuls}"
  return ", ".join(policy.save) or "(region inputs only)"


def _quality(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
  fn, loss_args = models.build_loss(name, scan=True if args.scan else None)
  start = time.perf_counter()
  planner = Planner(fn, *loss_args)
  setup = time.perf_counter() - start
  print(f"{name}: {len(planner.names)} checkpoint names, set-up "
        f"{setup:.1f} s ({planner.evaluations} evaluations)", file=sys.stderr)
  rows = []
  for budget in _budgets(planner, args.budgets):
    t0 = time.perf_counter()
    p = planner.plan(budget, max_evaluations=args.max_evaluations)
    seconds = time.perf_counter() - t0
    best = p.best_builtin
    row = {
        "model": name, "budget": budget, "plan": _summary(p.policy),
        "activation_bytes": p.activation_bytes,
        "recompute_flops": p.recompute_flops,
        "recompute_percent": p.recompute_percent, "proven": p.optimal,
        "seconds": seconds,
        "best_named": best.name if best else None,
        "best_named_flops": best.recompute_flops if best else None,
        "best_named_percent": best.recompute_percent if best else None,
        "not_above_named": best is None or p.recompute_flops <= best.recompute_flops,
        "exhaustive_flops": None, "equals_exhaustive": None,
    }
    rows.append(row)
  # After planning, so that the plans' timings and proofs do not profit from
  # the exhaustive measurements (the planner caches every evaluation).
  if name in args.exhaustive:
    if len(planner.names) > EXHAUSTIVE_LIMIT:
      print(f"  exhaustive skipped: {len(planner.names)} names", file=sys.stderr)
    else:
      exhaustive = _exhaustive(planner)
      for row in rows:
        optimum = min(f for b, f in exhaustive if b <= row["budget"])
        row["exhaustive_flops"] = optimum
        row["equals_exhaustive"] = row["recompute_flops"] == optimum
  return rows


def _timing(name: str, scan: bool, count: int) -> dict[str, Any]:
  """Seconds from nothing (model built too) to a plan at the second of the
  budgets, the first where checkpoint names must be chosen."""
  fn, loss_args = models.build_loss(name, scan=scan)
  lo = rt.analyze(fn, *loss_args, policy="boundary-only").activation_bytes
  hi = rt.analyze(fn, *loss_args, policy="save-everything").activation_bytes
  budget = lo + (hi - lo) // (count - 1)
  start = time.perf_counter()
  fn, loss_args = models.build_loss(name, scan=scan)
  p = rt.plan(fn, *loss_args, budget=budget)
  seconds = time.perf_counter() - start
  return {"model": name, "layout": "scan" if scan else "unrolled",
          "budget": budget, "seconds": seconds, "evaluations": p.evaluations,
          "proven": p.optimal}


def _print_quality(rows: list[dict[str, Any]]) -> None:
  body = []
  for r in rows:
    named = (f"{r['best_named']} {r['best_named_percent']:.1f}%"
             if r["best_named"] else "-")
    exhaustive = ("-" if r["exhaustive_flops"] is None else
                  "equal" if r["equals_exhaustive"] else
                  f"ABOVE ({r['exhaustive_flops']})")
    body.append([r["model"], format_bytes(r["budget"]), r["plan"][:48],
                 format_bytes(r["activation_bytes"]),
                 f"{r['recompute_percent']:.1f}%",
                 "yes" if r["proven"] else "no", named,
                 "ok" if r["not_above_named"] else "ABOVE", exhaustive,
                 f"{r['seconds']:.1f}"])
  print(text_table(
      ["model", "budget", "plan keeps", "kept", "recompute", "proven",
       "best named that fits", "vs named", "vs exhaustive", "s"], body,
      right=[False, True, False, True, True, False, False, False, False, True]))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=DEFAULT_MODELS,
                      help=f"built-in configs (default: {DEFAULT_MODELS})")
  parser.add_argument("--budgets", type=int, default=10,
                      help="budgets per model (default: 10)")
  parser.add_argument("--exhaustive", default="tiny",
                      help="models to search exhaustively, comma-separated "
                           "(default: tiny; 2**names evaluations each)")
  parser.add_argument("--timing", default="gpt2-xl",
                      help="models to time one plan from scratch on "
                           "(default: gpt2-xl; empty for none)")
  parser.add_argument("--max-evaluations", type=int,
                      default=DEFAULT_MAX_EVALUATIONS,
                      help="per budget (default: the planner's)")
  parser.add_argument("--scan", action="store_true",
                      help="plan the scanned layout instead of the default")
  parser.add_argument("--json", metavar="PATH", help="also write the results")
  args = parser.parse_args(argv)
  args.exhaustive = {m for m in args.exhaustive.split(",") if m}
  print(_machine.describe_machine())
  print(f"planner: max_evaluations={args.max_evaluations} per budget, "
        f"{args.budgets} budgets from boundary-only to save-everything, "
        f"layout {'scan' if args.scan else 'as configured'}")
  rows = []
  for name in (m for m in args.models.split(",") if m):
    rows.extend(_quality(name, args))
  print()
  _print_quality(rows)
  timings = [_timing(name, scan, args.budgets)
             for name in args.timing.split(",") if name
             for scan in (False, True)]
  if timings:
    print()
    print(text_table(["model", "layout", "budget", "seconds", "evaluations",
                      "proven"],
                     [[t["model"], t["layout"], format_bytes(t["budget"]),
                       f"{t['seconds']:.1f}", t["evaluations"],
                       "yes" if t["proven"] else "no"] for t in timings],
                     right=[False, False, True, True, True, False]))
  checked = [r for r in rows if r["equals_exhaustive"] is not None]
  print(f"\nnever above the best fitting named policy: "
        f"{sum(r['not_above_named'] for r in rows)}/{len(rows)} budgets")
  print(f"equal to the exhaustive optimum: "
        f"{sum(r['equals_exhaustive'] for r in checked)}/{len(checked)} budgets")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"machine": _machine.machine_info(), "quality": rows,
                 "timing": timings}, f, indent=2)
  ok = all(r["not_above_named"] for r in rows) and all(
      r["equals_exhaustive"] for r in checked)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
