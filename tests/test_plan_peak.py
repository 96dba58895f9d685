"""Plans whose budget bounds the training step's peak (``bounds="peak"``).

The model keeps a choice that matters for the peak: each layer's ``z`` is
read by the backward pass's matmul for ``w2``'s gradient, so keeping it
spares recomputing ``x @ w1`` but holds ``B x H`` floats per layer until the
backward pass. Every figure is compared with :func:`rt.peak` (the prediction)
or with XLA's own ``memory_analysis`` of ``jax.jit(jax.grad(loss))``, never
with a number written here.
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import xla_step_bytes

import remat_toolkit as rt
from remat_toolkit._src.planning.peak_search import search_peak
from remat_toolkit._src.planning.search import Outcome

S = jax.ShapeDtypeStruct
D, H, B, L = 64, 256, 128, 4


@rt.remat
def layer(w1, w2, x):
  z = rt.tag(x @ w1, "z")
  return x + z @ w2


def loss(params, x):
  for w1, w2 in params:
    x = layer(w1, w2, x)
  return (x ** 2).mean()


ARGS = ([(S((D, H), jnp.float32), S((H, D), jnp.float32))] * L,
        S((B, D), jnp.float32))


def _figures(policy):
  """(predicted peak, recompute FLOPs) of a policy."""
  return (rt.peak(loss, *ARGS, policy=policy).bytes,
          rt.analyze(loss, *ARGS, policy=policy).recompute_flops)


def test_a_budget_between_two_peaks_takes_the_least_recompute_that_fits():
  (lo_peak, lo_flops), (hi_peak, hi_flops) = (
      _figures("boundary-only"), _figures("save-everything"))
  assert lo_peak < hi_peak and hi_flops < lo_flops  # the trade-off exists
  budget = (lo_peak + hi_peak) // 2
  p = rt.plan(loss, *ARGS, budget=budget, bounds="peak")
  assert p.bounds == "peak" and p.peak_bytes <= budget
  assert p.peak_bytes == rt.peak(loss, *ARGS, policy=p.policy).bytes
  assert p.xla_peak_bytes is None  # nothing compiled
  # save-everything recomputes less but its peak is over: it is not taken,
  # and no named policy that fits recomputes less than the plan.
  named = {f.name: f for f in p.named}
  assert not named["save-everything"].fits
  assert named["save-everything"].peak_bytes == hi_peak
  assert all(p.recompute_flops <= f.recompute_flops
             for f in p.named if f.fits)
  assert p.recompute_flops <= lo_flops
  # With room for everything, nothing is recomputed.
  assert rt.plan(loss, *ARGS, budget=hi_peak, bounds="peak").recompute_flops == (
      hi_flops)
  assert "(peak)" in str(p).splitlines()[0]
  assert "predicted step peak" in str(p)
  assert p.to_dict()["peak_bytes"] == p.peak_bytes
  # A policy per region fills the budget between the uniform choices.
  q = rt.plan(loss, *ARGS, budget=budget, bounds="peak", per_layer=True)
  assert q.per_layer and q.peak_bytes <= budget
  assert q.peak_bytes == rt.peak(loss, *ARGS, policy=q.policy).bytes
  assert q.recompute_flops <= p.recompute_flops


def test_with_compile_xla_figure_of_the_plan_fits_the_budget():
  least = rt.peak(loss, *ARGS, policy="boundary-only", compile=True)
  budget = max(least.bytes, least.xla_bytes) * 101 // 100
  p = rt.plan(loss, *ARGS, budget=budget, bounds="peak", compile=True)
  assert p.xla_peak_bytes is not None and p.xla_peak_bytes <= budget
  # XLA's own figure of the step a user compiles under the plan.
  assert xla_step_bytes(loss, ARGS, p) <= budget
  assert "XLA's figure" in str(p)


def test_a_peak_budget_nothing_fits_names_the_least_predicted_peak():
  least = rt.peak(loss, *ARGS, policy="boundary-only").bytes
  with pytest.raises(ValueError, match="No policy fits the peak budget") as e:
    rt.plan(loss, *ARGS, budget=1000, bounds="peak")
  assert "least predicted peak" in str(e.value)
  assert f"({least} bytes, boundary-only)" in str(e.value)


def test_peak_options_are_checked():
  with pytest.raises(ValueError, match=r"bounds must be one of \['kept "
                     r"activations', 'estimated peak', 'peak'\]"):
    rt.plan(loss, *ARGS, budget="1MiB", bounds="peaks")
  with pytest.raises(ValueError, match="needs bounds='peak'"):
    rt.plan(loss, *ARGS, budget="1MiB", compile=True)
  with pytest.raises(TypeError, match="compile must be True or False"):
    rt.plan(loss, *ARGS, budget="1MiB", bounds="peak", compile="yes")
  with pytest.raises(ValueError, match="optimizer= bounds the train step's "
                     "peak; it needs bounds='peak'"):
    rt.plan(loss, *ARGS, budget="1MiB", optimizer="adamw")
  with pytest.raises(ValueError, match="Unknown optimizer 'adamx'"):
    rt.plan(loss, *ARGS, budget="1MiB", bounds="peak", optimizer="adamx")


def test_a_train_step_budget_holds_the_optimizer_state():
  """With optimizer=, the budget bounds the optax train step: a budget that
  fits jax.grad's peak under every policy fits no train step, and the plan
  for a larger one is the train step's peak as rt.peak predicts it."""
  grad_most = rt.peak(loss, *ARGS, policy="save-everything").bytes
  step_least = rt.peak(loss, *ARGS, policy="boundary-only",
                       optimizer="adamw").bytes
  assert grad_most < step_least  # Adam's two moments: more than any policy
  with pytest.raises(ValueError, match="No policy fits the peak budget"):
    rt.plan(loss, *ARGS, budget=grad_most, bounds="peak", optimizer="adamw")
  step_most = rt.peak(loss, *ARGS, policy="save-everything",
                      optimizer="adamw").bytes
  p = rt.plan(loss, *ARGS, budget=step_most, bounds="peak", optimizer="adamw")
  assert p.peak_bytes == rt.peak(loss, *ARGS, policy=p.policy,
                                 optimizer="adamw").bytes
  assert p.peak_bytes <= step_most


def test_with_compile_a_candidate_xla_fits_is_found_where_the_winner_does_not():
  """XLA's figure need not grow with the kept bytes: when the predicted
  winner is over the budget by XLA's figure, and nothing keeping less fits,
  a named policy that fits both by its prediction and by XLA's is taken,
  rather than saying that nothing fits."""
  # name: (kept bytes, recompute cost, predicted peak, XLA's peak)
  table = {"least recompute": (10, 0.0, 90, 120), "named": (20, 1.0, 95, 99)}

  def describe(name):
    kept, cost, _, _ = table[name]
    return Outcome(None, kept, 0, 0, cost, {}), name, name

  def peaks(policy, outcome, label, compile=False):
    _, _, predicted, xla = table[policy]
    return SimpleNamespace(bytes=predicted, xla_bytes=xla if compile else None)

  def solve(limit):  # the search's own plans: only one keeps so little
    return "least recompute" if limit >= 10 else None

  found = search_peak(peaks, solve, describe, 0, 10, 100, compile=True,
                      others=["named"])
  assert found == "named"
  assert search_peak(peaks, solve, describe, 0, 10, 100, compile=False,
                     others=["named"]) == "least recompute"
