"""The ``remat-toolkit`` commands that measure a model.

``compare`` and ``bench`` run several policies (``POLICY ...`` or ``--policy``
repeated); ``analyze``, ``breakdown`` and ``verify`` run one (``--policy``),
``peak`` one too (``POLICY`` or ``--policy``); ``plan`` finds one. Each
``_cmd_*`` computes its result and ends with
:func:`~remat_toolkit._src.cli.shared.emit`.

Example:
  >>> import argparse
  >>> from remat_toolkit._src.cli import commands as cli_commands
  >>> subparsers = argparse.ArgumentParser().add_subparsers()
  >>> for add_parser in cli_commands.PARSER_BUILDERS:
  ...   add_parser(subparsers)
  >>> sorted(subparsers.choices)
  ['analyze', 'bench', 'breakdown', 'compare', 'peak', 'plan', 'verify']
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from remat_toolkit import models
from remat_toolkit._src.analysis import analyze
from remat_toolkit._src.analysis.breakdown import OPTIMIZERS
from remat_toolkit._src.analysis.breakdown import memory_breakdown
from remat_toolkit._src.analysis.peak import peak
from remat_toolkit._src.analysis.verify import verify
from remat_toolkit._src.bench.batch_search import largest_batch
from remat_toolkit._src.bench.measure import DEFAULT_MODEL
from remat_toolkit._src.bench.measure import DEFAULT_POLICIES
from remat_toolkit._src.bench.measure import DEFAULT_STEPS
from remat_toolkit._src.bench.measure import DEFAULT_WARMUP
from remat_toolkit._src.bench.measure import bench
from remat_toolkit._src.cli.models import add_model_options
from remat_toolkit._src.cli.models import bench_model
from remat_toolkit._src.cli.models import load_model
from remat_toolkit._src.cli.models import model_line
from remat_toolkit._src.cli.shared import POLICY_HELP
from remat_toolkit._src.cli.shared import add_policy_argument
from remat_toolkit._src.cli.shared import add_policy_list_arguments
from remat_toolkit._src.cli.shared import chosen_policy
from remat_toolkit._src.cli.shared import command_parser
from remat_toolkit._src.cli.shared import emit
from remat_toolkit._src.cli.shared import policy_list
from remat_toolkit._src.planning import planner
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.results.bench import BatchSearch
from remat_toolkit._src.results.bench import BenchResult
from remat_toolkit._src.results.planning import ESTIMATED_PEAK
from remat_toolkit._src.results.planning import KEPT_ACTIVATIONS
from remat_toolkit._src.results.planning import PEAK
from remat_toolkit._src.transform.grouping import group_size

__all__ = ["PARSER_BUILDERS"]


# ---------------------------------------------------------------- compare

def _add_compare_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "compare",
      summary="Analyse every policy on a model (abstract shapes, nothing "
              "allocated): activation bytes kept, offloaded bytes, recompute "
              "FLOPs, largest residuals; Pareto-optimal rows marked.")
  add_policy_list_arguments(parser, default="the whole catalogue")
  add_model_options(parser)
  parser.add_argument("--compile", action="store_true",
                      help="also compile jit(grad) per policy and add XLA's "
                           "memory analysis (slow); with --peak, XLA's "
                           "figure of the step's peak too")
  parser.add_argument("--peak", action="store_true",
                      help="add the predicted peak of one jax.grad step per "
                           "policy (see `remat-toolkit peak`)")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
  policies = policy_list(args)
  loss_fn, loss_args = load_model(args)
  comparison = analyze.compare(loss_fn, *loss_args, policies=policies,
                                compile=args.compile, peak=args.peak)
  return emit(comparison, args, heading=model_line(args))


# ---------------------------------------------------------------- analyze

def _add_analyze_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "analyze",
      summary="What one policy keeps for the backward pass, module by module.")
  add_policy_argument(parser)
  add_model_options(parser)
  parser.add_argument("--depth", type=int, default=2,
                      help="module-path components per row (default: 2)")
  parser.add_argument("--limit", type=int, default=40,
                      help="rows shown (default: 40)")
  parser.add_argument("--compile", action="store_true",
                      help="add XLA's memory analysis of jit(grad)")
  parser.add_argument("--json", action="store_true",
                      help="print the report as JSON, one entry per residual")
  parser.set_defaults(run=_cmd_analyze)


def _cmd_analyze(args: argparse.Namespace) -> int:
  policy = chosen_policy(args)
  loss_fn, loss_args = load_model(args)
  report = analyze.analyze(loss_fn, *loss_args, policy=policy,
                            compile=args.compile)
  text = "\n".join([*report.summary_lines(), "",
                    report.table(depth=args.depth, limit=args.limit)])
  return emit(report, args, heading=model_line(args), text=text)


# ---------------------------------------------------------------- bench

def _int_list(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(
        f"expected positive integers separated by commas, e.g. 1,4; got {text!r}")
  return values


def _add_bench_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "bench",
      summary="Compile and run a training step (AdamW, jit, donated state) "
              "under each policy: compile time, step time, tokens/s and "
              "memory, relative to save-everything from the same run. "
              "--batch is the examples of one optimizer update, split into "
              "--grad-accum micro-batches.")
  add_policy_list_arguments(
      parser, default=f"{', '.join(DEFAULT_POLICIES)}; save-everything is "
                      "always added as the baseline")
  # --batch counts the examples of one optimizer update (all micro-batches).
  add_model_options(parser, default=DEFAULT_MODEL)
  parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                      help=f"timed steps per policy (default: {DEFAULT_STEPS})")
  parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, metavar="N",
                      help=f"untimed steps before them (default: {DEFAULT_WARMUP})")
  parser.add_argument("--grad-accum", type=_int_list, default=[1],
                      metavar="K[,K...]",
                      help="micro-batches per update; several values run each "
                           "policy at each on the same global batch")
  parser.add_argument("--max-batch-under", metavar="SIZE",
                      help="instead of running, find per policy the largest "
                           "micro-batch whose compiled step needs at most "
                           "SIZE (e.g. 2GiB); compiles only")
  parser.add_argument("--max-batch-cap", type=int, default=4096, metavar="N",
                      help="largest micro-batch tried (default: 4096)")
  parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                      help="start no further policy after this long (the "
                           "baseline always runs); the rest are reported as "
                           "skipped")
  output = parser.add_mutually_exclusive_group()
  output.add_argument("--json", action="store_true",
                      help="print a JSON list, one object per record")
  output.add_argument("--csv", action="store_true", help="print CSV")
  parser.add_argument("--quiet", action="store_true",
                      help="no progress lines on stderr")
  parser.set_defaults(run=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
  model, options = bench_model(args)
  common = dict(policies=policy_list(args),
                time_limit_s=args.time_limit, progress=not args.quiet,
                **options)
  result: BatchSearch | BenchResult
  if args.max_batch_under is not None:
    if args.batch is not None:
      raise ValueError("--batch does not apply with --max-batch-under, which "
                       "searches the batch; cap it with --max-batch-cap.")
    result = largest_batch(model, budget=args.max_batch_under,
                           max_batch=args.max_batch_cap, **common)
  else:
    result = bench(model, batch=args.batch, steps=args.steps,
                   warmup=args.warmup, grad_accum=args.grad_accum, **common)
  return emit(result, args)


# ---------------------------------------------------------------- plan

def _group_sizes(text: str) -> list[int | str]:
  sizes: list[int | str] = []
  for part in (p.strip() for p in text.split(",")):
    if part == "sqrt":
      sizes.append(part)
    elif part.isdigit() and int(part) > 0:
      sizes.append(int(part))
    else:
      raise argparse.ArgumentTypeError(
          f"expected group sizes separated by commas (positive integers or "
          f"'sqrt'), e.g. 1,2,4,sqrt; got {text!r}")
  return sizes


def _add_plan_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "plan",
      summary="Find the policy with the least recompute whose activations "
              "fit a memory budget (every number measured on the model, "
              "abstract shapes, nothing allocated).")
  parser.add_argument("--budget", required=True, metavar="SIZE",
                      help="device memory for what --bounds says (by default "
                           "the activations kept for the backward pass), "
                           "e.g. 2GiB or 1500MB")
  parser.add_argument("--bounds", choices=sorted(_BOUNDS), default=None,
                      help="what the budget bounds: kept-activations (the "
                           "default), estimated-peak (kept activations plus "
                           "one region's recompute workspace; the default with "
                           "--group-sizes) or peak (the training step's "
                           "predicted peak: parameters, gradients and "
                           "everything live at its worst moment)")
  parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                      help="with --bounds peak: bound the optax train step "
                           "with this optimizer, its state included "
                           "(default: jax.grad of the parameters)")
  parser.add_argument("--compile", action="store_true",
                      help="with --bounds peak: compile the chosen plan and "
                           "go on to the next candidate while XLA's figure "
                           "is over the budget")
  add_model_options(parser)
  parser.add_argument("--group-sizes", type=_group_sizes, metavar="G[,G...]",
                      help="also weigh these remat group sizes (blocks per "
                           "region, or sqrt), e.g. 1,2,4,sqrt; the budget then "
                           "bounds kept activations plus one region's "
                           "recompute workspace")
  parser.add_argument("--per-layer", action="store_true",
                      help="choose a policy for each remat region (an exact "
                           "per-region plan) and print the per-region table")
  parser.add_argument("--allow-offload", action="store_true",
                      help="also consider offloading tensors to host memory "
                           "(needs jax_remat3 off)")
  parser.add_argument("--host-budget", metavar="SIZE",
                      help="host memory offloading may use (default: no limit)")
  parser.add_argument("--host-bandwidth", type=float, metavar="BYTES_PER_S",
                      help="device-host bandwidth used to cost offloading "
                           "(default: 25e9)")
  parser.add_argument("--max-evaluations", type=int, metavar="N",
                      help="analyzer evaluations for repairing and proving "
                           "the plan (default: 48)")
  parser.add_argument("--save", metavar="PATH",
                      help="write the plan as a TOML policy file (load it "
                           "with --policy-file PATH or rt.load_policies)")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_plan)


def _plan_groups(args: argparse.Namespace) -> dict[str, Any]:
  if not args.group_sizes:
    return {}
  if ":" in args.model:
    raise ValueError(
        "--group-sizes needs a built-in --model config; for your own model "
        "call remat_toolkit.plan(..., groups=...) from Python.")
  config = models.get_config(args.model)
  current = args.group or config.remat_group

  def resolved(group):  # "sqrt" and 4 can be the same layout
    try:
      return group_size(int(group) if str(group).isdigit() else group,
                        config.num_layers)
    except ValueError:
      return group  # the planner reports why this size is skipped

  sizes = [g for g in args.group_sizes if resolved(g) != resolved(current)]

  def layout(group):
    grouped = argparse.Namespace(**{**vars(args), "group": str(group)})
    return load_model(grouped)

  return {"groups": layout, "group_sizes": sizes} if sizes else {}


#: --bounds, as the command line spells plan()'s ``bounds``.
_BOUNDS = {"kept-activations": KEPT_ACTIVATIONS,
           "estimated-peak": ESTIMATED_PEAK, "peak": PEAK}


def _plan_options(args: argparse.Namespace) -> dict[str, Any]:
  options: dict[str, Any] = dict(allow_offload=args.allow_offload,
                                 host_budget=args.host_budget,
                                 per_layer=args.per_layer,
                                 compile=args.compile,
                                 optimizer=args.optimizer)
  if args.bounds is not None:
    options["bounds"] = _BOUNDS[args.bounds]
  if args.host_bandwidth is not None:
    options["host_bandwidth"] = args.host_bandwidth
  if args.max_evaluations is not None:
    options["max_evaluations"] = args.max_evaluations
  options.update(_plan_groups(args))
  return options


def _cmd_plan(args: argparse.Namespace) -> int:
  loss_fn, loss_args = load_model(args)
  plan = planner.plan(loss_fn, *loss_args, budget=args.budget,
                      **_plan_options(args))
  if args.save:
    path = catalog.save_policy(plan, args.save)
    print(f"wrote {path}: load it with `--policy-file {path}` or "
          f"remat_toolkit.load_policies({str(path)!r})", file=sys.stderr)
  return emit(plan, args, heading=model_line(args))


# ---------------------------------------------------------------- breakdown

def _add_breakdown_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "breakdown",
      summary="Where a training step's memory goes (parameters, gradients, "
              "optimizer state, activations) and whether remat can help.")
  add_model_options(parser)
  parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                      help="count this optimizer's state (default: none)")
  add_policy_argument(parser)
  parser.add_argument("--compile", action="store_true",
                      help="also compile jit(grad) for XLA's temporary bytes")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_breakdown)


def _cmd_breakdown(args: argparse.Namespace) -> int:
  policy = chosen_policy(args)
  loss_fn, loss_args = load_model(args)
  result = memory_breakdown(loss_fn, *loss_args, optimizer=args.optimizer,
                            policy=policy, compile=args.compile)
  return emit(result, args, heading=model_line(args))


# ---------------------------------------------------------------- peak

def _add_peak_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "peak",
      summary="The peak device bytes of one training step under a policy, "
              "predicted from the program without compiling (what decides "
              "an out-of-memory error), and the tensors live at it.")
  parser.add_argument(
      "positional_policy", nargs="?", default=None, metavar="POLICY",
      help=f"{POLICY_HELP} (default: the ambient default, boundary-only)")
  add_policy_argument(parser)
  add_model_options(parser)
  parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                      help="measure the optax train step with this "
                           "optimizer, parameters and state donated "
                           "(default: jax.grad of the parameters)")
  parser.add_argument("--compile", action="store_true",
                      help="also compile the step for XLA's figure and the "
                           "buffers live at XLA's peak")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_peak)


def _cmd_peak(args: argparse.Namespace) -> int:
  given = [p for p in (args.positional_policy, args.policy) if p is not None]
  if len(given) == 2 and given[0] != given[1]:
    raise ValueError(
        f"peak: two policies given, {given[0]!r} and --policy {given[1]!r}; "
        "give one (peak POLICY, or compare POLICY... --peak for several).")
  policy = resolve.resolve_policy(given[0]) if given else None
  loss_fn, loss_args = load_model(args)
  result = peak(loss_fn, *loss_args, policy=policy, optimizer=args.optimizer,
                compile=args.compile)
  return emit(result, args, heading=model_line(args))


# ---------------------------------------------------------------- verify

def _add_verify_parser(subparsers: Any) -> None:
  parser = command_parser(
      subparsers, "verify",
      summary="Check a policy on a model: gradients with remat equal "
              "gradients without it, the policy is not a silent no-op, and no "
              "effect or Python-side state repeats on recompute. Exit status "
              "1 when a problem is found.")
  add_policy_argument(parser)
  add_model_options(parser, default="tiny")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the random parameters and inputs "
                           "(default: 0)")
  parser.add_argument("--rtol", type=float, default=None,
                      help="relative tolerance (default: by dtype, 1e-5 for "
                           "float32, 1e-2 for bfloat16)")
  parser.add_argument("--atol", type=float, default=None,
                      help="absolute tolerance (default: 0)")
  parser.add_argument("--no-values", action="store_true",
                      help="skip the gradient check (residuals and effects "
                           "only; nothing is compiled)")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
  policy = chosen_policy(args)
  loss_fn, loss_args = load_model(args)
  result = verify(loss_fn, *loss_args, policy=policy, rtol=args.rtol,
                  atol=args.atol, check_values=not args.no_values,
                  seed=args.seed)
  return emit(result, args, heading=model_line(args),
              status=0 if result.passed else 1)


#: One entry per command; each adds its subparser and binds ``run``.
PARSER_BUILDERS: list[Callable[[Any], None]] = [
    _add_compare_parser,
    _add_analyze_parser,
    _add_bench_parser,
    _add_plan_parser,
    _add_breakdown_parser,
    _add_peak_parser,
    _add_verify_parser,
]
