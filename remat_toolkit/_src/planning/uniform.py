"""The uniform plan's search: one choice of names for every region, measured.

Every number the search compares is measured by the residual analyzer on a
program traced once; none is predicted. Recompute is the analyzer's matmul
FLOPs, so recomputing elementwise work counts as free and, among choices of
equal FLOPs, the one keeping fewer bytes wins. The search has three stages:

1. Measure the named policies, the whole alternatives and each name kept on
   its own (the planner does, when it is built).
2. Add the per-name effects up into a model, solve it exactly (a dynamic
   programme over predicted bytes and FLOPs), and measure its best
   predictions, cheapest first, until the model predicts nothing better than
   what was measured. Names interact (keeping two tensors can spare a
   recompute that neither spares alone), so a prediction can be wrong; the
   measurement decides.
3. Repair or prove the result by a best-first branch and bound over real
   evaluations. It relies on two facts of JAX's partial evaluation: keeping
   more names never recomputes more, and a residual kept when *every*
   undecided name is kept (a name already kept, or a region input) is kept
   whatever the undecided names become. So measuring "keep every undecided
   name" gives, at once, the least recompute below a node (and its optimum,
   if it fits) and a lower bound on its bytes.

Stages 2 and 3 share ``max_evaluations``; :attr:`Plan.optimal` says whether
stage 3 finished, which proves that no choice of names and no whole
alternative recomputes less within the budget. The search itself works on
numbers alone (:mod:`~remat_toolkit._src.planning.search`); this module runs
it on the planner's measurements.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.planning.planner import Planner
  >>> from remat_toolkit._src.planning.search import Limits
  >>> @rt.remat
  ... def block(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
  >>> planner = Planner(lambda w, x: block(w, x).sum(),
  ...                   jax.ShapeDtypeStruct((16, 64), jnp.float32),
  ...                   jax.ShapeDtypeStruct((8, 16), jnp.float32))
  >>> best, proven = planner.uniform.solve(Limits(device=2048, host=0), 8)
  >>> sorted(best.chosen().save), best.recompute_flops, proven
  (['ffn.up'], 0, True)
"""

from __future__ import annotations

from collections.abc import Sequence

from remat_toolkit._src.planning.choices import Evaluator
from remat_toolkit._src.planning.search import AdditiveModel
from remat_toolkit._src.planning.search import Choice
from remat_toolkit._src.planning.search import Limits
from remat_toolkit._src.planning.search import Outcome
from remat_toolkit._src.planning.search import OutOfEvaluations
from remat_toolkit._src.planning.search import Search
from remat_toolkit._src.planning.search import drop_useless

__all__ = ["UniformSearch"]

# Most model predictions measured before the branch and bound starts.
_MODEL_CANDIDATES = 8


class UniformSearch:
  """The least-cost choice of names that fits, on one planner's evaluator.

  Args:
    evaluate: the planner's evaluator; what it measured already competes.
    names: the checkpoint names to choose for.
    boundary: ``boundary-only`` measured, the additive model's base.
    allow_offload: also choose offloading.
    least_cost: the least cost any choice can have (keeping every name or a
      whole alternative); what fits at that cost needs no search.
  """

  def __init__(self, evaluate: Evaluator, names: Sequence[str],
               boundary: Outcome, allow_offload: bool, least_cost: float):
    self.evaluate = evaluate
    self.names = tuple(names)
    self.boundary = boundary
    self.allow_offload = allow_offload
    self.least_cost = least_cost
    self._model: AdditiveModel | None = None

  def solve(self, limits: Limits, max_evaluations: int
            ) -> tuple[Outcome | None, bool]:
    """The least-cost fitting outcome, and whether the search proved it.

    The additive model's predictions are measured cheapest first until the
    model predicts nothing better than what was measured (this repairs a
    prediction that interactions between names made wrong); the branch and
    bound then proves the result over real evaluations, or improves it, with
    at most ``max_evaluations`` analyzer evaluations for both stages.
    """
    search = Search(self.evaluate, self.names, limits, self.allow_offload)
    # Whatever already fits (named policies, whole alternatives) competes.
    for o in list(self.evaluate.outcomes()):
      search.offer(o)
    if search.best is None or search.best.cost > self.least_cost:
      self._search(search, limits, max_evaluations)
    # else nothing recomputes less than what already fits: no search needed.
    best = search.best
    if best is not None and not best.chosen().mode:
      best = drop_useless(self.evaluate, best, limits)
    return best, search.complete

  def _additive_model(self) -> AdditiveModel:
    if self._model is None:
      singles = {n: self.evaluate(Choice(save=frozenset({n})))
                 for n in self.names}
      self._model = AdditiveModel(self.boundary, singles,
                                   self.evaluate.transfer, self.allow_offload)
    return self._model

  def _search(self, search: Search, limits: Limits,
              max_evaluations: int) -> None:
    model = self._additive_model()
    self.evaluate.limit = self.evaluate.evaluations + max_evaluations
    try:
      for predicted, choice in model.ranked(limits, _MODEL_CANDIDATES):
        if search.best is not None and predicted >= search.best.cost:
          break
        search.offer(self.evaluate(choice))
      search.run()
    except OutOfEvaluations:
      search.complete = False
    finally:
      self.evaluate.limit = None
