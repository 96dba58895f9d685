"""The ``remat-toolkit`` command line.

Each command is a pair of small functions: ``_add_<cmd>_parser(subparsers)``
declares its arguments (starting from :func:`_command_parser`, which adds the
options every command shares) and binds ``_cmd_<cmd>(args) -> int``, which
runs it and returns the exit status. A new command is one more pair, appended
to :data:`_PARSER_BUILDERS`::

  def _add_compare_parser(subparsers):
    parser = _command_parser(subparsers, "compare", summary="...")
    parser.add_argument("policies", nargs="+")
    parser.set_defaults(run=_cmd_compare)

  def _cmd_compare(args) -> int:
    ...
    return 0

A user mistake (an unknown policy name, a malformed policy file) prints one
line to stderr and exits with status 2, without a traceback.

Example:
  >>> import contextlib, io
  >>> from remat_toolkit._src import cli
  >>> with contextlib.redirect_stdout(io.StringIO()) as out:
  ...   status = cli.main(["show", "minimal"])
  >>> status, out.getvalue().splitlines()[0]
  (0, 'save-projections  (aliases: minimal)')
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from remat_toolkit._src import catalog
from remat_toolkit._src import compat as compat
from remat_toolkit._src import tags
from remat_toolkit._src.policy import Policy

__all__ = ["main", "build_parser"]

PROG = "remat-toolkit"

#: Exceptions that mean "the user asked for something wrong", not a bug.
_USER_ERRORS = (ValueError, FileNotFoundError)
_GLOB_CHARS = frozenset("*?[")
_TEXT_WIDTH = 88


# ---------------------------------------------------------------- shared

def _command_parser(subparsers: Any, name: str, *, summary: str
                    ) -> argparse.ArgumentParser:
  """A subcommand parser with the options every command shares."""
  parser = subparsers.add_parser(name, help=summary, description=summary)
  parser.add_argument(
      "--policies", action="append", default=[], metavar="PATH",
      help="also load the policies in this TOML file or folder, replacing "
           "built-ins of the same name (repeatable; the "
           f"{catalog.POLICY_PATH_ENV} variable works too)")
  return parser


def _load_user_policies(paths: Sequence[str]) -> None:
  # Same precedence as REMAT_TOOLKIT_POLICY_PATH: the user's files win.
  for path in paths:
    catalog.load_policies(path, override=True)


def _is_pattern(name: str) -> bool:
  return any(c in _GLOB_CHARS for c in name)


def _is_policy_file(name: str) -> bool:
  return name.endswith(".toml") or "/" in name or "\\" in name


def _resolve(name: str) -> tuple[Policy, str]:
  """The policy called ``name``, or read from the file ``name``; its source."""
  if _is_policy_file(name):
    path = Path(name)
    if not path.is_file():
      raise FileNotFoundError(
          f"Policy file {name!r} does not exist; give a policy name (see "
          f"`{PROG} list`) or the path of a .toml policy file.")
    return catalog.parse_policy_file(path), str(path)
  return catalog.get_policy(name), catalog.policy_source(name)


def _runs_under_remat3(policy: Policy) -> bool:
  # Some releases' remat3 replaces offloading policies by full remat.
  return not policy.offloads or compat.remat3_offloads()


def _policy_record(policy: Policy, source: str) -> dict[str, Any]:
  """Everything ``list --json`` / ``show --json`` print about one policy."""
  return {
      "name": policy.name,
      "description": policy.description,
      "aliases": list(policy.aliases),
      "save": list(policy.save),
      "offload": list(policy.offload),
      "matmuls": policy.matmuls,
      "offload_src": policy.offload_src,
      "offload_dst": policy.offload_dst,
      "save_everything": policy.save_everything,
      "keeps": _keeps_cell(policy),
      "offloads": _offloads_cell(policy),
      "lowers_to": policy.describe_lowering(),
      "runs_under_remat3": _runs_under_remat3(policy),
      "source": source,
  }


# ---------------------------------------------------------------- table

def _names_cell(names: Sequence[str]) -> str:
  """Tag names in full; MaxText equivalents and glob patterns as counts."""
  patterns = [n for n in names if _is_pattern(n)]
  maxtext = [n for n in names if n in tags.MAXTEXT_NAMES]
  shown = [n for n in names if n not in patterns and n not in maxtext]
  if not shown:  # a policy written only in MaxText names: show them.
    shown, maxtext = maxtext, []
  extras = []
  if maxtext:
    extras.append(f"{len(maxtext)} MaxText name{'s' * (len(maxtext) > 1)}")
  if patterns:
    extras.append(f"{len(patterns)} pattern{'s' * (len(patterns) > 1)}")
  text = ", ".join(shown)
  return f"{text} (+{', '.join(extras)})" if extras else text


def _keeps_cell(policy: Policy) -> str:
  if policy.save_everything:
    return "everything (no recomputation)"
  if policy.matmuls == "all":
    return "every matmul output"
  if policy.matmuls == "no-batch":
    return "matmul outputs without batch dims"
  return _names_cell(policy.save) if policy.save else "region inputs only"


def _offloads_cell(policy: Policy) -> str:
  if policy.matmuls == "offload-no-batch":
    return "matmul outputs without batch dims"
  return _names_cell(policy.offload) if policy.offload else "-"


def _render_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                  widths: Sequence[int]) -> str:
  """A fixed-width table; cells wrap in their column; rows blank-separated."""
  def line(cells: Sequence[str]) -> str:
    padded = (c.ljust(w) for c, w in zip(cells, widths, strict=True))
    return "  ".join(padded).rstrip()

  out = [line(headers), line(["-" * w for w in widths])]
  for i, row in enumerate(rows):
    wrapped = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""]
               for cell, w in zip(row, widths, strict=True)]
    if i:
      out.append("")
    for j in range(max(len(c) for c in wrapped)):
      out.append(line([c[j] if j < len(c) else "" for c in wrapped]))
  return "\n".join(out)


def _policy_table(policies: Sequence[Policy], width: int) -> str:
  # Names and aliases are never broken; long descriptions wrap instead.
  name_w = max(len(p.name) for p in policies)
  alias_w = max([len("aliases"),
                 *(len(a) for p in policies for a in p.aliases)])
  offloads_w = 20
  # keeps and trade-off share what is left of the width, 2:3.
  free = width - name_w - offloads_w - alias_w - 2 * 4
  keeps_w = max(20, free * 2 // 5)
  trade_w = max(24, free - keeps_w)
  rows = [[p.name, _keeps_cell(p), _offloads_cell(p), p.description or "-",
           ", ".join(p.aliases) or "-"] for p in policies]
  return _render_table(["name", "keeps", "offloads", "trade-off", "aliases"],
                       rows, [name_w, keeps_w, offloads_w, trade_w, alias_w])


def _terminal_width() -> int:
  # Piped output has no width; 160 keeps most descriptions to a few lines.
  return shutil.get_terminal_size(fallback=(160, 24)).columns


# ---------------------------------------------------------------- list

def _add_list_parser(subparsers: Any) -> None:
  parser = _command_parser(
      subparsers, "list",
      summary="List the policy catalogue: what each policy keeps, offloads "
              "and costs.")
  parser.add_argument("--json", action="store_true",
                      help="print a JSON array, one object per policy")
  parser.add_argument("--width", type=int, default=None, metavar="N",
                      help="table width in characters (default: the "
                           "terminal's; descriptions wrap to fit)")
  parser.set_defaults(run=_cmd_list)


def _cmd_list(args: argparse.Namespace) -> int:
  names = catalog.list_policies()
  policies = [catalog.get_policy(n) for n in names]
  if args.json:
    records = [_policy_record(p, catalog.policy_source(p.name))
               for p in policies]
    print(json.dumps(records, indent=2))
    return 0
  print(_policy_table(policies, args.width or _terminal_width()))
  print(f"\n{len(policies)} policies. `{PROG} show NAME` prints one in full. "
        "Names are case-insensitive and '-' equals '_'.")
  return 0


# ---------------------------------------------------------------- show

def _add_show_parser(subparsers: Any) -> None:
  parser = _command_parser(
      subparsers, "show",
      summary="Show one policy: its fields, the file it came from, and the "
              "JAX policy it lowers to.")
  parser.add_argument("name", help="a policy name or alias, or the path of a "
                                   ".toml policy file (to check it)")
  parser.add_argument("--json", action="store_true",
                      help="print a JSON object instead of text")
  parser.set_defaults(run=_cmd_show)


def _cmd_show(args: argparse.Namespace) -> int:
  policy, source = _resolve(args.name)
  if args.json:
    print(json.dumps(_policy_record(policy, source), indent=2))
  else:
    print(_describe(policy, source))
  return 0


def _field_lines(policy: Policy, source: str) -> list[str]:
  fields = [
      ("file", source),
      ("save", ", ".join(policy.save) or "-"),
      ("offload", ", ".join(policy.offload) or "-"),
      ("matmuls", policy.matmuls),
      ("save_everything", str(policy.save_everything).lower()),
      ("offload_src", policy.offload_src),
      ("offload_dst", policy.offload_dst),
  ]
  indent = " " * 18
  return [textwrap.fill(value, _TEXT_WIDTH, initial_indent=f"  {key:<16}",
                        subsequent_indent=indent, break_on_hyphens=False,
                        break_long_words=False)
          for key, value in fields]


def _lowering_lines(policy: Policy) -> list[str]:
  head = "Lowers to:"
  if any(_is_pattern(n) for n in policy.patterns):
    head = ("Lowers to (glob patterns expanded here against the tag "
            "vocabulary and MaxText names; at trace time, against the "
            "checkpoint names in your function):")
  out = textwrap.wrap(head, _TEXT_WIDTH)
  for text in policy.describe_lowering().splitlines():
    out.append(textwrap.fill(text, _TEXT_WIDTH, initial_indent="  ",
                             subsequent_indent="      ",
                             break_on_hyphens=False, break_long_words=False))
  return out


def _remat3_line(policy: Policy) -> str:
  if _runs_under_remat3(policy):
    text = ("jax_remat3: lowers to one of JAX's own policy constructors, so it "
            "behaves the same with jax_remat3 off and on.")
  else:
    text = (f"jax_remat3: CANNOT run under jax {jax.__version__}'s jax_remat3, "
            "which ignores offloading policies and would silently recompute "
            "everything; Policy.to_jax() raises ValueError while it is on. Use "
            "it with jax.config.update('jax_remat3', False).")
  return textwrap.fill(text, _TEXT_WIDTH)


def _describe(policy: Policy, source: str) -> str:
  head = policy.name
  if policy.aliases:
    head += f"  (aliases: {', '.join(policy.aliases)})"
  lines = [head]
  if policy.description:
    lines.append(textwrap.fill(policy.description, _TEXT_WIDTH,
                               initial_indent="  ", subsequent_indent="  "))
  lines += ["", *_field_lines(policy, source), "", *_lowering_lines(policy),
            "", _remat3_line(policy)]
  return "\n".join(lines)


# ---------------------------------------------------------------- models

_DEFAULT_ANALYSIS_MODEL = "gpt2-small"


def _add_model_options(parser: argparse.ArgumentParser, *,
                       default: str = _DEFAULT_ANALYSIS_MODEL) -> None:
  """Options that choose the model: a built-in config or ``module:function``."""
  parser.add_argument(
      "--model", default=default, metavar="CONFIG|MODULE:FUNCTION",
      help="a built-in config (tiny, gpt2-small, gpt2-xl, llama-7b, "
           "seed-example) or MODULE:FUNCTION returning (loss_fn, args) "
           f"(default: {default})")
  parser.add_argument("--batch", type=int, metavar="N", help="batch size")
  parser.add_argument("--seq", type=int, metavar="N", help="sequence length")
  parser.add_argument("--dtype", metavar="DTYPE",
                      help="activation dtype, e.g. bfloat16")
  layout = parser.add_mutually_exclusive_group()
  layout.add_argument("--scan", dest="scan", action="store_true", default=None,
                      help="apply the blocks with scan")
  layout.add_argument("--no-scan", dest="scan", action="store_false",
                      help="unroll the blocks in Python")
  parser.add_argument("--group", metavar="G",
                      help="blocks per remat region, or 'sqrt'")
  parser.add_argument("--framework", choices=("linen", "nnx"), default="linen",
                      help="built-in model implementation (default: linen)")


def _load_model(args: argparse.Namespace) -> tuple[Callable[..., Any], tuple]:
  """``(loss_fn, args)`` of the model the options name (abstract shapes)."""
  if ":" in args.model:
    return _load_user_model(args.model, _given_model_options(args))
  from remat_toolkit import models
  group = args.group
  if group is not None and group != "sqrt":
    try:
      group = int(group)
    except ValueError:
      raise ValueError(
          f"--group must be a positive integer or 'sqrt', got {group!r}.") from None
  return models.build_loss(args.model, batch=args.batch, seq=args.seq,
                           dtype=args.dtype, scan=args.scan, group=group,
                           framework=args.framework)


_MODEL_OPTIONS = ("batch", "seq", "dtype", "scan", "group")


def _given_model_options(args: argparse.Namespace) -> dict[str, Any]:
  given = {k: getattr(args, k) for k in _MODEL_OPTIONS
           if getattr(args, k, None) is not None}
  if getattr(args, "framework", "linen") != "linen":
    given["framework"] = args.framework
  return given


def _accepts(factory: Callable[..., Any], names: Sequence[str]) -> bool:
  try:
    params = inspect.signature(factory).parameters.values()
  except (TypeError, ValueError):
    return False
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return True
  keywords = {p.name for p in params
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  return set(names) <= keywords


def _load_user_model(spec: str, options: dict[str, Any] | None = None
                     ) -> tuple[Callable[..., Any], tuple]:
  """``MODULE:FUNCTION()``: the module is looked up from the current folder too.

  Model options given on the command line (``--batch``, ``--seq``, ...) are
  passed to FUNCTION as keyword arguments; a function that does not take
  them is an error rather than a silently ignored option.
  """
  import importlib
  options = options or {}
  module_name, _, attr = spec.partition(":")
  if os.getcwd() not in sys.path and "" not in sys.path:
    # As `python -m` does: a module in the folder the command runs from.
    sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(
        f"--model {spec!r}: cannot import module {module_name!r} ({e}); give "
        "MODULE:FUNCTION with the module in the current folder or on the "
        "Python path.") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise ValueError(
        f"--model {spec!r}: {module_name} has no function {attr!r}; it must "
        "return (loss_fn, args).")
  if options and not _accepts(factory, list(options)):
    flags = ", ".join(f"--{k}" for k in options)
    raise ValueError(
        f"--model {spec!r}: {flags} given, but {attr}() takes no "
        f"{', '.join(repr(k) for k in options)} argument; add "
        f"{'them' if len(options) > 1 else 'it'} as keyword arguments of "
        f"{attr}() or leave the option out.")
  result = factory(**options)
  if (not isinstance(result, tuple) or len(result) != 2
      or not callable(result[0])):
    raise ValueError(
        f"--model {spec!r}: {attr}() must return (loss_fn, args), got "
        f"{type(result).__name__}.")
  loss_fn, loss_args = result
  return loss_fn, tuple(loss_args) if isinstance(loss_args, (list, tuple)) else (loss_args,)


# ---------------------------------------------------------------- compare

def _add_compare_parser(subparsers: Any) -> None:
  parser = _command_parser(
      subparsers, "compare",
      summary="Analyse every policy on a model (abstract shapes, nothing "
              "allocated): activation bytes kept, offloaded bytes, recompute "
              "FLOPs, largest residuals; Pareto-optimal rows marked.")
  parser.add_argument("policy", nargs="*",
                      help="policies to compare (default: the whole catalogue)")
  _add_model_options(parser)
  parser.add_argument("--compile", action="store_true",
                      help="also compile jit(grad) per policy and add XLA's "
                           "memory analysis (slow)")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
  from remat_toolkit._src import analysis
  loss_fn, loss_args = _load_model(args)
  comparison = analysis.compare(loss_fn, *loss_args,
                                policies=args.policy or None,
                                compile=args.compile)
  if args.json:
    print(comparison.to_json(indent=2))
  else:
    print(_model_line(args))
    print(comparison)
  return 0


def _model_line(args: argparse.Namespace) -> str:
  parts = [f"model {args.model}"]
  for key in ("batch", "seq", "dtype", "group"):
    value = getattr(args, key)
    if value is not None:
      parts.append(f"{key} {value}")
  if args.scan is not None:
    parts.append("scan" if args.scan else "unrolled")
  return ", ".join(parts)


# ---------------------------------------------------------------- analyze

def _add_analyze_parser(subparsers: Any) -> None:
  parser = _command_parser(
      subparsers, "analyze",
      summary="What one policy keeps for the backward pass, module by module.")
  parser.add_argument("--policy", default=None,
                      help="policy name (default: the ambient default, "
                           "boundary-only)")
  _add_model_options(parser)
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
  from remat_toolkit._src import analysis
  loss_fn, loss_args = _load_model(args)
  report = analysis.analyze(loss_fn, *loss_args, policy=args.policy,
                            compile=args.compile)
  if args.json:
    print(report.to_json(indent=2))
    return 0
  print(_model_line(args))
  print("\n".join(report.summary_lines()))
  print()
  print(report.table(depth=args.depth, limit=args.limit))
  return 0


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
  # ``remat_toolkit._src.bench`` is also the function's name: import from the module.
  from remat_toolkit._src.bench import DEFAULT_MODEL
  from remat_toolkit._src.bench import DEFAULT_POLICIES
  from remat_toolkit._src.bench import DEFAULT_STEPS
  from remat_toolkit._src.bench import DEFAULT_WARMUP
  parser = _command_parser(
      subparsers, "bench",
      summary="Compile and run a training step (AdamW, jit, donated state) "
              "under each policy: compile time, step time, tokens/s and "
              "memory, relative to save-everything from the same run. "
              "--batch is the examples of one optimizer update, split into "
              "--grad-accum micro-batches.")
  parser.add_argument(
      "policy", nargs="*",
      help="policies to run (save-everything is always added as the "
           "baseline); 'all' for the whole catalogue; default: "
           f"{', '.join(DEFAULT_POLICIES)}")
  # --batch counts the examples of one optimizer update (all micro-batches).
  _add_model_options(parser, default=DEFAULT_MODEL)
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


def _bench_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
  """The model ``bench`` takes, and the build options given for it."""
  options = {"seq": args.seq, "dtype": args.dtype, "scan": args.scan,
             "group": args.group}
  if ":" in args.model:  # a user's (loss_fn, args); options would not apply
    return _load_user_model(args.model), options
  group = args.group
  if group is not None and group != "sqrt":
    try:
      options["group"] = int(group)
    except ValueError:
      raise ValueError(
          f"--group must be a positive integer or 'sqrt', got {group!r}.") from None
  return args.model, dict(options, framework=args.framework)


def _cmd_bench(args: argparse.Namespace) -> int:
  from remat_toolkit._src.bench import bench
  from remat_toolkit._src.bench import largest_batch
  policies = args.policy or None
  if policies and "all" in policies:
    policies = catalog.list_policies()
  model, options = _bench_model(args)
  common = dict(policies=policies, time_limit_s=args.time_limit,
                progress=not args.quiet, **options)
  if args.max_batch_under is not None:
    if args.batch is not None:
      raise ValueError("--batch does not apply with --max-batch-under, which "
                       "searches the batch; cap it with --max-batch-cap.")
    result = largest_batch(model, budget=args.max_batch_under,
                           max_batch=args.max_batch_cap, **common)
  else:
    result = bench(model, batch=args.batch, steps=args.steps,
                   warmup=args.warmup, grad_accum=args.grad_accum, **common)
  if args.json:
    print(result.to_json(indent=2))
  elif args.csv:
    print(result.to_csv(), end="")
  else:
    print(result)
  if args.json or args.csv:  # the records hold no warnings: say them here
    for warning in getattr(result, "warnings", ()):
      print(f"{PROG}: warning: {warning}", file=sys.stderr)
  return 0


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
  parser = _command_parser(
      subparsers, "plan",
      summary="Find the policy with the least recompute whose activations "
              "fit a memory budget (every number measured on the model, "
              "abstract shapes, nothing allocated).")
  parser.add_argument("--budget", required=True, metavar="SIZE",
                      help="device memory for the activations kept for the "
                           "backward pass, e.g. 2GiB or 1500MB")
  _add_model_options(parser)
  parser.add_argument("--group-sizes", type=_group_sizes, metavar="G[,G...]",
                      help="also weigh these remat group sizes (blocks per "
                           "region, or sqrt), e.g. 1,2,4,sqrt; the budget then "
                           "bounds kept activations plus one region's "
                           "recompute workspace")
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
                           "with --policies PATH or rt.load_policies)")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_plan)


def _plan_groups(args: argparse.Namespace) -> dict[str, Any]:
  if not args.group_sizes:
    return {}
  if ":" in args.model:
    raise ValueError(
        "--group-sizes needs a built-in --model config; for your own model "
        "call remat_toolkit.plan(..., groups=...) from Python.")
  from remat_toolkit import models
  from remat_toolkit._src.grouping import group_size
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
    return _load_model(grouped)

  return {"groups": layout, "group_sizes": sizes} if sizes else {}


def _cmd_plan(args: argparse.Namespace) -> int:
  from remat_toolkit._src import planner
  loss_fn, loss_args = _load_model(args)
  options: dict[str, Any] = dict(allow_offload=args.allow_offload,
                                 host_budget=args.host_budget)
  if args.host_bandwidth is not None:
    options["host_bandwidth"] = args.host_bandwidth
  if args.max_evaluations is not None:
    options["max_evaluations"] = args.max_evaluations
  options.update(_plan_groups(args))
  plan = planner.plan(loss_fn, *loss_args, budget=args.budget, **options)
  if args.save:
    path = plan.save(args.save)
    print(f"wrote {path}: load it with `--policies {path}` or "
          f"remat_toolkit.load_policies({str(path)!r})", file=sys.stderr)
  if args.json:
    print(plan.to_json(indent=2))
  else:
    print(_model_line(args))
    print(plan)
  return 0


# ---------------------------------------------------------------- breakdown

def _add_breakdown_parser(subparsers: Any) -> None:
  from remat_toolkit._src.breakdown import OPTIMIZERS
  parser = _command_parser(
      subparsers, "breakdown",
      summary="Where a training step's memory goes (parameters, gradients, "
              "optimizer state, activations) and whether remat can help.")
  _add_model_options(parser)
  parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                      help="count this optimizer's state (default: none)")
  parser.add_argument("--policy", default=None,
                      help="policy for the activations (default: the ambient "
                           "default, boundary-only)")
  parser.add_argument("--compile", action="store_true",
                      help="also compile jit(grad) for XLA's temporary bytes")
  parser.add_argument("--json", action="store_true", help="print JSON")
  parser.set_defaults(run=_cmd_breakdown)


def _cmd_breakdown(args: argparse.Namespace) -> int:
  from remat_toolkit._src.breakdown import memory_breakdown
  loss_fn, loss_args = _load_model(args)
  result = memory_breakdown(loss_fn, *loss_args, optimizer=args.optimizer,
                            policy=args.policy, compile=args.compile)
  if args.json:
    print(result.to_json(indent=2))
  else:
    print(_model_line(args))
    print(result)
  return 0


# ---------------------------------------------------------------- verify

def _add_verify_parser(subparsers: Any) -> None:
  parser = _command_parser(
      subparsers, "verify",
      summary="Check a policy on a model: gradients with remat equal "
              "gradients without it, the policy is not a silent no-op, and no "
              "effect or Python-side state repeats on recompute. Exit status "
              "1 when a problem is found.")
  parser.add_argument("--policy", default=None,
                      help="policy name or .toml file (default: the ambient "
                           "default, boundary-only)")
  _add_model_options(parser, default="tiny")
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
  from remat_toolkit._src.verify import verify
  policy = _resolve(args.policy)[0] if args.policy is not None else None
  loss_fn, loss_args = _load_model(args)
  result = verify(loss_fn, *loss_args, policy=policy, rtol=args.rtol,
                  atol=args.atol, check_values=not args.no_values,
                  seed=args.seed)
  if args.json:
    print(result.to_json(indent=2))
  else:
    print(_model_line(args))
    print(result)
  return 0 if result.passed else 1


# ---------------------------------------------------------------- main

#: One entry per command; each adds its subparser and binds ``run``.
_PARSER_BUILDERS: list[Callable[[Any], None]] = [
    _add_list_parser,
    _add_show_parser,
    _add_compare_parser,
    _add_analyze_parser,
    _add_bench_parser,
    _add_plan_parser,
    _add_breakdown_parser,
    _add_verify_parser,
]


def build_parser() -> argparse.ArgumentParser:
  """The argument parser with every registered command."""
  parser = argparse.ArgumentParser(
      prog=PROG,
      description="Choose, apply and inspect remat (activation "
                  "checkpointing) policies for JAX and Flax.")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
  subparsers.required = True
  for add_parser in _PARSER_BUILDERS:
    add_parser(subparsers)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command and returns its exit status.

  Args:
    argv: the arguments after the program name; default ``sys.argv[1:]``.

  Returns:
    0 on success, 2 for a usage or user error (message on stderr), 1 when
    the reader of stdout went away (``remat-toolkit list | head``).
  """
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # argparse printed the usage error or --help.
    return e.code if isinstance(e.code, int) else 2
  from remat_toolkit._src import analysis
  try:
    _load_user_policies(args.policies)
    # Every result prints its warnings with it (JSON included); raised as
    # Python warnings too, they would show twice.
    with analysis.quiet_warnings():
      return args.run(args)
  except _USER_ERRORS as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:  # `remat-toolkit list | head`: the reader left.
    # Point stdout at devnull so the interpreter's final flush cannot fail.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1
