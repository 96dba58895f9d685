"""Pins the JAX behaviour remat-toolkit relies on, per JAX release.

The package detects what a release can do (``_compat``); this file states,
for each supported release, what that detection must find and what JAX then
does. When a JAX release changes one of these facts, this file fails first
and ``remat_toolkit/_src/core/compat/`` is the one package to adapt.
"""

import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_helpers import jax_release
from shared_helpers import jax_residuals
from shared_helpers import scanned_sine

import remat_toolkit as rt
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr
from remat_toolkit._src.policies import lowering

cp = jax.checkpoint_policies


def _fn(x, w):
  a = rt.tag(jnp.sin(x @ w), "a")
  b = rt.tag(jnp.tanh(a @ w), "b")
  return jnp.sum(jnp.cos(b))


X = jnp.linspace(0.0, 1.0, 12).reshape(3, 4)
W = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)


def _saved(policy, fn=_fn):
  return sorted((str(aval), desc) for aval, desc in
                compat.saved_residuals(jax.checkpoint(fn, policy=policy),
                                          X, W))


def _saved_names(policy):
  return {r.name for r in jax_residuals(jax.checkpoint(_fn, policy=policy), X, W)
          if r.name}


# ------------------------------------------------------------ remat3 flag


def test_remat3_context_manager_sets_and_restores_the_flag():
  before = compat.remat3_enabled()
  with compat.remat3(not before):
    assert compat.remat3_enabled() is (not before)
    assert jax.config.jax_remat3 is (not before)
  assert compat.remat3_enabled() is before


def test_remat3_context_manager_restores_after_an_error():
  before = compat.remat3_enabled()
  with pytest.raises(RuntimeError):
    with compat.remat3(not before):
      raise RuntimeError("inside")
  assert compat.remat3_enabled() is before


def test_remat_mode_fixture_sets_the_flag(remat_mode):
  assert compat.remat3_enabled() is remat_mode


# ------------------------------------------------------------ policy drift


def test_our_test_function_really_saves_names(remat_mode):
  assert _saved_names(cp.save_only_these_names("a")) == {"a"}
  assert _saved_names(cp.save_only_these_names("a", "b")) == {"a", "b"}
  assert _saved(cp.nothing_saveable) != _saved(cp.everything_saveable)


def test_save_anything_except_these_names_is_a_stub(remat_mode):
  # It ignores its arguments: it saves the excluded name too, or, under a
  # remat3 that calls no plain function, nothing at all. Either way it does
  # not do what its name says.
  stub = cp.save_anything_except_these_names("a")
  assert stub("anything") is True
  if remat_mode and not compat.remat3_calls_policies():
    assert _saved(stub) == _saved(cp.nothing_saveable)
  else:
    assert "a" in _saved_names(stub)


def test_save_any_names_but_these_is_the_working_spelling(remat_mode):
  assert _saved_names(cp.save_any_names_but_these("a")) == {"b"}


@pytest.mark.parametrize("make_policy", [
    lambda: cp.save_from_both_policies(cp.save_only_these_names("a"),
                                       cp.dots_saveable),
    lambda: cp.save_and_offload_only_these_names(
        names_which_can_be_saved=["a"], names_which_can_be_offloaded=["b"],
        offload_src="device", offload_dst="pinned_host"),
    lambda: cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    lambda: (lambda prim, *avals, **params: True),
], ids=["save_from_both", "save_and_offload", "offload_dots", "lambda"])
def test_plain_callables_under_remat3_follow_the_detected_feature(
    make_policy, remat_mode):
  # jax 0.10's remat3 honours only JAX's policy classes: any other callable
  # silently becomes full remat. From jax 0.11 remat3 calls every policy.
  policy = make_policy()
  honoured = compat.remat3_calls_policies()
  assert compat.remat3_honours(policy) is honoured
  if remat_mode and not honoured:
    assert _saved(policy) == _saved(cp.nothing_saveable)
  else:
    assert _saved(policy) != _saved(cp.nothing_saveable)


@pytest.mark.parametrize("policy", [
    cp.save_only_these_names("a"), cp.save_any_names_but_these("a"),
    cp.dots_saveable, cp.dots_with_no_batch_dims_saveable,
    cp.everything_saveable, cp.nothing_saveable,
], ids=["only_names", "any_but", "dots", "dots_no_batch", "everything",
        "nothing"])
def test_jax_policy_classes_mean_the_same_under_both_modes(policy):
  assert compat.remat3_honours(policy)
  with compat.remat3(False):
    remat2 = [aval for aval, _ in _saved(policy)]  # labels differ by mode
    inputs_only = _saved(cp.nothing_saveable)
  with compat.remat3(True):
    remat3 = [aval for aval, _ in _saved(policy)]
  if policy is cp.everything_saveable:
    # remat2 keeps unnamed intermediates too, remat3 the named values: both
    # keep more than the inputs, but not the same list.
    assert len(remat2) > len(inputs_only) and len(remat3) > len(inputs_only)
  else:
    assert remat2 == remat3


def test_offloaded_residuals_are_host_memory():
  policy = cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=["a"],
      offload_src="device", offload_dst="pinned_host")
  with compat.remat3(False):
    residuals = compat.saved_residuals(jax.checkpoint(_fn, policy=policy),
                                          X, W)
  kinds = [_jaxpr.memory_kind_of(aval) for aval, _ in residuals]
  assert kinds.count("host") == 1
  host = [d for (aval, d), k in zip(residuals, kinds, strict=True)
          if k == "host"]
  assert "device_put" in host[0]


# ------------------------------------------------------------ per release

#: What each supported JAX minor release can do, as measured.
RELEASES = {
    "0.10": dict(remat3_calls_policies=False, remat3_offloads=False,
                 remat3_everything_keeps_unnamed=False,
                 closed_jaxpr_is_jaxpr=False, policy_classes=True),
    "0.11": dict(remat3_calls_policies=True, remat3_offloads=True,
                 remat3_everything_keeps_unnamed=True,
                 closed_jaxpr_is_jaxpr=True, policy_classes=True),
    "0.12": dict(remat3_calls_policies=True, remat3_offloads=True,
                 remat3_everything_keeps_unnamed=True,
                 closed_jaxpr_is_jaxpr=True, policy_classes=False),
}


_release = jax_release


@pytest.mark.skipif(_release() not in RELEASES,
                    reason="a JAX release outside the tested range")
def test_detected_features_are_the_measured_ones_for_this_release():
  expected = RELEASES[_release()]
  assert compat.remat3_calls_policies() is expected["remat3_calls_policies"]
  assert compat.remat3_offloads() is expected["remat3_offloads"]
  assert (compat.remat3_everything_keeps_unnamed()
          is expected["remat3_everything_keeps_unnamed"])
  assert (compat.ClosedJaxpr is compat.Jaxpr) is expected[
      "closed_jaxpr_is_jaxpr"]
  classes = compat._policy_classes()
  is_class = bool(classes) and isinstance(cp.save_only_these_names("a"), classes)
  assert is_class is expected["policy_classes"]


#: Whether ``dots_saveable`` keeps a convolution output, per release, with
#: ``jax_remat3`` (off, on). None: not yet measured on that release (the
#: probe then decides, and this pin says nothing).
DOTS_SAVEABLE_KEEPS_CONVS = {
    "0.10": (True, False),
    "0.11": None,
    "0.12": (True, True),
}


def _conv_fn(w, x):
  y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jnp.sum(jnp.sin(y))


@pytest.mark.parametrize("remat3_on", [False, True], ids=["remat2", "remat3"])
def test_dots_saveable_keeps_convs_is_what_jax_keeps(remat3_on):
  w = jax.ShapeDtypeStruct((3, 3, 2, 2), jnp.float32)
  x = jax.ShapeDtypeStruct((1, 4, 4, 2), jnp.float32)
  with compat.remat3(remat3_on):
    kept = [d for _, d in compat.saved_residuals(jax.checkpoint(
        _conv_fn, policy=jax.checkpoint_policies.dots_saveable), w, x)]
    detected = compat.dots_saveable_keeps_convs()
  assert detected is any("conv_general_dilated" in d for d in kept)
  measured = DOTS_SAVEABLE_KEEPS_CONVS.get(_release())
  if measured is not None:
    assert detected is measured[remat3_on]


#: Whether the XLA:CPU of each release computes a parameter's cast once for
#: both passes of a remat region, and converts a loop's 16-bit stacked input
#: whole (rt.peak's model follows the probes). None: not yet measured.
XLA_CPU_MERGES_PARAMETER_CASTS = {"0.10": True, "0.11": None, "0.12": False}
XLA_CPU_CONVERTS_LOOP_INPUTS = {"0.10": True, "0.11": None, "0.12": False}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_xla_merges_parameter_casts_is_what_xla_compiles():
  """The probe against the compiled program read independently: the number
  of distinct casts of the first layer's weight in XLA's optimized HLO."""
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)
  hlo = jax.jit(jax.grad(compat._cast_layers)).lower([w, w], x).compile()
  entry = hlo.as_text().split("ENTRY", 1)[1]
  param = next(line.split("=")[0].strip() for line in entry.splitlines()
               if "parameter(0)" in line)
  readers = [line for line in entry.splitlines()
             if param in line and not line.strip().startswith(param + " ")]
  assert compat.xla_merges_parameter_casts() is (len(readers) == 1)
  measured = XLA_CPU_MERGES_PARAMETER_CASTS.get(_release())
  if measured is not None:
    assert compat.xla_merges_parameter_casts() is measured


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_xla_converts_loop_inputs_whole_is_what_xla_compiles():
  """The probe against the compiled loop read independently: the loop's
  operands in XLA's optimized HLO carry the stacked input in float32."""
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  xs = jax.ShapeDtypeStruct((12, 16, 128), jnp.bfloat16)
  hlo = jax.jit(compat._scanned_matmul).lower(w, xs).compile().as_text()
  loop = next(line for line in hlo.split("ENTRY", 1)[1].splitlines()
              if " while(" in line)
  assert compat.xla_converts_loop_inputs_whole() is ("f32[12,16,128]" in loop)
  measured = XLA_CPU_CONVERTS_LOOP_INPUTS.get(_release())
  if measured is not None:
    assert compat.xla_converts_loop_inputs_whole() is measured


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="measured on XLA:CPU")
def test_a_loop_input_read_by_elementwise_math_is_converted_as_the_probe_says():
  """The probe compiles a matmul's loop; the peak model applies what it
  finds to every 16-bit stacked input a body reads. Pinned here: XLA
  converts one only sine reads (no matmul) whole, before the loop, exactly
  where the probe says it converts a matmul's."""
  w = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((12, 16, 128), jnp.bfloat16)
  hlo = jax.jit(scanned_sine).lower(w, x).compile().as_text()
  # Nothing else in the step is (12, 16, 128) float32: x is bfloat16.
  entry = hlo.split("ENTRY", 1)[1]
  assert compat.xla_converts_loop_inputs_whole() is ("f32[12,16,128]" in entry)



@pytest.mark.parametrize("trips", [1, 2])
def test_xla_runs_a_loop_of_one_trip_inline(trips):
  """The peak model runs a scan of length 1 as its body, inline
  (``liveness._single_iteration_body``): XLA's loop simplifier removes a
  loop of one trip, and keeps a loop of two."""
  def fn(ws, x):
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0].sum()
  hlo = jax.jit(jax.grad(fn)).lower(jnp.ones((trips, 16, 16)),
                                    jnp.ones((4, 16))).compile().as_text()
  assert (" while(" in hlo) is (trips > 1)

def test_is_computed_tells_arguments_and_constants_from_computed_values():
  """What decides whether a region's input is worth moving to the host."""
  const = jnp.ones(3)
  seen = {}

  def fn(w, x):
    seen["argument"] = compat.is_computed(w)
    seen["argument, not differentiated"] = compat.is_computed(x)
    seen["constant"] = compat.is_computed(const)
    y = jnp.sin(x) * w
    seen["computed"] = compat.is_computed(y)
    jax.vmap(lambda r: seen.setdefault("batched", compat.is_computed(r)))(y)

    def body(carry, xs):
      seen.setdefault("loop carry", compat.is_computed(carry))
      return carry * xs, None

    y, _ = jax.lax.scan(body, y, jnp.stack([w, w]))
    jax.checkpoint(lambda a: seen.setdefault(
        "checkpoint argument", compat.is_computed(a)) or a)(y)
    return y.sum()

  jax.jit(jax.grad(fn))(jnp.ones(3), jnp.ones(3))
  assert seen == {"argument": False, "argument, not differentiated": False,
                  "constant": False, "computed": True, "batched": True,
                  "loop carry": True, "checkpoint argument": False}
  eager = []

  def eager_fn(w):
    eager.append(compat.is_computed(w))
    return w.sum()

  jax.grad(eager_fn)(jnp.ones(3))
  assert eager == [True]  # no program to be an input of: as before


def test_a_nested_jit_argument_is_told_from_the_program_argument():
  """What says a region's inputs arrive through a jit the program calls
  (computed or given cannot be seen there): the parent of the jit's trace."""
  seen = {}

  @jax.jit
  def inner(w, y):
    seen["nested jit argument"] = compat.is_nested_jit_argument(y)
    seen["computed in the nested jit"] = compat.is_nested_jit_argument(y * w)
    return (y * w).sum()

  def fn(w, x):
    seen["program argument"] = compat.is_nested_jit_argument(w)
    return inner(w, jnp.sin(x) * w)

  jax.jit(jax.grad(fn))(jnp.ones(3), jnp.ones(3))
  assert seen == {"program argument": False, "nested jit argument": True,
                  "computed in the nested jit": False}
  seen.clear()
  # Differentiated, not traced (another shape: the jit traces again).
  jax.grad(lambda w: inner(w, w))(jnp.ones(4))
  assert seen["nested jit argument"] is False
  # Traced, but before the program computed anything: its own arguments.
  seen.clear()
  jax.make_jaxpr(jax.jit(jax.grad(lambda w: inner(w, w))))(jnp.ones(5))
  assert seen["nested jit argument"] is False


def test_declared_jax_range_covers_this_release():
  import importlib.metadata
  import re as re_
  requires = importlib.metadata.requires("remat-toolkit") or []
  spec = next(r for r in requires if re_.match(r"jax\b", r) and "extra" not in r)
  upper = re_.search(r"<\s*([0-9.]+)", spec).group(1)
  lower = re_.search(r">=\s*([0-9.]+)", spec).group(1)
  version = tuple(int(p) for p in jax.__version__.split(".")[:3])
  assert tuple(int(p) for p in lower.split(".")) <= version
  assert version < tuple(int(p) for p in upper.split("."))
  assert _release() in RELEASES


def test_jax_policy_is_one_object_per_call():
  a = compat.jax_policy("save_only_these_names", "x", "y")
  assert a is compat.jax_policy("save_only_these_names", "x", "y")
  assert a is not compat.jax_policy("save_only_these_names", "x")
  assert compat.jax_policy("dots_saveable") is cp.dots_saveable
  with pytest.raises(ValueError, match="save_anything_except_these_names"):
    compat.jax_policy("save_anything_except_these_names", "x")


def test_policy_markers_are_distinct_and_save_nothing(remat_mode):
  a, b = compat.policy_marker("m"), compat.policy_marker("m")
  assert a is not b and a != b
  assert _saved(a) == _saved(cp.nothing_saveable)
  _, eqn = _remat_eqn(a, remat_mode)
  assert compat.remat_policy_of(eqn) is a


def test_close_jaxpr_attaches_constants():
  closed = jax.make_jaxpr(lambda x: x + np.arange(4.0, dtype=np.float32))(
      np.ones(4, np.float32))
  again = compat.close_jaxpr(closed.jaxpr, closed.consts)
  assert [np.asarray(c).tolist() for c in compat.jaxpr_consts(again)] == [
      np.asarray(c).tolist() for c in closed.consts]
  out = compat.eval_jaxpr(again.jaxpr, again.consts, np.ones(4, np.float32))
  assert np.asarray(out[0]).tolist() == [1.0, 2.0, 3.0, 4.0]


# ------------------------------------------------------------ equations


def _remat_eqn(policy, remat_mode):
  jaxpr = jax.make_jaxpr(jax.checkpoint(_fn, policy=policy))(X, W)
  found = [e for e in jaxpr.jaxpr.eqns if compat.is_remat(e)]
  assert len(found) == 1
  expected = "call_hi_primitive" if remat_mode else "remat2"
  assert found[0].primitive.name == expected
  return jaxpr, found[0]


def test_checkpoint_name_of(remat_mode):
  jaxpr = jax.make_jaxpr(_fn)(X, W).jaxpr
  names = [compat.checkpoint_name_of(e) for e in jaxpr.eqns]
  assert [n for n in names if n] == ["a", "b"]
  assert names.count(None) == len(names) - 2


def test_is_remat_and_remat_body_of(remat_mode):
  _, eqn = _remat_eqn(cp.save_only_these_names("a"), remat_mode)
  body = compat.remat_body_of(eqn)
  assert isinstance(body, compat.Jaxpr)
  assert [compat.checkpoint_name_of(e) for e in body.eqns
          if compat.checkpoint_name_of(e)] == ["a", "b"]
  assert _jaxpr.sub_jaxprs(eqn)[0].eqns == body.eqns
  plain = jax.make_jaxpr(_fn)(X, W).jaxpr
  assert not any(compat.is_remat(e) for e in plain.eqns)


def test_scan_inputs_and_outputs_are_split_as_jax_lays_them_out():
  def f(w, b, x):
    def body(c, wi):
      return jnp.sin(c @ wi + b[None, :]), c
    return jax.lax.scan(body, x, w)

  eqn = jax.make_jaxpr(f)(jnp.ones((3, 4, 4)), jnp.ones(4), X).jaxpr.eqns[-1]
  assert compat.is_scan(eqn)
  # Inputs: (b), (x), (w); outputs: (carry), (stacked c).
  assert compat.scan_num_consts(eqn) == 1
  assert compat.scan_num_carry(eqn) == 1


def test_remat_policy_of_returns_the_policy_given(remat_mode):
  policy = cp.save_only_these_names("a")
  _, eqn = _remat_eqn(policy, remat_mode)
  assert compat.remat_policy_of(eqn) is policy


def test_remat3_stores_nothing_saveable_as_none(remat_mode):
  _, eqn = _remat_eqn(cp.nothing_saveable, remat_mode)
  expected = None if remat_mode else cp.nothing_saveable
  assert compat.remat_policy_of(eqn) is expected


def test_with_remat_substitutes_the_policy(remat_mode):
  closed, eqn = _remat_eqn(cp.nothing_saveable, remat_mode)
  only_b = cp.save_only_these_names("b")
  new_eqn = compat.with_remat(eqn, compat.remat_body_of(eqn), only_b)
  assert compat.remat_policy_of(new_eqn) is only_b
  eqns = [new_eqn if e is eqn else e for e in closed.jaxpr.eqns]
  swapped = closed.jaxpr.replace(eqns=eqns)

  def run(jaxpr):
    return lambda x, w: compat.eval_jaxpr(jaxpr, closed.consts, x, w)[0]

  def names(jaxpr):
    return {r.name for r in jax_residuals(run(jaxpr), X, W) if r.name}

  assert names(closed.jaxpr) == set()
  assert names(swapped) == {"b"}
  assert jnp.allclose(run(swapped)(X, W), _fn(X, W))


# ------------------------------------------------------------ flax


class _Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, name="proj")(x)
    return nn.Dense(4, name="out")(jnp.tanh(h))


class _Model(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _Block(name="block")(x)


def test_module_path_on_a_flax_linen_model(remat_mode):
  model = _Model()
  x = jnp.ones((2, 4))
  params = jax.eval_shape(model.init, jax.random.key(0), x)  # no compile
  jaxpr = jax.make_jaxpr(model.apply)(params, x).jaxpr
  dots = [_jaxpr.module_path(e) for e in jaxpr.eqns
          if e.primitive.name == "dot_general"]
  assert dots == ["_Model/block/proj", "_Model/block/out"]
  tanh = [_jaxpr.module_path(e) for e in jaxpr.eqns
          if e.primitive.name == "tanh"]
  assert tanh == ["_Model/block"]


def test_module_path_drops_transform_scopes(remat_mode):
  model = nn.remat(_Model)()
  x = jnp.ones((2, 4))
  params = jax.eval_shape(model.init, jax.random.key(0), x)  # no compile
  jaxpr = jax.make_jaxpr(lambda p, x: jax.grad(
      lambda p: model.apply(p, x).sum())(p))(params, x).jaxpr

  def paths(j):
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        yield _jaxpr.module_path(e)
      for sub in _jaxpr.sub_jaxprs(e):
        yield from paths(sub)

  found = set(paths(jaxpr))
  assert "_Model/block/proj" in found
  assert all("jvp" not in p and "transpose" not in p for p in found)


# ------------------------------------------------------------ the boundary

_PRIVATE = re.compile(r"jax\._src|from flax\.core import lift|flax\.core\.lift\b"
                      r"|linen\.transforms|from flax\.linen import transforms"
                      r"|jax_remat3")


def test_only_the_compat_layer_touches_jax_and_flax_internals():
  import pathlib
  package = pathlib.Path(rt.__file__).parent
  offenders = []
  for path in sorted(package.rglob("*.py")):
    if path.relative_to(package).parts[:3] == ("_src", "core", "compat"):
      continue
    for number, line in enumerate(path.read_text().splitlines(), 1):
      code = line.split("#")[0]
      if _PRIVATE.search(code) and not code.lstrip().startswith(('"', "'")):
        if "import" in code or "config" in code:
          offenders.append(f"{path.name}:{number}: {line.strip()}")
  assert not offenders, offenders


# ---------------------------------------------------------------- jit keys

def test_this_jax_has_user_contexts_in_jit_keys():
  # Both supported releases have jax.make_user_context; the fallback warns.
  assert compat.has_trace_key_context()


def test_trace_key_part_retraces_jit_and_reuses_equal_values():
  traces = []

  @jax.jit
  def f(x):
    traces.append(compat.trace_key())
    return x + 1

  for value in ("a", "a", "b", "a", ("c", 1), ("c", 1)):
    with compat.trace_key_part("test", value):
      f(1.0)
  assert [dict(k)["test"] for k in traces] == ["a", "b", ("c", 1)]
  assert compat.trace_key() == ()


def test_trace_key_parts_nest_by_slot():
  with compat.trace_key_part("one", 1), compat.trace_key_part("two", 2):
    with compat.trace_key_part("one", 3):
      assert dict(compat.trace_key()) == {"one": 3, "two": 2}
    assert dict(compat.trace_key()) == {"one": 1, "two": 2}


def test_fresh_trace_key_runs_jitted_python_again():
  traces = []

  @jax.jit
  def f(x):
    traces.append(None)
    return x + 1

  f(1.0)
  with compat.fresh_trace_key():
    f(1.0)
  f(1.0)
  assert len(traces) == 2


def test_trace_key_part_rejects_unhashable_values():
  with pytest.raises(TypeError):
    with compat.trace_key_part("test", []):
      pass


def test_use_policy_and_markers_enter_the_jit_key():
  marker = compat.policy_marker("test")
  with rt.use_policy("save-ffn") as policy:
    assert dict(compat.trace_key())["ambient"] == policy
    with lowering.substitute_ambient(marker):
      assert dict(compat.trace_key())["substitute"] is marker


#: Whether the release has ``jax_custom_vjp3`` (remat3 policies see inside a
#: custom_vjp only with it on). None: not yet measured on that release.
HAS_CUSTOM_VJP3 = {"0.10": True, "0.11": None, "0.12": True}


def test_custom_vjp3_flag_is_detected_per_release():
  measured = HAS_CUSTOM_VJP3.get(_release())
  if measured is not None:
    assert compat.has_custom_vjp3_flag() is measured
  if compat.has_custom_vjp3_flag():
    assert compat.custom_vjp3_enabled() is bool(jax.config.jax_custom_vjp3)


@pytest.mark.slow
@pytest.mark.parametrize("value, expected", [("1", True), ("0", False)])
def test_jax_reads_the_remat3_flag_from_the_environment(value, expected):
  # CI runs the suite a second time with JAX_REMAT3=1.
  env = {**os.environ, "JAX_REMAT3": value, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(
      [sys.executable, "-c",
       "from remat_toolkit._src.core import compat as c; print(c.remat3_enabled())"],
      env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == str(expected)


def test_is_linen_remat_knows_flax_lifted_checkpoint_classes():
  import flax.linen as nn

  class Block(nn.Module):
    def __call__(self, x):
      return x

  assert compat.is_linen_remat(nn.remat(Block)())
  assert compat.is_linen_remat(nn.checkpoint(Block)())
  assert not compat.is_linen_remat(Block())
  assert not compat.is_linen_remat(nn.jit(Block)())


@pytest.mark.pins_mode
def test_remat2_refuses_to_keep_a_complex_value_as_recognised():
  """With remat3 off, JAX rounds each kept value with reduce_precision,
  which refuses complex64: the analyzer reads that refusal as the policy's
  (another policy of the same program may run)."""
  with compat.remat3(False), pytest.raises(TypeError) as caught:
    region = jax.checkpoint(
        lambda x: jnp.abs(jnp.sin(jnp.exp(x.astype(jnp.complex64) * (1 + 2j)))),
        policy=jax.checkpoint_policies.everything_saveable)
    jax.make_jaxpr(jax.grad(lambda x: region(x).sum()))(jnp.ones(4))
  assert compat.is_reduce_precision_refusal(caught.value)
  assert not compat.is_reduce_precision_refusal(TypeError("other"))
