"""The package's layers, and the walls between them.

``remat_toolkit._src`` is a stack of packages, each importing only the ones
below it. This test reads every module's imports (at module level and
inside functions alike) and fails on an import of a higher layer and on any
import cycle between modules, so a change that breaks the order fails here
with the offending line, not later as a circular import.

The tests have a wall too: they reach into ``remat_toolkit._src`` only where
``tests/shared_helpers.py``'s docstring lists it, and a white-box test uses
only the names in its module's ``__all__``.
"""

import ast
import itertools
import re
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
#: those measured slow to import. Of the package's own, only the built-in
#: models: they load flax.linen and flax.nnx, about 0.5 s of the 2 s
#: ``import remat_toolkit`` takes (``python -X importtime``), which a user's
#: own model never needs.
DEFERRABLE = frozenset({"pandas", "matplotlib", "matplotlib.pyplot",
                        "remat_toolkit.models"})


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


# ---------------------------------------------------------------- the tests' wall

TESTS = PACKAGE.parent / "tests"
INTERNAL = "remat_toolkit._src"


def _allowed_internal_imports() -> dict[str, tuple[frozenset[str], bool]]:
  """File -> (``_src`` modules it may import, whether held to ``__all__``),
  read from the list in ``shared_helpers.py``'s docstring."""
  doc = ast.get_docstring(ast.parse(
      (TESTS / "shared_helpers.py").read_text(encoding="utf-8")))
  allowed = {}
  for entry in re.finditer(r"^- ``(\w+\.py)``: (.*?) -- (\S+)", doc, re.M | re.S):
    modules = frozenset(f"{INTERNAL}.{m}" for m in re.findall(r"``([\w.]+)``", entry[2]))
    allowed[entry[1]] = (modules, entry[3].startswith("white-box"))
  return allowed


def _module_all(module: str) -> frozenset[str]:
  """The names in a package module's ``__all__``, read from its source."""
  path = PACKAGE.parent.joinpath(*module.split("."))
  path = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
  for node in ast.parse(path.read_text(encoding="utf-8")).body:
    if (isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__all__" for t in node.targets)):
      return frozenset(ast.literal_eval(node.value))
  return frozenset()


def _internal_uses(path: Path) -> tuple[set[str], list[str]]:
  """(``_src`` modules a test file imports, ``module.name`` it uses from them)."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  modules, used, aliases = set(), [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(INTERNAL):
      for a in node.names:
        if _is_module(f"{node.module}.{a.name}"):
          modules.add(f"{node.module}.{a.name}")
          aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        else:
          modules.add(node.module)
          used.append(f"{node.module}.{a.name}")
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith(INTERNAL):
          modules.add(a.name)
          if a.asname:
            aliases[a.asname] = a.name
    elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
          and node.args and isinstance(node.args[0], ast.Constant)
          and str(node.args[0].value).startswith(INTERNAL)):
      modules.add(node.args[0].value)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in aliases:
      used.append(f"{aliases[node.value.id]}.{node.attr}")
  return modules, used


TEST_FILES = sorted(TESTS.glob("*.py"))


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_tests_reach_below_the_public_api_only_where_listed(path):
  allowed, white_box = _allowed_internal_imports().get(path.name, (frozenset(), False))
  modules, used = _internal_uses(path)
  unlisted = sorted(modules - allowed)
  assert not unlisted, (
      f"{path.name} imports {unlisted}: test through the public API "
      "(remat_toolkit, .results, .names, .models, run_cli), or list the file "
      "and the reason in shared_helpers.py's docstring")
  if white_box:
    outside = sorted(u for u in used
                     if not re.fullmatch(r"__\w+__", u.rsplit(".", 1)[1])
                     and u.rsplit(".", 1)[1] not in _module_all(u.rsplit(".", 1)[0]))
    assert not outside, (f"{path.name} is a white-box test of its module's "
                         f"__all__, but uses {outside}")


def test_the_list_of_tests_reaching_below_names_real_imports():
  for name, (allowed, _) in _allowed_internal_imports().items():
    assert (TESTS / name).exists(), name
    modules, _ = _internal_uses(TESTS / name)
    assert modules == allowed, (name, sorted(modules), sorted(allowed))
