"""Per-region plans: exact against brute force, applied exactly as planned.

The per-region planner's answer is checked against every combination of
per-region choices, each measured by the analyzer on the whole program; an
applied plan is checked against JAX's own ``saved_residuals`` on the
built-in GPT (linen and NNX) and on Hugging Face's T5 (two kinds of block, a
model nobody here wrote). These tests read the remat mode from the
environment: CI runs them with ``jax_remat3`` off, then on (``JAX_REMAT3=1``).
"""

import dataclasses
import itertools
import json
import warnings

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import assert_trees_close
from shared_helpers import grad_of
from shared_helpers import jax_activation_bytes
from shared_helpers import remat3_enabled
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models

S = jax.ShapeDtypeStruct
F32 = jnp.float32
B, D, K = 4, 8, 4


@rt.remat
def block(w1, w2, x):
  # a and b are slices of one unnamed matmul: keeping one of them spares no
  # recompute, keeping both spares the matmul, so a region's choices are
  # not additive and the planner must measure them together.
  y = jnp.tanh(x) @ w1
  a = rt.tag(y[:, :K] * 2.0, "a")
  b = rt.tag(y[:, K:2 * K] * 3.0, "b")
  return x + jnp.tanh(a * b) @ w2


def loss(params, x):
  for w1, w2 in params:
    x = block(w1, w2, x)
  return (x ** 2).mean()


def _args(widths):
  return ([(S((D, width), F32), S((K, D), F32)) for width in widths],
          S((B, D), F32))


# Regions #0 and #1 are one kind (measured together), #2 is another.
ARGS = _args((16, 16, 32))
OPTIONS = ([rt.Policy(name="bf", save=list(keep)) for n in range(3)
            for keep in itertools.combinations("ab", n)]
           + [rt.Policy(name="bf", save_everything=True),
              rt.Policy(name="bf", matmuls="all"),
              rt.Policy(name="bf", matmuls="no-batch")])
_EVERY_MIX: dict = {}


def region_keys(args):
  """The keys of the regions of ``loss``: their positions (plain functions)."""
  return [f"#{i}" for i in range(len(args[0]))]


def every_mix(args):
  """Every per-region choice of the candidates, measured on the whole
  program (7**regions analyses of one trace)."""
  keys = region_keys(args)
  mixes = [rt.Policy(name=f"mix-{i}", regions=list(zip(keys, mix, strict=True)))
           for i, mix in enumerate(itertools.product(OPTIONS, repeat=len(keys)))]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # what some mixes keep, said per mix
    return list(rt.compare(loss, *args, policies=mixes).reports.values())


def test_per_region_plans_equal_brute_force():
  # remat3 analyses cost several times more: there two regions of one kind.
  remat3 = remat3_enabled()
  args = _args((16, 16) if remat3 else (16, 16, 32))
  reports = every_mix(args)
  lo = min(r.activation_bytes for r in reports)
  hi = max(r.activation_bytes for r in reports)
  steps = 6 if remat3 else 10
  budgets = [lo + (hi - lo) * i // steps for i in range(steps + 1)]
  plans = [rt.plan(loss, *args, budget=b, per_layer=True) for b in budgets]
  # Uniform plans at the same budgets, and the plans' own policies measured,
  # each on one trace.
  uniform = {f.budget: f for f in rt.frontier(
      loss, *args, policies=["boundary-only"], budgets=budgets).points
             if f.source == "plan"}
  measured = rt.compare(loss, *args, policies=[
      dataclasses.replace(p.policy, name=f"plan-{i}") for i, p in enumerate(plans)])
  mixed = False
  for budget, p, check in zip(budgets, plans, measured.reports.values(),
                              strict=True):
    fitting = [r for r in reports if r.activation_bytes <= budget]
    assert p.recompute_flops == min(r.recompute_flops for r in fitting), budget
    assert p.activation_bytes <= budget and p.optimal
    # The figures are the analyzer's for the plan's own policy.
    assert (check.activation_bytes, check.recompute_flops) == (
        p.activation_bytes, p.recompute_flops)
    # Never worse than the best uniform plan at the same budget.
    assert p.recompute_flops <= uniform[budget].recompute_flops
    mixed |= len({r.policy for r in p.regions}) > 1
  assert mixed  # some budget is best served by different policies per region
  assert [(r.region, r.kind) for r in p.regions] == [
      ("#0", 0), ("#1", 0), ("#2", 1)][:len(args[0])]


def _mid_budget(fn, args, low="boundary-only", high="save-attention"):
  lo = rt.analyze(fn, *args, policy=low).activation_bytes
  hi = rt.analyze(fn, *args, policy=high).activation_bytes
  return (lo + hi) // 2


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_a_per_region_policy_keeps_what_jax_keeps(framework):
  fn, args = models.build_loss("tiny", framework=framework)
  first, second = ["layers_0", "layers_1"] if framework == "linen" else [
      "layers/0", "layers/1"]
  mixed = rt.Policy(name="mixed", regions={first: "save-attention",
                                           second: "save-ffn"})
  report = rt.analyze(fn, *args, policy=mixed)
  assert report.activation_bytes == jax_activation_bytes(fn, args, mixed)
  uniform = [rt.analyze(fn, *args, policy=p).activation_bytes
             for p in ("save-attention", "save-ffn")]
  assert min(uniform) < report.activation_bytes < max(uniform)


# Planning is the same in both remat modes (the remat3 pass checks the
# analyzer's per-region figures above and the brute force): once per leg.
@pytest.mark.slow
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_an_applied_plan_keeps_what_jax_keeps(framework):
  fn, args = models.build_loss("tiny", framework=framework)
  p = rt.plan(fn, *args, budget=_mid_budget(fn, args), per_layer=True)
  assert len({r.policy for r in p.regions}) > 1, p.regions
  assert [r.region for r in p.regions] == (
      ["layers_0", "layers_1"] if framework == "linen"
      else ["layers/0", "layers/1"])
  # rt.use_policy(plan): each region takes its planned policy when traced.
  assert jax_activation_bytes(fn, args, p) == p.activation_bytes
  by_name = rt.analyze(fn, *args, policy=p)
  assert (by_name.activation_bytes, by_name.recompute_flops) == (
      p.activation_bytes, p.recompute_flops)


def test_an_applied_plan_gives_the_gradients_of_no_remat():
  bounds = rt.compare(loss, *ARGS, policies=["boundary-only", "save-everything"])
  lo, hi = (r.activation_bytes for r in bounds.reports.values())
  p = next(p for p in (rt.plan(loss, *ARGS, budget=lo + (hi - lo) * i // 10,
                               per_layer=True)
                       for i in range(1, 10))
           if len({r.policy for r in p.regions}) > 1)
  keys = jax.random.split(jax.random.key(0), 7)
  values = jax.tree.map(lambda s, k: jax.random.normal(k, s.shape, s.dtype),
                        ARGS, jax.tree.unflatten(jax.tree.structure(ARGS),
                                                 list(keys)))

  def plain(params, x):
    for w1, w2 in params:
      y = jnp.tanh(x) @ w1
      x = x + jnp.tanh((y[:, :K] * 2.0) * (y[:, K:2 * K] * 3.0)) @ w2
    return (x ** 2).mean()

  with rt.use_policy(p):
    grads = grad_of(loss, *values)
  assert_trees_close(grads, grad_of(plain, *values))


# Hugging Face's T5 is slow to trace and the same in both remat modes as far
# as region keys go: once per CI leg.
@pytest.mark.slow
def test_rules_apply_the_plan_to_a_model_one_cannot_edit(third_party_code):
  from third_party_models import t5  # encoder and decoder: two kinds of block
  model = t5()
  found = rt.remat_modules(model.module)  # the blocks, reading the ambient policy
  params = jax.eval_shape(lambda: model.init(found))
  loss_fn = model.loss(found)
  p = rt.plan(loss_fn, params, budget=_mid_budget(loss_fn, (params,)),
              per_layer=True)
  # The first block of each stack computes the relative position bias the
  # others reuse: four kinds, each region measured on its own.
  assert [(r.region, r.kind) for r in p.regions] == [
      ("encoder/block/0", 0), ("encoder/block/1", 1),
      ("decoder/block/0", 2), ("decoder/block/1", 3)]
  assert len({r.policy for r in p.regions}) > 1, p.regions
  ruled = rt.remat_modules(model.module, p.rules)
  ruled_loss = model.loss(ruled)
  jax_bytes = jax_activation_bytes(ruled_loss, (params,), "boundary-only")
  assert jax_bytes == p.activation_bytes
  with warnings.catch_warnings():  # the regions have their own policies now
    warnings.simplefilter("ignore")
    report = rt.analyze(ruled_loss, params, policy="boundary-only")
  # Its regions have policies of their own, so the analyzer counts their
  # recompute in the backward pass rather than as the policy's: compare the
  # backward pass, recompute included.
  assert (report.activation_bytes, report.backward_flops) == (
      p.activation_bytes, p.report.backward_flops)


@pytest.mark.slow
def test_a_plan_saved_and_loaded_is_the_same_policy(tmp_path):
  fn, args = models.build_loss("tiny")
  p = rt.plan(fn, *args, budget=_mid_budget(fn, args), per_layer=True)
  path = rt.save_policy(p, tmp_path / "plan.toml")
  (loaded,) = rt.load_policies(path)
  assert loaded == p.policy
  again = rt.analyze(fn, *args, policy=p.policy.name)
  assert (again.activation_bytes, again.recompute_flops) == (
      p.activation_bytes, p.recompute_flops)
  data = p.to_dict()
  assert [r["region"] for r in data["regions"]] == ["layers_0", "layers_1"]
  assert data["policy"]["regions"] == {k: v.name for k, v in p.policy.regions}


@pytest.mark.slow
def test_cli_plan_per_layer(tmp_path):
  path = tmp_path / "plan.toml"
  status, out, _ = run_cli("plan", "--model", "tiny", "--budget", "60KiB",
                           "--per-layer", "--json", "--save", path)
  assert status == 0
  data = json.loads(out)
  assert [r["region"] for r in data["regions"]] == ["layers_0", "layers_1"]
  assert "[regions]" in path.read_text()
  status, text, _ = run_cli("plan", "--model", "tiny", "--budget", "60KiB",
                            "--per-layer")
  assert status == 0
  assert "per region" in text and "layers_0" in text


def test_a_region_the_policy_does_not_name_keeps_its_inputs_and_says_so():
  partial = rt.Policy(name="partial", regions={"#0": "save-everything"})
  with pytest.warns(UserWarning, match=r"'partial' has no policy for the remat "
                    r"region\(s\) '#1'.*boundary-only"):
    with rt.use_policy(partial):
      jax.make_jaxpr(jax.grad(loss))(*ARGS)
  report = rt.analyze(loss, *ARGS, policy=partial)
  assert any("'#1'" in w and "'#2'" in w for w in report.warnings)


def test_the_dense_frontier_fills_the_gaps_between_named_policies():
  import matplotlib
  matplotlib.use("Agg")
  f = rt.frontier(loss, *ARGS, per_layer=True)
  named = [p for p in f.points if p.source == "named"]
  planned = [p for p in f.points if p.source == "per-region plan"]
  # Every step of the exact per-region front, measured.
  assert len(planned) > len({(p.activation_bytes, p.recompute_flops)
                             for p in named if p.on_frontier})
  measured = rt.compare(loss, *ARGS, policies=[
      dataclasses.replace(p.policy, name=f"point-{i}") for i, p in enumerate(planned)])
  for p, r in zip(planned, measured.reports.values(), strict=True):
    assert p.activation_bytes <= p.budget
    assert (r.activation_bytes, r.recompute_flops) == (
        p.activation_bytes, p.recompute_flops)
    # No named policy that fits the same budget recomputes less.
    assert p.recompute_flops <= min(q.recompute_flops for q in named
                                    if q.activation_bytes <= p.budget)
  # Between named points, some plan recomputes strictly less than any named
  # policy that fits its budget.
  assert any(p.recompute_flops < min(q.recompute_flops for q in named
                                     if q.activation_bytes <= p.budget)
             for p in planned)
  ax = f.plot()
  assert "per-region plan" in [t.get_text() for t in ax.get_legend().get_texts()]
