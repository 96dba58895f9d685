"""The planner's search on numbers alone: no JAX, no tracing.

Each test builds a table of made-up measurements (bytes and recompute per
choice of kept names) that obeys the two facts the branch and bound relies
on (keeping more never recomputes more; what is held when every undecided
name is kept is held whatever they become), and checks the search against
brute force over every subset.
"""

import itertools
import random

import pytest

from remat_toolkit._src.planning import search as plan_search
from remat_toolkit._src.planning.search import AdditiveModel
from remat_toolkit._src.planning.search import Choice
from remat_toolkit._src.planning.search import Limits
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.planning.search import Search
from remat_toolkit._src.planning.search import drop_useless


def test_the_search_module_imports_no_jax():
  source = plan_search.__file__
  with open(source, encoding="utf-8") as f:
    text = f.read()
  assert "import jax" not in text and "from jax" not in text


class Table:
  """Made-up measurements: each name holds some bytes and spares some
  recompute when kept; ``pairs`` spare extra recompute only together."""

  def __init__(self, nbytes, spared, pairs=(), base_cost=100, base_bytes=10):
    self.nbytes, self.spared, self.pairs = nbytes, spared, dict(pairs)
    self.base_cost, self.base_bytes = base_cost, base_bytes
    self.evaluations = 0
    self.limit = None

  def __call__(self, choice: Choice) -> Outcome:
    if self.limit is not None and self.evaluations >= self.limit:
      raise plan_search.OutOfEvaluations
    self.evaluations += 1
    kept = choice.save
    cost = self.base_cost - sum(self.spared[n] for n in kept)
    cost -= sum(v for pair, v in self.pairs.items() if pair <= kept)
    by_name = {n: self.nbytes[n] for n in kept}
    return Outcome(choice, self.base_bytes + sum(by_name.values()), 0,
                   cost, cost, by_name)

  def brute_force(self, device):
    names = sorted(self.nbytes)
    best = None
    for k in range(len(names) + 1):
      for keep in itertools.combinations(names, k):
        o = self(Choice(save=frozenset(keep)))
        if o.device_bytes <= device and (best is None or o.cost < best):
          best = o.cost
    return best


def random_table(seed, count=6):
  rng = random.Random(seed)
  names = [f"n{i}" for i in range(count)]
  pairs = {frozenset(rng.sample(names, 2)): rng.randint(1, 9)
           for _ in range(2)}
  return Table({n: rng.randint(1, 20) for n in names},
               {n: rng.randint(0, 9) for n in names}, pairs)


@pytest.mark.parametrize("seed", range(12))
def test_branch_and_bound_equals_brute_force(seed):
  table = random_table(seed)
  total = table.base_bytes + sum(table.nbytes.values())
  for device in range(table.base_bytes, total + 1, 7):
    search = Search(table, sorted(table.nbytes), Limits(device, 0),
                    allow_offload=False)
    search.run()
    assert search.complete
    assert search.best.cost == table.brute_force(device), device
    assert search.best.device_bytes <= device


def test_nothing_fits_leaves_no_best():
  table = random_table(0)
  search = Search(table, sorted(table.nbytes), Limits(table.base_bytes - 1, 0),
                  allow_offload=False)
  search.run()
  assert search.best is None and search.complete


def test_out_of_evaluations_is_raised_to_the_caller():
  table = random_table(1)
  table.limit = 1
  search = Search(table, sorted(table.nbytes), Limits(table.base_bytes + 5, 0),
                  allow_offload=False)
  with pytest.raises(plan_search.OutOfEvaluations):
    search.run()
  assert not search.complete


def test_drop_useless_removes_names_that_spare_nothing():
  table = Table({"a": 4, "b": 4}, {"a": 5, "b": 0})
  both = table(Choice(save=frozenset({"a", "b"})))
  best = drop_useless(table, both, Limits(100, 0))
  assert best.choice.save == {"a"}


def test_additive_model_is_exact_without_interactions():
  table = Table({"a": 4, "b": 6, "c": 3}, {"a": 5, "b": 9, "c": 1})
  base = table(Choice())
  singles = {n: table(Choice(save=frozenset({n}))) for n in table.nbytes}
  model = AdditiveModel(base, singles, 0.0, allow_offload=False)
  for device in range(10, 24):
    ranked = model.ranked(Limits(device, 0), count=3)
    predicted, choice = ranked[0]
    assert predicted == table(choice).cost == table.brute_force(device)
    assert [c for c, _ in ranked] == sorted(c for c, _ in ranked)


def test_additive_model_offloads_when_transfers_are_cheap():
  table = Table({"a": 4}, {"a": 5})
  base = table(Choice())
  model = AdditiveModel(base, {"a": table(Choice(save=frozenset({"a"})))},
                        transfer_flops_per_byte=0.1, allow_offload=True)
  (cost, choice), *_ = model.ranked(Limits(device=10, host=100), count=2)
  assert choice.offload == {"a"} and cost == pytest.approx(95.8)
  # No host room: only recomputing fits the device budget.
  (cost, choice), = model.ranked(Limits(device=10, host=0), count=2)
  assert choice == Choice() and cost == 100


def test_choice_digest_depends_on_the_choice_only():
  a = Choice(save=frozenset({"x", "y"}))
  assert a.digest() == Choice(save=frozenset({"y", "x"})).digest()
  assert a.digest() != Choice(offload=frozenset({"x", "y"})).digest()
  assert a.digest() != Choice(mode="save-matmuls").digest()
