"""The remat regions of a traced program, as the analyzer handles them.

The analyzer traces a loss once with placeholder policies (markers) on its
regions; here those regions are counted, given the policy being analysed,
inlined (the program without remat), shared between identical layers and
evaluated once per shared body, and searched for effects that run again
when a region is recomputed.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax

from remat_toolkit._src.analysis.sources import source_of
from remat_toolkit._src.core import compat
from remat_toolkit._src.core.compat import Jaxpr
from remat_toolkit._src.core.compat import JaxprEqn
from remat_toolkit._src.core.compat import Literal
from remat_toolkit._src.core.compat import Var
from remat_toolkit._src.core.jaxpr import Inline
from remat_toolkit._src.core.jaxpr import is_jaxpr_var
from remat_toolkit._src.core.jaxpr import module_path
from remat_toolkit._src.core.jaxpr import names_in
from remat_toolkit._src.core.jaxpr import rewrite
from remat_toolkit._src.core.jaxpr import sub_jaxprs
from remat_toolkit._src.core.jaxpr import walk
from remat_toolkit._src.policies import catalog

__all__ = [
    "count_remat_regions", "count_shadowed_regions", "region_signature",
    "substitute_policy", "set_every_region_policy", "inline_regions", "strip_remat",
    "share_identical_regions", "eval_with_jitted_regions", "CALLBACK_PRIMITIVES",
    "EffectSite", "effects_in_remat_regions", "own_policy_regions",
]


# ---------------------------------------------------------------- counting

def count_remat_regions(jaxpr: Jaxpr, markers: Any = None) -> int:
  """Remat regions in ``jaxpr`` (only those whose policy is ``in markers``,
  if given: a container of placeholder policies)."""
  return sum(1 for e in walk(jaxpr) if compat.is_remat(e) and (
      markers is None or compat.remat_policy_of(e) in markers))


def count_shadowed_regions(jaxpr: Jaxpr, markers: Any) -> int:
  """Regions whose policy is ``in markers`` nested inside a remat region
  with a policy of its own: the outer policy decides what they save."""
  count = 0
  for eqn in jaxpr.eqns:
    if compat.is_remat(eqn) and compat.remat_policy_of(eqn) not in markers:
      count += count_remat_regions(compat.remat_body_of(eqn), markers)
      continue
    count += sum(count_shadowed_regions(sub, markers)
                 for sub in sub_jaxprs(eqn))
  return count


def region_signature(eqn: JaxprEqn) -> str:
  """Text equal for remat regions that compute the same thing anywhere.

  The body with the module scopes all its equations share dropped (the
  unrolled layers of a model differ only there), and the region's input
  types.
  """
  body = compat.remat_body_of(eqn)
  prefix = _common_scopes(body)
  if prefix:
    body = body.replace(eqns=[compat.drop_leading_scopes(e, len(prefix))
                              for e in body.eqns])
  inputs = " ".join(v.aval.str_short() for v in eqn.invars)
  return f"{inputs}\n{body}"


# ---------------------------------------------------------------- rewrites

def substitute_policy(jaxpr: Jaxpr, markers: Any,
                      choose: Callable[[Any, frozenset[str]], Any],
                      body_for: Callable[[Any, Jaxpr], Jaxpr] | None = None
                      ) -> Jaxpr:
  """Replaces the policy of every remat region whose policy is ``in markers``.

  ``choose(marker, names_in_region)`` gives the JAX policy for each such
  region, and ``body_for(marker, body)`` (if given) its body. The rest of
  the program is shared, not re-traced.
  """
  def on_eqn(eqn, recurse):
    policy = compat.remat_policy_of(eqn) if compat.is_remat(eqn) else None
    if policy is not None and policy in markers:
      body = compat.remat_body_of(eqn)
      new_body = recurse(body)
      if body_for is not None:
        new_body = body_for(policy, new_body)
      return compat.with_remat(eqn, new_body, choose(policy, names_in(body)))
    return None

  return rewrite(jaxpr, on_eqn)


def set_every_region_policy(jaxpr: Jaxpr, policy: Any) -> Jaxpr:
  """Gives every remat region, at any depth, ``policy``."""
  def on_eqn(eqn, recurse):
    if compat.is_remat(eqn):
      return compat.with_remat(eqn, recurse(compat.remat_body_of(eqn)), policy)
    return None

  return rewrite(jaxpr, on_eqn)


def inline_regions(jaxpr: Jaxpr, markers: Any) -> Jaxpr:
  """``jaxpr`` with every remat region whose policy is ``in markers`` inlined.

  The result is the program without those regions: what a training step
  costs with no remat at all (under jax 0.10's remat3, ``everything_saveable`` still
  recomputes un-named values, so it is not that baseline). A remat3 region
  whose body captured constants stays a region.
  """
  def on_eqn(eqn, recurse):
    if not (compat.is_remat(eqn) and compat.remat_policy_of(eqn) in markers
            and not compat.remat_body_consts(eqn)):
      return None
    body = recurse(compat.remat_body_of(eqn))
    benv = dict(zip(body.invars, eqn.invars, strict=True))
    eqns = []
    for be in body.eqns:
      outs = [v if isinstance(v, compat.DropVar) else Var(v.aval)
              for v in be.outvars]
      # Out of the region, each keeps the module scopes JAX would prefix.
      eqns.append(compat.nest_scopes(be, eqn).replace(
          invars=[benv.get(a, a) if is_jaxpr_var(a) else a for a in be.invars],
          outvars=outs))
      benv.update(zip(be.outvars, outs, strict=True))
    return Inline(eqns, [benv.get(v, v) if is_jaxpr_var(v) else v
                         for v in body.outvars])

  return rewrite(jaxpr, on_eqn)


def strip_remat(jaxpr: Jaxpr) -> tuple[Jaxpr, int]:
  """``jaxpr`` without any remat region: the program with no recomputation.

  Every region (ambient or with its own policy) is inlined. A remat3 region
  whose body captured constants cannot be inlined; it gets
  ``everything_saveable`` instead (which under jax 0.10's remat3 recomputes
  un-named values, so it is counted).

  Returns:
    ``(jaxpr, regions_left)``.
  """
  markers = (compat.policy_marker("strip"),)
  inlined = inline_regions(set_every_region_policy(jaxpr, markers[0]), markers)
  left = count_remat_regions(inlined, markers)
  if left:
    inlined = substitute_policy(
        inlined, markers,
        lambda *_: jax.checkpoint_policies.everything_saveable)
  return inlined, left


def share_identical_regions(jaxpr: Jaxpr, markers: Any) -> Jaxpr:
  """Makes structurally identical remat bodies one shared jaxpr object.

  The unrolled layers of a model trace to equal bodies that differ only in
  their module scope (``layers_3/...``). Moving that scope onto the remat
  equation and sharing one body lets JAX's own per-jaxpr caches (JVP,
  partial evaluation) serve every layer, so analysing another policy costs
  one layer's work instead of one per layer. Module paths are unchanged:
  JAX prefixes the equation's name stack when it evaluates the body.
  """
  if compat.remat3_enabled():
    return jaxpr  # remat3 re-traces regions itself; sharing buys nothing.
  shared: dict[Any, Jaxpr] = {}

  def on_eqn(eqn, recurse):
    if (eqn.primitive is compat.remat_p
        and compat.remat_policy_of(eqn) in markers
        and not compat.remat_body_of(eqn).constvars):
      return _share_body(eqn, shared)
    return None

  return rewrite(jaxpr, on_eqn)


def _share_body(eqn: JaxprEqn, shared: dict[Any, Jaxpr]) -> JaxprEqn:
  body = compat.remat_body_of(eqn)
  prefix = _common_scopes(body)
  if prefix:
    body = body.replace(eqns=[
        compat.drop_leading_scopes(e, min(len(prefix),
                                          len(compat.leading_scopes(e))))
        for e in body.eqns])
  # A jaxpr's text leaves out its name stacks and what its Python rules
  # compute (two custom_vjp kernels of one primal print alike): two bodies
  # are one only if every equation also sits in the same module below the
  # region, and calls the same rules.
  key = (str(body), tuple(compat.leading_scopes(e) for e in body.eqns),
         tuple(compat.rule_fingerprint(e) for e in walk(body)))
  canonical = shared.setdefault(key, body)
  moved = compat.prefix_scopes(eqn, prefix)
  return compat.with_remat(moved, canonical, compat.remat_policy_of(eqn))


def _common_scopes(body: Jaxpr) -> tuple[Any, ...]:
  """The leading module scopes of ``body``: the region's own module.

  An equation whose whole name stack lies above the others' (a region's
  input named before the module's scope is entered) sits at the region's
  root, so it does not shorten the prefix.
  """
  stacks = [compat.leading_scopes(e) for e in body.eqns]
  try:  # a stack is deep unless it is a strict prefix of another
    above = {o[:k] for o in set(stacks) for k in range(len(o))}
    deep = [s for s in stacks if s not in above]
  except TypeError:  # an unhashable name-stack item: compare pairwise
    deep = [s for s in stacks
            if not any(len(o) > len(s) and o[:len(s)] == s for o in stacks)]
  prefix = _shared_prefix(deep)
  for s in stacks:
    if prefix[:len(s)] != s:
      prefix = _shared_prefix([prefix, s])
  return prefix


def _shared_prefix(stacks: list[tuple[Any, ...]]) -> tuple[Any, ...]:
  """The leading scope items all of ``stacks`` share."""
  prefix = []
  for items in zip(*stacks, strict=False):  # up to the shortest
    first = items[0]
    if not compat.is_scope(first) or any(it != first for it in items[1:]):
      break
    prefix.append(first)
  return tuple(prefix)


# ---------------------------------------------------------------- evaluating

def eval_with_jitted_regions(jaxpr: Jaxpr, consts: list[Any], *args: Any
                             ) -> list[Any]:
  """``eval_jaxpr``, but each top-level remat2 region runs as a jitted call.

  JAX linearizes a jitted call once per distinct jaxpr and caches it, so
  regions that share a body (see :func:`share_identical_regions`) cost one
  region's work when a policy is analysed, not one per layer.
  """
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    with compat.eval_context(eqn):
      if eqn.primitive is compat.remat_p:
        outs = _jitted_region(compat.remat_body_of(eqn),
                              compat.remat_policy_of(eqn),
                              eqn.params["prevent_cse"])(*map(read, eqn.invars))
      else:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        if not eqn.primitive.multiple_results:
          outs = [outs]
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _jitted_region(body: Jaxpr, policy: Any, prevent_cse: Any) -> Callable:
  per_body = _JITTED.setdefault(body, {})
  key = (id(policy), prevent_cse)
  entry = per_body.get(key)
  if entry is None or entry[0] is not policy:
    def region(*xs):
      return compat.bind_remat(body, policy, prevent_cse, *xs)
    entry = per_body[key] = (policy, jax.jit(region))
  return entry[1]


# ---------------------------------------------------------------- effects

#: Host-callback primitives: their Python function runs again whenever the
#: region around them is recomputed (``pure_callback`` carries no effect).
CALLBACK_PRIMITIVES: frozenset[str] = frozenset(
    {"debug_callback", "debug_print", "io_callback", "pure_callback",
     "callback"})


@dataclasses.dataclass(frozen=True)
class EffectSite:
  """An effectful or host-callback equation found inside a remat region."""

  primitive: str
  effects: tuple[str, ...]
  module_path: str
  source: str


def effects_in_remat_regions(jaxpr: Jaxpr) -> list[EffectSite]:
  """Effectful and host-callback equations inside any remat region.

  Each runs once in the forward pass and again whenever the backward pass
  recomputes its region (``jax.debug.print`` prints twice). Nested regions
  are searched once, from the outermost.
  """
  found: list[EffectSite] = []
  outermost = (e for e in walk(jaxpr, descend=lambda e: not compat.is_remat(e))
               if compat.is_remat(e))
  for region in outermost:
    for eqn in walk(compat.remat_body_of(region)):
      if ((eqn.effects or eqn.primitive.name in CALLBACK_PRIMITIVES)
          and not sub_jaxprs(eqn)):  # the effect, not a call carrying it
        found.append(EffectSite(
            eqn.primitive.name,
            tuple(sorted(type(e).__name__ for e in eqn.effects)),
            module_path(eqn), source_of(eqn)))
  return found


def _policy_label(jax_policy: Any, names: frozenset[str]) -> str:
  """A catalogue name for a region's own JAX policy, else the JAX policy."""
  # remat3 stores nothing_saveable as None; so does jax.checkpoint's default.
  target = (jax.checkpoint_policies.nothing_saveable if jax_policy is None
            else jax_policy)
  for name in catalog.list_policies():
    candidate = catalog.get_policy(name)
    try:
      lowered = candidate.to_jax(names)
      same = lowered is target or bool(lowered == target)
    except (TypeError, ValueError):  # e.g. an offloading policy under remat3
      continue
    if same:
      return repr(candidate.name)
  qualname = getattr(target, "__qualname__", None) or type(target).__name__
  return f"the JAX policy {qualname.split('.')[0]}"


def own_policy_regions(jaxpr: Jaxpr, markers: Any,
                       clean: Callable[[str], str]) -> list[tuple[str, str]]:
  """Where the program's regions keep a policy of their own (not a toolkit
  marker), each with a name for it: a catalogue policy's when one lowers to
  it, else the JAX policy's. ``clean`` turns a module path into the one
  results show."""
  found = []
  for eqn in walk(jaxpr):
    if not compat.is_remat(eqn) or compat.remat_policy_of(eqn) in markers:
      continue
    where = clean(module_path(eqn)) or source_of(eqn) or "the top level"
    names = names_in(compat.remat_body_of(eqn))
    found.append((where, _policy_label(compat.remat_policy_of(eqn), names)))
  return found
