"""How close `rt.peak`'s predicted peak is to XLA's, and whether it ranks policies as XLA does.

For the built-in GPT-2 small shape cut to 4 layers (seq 256, batch 4, bf16
activations), per table (layers unrolled or under scan; the naive,
``dot_product`` or flash attention core; linen or NNX) and per policy:

* ``predicted``: ``rt.peak(...).bytes``, the peak of one ``jax.jit(jax.grad(fn))``
  step predicted from the program, without compiling;
* ``XLA``: ``rt.peak(..., compile=True).xla_bytes``, argument + output + temp -
  alias bytes of the compiled step (``memory_analysis()``);
* ``error``: predicted / XLA - 1;
* ``kept``: the activation bytes the policy keeps (``rt.analyze``), for reference.

A table *keeps the ranking* when, for every pair of policies whose XLA
figures differ by more than 5%, the prediction orders them the same way;
the pairs that disagree are printed, and so is the same check for the kept
bytes (which ignore the transients that decide the peak).

``--hf`` measures models nobody here wrote instead: Hugging Face Flax
GPT-2, BERT and Llama (transformers, built from configs: nothing is
downloaded) with 4 layers x 256, seq 256, batch 4, bfloat16 activations,
each block made a region by ``rt.remat_modules`` (blocks found, not named).

``--optimizer adam`` (any name ``rt.peak`` takes) measures the optax train
step instead of ``jax.grad``: gradients, the update and the new parameters
and optimizer state, the parameters and state donated.

``--seconds`` adds the time to predict (``rt.peak`` without compile) and to
compile the step (``jax.jit(jax.grad(fn)).lower(...).compile()`` under the
policy). ``--speed`` times only that, on the 12-layer gpt2-small shape (batch
8, seq 1024): the target is predicting at least 3x faster than compiling.

XLA:CPU's figures are taken with its concurrency-optimized scheduler off
(``--xla_cpu_enable_concurrency_optimized_scheduler=false``, added to
``XLA_FLAGS`` here before JAX is imported): with it on, XLA:CPU's temporaries
hide the policy's effect.

Usage:
  python benchmarks/peak_accuracy.py [--layouts unrolled scan]
      [--attention naive dot_product flash] [--frameworks linen nnx]
      [--policies boundary-only save-qkv ...] [--optimizer adam] [--seconds]
  python benchmarks/peak_accuracy.py --speed [--layouts unrolled scan]
  python benchmarks/peak_accuracy.py --hf [--policies ...]
"""

from __future__ import annotations

import os

_CPU_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
# Before JAX is imported, as a script (XLA reads its flags once); imported
# (by gpu_all.py), the flags are the importer's.
if __name__ == "__main__" and _CPU_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _CPU_FLAG).strip()

import argparse  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
from _machine import describe_machine  # noqa: E402

import remat_toolkit as rt  # noqa: E402
from remat_toolkit import models  # noqa: E402

POLICIES = ("boundary-only", "save-qkv", "save-ffn", "save-attention",
            "save-matmuls", "recompute-attention-core", "save-everything")
LAYOUTS = ("unrolled", "scan")
#: Pairs of policies whose reference figures differ by at most this share
#: are not ranked: either order is right.
RANK_TOLERANCE = 0.05
MiB = 2 ** 20


def shape(layers: int = 4, seq: int = 256, batch: int = 4) -> models.GPTConfig:
  """The GPT-2 small shape, cut down (12 layers, seq 1024, batch 8 uncut)."""
  return models.get_config("gpt2-small").replace(
      num_layers=layers, seq_len=seq, batch_size=batch)


def mib(n: int | None) -> str:
  return "-" if n is None else f"{n / MiB:,.1f} MiB"


def percent(x: float | None) -> str:
  return "-" if x is None else f"{x:+.1%}"


def compile_seconds(fn: Callable, args: tuple, policy: str) -> tuple[float, int]:
  """Seconds to trace, lower and compile ``jax.jit(jax.grad(fn))`` under
  ``policy``, as a user would for XLA's figure, and that figure."""
  start = time.perf_counter()
  with rt.use_policy(policy):
    compiled = jax.jit(jax.grad(fn)).lower(*args).compile()
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  return seconds, int(m.argument_size_in_bytes + m.output_size_in_bytes
                      + m.temp_size_in_bytes - m.alias_size_in_bytes)


def measure(fn: Callable, args: tuple, policies, *, seconds: bool = False,
            measured: Callable[[str], int | None] | None = None,
            deadline: float | None = None,
            optimizer: str | None = None) -> list[dict[str, Any]]:
  """One record per policy: predicted, XLA's, kept bytes, error, findings
  (of the optax train step with ``optimizer``, else of ``jax.grad``);
  with ``seconds`` the time to predict and to compile; with ``measured``
  (policy -> bytes, e.g. a GPU's ``peak_bytes_in_use`` after a real step)
  that figure too. Policies past ``deadline`` (``time.perf_counter()``) are
  left out."""
  rows = []
  for policy in policies:
    if deadline is not None and time.perf_counter() > deadline:
      print(f"(out of time: {policy} and the policies after it left out)")
      break
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # the findings are listed from the results
      start = time.perf_counter()
      predicted = rt.peak(fn, *args, policy=policy, optimizer=optimizer)
      predict_s = time.perf_counter() - start
      p = rt.peak(fn, *args, policy=policy, optimizer=optimizer, compile=True)
      row = {"policy": policy, "predicted": p.bytes, "xla": p.xla_bytes,
             "kept": p.kept_bytes, "error": p.error, "when": p.when,
             "findings": [w for w in p.warnings
                          if getattr(w, "kind", "") != "prediction-off"]}
      assert predicted.bytes == p.bytes, (policy, predicted.bytes, p.bytes)
      if seconds:
        row["predict_s"] = predict_s
        row["compile_s"], _ = compile_seconds(fn, args, policy)
      if measured is not None:
        row["measured"] = measured(policy)
    rows.append(row)
  return rows


def disagreements(rows, truth: str, guess: str,
                  tolerance: float = RANK_TOLERANCE) -> tuple[int, list[str]]:
  """How many pairs ``truth`` ranks (figures more than ``tolerance`` apart),
  and those that ``guess`` orders otherwise (a tie counts as otherwise)."""
  ranked, wrong = 0, []
  for a, b in itertools.combinations(rows, 2):
    if a.get(truth) is None or b.get(truth) is None:
      continue
    if abs(a[truth] - b[truth]) <= tolerance * max(a[truth], b[truth]):
      continue
    ranked += 1
    lo, hi = (a, b) if a[truth] < b[truth] else (b, a)
    if not lo[guess] < hi[guess]:
      wrong.append(f"{lo['policy']} < {hi['policy']} ({truth} {mib(lo[truth])} < "
                   f"{mib(hi[truth])}; {guess} {mib(lo[guess])} vs {mib(hi[guess])})")
  return ranked, wrong


def print_table(rows, truth: str = "xla") -> None:
  """The rows as a fixed-width table; ``truth`` is the figure the error is
  taken against (``"xla"``, or ``"measured"`` on a GPU)."""
  columns = [("policy", lambda r: r["policy"]),
             ("predicted", lambda r: mib(r["predicted"])),
             ("XLA", lambda r: mib(r["xla"]))]
  if any("measured" in r for r in rows):
    columns.append(("measured", lambda r: mib(r.get("measured"))))
    columns.append(("vs measured", lambda r: percent(
        r["predicted"] / r["measured"] - 1 if r.get("measured") else None)))
  columns += [("error", lambda r: percent(r["error"])),
              ("kept", lambda r: mib(r["kept"]))]
  if any("predict_s" in r for r in rows):
    columns += [("predict s", lambda r: f"{r['predict_s']:.2f}"),
                ("compile s", lambda r: f"{r['compile_s']:.2f}")]
  columns += [("predicted peak at", lambda r: r["when"]),
              ("findings", lambda r: ", ".join(sorted({f.kind for f in r["findings"]})) or "-")]
  cells = [[get(r) for _, get in columns] for r in rows]
  widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _) in enumerate(columns)]
  left = {0, len(columns) - 2, len(columns) - 1}

  def line(values):
    return "  ".join(v.ljust(w) if i in left else v.rjust(w)
                     for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()
  print(line([name for name, _ in columns]))
  print(line(["-" * w for w in widths]))
  for c in cells:
    print(line(c))
  for f in dict.fromkeys(f for r in rows for f in r["findings"]):
    print(f"finding: {f}")
  reference, who = {"xla": ("XLA's", "XLA"),
                    "measured": ("the measured", "the measured peak")}[truth]
  for guess, what in (("predicted", "predicted peak"), ("kept", "kept bytes")):
    ranked, wrong = disagreements(rows, truth, guess)
    verdict = "keeps" if not wrong else "breaks"
    print(f"ranking by {what}: {verdict} {reference} order ({ranked - len(wrong)}/{ranked} "
          f"pairs more than {RANK_TOLERANCE:.0%} apart agree)")
    for w in wrong:
      print(f"  disagrees: {w}")
  # Closer pairs: either order is within the error, but say how often each
  # figure still gets it right.
  ranked, wrong_peak = disagreements(rows, truth, "predicted", tolerance=0.0)
  _, wrong_kept = disagreements(rows, truth, "kept", tolerance=0.0)
  print(f"pairs at any gap: the predicted peak orders {ranked - len(wrong_peak)}/{ranked} "
        f"as {who} does, the kept bytes {ranked - len(wrong_kept)}/{ranked}")


#: Hugging Face Flax models: (config class, model class, extra config).
HF_MODELS = {
    "gpt2": ("GPT2Config", "FlaxGPT2LMHeadModel",
             dict(n_layer=4, n_embd=256, n_head=4, n_positions=256)),
    "bert": ("BertConfig", "FlaxBertModel",
             dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                  intermediate_size=1024, max_position_embeddings=256)),
    "llama": ("LlamaConfig", "FlaxLlamaForCausalLM",
              dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                   num_key_value_heads=4, intermediate_size=1024,
                   max_position_embeddings=256)),
}


def hf_loss(name: str, seq: int = 256, batch: int = 4, vocab: int = 8192
            ) -> tuple[Callable, tuple]:
  """``params -> mean square of the first output`` for a Hugging Face Flax
  model whose blocks ``rt.remat_modules`` makes regions, and its abstract
  parameters."""
  import transformers  # optional: only this mode needs it

  config_name, model_name, extra = HF_MODELS[name]
  config = getattr(transformers, config_name)(vocab_size=vocab, **extra)
  model = getattr(transformers, model_name)(config, dtype=jax.numpy.bfloat16,
                                            _do_init=False)
  ids = jax.numpy.arange(batch * seq, dtype=jax.numpy.int32).reshape(
      batch, seq) % vocab
  inputs = {"input_ids": ids, "attention_mask": jax.numpy.ones_like(ids),
            "position_ids": jax.numpy.broadcast_to(jax.numpy.arange(seq), ids.shape)}
  if name == "bert":
    inputs.update(token_type_ids=jax.numpy.zeros_like(ids), head_mask=None)
  module = rt.remat_modules(model.module)
  params = jax.eval_shape(
      lambda: module.init(jax.random.key(0), **inputs))["params"]

  def loss(params):
    out = module.apply({"params": params}, **inputs)
    first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    return jax.numpy.mean(jax.numpy.square(first.astype(jax.numpy.float32)))
  return loss, (params,)


def tables(args) -> list[tuple[str, Callable[[], tuple[Callable, tuple]]]]:
  """The tables to measure: (label, build the loss and its arguments)."""
  if args.hf:
    return [(f"Hugging Face Flax {name}, unrolled, remat_modules",
             lambda name=name: hf_loss(name, args.seq, args.batch))
            for name in HF_MODELS]
  cfg = shape(args.layers, args.seq, args.batch)
  out = []
  for layout, core, framework in itertools.product(args.layouts, args.attention,
                                                   args.frameworks):
    out.append((f"{layout}, {core} attention, {framework}",
                lambda layout=layout, core=core, framework=framework:
                models.build_loss(cfg, scan=layout == "scan", attention=core,
                                  framework=framework)))
  return out


def accuracy(args) -> int:
  cfg = shape(args.layers, args.seq, args.batch)
  step = (f"the optax {args.optimizer} train step (parameters and state donated)"
          if args.optimizer else "jax.jit(jax.grad(loss))")
  if args.hf:
    print(f"config Hugging Face Flax {', '.join(HF_MODELS)}: 4 layers x 256, "
          f"batch {args.batch}, seq {args.seq}, bfloat16 activations, float32 "
          f"parameters; blocks made regions by rt.remat_modules; step: {step}; "
          f"policies: {', '.join(args.policies)}")
  else:
    print(f"config gpt2-small cut to {cfg.num_layers} layers x {cfg.d_model}, "
          f"batch {cfg.batch_size}, seq {cfg.seq_len}, {cfg.dtype} activations, "
          f"{cfg.param_dtype} parameters; step: {step}; "
          f"policies: {', '.join(args.policies)}")
  worst: tuple[float, str] | None = None
  tables_done = kept_order = kept_tables = pairs = peak_right = kept_right = 0
  predict_total = compile_total = 0.0
  for label, build in tables(args):
    print(f"\n## {label}\n")
    fn, loss_args = build()
    start = time.perf_counter()
    rows = measure(fn, loss_args, args.policies, seconds=args.seconds,
                   optimizer=args.optimizer)
    print_table(rows)
    print(f"({time.perf_counter() - start:.0f} s)")
    tables_done += 1
    kept_order += not disagreements(rows, "xla", "predicted")[1]
    kept_tables += not disagreements(rows, "xla", "kept")[1]
    n, wrong = disagreements(rows, "xla", "predicted", tolerance=0.0)
    pairs += n
    peak_right += n - len(wrong)
    kept_right += n - len(disagreements(rows, "xla", "kept", tolerance=0.0)[1])
    for r in rows:
      if r["error"] is not None and (worst is None or abs(r["error"]) > abs(worst[0])):
        worst = (r["error"], f"{r['policy']}, {label}")
      predict_total += r.get("predict_s", 0.0)
      compile_total += r.get("compile_s", 0.0)
  print()
  if args.seconds:
    print(f"time: predicting {predict_total:.1f} s, compiling {compile_total:.1f} s "
          f"({compile_total / predict_total:.1f}x)")
  print(f"worst error {percent(worst[0])} ({worst[1]}); the predicted peak keeps "
        f"XLA's ranking in {kept_order}/{tables_done} tables, the kept bytes in "
        f"{kept_tables}/{tables_done}; at any gap the predicted peak orders {peak_right}/{pairs} "
        f"pairs as XLA does, the kept bytes {kept_right}/{pairs}")
  return 0


def speed(args) -> int:
  cfg = models.get_config("gpt2-small")  # uncut: 12 layers, batch 8, seq 1024
  print(f"config gpt2-small: {cfg.num_layers} layers x {cfg.d_model}, batch "
        f"{cfg.batch_size}, seq {cfg.seq_len}, {cfg.dtype} activations; predict: "
        "rt.peak(fn, *args, policy=p); compile: jax.jit(jax.grad(fn)).lower(*args)"
        ".compile() under p; each traces the model itself")
  # One-time costs (JAX's own caches, the first compile) on a tiny model first.
  tiny_fn, tiny_args = models.build_loss("tiny")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rt.peak(tiny_fn, *tiny_args, policy="boundary-only")
  compile_seconds(tiny_fn, tiny_args, "boundary-only")
  ratios = []
  for layout in args.layouts:
    fn, loss_args = models.build_loss(cfg, scan=layout == "scan")
    print(f"\n## {layout}\n")
    print(f"{'policy':26s}  {'predict s':>9s}  {'compile s':>9s}  {'ratio':>6s}  "
          f"{'predicted':>12s}  {'XLA':>12s}  {'error':>7s}")
    predict_times, compile_times = [], []
    for policy in args.policies:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        p = rt.peak(fn, *loss_args, policy=policy)
        predict_s = time.perf_counter() - start
      compile_s, xla = compile_seconds(fn, loss_args, policy)
      predict_times.append(predict_s)
      compile_times.append(compile_s)
      print(f"{policy:26s}  {predict_s:9.2f}  {compile_s:9.2f}  "
            f"{compile_s / predict_s:5.1f}x  {mib(p.bytes):>12s}  {mib(xla):>12s}  "
            f"{percent(p.bytes / xla - 1):>7s}")
    ratio = statistics.median(compile_times) / statistics.median(predict_times)
    ratios.append(ratio)
    print(f"median: predict {statistics.median(predict_times):.2f} s, compile "
          f"{statistics.median(compile_times):.2f} s: predicting is {ratio:.1f}x "
          "faster (target >= 3x)")
  print(f"\npredicting at least 3x faster than compiling: "
        f"{'yes' if min(ratios) >= 3 else 'no'} (slowest layout {min(ratios):.1f}x)")
  return 0 if min(ratios) >= 3 else 1


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
  parser.add_argument("--attention", nargs="+", default=list(models.ATTENTION_KINDS),
                      choices=models.ATTENTION_KINDS)
  parser.add_argument("--frameworks", nargs="+", default=["linen", "nnx"],
                      choices=["linen", "nnx"])
  parser.add_argument("--policies", nargs="+", default=list(POLICIES))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seconds", action="store_true",
                      help="also time predicting against compiling, per policy")
  parser.add_argument("--hf", action="store_true",
                      help="measure Hugging Face Flax GPT-2, BERT and Llama "
                           "under rt.remat_modules instead")
  parser.add_argument("--speed", action="store_true",
                      help="only time predict against compile on the 12-layer "
                           "gpt2-small shape (batch 8, seq 1024)")
  parser.add_argument("--optimizer", default=None,
                      help="measure the optax train step of this optimizer "
                           "(e.g. adam) instead of jax.grad")
  args = parser.parse_args(argv)
  if args.optimizer and (args.seconds or args.speed):
    parser.error("--optimizer measures accuracy only: drop --seconds/--speed")
  print(describe_machine())
  print("command: python benchmarks/peak_accuracy.py " + " ".join(
      sys.argv[1:] if argv is None else argv))
  started = time.perf_counter()
  status = speed(args) if args.speed else accuracy(args)
  print(f"(whole run: {time.perf_counter() - started:.0f} s)")
  return status


if __name__ == "__main__":
  sys.exit(main())
