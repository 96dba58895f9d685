"""The memory/recompute table of every built-in policy on a built-in model.

Static analysis on abstract shapes: nothing is allocated, so the largest
configs run on a laptop. With --markdown, the catalogue's table in
docs/concepts/policies.md (the README's is readme_compare.py's).

Usage:
  python benchmarks/policy_table.py [--config gpt2-small] [--group 1] [--scan]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

import remat_toolkit as rt  # noqa: E402
from remat_toolkit import models  # noqa: E402


def _markdown(comparison) -> str:
  """The catalogue as a markdown table, with the measured columns."""
  from remat_toolkit._src.core.format import format_bytes
  lines = ["| policy | keeps on device | offloads to host | aliases "
           "| activations | offloaded | recompute |",
           "|---|---|---|---|---:|---:|---:|"]
  for row in comparison.rows():
    policy = rt.get_policy(row["policy"])
    vocab = [n for n in policy.save if n in rt.names.VOCABULARY]
    keeps = ", ".join(vocab) if vocab else policy.keeps_summary()
    off = [n for n in policy.offload if n in rt.names.VOCABULARY]
    offloads = ", ".join(off) if off else policy.offloads_summary()
    aliases = ", ".join(f"`{a}`" for a in policy.aliases) or "-"
    lines.append(
        f"| `{policy.name}` | {keeps} | {offloads} | {aliases} "
        f"| {format_bytes(row['activation_bytes'])} "
        f"| {format_bytes(row['offloaded_bytes']) if row['offloaded_bytes'] else '-'} "
        f"| {row['recompute_percent']:.1f}% |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="gpt2-small")
  parser.add_argument("--group", default=None)
  parser.add_argument("--scan", action="store_true")
  parser.add_argument("--policies", nargs="*", default=None)
  parser.add_argument("--markdown", action="store_true",
                      help="print the catalogue table of docs/concepts/policies.md instead")
  args = parser.parse_args()
  group = args.group if args.group in (None, "sqrt") else int(args.group)
  print(describe_machine())
  fn, loss_args = models.build_loss(args.config, group=group,
                                    scan=args.scan or None)
  cfg = models.get_config(args.config)
  print(f"config {args.config}: {cfg.num_layers} layers x {cfg.d_model}, "
        f"batch {cfg.batch_size}, seq {cfg.seq_len}, {cfg.dtype} activations, "
        f"remat group {group or cfg.remat_group}, "
        f"{'scan' if args.scan else 'unrolled'}\n")
  start = time.perf_counter()
  comparison = rt.compare(fn, *loss_args, policies=args.policies)
  print(_markdown(comparison) if args.markdown else comparison)
  print(f"\nanalysed {len(comparison.reports)} policies in "
        f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
