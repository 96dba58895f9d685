"""Helpers shared by the test files: one copy of each, imported where needed.

``third_party_models.py`` holds the Hugging Face models; fixtures are in
``conftest.py`` (``quick_compiles``, ``remat_mode``).
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import remat_toolkit as rt
from remat_toolkit._src.analysis import residuals as _residuals
from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import lowering
from remat_toolkit._src.policies.policy import unrunnable_reason

#: The running JAX's minor release ("0.10", "0.11", "0.12"): pins of JAX bugs
#: and behaviours that no feature probe covers are stated per release.
JAX_RELEASE = ".".join(jax.__version__.split(".")[:2])


# ---------------------------------------------------------------- residuals

def residuals(fn, *args):
  """What is saved, as a sorted list of (shape, dtype, what) records."""
  out = []
  for aval, desc in compat.saved_residuals(fn, *args):
    named = re.match(r"named '([^']+)'", desc)
    if named:
      what = "named " + named.group(1)
    elif desc.startswith("from the argument"):
      what = "argument"
    elif desc.startswith("from a constant"):
      what = "constant"
    else:
      what = "output of " + desc.split()[2]
    out.append((tuple(aval.shape), str(aval.dtype), what))
  return sorted(out)


def named(records):
  """The checkpoint names among :func:`residuals` records."""
  return {what[len("named "):] for _, _, what in records
          if what.startswith("named ")}


def jax_accounting(fn, args, policy):
  """(count, activation bytes, argument count) from JAX's saved_residuals,
  with ``fn`` traced under the ambient ``policy``."""
  def under_policy(*a):
    with rt.use_policy(policy):
      return fn(*a)
  found = compat.saved_residuals(under_policy, *args)
  activations = [a for a, d in found if "from the argument" not in d]
  return (len(found), sum(_residuals.aval_nbytes(a) for a in activations),
          len(found) - len(activations))


def jax_activation_bytes(fn, args, policy):
  """Device bytes of the residuals JAX itself reports with ``fn`` traced
  under the ambient ``policy``, less arguments: constants and literals
  count, as they do in ``ResidualReport.activation_bytes``."""
  def under(*a):
    with rt.use_policy(policy):
      return fn(*a)
  return sum(_residuals.aval_nbytes(aval)
             for aval, desc in compat.saved_residuals(under, *args)
             if not desc.startswith("from the argument"))


def jax_kinds(fn, args, policy):
  """(kind, shape, bytes) of each residual JAX lists, sorted, with ``fn``
  traced under the ambient ``policy``; kinds as ``rt.analyze`` names them."""
  def under(*a):
    with rt.use_policy(policy):
      return fn(*a)
  kinds = {"from the argument": "argument", "from a constant": "constant",
           "from a literal": "literal"}
  out = []
  for aval, desc in compat.saved_residuals(under, *args):
    kind = next((k for p, k in kinds.items() if desc.startswith(p)), "activation")
    out.append((kind, tuple(aval.shape), _residuals.aval_nbytes(aval)))
  return sorted(out)


def runnable_policies() -> list[str]:
  """The built-in policies that can run in the current remat mode."""
  return [n for n in rt.list_policies()
          if unrunnable_reason(rt.get_policy(n)) is None]


# ---------------------------------------------------------------- devices

def run_on_simulated_devices(script, *args, count=8):
  """Runs ``script`` (Python source) in a subprocess with ``count`` CPU
  devices and returns the JSON it prints last.

  ``--xla_force_host_platform_device_count`` only takes effect before JAX
  starts its backend, and the rest of the suite runs on one device. The
  tests folder is on the subprocess's path, after the repository root.
  """
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={count}").strip()
  env["JAX_PLATFORMS"] = "cpu"
  tests = Path(__file__).resolve().parent
  env["PYTHONPATH"] = os.pathsep.join(
      [str(tests.parent), str(tests), env.get("PYTHONPATH", "")])
  done = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                        env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- regions

def ambient_region(f):
  """A remat region that reads the ambient policy at trace time."""
  def g(*args):
    region = lowering.region_policy(None)
    return jax.checkpoint(f, policy=lowering.region_jax_policy(region))(*args)
  return g


def grad_of(loss, *args):
  """``jax.grad(loss)(*args)``, traced once and run op by op.

  Op-by-op execution shares compiled primitives across every test, where a
  ``jit`` per model would compile each program anew.
  """
  closed, out_shape = jax.make_jaxpr(jax.grad(loss), return_shape=True)(*args)
  flat = compat.eval_jaxpr(closed.jaxpr, closed.consts,
                           *jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(out_shape), flat)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  """Leaf by leaf ``assert_allclose``; PRNG keys compare by their key data."""
  def as_numpy(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      as_numpy(x), as_numpy(y), rtol=rtol, atol=atol), a, b)


# ---------------------------------------------------------------- models

def cheap_init(key, shape, dtype=jnp.float32):
  """Weights from a NumPy constant scaled by the key: traceable, like any
  initialiser, but without the many random-number operations JAX's
  initialisers would compile in each remat mode."""
  base = np.random.RandomState(sum(shape)).normal(size=shape) / np.sqrt(
      shape[0])
  scale = 1 + (jax.random.key_data(key)[-1] % 8).astype(dtype) / 8
  return (jnp.asarray(base, dtype) * scale).astype(dtype)


class NNXMlp(nnx.Module):
  """A two-layer NNX feed-forward block (``fc1``, ``fc2``) of width ``d``."""

  def __init__(self, d, rngs):
    self.fc1 = nnx.Linear(d, 2 * d, kernel_init=cheap_init, rngs=rngs)
    self.fc2 = nnx.Linear(2 * d, d, kernel_init=cheap_init, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.gelu(self.fc1(x)))


# ---------------------------------------------------------------- documentation

@dataclasses.dataclass(frozen=True)
class CodeBlock:
  """A fenced code block of a Markdown page.

  ``directive`` is set by an HTML comment on the line before the fence:
  ``<!-- skip: needs a GPU -->`` (the block is not run, for that reason) or
  ``<!-- file: my_policies/keep-qk.toml -->`` (the block is that file's text,
  written before the page's next blocks run).
  """

  lang: str
  code: str
  line: int
  directive: str = ""
  argument: str = ""


_FENCE = re.compile(
    r"^(?:<!--\s*(?P<directive>skip|file):\s*(?P<argument>.*?)\s*-->\n)?"
    r"```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)


def markdown_code_blocks(path: Path) -> list[CodeBlock]:
  """The fenced blocks of a Markdown file, in order.

  Only fences at the start of a line count; an indented fence (inside a list)
  would be missed, so it fails instead of being skipped unseen.
  """
  text = path.read_text(encoding="utf-8")
  blocks = [CodeBlock(lang=m["lang"], code=m["code"],
                      line=text.count("\n", 0, m.start("lang")) + 1,
                      directive=m["directive"] or "", argument=m["argument"] or "")
            for m in _FENCE.finditer(text)]
  fences = len(re.findall(r"^[ \t]*```python", text, re.M))
  parsed = sum(b.lang == "python" for b in blocks)
  assert fences == parsed, (
      f"{path}: {fences - parsed} ```python block(s) are indented or unclosed; "
      "start each fence at the beginning of a line so its example runs.")
  return blocks


def run_markdown_examples(path: Path, capsys) -> dict[int, str]:
  """Runs a page's Python blocks in order in one namespace, as a reader would.

  ``file:`` blocks are written (relative to the current directory) before the
  blocks after them run; ``skip:`` blocks are left out. Returns what each
  block printed, by the line of its fence.
  """
  namespace: dict = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
  printed = {}
  for block in markdown_code_blocks(path):
    if block.directive == "file":
      target = Path(block.argument)
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_text(block.code, encoding="utf-8")
    elif block.lang == "python" and block.directive != "skip":
      exec(compile(block.code, f"{path.name}, line {block.line}", "exec"), namespace)
      printed[block.line] = capsys.readouterr().out
  return printed
