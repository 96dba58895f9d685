"""The planner finds the least recompute that fits, measured, never assumed.

Its answers are checked against brute force over every subset of checkpoint
names, each evaluated with the real analyzer, under ``jax_remat3`` off and on;
what the plan saves is checked against JAX's own ``saved_residuals`` under the
JAX constructor written by hand.
"""

import itertools
import json
import math
import re

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import jax_residuals
from shared_helpers import remat3
from shared_helpers import remat3_enabled
from shared_helpers import remat3_offloads
from shared_helpers import reports_of
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models

S = jax.ShapeDtypeStruct
B, D, H, K, L = 4, 8, 16, 4, 2
NAMES = ("n", "a", "b", "h", "u", "s")


def block_body(w1, w2, w3, x):
  # ``a`` and ``b`` are slices of the unnamed matmul ``y``: keeping one of
  # them saves no recompute, keeping both saves recomputing ``y``. Costs are
  # not additive here.
  t = rt.tag
  n = t(jnp.tanh(x), "n")
  y = n @ w1
  a = t(y[:, :K] * 2.0, "a")  # linear in y: backward needs neither y nor a
  b = t(y[:, K:2 * K] * 3.0, "b")
  h = t(a * b, "h")
  u = t(h @ w2, "u")
  s = t(jnp.tanh(u), "s")
  return x + s @ w3


def loss_of(block):
  def loss(params, x):
    for w1, w2, w3 in params:
      x = block(w1, w2, w3, x)
    return (x ** 2).mean()
  return loss


loss = loss_of(rt.remat(block_body))


ARGS = ([(S((D, H), jnp.float32), S((K, H), jnp.float32),
          S((H, D), jnp.float32))] * L, S((B, D), jnp.float32))
_MEASURED: dict = {}


@rt.remat
def small_block(w1, w2, x):
  u = rt.tag(jnp.tanh(x) @ w1, "u")
  s = rt.tag(jnp.tanh(u), "s")
  return x + rt.tag(s @ w2, "o")


def small_loss(params, x):
  for w1, w2 in params:
    x = small_block(w1, w2, x)
  return (x ** 2).mean()


SMALL_ARGS = ([(S((D, H), jnp.float32), S((H, D), jnp.float32))] * L,
              S((B, D), jnp.float32))


def every_choice(*, offload=False):
  """Every keep/recompute(/offload) choice of the names, and the whole
  alternatives, each measured by the analyzer (cached per remat mode).

  With ``offload``, of the three-name ``small_loss`` (3**3 choices)."""
  key = (remat3_enabled(), offload)
  if key not in _MEASURED:
    fn, args, names = ((small_loss, SMALL_ARGS, ("u", "s", "o")) if offload
                       else (loss, ARGS, NAMES))
    options = ("save", "recompute", "offload") if offload else ("save",
                                                                "recompute")
    policies = []
    for combo in itertools.product(options, repeat=len(names)):
      pick = lambda what: [n for n, c in zip(names, combo, strict=True)  # noqa: E731
                           if c == what]
      policies.append(rt.Policy(name="bf", save=pick("save"),
                                offload=pick("offload")))
    modes = [{"save_everything": True}, {"matmuls": "all"},
             {"matmuls": "no-batch"}]
    if offload:
      modes.append({"matmuls": "offload-no-batch"})
    for mode in modes:
      policies.append(rt.Policy(name="bf", **mode))
    _MEASURED[key] = reports_of(fn, args, policies)
  return _MEASURED[key]


def brute_force(budget, *, offload=False, transfer=0.0):
  """(least cost, its report) among the measured choices that fit."""
  best = None
  for r in every_choice(offload=offload):
    cost = r.recompute_flops + 2 * r.offloaded_bytes * transfer
    if r.activation_bytes <= budget and (best is None or cost < best[0]):
      best = (cost, r)
  return best


def budgets_between(count, fn=loss, args=ARGS):
  lo, hi = (r.activation_bytes for r in reports_of(
      fn, args, ["boundary-only", "save-everything"]))
  return [lo + (hi - lo) * i // (count - 1) for i in range(count)]


def test_test_model_is_not_additive(remat_mode):
  subsets = [(), ("a",), ("b",), ("a", "b")]
  flops = dict(zip(subsets, (r.recompute_flops for r in reports_of(
      loss, ARGS, [rt.Policy(name="p", save=list(k)) for k in subsets])),
                   strict=True))
  # Each alone saves nothing, together they save the shared matmul.
  assert flops[()] == flops[("a",)] == flops[("b",)] > flops[("a", "b")]


def test_plans_equal_brute_force_over_every_subset(remat_mode):
  budgets = budgets_between(7)
  # frontier plans at every budget on one trace (the planner's own search).
  plans = [p for p in rt.frontier(loss, *ARGS, budgets=budgets,
                                  max_evaluations=400).points
           if p.source == "plan"]
  assert sorted(p.budget for p in plans) == budgets
  checks = reports_of(loss, ARGS, [p.policy for p in plans])
  for p, check in zip(plans, checks, strict=True):
    cost, _ = brute_force(p.budget)
    assert p.recompute_flops == cost, p.budget
    assert p.activation_bytes <= p.budget
    # The numbers are measurements of the plan's own policy.
    assert (check.activation_bytes, check.recompute_flops) == (
        p.activation_bytes, p.recompute_flops)
  # The interaction matters: some plan keeps both a and b.
  assert any({"a", "b"} <= set(p.policy.save) for p in plans)


def test_plan_is_proven_optimal_and_matches_brute_force(remat_mode):
  for budget in budgets_between(7)[2:3]:
    p = rt.plan(loss, *ARGS, budget=budget)
    assert p.optimal
    assert p.recompute_flops == brute_force(budget)[0]
    assert p.estimated_peak == p.activation_bytes + p.workspace_bytes


def test_plan_saves_what_jax_saves_for_the_same_names(remat_mode):
  p = rt.plan(loss, *ARGS, budget=budgets_between(7)[2])
  kept = sorted(n for n, d in p.decisions.items() if d == "save")
  assert kept and list(p.policy.save) == kept
  by_hand = jax.checkpoint_policies.save_only_these_names(*kept)
  found = jax_residuals(loss_of(jax.checkpoint(block_body, policy=by_hand)), *ARGS)
  assert p.activation_bytes == sum(r.nbytes for r in found if r.kind != "argument")
  saved_names = {r.name for r in p.report.activations if r.name}
  assert saved_names <= set(kept)
  # Under the plan as ambient policy, the model keeps exactly that.
  ambient = jax_residuals(loss, *ARGS, policy=p.policy)
  assert (sorted((r.shape, r.dtype, r.what) for r in found)
          == sorted((r.shape, r.dtype, r.what) for r in ambient))


def test_plan_never_worse_than_the_best_fitting_named_policy(remat_mode):
  for budget in budgets_between(7)[1:4:2]:
    p = rt.plan(loss, *ARGS, budget=budget)
    fitting = [f for f in p.named if f.fits]
    assert fitting, budget
    assert all(f.activation_bytes <= budget for f in fitting)
    assert p.recompute_flops <= min(f.recompute_flops for f in fitting)
    closest = p.closest_builtins
    assert [f.cost for f in closest] == sorted(f.cost for f in closest)
    assert closest[0].cost == min(f.cost for f in fitting)
    named = {f.name: f for f in p.named}
    report = rt.analyze(loss, *ARGS, policy=closest[0].name)
    assert named[closest[0].name].activation_bytes == report.activation_bytes


def test_budget_below_the_smallest_raises_and_says_the_smallest(remat_mode):
  least = min(r.activation_bytes for r in every_choice())
  with pytest.raises(ValueError, match=f"least .* measured is .*{least} bytes"):
    rt.plan(loss, *ARGS, budget=least - 1)
  assert rt.plan(loss, *ARGS, budget=least).activation_bytes == least


def test_budget_strings_and_bad_budgets():
  budget = budgets_between(3)[1]
  kib = math.ceil(budget / 1024)
  assert (rt.plan(loss, *ARGS, budget=f"{kib}KiB").policy
          == rt.plan(loss, *ARGS, budget=kib * 1024).policy)
  with pytest.raises(ValueError, match="not a memory size"):
    rt.plan(loss, *ARGS, budget="lots")
  assert (rt.plan(loss, *ARGS, budget=float(kib * 1024)).policy
          == rt.plan(loss, *ARGS, budget=kib * 1024).policy)
  with pytest.raises(TypeError, match="memory size"):
    rt.plan(loss, *ARGS, budget=[kib])


def test_plan_does_not_register_until_asked(fresh_catalogue):
  before = rt.list_policies()
  p = rt.plan(loss, *ARGS, budget="64KiB")
  assert rt.list_policies() == before
  assert rt.register_policy(p) is p.policy
  assert rt.get_policy(p.policy.name) == p.policy
  with rt.use_policy(p.policy.name):
    assert rt.analyze(loss, *ARGS).activation_bytes == p.activation_bytes


def test_save_writes_a_policy_file_that_loads_back_equal(tmp_path, fresh_catalogue):
  p = rt.plan(loss, *ARGS, budget=budgets_between(4)[2])
  path = rt.save_policy(p, tmp_path / "planned.toml")
  loaded = rt.load_policies(path)
  assert loaded == [p.policy]
  assert rt.analyze(loss, *ARGS, policy=p.policy.name).activation_bytes == (
      p.activation_bytes)
  with pytest.raises(ValueError, match="file path"):
    rt.save_policy(p, tmp_path)


def test_plans_for_two_models_load_side_by_side(tmp_path, fresh_catalogue):
  # Same kept names, different models: a name from the kept set alone made
  # the second load collide with the first.
  wide = ([(S((D, H), jnp.float32), S((K, H), jnp.float32),
            S((H, D), jnp.float32))] * L, S((2 * B, D), jnp.float32))
  first = rt.plan(loss, *ARGS, budget="1GiB")
  second = rt.plan(loss, *wide, budget="1GiB")
  assert first.decisions == second.decisions
  assert first.policy.name != second.policy.name
  loaded = [*rt.load_policies(rt.save_policy(first, tmp_path / "a.toml")),
            *rt.load_policies(rt.save_policy(second, tmp_path / "b.toml"))]
  assert [p.name for p in loaded] == [first.policy.name, second.policy.name]


def test_whole_alternative_round_trips(tmp_path, fresh_catalogue):
  # With room for everything, no recompute: save-matmuls or save-everything.
  p = rt.plan(loss, *ARGS, budget="10MiB")
  assert p.recompute_flops == 0
  assert rt.load_policies(rt.save_policy(p, tmp_path / "whole.toml")) == [p.policy]


def test_names_with_glob_characters_are_matched_literally(remat_mode):
  @rt.remat
  def odd(w, v, x):
    h = rt.tag(x @ w, "mlp[0]*")  # the pattern mlp[0]* also matches mlp0x
    g = rt.tag(jnp.sin(h) * 2.0, "mlp0x")
    z = jnp.tanh(x @ v)  # an unnamed matmul that save-matmuls would keep
    return jnp.tanh(g) @ w.T + z

  args = (S((D, H), jnp.float32), S((D, D), jnp.float32),
          S((B, D), jnp.float32))
  fn = lambda w, v, x: odd(w, v, x).sum()  # noqa: E731
  base = rt.analyze(fn, *args, policy="boundary-only").activation_bytes
  p = rt.plan(fn, *args, budget=base + B * H * 4)
  assert p.decisions == {"mlp[0]*": "save", "mlp0x": "recompute"}
  assert p.policy.save == ("mlp[[]0][*]",)
  assert p.policy.lowering(["mlp[0]*", "mlp0x"]).saved_names == {"mlp[0]*"}
  assert {r.name for r in p.report.activations if r.name} == {"mlp[0]*"}


@pytest.mark.pins_mode
def test_offload_is_a_third_choice_costed_by_bandwidth():
  with remat3(False):
    lo = rt.analyze(small_loss, *SMALL_ARGS, policy="boundary-only").activation_bytes
    transfer = 1e-3  # FLOP-equivalents per byte moved: offloading is cheap
    cost, _ = brute_force(lo, offload=True, transfer=transfer)
    p = rt.plan(small_loss, *SMALL_ARGS, budget=lo, allow_offload=True,
                host_bandwidth=1e12, device_flops=1e9, max_evaluations=400)
    assert p.optimal
    assert p.cost == pytest.approx(cost)
    assert p.offloaded_bytes > 0 and p.policy.offloads
    assert p.activation_bytes <= lo
    # A host budget of zero forbids it again.
    q = rt.plan(small_loss, *SMALL_ARGS, budget=lo, allow_offload=True,
                host_budget=0, host_bandwidth=1e12, device_flops=1e9)
    assert q.offloaded_bytes == 0 and not q.policy.offloads


def test_option_errors():
  if not remat3_offloads():
    with remat3(True):
      with pytest.raises(ValueError, match=f"jax {jax.__version__}"):
        rt.plan(loss, *ARGS, budget="1MiB", allow_offload=True)
  with pytest.raises(ValueError, match="allow_offload"):
    rt.plan(loss, *ARGS, budget="1MiB", host_budget="1GiB")
  with remat3(False), pytest.raises(ValueError, match="host_bandwidth"):
    rt.plan(loss, *ARGS, budget="1MiB", allow_offload=True, host_bandwidth=0)
  with pytest.raises(ValueError, match="no remat region"):
    rt.plan(lambda w, x: (x @ w).sum(), S((D, D), jnp.float32),
            S((B, D), jnp.float32), budget="1MiB")


def test_display_and_json():
  p = rt.plan(loss, *ARGS, budget="64KiB")
  text = str(p)
  assert p.policy.name in text and "named policy" in text
  assert "<table" in p._repr_html_()
  data = json.loads(p.to_json())
  assert data["activation_bytes"] == p.activation_bytes
  assert data["policy"]["save"] == list(p.policy.save)


# ------------------------------------------------------------------ groups

def chain(group):
  """A chain of L4 identical blocks, ``group`` blocks per remat region."""
  layers = 4
  if layers % group:
    raise ValueError(f"group {group} does not divide {layers} layers")

  def region(params, x):
    for w1, w2, w3 in params:
      t = rt.tag
      h = t(jnp.tanh(x @ w1), "a")
      x = x + t(jnp.tanh(h @ w2), "u") @ w3
    return x

  grouped = rt.remat(region)

  def fn(params, x):
    for i in range(0, layers, group):
      x = grouped(params[i:i + group], x)
    return (x ** 2).mean()

  args = ([(S((D, H), jnp.float32), S((H, H), jnp.float32),
            S((H, D), jnp.float32))] * layers, S((B, D), jnp.float32))
  return fn, args


def test_groups_report_boundaries_plus_one_region(remat_mode):
  fn, args = chain(1)
  p = rt.plan(fn, *args, budget="8MiB", groups=chain, group_sizes=(3, 4))
  by_group = {g.group: g for g in p.groups}
  assert set(by_group) == {None, 3, 4}
  assert "skipped" in by_group[3].note
  for g in (None, 4):
    est = by_group[g]
    everything, matmuls, all_names, boundary = reports_of(*chain(g or 1), [
        "save-everything", "save-matmuls", rt.Policy(name="all", save=["a", "u"]),
        "boundary-only"])
    whole = max(r.activation_bytes for r in (everything, matmuls, all_names))
    regions = 4 // (g or 1)
    assert est.regions == regions
    assert est.everything_bytes == whole
    assert est.workspace_bytes == max(whole - est.activation_bytes, 0) // regions
    assert est.estimated_peak == est.activation_bytes + est.workspace_bytes
    assert est.boundary_bytes == boundary.activation_bytes
  fitting = [g for g in p.groups if g.fits]
  assert p.recompute_flops == min(g.recompute_flops for g in fitting)
  assert p.estimated_peak <= p.budget


def test_groups_trade_boundaries_for_workspace():
  fn, args = chain(1)
  p = rt.plan(fn, *args, budget="8MiB",
              groups={2: chain(2), 4: chain(4)})
  by_group = {g.group: g for g in p.groups}
  # Larger regions keep fewer boundaries but recompute more at once.
  assert (by_group[4].boundary_bytes < by_group[2].boundary_bytes
          < by_group[None].boundary_bytes)
  workspace = {g.group: (g.everything_bytes - g.boundary_bytes) // g.regions
               for g in p.groups}
  assert workspace[4] > workspace[2] > workspace[None]
  tight = min(g.boundary_bytes + workspace[g.group] for g in p.groups)
  q = rt.plan(fn, *args, budget=tight, groups={2: chain(2), 4: chain(4)})
  assert q.estimated_peak <= tight
  with pytest.raises(ValueError, match="smallest estimated peak"):
    rt.plan(fn, *args, budget=tight - 1, groups={2: chain(2), 4: chain(4)})
  with pytest.raises(TypeError, match="pair"):
    rt.plan(fn, *args, budget="8MiB", groups={2: fn})


def test_what_the_budget_bounds_is_explicit():
  fn, args = chain(1)
  kept = rt.plan(fn, *args, budget="20KiB")
  assert kept.bounds == "kept activations" and kept.activation_bytes <= 20 * 1024
  assert "(kept activations)" in str(kept).splitlines()[0]
  # With groups the layouts are compared by peak, and the result says so.
  grouped = rt.plan(fn, *args, budget="8MiB", groups={2: chain(2)})
  assert grouped.bounds == "estimated peak"
  assert "(estimated peak)" in str(grouped).splitlines()[0]
  assert grouped.estimated_peak <= grouped.budget
  with pytest.raises(ValueError, match="cannot compare layouts"):
    rt.plan(fn, *args, budget="8MiB", groups={2: chain(2)},
            bounds="kept activations")
  with pytest.raises(ValueError, match="bounds must be one of"):
    rt.plan(fn, *args, budget="8MiB", bounds="peak bytes")
  # The peak can be bounded without groups too.
  peak = rt.plan(fn, *args, budget=kept.estimated_peak, bounds="estimated peak")
  assert peak.bounds == "estimated peak"
  assert peak.estimated_peak <= kept.estimated_peak


def test_plan_numbers_are_read_from_its_report():
  p = rt.plan(loss, *ARGS, budget="64KiB")
  r = p.report
  assert (p.activation_bytes, p.offloaded_bytes, p.recompute_flops,
          p.recompute_percent) == (r.activation_bytes, r.offloaded_bytes,
                                   r.recompute_flops, r.recompute_percent)
  assert p.estimated_peak == p.activation_bytes + p.workspace_bytes
  data = p.to_dict()
  assert (data["activation_bytes"], data["estimated_peak"]) == (
      r.activation_bytes, p.estimated_peak)


# ------------------------------------------------------------------ frontier

def test_frontier_points_and_pareto_flags(remat_mode):
  f = rt.frontier(loss, *ARGS, budgets=4)
  sources = {p.source for p in f.points}
  assert sources == {"named", "plan"}
  for p in f.points:
    dominated = any(q.activation_bytes <= p.activation_bytes
                    and q.recompute_flops <= p.recompute_flops
                    and (q.activation_bytes < p.activation_bytes
                         or q.recompute_flops < p.recompute_flops)
                    for q in f.points)
    assert p.on_frontier == (not dominated)
  for p, r in zip(f.points, reports_of(loss, ARGS, [p.policy for p in f.points]),
                  strict=True):
    assert (r.activation_bytes, r.recompute_flops) == (p.activation_bytes,
                                                       p.recompute_flops)
  # Plans are on the frontier among named policies at their budgets.
  for p in f.points:
    if p.source == "plan":
      assert p.activation_bytes <= p.budget
  assert "frontier" in str(f) and "<table" in f._repr_html_()
  assert len(f.to_dataframe()) == len(f.points)


def test_frontier_plot_and_given_policies():
  import matplotlib
  matplotlib.use("Agg")
  f = rt.frontier(loss, *ARGS, policies=["boundary-only", "save-everything"],
                  budgets=["40KiB"])
  assert {p.label for p in f.points if p.source == "named"} == {
      "boundary-only", "save-everything"}
  ax = f.plot()
  assert ax.get_xlabel().startswith("activation memory")
  with pytest.raises(TypeError, match="list"):
    rt.frontier(loss, *ARGS, policies="boundary-only")


# ------------------------------------------------------------------ CLI

@pytest.mark.slow
def test_cli_plan_json_save_and_errors(tmp_path, fresh_catalogue):
  path = tmp_path / "p.toml"
  status, out, err = run_cli("plan", "--model", "tiny", "--budget", "60KiB",
                             "--json", "--max-evaluations", "8", "--save", path)
  assert status == 0
  data = json.loads(out)
  assert "wrote" in err
  fn, args = models.build_loss("tiny")
  direct = rt.plan(fn, *args, budget="60KiB", max_evaluations=8)
  assert data["policy"]["save"] == list(direct.policy.save)
  assert data["activation_bytes"] == direct.activation_bytes <= 60 * 1024
  assert rt.load_policies(path) == [direct.policy]
  # Below the least any policy keeps: one line on stderr, status 2.
  status, _, err = run_cli("plan", "--model", "tiny", "--budget", "1KiB")
  assert status == 2
  assert "least activation memory measured" in err and "Traceback" not in err
  status, _, err = run_cli("plan", "--model", "tiny", "--budget", "lots")
  assert status == 2 and "not a memory size" in err


@pytest.mark.slow
def test_cli_plan_text_and_group_sizes():
  status, text, _ = run_cli("plan", "--model", "tiny", "--budget", "400KiB",
                            "--max-evaluations", "4", "--group-sizes", "1,2")
  assert status == 0
  assert "group sizes" in text and "best named policy" in text
  status, _, _ = run_cli("plan", "--model", "tiny", "--budget", "1MiB",
                         "--group-sizes", "0")
  assert status == 2


def test_plan_and_verify_findings_are_kinded():
  """Every finding a plan or a verification carries is a Finding of a known
  kind, so a caller picks them out by kind, never by their wording."""
  layer = rt.remat(lambda w, x: jnp.sin(jnp.sin(x @ w)))

  def loss(w, x):
    return layer(w, layer(w, x)).sum()

  w, x = jnp.eye(4), jnp.ones((2, 4))
  with pytest.warns(UserWarning, match="holds a checkpoint name"):
    plan = rt.plan(loss, w, x, budget="1 MiB")
  assert [f.kind for f in plan.warnings] == ["no-names"]
  with pytest.warns(UserWarning, match="keeps none of its names"):
    verified = rt.verify(loss, w, x, policy="save-ffn")
  assert "keeps-none" in [f.kind for f in verified.warnings]
  for finding in (*plan.warnings, *verified.warnings):
    assert isinstance(finding, str) and re.fullmatch(
        r"[a-z0-9]+(-[a-z0-9]+)*", getattr(finding, "kind", "")), finding
