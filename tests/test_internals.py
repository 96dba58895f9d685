"""Internal invariants with no public face, checked white-box.

Every other test checks behaviour through the public API. What is here is an
optimisation or an internal contract whose only visible effect is that the
public figures do not change, so a public test cannot tell it is in place:
each test says what it guards and why it cannot be seen from outside.
"""

import ast
import collections
from pathlib import Path
from unittest import mock

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from shared_helpers import W
from shared_helpers import X
from shared_helpers import remat3
from shared_helpers import remat_bodies
from shared_helpers import tagged_block
from shared_helpers import two_block_loss as loss

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit._src.analysis import diagnose
from remat_toolkit._src.analysis import regions as _regions
from remat_toolkit._src.analysis import report
from remat_toolkit._src.analysis import residuals as _residuals
from remat_toolkit._src.analysis import trace
from remat_toolkit._src.core import jaxpr as _jaxpr

cp = jax.checkpoint_policies


# ---------------------------------------------------------------- shared bodies

@pytest.mark.pins_mode
@pytest.mark.parametrize("framework, layer", [("linen", "layers_{}/attn"),
                                              ("nnx", "layers/{}/attn")])
def test_identical_layers_share_one_body_without_changing_the_report(
    framework, layer):
  """The analyzer makes identical unrolled layers one jaxpr, so analysing a
  policy costs one layer's work: only its speed shows, and the report must
  be the one an unshared trace gives."""
  fn, args = models.build_loss(models.get_config("tiny", num_layers=4),
                               scan=False, framework=framework)
  with remat3(False):  # remat3 re-traces regions itself: nothing is shared
    program = trace.TracedProgram(fn, args)
    bodies = {id(body) for body in remat_bodies(program.jaxpr.jaxpr)}
    assert program.regions == 4 and len(bodies) == 1
    shared = report.build_report(program, rt.get_policy("save-attention"))
    with mock.patch.object(_regions, "share_identical_regions", lambda j, m: j):
      plain = report.build_report(trace.TracedProgram(fn, args),
                                  rt.get_policy("save-attention"))
  assert shared.to_dict() == plain.to_dict()
  assert {layer.format(i) for i in range(4)} <= {
      r.module_path for r in shared.activations}


# ---------------------------------------------------------------- shared steps
# Policies that lower differently but decide alike on a program share one
# traced step; its figures must be each policy's own.

def _alike_policies():
  # An exact name is kept as written, so "ffn.up" alone and with a name the
  # model lacks lower to different JAX policies that save the same values.
  return (rt.Policy(name="up", save=("ffn.up",)),
          rt.Policy(name="up-and-absent", save=("ffn.up", "not.in.model")),
          rt.Policy(name="down", save=("ffn.down",)))


def test_policies_that_decide_alike_share_one_step():
  up, absent, down = _alike_policies()
  with remat3(False):  # remat3 reads policies by type: nothing is shared
    program = trace.TracedProgram(loss, (W, X))
    assert program.lowered(up) != program.lowered(absent)
    assert program.step(absent) is program.step(up)
    assert program.step(down) is not program.step(up)
    shared = {p.name: report.build_report(program, p).to_dict()
              for p in (up, absent, down)}
    alone = {p.name: report.build_report(trace.TracedProgram(loss, (W, X)),
                                         p).to_dict()
             for p in (up, absent, down)}
  assert shared == alone
  assert shared["up"]["activation_bytes"] > 0


def test_a_raw_jax_policy_shares_no_step():
  """A raw JAX policy is the user's code: it is called only as JAX calls
  it, never asked again to compare it with another."""
  calls = collections.Counter()

  def counting(prim, *args, **params):
    calls["asked"] += 1
    return jax.checkpoint_policies.save_only_these_names("ffn.up")(
        prim, *args, **params)

  up = _alike_policies()[0]
  with remat3(False):
    program = trace.TracedProgram(loss, (W, X))
    program.step(up)
    raw = rt.Policy(name="raw", jax_policy=counting)
    step = program.step(raw)
    asked = calls["asked"]
    assert step is not program.step(up) and asked > 0
    program.step(rt.Policy(name="after", save=("ffn.up", "absent.name")))
    assert calls["asked"] == asked


@pytest.mark.pins_mode
def test_walks_of_shared_bodies_find_what_every_walk_finds():
  """parameter_vars and argument_positions skip a walk of a shared body
  that cannot add anything: the result is the walk-every-time one."""
  fn, args = models.build_loss(models.get_config("tiny", num_layers=3),
                               scan=False)
  with remat3(False):
    program = trace.TracedProgram(fn, args)
    step = program.step(rt.get_policy("save-attention")).jaxpr.jaxpr
  with mock.patch.object(_jaxpr._Revisits, "unchanged", lambda self, j: False):
    every_params = _jaxpr.parameter_vars(step)
    every_args = _jaxpr.argument_positions(step)
  assert _jaxpr.parameter_vars(step) == every_params
  assert _jaxpr.argument_positions(step) == every_args


# ---------------------------------------------------------------- the report builder
# The traced program measures; the report builder diagnoses, once per program
# and once per policy. Diagnosing twice and dropping the repeats gives the
# same warnings, so only the counts show the builder is in place.

@rt.remat(policy="save-ffn")
def _own_block(w, x):
  return jnp.tanh(rt.tag(x @ w, "ffn.up"))


def _mixed_loss(w, x):
  """One region with its own policy, and two taking the policy analysed."""
  return _own_block(w, tagged_block(w, tagged_block(w, x))).sum()


def test_the_traced_program_only_measures():
  """No report, no finding: trace.py imports neither the diagnosis nor the
  report builder, nor makes a result."""
  for method in ("report", "kernel_findings"):
    assert not hasattr(trace.TracedProgram, method), method
  tree = ast.parse(Path(trace.__file__).read_text(encoding="utf-8"))
  imported = {a.name for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom)
              for a in node.names} | {node.module for node in ast.walk(tree)
                                      if isinstance(node, ast.ImportFrom)}
  assert not imported & {"diagnose", "report", "ResidualReport", "Finding",
                         "remat_toolkit._src.analysis.diagnose",
                         "remat_toolkit._src.analysis.report"}, imported


def test_compare_diagnoses_the_program_once_and_each_policy_once(monkeypatch):
  calls = collections.Counter()

  def counted(module, name):
    real = getattr(module, name)

    def call(*args, **kwargs):
      calls[name] += 1
      return real(*args, **kwargs)

    monkeypatch.setattr(module, name, call)

  for name in ("program_findings", "policy_findings"):
    counted(report, name)
  for name in ("selection_warnings", "per_region_warnings", "kernel_warnings"):
    counted(diagnose, name)
  policies = ["boundary-only", "save-ffn", "save-qkv"]
  with pytest.warns(UserWarning) as raised:
    comparison = rt.compare(_mixed_loss, W, X, policies=policies)
  assert calls == {"program_findings": 1, "policy_findings": 3,
                   "selection_warnings": 3, "per_region_warnings": 3,
                   "kernel_warnings": 3}
  # Each finding once, without dropping repeats: the regions' for no one
  # policy, then the policy keeping none of its names; each report words
  # the regions' finding for its own policy.
  assert [(w.kind, w.policy) for w in comparison.warnings] == [
      ("own-policies", None), ("keeps-none", "save-qkv")]
  assert "1 of 3 remat regions has its own policy" in comparison.warnings[0]
  assert [str(w.message) for w in raised] == list(comparison.warnings)
  for name, r in comparison.reports.items():
    assert r.warnings[0].kind == "own-policies"
    assert f"ignores policy {name!r}" in r.warnings[0]


# ---------------------------------------------------------------- jaxpr helpers verify uses
# What rt.verify reports rests on these walks (effects re-run in regions,
# the no-remat reference, one trace or two); each is checked on a jaxpr
# whose answer is known.

def test_effects_in_remat_regions_walks_nested_regions_and_scans():
  def f(x):
    def inner(x):
      jax.debug.callback(lambda v: None, x.sum())
      return jnp.sin(x)

    def outer(x):
      return jax.checkpoint(inner)(x) * 2.0

    def body(c, _):
      return jax.checkpoint(outer)(c), None

    jax.debug.callback(lambda v: None, x.sum())  # outside any region
    return jax.lax.scan(body, x, None, length=3)[0].sum()

  sites = _regions.effects_in_remat_regions(jax.make_jaxpr(f)(X).jaxpr)
  assert [s.primitive for s in sites] == ["debug_callback"]
  assert sites[0].effects and "test_internals.py" in sites[0].source


def test_strip_remat_removes_every_region(remat_mode):
  def f(w, x):
    inner = jax.checkpoint(lambda x: jnp.sin(x @ w), policy=cp.dots_saveable)
    return jax.checkpoint(lambda x: jnp.tanh(inner(x)))(x).sum() + loss(w, x)

  closed = jax.make_jaxpr(f)(W, X)
  assert _regions.count_remat_regions(closed.jaxpr) == 4
  stripped, left = _regions.strip_remat(closed.jaxpr)
  assert left == 0 and _regions.count_remat_regions(stripped) == 0
  got = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(stripped, closed.consts))(
      W, X)[0]
  np.testing.assert_allclose(got, f(W, X), rtol=1e-6)


def test_trace_difference_ignores_shared_subjaxprs_and_addresses():
  helper = jax.jit(lambda x: jnp.sin(x) * 2.0)

  def f(x):
    return helper(helper(x)).sum() + jax.nn.relu(x).sum()

  first = jax.make_jaxpr(f)(X)
  second = jax.make_jaxpr(f)(X)  # helper's jaxpr now comes from a cache
  assert _jaxpr.trace_difference(first, second) is None
  scaled = jax.make_jaxpr(lambda x: f(x) * 3.0)(X)
  assert "mul" in _jaxpr.trace_difference(first, scaled)


def test_trace_difference_compares_captured_constants():
  def with_const(value):
    return jax.make_jaxpr(lambda x: x + np.full((4, 8), value, np.float32))(X)

  assert _jaxpr.trace_difference(with_const(1.0), with_const(1.0)) is None
  assert _jaxpr.trace_difference(with_const(1.0), with_const(2.0))


def test_residual_origins_carry_the_step_variable_holding_each(remat_mode):
  program = trace.TracedProgram(loss, (W, X))
  for name in ("boundary-only", "save-ffn", "save-everything"):
    step = program.step(rt.get_policy(name))
    origins = _residuals.residual_origins(step.jaxpr, 1, step.num_residuals)
    outvars = set(step.jaxpr.jaxpr.outvars)
    invars = set(step.jaxpr.jaxpr.invars)
    for o in origins:
      assert tuple(o.var.aval.shape) == tuple(o.aval.shape)
      assert o.var in (invars if o.kind == "argument" else outvars)


def test_float_dtypes_in_finds_dtypes_inside_nested_jaxprs():
  f = jax.jit(lambda x: jnp.sin(x.astype(jnp.bfloat16)).astype(jnp.float32))
  dtypes = _jaxpr.float_dtypes_in(jax.make_jaxpr(f)(X).jaxpr)
  assert dtypes == {np.dtype(jnp.bfloat16), np.dtype(jnp.float32)}
