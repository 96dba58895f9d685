"""The model a ``remat-toolkit`` command measures: its options and loading.

``--model`` names a built-in config (``tiny``, ``gpt2-small``, ...) or
``MODULE:FUNCTION``, a function of the user's returning ``(loss_fn, args)``;
``--batch``, ``--seq``, ``--dtype``, ``--scan`` and ``--group`` shape it, and
``--attention`` chooses a built-in model's attention core.

Example:
  >>> import argparse
  >>> from remat_toolkit._src.cli import models as cli_models
  >>> parser = argparse.ArgumentParser()
  >>> cli_models.add_model_options(parser)
  >>> cli_models.model_line(parser.parse_args(["--model", "tiny", "--scan"]))
  'model tiny, scan'
  >>> cli_models.model_line(parser.parse_args(
  ...     ["--model", "tiny", "--attention", "flash"]))
  'model tiny, attention flash'
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from remat_toolkit import models

__all__ = ["add_model_options", "load_model", "load_user_model",
           "bench_model", "model_line"]

_DEFAULT_ANALYSIS_MODEL = "gpt2-small"
_MODEL_OPTIONS = ("batch", "seq", "dtype", "scan", "group", "attention")


def add_model_options(parser: argparse.ArgumentParser, *,
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
  parser.add_argument("--attention", choices=models.ATTENTION_KINDS,
                      help="attention core of a built-in model: naive (the "
                           "full seq x seq softmax), dot_product "
                           "(jax.nn.dot_product_attention) or flash (a "
                           "blockwise kernel keeping q, k, v, output and "
                           "log-sum-exp) (default: the config's, naive)")


def model_line(args: argparse.Namespace) -> str:
  """The line above a command's text: which model, shaped how."""
  parts = [f"model {args.model}"]
  for key in ("batch", "seq", "dtype", "group"):
    value = getattr(args, key)
    if value is not None:
      parts.append(f"{key} {value}")
  if args.scan is not None:
    parts.append("scan" if args.scan else "unrolled")
  if getattr(args, "attention", None) is not None:
    parts.append(f"attention {args.attention}")
  return ", ".join(parts)


def _parse_group(group: str | None) -> int | str | None:
  if group is None or group == "sqrt":
    return group
  try:
    return int(group)
  except ValueError:
    raise ValueError(
        f"--group must be a positive integer or 'sqrt', got {group!r}.") from None


def load_model(args: argparse.Namespace) -> tuple[Callable[..., Any], tuple]:
  """``(loss_fn, args)`` of the model the options name (abstract shapes)."""
  if ":" in args.model:
    return load_user_model(args.model, _given_model_options(args))
  return models.build_loss(args.model, batch=args.batch, seq=args.seq,
                           dtype=args.dtype, scan=args.scan,
                           group=_parse_group(args.group),
                           framework=args.framework, attention=args.attention)


def bench_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
  """The model ``bench`` takes, and the build options given for it."""
  options = {"seq": args.seq, "dtype": args.dtype, "scan": args.scan,
             "group": args.group}
  if ":" in args.model:  # a user's (loss_fn, args); options would not apply
    return load_user_model(args.model), options
  options["group"] = _parse_group(args.group)
  model: Any = args.model
  if args.attention is not None:
    model = models.get_config(args.model, attention=args.attention)
  return model, dict(options, framework=args.framework)


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


def _import_user_module(spec: str, module_name: str) -> Any:
  if os.getcwd() not in sys.path and "" not in sys.path:
    # As `python -m` does: a module in the folder the command runs from.
    sys.path.insert(0, os.getcwd())
  try:
    return importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(
        f"--model {spec!r}: cannot import module {module_name!r} ({e}); give "
        "MODULE:FUNCTION with the module in the current folder or on the "
        "Python path.") from None


def load_user_model(spec: str, options: dict[str, Any] | None = None
                    ) -> tuple[Callable[..., Any], tuple]:
  """``MODULE:FUNCTION()``: the module is looked up from the current folder too.

  Model options given on the command line (``--batch``, ``--seq``, ...) are
  passed to FUNCTION as keyword arguments; a function that does not take
  them is an error rather than a silently ignored option.
  """
  options = options or {}
  module_name, _, attr = spec.partition(":")
  module = _import_user_module(spec, module_name)
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
