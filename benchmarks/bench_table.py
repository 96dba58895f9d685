"""The bench table of docs/benchmarks.md: every built-in policy's training step on a CPU.

Runs ``rt.bench`` (AdamW, jit, donated state) on a small GPT (4 layers
under ``scan``, d_model 64, sequence 256, batch 8, float32: activations far
larger than parameters, as in real training) under every policy of the
catalogue, then prints the machine, the command and a Markdown table. Each
figure is relative to save-everything from the same run.

On XLA:CPU, what remat frees shows in the compiled memory only when the
layers run under scan: with layers unrolled, the default (concurrency-
optimised) scheduler keeps buffers alive, and even without it the AdamW
update phase sets the peak. So the layers are scanned (``--unrolled`` to
compare) and the scheduler is turned off before JAX starts (unless
``--default-scheduler``); the flags used are printed.

Usage:
  python benchmarks/bench_table.py [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SCHEDULER_OFF = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# A GPT small enough to compile 16 times in a few minutes on two cores, big
# enough that a step takes tens of milliseconds rather than microseconds.
CONFIG = dict(name="bench-small", num_layers=4, d_model=64, num_heads=4,
              d_ff=256, seq_len=256, batch_size=8, dtype="float32",
              scan_layers=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=10,
                      help="timed steps per policy (default: 10)")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed steps before them (default: 3)")
  parser.add_argument("--unrolled", action="store_true",
                      help="apply the layers in a Python loop, not scan")
  parser.add_argument("--default-scheduler", action="store_true",
                      help="keep XLA:CPU's concurrency-optimised scheduler")
  parser.add_argument("--policies", nargs="+", metavar="NAME",
                      help="policies to run (default: the whole catalogue)")
  parser.add_argument("--json", metavar="PATH",
                      help="also write the machine and the records here")
  return parser.parse_args(argv)


def set_scheduler_flag(default_scheduler: bool) -> None:
  # XLA reads XLA_FLAGS once, when the CPU backend starts: set it first.
  flags = os.environ.get("XLA_FLAGS", "")
  if not default_scheduler and SCHEDULER_OFF not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {SCHEDULER_OFF}".strip()


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  set_scheduler_flag(args.default_scheduler)
  import _machine

  import remat_toolkit as rt
  from remat_toolkit import models

  config = models.get_config("tiny").replace(**CONFIG)
  print(_machine.describe_machine())
  print("command: python benchmarks/bench_table.py " + " ".join(
      sys.argv[1:] if argv is None else argv))
  start = time.perf_counter()
  result = rt.bench(config, policies=args.policies or rt.list_policies(),
                    steps=args.steps, warmup=args.warmup,
                    scan=not args.unrolled)
  print()
  print(result.to_markdown())
  print()
  for note in result.notes():
    print(note)
  print(f"(whole run: {time.perf_counter() - start:.0f} s)")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"machine": _machine.machine_info(), "config": CONFIG,
                 "scan": not args.unrolled, "notes": result.notes(),
                 "records": result.rows()}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
