"""Re-policy a function whose remat regions were written into it.

A model that remats itself (MaxText's ``jax.checkpoint(policy=...)`` around
each decoder layer, recurrentgemma's ``nn.remat``, an ``nnx.remat``, a scan
of a rematted body) fixes its regions' policies in its own source.
:func:`repolicy` traces such a function where it is called, gives each remat
region found in the program (at any depth: scan bodies, jitted inner
functions, other call-like primitives) another policy, keeps the region's
other settings, and evaluates the program inside the caller's trace, so it
composes with ``jax.jit`` and ``jax.grad``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> layer = jax.checkpoint(lambda w, x: jnp.sin(x @ w),
  ...                        policy=jax.checkpoint_policies.nothing_saveable)
  >>> f = rt.repolicy(lambda w, x: layer(w, layer(w, x)).sum(), "save-everything")
  >>> float(jax.grad(f)(jnp.eye(2), jnp.ones((1, 2)))[0, 0]) != 0.0
  True
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr
from remat_toolkit._src.core.arg_paths import module_path_of
from remat_toolkit._src.policies import lowering
from remat_toolkit._src.policies import region_inputs
from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies.findings import brief
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.transform.trace_cache import is_array

__all__ = ["repolicy"]


def _check_regions(regions: Any) -> tuple[str, ...] | None:
  """``regions`` as a tuple of patterns, or a TypeError naming the fix."""
  if regions is None:
    return None
  if isinstance(regions, str):
    regions = (regions,)
  if (not isinstance(regions, Sequence) or not regions
      or not all(isinstance(r, str) and r for r in regions)):
    raise TypeError(
        f"repolicy's regions must be a module path or glob, or a non-empty "
        f"list of them (e.g. regions='layers_*'), got {regions!r}.")
  return tuple(regions)


def _selected(key: str, patterns: tuple[str, ...] | None, hits: set[str]
              ) -> bool:
  if patterns is None:
    return True
  matched = [p for p in patterns if region_keys.key_matches(key, p)]
  hits.update(matched)
  return bool(matched)


def _argument_paths(args: tuple, kwargs: dict, traced: list[int]
                   ) -> list[tuple[str, ...]]:
  """Per traced leaf of ``(args, kwargs)``, the module path of the variable
  it is (``('layers', '0', 'lin')`` for an NNX state's
  ``layers/0/lin/kernel``; :func:`~remat_toolkit._src.core.arg_paths.
  module_path_of`); ``()`` for a bare array."""
  paths = [path for path, _ in
           jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
  # (args, kwargs) and the position (or keyword) come first.
  return [module_path_of(paths[i][2:]) for i in traced]


def _common_prefix(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
  common: list[str] = []
  for names in zip(*paths, strict=False) if paths else ():
    if any(n != names[0] for n in names[1:]):
      break
    common.append(names[0])
  return tuple(common)


def _body_scopes(body: Any) -> list[str]:
  """The module scopes every equation of a region's body shares."""
  return list(_common_prefix([tuple(compat.module_scopes(e))
                              for e in body.eqns]))


class _Arguments:
  """Where the program's arguments come from, to key regions by."""

  def __init__(self, program: Any, paths: list[tuple[str, ...]]):
    self.positions = _jaxpr.argument_positions(program)
    self.paths = paths

  def module_path(self, eqn: Any) -> tuple[str, ...]:
    """The module path the variables a region reads share (the weights of
    ``layers/3``), of the argument it reads most variables of."""
    by_argument: dict[str, list[tuple[str, ...]]] = {}
    for v in eqn.invars:
      position = (self.positions.get(v, -1) if _jaxpr.is_jaxpr_var(v)
                  else -1)
      if 0 <= position < len(self.paths) and self.paths[position]:
        path = self.paths[position]
        by_argument.setdefault(path[0], []).append(path)
    if not by_argument:
      return ()
    return _common_prefix(max(by_argument.values(), key=len))


def _region_key(eqn: Any, body: Any, arguments: _Arguments) -> str:
  """The region's module path, else its position.

  Flax pushes a module's scope while its body is traced, so a linen region
  sits in its parent's scopes (the first being the root module's class
  name, which linen scope paths leave out) and its own scope heads every
  equation of its body. A program without scopes (an NNX model, a function
  of a parameter tree) names a region by the path its weights share in
  the function's arguments.
  """
  outer = compat.module_scopes(eqn)[1:]
  path = tuple(outer + _body_scopes(body)) or arguments.module_path(eqn)
  return region_keys.region_key(path or None)


def _rewrite(program: Any, policy: PolicyLike,
             patterns: tuple[str, ...] | None,
             paths: list[tuple[str, ...]]) -> tuple[Any, list[str]]:
  """``program`` with each selected region's policy replaced; the keys."""
  keys: list[str] = []
  seen: list[str] = []  # every region's key, selected or not
  hits: set[str] = set()
  arguments = _Arguments(program, paths)

  def on_eqn(eqn: Any, recurse: Callable[[Any], Any]) -> Any:
    if not compat.is_remat(eqn):
      return None
    old_body = compat.remat_body_of(eqn)
    key = _region_key(eqn, old_body, arguments)  # outer first, as tracing numbers them
    seen.append(key)
    body = recurse(old_body)
    if not _selected(key, patterns, hits):
      return None if body is old_body else compat.with_remat(
          eqn, body, compat.remat_policy_of(eqn))
    keys.append(key)
    names = _jaxpr.names_in(body)
    # Its computed inputs: the function's own arguments (the weights
    # nn.remat passes in) are held by the caller anyway.
    mask = tuple(v not in arguments.positions for v in eqn.invars)
    region = lowering.region_policy(policy, key)
    if region_inputs.selects_inputs(region.policy):
      body = region_inputs.name_body_inputs(body, mask)
      names |= {region_inputs.INPUT_NAME}  # a region fed only arguments
    lowering.warn_if_unmatched(region, names, f"remat region {key!r}")
    return compat.with_remat(
        eqn, body, lowering.region_jax_policy(region, names, mask))

  new = _jaxpr.rewrite(program, on_eqn)
  _warn_unmatched_patterns(patterns, hits, seen)
  return new, keys


def _warn_unmatched_patterns(patterns: tuple[str, ...] | None,
                             hits: set[str], keys: list[str]) -> None:
  missing = [p for p in patterns or () if p not in hits]
  if missing:
    warnings.warn(
        f"repolicy's regions {missing} match no remat region of the function "
        f"(its regions: {brief(sorted(set(keys)), 8) if keys else 'none'}); "
        "those regions keep their own policies. Name a region's key or a "
        f"glob of keys, e.g. regions={_example_pattern(keys)!r}.",
        UserWarning, stacklevel=4)


def _example_pattern(keys: list[str]) -> str:
  """A glob over the regions' keys: the first one's last number starred."""
  if not keys:
    return "layers_*"
  return re.sub(r"\d+(?!.*\d)", "*", sorted(keys)[0])


def _warn_no_regions() -> None:
  warnings.warn(
      "repolicy found no remat region in the function (no jax.checkpoint, "
      "nn.remat or nnx.remat); the policy changes nothing. Use rt.remat or "
      "rt.remat_modules to make regions.", UserWarning, stacklevel=4)


def _run(fn: Callable[..., Any], policy: PolicyLike,
         patterns: tuple[str, ...] | None, args: tuple, kwargs: dict) -> Any:
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  traced = [i for i, x in enumerate(leaves) if is_array(x)]

  def flat(*dynamic):
    full = list(leaves)
    for i, x in zip(traced, dynamic, strict=True):
      full[i] = x
    a, kw = jax.tree_util.tree_unflatten(treedef, full)
    return fn(*a, **kw)

  dynamic = [leaves[i] for i in traced]
  closed, out_shape = _jaxpr.trace_program(flat, dynamic)
  with region_keys.counting():  # positions count afresh in each program
    program, keys = _rewrite(compat.inner_jaxpr(closed), policy, patterns,
                             _argument_paths(args, kwargs, traced))
  if not keys and patterns is None:
    _warn_no_regions()
  outs = compat.eval_jaxpr(program, compat.jaxpr_consts(closed), *dynamic)
  return jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(out_shape), outs)


def repolicy(fn: Callable[..., Any], policy: PolicyLike = None, *,
             regions: str | Sequence[str] | None = None) -> Callable[..., Any]:
  """``fn`` with ``policy`` in place of its own remat regions' policies.

  For models that remat themselves (``jax.checkpoint(policy=...)`` around
  each layer, ``nn.remat``, ``nnx.remat``, ``nn.remat_scan``, a scan of a
  rematted body, regions inside a jitted inner function). Each call traces
  ``fn``, replaces the policy of every remat region of the program (or of
  those ``regions`` selects), keeps each region's other settings
  (``prevent_cse``, its body) and evaluates it in the caller's trace: it
  composes with ``jax.jit`` and ``jax.grad`` and compiles to the program the
  same policy written into the model by hand gives. A region is keyed by
  its module path where the program carries one: a Flax module's scope
  path, else the path the weights it reads share in ``fn``'s arguments
  (an NNX state's ``layers/3``, a scanned stack's ``decoder/layers``);
  else by position (``#0``, ``#1``...), as ``rt.remat``'s regions are, so
  a per-region plan applies to it.

  Args:
    fn: the function (a loss, a model's apply) whose regions to re-policy.
    policy: any policy ``rt.remat`` accepts; None (default) reads the
      ambient policy at trace time, so ``rt.compare(rt.repolicy(loss), ...)``
      measures each policy on the model.
    regions: a region key or glob, or a list of them: only the regions it
      matches are re-policied, the others keep their own policy. A pattern
      that matches no region warns.

  Returns:
    A function of the same signature as ``fn``.

  Raises:
    TypeError: ``fn`` is not callable, ``policy`` or ``regions`` has the
      wrong type.
    ValueError: ``policy`` names no known policy.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> body = jax.checkpoint(lambda x: jnp.sin(jnp.sin(x)))
    >>> loss = lambda x: body(x).sum()
    >>> with rt.use_policy("save-everything"):
    ...   len(rt.analyze(rt.repolicy(loss), jnp.ones(4)).residuals) > 0
    True
  """
  if not callable(fn):
    raise TypeError(f"repolicy takes the function to re-policy, got "
                    f"{fn!r} ({type(fn).__name__}); e.g. rt.repolicy(loss).")
  policy = resolve.declared_policy(policy, argument="repolicy's policy")
  patterns = _check_regions(regions)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    return _run(fn, policy, patterns, args, kwargs)

  return wrapped
