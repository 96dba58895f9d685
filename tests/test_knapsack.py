"""The per-region solver on numbers: exact against enumerating every mix."""

import itertools
import math
import random

import pytest

from remat_toolkit._src.planning import knapsack
from remat_toolkit._src.planning.knapsack import Option


def _random_groups(rng, count, options, host):
  return [[Option(rng.randrange(0, 40), rng.randrange(0, 10) if host else 0,
                  rng.randrange(0, 50)) for _ in range(options)]
          for _ in range(count)]


def _every_mix(groups):
  for picks in itertools.product(*(range(len(g)) for g in groups)):
    chosen = [g[k] for g, k in zip(groups, picks, strict=True)]
    yield (sum(o.device for o in chosen), sum(o.host for o in chosen),
           sum(o.cost for o in chosen), picks)


@pytest.mark.parametrize("host", [False, True], ids=["device", "device+host"])
def test_cheapest_mix_equals_enumerating_every_mix(host):
  rng = random.Random(7)  # derandomised: the same 40 cases every run
  for _ in range(40):
    groups = _random_groups(rng, rng.randrange(1, 5), rng.randrange(1, 5), host)
    everything = list(_every_mix(groups))
    mixes = knapsack.pareto_mixes(groups)
    for device in range(0, 161, 8):
      host_limit = rng.choice([math.inf, 5, 12]) if host else math.inf
      fitting = [m for m in everything
                 if m[0] <= device and m[1] <= host_limit]
      best = knapsack.cheapest(mixes, device=device, host=host_limit)
      if not fitting:
        assert best is None
        continue
      assert best.cost == min(m[2] for m in fitting)
      assert (best.device, best.host) <= (device, host_limit)
      # The picks are what the sums say.
      chosen = [g[k] for g, k in zip(groups, best.picks, strict=True)]
      assert (sum(o.device for o in chosen), sum(o.host for o in chosen),
              sum(o.cost for o in chosen)) == (best.device, best.host,
                                               best.cost)


def test_identical_regions_stay_few_states():
  # 48 identical regions with a convex front: the front of the sums grows
  # linearly, which is what keeps a 48-layer plan fast.
  region = [Option(0, 0, 100), Option(3, 0, 60), Option(7, 0, 30),
            Option(12, 0, 10), Option(20, 0, 0)]
  mixes = knapsack.pareto_mixes([region] * 48)
  assert len(mixes) <= 48 * (len(region) - 1) + 1
  assert [m.device for m in mixes] == sorted(m.device for m in mixes)
  costs = [m.cost for m in mixes]
  assert costs == sorted(costs, reverse=True)


def test_limits_drop_what_cannot_fit_and_ties_prefer_the_first_option():
  groups = [[Option(0, 0, 5), Option(0, 0, 5), Option(9, 0, 0)]] * 2
  mixes = knapsack.pareto_mixes(groups, device=9)
  assert [(m.device, m.cost, m.picks) for m in mixes] == [
      (0, 10, (0, 0)), (9, 5, (0, 2))]
  with pytest.raises(ValueError, match="group 1 has no option"):
    knapsack.pareto_mixes([[Option(0, 0, 1)], []])
