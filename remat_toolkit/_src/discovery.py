"""Finding a model's repeated blocks, and what :func:`remat_modules` chose.

Without rules, :func:`remat_toolkit.remat_modules` makes a remat region of
every block of the outermost stacks of a model's module tree
(:func:`find_blocks`); :class:`RematSummary` records the regions it made,
for :func:`remat_toolkit.remat_summary`.

Example:
  >>> from remat_toolkit._src import discovery
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

from remat_toolkit._src.rendered import Rendered

__all__ = ["RematSummary", "find_blocks", "report_no_blocks", "summarize",
           "INDEXED", "Path"]

# A module name ending in an index: HF's ``h/0``, Flax's auto-names
# ``Block_1``, user names ``layers_3`` or ``block2``.
INDEXED = re.compile(r"(.*?)_?(\d+)")

Path = tuple[str, ...]


def find_blocks(modules: Mapping[Path, str],
                callable_paths: set[Path] | None = None) -> list[Path]:
  """The paths of a model's repeated blocks, in the order of ``modules``.

  A stack is two or more sibling modules with one name stem and consecutive
  indices (``h/0``, ``h/1``; ``layers_0``, ``layers_1``) that each contain
  submodules: a Dense repeats too, but a region around one layer only moves
  its input. A stack inside a member of another stack (the experts of a
  block, T5's sub-layers ``layer/0``, ``layer/1``) is left out, as regions do
  not nest; every outermost stack counts, so both the encoder and the
  decoder stack of a seq2seq model become regions.

  Args:
    modules: module class name by path, in call (or graph) order.
    callable_paths: the modules a region can wrap (linen: those called
      through ``__call__``); None: all.
  """
  parents = {path[:k] for path in modules for k in range(len(path))}
  stacks: dict[tuple[Path, str], dict[int, Path]] = {}
  for path in modules:
    if not path or path not in parents:
      continue
    if callable_paths is not None and path not in callable_paths:
      continue
    match = INDEXED.fullmatch(path[-1])
    if match:
      stacks.setdefault((path[:-1], match.group(1)), {})[
          int(match.group(2))] = path
  found: list[Path] = []
  # Shallowest first, so that a stack nested in a chosen one is seen after it.
  for (parent, _), members in sorted(stacks.items(),
                                     key=lambda item: len(item[0][0])):
    indices = sorted(members)
    if len(indices) < 2 or indices[-1] - indices[0] != len(indices) - 1:
      continue
    if any(parent[:len(block)] == block for block in found):
      continue
    found.extend(members[i] for i in indices)
  order = {path: i for i, path in enumerate(modules)}
  return sorted(found, key=order.__getitem__)


def report_no_blocks(model_name: str, modules: Mapping[Path, str],
                     strict: bool, stacklevel: int) -> None:
  """Warns (or raises) that discovery found nothing; names what to pass."""
  parents = {path[:k] for path in modules for k in range(len(path))}
  composite = sorted({cls for path, cls in modules.items()
                      if path and path in parents})
  example = composite[0] if composite else "MyBlock"
  listed = (f"its submodule classes that contain modules are {composite[:20]}"
            if composite else "none of its submodules contains modules")
  message = (
      f"remat_modules found no repeated blocks in {model_name}: no module kind "
      f"with submodules repeats under indexed sibling names (h/0, h/1 or "
      f"layers_0, layers_1), so no remat region was made. Pass rules naming "
      f"the block class or path, e.g. rt.remat_modules(model, "
      f"{{{example!r}: None}}); {listed}.")
  if strict:
    raise ValueError(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel)


@dataclasses.dataclass(frozen=True)
class RematSummary(Rendered):
  """What :func:`remat_modules` made remat regions of; ``print`` it.

  Attributes:
    model: the model's class name.
    auto: True when the blocks were found automatically (no rules given).
    classes: the class names of the region modules, in order of first region.
    regions: the module path of each region (``transformer/h/0``), in call
      order (linen) or graph order (NNX).
    ran: False for a linen model that has not run yet: its submodules, and so
      its regions, are known at its first ``init`` / ``apply``.
  """

  model: str
  auto: bool
  classes: tuple[str, ...] = ()
  regions: tuple[str, ...] = ()
  ran: bool = True


def summarize(model_name: str, auto: bool,
              regions: Mapping[str, str]) -> RematSummary:
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
      regions=tuple(path or "<root>" for path in ordered))
