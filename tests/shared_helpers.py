"""Helpers shared by the test files: one copy of each, imported where needed.

``third_party_models.py`` holds the Hugging Face models; fixtures are in
``conftest.py`` (``quick_compiles``, ``remat_mode``, ``fresh_catalogue``).

Tests check behaviour through the public API: ``remat_toolkit``,
``remat_toolkit.results``, ``remat_toolkit.names``, ``remat_toolkit.models`` and
the command's entry ``remat_toolkit.__main__.main`` (:func:`run_cli`). The
files below reach into ``remat_toolkit._src``, each for the reason given and
only into the modules named; ``tests/test_layers.py`` reads this list and fails
on any other import of ``remat_toolkit._src`` from a test, and on a white-box
test using a name outside its module's ``__all__``.

- ``shared_helpers.py``: ``core.compat``, ``core.jaxpr``, ``analysis.regions``
  -- the oracle results are checked against, which cannot come from the
  results: JAX's own ``saved_residuals`` (:func:`jax_residuals`), the remat
  mode switch (:func:`remat3`), what this JAX release does (the compatibility
  layer's probes, pinned per release by ``test_compat.py``) and what a traced
  program holds (remat regions and checkpoint names, encoded differently per
  mode).
- ``conftest.py``: ``core.compat``, ``policies.catalog``, ``policies.findings``
  -- the ``remat_mode`` fixture, a catalogue of the built-ins alone
  (``fresh_catalogue``), and trace-time findings raised again as in a fresh
  process (``fresh_trace_warnings``).
- ``test_compat.py``: ``core.compat``, ``core.jaxpr``, ``policies.lowering``
  -- pins each JAX behaviour the compatibility layer relies on, per release,
  read with the jaxpr walks, and what the analyzer's marker policy enters.
- ``test_compat_kernels.py``: ``core.compat``, ``core.jaxpr``,
  ``analysis.flops`` -- the same for kernels (``custom_vjp``, Pallas, cuDNN),
  read with the jaxpr walks and the analyzer's kernel counting.
- ``test_compat_meshes.py``: ``core.compat`` -- the same for meshes larger
  than this machine (``jax.sharding.AbstractMesh``).
- ``test_layers.py``: none -- reads the package's files, imports nothing of it.
- ``test_cli_reference.py``: ``cli.main`` -- white-box: the command's parser,
  which the docs' CLI reference renders, to check every command and option is
  on the page.
- ``test_knapsack.py``: ``planning.knapsack`` -- white-box: the exact per-region
  knapsack, a pure solver.
- ``test_plan_search.py``: ``planning.search`` -- white-box: the plan's branch and
  bound, a pure solver.
- ``test_pareto.py``: ``core.pareto`` -- white-box: the one Pareto rule every
  result's flags come from.
- ``test_policy_toml.py``: ``policies.policy_toml`` -- white-box: the policy file
  reader and writer.
- ``test_public_api.py``: ``results.base`` -- white-box: every result class
  derives from the one base and registers on its rendering entry.
- ``test_batch_search.py``: ``bench.batch_search`` -- white-box: the largest-batch
  search (pure) and the step memory it bisects, which no result shows.
- ``test_train_step.py``: ``bench.train_step`` -- white-box: the benchmarked step's
  gradient accumulation, whose parameters no result shows.
- ``test_inputs.py``: ``core.inputs`` -- white-box: the synthetic inputs made for
  abstract arguments, whose values no result shows.
- ``test_cli_output.py``: ``cli.shared`` -- white-box: the output helper's branch
  for JSON without a place for warnings, which no command's result reaches.
- ``test_find_blocks.py``: ``transform.discovery`` -- white-box: the block
  heuristic of ``rt.remat_modules`` on hand-made module trees.
- ``test_group_size.py``: ``transform.grouping`` -- white-box: layers per region
  for a group size, a pure function, over many layer counts.
- ``test_internals.py``: ``analysis.trace``, ``analysis.report``,
  ``analysis.diagnose``, ``analysis.residuals``, ``analysis.regions``,
  ``core.jaxpr`` -- internal invariants whose only visible effect is that
  public figures do not change (identical layers traced as one shared body;
  a program and each policy diagnosed once, the traced program only
  measuring), and the jaxpr walks ``rt.verify`` and the residual origins
  rest on.
- ``test_peak_model.py``: ``analysis.liveness``, ``analysis.packing`` -- white-box:
  the peak's buffer model rule by rule (merged casts, in-place outputs, 16-bit
  products, loop conversions, the layout of temporaries), each switched on
  and off as the compatibility layer's probes would, which no result can do
  on one JAX release.
- ``test_xla_buffers.py``: ``analysis.xla_buffers`` -- white-box: the reading
  of XLA's compiled text, on a hand-written module whose instructions XLA
  made without op metadata (a fusion, a convert), which a small program's
  compile may not produce on every release.
- ``test_plan_peak.py``: ``planning.peak_search``, ``planning.search``
  -- white-box: the peak search with XLA's figures made up, where XLA's
  figure does not grow with the kept bytes (which a small program's compile
  on this machine may not show).
- ``test_verify.py``: ``analysis.verify`` -- white-box: the norm-wise gradient
  comparison, whose edge cases (NaN, zero leaves) no small model reaches.
- ``test_warnings.py``: ``policies.findings`` -- white-box: the one switch that
  silences findings raised while tracing, and the kinds every finding has.
"""

import dataclasses
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import warnings
from contextlib import redirect_stderr
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import remat_toolkit as rt
from remat_toolkit.__main__ import main as _cli_main
from remat_toolkit._src.analysis import regions as _regions
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr

#: The running JAX's minor release ("0.10", "0.11", "0.12"): pins of JAX bugs
#: and behaviours that no feature probe covers are stated per release.
JAX_RELEASE = ".".join(jax.__version__.split(".")[:2])


# ---------------------------------------------------------------- JAX's behaviour

#: ``with remat3(on):`` runs the block with ``jax_remat3`` set to ``on``. jax 0.10
#: picks the remat implementation when ``jax.checkpoint`` wraps a function, so
#: build checkpointed functions inside the block.
remat3 = compat.remat3
#: Whether ``jax_remat3`` is on now.
remat3_enabled = compat.remat3_enabled
#: Whether this JAX's remat3 moves offloaded residuals to the host.
remat3_offloads = compat.remat3_offloads
#: Whether remat3 decides a name by calling the policy (so any callable works).
remat3_calls_policies = compat.remat3_calls_policies
#: Whether remat3 honours this JAX policy (rather than recomputing everything).
remat3_honours = compat.remat3_honours
#: Whether remat3's ``everything_saveable`` keeps unnamed values too.
remat3_everything_keeps_unnamed = compat.remat3_everything_keeps_unnamed
#: Whether remat3's policies see inside a ``custom_vjp`` forward rule.
remat3_sees_into_custom_vjp = compat.remat3_sees_into_custom_vjp
#: Whether an offloading policy would do nothing now (remat3 on, not offloading).
offloading_unsupported = compat.offloading_unsupported
#: Whether ``dots_saveable`` keeps convolutions in the active remat mode.
dots_saveable_keeps_convs = compat.dots_saveable_keeps_convs
#: Whether this JAX has the ``jax_custom_vjp3`` flag, and whether it is on.
has_custom_vjp3_flag = compat.has_custom_vjp3_flag
custom_vjp3_enabled = compat.custom_vjp3_enabled
#: The setting under which both remat modes keep a kernel's residuals alike.
custom_vjp_alignment = compat.custom_vjp_alignment


# ---------------------------------------------------------------- residuals

#: What ``saved_residuals`` says a residual comes from, and the kind
#: ``rt.analyze`` gives it.
_SOURCES = {"from the argument": "argument", "from a constant": "constant",
            "from a literal": "literal"}


@dataclasses.dataclass(frozen=True)
class Saved:
  """One residual as JAX's ``saved_residuals`` lists it, its text parsed once.

  ``kind`` is what ``rt.analyze`` calls it: ``"argument"``, ``"constant"``,
  ``"literal"`` or ``"activation"``. An activation has either a checkpoint
  ``name`` or the ``primitive`` that made it (``"sin"``, ``"scan"``,
  ``"device_put"``; ``"jit"`` for a jitted function's output). ``nbytes``
  is computed here from the shape and dtype, not by the toolkit.
  """

  shape: tuple[int, ...]
  dtype: str
  kind: str
  name: str | None
  primitive: str | None
  memory_kind: str
  nbytes: int
  description: str = dataclasses.field(compare=False)
  aval: Any = dataclasses.field(compare=False, repr=False)

  @property
  def what(self) -> str:
    """``"named NAME"``, ``"output of PRIMITIVE"`` or the kind."""
    if self.name is not None:
      return f"named {self.name}"
    if self.primitive is not None:
      return f"output of {self.primitive}"
    return self.kind


def _parse(aval: Any, description: str) -> Saved:
  kind = next((k for prefix, k in _SOURCES.items()
               if description.startswith(prefix)), "activation")
  name = primitive = None
  if kind == "activation":
    if named := re.match(r"named '(.*?)' from ", description):
      name = named[1]
    elif description.startswith("output of jitted function "):
      primitive = "jit"
    elif made := re.match(r"output of (\S+) from ", description):
      primitive = made[1]
    else:
      raise AssertionError(f"saved_residuals says {description!r}: a form "
                           "these tests do not know; teach _parse it")
  space = str(getattr(aval, "memory_space", "") or "").lower()
  return Saved(shape=tuple(aval.shape), dtype=str(aval.dtype), kind=kind,
               name=name, primitive=primitive,
               memory_kind="host" if "host" in space else "device",
               nbytes=math.prod(aval.shape) * aval.dtype.itemsize,
               description=description, aval=aval)


def jax_release() -> str:
  """This JAX's minor release, ``"0.10"``: the key of the per-release pins."""
  return ".".join(jax.__version__.split(".")[:2])


def jax_residuals(fn, *args, policy=None) -> list[Saved]:
  """What JAX's own ``saved_residuals`` says ``fn(*args)`` keeps, in its order.

  With ``policy`` (anything ``rt.use_policy`` takes), ``fn`` is traced under
  it as the ambient policy.
  """
  if policy is not None:
    fn = _under_policy(fn, policy)
  return [_parse(aval, description)
          for aval, description in compat.saved_residuals(fn, *args)]


def _under_policy(fn, policy):
  def under(*args):
    with rt.use_policy(policy):
      return fn(*args)
  return under


def residuals(fn, *args):
  """What is saved, as a sorted list of (shape, dtype, what) records."""
  return sorted((r.shape, r.dtype, r.what) for r in jax_residuals(fn, *args))


def named(records):
  """The checkpoint names among :func:`residuals` records."""
  return {what[len("named "):] for _, _, what in records
          if what.startswith("named ")}


def jax_accounting(fn, args, policy):
  """(count, activation bytes, argument count) from JAX's saved_residuals,
  with ``fn`` traced under the ambient ``policy``."""
  found = jax_residuals(fn, *args, policy=policy)
  arguments = [r for r in found if r.kind == "argument"]
  return (len(found), sum(r.nbytes for r in found) - sum(r.nbytes for r in arguments),
          len(arguments))


def jax_activation_bytes(fn, args, policy):
  """Device bytes of the residuals JAX itself reports with ``fn`` traced
  under the ambient ``policy``, less arguments: constants and literals
  count, as they do in ``ResidualReport.activation_bytes``."""
  return sum(r.nbytes for r in jax_residuals(fn, *args, policy=policy)
             if r.kind != "argument")


def jax_kinds(fn, args, policy):
  """(kind, shape, bytes) of each residual JAX lists, sorted, with ``fn``
  traced under the ambient ``policy``; kinds as ``rt.analyze`` names them."""
  return sorted((r.kind, r.shape, r.nbytes)
                for r in jax_residuals(fn, *args, policy=policy))


def reports_of(fn, args, policies):
  """``rt.analyze`` of ``fn`` under each policy, in order, on one trace.

  Through ``rt.compare``, under names of their own (policies of one name
  would share a row); what the reports warn about is not these tests' subject.
  """
  policies = [rt.get_policy(p) if isinstance(p, str) else p for p in policies]
  renamed = [dataclasses.replace(p, name=f"policy-{i}")
             for i, p in enumerate(policies)]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    reports = rt.compare(fn, *args, policies=renamed).reports
  return [reports[p.name] for p in renamed]


def runnable_policies() -> list[str]:
  """The built-in policies that can run in the current remat mode."""
  runnable = []
  for name in rt.list_policies():
    if not (rt.get_policy(name).offloads and offloading_unsupported()):
      runnable.append(name)
  return runnable


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


# ---------------------------------------------------------------- programs

def remat_bodies(jaxpr):
  """The bodies of every remat region in ``jaxpr``, in program order: those
  inside scans and inside other regions included."""
  bodies = []
  for eqn in jaxpr.eqns:
    if compat.is_remat(eqn):
      bodies.append(compat.remat_body_of(eqn))
    for sub in _jaxpr.sub_jaxprs(eqn):
      bodies.extend(remat_bodies(sub))
  return bodies


#: Remat regions in a jaxpr, nested ones and those inside scans included.
count_remat_regions = _regions.count_remat_regions
#: Every checkpoint name a jaxpr holds, sub-jaxprs included.
checkpoint_names = _jaxpr.names_in
#: The checkpoint name an equation attaches (None if none), in either mode.
checkpoint_name_of = compat.checkpoint_name_of
#: The Flax module path an equation was made in (``layers_0/mlp``).
module_path = _jaxpr.module_path
#: The jaxprs an equation holds (a scan's body, a region's, a call's).
sub_jaxprs = _jaxpr.sub_jaxprs
def without_dead_code(jaxpr):
  """``jaxpr`` less the equations no output needs (remat3 leaves some)."""
  return compat.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))


#: ``device_put`` equations moving values to host memory, sub-jaxprs included.
count_host_offloads = _jaxpr.count_host_offloads
#: The primitive ``jax.ad_checkpoint.checkpoint_name`` binds (remat2's view):
#: what a policy is called with to decide a name.
name_p = compat.name_p
#: Whether an equation is a remat region, or a scan (linearized ones too).
is_remat = compat.is_remat
is_scan = compat.is_scan


# ---------------------------------------------------------------- two tagged blocks

#: Fixed inputs of :func:`two_block_loss` (weights, batch).
W = jnp.linspace(-0.5, 0.5, 64, dtype=jnp.float32).reshape(8, 8)
X = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)


@rt.remat
def tagged_block(w, x):
  """One region reading the ambient policy, with ``ffn.up`` and ``ffn.down``."""
  h = rt.tag(x @ w, "ffn.up")
  return jnp.tanh(rt.tag(jnp.sin(h) @ w, "ffn.down"))


def two_block_loss(w, x):
  """Two :func:`tagged_block` regions, a scalar loss of ``(W, X)``."""
  return (tagged_block(w, tagged_block(w, x)) ** 2).sum()


# ---------------------------------------------------------------- command line

def run_cli(*argv: str) -> tuple[int, str, str]:
  """Runs the ``remat-toolkit`` command in-process: (status, stdout, stderr).

  Through ``remat_toolkit.__main__.main``, what ``python -m remat_toolkit``
  and the console script call; an exit argparse makes itself is a status.
  """
  out, err = io.StringIO(), io.StringIO()
  with redirect_stdout(out), redirect_stderr(err):
    try:
      status = _cli_main([str(a) for a in argv])
    except SystemExit as exit_:
      status = exit_.code
  return status, out.getvalue(), err.getvalue()


def policy_sources() -> dict[str, str]:
  """Where each policy in the catalogue comes from, as ``remat-toolkit list
  --json`` says: a file's path, ``"python"``, or the baselines' note."""
  status, out, err = run_cli("list", "--json")
  assert status == 0, err
  return {p["name"]: p["source"] for p in json.loads(out)}


# ---------------------------------------------------------------- gradients

def grad_of(loss, *args):
  """``jax.grad(loss)(*args)``, traced once and run op by op.

  Op-by-op execution shares compiled primitives across every test, where a
  ``jit`` per model would compile each program anew.
  """
  closed, out_shape = jax.make_jaxpr(jax.grad(loss), return_shape=True)(*args)
  flat = compat.eval_jaxpr(closed.jaxpr, closed.consts,
                           *jax.tree.leaves(args))
  return jax.tree.unflatten(jax.tree.structure(out_shape), flat)


#: XLA options for the tests' gradient programs: LLVM optimisation off
#: compiles two to three times faster on CPU; the HLO passes (fusion, CSE,
#: remat's optimisation barriers) still run.
QUICK_XLA = {"xla_backend_optimization_level": 0,
             "xla_llvm_disable_expensive_passes": True}
#: Relative tolerance of a gradient check, by the dtype the model computes in.
GRADIENT_RTOL = {"float32": 1e-5, "bfloat16": 1e-2}


def assert_gradients_close(got, want, rtol, label=""):
  """``(loss, grads)`` pairs equal norm-wise, as ``rt.verify`` compares them.

  The loss is measured against its own size; every gradient leaf against
  the largest gradient entry of all leaves, so rounding noise on a leaf whose
  exact gradient is zero is not a large relative error. Non-finite entries
  must sit in the same places.
  """
  (got_loss, got_grads), (want_loss, want_grads) = got, want
  got_leaves = jax.tree.leaves(got_grads)
  want_leaves = jax.tree.leaves(want_grads)
  assert len(got_leaves) == len(want_leaves), label
  scale = max((float(np.max(np.abs(np.asarray(w, np.float64)), initial=0.0))
               for w in want_leaves), default=0.0)
  pairs = [(got_loss, want_loss, abs(float(want_loss)))]
  pairs += [(g, w, scale) for g, w in zip(got_leaves, want_leaves, strict=True)]
  for i, (g, w, size) in enumerate(pairs):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.array_equal(np.isfinite(g), np.isfinite(w)), (label, i)
    finite = np.isfinite(w)
    diff = float(np.max(np.abs(g - w)[finite], initial=0.0))
    assert diff <= rtol * size, (label, "loss" if i == 0 else f"leaf {i - 1}",
                                 diff, size)


def concrete(tree, seed=0):
  """``tree`` with its ``jax.ShapeDtypeStruct`` leaves made arrays.

  Floats are ``N(0, 1/fan_in)`` (fan-in: the second-to-last axis), so
  activations stay of order one; integers and booleans are zeros (valid
  token ids and masks); PRNG keys are split from ``seed``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
  out = []
  for key, leaf in zip(keys, leaves, strict=False):
    if not isinstance(leaf, jax.ShapeDtypeStruct):
      out.append(leaf)
    elif jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      out.append(jax.random.split(key, max(1, math.prod(leaf.shape))).reshape(
          leaf.shape))
    elif jnp.issubdtype(leaf.dtype, jnp.inexact):
      fan_in = leaf.shape[-2] if len(leaf.shape) >= 2 else 1
      out.append((jax.random.normal(key, leaf.shape) / math.sqrt(max(fan_in, 1))
                  ).astype(leaf.dtype))
    else:
      out.append(jnp.zeros(leaf.shape, leaf.dtype))
  return jax.tree.unflatten(treedef, out)


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


@rt.remat
def _mlp_block(w, x):
  up = rt.tag(x @ w[0], "ffn.up")
  return x + rt.tag(jnp.tanh(up) @ w[1], "ffn.down")


def scanned_mlp_loss(params, batch):
  """A residual MLP whose layers run under scan, one remat region each."""
  def layer(x, w):
    return _mlp_block(w, x), None

  x, _ = jax.lax.scan(layer, batch["x"], params["w"])
  return jnp.mean((x - batch["y"]) ** 2)


def scanned_mlp_args(batch_size=8, abstract=False, layers=4, width=16):
  """``(params, batch)`` for :func:`scanned_mlp_loss`: arrays, or their
  ``jax.ShapeDtypeStruct`` with ``abstract``."""
  params = {"w": jax.random.normal(jax.random.key(0),
                                   (layers, 2, width, width)) * 0.1}
  batch = {"x": jax.random.normal(jax.random.key(1), (batch_size, width)),
           "y": jax.random.normal(jax.random.key(2), (batch_size, width))}
  if abstract:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, batch))
  return params, batch


# ---------------------------------------------------------------- documentation

def scanned_sine(w, x):
  """A scan whose 16-bit stacked input is computed in the step and only read
  by elementwise math (no matmul), the loop its last reader."""
  xs = (x * 2).astype(jnp.bfloat16)

  def body(carry, s):
    return carry + jnp.sin(s).astype(jnp.float32) * w, None
  return jax.lax.scan(body, jnp.zeros(x.shape[1:], jnp.float32), xs)[0].sum()


def _load_docs_examples():
  """``docs/_ext/example_outputs.py``, loaded by path (it is build code, not a
  package): the pages' parser, runner and output comparison, one copy for the
  tests and the script that writes the pages' output blocks."""
  path = Path(__file__).resolve().parent.parent / "docs" / "_ext" / "example_outputs.py"
  spec = importlib.util.spec_from_file_location("docs_example_outputs", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while defining
  spec.loader.exec_module(module)
  return module


#: The docs pages' examples: :func:`docs_examples.reader_environment`,
#: ``.examples``, ``.differences``, ``.layout_problems`` (see that file).
docs_examples = _load_docs_examples()
#: A fenced block of a Markdown page, its directive (``skip:``, ``file:``,
#: ``output:``) included.
CodeBlock = docs_examples.CodeBlock
#: The fenced blocks of a Markdown file, in order.
markdown_code_blocks = docs_examples.markdown_code_blocks
#: Runs a page's Python blocks in order in one namespace, as a reader would:
#: what each printed, by the line of its fence.
run_markdown_examples = docs_examples.run_examples



def xla_step_bytes(fn, args, policy, optimizer=None) -> int:
  """XLA's figure of one step of ``fn`` under ``policy``, compiled here (the
  oracle ``rt.peak(..., compile=True)``, ``compare`` and ``plan`` are checked
  against): argument + output + temp - alias of ``memory_analysis()``, for
  ``jax.jit(jax.grad(fn))``, or with ``optimizer`` the optax train step with
  the parameters (``args[0]``) and the state donated."""
  with rt.use_policy(policy):
    if optimizer is None:
      lowered = jax.jit(jax.grad(fn)).lower(*args)
    else:
      def step(params, state, *rest):
        updates, state = optimizer.update(jax.grad(fn)(params, *rest), state,
                                          params)
        return optax.apply_updates(params, updates), state
      state = jax.eval_shape(optimizer.init, args[0])
      lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
          args[0], state, *args[1:])
    m = lowered.compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes
          + m.temp_size_in_bytes - m.alias_size_in_bytes)
