"""Remat regions with named policies: :func:`remat` and :func:`remat_region`.

Every region decides its JAX policy when it is traced, not when it is
declared: ``policy=None`` reads the ambient policy (``rt.use_policy``), and a
named policy's glob patterns are expanded against the checkpoint names the
region actually contains, so what reaches JAX is always one of its own policy
constructors (honoured under ``jax_remat3`` as well).

To know the names before choosing the policy, a region whose policy has name
patterns is traced once with ``jax.make_jaxpr`` (model code runs once), its
names are read off the jaxpr, and the jaxpr is replayed inside a single
``jax.checkpoint`` with the lowered policy. Regions whose policy has no
patterns, and every region while the analyzer overrides ambient regions, go
straight to ``jax.checkpoint``. A plain function's trace is kept per call
signature (:mod:`~remat_toolkit._src.transform.trace_cache`); NNX regions name their
modules by path (:mod:`~remat_toolkit._src.transform.nnx_paths`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat(policy="save-ffn")
  ... def ffn(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up")) @ w.T
  >>> w, x = jnp.ones((4, 8)), jnp.ones((2, 4))
  >>> jax.grad(lambda w: ffn(w, x).sum())(w).shape
  (4, 8)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import pathlib
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import TypeVar
from typing import overload

import jax
import numpy as np

from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import lowering
from remat_toolkit._src.policies import region_inputs
from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies import tags
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_at_trace
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.transform import nnx_paths
from remat_toolkit._src.transform import trace_cache
from remat_toolkit._src.transform.trace_cache import is_array

__all__ = ["remat", "remat_region"]


# ---------------------------------------------------------------- settings

@dataclasses.dataclass(frozen=True)
class RegionSpec:
  """What one region needs at trace time, fixed when it is declared."""

  policy: PolicyLike
  prevent_cse: bool
  static_argnums: tuple[int, ...]
  static_argnames: tuple[str, ...]
  where: str
  # Appended to the owner's module path in the region's key: a linen region
  # lifted on a parent over a function (remat_chain's groups).
  name: str | None = None


def validate_policy(policy: PolicyLike, where: str) -> PolicyLike:
  """Fails at declaration for a bad policy; returns what the region holds
  (:func:`resolve.declared_policy`).

  The resolver's own messages, the TypeError prefixed by ``where`` (a rule
  or a region among many); None (the ambient policy) is always valid.
  """
  try:
    return resolve.declared_policy(policy)  # unknown name -> ValueError
  except TypeError as error:
    raise TypeError(f"{where}: {error}") from None


def _normalize_static_argnums(static_argnums: int | Sequence[int], where: str
                              ) -> tuple[int, ...]:
  if isinstance(static_argnums, (int, np.integer)) and not isinstance(
      static_argnums, bool):
    static_argnums = (int(static_argnums),)
  if isinstance(static_argnums, (str, bytes)) or not isinstance(
      static_argnums, Sequence):
    raise TypeError(
        f"static_argnums for {where} must be an int or a tuple of ints, got "
        f"{static_argnums!r}; e.g. static_argnums=(1,).")
  out = []
  for i in static_argnums:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
      raise TypeError(
          f"static_argnums for {where} must hold ints, got {i!r} in "
          f"{tuple(static_argnums)!r}.")
    if i < 0:
      raise ValueError(
          f"static_argnums for {where} must be non-negative positions of the "
          f"call's own arguments (self not counted), got {i}.")
    out.append(int(i))
  return tuple(sorted(set(out)))


# ---------------------------------------------------------------- arguments

def _require_hashable(value: Any, label: str, where: str) -> None:
  try:
    hash(value)
  except TypeError:
    fix = ("pass it as a traced argument (drop it from static_argnums)"
           if is_array(value) else
           "pass a hashable value (a tuple instead of a list, a frozen "
           "dataclass), or drop it from static_argnums to trace it")
    raise TypeError(
        f"{label} of {where} is static but unhashable: {value!r} of type "
        f"{type(value).__name__}; static arguments are specialised on by "
        f"value, so {fix}.") from None


_Rebuild = Callable[[list[Any]], tuple[tuple, dict]]


def _split_static(spec: RegionSpec, args: tuple, kwargs: dict
                  ) -> tuple[list[Any], _Rebuild]:
  """Splits a call into traced array leaves and a function that rebuilds it.

  Arguments named by ``static_argnums`` stay whole and must be hashable;
  elsewhere every leaf that is not an array (Python bool, int, float, None,
  str, ...) is static, like ``equinox.filter_checkpoint``.
  """
  for i in spec.static_argnums:
    if i < len(args):
      _require_hashable(args[i], f"positional argument {i}", spec.where)
  for name in spec.static_argnames:
    if name in kwargs:
      _require_hashable(kwargs[name], f"argument {name!r}", spec.where)
  whole_static_pos = {i for i in spec.static_argnums if i < len(args)}
  whole_static_kw = {k for k in spec.static_argnames if k in kwargs}
  traced_args = tuple(None if i in whole_static_pos else a
                      for i, a in enumerate(args))
  traced_kwargs = {k: None if k in whole_static_kw else v
                   for k, v in kwargs.items()}
  leaves, treedef = jax.tree_util.tree_flatten((traced_args, traced_kwargs))
  is_dyn = [is_array(leaf) for leaf in leaves]
  dynamic = [leaf for leaf, d in zip(leaves, is_dyn, strict=True) if d]

  def rebuild(new_dynamic: list[Any]) -> tuple[tuple, dict]:
    it = iter(new_dynamic)
    merged = [next(it) if d else leaf
              for leaf, d in zip(leaves, is_dyn, strict=True)]
    a, kw = jax.tree_util.tree_unflatten(treedef, merged)
    a = tuple(args[i] if i in whole_static_pos else x for i, x in enumerate(a))
    kw = {k: kwargs[k] if k in whole_static_kw else v for k, v in kw.items()}
    return a, kw

  return dynamic, rebuild


# ---------------------------------------------------------------- the region

#: Remat bodies whose regions are not foreign: the toolkit's own, and
#: linen's lifted ``nn.remat`` (``rules`` names the model's region there).
_OWN_BODIES = (str(pathlib.Path(__file__).resolve().parents[2]) + os.sep,
               os.sep + os.path.join("flax", "linen", "transforms.py"))


def _warn_if_enclosed(region: lowering.RegionPolicy, where: str) -> None:
  """Says so, once, when a region is traced inside a remat region the
  program makes itself (a ``jax.checkpoint``, an ``nnx.remat``): that
  region recomputes everything in it by its own policy, so the policy asked
  for here changes nothing."""
  outer = compat.enclosing_remat()
  if (outer is None or region.policy is None
      or region.policy.name == "boundary-only"  # it keeps the inputs anyway
      or any(own in outer for own in _OWN_BODIES)):
    return
  warn_at_trace(Finding(
      f"remat region {where} is traced inside a remat region the program "
      "makes itself "
      f"(the jax.checkpoint or nnx.remat of {outer}): that region recomputes "
      "everything in it by its own policy, so policy "
      f"{region.policy.name!r} changes nothing there. Re-policy the "
      "program's own regions instead, rt.repolicy(loss, policy), or remove "
      "the outer remat.", "shadowed", region.policy.name), stacklevel=5)


def _warn_if_inputs_unseen(region: lowering.RegionPolicy, where: str,
                           unseen: int) -> None:
  """Says so, once, when a policy that moves region inputs meets ``unseen``
  inputs that arrive as arguments of a ``jax.jit`` the program calls
  (:func:`region_inputs.unseen_inputs`): whether the program computed them
  cannot be seen from inside the jit (one trace serves every caller), so
  they stay on the device, unmoved. The analyzer's trace records them with
  its marker instead, and its results say it per policy."""
  policy = region.policy
  if (not unseen or policy is None
      or not region_inputs.selects_inputs(policy)):
    return
  warn_at_trace(Finding(
      f"remat region {where} is traced inside a jax.jit the program calls, "
      f"and {unseen} of its input(s) arrive as that jit's arguments: whether "
      "the program computed them (activations to move) or was given them "
      "(parameters, held on the device anyway) cannot be seen from inside "
      f"the jit, so policy {policy.name!r} leaves them on the device. "
      "Call the function without jax.jit inside the traced program, or "
      "re-policy the whole program, rt.repolicy(loss, policy), which sees "
      "through the jit.", "inputs-unseen", policy.name), stacklevel=5)


def _dynamic_part(mask: tuple[bool, ...], inputs: tuple) -> tuple[bool, ...]:
  """The entries of a region's input ``mask`` for its dynamic inputs (the
  prefix, never named, comes first)."""
  prefix, _ = inputs
  return mask[len(jax.tree_util.tree_leaves(prefix)):]


def _named_dynamic(body: Callable[..., Any],
                   mask: tuple[bool, ...]) -> Callable[..., Any]:
  """``body`` naming its dynamic inputs ``block.input`` first where ``mask``
  says so (:mod:`~remat_toolkit._src.policies.region_inputs`); the prefix (a
  module's variables and rngs, an NNX module's state) is never named."""
  if not any(mask):
    return body

  def named_body(prefix_, dynamic_):
    return body(prefix_, region_inputs.name_inputs(dynamic_, mask))

  return named_body


def _checkpoint_traced(traced: trace_cache.Trace, spec: RegionSpec,
                       inputs: tuple, region: lowering.RegionPolicy,
                       mask: tuple[bool, ...], unseen: int) -> Any:
  """Replays a traced region inside one ``jax.checkpoint``, its policy
  lowered against the names the trace contains; ``mask``: which inputs it
  names (:func:`region_inputs.input_mask`); ``unseen``: how many it cannot
  tell (:func:`region_inputs.unseen_inputs`)."""
  names = traced.names
  if region_inputs.selects_inputs(region.policy):
    names = names | {region_inputs.INPUT_NAME}  # a region fed only arguments
  lowering.warn_if_unmatched(region, names, spec.where)
  jax_policy = lowering.region_jax_policy(region, names, mask, unseen)
  return jax.checkpoint(traced.replay(), policy=jax_policy,
                        prevent_cse=spec.prevent_cse)(*inputs)


def _checkpoint_pure(pure: Callable[..., Any], spec: RegionSpec,
                     prefix: tuple, args: tuple, kwargs: dict,
                     key: str) -> Any:
  """``pure(*prefix, *args, **kwargs)`` as exactly one remat region.

  ``prefix`` holds pytrees of arrays that are always traced (a linen
  module's variables and rngs, an NNX module's state). The body is traced
  first only when the policy needs the region's names. ``key`` is the
  region's key (:mod:`~remat_toolkit._src.policies.region_keys`).
  """
  dynamic, rebuild = _split_static(spec, args, kwargs)

  def body(prefix_, dynamic_):
    a, kw = rebuild(dynamic_)
    return pure(*prefix_, *a, **kw)

  inputs = (prefix, dynamic)
  region = lowering.region_policy(spec.policy, key)
  _warn_if_enclosed(region, spec.where)
  unseen = region_inputs.unseen_inputs(dynamic)
  _warn_if_inputs_unseen(region, spec.where, unseen)
  mask = region_inputs.input_mask(*inputs)
  named = region_inputs.selects_inputs(region.policy)
  if named:
    body = _named_dynamic(body, _dynamic_part(mask, inputs))
  if region.reads_names:
    return _checkpoint_traced(trace_cache.trace(body, inputs), spec, inputs,
                              region, mask, unseen)
  known = tags.known_names() | ({region_inputs.INPUT_NAME} if named else set())
  jax_policy = lowering.region_jax_policy(region, known, mask, unseen)
  return jax.checkpoint(body, policy=jax_policy,
                        prevent_cse=spec.prevent_cse)(*inputs)


def _checkpoint_cached(fn: Callable[..., Any], spec: RegionSpec,
                       cache: dict, args: tuple, kwargs: dict) -> Any:
  """A plain function's region, its Python traced once per call signature.

  Like ``jax.checkpoint``, repeated calls with the same shapes, dtypes and
  static arguments re-use the trace; the policy is still decided at each
  call (it is not part of the trace), so ``use_policy`` keeps working.
  """
  key = trace_cache.call_key(args, kwargs, spec.static_argnums,
                             spec.static_argnames)
  dynamic, rebuild = _split_static(spec, args, kwargs)

  def body(prefix_, dynamic_):
    del prefix_
    a, kw = rebuild(dynamic_)
    return fn(*a, **kw)

  inputs = ((), dynamic)
  traced = trace_cache.cached_trace(cache, key, body, inputs)
  # A plain function's key is known only once its body is traced (nested
  # regions are numbered first), so a region whose policy names its inputs
  # is traced again with the names, under a key of its own.
  region = lowering.region_policy(spec.policy)
  _warn_if_enclosed(region, spec.where)
  unseen = region_inputs.unseen_inputs(dynamic)
  _warn_if_inputs_unseen(region, spec.where, unseen)
  mask = region_inputs.input_mask(*inputs)  # no prefix: all dynamic
  if region_inputs.selects_inputs(region.policy):
    traced = trace_cache.cached_trace(
        cache, None if key is None else (key, region_inputs.INPUT_NAME, mask),
        _named_dynamic(body, mask), inputs)
  return _checkpoint_traced(traced, spec, inputs, region, mask, unseen)


# -------------------------------------------------------------- linen lifting

def linen_transform(scope_target: Callable[..., Any], *, spec: RegionSpec
                    ) -> Callable[..., Any]:
  """A lifted remat like ``flax.core.lift.checkpoint``, deciding at trace time.

  The module body runs on variables and rngs passed in as values, so the
  region is a pure function: discovering its names has no side effect on
  the outer scope, and dropout draws the same keys in the recompute.
  """
  keys: list[str] = []  # the key of the region being called, innermost last

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    def pure(variable_groups_, rng_groups_, *args_, **kwargs_):
      scope = scope_fn(variable_groups_, rng_groups_)
      y = scope_target(scope, *args_, **kwargs_)
      return y, repack_fn(scope)

    return _checkpoint_pure(pure, spec, (variable_groups, rng_groups),
                            args, kwargs, keys[-1])

  packed = compat.flax_lift_pack(inner, name="remat")

  def lifted(scope_tree, *args, **kwargs):
    # The region is named by the module path of the scope it is lifted on.
    path = compat.linen_scope_path(scope_tree)
    keys.append(region_keys.region_key(
        path + ((spec.name,) if spec.name else ())))
    try:
      return packed(scope_tree, *args, **kwargs)
    finally:
      keys.pop()

  return lifted


# Flax names a lifted class ``transform.__name__.capitalize() + cls.__name__``;
# "checkpoint" gives nn.remat's names (CheckpointBlock_0), so swapping
# nn.remat for rt.remat keeps a model's variables.
linen_transform.__name__ = "checkpoint"


def _is_linen_module(x: Any) -> bool:
  from flax import linen as nn
  return isinstance(x, nn.Module)


def _is_nnx_node(x: Any) -> bool:
  from flax import nnx
  return nnx.graph.is_graph_node(x)


# --------------------------------------------------------------- NNX lifting

_NNX_CTXTAG = "remat_toolkit.remat"


@dataclasses.dataclass(frozen=True)
class _NodeSlot:
  """Stands for the i-th NNX graph node state of a call while it is traced."""

  index: int


def _call_nnx(fn: Callable[..., Any], spec: RegionSpec, args: tuple,
              kwargs: dict, *, method: bool) -> Any:
  """Runs ``fn`` on NNX modules as one region, lifted as ``nnx.remat`` is.

  Flax's own ``split_inputs`` / ``merge_inputs`` (what ``nnx.remat`` builds
  on) turn the modules into graph definitions and state; the region is a
  pure function of the state, and what the call changed is written back
  afterwards: Variables (rng counters, batch statistics, ``sow``), plain
  attributes (``self.calls += 1``) and added or removed attributes, as with
  ``nnx.remat``. ``method``: ``args[0]`` is the module ``fn`` is a method of.
  """
  from flax import nnx

  def call(args_, kwargs_):
    nodes = [x for x in jax.tree_util.tree_leaves(
        (args_, kwargs_), is_leaf=_is_nnx_node)
             if isinstance(x, nnx.Module)]
    with nnx_paths.region_scopes(nodes, args_[0] if method else None):
      return fn(*args_, **kwargs_)

  merged = compat.nnx_merge_inputs(call, _NNX_CTXTAG)

  def split(args_, kwargs_):
    # Module state is always traced; the other arguments follow the region's
    # static rules.
    states: list[Any] = []

    def to_slot(x):
      if compat.is_nnx_node_states(x):
        states.append(x)
        return _NodeSlot(len(states) - 1)
      return x

    slotted_args, slotted_kwargs = jax.tree_util.tree_map(
        to_slot, (args_, kwargs_), is_leaf=compat.is_nnx_node_states)

    def pure(_rt_states, *a, **kw):
      a, kw = jax.tree_util.tree_map(
          lambda x: _rt_states[x.index] if isinstance(x, _NodeSlot) else x,
          (a, kw), is_leaf=lambda x: isinstance(x, _NodeSlot))
      return merged(a, kw)

    return _checkpoint_pure(pure, spec, (tuple(states),), slotted_args,
                            slotted_kwargs, key=key)

  modules = [x for x in jax.tree_util.tree_leaves(
      (args, kwargs), is_leaf=_is_nnx_node) if isinstance(x, nnx.Module)]
  # The region is named by the module it is a method of, else by the first
  # module it is given (a remat_chain group by its first layer).
  key = region_keys.region_key(nnx_paths.path_of(modules[0]) if modules
                               else None)
  return compat.nnx_split_inputs(split, _NNX_CTXTAG)(args, kwargs)


# ---------------------------------------------------------------- public API

def remat_region(fn: Callable[..., Any], *, policy: PolicyLike = None,
                 prevent_cse: bool = True,
                 static_argnums: int | Sequence[int] = (),
                 where: str = "a remat region",
                 name: str | None = None) -> Callable[..., Any]:
  """Makes ``g`` with ``g(*args) == fn(*args)``, computed in ONE remat region.

  The region's policy is resolved when ``g`` is called (trace time), once,
  and lowered against the checkpoint names the region contains. If
  ``args[0]`` is a bound linen Module the region is a Flax lifted remat
  (variables and rngs work, dropout masks repeat in the recompute); if any
  argument is an NNX graph node the modules' state is lifted like
  ``nnx.remat`` does; otherwise it is a ``jax.checkpoint``.

  Args:
    fn: the function; may take a linen Module or NNX modules as arguments.
    policy: a policy name, :class:`Policy`, raw JAX policy, or None for the
      ambient policy (read at trace time).
    prevent_cse: passed to ``jax.checkpoint``.
    static_argnums: positions of ``fn``'s own arguments that are static,
      not counting a leading linen or NNX module. Non-array leaves (Python
      scalars, None, strings) are static anyway.
    where: how warnings and errors name this region.
    name: for a linen region lifted on a parent module over a function, its
      name after the parent's path in the region's key (``remat_group_1``).

  Returns:
    The wrapped function.

  Raises:
    ValueError: for an unknown policy name or a negative static position.
    TypeError: for a policy or ``static_argnums`` of the wrong type.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> from remat_toolkit._src.transform.remat import remat_region
    >>> g = remat_region(lambda x: jnp.sin(jnp.sin(x)), policy="boundary-only")
    >>> float(jax.grad(g)(0.0))
    1.0
  """
  policy = validate_policy(policy, where)
  spec = RegionSpec(policy=policy, prevent_cse=bool(prevent_cse),
                    static_argnums=_normalize_static_argnums(static_argnums,
                                                             where),
                    static_argnames=(), where=where, name=name)
  return region_from_spec(fn, spec)


def region_from_spec(fn: Callable[..., Any], spec: RegionSpec
                     ) -> Callable[..., Any]:
  """``fn`` as one region: lifted for linen or NNX, else a cached trace."""
  lifted_linen = None
  traces: dict = {}

  @functools.wraps(fn)
  def region(*args, **kwargs):
    nonlocal lifted_linen
    if args and _is_linen_module(args[0]):
      if lifted_linen is None:
        lifted_linen = compat.linen_decorator_lift_transform(
            linen_transform, fn, spec=spec)
      return lifted_linen(*args, **kwargs)
    nnx_call = args and _is_nnx_node(args[0])
    if nnx_call or any(_is_nnx_node(x) for x in jax.tree_util.tree_leaves(
        (args, kwargs), is_leaf=_is_nnx_node)):
      head = 1 if nnx_call else 0
      shifted = dataclasses.replace(
          spec, static_argnums=tuple(i + head for i in spec.static_argnums))
      return _call_nnx(fn, shifted, args, kwargs, method=bool(nnx_call))
    return _checkpoint_cached(fn, spec, traces, args, kwargs)

  return region


#: What ``remat`` wraps: a function, a method or a Module class, returned as
#: the same kind of thing.
_Target = TypeVar("_Target", bound=Callable[..., Any])


@overload
def remat(target: None = None, policy: PolicyLike = None, *,
          static_argnums: int | Sequence[int] = (),
          prevent_cse: bool | None = None
          ) -> Callable[[_Target], _Target]: ...


@overload
def remat(target: _Target, policy: PolicyLike = None, *,
          static_argnums: int | Sequence[int] = (),
          prevent_cse: bool | None = None) -> _Target: ...


def remat(target: Any = None, policy: PolicyLike = None, *,
          static_argnums: int | Sequence[int] = (),
          prevent_cse: bool | None = None) -> Any:
  """Remat with a named policy, for Flax modules, methods and functions.

  ``target`` may be a linen Module class (a class is returned, used like
  ``nn.remat(cls)``), an NNX Module class (a subclass whose ``__call__`` is
  one region), a linen or NNX method in a class body, or a plain JAX
  function. Without ``target`` it is a decorator:
  ``@rt.remat(policy="save-ffn")``.

  Args:
    target: what to rematerialise.
    policy: a policy name, :class:`Policy`, raw JAX policy (passed through),
      or None for the ambient policy (``rt.use_policy``), read each time
      the region is traced. An explicit policy wins over the ambient one.
    static_argnums: positions of the call's own arguments to treat as
      static; ``self`` is never counted. Non-array arguments (Python bool,
      int, float, None, str) are static without being listed; pass a
      ``jnp`` array to trace a number instead.
    prevent_cse: passed to ``jax.checkpoint``; default True.

  Returns:
    The rematerialised class or function, or a decorator.

  Raises:
    TypeError: if ``target`` is not a Module class, method or function, or
      is a method bound to a module instance.
    ValueError: for an unknown policy name (with suggestions) or
      ``static_argnums`` outside the call's arguments.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import remat_toolkit as rt
    >>> class Block(nn.Module):
    ...   @rt.remat(policy="save-ffn")
    ...   @nn.compact
    ...   def __call__(self, x, train):
    ...     return nn.Dense(4)(rt.tag(nn.Dense(8)(x), "ffn.up"))
    >>> x = jnp.ones((2, 4))
    >>> params = Block().init(jax.random.key(0), x, True)
    >>> Block().apply(params, x, True).shape
    (2, 4)
  """
  if target is None:
    return functools.partial(remat, policy=policy,
                             static_argnums=static_argnums,
                             prevent_cse=prevent_cse)
  where = _describe(target)
  _check_target(target, where)
  policy = validate_policy(policy, where)
  static = _normalize_static_argnums(static_argnums, where)
  cse = True if prevent_cse is None else bool(prevent_cse)
  if _is_linen_class(target):
    # A linen Module class (_is_linen_class), maybe under functools.partial.
    cls: Any = target.func if isinstance(target, functools.partial) else target
    spec = region_spec(cls.__call__, policy, cse, static, where, method=True)
    return compat.linen_lift_transform(linen_transform, target, spec=spec)
  if _is_nnx_class(target):
    call = remat(target.__call__, policy, static_argnums=static,
                 prevent_cse=cse)
    return type(f"Remat{target.__name__}", (target,),
                {"__call__": call, "__module__": target.__module__,
                 "__qualname__": f"Remat{target.__qualname__}"})
  spec = region_spec(target, policy, cse, static, where,
                   method=_looks_like_method(target))
  return region_from_spec(target, spec)


def _describe(target: Any) -> str:
  name = getattr(target, "__qualname__", None) or getattr(
      target, "__name__", None)
  return f"{name}" if name else repr(target)


def _is_linen_class(target: Any) -> bool:
  from flax import linen as nn
  cls = target.func if isinstance(target, functools.partial) else target
  return isinstance(cls, type) and issubclass(cls, nn.Module)


def _is_nnx_class(target: Any) -> bool:
  from flax import nnx
  return isinstance(target, type) and issubclass(target, nnx.Module)


def _check_target(target: Any, where: str) -> None:
  if _is_linen_class(target) or _is_nnx_class(target):
    return
  owner = getattr(target, "__self__", None)
  if inspect.ismethod(target) and (_is_linen_module(owner)
                                   or _is_nnx_node(owner)):
    name = target.__name__
    raise TypeError(
        f"rt.remat got the bound method {type(owner).__name__}.{name} of a "
        f"module instance; remat the class instead "
        f"(rt.remat({type(owner).__name__})), decorate {name} in the class "
        f"body (@rt.remat), or wrap a function that takes the module: "
        f"rt.remat(lambda m, *a: m.{name}(*a))(module, ...).")
  if isinstance(target, type) or not callable(target) or _is_linen_module(
      target) or _is_nnx_node(target):
    kind = ("a module instance" if _is_linen_module(target)
            or _is_nnx_node(target) else f"a {type(target).__name__}")
    raise TypeError(
        f"rt.remat takes a linen or NNX Module class, a method or a function, "
        f"got {target!r} ({kind}); e.g. rt.remat(Block, policy='save-ffn') "
        "or @rt.remat(policy='save-ffn') on a method. To pass a policy as a "
        "decorator argument write @rt.remat(policy=...).")


def _looks_like_method(fn: Callable[..., Any]) -> bool:
  """A function defined in a class body, judged by its first parameter."""
  try:
    params = list(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return False
  return bool(params) and params[0] == "self"


def region_spec(fn: Callable[..., Any], policy: PolicyLike, prevent_cse: bool,
                static: tuple[int, ...], where: str, *, method: bool
                ) -> RegionSpec:
  """Checks ``static`` against ``fn``'s signature and names those arguments."""
  names: tuple[str, ...] = ()
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    params = None
  if params is not None:
    if method and params:
      params = params[1:]
    positional = [p for p in params if p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    bad = [i for i in static if i >= len(positional)]
    if bad and not varargs:
      listed = ", ".join(f"{i}: {p.name}" for i, p in enumerate(positional))
      raise ValueError(
          f"static_argnums={static} is out of range for {where}, whose "
          f"arguments are {{{listed}}}; static_argnums counts the call's own "
          "arguments from 0, never self.")
    names = tuple(positional[i].name for i in static
                  if i < len(positional)
                  and positional[i].kind == positional[i].POSITIONAL_OR_KEYWORD)
  return RegionSpec(policy=policy, prevent_cse=prevent_cse,
                    static_argnums=static, static_argnames=names, where=where)
