"""White-box: the largest-batch search and the step memory it bisects.

``search_largest`` is a pure search over a measuring function (no JAX),
from 1 or from a guessed start (the predicted peak's largest fitting size);
``step_memory`` compiles one training step and reads XLA's memory analysis,
the figure ``rt.largest_batch`` compares with the budget. Both are checked
here directly, through the module's ``__all__``: the public
``rt.largest_batch`` reports only the sizes its search tried.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from shared_helpers import offloading_unsupported
from shared_helpers import remat3
from shared_helpers import scanned_mlp_args as make_args
from shared_helpers import scanned_mlp_loss as scanned_loss

import remat_toolkit as rt
from remat_toolkit._src.bench.batch_search import search_largest
from remat_toolkit._src.bench.batch_search import step_memory

# ---------------------------------------------------------------- the search

def _brute_force(measure, budget, cap):
  best = 0
  for n in range(1, cap + 1):
    if measure(n) > budget:
      break
    best = n
  return best


@pytest.mark.parametrize("fixed,per_example,step,quadratic",
                         [(1000, 37, 1, 0), (5000, 64, 8, 0), (10, 3, 1, 2),
                          (0, 1000, 64, 0), (7, 1, 1, 0)])
@pytest.mark.parametrize("budget", [0, 999, 4000, 123_456, 10**9])
@pytest.mark.parametrize("cap", [1, 5, 300, 4096])
def test_search_finds_the_exact_limit(fixed, per_example, step, quadratic,
                                      budget, cap):
  def measure(n):
    return fixed + per_example * (-(-n // step) * step) + quadratic * n * n

  good, bad, tries = search_largest(measure, budget, cap)
  assert good == _brute_force(measure, budget, cap)
  assert bad == (None if good == cap else good + 1)
  assert len({n for n, _ in tries}) == len(tries)  # no size compiled twice
  assert all(measure(n) == b for n, b in tries)


def test_search_needs_few_compiles_when_memory_is_affine():
  _, _, tries = search_largest(lambda n: 1000 + 37 * n, 1000 + 37 * 300 + 5, 4096)
  assert len(tries) <= 5


@pytest.mark.parametrize("fixed,per_example,step,quadratic",
                         [(1000, 37, 1, 0), (5000, 64, 8, 0), (10, 3, 1, 2)])
@pytest.mark.parametrize("budget", [999, 123_456])
@pytest.mark.parametrize("cap", [5, 4096])
@pytest.mark.parametrize("offset", [None, 0, 1, -1, 7, -7, 10**6, -10**6])
def test_search_from_a_start_finds_the_exact_limit(fixed, per_example, step,
                                                   quadratic, budget, cap,
                                                   offset):
  # The start is a guess (a predicted peak's): right, off by a little or
  # by a lot, the compiled figures alone decide.
  def measure(n):
    return fixed + per_example * (-(-n // step) * step) + quadratic * n * n

  exact = _brute_force(measure, budget, cap)
  start = 1 if offset is None else exact + offset
  good, bad, tries = search_largest(measure, budget, cap, start=start)
  assert good == exact
  assert bad == (None if good == cap else good + 1)
  assert len({n for n, _ in tries}) == len(tries)
  assert tries[0][0] == min(max(start, 1), cap)


def test_a_right_start_takes_two_compiles_and_a_near_one_few():
  measure = lambda n: 1000 + 37 * n  # noqa: E731
  budget = 1000 + 37 * 300 + 5
  assert [n for n, _ in search_largest(measure, budget, 4096, start=300)[2]] == [
      300, 301]
  for start in (270, 330):  # a prediction 10% off
    good, _, tries = search_largest(measure, budget, 4096, start=start)
    assert good == 300 and len(tries) <= 4


# ---------------------------------------------------------------- step memory

def test_step_memory_follows_the_policy(remat_mode):
  args = make_args(abstract=True)
  saved = step_memory(scanned_loss, *args, policy="save-everything")
  remat = step_memory(scanned_loss, *args, policy="boundary-only")
  assert remat["temp_bytes"] < saved["temp_bytes"]
  assert saved["argument_bytes"] == remat["argument_bytes"]


def test_largest_batch_fits_and_its_double_does_not():
  args = make_args(abstract=True)
  budget = step_memory(scanned_loss, *args, batch=24)["peak_bytes"] - 1
  search = rt.largest_batch(scanned_loss, *args, budget=budget,
                            policies=["boundary-only"], max_batch=256,
                            progress=False)
  assert list(search.fits) == ["save-everything", "boundary-only"]
  for policy, fit in search.fits.items():
    assert 1 <= fit.batch < 256 and not fit.hit_cap
    assert fit.over_batch == fit.batch + 1
    assert fit.bytes <= budget < fit.over_bytes
    # The first compile is where the predicted peak meets the budget, not 1.
    assert fit.tries[0][0] > 1
    double = step_memory(scanned_loss, *args, policy=policy, batch=2 * fit.batch)
    assert double["peak_bytes"] > budget
  # Recomputing instead of saving admits more examples under scan.
  assert search.fits["boundary-only"].batch > search.fits["save-everything"].batch
  assert "largest micro-batch" in str(search)


def test_a_jitted_loss_still_takes_each_policy():
  # jit caches its trace by function, ambient policy not included: bench
  # unwraps it so that each policy is traced anew.
  args = make_args(abstract=True)
  jitted = jax.jit(scanned_loss)
  saved = step_memory(jitted, *args, policy="save-everything")
  remat = step_memory(jitted, *args, policy="boundary-only")
  assert remat["temp_bytes"] < saved["temp_bytes"]


def test_step_memory_takes_any_policy_like():
  # A raw JAX policy resolves as everywhere else (Policy.from_jax).
  args = make_args(abstract=True)
  raw = jax.checkpoint_policies.nothing_saveable
  named = step_memory(scanned_loss, *args, policy="boundary-only")
  assert step_memory(scanned_loss, *args, policy=raw) == named
  assert (step_memory(scanned_loss, *args, policy=rt.get_policy("boundary-only"))
          == named)


def test_an_offloading_policy_that_cannot_run_is_refused():
  with remat3(True):
    if not offloading_unsupported():
      pytest.skip(f"jax {jax.__version__}'s remat3 offloads: nothing to refuse")
    with pytest.raises(ValueError,
                       match="Policy 'offload-qkv' offloads to host memory, but"):
      step_memory(scanned_loss, *make_args(abstract=True), policy="offload-qkv")


def test_the_optimizer_is_taken_by_name_as_peak_and_plan_take_it():
  """``optimizer="sgd"`` is optax's sgd, as in rt.peak, rt.plan and
  rt.memory_breakdown; an unknown name is refused with the known ones."""
  loss = lambda w, b: jnp.mean((b @ w) ** 2)  # noqa: E731
  args = (jax.ShapeDtypeStruct((4, 4), jnp.float32),
          jax.ShapeDtypeStruct((1, 4), jnp.float32))
  options = dict(budget="2KiB", max_batch=64, policies=[], progress=False)
  named = rt.largest_batch(loss, *args, optimizer="sgd", **options)
  given = rt.largest_batch(loss, *args, optimizer=optax.sgd(1e-3), **options)
  assert named.fits["save-everything"] == given.fits["save-everything"]
  with pytest.raises(ValueError, match="'nadam-ish'.*adamw"):
    rt.largest_batch(loss, *args, optimizer="nadam-ish", **options)
