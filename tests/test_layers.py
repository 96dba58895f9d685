"""The package's layers, and the walls between them.

``remat_toolkit._src`` is a stack of packages, each importing only the ones
below it. This test reads every module's imports (at module level and
inside functions alike) and fails on an import of a higher layer and on any
import cycle between modules, so a change that breaks the order fails here
with the offending line, not later as a circular import.
"""

import ast
import itertools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "remat_toolkit"

#: Bottom to top. A module may import its own layer and the layers below.
LAYERS = (
    "remat_toolkit._src.core",
    "remat_toolkit._src.policies",
    "remat_toolkit._src.results",
    "remat_toolkit._src.transform",
    "remat_toolkit.models",
    "remat_toolkit._src.analysis",
    "remat_toolkit._src.planning",
    "remat_toolkit._src.bench",
    "remat_toolkit._src.display",
    "remat_toolkit._src.cli",
    # The public face: the top-level namespace and its two public modules.
    "remat_toolkit",
)

#: Imports that may be deferred into a function: optional dependencies, and
#: those measured slow to import (none of the package's own modules).
DEFERRABLE = frozenset({"pandas", "matplotlib", "matplotlib.pyplot"})


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _layer(module: str) -> int:
  best = max((i for i, layer in enumerate(LAYERS)
              if module == layer or module.startswith(layer + ".")),
             key=lambda i: len(LAYERS[i]), default=None)
  if best is None:
    raise AssertionError(f"{module} is in no layer of LAYERS")
  return best


def _imports(path: Path) -> list[tuple[str, int, bool]]:
  """``(imported module, line, at module level)`` of the package's own."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  module = _module_name(path)
  is_package = path.name == "__init__.py"
  found = []
  top_level = {id(n) for n in tree.body}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
      else:
        prefix = node.module or ""
      # "from pkg import mod" imports the module pkg.mod when it is one.
      names = [f"{prefix}.{a.name}" if _is_module(f"{prefix}.{a.name}")
               else prefix for a in node.names]
    else:
      continue
    for name in names:
      if name == "remat_toolkit" or name.startswith("remat_toolkit."):
        found.append((name, node.lineno, id(node) in top_level))
  return found


def _is_module(name: str) -> bool:
  path = PACKAGE.parent.joinpath(*name.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_a_module_imports_only_its_layer_and_those_below(path):
  module = _module_name(path)
  own = _layer(module)
  upward = [f"line {line}: {name} ({LAYERS[_layer(name)]})"
            for name, line, _ in _imports(path) if _layer(name) > own]
  assert not upward, (f"{module} ({LAYERS[own]}) imports a higher layer: "
                      + "; ".join(upward))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_no_import_of_the_package_is_deferred_into_a_function(path):
  deferred = [f"line {line}: {name}" for name, line, top in _imports(path)
              if not top and name not in DEFERRABLE]
  assert not deferred, (f"{_module_name(path)} imports inside a function "
                        "(move the code to its layer instead): "
                        + "; ".join(deferred))


def test_no_import_cycle():
  graph = {_module_name(p): {n for n, _, _ in _imports(p)} for p in MODULES}
  # A package's __init__ is not a cycle with the modules it re-exports.
  for module, targets in graph.items():
    targets.discard(module)
  cycles = []
  for start in graph:
    stack, seen = [(start, (start,))], set()
    while stack:
      node, path = stack.pop()
      for nxt in graph.get(node, ()):
        if nxt == start:
          cycles.append(" -> ".join((*path, start)))
        elif nxt not in seen and nxt in graph:
          seen.add(nxt)
          stack.append((nxt, (*path, nxt)))
  shortest = sorted(set(cycles), key=len)[:3]
  assert not shortest, "import cycles: " + " | ".join(shortest)


def test_layers_are_listed_bottom_to_top_once():
  assert len(set(LAYERS)) == len(LAYERS)
  assert all(a != b for a, b in itertools.pairwise(LAYERS))
