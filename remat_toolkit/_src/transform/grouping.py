"""Remat regions over runs of layers: ``remat_chain`` and ``scan_layers``.

Where the region boundaries fall decides what a remat policy can save: a
region's inputs are always kept, everything inside follows the policy. One
region per block keeps every block input; one region per ``group`` blocks
keeps only every ``group``-th input and recomputes the group in the backward
pass. With ``group`` about sqrt(L) the activations kept across the whole
stack drop to O(sqrt(L)) for about one extra forward pass (Chen et al. 2016).

* :func:`remat_chain` applies a list of layers (linen or NNX submodules, or
  plain callables) with one remat region per ``group`` consecutive layers.
* :func:`scan_layers` (linen and NNX) builds the
  scanned stack Flax recommends, ``nn.scan(nn.remat(Block,
  prevent_cse=False))``, with parameters stacked along a leading axis and
  dropout keys split per layer; ``group > 1`` nests two scans.

Every region reads its policy at trace time (``policy=None``: the ambient
one, see :func:`remat_toolkit.use_policy`). The scans also take one policy
per region (a per-layer plan): consecutive regions of equal policy become
one scan each, over a stack of variables of its own
(:mod:`~remat_toolkit._src.transform.scan_runs`, :func:`remat_toolkit.restack`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> layers = [jnp.sin, jnp.cos, jnp.tanh, jnp.sin]
  >>> f = lambda x: rt.remat_chain(layers, x, group=2).sum()
  >>> jax.grad(f)(jnp.ones(3)).shape
  (3,)
  >>> from remat_toolkit._src.transform.grouping import group_size
  >>> group_size("sqrt", 24)
  4
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import cast

from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.transform import remat as transform
from remat_toolkit._src.transform import scan_runs

__all__ = ["remat_chain", "scan_layers", "group_size"]

GroupLike = int | str
"""A group size: layers per remat region (an int), or ``"sqrt"`` for the
divisor of the number of layers closest to its square root."""


# ---------------------------------------------------------------- group sizes

def group_size(group: GroupLike, num_layers: int, *, exact: bool = False
               ) -> int:
  """The number of layers per remat region.

  ``"sqrt"`` picks the divisor of ``num_layers`` closest to
  ``sqrt(num_layers)`` (ties go to the smaller one), so every region has the
  same size: 24 layers give 6 regions of 4, 12 give 4 of 3. When that divisor
  is under half of ``sqrt(num_layers)`` (a prime count, say) and unequal
  regions are allowed (``exact=False``), it is ``round(sqrt(num_layers))``
  and the last region is shorter.

  Args:
    group: a positive int, or ``"sqrt"``.
    num_layers: how many layers are grouped.
    exact: whether the size must divide ``num_layers`` (scans need it).

  Returns:
    The group size, between 1 and ``num_layers``.

  Raises:
    ValueError: for a group that is not a positive int or ``"sqrt"``, one
      larger than ``num_layers``, or (with ``exact``) one that does not
      divide ``num_layers``.

  Example:
    >>> from remat_toolkit._src.transform.grouping import group_size
    >>> group_size("sqrt", 12), group_size("sqrt", 13), group_size(2, 4)
    (3, 4, 2)
  """
  if group == "sqrt":
    return _sqrt_group(num_layers, exact=exact)
  if isinstance(group, bool) or not isinstance(group, int) or group < 1:
    raise ValueError(
        f"group must be a positive number of layers per remat region or "
        f"'sqrt', got {group!r}; e.g. group=4.")
  if group > num_layers:
    raise ValueError(
        f"group={group} is larger than the {num_layers} layers it groups; "
        f"use group={num_layers} for a single region, or a smaller group.")
  if exact and num_layers % group:
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
    raise ValueError(
        f"group={group} does not divide the {num_layers} scanned layers; "
        f"choose one of {divisors} or group='sqrt'.")
  return group


def _sqrt_group(num_layers: int, *, exact: bool) -> int:
  root = math.sqrt(num_layers)
  divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
  nearest = min(divisors, key=lambda d: (abs(d - root), d))
  if exact or nearest >= root / 2:
    return nearest
  return max(1, round(root))


# ---------------------------------------------------------------- layer kinds

def _is_linen_module(x: Any) -> bool:
  from flax import linen as nn
  return isinstance(x, nn.Module)


def _is_nnx_module(x: Any) -> bool:
  from flax import nnx
  return isinstance(x, nnx.Module)


def _chain_kind(layers: Sequence[Any]) -> str:
  """``"linen"``, ``"nnx"`` or ``"plain"``; a list mixing the two fails."""
  has_linen = any(_is_linen_module(layer) for layer in layers)
  has_nnx = any(_is_nnx_module(layer) for layer in layers)
  if has_linen and has_nnx:
    raise TypeError(
        "remat_chain got both linen and NNX modules in one list of layers; "
        "a chain belongs to one framework, split it into two calls.")
  return "linen" if has_linen else "nnx" if has_nnx else "plain"


def _check_layers(layers: Any) -> list[Any]:
  if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
    try:
      layers = list(layers)
    except TypeError:
      raise TypeError(
          f"remat_chain takes a sequence of layers (modules or callables), "
          f"got {layers!r}.") from None
  layers = list(layers)
  if not layers:
    raise ValueError("remat_chain got no layers; pass at least one layer.")
  for i, layer in enumerate(layers):
    if not callable(layer):
      raise TypeError(
          f"remat_chain layer {i} is not callable: {layer!r}; pass modules "
          "or functions that map x to x.")
  return layers


# ---------------------------------------------------------------- remat_chain

def _apply(layers: Sequence[Any], x: Any, kwargs: dict[str, Any]) -> Any:
  for layer in layers:
    x = layer(x, **kwargs)
  return x


def _linen_owner(chunk: Sequence[Any]) -> Any:
  """The module a linen region is lifted on: the layers' parent if bound."""
  from flax import linen as nn
  first = next(layer for layer in chunk if _is_linen_module(layer))
  if first.scope is None:
    raise ValueError(
        f"remat_chain got the unbound linen module {type(first).__name__}; "
        "call remat_chain inside a module method (setup or @nn.compact) "
        "with submodules of that module.")
  parent = first.parent
  return parent if isinstance(parent, nn.Module) else first


def _chunk_region(chunk: tuple[Any, ...], kind: str, index: int,
                  policy: PolicyLike, prevent_cse: bool, where: str
                  ) -> Callable[..., Any]:
  fn: Callable[..., Any]  # the two take different arguments
  if kind == "linen":
    def linen_group(owner, layers, x, **kwargs):
      del owner  # lifted so that the layers' variables and rngs are too
      return _apply(layers, x, kwargs)
    # Flax names the lifted call ``Owner.<function name>`` in module paths.
    linen_group.__name__ = linen_group.__qualname__ = f"remat_group_{index}"
    fn = linen_group
  else:
    def fn(layers, x, **kwargs):
      return _apply(layers, x, kwargs)
  return transform.remat_region(fn, policy=policy, prevent_cse=prevent_cse,
                               where=where,
                               name=f"remat_group_{index}" if kind == "linen"
                               else None)


def remat_chain(layers: Sequence[Callable[..., Any]], x: Any, *,
                group: GroupLike = 1, policy: PolicyLike = None,
                prevent_cse: bool = True, **kwargs: Any) -> Any:
  """Applies ``layers`` in order, one remat region per ``group`` layers.

  Call it inside a linen module method with that module's submodules, inside
  an NNX module with its submodules, or anywhere with plain functions. Each
  region keeps its input (the output of the previous region) and what its
  policy allows; everything else in the region is recomputed in the backward
  pass.

  Args:
    layers: linen or NNX submodules, or callables, each mapping ``x`` to a
      value of the same structure (``layer(x, **kwargs)``).
    x: the input of the first layer.
    group: layers per region, or ``"sqrt"`` (see :func:`group_size`); the
      last region is shorter when ``group`` does not divide the count.
    policy: a policy name, :class:`remat_toolkit.Policy`, raw JAX policy, or
      None for the ambient policy (read at trace time).
    prevent_cse: passed to ``jax.checkpoint``; keep True outside ``scan``.
    **kwargs: passed to every layer; arrays are traced, anything else
      (``deterministic=True``, strings, None) is static.

  Returns:
    The output of the last layer.

  Raises:
    ValueError: for a bad ``group`` or an empty list.
    TypeError: for a layer that is not callable, or linen and NNX mixed.

  Linen regions are lifted on the layers' parent module, so the module paths
  of their equations read ``Parent.remat_group_<k>/layers_<i>/...``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import remat_toolkit as rt
    >>> class Stack(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     layers = [nn.Dense(3, name=f"layers_{i}") for i in range(4)]
    ...     return rt.remat_chain(layers, x, group=2, policy="boundary-only")
    >>> x = jnp.ones((2, 3))
    >>> params = Stack().init(jax.random.key(0), x)
    >>> Stack().apply(params, x).shape
    (2, 3)
  """
  check_flag("prevent_cse", prevent_cse)
  policy = transform.validate_policy(policy, "remat_chain")
  layers = _check_layers(layers)
  size = group_size(group, len(layers))
  kind = _chain_kind(layers)
  for index, start in enumerate(range(0, len(layers), size)):
    chunk = tuple(layers[start:start + size])
    where = (f"remat_chain region {index} (layers {start}.."
             f"{start + len(chunk) - 1})")
    region = _chunk_region(chunk, kind, index, policy, prevent_cse, where)
    if kind == "linen":
      x = region(_linen_owner(chunk), chunk, x, **kwargs)
    else:
      x = region(chunk, x, **kwargs)
  return x


# ---------------------------------------------------------------- linen scan

def _check_length(length: Any) -> int:
  if isinstance(length, bool) or not isinstance(length, int) or length < 1:
    raise ValueError(
        f"scan_layers length must be a positive number of layers, got "
        f"{length!r}.")
  return length


def _raw_method(method: Any) -> Any:
  # Flax wraps every module method (state handling, name scope) with
  # functools.wraps; the raw function runs the body inline, without a second
  # name scope, so module paths stay ``layers/attn``.
  return getattr(method, "__wrapped__", method)


def _carry_step(block_cls: type) -> type:
  """``block_cls`` whose ``__call__`` returns ``(x, None)``, as scan wants."""
  from flax import linen as nn

  body = _raw_method(block_cls.__call__)

  def __call__(self, x, *args):
    return body(self, x, *args), None

  if getattr(body, "compact", False):
    __call__ = nn.compact(__call__)
  __call__.__doc__ = body.__doc__
  return type(block_cls.__name__, (block_cls,), {
      "__call__": __call__, "__module__": block_cls.__module__,
      "__qualname__": block_cls.__qualname__})


def _linen_scan(target: type, length: int) -> type:
  from flax import linen as nn
  # Every collection is per layer: params, and mutable ones such as batch
  # statistics or sown intermediates.
  return nn.scan(target, variable_axes={True: 0},
                 split_rngs={"params": True, "dropout": True},
                 in_axes=nn.broadcast, length=length)


def scan_layers(block_cls: type, length: int, *,
                policy: PolicyLike | Sequence[PolicyLike] = None,
                group: GroupLike = 1, remat: bool = True) -> type:
  """A module class applying ``length`` blocks with ``scan``, each rematted.

  The linen form is ``nn.scan(nn.remat(block_cls, prevent_cse=False))`` with
  parameters (and any other variable collection) stacked along a leading
  axis and ``params``/``dropout`` keys split per layer; the remat policy is
  read at trace time. With ``group > 1`` two scans are nested, the outer
  one over ``length // group`` remat regions of ``group`` blocks each (Chen
  et al.'s sqrt(n) schedule); parameters then have the leading shape
  ``(length // group, group)``.

  An NNX ``block_cls`` gives an NNX Module class: blocks are created stacked
  with ``nnx.vmap`` (rng streams split per layer, so each layer has its own
  parameters and dropout keys) and applied with ``nnx.scan`` over the
  stack, each remat region reading its policy at trace time with
  ``prevent_cse=False``; ``Stack(*args, rngs=rngs, **kwargs)`` builds the
  blocks (attribute ``blocks``, an ``nnx.Dict`` of one stack per run under
  a per-layer plan) and ``stack(x, *call_args)`` applies them.

  Regions inside one scan share one body, so a scan takes one policy. Given
  one policy per region (a per-layer plan, made on the unrolled model with
  ``rt.plan(..., per_layer=True)``), the stack runs as consecutive scans,
  one per run of regions with equal policy, each the scan above over
  variables of its own: the module's variables are one subtree per run,
  ``run_0``, ``run_1``, ... (in every collection), each stacked along the
  leading axis like the single scan's. When every region has the same
  policy it is the single scan, variables and program unchanged. Each run
  keeps what the same regions keep in the unrolled model, so the stack
  keeps exactly the plan's ``activation_bytes`` (for plans without
  ``save-everything`` regions: under that policy the unrolled and scanned
  programs keep different values), and each run's gradient is the size of
  its own variables, not the stack's. ``init`` splits the single scan's
  variables, so a seed gives the same model whatever the plan, and
  :func:`remat_toolkit.restack` moves variables between layouts (to resume
  under another plan; the single stack is the runs concatenated). Dropout
  keys are split per run: they differ from the single scan's, and still
  per layer.

  Args:
    block_cls: a linen Module class whose ``__call__(x, *args)`` returns a
      value shaped like ``x``; a plain class, not one already transformed.
    length: number of blocks.
    policy: one policy for every region: a policy name,
      :class:`remat_toolkit.Policy`, raw JAX policy, or None for the
      ambient policy, read at trace time. Or one policy per remat region,
      in layer order: a plan from ``rt.plan(..., per_layer=True)``, a
      per-region :class:`remat_toolkit.Policy` (its regions in order; keys
      must not be globs), a catalogue name of one (such as a registered
      plan, looked up when the class is built), or a list of
      ``length // group`` policies (each a name, Policy, plan, raw JAX
      policy, or None for the ambient one).
    group: blocks per remat region, or ``"sqrt"`` (a divisor of ``length``).
    remat: False gives the plain scan (the no-remat baseline); a per-region
      policy is then checked and unused.

  Returns:
    A linen Module class taking ``block_cls``'s constructor arguments, whose
    ``__call__(x, *args)`` returns the output of the last block; ``args``
    are passed, unchanged, to every block.

  Raises:
    ValueError: for a bad ``length`` or ``group``, a ``group`` that does
      not divide ``length``, an unknown policy name, or a per-region policy
      that does not give exactly ``length // group`` policies in order.
    TypeError: if ``block_cls`` is not a linen or NNX Module class, or a
      policy is not one.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import remat_toolkit as rt
    >>> class Block(nn.Module):
    ...   width: int
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + jnp.tanh(rt.tag(nn.Dense(self.width)(x), "ffn.up"))
    >>> Stack = rt.scan_layers(Block, 4, policy="save-ffn")
    >>> x = jnp.ones((2, 3))
    >>> params = Stack(width=3).init(jax.random.key(0), x)
    >>> params["params"]["Dense_0"]["kernel"].shape
    (4, 3, 3)

    One policy per layer: two scans, each over its run's parameters.

    >>> plan = ["boundary-only"] * 3 + ["save-ffn"]
    >>> Planned = rt.scan_layers(Block, 4, policy=plan)
    >>> runs = rt.restack(params["params"], plan)
    >>> runs["run_1"]["Dense_0"]["kernel"].shape
    (1, 3, 3)
    >>> apply = lambda p: Planned(width=3).apply({"params": p}, x)
    >>> sum(e.primitive.name == "scan" for e in jax.make_jaxpr(apply)(runs).eqns)
    2
    >>> bool(jnp.allclose(apply(runs), Stack(width=3).apply(params, x)))
    True

    An NNX class, stacked with ``nnx.vmap`` and applied with ``nnx.scan``:

    >>> from flax import nnx
    >>> import remat_toolkit as rt
    >>> class NNXBlock(nnx.Module):
    ...   def __init__(self, width, *, rngs):
    ...     self.fc = nnx.Linear(width, width, rngs=rngs)
    ...   def __call__(self, x):
    ...     return x + jnp.tanh(rt.tag(self.fc(x), "ffn.up"))
    >>> stack = rt.scan_layers(NNXBlock, 4)(3, rngs=nnx.Rngs(0))
    >>> stack.blocks.fc.kernel.shape
    (4, 3, 3)
    >>> stack(jnp.ones((2, 3))).shape
    (2, 3)
    >>> plan = ["boundary-only"] * 2 + ["save-ffn"] * 2
    >>> planned = rt.scan_layers(NNXBlock, 4, policy=plan)(
    ...     3, rngs=nnx.Rngs(0))
    >>> planned.blocks["run_1"].fc.kernel.shape
    (2, 3, 3)
    >>> bool(jnp.allclose(planned(jnp.ones((2, 3))), stack(jnp.ones((2, 3)))))
    True
    >>> rt.restack(nnx.state(planned.blocks), None)["fc"]["kernel"].shape
    (4, 3, 3)
  """
  from flax import linen as nn

  check_flag("remat", remat)
  if _is_nnx_class(block_cls):
    return _nnx_scan_layers(block_cls, length, policy=policy, group=group,
                            remat=remat)
  if not (isinstance(block_cls, type) and issubclass(block_cls, nn.Module)):
    raise TypeError(
        f"scan_layers takes a linen or NNX Module class, got {block_cls!r}; "
        "pass the class itself (Block), not an instance (Block(...)).")
  where = f"scan_layers({block_cls.__name__})"
  length = _check_length(length)
  size = group_size(group, length, exact=True)
  runs = scan_runs.planned_runs(policy, length, size, where)
  if runs is not None:
    if remat and len(runs) > 1:
      return scan_runs.linen_stack(
          block_cls, length, size, runs,
          functools.partial(_single_scan, block_cls, size=size))
    policy = runs[0].policy  # one policy for every region: the single scan
  # No runs: ``policy`` is one policy, not a list of them.
  policy = transform.validate_policy(cast(PolicyLike, policy), where)
  return _single_scan(block_cls, length, policy, remat, size=size)


def _single_scan(block_cls: type, length: int, policy: PolicyLike,
                 remat: bool, *, size: int) -> type:
  """``scan_layers``' class for one policy: a scan over remat regions."""
  from flax import linen as nn

  region = _carry_step(block_cls)
  if size > 1:
    region = _linen_scan(region, size)
  if remat:
    region = transform.remat(region, policy, prevent_cse=False)
  scanned = _linen_scan(region, length // size)

  def __call__(self, x, *args):
    y, _ = scanned.__call__(self, x, *args)
    return y

  # nowrap: the scanned class's __call__ already handles module state; a
  # second wrapper would add the module name to every path twice.
  return type(f"Scanned{block_cls.__name__}", (scanned,), {
      "__call__": nn.nowrap(__call__), "__module__": block_cls.__module__,
      "__doc__": _layout_doc(block_cls, length, size, remat)})


def _layout_doc(block_cls: type, length: int, size: int, remat: bool) -> str:
  regions = f"one remat region per {size} block(s)" if remat else "no remat"
  return f"{length} x {block_cls.__name__}, scanned, {regions}."


# ---------------------------------------------------------------- NNX scan

def _is_nnx_class(cls: Any) -> bool:
  from flax import nnx
  return isinstance(cls, type) and issubclass(cls, nnx.Module)


def _stacked(make: Callable[[Any], Any], shape: tuple[int, ...], rngs: Any
             ) -> Any:
  """Builds ``make(rngs)`` with state stacked to leading ``shape``."""
  from flax import nnx
  if not shape:
    return make(rngs)

  @nnx.split_rngs(splits=shape[0])
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs_):
    return _stacked(make, shape[1:], rngs_)

  return create(rngs)


def _nnx_scan_apply(fn: Callable[..., Any], blocks: Any, x: Any) -> Any:
  from flax import nnx

  def step(carry, block):
    return fn(block, carry)

  return nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks)


@dataclasses.dataclass(frozen=True)
class _NNXScanSpec:
  block_cls: type
  length: int
  size: int
  policy: Any
  remat: bool
  # Consecutive scans of equal policy (a per-region plan); None: one scan.
  runs: tuple[scan_runs.Run, ...] | None = None


def _nnx_scan_layers(block_cls: type, length: int, *,
                    policy: PolicyLike | Sequence[PolicyLike] = None,
                    group: GroupLike = 1, remat: bool = True) -> type:
  """:func:`scan_layers` for an NNX Module class (see there)."""
  where = f"scan_layers({block_cls.__name__})"
  length = _check_length(length)
  size = group_size(group, length, exact=True)
  runs = scan_runs.planned_runs(policy, length, size, where)
  if runs is not None:
    policy = runs[0].policy
    runs = runs if remat and len(runs) > 1 else None
  # An unknown name fails now, not at trace time; no runs: one policy.
  policy = transform.validate_policy(cast(PolicyLike, policy), where)
  spec = _NNXScanSpec(block_cls=block_cls, length=length, size=size,
                      policy=policy, remat=bool(remat), runs=runs)
  return _make_nnx_stack_class(spec)


def _make_nnx_stack_class(spec: _NNXScanSpec) -> type:
  from flax import nnx

  shape = ((spec.length,) if spec.size == 1
           else (spec.length // spec.size, spec.size))

  class ScannedLayers(nnx.Module):
    __doc__ = (scan_runs.layout_doc(spec.block_cls.__name__, spec.length,
                                    spec.size, spec.runs) if spec.runs
               else _layout_doc(spec.block_cls, spec.length, spec.size,
                                spec.remat))

    def __init__(self, *args: Any, rngs: Any, **kwargs: Any):
      blocks = _stacked(
          lambda r: spec.block_cls(*args, rngs=r, **kwargs), shape, rngs)
      # Runs get the rows of the single stack: a seed gives the same model
      # (and dropout keys) whatever the plan.
      self.blocks = scan_runs.nnx_runs(blocks, spec.runs) if spec.runs else (
          blocks)

    def __call__(self, x: Any, *args: Any) -> Any:
      return _nnx_scan_call(spec, self.blocks, x, args)

  ScannedLayers.__name__ = ScannedLayers.__qualname__ = (
      f"Scanned{spec.block_cls.__name__}")
  return ScannedLayers


def _nnx_scan_call(spec: _NNXScanSpec, blocks: Any, x: Any,
                   args: tuple[Any, ...]) -> Any:
  def one_block(block, carry):
    return block(carry, *args)

  if spec.size == 1:
    region = one_block
  else:
    def region(group_blocks, carry):
      return _nnx_scan_apply(one_block, group_blocks, carry)
  if spec.runs:
    return scan_runs.nnx_call(
        blocks, x, spec.runs, region, _nnx_scan_apply,
        f"scan_layers({spec.block_cls.__name__})", spec.size)
  if spec.remat:
    region = transform.remat_region(
        region, policy=spec.policy, prevent_cse=False,
        where=f"scanned {spec.block_cls.__name__} region")
  return _nnx_scan_apply(region, blocks, x)
