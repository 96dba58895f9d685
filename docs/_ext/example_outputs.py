"""What the docs pages' Python examples print, shown on the pages and checked.

Each ```python block of a page under ``docs/`` that prints is followed by its
output, a text block marked with the JAX release it was recorded with::

    <!-- output: jax 0.12.0.1 -->
    ```text title="Output"
    ['ffn.up']
    ```

The marker is a directive in the style of ``<!-- skip: ... -->`` and
``<!-- file: ... -->`` (the line before a fence; the reader does not see it).
``python docs/_ext/example_outputs.py`` runs every page's examples as a reader
would (a page's blocks in order in one namespace, in an empty folder, JAX's
default remat mode) and rewrites those blocks in place: it adds one after each
example that prints, updates it, or removes it where the example prints
nothing. ``--check`` changes nothing and exits 1 listing where a page differs
from the run; name pages (``how-to/offload.md``) to run only those.

Record the outputs with the newest JAX the package supports, the one the
README's first command installs (``.venv-newest`` in CI's terms), on a CPU,
with ``XLA_FLAGS`` unset: the script refuses another backend or set flags. On
that release ``tests/test_docs.py`` compares each block's output exactly; on
another it masks what a JAX release changes (:func:`normalise`).

The tests import this file (by path) for the parser and the runner, so the
page, the script and the tests read examples one way.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import importlib.metadata
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The checkout's package, not whichever one the environment has installed:
# the pages document the code being built.
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from remat_toolkit._src.core import compat  # noqa: E402
from remat_toolkit._src.policies import catalog  # noqa: E402

#: The directive before an output block names the JAX release, as ``jax X``.
RECORDED = re.compile(r"^jax (?P<version>\S+)$")
#: The environment variable of extra policy folders; a reader has none set.
POLICY_PATH = "REMAT_TOOLKIT_POLICY_PATH"


# ---------------------------------------------------------------- reading a page

@dataclasses.dataclass(frozen=True)
class CodeBlock:
  """A fenced code block of a Markdown page.

  ``directive`` is set by an HTML comment on the line before the fence:
  ``<!-- skip: needs a GPU -->`` (the block is not run, for that reason),
  ``<!-- file: my_policies/keep-qk.toml -->`` (the block is that file's text,
  written before the page's next blocks run) or ``<!-- output: jax 0.12.0.1 -->``
  (the block is what the example before it prints, recorded on that JAX).
  ``start`` and ``end`` are its offsets in the page's text, directive included.
  """

  lang: str
  code: str
  line: int
  directive: str = ""
  argument: str = ""
  start: int = dataclasses.field(default=0, compare=False)
  end: int = dataclasses.field(default=0, compare=False)

  @property
  def is_example(self) -> bool:
    """A Python block that runs (not left out with ``skip:``)."""
    return self.lang == "python" and self.directive != "skip"


_FENCE = re.compile(
    r"^(?:<!--\s*(?P<directive>skip|file|output):\s*(?P<argument>.*?)\s*-->\n)?"
    r"```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


def markdown_code_blocks(path: Path) -> list[CodeBlock]:
  """The fenced blocks of a Markdown file, in order.

  Only fences at the start of a line count; an indented fence (inside a list)
  would be missed, so it fails instead of being skipped unseen.
  """
  text = path.read_text(encoding="utf-8")
  blocks = [CodeBlock(lang=m["lang"], code=m["code"],
                      line=text.count("\n", 0, m.start("lang")) + 1,
                      directive=m["directive"] or "", argument=m["argument"] or "",
                      start=m.start(), end=m.end())
            for m in _FENCE.finditer(text)]
  fences = len(re.findall(r"^[ \t]*```python", text, re.M))
  parsed = sum(b.lang == "python" for b in blocks)
  assert fences == parsed, (
      f"{path}: {fences - parsed} ```python block(s) are indented or unclosed; "
      "start each fence at the beginning of a line so its example runs.")
  return blocks


def examples(path: Path) -> list[tuple[CodeBlock, CodeBlock | None]]:
  """Each example of a page with its output block (None where it shows none).

  An output block belongs to the example just before it, with only blank
  lines between them.
  """
  text = path.read_text(encoding="utf-8")
  blocks = markdown_code_blocks(path)
  found = []
  for i, block in enumerate(blocks):
    following = blocks[i + 1] if i + 1 < len(blocks) else None
    if block.is_example:
      shown = (following if following is not None and following.directive == "output"
               and not text[block.end:following.start].strip() else None)
      found.append((block, shown))
  return found


def prints(block: CodeBlock) -> bool:
  """Whether the block's code calls ``print``: what the page must show."""
  return any(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"
             for node in ast.walk(ast.parse(block.code)))


def layout_problems(path: Path) -> list[str]:
  """What is wrong with a page's output blocks, read without running anything.

  An example that calls ``print`` shows an output block right after it; an
  output block follows an example and names the JAX it was recorded with.
  """
  name = path.relative_to(DOCS) if path.is_relative_to(DOCS) else path
  problems = []
  attached = set()
  for block, shown in examples(path):
    if shown is not None:
      attached.add(shown.line)
    elif prints(block):
      problems.append(f"{name}, line {block.line}: the example prints, but no "
                      "<!-- output: ... --> block follows it")
  for block in markdown_code_blocks(path):
    if block.directive != "output":
      continue
    if block.line not in attached:
      problems.append(f"{name}, line {block.line}: an output block that follows no "
                      "example (it must come right after a ```python block that runs)")
    if not RECORDED.match(block.argument) or block.lang != "text":
      problems.append(f"{name}, line {block.line}: write an output block as "
                      "<!-- output: jax VERSION --> and a ```text fence, got "
                      f"{block.argument!r} and ```{block.lang}")
  return problems


def recorded_versions(path: Path) -> set[str]:
  """The JAX releases a page's output blocks say they were recorded with."""
  return {m["version"] for b in markdown_code_blocks(path)
          if b.directive == "output" and (m := RECORDED.match(b.argument))}


def pages() -> list[Path]:
  """The pages under ``docs/`` with Python examples."""
  return [page for page in sorted(DOCS.rglob("*.md"))
          if any(b.lang == "python" for b in markdown_code_blocks(page))]


# ---------------------------------------------------------------- running a page

@contextlib.contextmanager
def reader_environment() -> Iterator[None]:
  """A reader's defaults: an empty working folder, the built-in policies alone
  (no policy folder in the environment), JAX's default remat mode
  (``jax_remat3`` off: jax 0.10's remat3 refuses the offloading examples),
  NumPy rank promotion allowed (the test suite forbids it; Hugging Face's
  models rely on it), charts drawn but not shown."""
  try:
    import matplotlib  # optional: only the pages that plot need it
    matplotlib.use("Agg")
  except ImportError:
    matplotlib = None
  policy_path = os.environ.pop(POLICY_PATH, None)
  try:
    with (tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder),
          catalog.isolated(fresh=True), compat.remat3(False),
          jax.numpy_rank_promotion("allow")):
      yield
  finally:
    if policy_path is not None:
      os.environ[POLICY_PATH] = policy_path
    if matplotlib is not None:
      import matplotlib.pyplot as plt
      plt.close("all")


def run_examples(path: Path) -> dict[int, str]:
  """Runs a page's Python blocks in order in one namespace, as a reader would.

  ``file:`` blocks are written (relative to the current directory) before the
  blocks after them run; ``skip:`` blocks are left out. Returns what each
  block printed, by the line of its fence. Run it inside
  :func:`reader_environment` for what the pages show.
  """
  namespace: dict = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
  printed = {}
  for block in markdown_code_blocks(path):
    if block.directive == "file":
      target = Path(block.argument)
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_text(block.code, encoding="utf-8")
    elif block.is_example:
      out = io.StringIO()
      with contextlib.redirect_stdout(out):
        # dont_inherit: this file's `from __future__ import annotations` is not the reader's.
        exec(compile(block.code, f"{path.name}, line {block.line}", "exec",
                     dont_inherit=True), namespace)
      printed[block.line] = out.getvalue()
  return printed


# ---------------------------------------------------------------- comparing

def tidy(text: str) -> str:
  """Output as a page holds it: no spaces at line ends, no blank lines around."""
  return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


_FIGURE = re.compile(r"[+-]?\d+(?:[.,]\d+)*")
_UNIT = re.compile(r"\bN ([KMGT]i)?B\b|\bN [KMGTP]?FLOP\b")
_PRIMITIVE = re.compile(r"<[\w.]+>")
_FIGURE_DICT = re.compile(r"\{'[^'{}]*': N(?:, '[^'{}]*': N)*\}")


def normalise(text: str, *, exact: bool) -> str:
  """``text`` as compared: :func:`tidy` only where ``exact``, else masked.

  Masked is what stays when the JAX release changes. Figures (``74816``,
  ``12.0``, ``-5.1``) become ``N``, a size or FLOP count ``N B`` / ``N FLOP``
  whatever its unit. A JAX primitive's name (``<select_n>``, how an
  unnamed residual is called) becomes ``<…>``: releases compute the same value
  with other primitives (jax 0.12 ``<select_n>``, jax 0.10 ``<div>``). A
  breakdown printed as a dict of figures (``by_name()``, ``by_module()``,
  ``by_phase()``) becomes ``{…}``: which small residuals a release keeps, so
  which entries it lists and their order by bytes, is the release's (jax 0.10
  keeps a few hundred bytes in the tiny model's ``layers_0`` that 0.12 does
  not). Runs of spaces and of ``-`` become one, as table columns are as wide
  as their figures. What is left (the words, the names a policy keeps, the
  columns, the lines) must match.
  """
  text = tidy(text)
  if exact:
    return text
  text = _FIGURE.sub("N", text)
  text = _UNIT.sub(lambda m: "N FLOP" if m[0].endswith("FLOP") else "N B", text)
  text = _PRIMITIVE.sub("<…>", text)
  text = _FIGURE_DICT.sub("{…}", text)
  text = re.sub(r"-{2,}", "-", text)
  return re.sub(r"[ \t]+", " ", text)


def exact_here(recorded: str) -> bool:
  """Whether outputs recorded on JAX ``recorded`` compare exactly in this
  process: the same JAX release, on a CPU (the backend they are recorded
  on), with ``XLA_FLAGS`` unset (flags change XLA's compiled figures)."""
  return (recorded == jax.__version__ and jax.default_backend() == "cpu"
          and not os.environ.get("XLA_FLAGS"))


def differences(path: Path, printed: dict[int, str]) -> list[str]:
  """Where a page's output blocks differ from what its examples printed.

  ``printed`` is :func:`run_examples`'s result. Each block is compared
  exactly where :func:`exact_here` says so for the JAX it names, else masked
  (:func:`normalise`); the message says which, with a diff.
  """
  name = path.relative_to(DOCS) if path.is_relative_to(DOCS) else path
  found = []
  for block, shown in examples(path):
    out = tidy(printed.get(block.line, ""))
    if shown is None:
      if out:
        found.append(f"{name}, line {block.line}: the example prints, but the page "
                     f"shows no output:\n{out}")
      continue
    recorded = m["version"] if (m := RECORDED.match(shown.argument)) else "?"
    exact = exact_here(recorded)
    want, got = normalise(shown.code, exact=exact), normalise(out, exact=exact)
    if want != got:
      how = ("exactly" if exact else
             f"with figures masked (recorded on jax {recorded}, this is jax "
             f"{jax.__version__} on {jax.default_backend()})")
      diff = "\n".join(difflib.unified_diff(
          want.splitlines(), got.splitlines(), "shown", "printed", lineterm=""))
      found.append(f"{name}, line {block.line}: what the example prints differs from "
                   f"its output block, compared {how}:\n{diff}")
  return found


# ---------------------------------------------------------------- rewriting

def output_block(output: str, version: str) -> str:
  """The Markdown of an output block (directive, fence and text)."""
  return f"<!-- output: jax {version} -->\n```text title=\"Output\"\n{output}\n```"


def rewrite(path: Path, printed: dict[int, str], version: str) -> str:
  """The page's text with every output block made from ``printed``.

  An example that printed gets a block right after it (replacing the one
  there); one that printed nothing loses its block. The rest of the page is
  kept byte for byte.
  """
  text = path.read_text(encoding="utf-8")
  for block, shown in reversed(examples(path)):
    out = tidy(printed.get(block.line, ""))
    end = shown.end if shown is not None else block.end
    text = (text[:block.end] + (f"\n\n{output_block(out, version)}" if out else "")
            + text[end:])
  return text


def main(argv: list[str] | None = None) -> int:
  """Rewrites the pages' output blocks from a run, or checks them (``--check``)."""
  parser = argparse.ArgumentParser(
      prog="python docs/_ext/example_outputs.py",
      description="Run the docs pages' Python examples and write what each prints "
                  "in the output block after it.")
  parser.add_argument("pages", nargs="*", metavar="PAGE",
                      help="pages to run, relative to docs/ (default: every page "
                           "with a Python example)")
  parser.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 listing where the pages differ from the run")
  args = parser.parse_args(argv)
  if os.environ.get("XLA_FLAGS"):
    parser.error(f"XLA_FLAGS is set ({os.environ['XLA_FLAGS']!r}): the pages show a "
                 "reader's defaults; unset it")
  if jax.default_backend() != "cpu":
    parser.error(f"the JAX backend is {jax.default_backend()}: outputs are recorded on "
                 "a CPU; run with JAX_PLATFORMS=cpu")
  targets = [DOCS / p for p in args.pages] if args.pages else pages()
  missing = [str(p) for p in targets if not p.is_file()]
  if missing:
    parser.error(f"no such page: {', '.join(missing)}")
  print(f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, CPU, "
        f"jax_remat3 off; {len(targets)} page(s)")
  problems, changed = [], []
  for page in targets:
    with reader_environment():
      printed = run_examples(page)
    if args.check:
      problems += layout_problems(page) + differences(page, printed)
      continue
    text = rewrite(page, printed, jax.__version__)
    if text != page.read_text(encoding="utf-8"):
      page.write_text(text, encoding="utf-8")
      changed.append(page)
    shown = sum(bool(tidy(out)) for out in printed.values())
    print(f"{'rewrote' if page in changed else 'unchanged'} {page.relative_to(DOCS)}: "
          f"{shown} output block(s)")
  if args.check:
    print("\n\n".join(problems) if problems else "every output block is what its example prints")
    return 1 if problems else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
