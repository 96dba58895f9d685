"""Which sub-block to recompute depends on the attention kernel: the ranking flip.

"Memory-efficient attention kernels avoid storing the full attention matrix,
so after using such a kernel, checkpointing the feed-forward blocks may save
more memory than checkpointing attention itself." This script shows it on the
built-in GPT-2 small shape with each attention core of the built-in models
(``naive``: the full softmax; ``dot_product``: ``jax.nn.dot_product_attention``;
``flash``: the blockwise ``custom_vjp`` kernel of ``remat_toolkit.models.flash``),
by static analysis on abstract shapes (nothing is allocated):

1. per layer, what keeping all of the attention sub-block costs against
   keeping all of the FFN: the memory that recomputing that sub-block
   frees. Counted two ways: every tensor the model tags there (``attn.*``,
   the naive core's S x S logits and probabilities included; what a name
   policy can keep), and everything JAX keeps there with no remat (the f32
   S x S logits of ``dot_product_attention``, which carry no name, included);
   with Korthikanti et al.'s 16-bit estimate beside them (attention
   ``11sbh + 5as^2b``, MLP ``19sbh``; a kernel that does not store the
   scores removes ``5as^2b``);
2. what the named policies ``save-attention`` (recompute the FFN) and
   ``save-ffn`` (recompute attention) keep and recompute, and which kernels
   run again in the backward pass;
3. the sequence length where the ranking flips, per core (Korthikanti:
   ``s = 8h/5a`` for the naive core, about 100 tokens at GPT-2 small's
   head dimension of 64).

Usage:
  python benchmarks/attention_cores.py [--config gpt2-small] [--seq 1024]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe_machine  # noqa: E402

import remat_toolkit as rt  # noqa: E402
from remat_toolkit import models  # noqa: E402

MiB = 2 ** 20
CORES = models.ATTENTION_KINDS
KEEP_ATTENTION = rt.Policy(name="keep-all-attention", save=["attn.*"],
                           description="every attention tensor the model tags")
KEEP_FFN = rt.Policy(name="keep-all-ffn", save=["ffn.*"],
                     description="every FFN tensor the model tags")
NAMED = ("save-attention", "save-ffn")
SWEEP = (16, 32, 64, 96, 128, 160, 192, 256, 1024, 4096)


def _compare(config: str, core: str, seq: int | None, layers: int | None,
             policies) -> rt.results.Comparison:
  cfg = models.get_config(config, attention=core,
                          **({"num_layers": layers} if layers else {}))
  fn, args = models.build_loss(cfg, seq=seq)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the findings are printed from the results
    return rt.compare(fn, *args, policies=policies)


def _per_layer(comparison, policy_name: str, layers: int) -> float:
  """Bytes per layer that keeping ``policy_name``'s tensors adds to boundary-only."""
  extra = (comparison.reports[policy_name].activation_bytes
           - comparison.reports["boundary-only"].activation_bytes)
  return extra / layers


def _korthikanti(cfg, seq: int, core: str) -> tuple[float, float]:
  """16-bit bytes per layer of attention and MLP activations (Korthikanti
  et al. 2022, Table 2), the attention-score term dropped for a kernel that
  does not store it."""
  s, b, h, a = seq, cfg.batch_size, cfg.d_model, cfg.num_heads
  attention = 11 * s * b * h + (5 * a * s * s * b if core == "naive" else 0)
  return attention, 19 * s * b * h


def _everything_per_layer(report, sub_block: str, layers: int) -> float:
  """Bytes per layer of what the model keeps in ``sub_block`` with no remat
  at all (every residual made under ``layers_k/<sub_block>``)."""
  kept = report.by_module(depth=2)
  return sum(b for path, b in kept.items()
             if path.split("/")[-1] == sub_block) / layers


def _sub_block_table(config: str, seq: int | None) -> None:
  cfg = models.get_config(config)
  seq = seq or cfg.seq_len
  print(f"1. Per layer, {config} ({cfg.num_layers} layers x {cfg.d_model}, "
        f"{cfg.num_heads} heads, batch {cfg.batch_size}, seq {seq}, "
        f"{cfg.dtype} activations): what keeping all of a sub-block costs,\n"
        "   i.e. what recomputing it frees: every tensor the model tags there "
        "(what a name policy can keep),\n   everything JAX keeps there with no "
        "remat, and Korthikanti's 16-bit estimate\n")
  print(f"{'':<12} {'attention (MiB per layer)':>33}   {'FFN (MiB per layer)':>33}")
  print(f"{'core':<12} {'tagged':>10} {'everything':>11} {'estimate':>10}   "
        f"{'tagged':>10} {'everything':>11} {'estimate':>10}   recompute to free the most")
  for core in CORES:
    comparison = _compare(config, core, seq, None,
                          ["boundary-only", KEEP_ATTENTION, KEEP_FFN,
                           "save-everything"])
    attention = _per_layer(comparison, KEEP_ATTENTION.name, cfg.num_layers)
    ffn = _per_layer(comparison, KEEP_FFN.name, cfg.num_layers)
    everything = comparison.reports["save-everything"]
    all_attention = _everything_per_layer(everything, "attn", cfg.num_layers)
    all_ffn = _everything_per_layer(everything, "mlp", cfg.num_layers)
    k_att, k_ffn = _korthikanti(cfg, seq, core)
    winner = "attention" if all_attention > all_ffn else "the FFN"
    print(f"{core:<12} {attention / MiB:>10.1f} {all_attention / MiB:>11.1f} "
          f"{k_att / MiB:>10.1f}   {ffn / MiB:>10.1f} {all_ffn / MiB:>11.1f} "
          f"{k_ffn / MiB:>10.1f}   {winner}")


def _named_table(config: str, seq: int | None) -> None:
  print("\n2. The named policies: save-attention keeps attention and recomputes "
        "the FFN; save-ffn the reverse\n")
  print(f"{'core':<12} {'policy':<16} {'activations':>12} {'recompute':>10}  "
        "kernels run again in the backward pass")
  for core in CORES:
    comparison = _compare(config, core, seq, None, ["boundary-only", *NAMED])
    for name in NAMED:
      report = comparison.reports[name]
      again = ", ".join(f"{kernel}: {n:g} runs"
                        for kernel, (n, _) in report.kernel_reruns().items())
      print(f"{core:<12} {name:<16} {report.activation_bytes / 2 ** 30:>8.2f} GiB "
            f"{report.recompute_percent:>9.1f}%  {again or '-'}")


def _sweep(config: str) -> None:
  cfg = models.get_config(config)
  print(f"\n3. Where the ranking flips: per layer, everything JAX keeps in attention "
        f"/ in the FFN with no remat (MiB),\n   by sequence length (2 layers of "
        f"{config}); the larger is the sub-block to recompute\n")
  print(f"{'seq':>6}  " + "  ".join(f"{core:>22}" for core in CORES))
  flips: dict[str, int] = {}
  previous: dict[str, str] = {}
  for seq in SWEEP:
    cells = []
    for core in CORES:
      everything = _compare(config, core, seq, 2, ["save-everything"]).reports[
          "save-everything"]
      attention = _everything_per_layer(everything, "attn", 2)
      ffn = _everything_per_layer(everything, "mlp", 2)
      bigger = "attn" if attention > ffn else "ffn"
      if core in previous and previous[core] != bigger and core not in flips:
        flips[core] = seq
      previous[core] = bigger
      cells.append(f"{attention / MiB:>7.1f} / {ffn / MiB:>6.1f} {bigger:>4}")
    print(f"{seq:>6}  " + "  ".join(f"{c:>22}" for c in cells))
  for core in CORES:
    where = (f"between seq {SWEEP[SWEEP.index(flips[core]) - 1]} and {flips[core]}"
             if core in flips else f"at no length from {SWEEP[0]} to {SWEEP[-1]}")
    print(f"{core}: attention outgrows the FFN {where}")
  print(f"Korthikanti (16-bit, naive core): s = 8h/5a = "
        f"{8 * cfg.d_model / (5 * cfg.num_heads):.0f} tokens")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="gpt2-small")
  parser.add_argument("--seq", type=int, default=None,
                      help="sequence length of tables 1 and 2 (default: the config's)")
  args = parser.parse_args()
  print(describe_machine())
  print()
  start = time.perf_counter()
  _sub_block_table(args.config, args.seq)
  _named_table(args.config, args.seq)
  _sweep(args.config)
  print(f"\nanalysed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
