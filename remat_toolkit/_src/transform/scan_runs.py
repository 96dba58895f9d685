"""A per-region plan on a scanned stack: one scan and one stack per run.

Regions inside one ``scan`` share one body, so a scan takes one policy. A
plan made per block on the unrolled model (``rt.plan(..., per_layer=True)``)
gives each remat region of the stack its own policy; the stack then runs as
consecutive scans, one per *run* of regions with equal policy. Each run is
an ordinary scan, ``nn.scan(remat(block, policy=run_policy,
prevent_cse=False))``, over variables of its own: the stack's variables are
one subtree per run, ``run_0``, ``run_1``, ... (:func:`run_name`), each
stacked like the single scan's (leading shape ``(n,)`` for a run of ``n``
regions, ``(n, group)`` with ``group > 1``). When every region has the same
policy there is one run and the stack is the single scan, variables and
program unchanged.

What this costs, compared with the single scan:

* Residuals: a run keeps what the same regions keep in the unrolled model
  (its regions' inputs and what each policy allows), so the scanned stack
  keeps exactly the plan's ``activation_bytes`` and recomputes the plan's
  FLOPs. Under ``save-everything`` the unrolled and scanned programs keep
  different values (the scanned one less, measured on the built-in GPT),
  so a plan with such regions is not matched byte for byte. A run under
  ``save-everything`` keeps no copy of its parameters: they are the scan's
  own inputs, forwarded to the backward pass.
* Gradients: each run's gradient is the size of its own variables, so
  splitting a stack adds no stack-sized buffer. Measured on XLA:CPU with
  ``--xla_cpu_enable_concurrency_optimized_scheduler=false``, ``jax.grad``
  of an 8-layer stack with 24 MiB of parameters: 10.0 MiB of temporaries
  as one run, 8.0 MiB as 2 runs, 16.5 MiB as 8 runs of one layer each
  (reading each layer by index from one stack gave 32 and 33.5 MiB).
* Compile time: one scan body per run.

Because the variables depend on the plan, :func:`restack` moves a stack's
variables between layouts (a run resumed under a different plan): the
single stack is the runs concatenated along the leading axis. Variables the
call changes (batch statistics, ``sow``, NNX rng counts) live in the same
layout. ``init`` builds the single scan's variables and splits them, so a
seed gives the same model whatever the plan; linen dropout keys are split
per run (they differ from the single scan's but still per layer), NNX ones
are the single scan's (they live in the stacked state).

Example:
  >>> import jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> stack = {"kernel": jnp.zeros((4, 3, 3))}  # a single scan's variables
  >>> runs = rt.restack(stack, ["boundary-only"] * 3 + ["save-ffn"])
  >>> {k: v["kernel"].shape for k, v in runs.items()}
  {'run_0': (3, 3, 3), 'run_1': (1, 3, 3)}
  >>> rt.restack(runs, None)["kernel"].shape
  (4, 3, 3)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_toolkit._src.core.globs import is_glob
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.transform import remat as transform

__all__ = ["Run", "planned_runs", "run_name", "run_where", "restack",
           "linen_stack", "nnx_runs", "nnx_call", "layout_doc"]

@dataclasses.dataclass(frozen=True)
class Run:
  """Remat regions ``start .. stop - 1`` of a stack, with one policy.

  Attributes:
    start: the first region (in regions, not layers).
    stop: one past the last region.
    policy: the regions' policy; None reads the ambient one at trace time.
  """

  start: int
  stop: int
  policy: Policy | None


def run_name(index: int) -> str:
  """The name of run ``index``'s variables in a stack's tree: ``run_<k>``."""
  return f"run_{index}"


# ---------------------------------------------------------------- policies

def planned_runs(policy: Any, length: int, size: int, where: str
                 ) -> tuple[Run, ...] | None:
  """The runs of equal policy ``policy`` gives a stack, or None for one policy.

  Args:
    policy: what a ``scan_layers`` ``policy=`` argument holds. A plan, a
      per-region :class:`Policy`, a catalogue name of one (looked up now), or
      a list or tuple of policies (each anything ``policy=`` accepts) gives
      one policy per region, in order; anything else is one policy for all.
    length: the stack's layers.
    size: layers per remat region.
    where: how errors name the stack.

  Returns:
    The runs, in order (one run when every region has the same policy), or
    None when ``policy`` is a single policy.

  Raises:
    ValueError: when the count is not ``length // size``, a per-region
      policy names regions by glob (no order), an entry is itself a
      per-region policy, or a name is unknown.
    TypeError: for an entry that is not a policy.

  Example:
    >>> from remat_toolkit._src.transform import scan_runs
    >>> runs = scan_runs.planned_runs(
    ...     ["boundary-only", "boundary-only", "save-ffn", "save-ffn"], 4, 1,
    ...     "scan_layers(Block)")
    >>> [(r.start, r.stop, r.policy.name) for r in runs]
    [(0, 2, 'boundary-only'), (2, 4, 'save-ffn')]
  """
  policies = _region_policies(policy, where)
  if policies is None:
    return None
  regions = length // size
  if len(policies) != regions:
    what = (f"the list of {len(policies)} policies"
            if isinstance(policy, (list, tuple))
            else f"the per-region policy {_name(policy)!r}, with "
                 f"{len(policies)} regions,")
    raise ValueError(
        f"{where}: {what} does not fit the stack's {regions} remat regions "
        f"({length} layers, {size} per region); a scanned stack takes "
        f"exactly one policy per region, in order. Plan the unrolled model "
        f"with the same layers and group (rt.plan(..., per_layer=True) with "
        f"{length} layers, {size} per region) or pass {regions} policies.")
  return _runs(policies)


def _runs(policies: Sequence[Policy | None]) -> tuple[Run, ...]:
  runs: list[Run] = []
  start = 0
  for i in range(1, len(policies) + 1):
    if i == len(policies) or policies[i] != policies[start]:
      runs.append(Run(start, i, policies[start]))
      start = i
  return tuple(runs)


def _region_policies(policy: Any, where: str) -> list[Policy | None] | None:
  """One policy per region, in order; None when ``policy`` is one policy."""
  if isinstance(policy, (list, tuple)):
    return [_entry(item, i, where) for i, item in enumerate(policy)]
  if policy is None:
    return None
  resolved = resolve.resolve_policy(transform.validate_policy(policy, where))
  if not resolved.is_per_region:
    return None
  globs = [key for key, _ in resolved.regions if is_glob(key)]
  if globs:
    raise ValueError(
        f"{where}: the per-region policy {resolved.name!r} names regions by "
        f"pattern ({', '.join(repr(g) for g in globs[:3])}), which puts no "
        "order on a scanned stack's regions; give one region key per remat "
        "region, in layer order (as rt.plan(..., per_layer=True) on the "
        "unrolled model does), or a list of policies.")
  return [p for _, p in resolved.regions]


def _entry(item: Any, index: int, where: str) -> Policy | None:
  if item is None:
    return None  # the ambient policy, read at trace time
  if isinstance(item, (list, tuple)):
    raise TypeError(
        f"{where}: policy[{index}] is {item!r}; each entry is one region's "
        "policy (a name, a Policy, a plan or a jax.checkpoint_policies "
        "policy), not a list.")
  try:
    resolved = resolve.resolve_policy(item, argument=f"policy[{index}]")
  except TypeError as error:
    raise TypeError(f"{where}: {error}") from None
  if resolved.is_per_region:
    raise ValueError(
        f"{where}: policy[{index}] is the per-region policy "
        f"{resolved.name!r}; each entry is one region's policy. Pass that "
        "per-region policy (or its plan) as policy= itself instead of a "
        "list.")
  return resolved


def _name(policy: Any) -> str:
  return resolve.resolve_policy(policy).name


def run_where(where: str, run: Run, size: int) -> str:
  """How warnings and errors name ``run`` of the stack ``where``."""
  return (f"{where} layers {run.start * size}.."
          f"{run.stop * size - 1} (policy "
          f"{'ambient' if run.policy is None else run.policy.name})")


def layout_doc(block: str, length: int, size: int,
               runs: Sequence[Run]) -> str:
  """The docstring of a stack scanned in runs."""
  parts = ", ".join(
      f"{run_name(k)}: layers {r.start * size}..{r.stop * size - 1} "
      f"{'ambient' if r.policy is None else r.policy.name}"
      for k, r in enumerate(runs))
  return (f"{length} x {block}, as {len(runs)} consecutive scans with "
          f"variables of their own, one remat region per {size} block(s): "
          f"{parts}.")


# ---------------------------------------------------------------- layouts

def _rows(tree: Any, start: int, stop: int) -> Any:
  return jax.tree.map(lambda v: v[start:stop], tree)


def _concatenated(parts: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _run_count(tree: Any) -> int:
  """How many runs a tree in the runs layout holds; 0 for any other tree."""
  if not isinstance(tree, Mapping) or len(tree) < 2:
    return 0
  names = {run_name(k) for k in range(len(tree))}
  return len(tree) if set(tree) == names else 0


def _joined(tree: Any) -> Any:
  """The single layout of a stack's variables in either layout."""
  count = _run_count(tree)
  if not count:
    return tree
  return _concatenated([tree[run_name(k)] for k in range(count)])


def _as_mapping_like(tree: Any, parts: dict[str, Any]) -> Any:
  """``parts`` as the mapping type of ``tree`` (an ``nnx.State`` stays one)."""
  if isinstance(tree, dict) or not isinstance(tree, Mapping):
    return parts
  # An nnx.State holds plain mappings inside (its getter wraps them): nest
  # those, so the result flattens like the state of a module.
  # A Mapping subclass built from a dict, as nnx.State is (Mapping itself
  # declares no such constructor).
  state_type: Any = type(tree)
  return state_type({k: getattr(v, "raw_mapping", v) for k, v in parts.items()})


def _split(stack: Any, runs: Sequence[Run], where: str) -> Any:
  regions = runs[-1].stop
  bad = [(jax.tree_util.keystr(path), getattr(leaf, "shape", None))
         for path, leaf in jax.tree_util.tree_leaves_with_path(stack)
         if not getattr(leaf, "shape", ()) or leaf.shape[0] != regions]
  if bad:
    path, shape = bad[0]
    raise ValueError(
        f"{where}: the variable at {path or 'the root'} has shape {shape}, "
        f"but the policy gives {regions} remat regions, so each stacked "
        f"variable needs a leading axis of {regions}. Pass the variables of "
        "one scanned stack (the subtree under its name, such as "
        "params['layers']) and a policy with one entry per remat region of "
        "that stack.")
  return _as_mapping_like(stack, {
      run_name(k): _rows(stack, run.start, run.stop)
      for k, run in enumerate(runs)})


def restack(variables: Any, policy: Any) -> Any:
  """A scanned stack's variables in the layout ``policy`` gives it.

  :func:`scan_layers` gives a stack with one
  policy per remat region one subtree of variables per run of equal policy
  (``run_0``, ``run_1``, ...; see :mod:`~remat_toolkit._src.transform.scan_runs`),
  and a stack with one policy the single scan's variables. This moves a
  stack's variables, in either layout, to the layout of ``policy``: to
  resume training under a different plan, or to read a planned stack's
  variables layer by layer. The single stack is the runs concatenated along
  the leading axis; nothing else changes.

  Args:
    variables: one stack's variables: a tree of arrays stacked along a
      leading axis of remat regions (the single layout), or a mapping with
      exactly the keys ``run_0 .. run_<n-1>``, ``n >= 2`` (the runs
      layout). For linen, the stack's subtree in one collection
      (``params['layers']``, ``batch_stats['layers']``); for NNX, the state
      of the stack's ``blocks`` (``nnx.state(model.layers.blocks)``).
    policy: the layout's policy, anything ``scan_layers`` takes: one policy
      per region (a per-layer plan, a per-region Policy or its name, a
      list) gives the runs layout (the single one when all are equal); a
      single policy or None gives the single layout.

  Returns:
    ``variables`` in the new layout (the same tree type: an ``nnx.State``
    stays one). Leaves are sliced or concatenated, not copied otherwise.

  Raises:
    ValueError: when a leaf's leading axis is not the number of remat
      regions of ``policy``, or for a bad policy (as ``scan_layers``).

  Example:
    Resuming a linen stack under a different plan:

    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import remat_toolkit as rt
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + jnp.tanh(rt.tag(nn.Dense(3)(x), "ffn.up"))
    >>> old = ["save-ffn"] * 2 + ["boundary-only"] * 2
    >>> new = ["boundary-only"] * 3 + ["save-ffn"]
    >>> x = jnp.ones((2, 3))
    >>> params = rt.scan_layers(Block, 4, policy=old)().init(
    ...     jax.random.key(0), x)["params"]
    >>> params["run_1"]["Dense_0"]["kernel"].shape
    (2, 3, 3)
    >>> moved = rt.restack(params, new)
    >>> moved["run_0"]["Dense_0"]["kernel"].shape
    (3, 3, 3)
    >>> y = rt.scan_layers(Block, 4, policy=new)().apply({"params": moved}, x)
    >>> y_single = rt.scan_layers(Block, 4)().apply(
    ...     {"params": rt.restack(params, None)}, x)
    >>> bool(jnp.allclose(y, y_single))
    True
  """
  where = "restack"
  variables = _joined(variables)
  policies = _region_policies(policy, where)
  if policies is None:
    return variables
  runs = _runs(policies)
  if len(runs) == 1:
    return variables
  return _split(variables, runs, where)


# ---------------------------------------------------------------- linen

def linen_stack(block_cls: type, length: int, size: int, runs: Sequence[Run],
                single_scan: Callable[[int, Any, bool], type]) -> type:
  """The linen module class applying ``runs``, one child scan per run.

  Args:
    block_cls: the block class; the stack takes its constructor arguments.
    length: the stack's blocks.
    size: blocks per remat region.
    runs: the runs, in order.
    single_scan: ``single_scan(n, policy, remat)`` is ``scan_layers``'
      single-scan class of ``n`` blocks under ``policy``.

  Returns:
    A subclass of ``block_cls`` (for its fields) whose ``__call__`` applies
    child ``run_k`` (a single-scan class) for each run in order; ``init``
    runs the single scan of the whole stack and splits its variables.
  """
  from flax import linen as nn

  fields = [f.name for f in dataclasses.fields(block_cls)
            if f.init and f.name not in ("parent", "name")]
  run_classes = [single_scan((r.stop - r.start) * size, r.policy, True)
                 for r in runs]
  whole = single_scan(length, None, False)

  def init_whole(module, x, *args):
    # The single scan bound to this module's own scope: its variables (and
    # their random values) are the single scan's, then split per run.
    scan = whole(**{n: getattr(module, n) for n in fields},
                 parent=module.scope)
    return scan(x, *args)

  split = functools.partial(_split, runs=runs, where="scan_layers init")

  @nn.compact
  def __call__(self, x, *args):
    if self.is_initializing():
      # The variables of a fresh stack are split after the single scan made
      # them, so a seed gives the same model whatever the plan.
      # (Flax runs init_whole twice: to make the variables, then on them,
      # seen through trans_in_fn.)
      return nn.map_variables(
          init_whole, True,
          trans_in_fn=lambda vs: {c: _joined(v) for c, v in vs.items()},
          trans_out_fn=lambda vs: {c: split(v) if v else v
                                   for c, v in vs.items()},
          init=True, mutable=True)(self, x, *args)
    kwargs = {n: getattr(self, n) for n in fields}
    for k, cls in enumerate(run_classes):
      x = cls(**kwargs, name=run_name(k))(x, *args)
    return x

  def setup(self):
    del self  # the block's own setup runs inside each run's scan

  return type(f"Scanned{block_cls.__name__}", (block_cls,), {
      "__call__": __call__, "setup": setup,
      "__module__": block_cls.__module__,
      "__doc__": layout_doc(block_cls.__name__, length, size, runs)})


# ---------------------------------------------------------------- NNX

def nnx_runs(blocks: Any, runs: Sequence[Run]) -> Any:
  """Stacked NNX ``blocks`` as an ``nnx.Dict`` of one stacked module per run.

  Each run's state is the rows of the single stack's (rng keys and counts
  included), so its dropout masks are the single scan's.
  """
  from flax import nnx
  graphdef, state = nnx.split(blocks)
  return nnx.Dict({
      run_name(k): nnx.merge(graphdef, _rows(state, run.start, run.stop))
      for k, run in enumerate(runs)})


def nnx_call(blocks: Any, x: Any, runs: Sequence[Run],
             apply_region: Callable[[Any, Any], Any],
             scan: Callable[[Callable[..., Any], Any, Any], Any], where: str,
             size: int) -> Any:
  """Applies the runs of an NNX stack, one scan over each run's blocks.

  Args:
    blocks: the ``nnx.Dict`` of :func:`nnx_runs`; each run's state is
      updated in place by its scan.
    x: the carry.
    runs: the runs, in order.
    apply_region: ``apply_region(region_blocks, x)`` applies one region's
      blocks (one block, or ``size`` stacked ones).
    scan: ``scan(region, stacked_blocks, x)`` scans ``region`` over a stack.
    where: how warnings name the stack.
    size: blocks per region, for the warnings.

  Returns:
    The last region's output.
  """
  for k, run in enumerate(runs):
    region = transform.remat_region(
        apply_region, policy=run.policy, prevent_cse=False,
        where=run_where(where, run, size))
    x = scan(region, blocks[run_name(k)], x)
  return x
