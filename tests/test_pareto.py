"""One Pareto rule and one chart, for the comparison and the frontier alike.

Three implementations used to disagree: the frontier's ignored offloaded
bytes (so an offloading policy hid the policies that move nothing), and the
planner's dynamic programme dropped all but one of equal points, which the
tables' flags must not. Now ``pareto_flags`` decides for all of them.
"""

import itertools
import sys

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from shared_helpers import remat3
from shared_helpers import remat3_offloads

import remat_toolkit as rt
from remat_toolkit._src.core.pareto import dominates
from remat_toolkit._src.core.pareto import pareto_flags
from remat_toolkit._src.core.pareto import undominated

S = jax.ShapeDtypeStruct


def by_definition(points):
  return [not any(all(o <= m for o, m in zip(other, mine, strict=True)) and other != mine
                  for other in points) for mine in points]


@given(st.lists(st.tuples(*[st.integers(0, 4)] * 3), max_size=30))
def test_flags_follow_the_definition(points):
  assert pareto_flags(points) == by_definition(points)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=20))
def test_undominated_keeps_one_of_each_front_value_in_order(points):
  items = list(enumerate(points))
  kept = undominated(items, key=lambda item: item[1])
  front = {p for p, on in zip(points, pareto_flags(points), strict=True) if on}
  assert [p for _, p in kept] == sorted(front)
  for i, p in kept:  # the first of equal points is the one kept
    assert i == points.index(p)


def test_equal_points_share_the_front():
  # Two policies with the same numbers are both Pareto-optimal in a table.
  assert pareto_flags([(3, 1), (3, 1), (4, 1)]) == [True, True, False]
  assert undominated([(3, 1, "x"), (3, 1, "y")], key=lambda s: s[:2]) == [
      (3, 1, "x")]


def test_offloaded_bytes_are_a_criterion_of_their_own():
  # Fewer device bytes bought with host transfers does not dominate.
  moves_nothing, offloads = (20, 0, 0), (10, 0, 50)
  assert not dominates(offloads, moves_nothing)
  assert pareto_flags([moves_nothing, offloads]) == [True, True]
  assert pareto_flags([(20, 0), (10, 0)]) == [False, True]


def test_mixed_lengths_are_refused():
  with pytest.raises(ValueError, match="same number of criteria"):
    pareto_flags([(1, 2), (1, 2, 3)])
  assert pareto_flags([]) == []


# ---------------------------------------------------------------- models

@rt.remat
def block(w1, w2, x):
  u = rt.tag(jnp.tanh(x) @ w1, "u")
  return x + rt.tag(jnp.tanh(u), "s") @ w2


def loss(w1, w2, x):
  return (block(w1, w2, x) ** 2).mean()


ARGS = (S((8, 16), jnp.float32), S((16, 8), jnp.float32), S((4, 8), jnp.float32))
KEEP_U = rt.Policy(name="keep-u", save=["u"])
OFFLOAD_U = rt.Policy(name="offload-u", offload=["u"])


def test_an_offloading_policy_does_not_hide_the_frontier():
  with remat3(False):
    f = rt.frontier(loss, *ARGS, budgets=[],
                    policies=["boundary-only", KEEP_U, OFFLOAD_U])
  points = {p.label: p for p in f.points}
  keep, off = points["keep-u"], points["offload-u"]
  # In memory and recompute alone, offloading beats keeping...
  assert off.activation_bytes < keep.activation_bytes
  assert off.recompute_flops <= keep.recompute_flops and off.offloaded_bytes
  # ...but it moves bytes to host, so both are on the frontier.
  assert keep.on_frontier and off.on_frontier
  flags = pareto_flags([(p.activation_bytes, p.recompute_flops,
                         p.offloaded_bytes) for p in f.points])
  assert [p.on_frontier for p in f.points] == flags
  assert "offload" in str(f).splitlines()[-1]


@pytest.mark.skipif(remat3_offloads(),
                    reason="this JAX's remat3 offloads")
def test_frontier_skips_what_cannot_run_and_warns():
  with remat3(True), pytest.warns(UserWarning, match="offload-u"):
    f = rt.frontier(loss, *ARGS, budgets=[],
                    policies=["boundary-only", OFFLOAD_U])
  assert [p.label for p in f.points] == ["boundary-only"]
  assert "jax_remat3" in f.skipped["offload-u"]
  assert "skipped offload-u" in str(f)
  assert f.to_dict()["skipped"] == dict(f.skipped)


# ---------------------------------------------------------------- the plot

def flat(pairs):
  return [v for pair in sorted(pairs) for v in pair]


def scatter_points(ax):
  return flat(tuple(map(float, xy)) for c in ax.collections
              for xy in c.get_offsets())


@pytest.fixture
def agg():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  yield
  plt.close("all")


def test_both_charts_put_memory_on_x_and_recompute_on_y(agg):
  policies = ["boundary-only", "save-everything", KEEP_U,
              rt.Policy(name="keep-s", save=["s"])]
  comparison = rt.compare(loss, *ARGS, policies=policies)
  f = rt.frontier(loss, *ARGS, policies=policies, budgets=2)
  for result, points in (
      (comparison, [(r["activation_bytes"], r["recompute_percent"], r["pareto"])
                    for r in comparison.rows()]),
      (f, [(p.activation_bytes, p.recompute_percent, p.on_frontier)
           for p in f.points])):
    ax = result.plot()
    assert "memory" in ax.get_xlabel() and "MiB" in ax.get_xlabel()
    assert "recompute" in ax.get_ylabel()
    expected = flat((b / 2**20, r) for b, r, _ in points)
    assert scatter_points(ax) == pytest.approx(expected)
    # The front is joined, least memory first.
    (line,) = ax.lines
    front = sorted((b / 2**20, r) for b, r, on in points if on)
    xs = sorted(set(line.get_xdata()))
    assert xs == pytest.approx(sorted({x for x, _ in front}))


def test_plans_are_marked_and_named_policies_labelled(agg):
  f = rt.frontier(loss, *ARGS, policies=["boundary-only", "save-everything"],
                  budgets=2)
  ax = f.plot()
  plans = [p for p in f.points if p.source == "plan"]
  assert plans
  assert sorted(t.get_text() for t in ax.texts) == [
      "boundary-only", "save-everything"]
  assert [t.get_text() for t in ax.get_legend().get_texts()] == [
      "named policy", "plan"]
  # Drawn on the axes given, not a new figure.
  import matplotlib.pyplot as plt
  _, given_ax = plt.subplots()
  assert f.plot(ax=given_ax) is given_ax
  assert rt.compare(loss, *ARGS, policies=["boundary-only"]).plot(
      ax=given_ax) is given_ax


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
  f = rt.frontier(loss, *ARGS, policies=["boundary-only"], budgets=[])
  for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ImportError, match="plot needs matplotlib"):
    f.plot()


def test_no_three_criteria_point_is_dominated_in_the_small_model():
  # Every pair of frontier points: neither dominates the other.
  f = rt.frontier(loss, *ARGS, budgets=3)
  front = [(p.activation_bytes, p.recompute_flops, p.offloaded_bytes)
           for p in f.frontier]
  assert front
  for a, b in itertools.permutations(front, 2):
    assert not dominates(a, b)
