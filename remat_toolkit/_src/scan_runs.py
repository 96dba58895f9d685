"""A per-region plan on a scanned stack: consecutive scans of equal policy.

Regions inside one ``scan`` share one body, so a scan takes one policy. A
plan made per block on the unrolled model (``rt.plan(..., per_layer=True)``)
gives each remat region of the stack its own policy; the stack then runs as
consecutive scans, one per run of regions with equal policy, each region
with its run's policy given explicitly (inside a scan every region has the
scan's key, so the ambient per-region lookup could not tell them apart).

The variables stay those of the single scan: one tree, each leaf stacked
along the leading axis (``(length,)`` or ``(length // group, group)``), so
a checkpoint written under one plan loads under any other. Variables the
call does not change (``params``, NNX ``Param``) are read by each region
from the whole stack by its layer index, inside the remat region: the
backward pass recomputes that read instead of keeping a copy of the
layers' variables. What each scan keeps is therefore what the same regions
keep in the unrolled model, plus the layer index of each region (an int32,
4 bytes per region). A policy that keeps every intermediate
(``save-everything``) keeps the read variables too, and says so when the
stack is built; ``save-matmuls`` recomputes no matmul either and keeps only
their outputs.

The stack's gradient is the sum of the runs' gradients, each the size of
the whole stack (a read by index transposes to an update of the whole
stack). XLA:CPU keeps each run's until the final sum: measured on an 8-layer
stack, temporaries grow by about one stack of parameters per run after the
first (2 runs: +1, 4 runs: +3; runs of one layer each are unrolled:
about +1). The analyzer counts residuals, not gradient buffers, so it does
not show this. Slicing the stack per run instead would keep every slice as
a residual (a copy of the stack's parameters at the start of the backward
pass), and measured no better on XLA:CPU.

Collections the call changes (batch statistics, ``sow``, NNX rng counts)
are sliced per run, scanned like the single scan's, and written back: the
updated stack is the concatenation of the runs' updates. NNX dropout keys
are the single scan's (they are stacked per layer); linen ones are split
per scan, so they differ from the single scan's but still per layer.

Example:
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src import scan_runs
  >>> runs = scan_runs.planned_runs(
  ...     ["boundary-only", "boundary-only", "save-ffn", "save-ffn"], 4, 1,
  ...     "scan_layers(Block)")
  >>> [(r.start, r.stop, r.policy.name) for r in runs]
  [(0, 2, 'boundary-only'), (2, 4, 'save-ffn')]
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from remat_toolkit._src import region_keys
from remat_toolkit._src import resolve
from remat_toolkit._src import transform
from remat_toolkit._src.policy import Policy

__all__ = ["Run", "planned_runs", "linen_stack", "nnx_call", "layout_doc"]

# Rng streams split per layer, as the single scan splits them.
_SPLIT_RNGS = {"params": True, "dropout": True}


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
  runs: list[Run] = []
  start = 0
  for i in range(1, regions + 1):
    if i == regions or policies[i] != policies[start]:
      runs.append(Run(start, i, policies[start]))
      start = i
  if len(runs) > 1:
    _warn_if_keeping_variables(runs, size, where)
  return tuple(runs)


def _warn_if_keeping_variables(runs: Sequence[Run], size: int,
                               where: str) -> None:
  """A run that keeps every intermediate keeps the variables it read too."""
  for run in runs:
    if run.policy is not None and run.policy.save_everything:
      warnings.warn(
          f"{_where(where, run, size)} keeps every intermediate, and in a "
          "run of a scanned stack that includes the layers' variables read "
          "from the stack: a copy of those layers' parameters is kept for "
          "the backward pass. save-matmuls recomputes no matmul either and "
          "keeps only their outputs.", UserWarning, stacklevel=4)


def _region_policies(policy: Any, where: str) -> list[Policy | None] | None:
  """One policy per region, in order; None when ``policy`` is one policy."""
  if isinstance(policy, (list, tuple)):
    return [_entry(item, i, where) for i, item in enumerate(policy)]
  if policy is None:
    return None
  transform.validate_policy(policy, where)
  resolved = resolve.resolve_policy(policy)
  if not resolved.is_per_region:
    return None
  globs = [key for key, _ in resolved.regions if region_keys.is_pattern(key)]
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


def _where(where: str, run: Run, size: int) -> str:
  return (f"{where} layers {run.start * size}.."
          f"{run.stop * size - 1} (policy "
          f"{'ambient' if run.policy is None else run.policy.name})")


def layout_doc(block: str, length: int, size: int,
               runs: Sequence[Run]) -> str:
  """The docstring of a stack scanned in runs."""
  parts = ", ".join(
      f"layers {r.start * size}..{r.stop * size - 1} "
      f"{'ambient' if r.policy is None else r.policy.name}" for r in runs)
  return (f"{length} x {block}, as {len(runs)} consecutive scans, one remat "
          f"region per {size} block(s): {parts}.")


# ---------------------------------------------------------------- stacked rows

def _rows(tree: Any, start: int, stop: int) -> Any:
  return jax.tree.map(lambda v: v[start:stop], tree)


def _layer(tree: Any, index: jax.Array) -> Any:
  return jax.tree.map(
      lambda v: jax.lax.dynamic_index_in_dim(v, index, keepdims=False), tree)


def _concatenated(parts: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _indices(run: Run) -> jax.Array:
  # Traced (an iota) rather than a constant: JAX would forward a constant
  # index to the backward pass, the analyzer (which replays constants as
  # NumPy arrays) would see it stacked; traced, both count 4 bytes a region.
  return jnp.arange(run.start, run.stop, dtype=jnp.int32)


# ---------------------------------------------------------------- linen

def _linen_scan(fn: Callable[..., Any], length: int, *,
                broadcast: Sequence[str] = (),
                in_axes: Any = None) -> Callable[..., Any]:
  from flax import linen as nn
  return nn.scan(fn, variable_axes={True: 0},
                 variable_broadcast=list(broadcast) or False,
                 split_rngs=_SPLIT_RNGS,
                 in_axes=nn.broadcast if in_axes is None else in_axes,
                 length=length)


def linen_stack(block_cls: type, length: int, size: int, runs: Sequence[Run],
                where: str) -> type:
  """The linen module class applying ``runs`` as consecutive scans.

  Built like ``scan_layers``' single scan (same constructor arguments, same
  variables); ``init`` runs that single scan, ``apply`` the runs.
  """
  from flax import linen as nn
  from flax.core import meta

  fields = [f.name for f in dataclasses.fields(block_cls)
            if f.init and f.name not in ("parent", "name")]

  def one_block(module, x, *args):
    # The block bound to the lifted scope itself: its variables sit where the
    # single scan puts them, and its own setup or compact method runs as is.
    block = block_cls(**{n: getattr(module, n) for n in fields},
                      parent=module.scope)
    return block(x, *args), None

  region_body = one_block if size == 1 else _linen_scan(one_block, size)

  def take_layer(tree, index):
    # Boxed variables (nn.Partitioned) lose the stacked axis's name too, as
    # the single scan's scanned variables do.
    return meta.remove_axis(_layer(tree, index), 0, {})

  def run_scan(run: Run, unchanged: list[str], num_args: int):
    def region_fn(module, x, index, *args):
      if not unchanged:
        return region_body(module, x, *args)
      read = nn.map_variables(region_body, unchanged,
                              trans_in_fn=lambda vs: take_layer(vs, index))
      return read(module, x, *args)

    region = transform.remat_region(region_fn, policy=run.policy,
                                    prevent_cse=False,
                                    where=_where(where, run, size))
    return _linen_scan(region, run.stop - run.start, broadcast=unchanged,
                       in_axes=(0,) + (nn.broadcast,) * num_args)

  def apply_runs(self, x, args):
    unchanged = [c for c in self.variables
                 if not self.is_mutable_collection(c)]
    before: dict[str, Any] = {}
    updates: list[Any] = []

    def view(variables, run):
      if not before:
        before.update(variables)  # every run reads the stack as it was
      return {c: _rows(v, run.start, run.stop)
              if self.is_mutable_collection(c) else v
              for c, v in before.items()}

    def write_back(changed, last):
      updates.append(changed)
      return _concatenated(updates) if last else {}

    for k, run in enumerate(runs):
      scan = nn.map_variables(
          run_scan(run, unchanged, len(args)), True,
          trans_in_fn=functools.partial(view, run=run),
          trans_out_fn=functools.partial(write_back,
                                         last=k == len(runs) - 1),
          mutable=True)
      x, _ = scan(self, x, _indices(run), *args)
    return x

  def __call__(self, x, *args):
    if self.is_initializing():
      y, _ = _linen_scan(region_body, length // size)(self, x, *args)
      return y
    return apply_runs(self, x, args)

  def setup(self):
    del self  # the block's own setup runs on the block bound in each layer

  # nowrap: each lifted transform wraps the module state itself.
  return type(f"Scanned{block_cls.__name__}", (block_cls,), {
      "__call__": nn.nowrap(__call__), "setup": setup,
      "__module__": block_cls.__module__,
      "__doc__": layout_doc(block_cls.__name__, length, size, runs)})


# ---------------------------------------------------------------- NNX

def nnx_call(blocks: Any, x: Any, runs: Sequence[Run],
             apply_region: Callable[[Any, Any], Any], where: str,
             size: int) -> Any:
  """Applies NNX ``blocks`` (state stacked per region) as ``runs``.

  Args:
    blocks: the stacked blocks (a module whose state has leading axis
      ``regions``); updated in place with what the call changed.
    x: the carry.
    runs: the runs, in order.
    apply_region: ``apply_region(region_blocks, x)`` applies one region's
      blocks (one block, or ``size`` stacked ones).
    where: how warnings name the stack.
    size: blocks per region, for the warnings.

  Returns:
    The last region's output.
  """
  from flax import nnx

  graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
  axes = nnx.StateAxes({nnx.Param: None, ...: 0})
  updates = []
  for run in runs:
    view = nnx.merge(graphdef, params, _rows(rest, run.start, run.stop))
    region = transform.remat_region(
        functools.partial(_nnx_layer, apply_region), policy=run.policy,
        prevent_cse=False, where=_where(where, run, size))
    x = nnx.scan(functools.partial(_nnx_step, region),
                 in_axes=(nnx.Carry, axes, 0), out_axes=nnx.Carry)(
                     x, view, _indices(run))
    updates.append(nnx.state(view, nnx.Not(nnx.Param)))
  nnx.update(blocks, _concatenated(updates))
  return x


def _nnx_step(region: Callable[..., Any], carry: Any, view: Any,
              index: jax.Array) -> Any:
  return region(view, carry, index)


def _nnx_layer(apply_region: Callable[[Any, Any], Any], view: Any, x: Any,
               index: jax.Array) -> Any:
  """One region: its parameters read from the whole stack (``view``) by
  index, the rest of its state already its own; changes written back."""
  from flax import nnx
  graphdef, params, rest = nnx.split(view, nnx.Param, ...)
  layer = nnx.merge(graphdef, _layer(params, index), rest)
  y = apply_region(layer, x)
  nnx.update(view, nnx.state(layer, nnx.Not(nnx.Param)))
  return y

