"""The documentation site: every public name documented, every example run.

The site itself is built by ``mkdocs build --strict`` in CI (the ``docs``
extra); these tests need only the ``test`` extra: they read ``docs/`` and the
package.
"""

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
from shared_helpers import docs_examples
from shared_helpers import markdown_code_blocks
from shared_helpers import run_markdown_examples

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit import names
from remat_toolkit import results

DOCS = Path(__file__).resolve().parent.parent / "docs"
API = DOCS / "api"

PUBLIC = {
    "remat_toolkit": rt.__all__,
    "remat_toolkit.results": results.__all__,
    "remat_toolkit.names": names.__all__,
    "remat_toolkit.models": models.__all__,
}

# A docs example may be left out only for hardware a CI machine does not have.
SKIP_REASON = re.compile(r"^needs (a GPU|\d+ devices)\b")


def _documented() -> list[str]:
  return [identifier for page in sorted(API.glob("*.md"))
          for identifier in re.findall(r"^:::\s+(\S+)", page.read_text(encoding="utf-8"),
                                       re.M)]


def _public_names() -> list[str]:
  return [f"{module}.{name}" for module, names_ in PUBLIC.items() for name in names_]


#: Type aliases the signatures name, documented on the API index though they
#: live under ``_src`` (an alias cannot be re-exported with a docstring).
TYPE_ALIASES = ("remat_toolkit._src.policies.resolve.PolicyLike",
                "remat_toolkit._src.transform.grouping.GroupLike",
                "remat_toolkit._src.planning.groups.GroupsLike")


@pytest.mark.parametrize("identifier", TYPE_ALIASES)
def test_type_aliases_are_documented(identifier):
  module, name = identifier.rsplit(".", 1)
  assert identifier in _documented()
  assert _attribute_docstring(module, name), f"{identifier} has no docstring"


def test_every_public_name_has_an_api_entry_and_only_those():
  documented = [d for d in _documented() if d not in TYPE_ALIASES]
  missing = sorted(set(_public_names()) - set(documented))
  assert not missing, (
      f"public names without an API entry: {missing}; add a `::: NAME` line to the "
      "page of docs/api/ where it belongs")
  extra = sorted(set(documented) - set(_public_names()))
  assert not extra, f"docs/api/ documents names that are not public: {extra}"
  twice = sorted({name for name in documented if documented.count(name) > 1})
  assert not twice, f"documented more than once: {twice}"


def _attribute_docstring(module_name: str, name: str) -> str | None:
  """The string literal after ``name = ...`` where the module (or one it imports it
  from) assigns it: the docstring an API page shows for a constant."""
  module = importlib.import_module(module_name)
  tree = ast.parse(Path(inspect.getsourcefile(module)).read_text(encoding="utf-8"))
  body = tree.body
  for statement, following in zip(body, body[1:] + [None], strict=True):
    targets = (statement.targets if isinstance(statement, ast.Assign)
               else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
    if any(isinstance(t, ast.Name) and t.id == name for t in targets):
      if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
          and isinstance(following.value.value, str)):
        return following.value.value
      return None
  for statement in body:
    if isinstance(statement, ast.ImportFrom) and any(a.name == name for a in statement.names):
      return _attribute_docstring(statement.module, name)
  return None


@pytest.mark.parametrize("identifier", _public_names())
def test_every_public_name_has_a_docstring(identifier):
  module_name, name = identifier.rsplit(".", 1)
  obj = getattr(importlib.import_module(module_name), name)
  if inspect.isclass(obj) or callable(obj):
    doc = obj.__doc__  # its own: inspect.getdoc would inherit a base class's
    if inspect.isclass(obj) and (doc or "").startswith(f"{obj.__name__}("):
      doc = None  # the signature @dataclass writes where a class has no docstring
  else:
    doc = _attribute_docstring(module_name, name)
  assert doc and doc.strip(), (
      f"{identifier} has no docstring; its API page would be empty"
      + ("" if callable(obj) else " (write a string literal after the assignment)"))


@pytest.mark.parametrize("name", rt.__all__)
def test_every_top_level_name_shows_a_runnable_example(name):
  doc = inspect.getdoc(getattr(rt, name)) or ""
  example = re.search(r"^Examples?:\n(.*)", doc, re.M | re.S)
  assert example and ">>> " in example.group(1), (
      f"rt.{name}'s docstring has no Example: section with a >>> line")


def _pages_with_examples() -> list[str]:
  return [str(page.relative_to(DOCS)) for page in sorted(DOCS.rglob("*.md"))
          if any(b.lang == "python" for b in markdown_code_blocks(page))]


def test_examples_are_left_out_only_for_hardware():
  for page in sorted(DOCS.rglob("*.md")):
    for block in markdown_code_blocks(page):
      if block.directive == "skip":
        assert SKIP_REASON.match(block.argument), (
            f"{page.relative_to(DOCS)}, line {block.line}: an example may be skipped only "
            f"when it needs a GPU or several devices, not {block.argument!r}")


def test_every_example_that_prints_shows_its_output():
  """Read, not run: an example that calls ``print`` is followed by its output
  block, every output block follows an example and names its JAX, and all of
  them were recorded on one JAX (the script rewrites every page at once)."""
  problems = [p for page in sorted(DOCS.rglob("*.md"))
              for p in docs_examples.layout_problems(page)]
  assert not problems, "\n".join(problems) + (
      "\nrun `python docs/_ext/example_outputs.py` (on the newest JAX) to write them")
  versions = set().union(*(docs_examples.recorded_versions(page)
                           for page in sorted(DOCS.rglob("*.md"))))
  assert len(versions) == 1, (
      f"the pages' outputs were recorded on several JAX releases, {sorted(versions)}: "
      "rewrite them all with `python docs/_ext/example_outputs.py` on the newest")


def test_on_another_release_what_releases_change_is_masked():
  """The masked comparison of ``test_page_examples_run``, on lines jax 0.10.2
  and 0.12.0.1 print differently (figures, a primitive, a breakdown's entries)."""
  normalise = docs_examples.normalise
  new = ("save-everything    336.0 KiB  100.0%  20  <transpose>, mlpwi\n"
         "{'layers_1': 45056, 'ln_f': 4096, 'embed': 128}")
  old = ("save-everything    1.2 MiB     100.0%  24  <transpose>, mlpwi\n"
         "{'layers_1': 45312, 'ln_f': 4096, 'layers_0': 1024, 'embed': 128}")
  assert normalise(new, exact=False) == normalise(old, exact=False)
  assert normalise(new, exact=True) != normalise(old, exact=True)
  assert normalise("[('kernel', 1.0, 4096)] <div>", exact=False) == normalise(
      "[('kernel', 2.0, 8192)] <select_n>", exact=False)
  for changed in ("save-qkv    336.0 KiB  100.0%  20  <transpose>, mlpwi",  # a name
                  "save-everything    336.0 KiB  20  <transpose>, mlpwi",  # a column
                  "save-everything    336.0 KiB  100.0%  20  <transpose>"):
    assert normalise(changed, exact=False) != normalise(new.splitlines()[0], exact=False)


@pytest.fixture
def reader_environment():
  """A reader's defaults (``docs_examples.reader_environment``): an empty
  working folder, the built-in policies alone, ``jax_remat3`` off, NumPy rank
  promotion allowed, charts not shown."""
  pytest.importorskip("matplotlib")
  with docs_examples.reader_environment():
    yield


# Mode-independent (the examples are the API's, not the remat mode's) and slow.
@pytest.mark.slow
@pytest.mark.usefixtures("reader_environment")
@pytest.mark.parametrize("page", _pages_with_examples())
def test_page_examples_run(page):
  """Every example runs and prints what the page shows after it.

  The output blocks are written by ``docs/_ext/example_outputs.py`` from a
  run on the newest JAX in range (what the README's first command installs),
  and each names that release (``<!-- output: jax 0.12.0.1 -->``). On that
  release, on a CPU with ``XLA_FLAGS`` unset, what a block prints must equal
  its output block exactly (spaces at line ends aside): figures, names,
  columns. On another release (CI's minimum-versions row, jax 0.10.2) the
  residuals JAX keeps differ in legitimate ways, so the comparison masks what
  a release changes (``docs_examples.normalise``): every figure, a size's or a
  FLOP count's unit, JAX primitive names (``<select_n>`` on 0.12 is ``<div>``
  on 0.10), breakdown dicts of figures (jax 0.10 keeps a few small residuals
  more, so a ``by_module()`` lists other entries) and column padding. The
  words, policy and checkpoint names, table columns and the number of lines
  must still match: an example that prints something else, or a table that
  lost a column, fails on every release.
  """
  path = DOCS / page
  printed = run_markdown_examples(path)
  differences = docs_examples.differences(path, printed)
  assert not differences, "\n\n".join(differences) + (
      "\nif the change is meant, run `python docs/_ext/example_outputs.py "
      f"{page}` on jax {sorted(docs_examples.recorded_versions(path))}")


def test_api_pages_show_the_values_of_constant_defaults():
  """A default written as a module constant is shown with its value on the
  API pages (the docs extension); the reader cannot look the name up."""
  griffe = pytest.importorskip("griffe")
  spec = importlib.util.spec_from_file_location(
      "docs_docstrings", DOCS / "_ext" / "docstrings.py")
  extension = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(extension)
  package = griffe.load(
      "remat_toolkit", search_paths=[str(DOCS.parent)],
      extensions=griffe.load_extensions(extension.SphinxDocstrings()))
  defaults = {p.name: str(p.default)
              for p in package["_src.planning.planner.plan"].parameters}
  assert defaults["max_evaluations"] == "48"
  assert defaults["host_bandwidth"] == "2.5e+10"
  assert not [d for d in defaults.values() if d.startswith("DEFAULT_")]
