"""Finding a model's repeated blocks, and what :func:`remat_modules` chose.

Without rules, :func:`remat_toolkit.remat_modules` makes a remat region of
every block of the outermost stacks of a model's module tree
(:func:`find_blocks`); :class:`RematSummary` records the regions it made,
for :func:`remat_toolkit.remat_summary`.

Example:
  >>> from remat_toolkit._src.transform import discovery
  >>> modules = {(): "Model", ("h", "0"): "Block", ("h", "0", "mlp"): "Dense",
  ...            ("h", "1"): "Block", ("h", "1", "mlp"): "Dense"}
  >>> discovery.find_blocks(modules)
  [('h', '0'), ('h', '1')]
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping

from remat_toolkit._src.results.regions import RematSummary

__all__ = ["find_blocks", "likely_block", "report_no_blocks", "summarize",
           "Flow", "INDEXED", "Path"]

# A module name ending in an index: HF's ``h/0``, Flax's auto-names
# ``Block_1``, user names ``layers_3`` or ``block2``.
INDEXED = re.compile(r"(.*?)_?(\d+)")

Path = tuple[str, ...]


@dataclasses.dataclass
class Flow:
  """How a model's modules ran in one trace (linen), for :func:`find_blocks`.

  Attributes:
    calls: how many times each module's ``__call__`` ran.
    fed_by: for each module, the modules whose output was its first input.
    returns: for each module that returned another module's output (a
      container returning its last layer's), that module.
  """

  calls: dict[Path, int] = dataclasses.field(default_factory=dict)
  fed_by: dict[Path, set[Path]] = dataclasses.field(default_factory=dict)
  returns: dict[Path, Path] = dataclasses.field(default_factory=dict)


def _stacks(modules: Mapping[Path, str], composite: set[Path],
            callable_paths: set[Path] | None) -> list[list[Path]]:
  """Runs of two or more indexed siblings with submodules, shallowest first."""
  stacks: dict[tuple[Path, str], dict[int, Path]] = {}
  for path in modules:
    if not path or path not in composite:
      continue
    if callable_paths is not None and path not in callable_paths:
      continue
    match = INDEXED.fullmatch(path[-1])
    if match:
      stacks.setdefault((path[:-1], match.group(1)), {})[
          int(match.group(2))] = path
  runs = []
  for _, members in sorted(stacks.items(), key=lambda item: len(item[0][0])):
    indices = sorted(members)
    if len(indices) >= 2 and indices[-1] - indices[0] == len(indices) - 1:
      runs.append([members[i] for i in indices])
  return runs


def _inside(path: Path, block: Path) -> bool:
  return path[:len(block)] == block


def _outermost(runs: list[list[Path]]) -> list[list[Path]]:
  """The runs not nested in a member of an earlier (shallower) one."""
  chosen: list[list[Path]] = []
  for run in runs:
    if not any(_inside(run[0], block) for kept in chosen for block in kept):
      chosen.append(run)
  return chosen


def _chained(run: list[Path], flow: Flow) -> bool:
  """Each member's input is the previous member's output."""
  return all(before in flow.fed_by.get(after, ()) for before, after
             in zip(run, run[1:], strict=False))


def _layers_of_stage(member: Path, modules: Mapping[Path, str],
                     composite: set[Path], runs: list[list[Path]],
                     flow: Flow) -> list[list[Path]] | None:
  """The stacks a stage is made of, or None when ``member`` is a block.

  A stage (a ResNet stage of residual layers) holds nothing with submodules
  besides stacks of one class of layer, each feeding the next, and their
  containers, and returns the last layer's output: the layers repeat along
  the depth. A block holding other parts (attention beside its experts), a
  stack applied side by side (experts) or of different sub-layers (T5's
  ``layer/0``, ``layer/1``), or adding a residual to its layers' output
  (ResNet's layer of convolutions) is the block.
  """
  inner = _outermost([run for run in runs if run[0] != member
                      and _inside(run[0], member)])
  if not inner or any(len({modules[p] for p in run}) > 1
                      or not _chained(run, flow) for run in inner):
    return None
  if flow.returns.get(member) != inner[-1][-1]:
    return None
  members = [p for run in inner for p in run]
  for path in composite:
    if (_inside(path, member) and path != member
        and not any(_inside(path, m) or _inside(m, path) for m in members)):
      return None
  return inner


def _depth_runs(run: list[Path], modules: Mapping[Path, str],
                composite: set[Path], runs: list[list[Path]],
                flow: Flow) -> list[list[Path]]:
  """``run``, or the layers of its members when they are all stages."""
  stages = [_layers_of_stage(m, modules, composite, runs, flow)
            for m in run]
  known = [inner for inner in stages if inner is not None]
  if len(known) < len(stages):  # a member that is no stage
    return [run]
  return [deeper for inner in known for layers in inner
          for deeper in _depth_runs(layers, modules, composite, runs, flow)]


def _is_conv_stack(run: list[Path], modules: Mapping[Path, str]) -> bool:
  """Every member computes with convolutions and no dense layer."""
  def kinds(member: Path) -> set[str]:
    leaves = {modules[p].lower() for p in modules
              if _inside(p, member) and p != member}
    return {kind for kind in ("conv", "dense", "einsum", "attention")
            if any(kind in leaf for leaf in leaves)}
  return all(kinds(m) == {"conv"} for m in run)


def _applied_repeatedly(modules: Mapping[Path, str], composite: set[Path],
                        callable_paths: set[Path] | None,
                        calls: Mapping[Path, int]) -> list[Path]:
  """The outermost modules with submodules called two or more times."""
  found: list[Path] = []
  for path in sorted(modules, key=len):
    if (path and path in composite and calls.get(path, 0) >= 2
        and (callable_paths is None or path in callable_paths)
        and not any(_inside(path, block) for block in found)):
      found.append(path)
  return found


def find_blocks(modules: Mapping[Path, str],
                callable_paths: set[Path] | None = None,
                flow: Flow | None = None) -> list[Path]:
  """The paths of a model's repeated blocks, in the order of ``modules``.

  A stack is two or more sibling modules with one name stem and consecutive
  indices (``h/0``, ``h/1``; ``layers_0``, ``layers_1``) that each contain
  submodules: a Dense repeats too, but a region around one layer only moves
  its input. A stack inside a member of another stack (the experts of a
  block, T5's sub-layers ``layer/0``, ``layer/1``) is left out, as regions do
  not nest; every outermost stack counts, so both the encoder and the
  decoder stack of a seq2seq model become regions. Two exceptions follow the
  block that repeats along the depth: a stack of stages, each only a stack
  of one kind of layer feeding one another (ResNet's ``stages/0/layers/1``),
  gives its layers (when ``flow`` says which module fed which);
  a stack of convolution-only blocks (Wav2Vec2's feature extractor) is left
  out when the model has another stack. With no stack, a module with
  submodules called two or more times (ALBERT's one shared layer) is the
  block, when ``flow`` says how often each was called.

  Args:
    modules: module class name by path, in call (or graph) order.
    callable_paths: the modules a region can wrap (linen: those called
      through ``__call__``); None: all.
    flow: how the modules ran (:class:`Flow`); None: unknown, so stages
      are blocks and a module called twice is not.
  """
  flow = flow or Flow()
  composite = {path[:k] for path in modules for k in range(len(path))}
  runs = _stacks(modules, composite, callable_paths)
  chosen = [deeper for run in _outermost(runs)
            for deeper in _depth_runs(run, modules, composite, runs, flow)]
  dense = [run for run in chosen if not _is_conv_stack(run, modules)]
  if dense:
    chosen = dense
  found = [path for run in chosen for path in run]
  if not found:
    found = _applied_repeatedly(modules, composite, callable_paths,
                                flow.calls)
  order = {path: i for i, path in enumerate(modules)}
  return sorted(found, key=order.__getitem__)


def likely_block(modules: Mapping[Path, str],
                 calls: Mapping[Path, int] | None = None) -> str | None:
  """The class most likely to be the block: the module with submodules
  called most often, then the one holding the most modules."""
  composite = {path[:k] for path in modules for k in range(len(path))}
  calls = calls or {}
  ranked = sorted(
      (path for path in modules if path and path in composite),
      key=lambda path: (-calls.get(path, 0),
                        -sum(_inside(p, path) for p in modules), path))
  return modules[ranked[0]] if ranked else None


def report_no_blocks(model_name: str, modules: Mapping[Path, str],
                     strict: bool, stacklevel: int,
                     calls: Mapping[Path, int] | None = None) -> None:
  """Warns (or raises) that discovery found nothing; names what to pass."""
  parents = {path[:k] for path in modules for k in range(len(path))}
  composite = sorted({cls for path, cls in modules.items()
                      if path and path in parents})
  example = likely_block(modules, calls) or "MyBlock"
  listed = (f"its submodule classes that contain modules are {composite[:20]}"
            if composite else "none of its submodules contains modules")
  message = (
      f"remat_modules found no repeated blocks in {model_name}: no module kind "
      f"with submodules repeats under indexed sibling names (h/0, h/1 or "
      f"layers_0, layers_1) or is called more than once, so no remat region "
      f"was made. Pass rules naming the block class or path, e.g. "
      f"rt.remat_modules(model, {{{example!r}: None}}) (the likeliest block); "
      f"{listed}.")
  if strict:
    raise ValueError(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel)


def summarize(model_name: str, auto: bool, regions: Mapping[str, str],
              applications: Mapping[str, int] | None = None) -> RematSummary:
  """Regions listed stack by stack (in order of first use), each stack by
  index: ``Block()(Block()(x))`` calls ``Block_1`` first."""
  stacks: dict[tuple[str, str], int] = {}
  keys = {}
  for path in regions:
    parts = path.split("/") if path else []
    key = []
    for depth, name in enumerate(parts):
      match = INDEXED.fullmatch(name)
      stem, index = (match.group(1), int(match.group(2))) if match else (
          name, 0)
      stack = ("/".join(parts[:depth]), stem)
      key.append((stacks.setdefault(stack, len(stacks)), index))
    keys[path] = tuple(key)
  ordered = sorted(regions, key=keys.__getitem__)
  return RematSummary(
      model=model_name, auto=auto,
      classes=tuple(dict.fromkeys(regions[path] for path in ordered)),
      regions=tuple(path or "<root>" for path in ordered),
      applications=tuple(applications.get(path, 1) for path in ordered)
      if applications is not None else ())
