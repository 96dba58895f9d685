"""Never silent: every result says when its figures are not the policy's own.

Three cases, for each entry point: (a) no region reads the policy, (b)
regions with their own policy ignore it, (c) the policy keeps none of its
names in this model. Each finding is in the result's ``warnings``, its text,
HTML and JSON, and is raised once as a ``UserWarning`` when the result is
made.
"""

import html
import json
import warnings

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit._src.policies.findings import KINDS
from remat_toolkit._src.policies.findings import quiet

S = jax.ShapeDtypeStruct
W = S((4, 4), jnp.float32)
X = S((2, 4), jnp.float32)

NO_REGION = "fn has no remat region at all"
NONE_READS = "no remat region in fn reads the ambient policy"
SOME_OWN = "1 of 2 remat regions has its own policy and ignores"
NO_NAMES = "keeps none of its names in this model"


@rt.remat
def _ambient(w, x):
  return jnp.tanh(rt.tag(x @ w, "ffn.up"))


@rt.remat
def _untagged(w, x):
  return jnp.tanh(x @ w)


@rt.remat(policy="save-ffn")
def _own(w, x):
  return jnp.tanh(rt.tag(x @ w, "ffn.up"))


def no_region(w, x):
  return jnp.tanh(x @ w).sum()


def own_only(w, x):
  return _own(w, x).sum()


def mixed(w, x):
  return _own(w, _ambient(w, x)).sum()


def healthy(w, x):
  return _ambient(w, x).sum()


def untagged(w, x):
  return _untagged(w, x).sum()


def made(call):
  """The result of ``call()`` and the UserWarnings raised while making it."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = call()
  return result, [str(w.message) for w in caught
                  if issubclass(w.category, UserWarning)]


def assert_said(result, raised, *fragments, exported=None):
  """Each fragment is one warning, raised once and shown everywhere."""
  assert len(result.warnings) == len(fragments), result.warnings
  for warning, fragment in zip(result.warnings, fragments, strict=True):
    assert fragment in warning, warning
    assert getattr(warning, "kind", None) in KINDS, warning  # a Finding
    assert raised.count(warning) == 1, raised
    assert warning in str(result)
    assert html.escape(warning, quote=False) in result._repr_html_()
  assert sorted(raised) == sorted(result.warnings)
  data = result.to_dict() if exported is None else exported
  assert data["warnings"] == list(result.warnings)
  json.dumps(data, default=str)


def assert_quiet(result, raised):
  assert result.warnings == () and raised == []
  assert "warning:" not in str(result)


# ------------------------------------------------------------ analyze

def test_analyze_no_region():
  report, raised = made(lambda: rt.analyze(no_region, W, X, policy="save-ffn"))
  assert_said(report, raised, NO_REGION)
  assert "policy 'save-ffn' changes nothing" in report.warnings[0]


def test_analyze_regions_with_their_own_policy():
  report, raised = made(lambda: rt.analyze(own_only, W, X,
                                           policy="save-everything"))
  assert_said(report, raised, NONE_READS)
  # Which regions, and which policy they use instead.
  assert "1 region uses 'save-ffn', at " in report.warnings[0]
  assert "_own" in report.warnings[0] or "test_warnings.py" in report.warnings[0]
  report, raised = made(lambda: rt.analyze(mixed, W, X, policy="save-everything"))
  assert_said(report, raised, SOME_OWN)
  assert "'save-ffn'" in report.warnings[0]


def test_analyze_policy_keeping_none_of_its_names():
  report, raised = made(lambda: rt.analyze(healthy, W, X, policy="save-qkv"))
  assert_said(report, raised, "policy 'save-qkv' " + NO_NAMES)
  text = report.warnings[0]
  assert "'attn.q'" in text and "'ffn.up'" in text and "rt.tag" not in text
  assert "remat_toolkit.tag(x, name)" in text


@pytest.mark.parametrize("policy", ["save-ffn", "save-matmuls", "boundary-only",
                                    "save-everything", "save-matmuls-no-batch"])
def test_analyze_healthy_has_no_warning(policy):
  assert_quiet(*made(lambda: rt.analyze(healthy, W, X, policy=policy)))


def test_a_policy_without_names_is_never_flagged_on_an_untagged_model():
  for policy in ("boundary-only", "save-everything", "save-matmuls"):
    assert_quiet(*made(lambda p=policy: rt.analyze(untagged, W, X, policy=p)))


# ------------------------------------------------------------ compare

def test_compare_no_region():
  comparison, raised = made(lambda: rt.compare(
      no_region, W, X, policies=["boundary-only", "save-ffn"]))
  assert_said(comparison, raised, NO_REGION)
  assert "no policy changes anything" in comparison.warnings[0]


def test_compare_regions_with_their_own_policy_said_once():
  comparison, raised = made(lambda: rt.compare(
      mixed, W, X, policies=["boundary-only", "save-ffn", "save-everything"]))
  assert_said(comparison, raised, SOME_OWN)
  comparison, raised = made(lambda: rt.compare(
      own_only, W, X, policies=["boundary-only", "save-everything"]))
  assert_said(comparison, raised, NONE_READS)


def test_compare_names_each_silent_policy_once_and_marks_it():
  comparison, raised = made(lambda: rt.compare(
      healthy, W, X, policies=["save-ffn", "save-qkv", "save-attention",
                               "save-qkv"]))
  assert_said(comparison, raised, "policy 'save-qkv' " + NO_NAMES,
              "policy 'save-attention' " + NO_NAMES)
  flags = {r["policy"]: r["keeps_none_of_its_names"] for r in comparison.rows()}
  assert flags == {"save-ffn": False, "save-qkv": True, "save-attention": True}
  text = str(comparison)
  assert "save-qkv !" in text and "save-ffn !" not in text
  assert "! = keeps none of its names" in text


def test_compare_healthy_has_no_warning():
  comparison, raised = made(lambda: rt.compare(
      healthy, W, X, policies=["boundary-only", "save-ffn", "save-matmuls",
                               "save-everything"]))
  assert_quiet(comparison, raised)
  assert not any(r["keeps_none_of_its_names"] for r in comparison.rows())


# ------------------------------------------------------------ plan

def test_plan_no_region_is_an_error_that_says_why():
  with pytest.raises(ValueError, match=NO_REGION):
    rt.plan(no_region, W, X, budget="1KiB")
  with pytest.raises(ValueError, match=r"(?s)reads the ambient policy.*'save-ffn'"):
    rt.plan(own_only, W, X, budget="1KiB")


def test_plan_regions_with_their_own_policy():
  p, raised = made(lambda: rt.plan(mixed, W, X, budget="1KiB"))
  assert_said(p, raised, SOME_OWN)
  assert "'save-ffn'" in p.warnings[0]


def test_plan_without_names_to_decide_on():
  p, raised = made(lambda: rt.plan(untagged, W, X, budget="1KiB"))
  assert_said(p, raised, "holds a checkpoint name")
  assert "remat_toolkit.tag(x, name)" in p.warnings[0]


def test_plan_healthy_has_no_warning():
  assert_quiet(*made(lambda: rt.plan(healthy, W, X, budget="1KiB")))


def test_frontier_carries_the_planner_warnings():
  f, raised = made(lambda: rt.frontier(untagged, W, X, budgets=1))
  assert_said(f, raised, "holds a checkpoint name")


# ------------------------------------------------------------ memory_breakdown

def test_breakdown_no_region():
  b, raised = made(lambda: rt.memory_breakdown(no_region, W, X,
                                               policy="save-ffn"))
  assert_said(b, raised, NO_REGION)


def test_breakdown_regions_with_their_own_policy():
  b, raised = made(lambda: rt.memory_breakdown(mixed, W, X,
                                               policy="boundary-only"))
  assert_said(b, raised, SOME_OWN)


def test_breakdown_policy_keeping_none_of_its_names():
  b, raised = made(lambda: rt.memory_breakdown(healthy, W, X,
                                               policy="save-attention"))
  assert_said(b, raised, "policy 'save-attention' " + NO_NAMES)


def test_breakdown_healthy_has_no_warning():
  assert_quiet(*made(lambda: rt.memory_breakdown(healthy, W, X,
                                                 policy="save-ffn")))


# ------------------------------------------------------------ verify

def test_verify_no_region():
  v, raised = made(lambda: rt.verify(no_region, W, X, policy="save-ffn",
                                     check_values=False))
  assert_said(v, raised, NO_REGION)


def test_verify_regions_with_their_own_policy():
  v, raised = made(lambda: rt.verify(mixed, W, X, policy="save-everything",
                                     check_values=False))
  assert_said(v, raised, SOME_OWN)
  # The function verified as it is (no policy asked for): nothing to say.
  assert_quiet(*made(lambda: rt.verify(mixed, W, X, check_values=False)))


def test_verify_policy_keeping_none_of_its_names_warns_once():
  # The gradient check traces the regions under the policy too; the
  # finding is still raised once.
  v, raised = made(lambda: rt.verify(healthy, W, X, policy="save-qkv"))
  assert_said(v, raised, "policy 'save-qkv' " + NO_NAMES)
  assert v.no_op == "boundary-only" and v.ok is True


def test_verify_healthy_has_no_warning():
  v, raised = made(lambda: rt.verify(healthy, W, X, policy="save-ffn"))
  assert_quiet(v, raised)
  assert v.passed


# ------------------------------------------------------------ bench

def _batch_loss(fn):
  return lambda w, batch: fn(w, batch["x"])


_PARAMS = jnp.full((4, 4), 0.25)
_BATCH = {"x": jnp.ones((2, 4))}


def _bench(fn, policy):
  return rt.bench(_batch_loss(fn), _PARAMS, _BATCH, policies=[policy], steps=1,
                  warmup=0, progress=False)


def test_bench_no_region():
  result, raised = made(lambda: _bench(no_region, "boundary-only"))
  assert_said(result, raised, NO_REGION)


def test_bench_regions_with_their_own_policy():
  result, raised = made(lambda: _bench(mixed, "boundary-only"))
  assert_said(result, raised, SOME_OWN)


def test_bench_policy_keeping_none_of_its_names_warns_once():
  # Compiling under the policy traces its regions; still one warning.
  result, raised = made(lambda: _bench(healthy, "save-qkv"))
  assert_said(result, raised, "policy 'save-qkv' " + NO_NAMES)


def test_bench_healthy_has_no_warning():
  assert_quiet(*made(lambda: _bench(healthy, "save-ffn")))


# ------------------------------------------------------------ raising once

def test_repr_raises_nothing_more():
  report, _ = made(lambda: rt.analyze(no_region, W, X, policy="save-ffn"))
  _, raised = made(lambda: (str(report), report._repr_html_(), repr(report)))
  assert raised == []


def test_quiet_warnings_keeps_them_on_the_result():
  with quiet():
    report, raised = made(lambda: rt.analyze(no_region, W, X,
                                             policy="save-ffn"))
  assert raised == [] and NO_REGION in report.warnings[0]


def test_cli_prints_each_warning_once(tmp_path, monkeypatch):
  (tmp_path / "silent_model.py").write_text(
      "import jax, jax.numpy as jnp\n"
      "def make():\n"
      "  w = jax.ShapeDtypeStruct((4, 4), jnp.float32)\n"
      "  x = jax.ShapeDtypeStruct((2, 4), jnp.float32)\n"
      "  return (lambda w, x: jnp.tanh(x @ w).sum()), (w, x)\n")
  monkeypatch.chdir(tmp_path)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    status, out, _ = run_cli("analyze", "--model", "silent_model:make",
                             "--policy", "save-ffn")
  assert status == 0 and out.count(NO_REGION) == 1
  assert not [w for w in caught if NO_REGION in str(w.message)]


def test_the_trace_time_names_warning_has_a_switch(fresh_trace_warnings):
  # Results that carry the finding silence the one rt.remat regions raise
  # when traced; a switch, not a filter on the message's wording.
  policy = rt.Policy(name="keeps-a-name-nobody-has", save=["nobody.has.this"])
  f = rt.remat(lambda x: jnp.sin(rt.tag(x @ x.T, "ffn.up")).sum(),
               policy=policy)
  x = jnp.ones((2, 2))
  with quiet():
    _, raised = made(lambda: jax.make_jaxpr(jax.grad(f))(x))
  assert raised == []
  _, raised = made(lambda: jax.make_jaxpr(jax.grad(f))(x * 2))
  assert len(raised) == 1 and "'nobody.has.this'" in raised[0]
