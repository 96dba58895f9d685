"""How long comparing every policy takes, against JAX's own saved_residuals.

The target: `rt.compare` over every built-in policy on the gpt2-xl shape
(48 layers, abstract inputs) takes at most 1.5x what JAX's own
`saved_residuals` (private: `jax._src.ad_checkpoint`, the data source of
`jax.ad_checkpoint.print_saved_residuals`) takes for ONE policy on the same
function with layers unrolled, and at most 3x under `scan`.

Each measurement runs in a fresh process so that no trace cache is shared
between the two sides; each side is measured `--repeats` times and the
median reported.

``--phases`` adds where `rt.compare`'s time goes, per layout, in one more
fresh process each: tracing the model (JAX's side pays it too), the traced
training steps (one ``jax.vjp`` of the whole step per distinct lowering of
the policies, inside JAX), the residuals' origins, and everything else.

Usage:
  python benchmarks/analyzer_speed.py [--config gpt2-xl] [--repeats 3] [--phases]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

#: The most rt.compare of every policy may take, in JAX's time for one.
TARGETS = {"unrolled": 1.5, "scan": 3.0}

_CHILD = r"""
import json, sys, time
import jax
import remat_toolkit as rt
from remat_toolkit._src.core import compat
from remat_toolkit import models
config, scan, side = sys.argv[1], sys.argv[2] == "scan", sys.argv[3]
fn, args = models.build_loss(config, scan=scan)
if side == "jax":
  def under_policy(*a):
    with rt.use_policy("boundary-only"):
      return fn(*a)
  start = time.perf_counter()
  compat.saved_residuals(under_policy, *args)  # jax's private saved_residuals
  count = 1
else:
  start = time.perf_counter()
  comparison = rt.compare(fn, *args)
  count = len(comparison.reports)
print(json.dumps({"seconds": time.perf_counter() - start, "policies": count}))
"""


_PHASES = r"""
import json, sys, time
import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit._src.analysis import residuals
from remat_toolkit._src.core import jaxpr
config, scan = sys.argv[1], sys.argv[2] == "scan"
fn, args = models.build_loss(config, scan=scan)
spent, calls = {}, {}
def timed(module, name, label):
  inner = getattr(module, name)
  def wrapper(*a, **k):
    start = time.perf_counter()
    try:
      return inner(*a, **k)
    finally:
      spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
      calls[label] = calls.get(label, 0) + 1
  setattr(module, name, wrapper)
timed(jaxpr, "trace_program", "trace the model")
timed(residuals, "trace_training_step", "traced steps (jax.vjp)")
timed(residuals, "residual_origins", "residual origins")
start = time.perf_counter()
rt.compare(fn, *args)
total = time.perf_counter() - start
spent["everything else"] = total - sum(spent.values())
print(json.dumps({"total": total, "spent": spent, "calls": calls}))
"""


def _phases(config: str, layout: str) -> dict:
  out = subprocess.run([sys.executable, "-W", "ignore", "-c", _PHASES, config,
                        layout], check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _print_phases(config: str, rows: list[dict]) -> None:
  print(f"\nwhere rt.compare's time goes ({config}, one fresh process per "
        "layout):")
  print(f"{'layout':9} {'phase':24} {'seconds':>8} {'calls':>6} "
        f"{'x JAX one policy':>17}")
  for r in rows:
    found = _phases(config, r["layout"])
    for phase, seconds in found["spent"].items():
      calls = found["calls"].get(phase)
      print(f"{r['layout']:9} {phase:24} {seconds:8.2f} "
            f"{calls if calls else '':>6} {seconds / r['jax_one_policy_s']:17.2f}")


def _measure(config: str, layout: str, side: str) -> dict:
  out = subprocess.run([sys.executable, "-c", _CHILD, config, layout, side],
                       check=True, capture_output=True, text=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="gpt2-xl")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", metavar="PATH", help="also write results here")
  parser.add_argument("--phases", action="store_true",
                      help="also say where rt.compare's time goes")
  args = parser.parse_args()
  print(describe_machine())
  print(f"config {args.config}, abstract inputs, median of {args.repeats} "
        "fresh processes each\n")
  rows = []
  for layout in ("unrolled", "scan"):
    jax_s = statistics.median(_measure(args.config, layout, "jax")["seconds"]
                              for _ in range(args.repeats))
    runs = [_measure(args.config, layout, "rt") for _ in range(args.repeats)]
    rt_s = statistics.median(r["seconds"] for r in runs)
    rows.append({"layout": layout, "jax_one_policy_s": jax_s,
                 "compare_all_s": rt_s, "policies": runs[0]["policies"],
                 "ratio": rt_s / jax_s})
  print(f"{'layout':9} {'saved_residuals, 1 policy':>26} "
        f"{'rt.compare, all policies':>25} {'ratio':>6}  target")
  for r in rows:
    target = TARGETS[r["layout"]]
    verdict = "met" if r["ratio"] <= target else "not met"
    print(f"{r['layout']:9} {r['jax_one_policy_s']:25.2f}s "
          f"{r['compare_all_s']:17.2f}s ({r['policies']:2d}) {r['ratio']:6.2f}"
          f"  <= {target:.1f}: {verdict}")
  if args.phases:
    _print_phases(args.config, rows)
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
  main()
