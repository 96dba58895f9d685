"""Policies for models one cannot edit: :func:`remat_modules`.

Rules map a module class name or a module-path glob to a policy; every module
that matches becomes one remat region, and the model is used exactly as
before (same variables, same ``init`` / ``apply`` or call signature).

Inside a region, ``tag_outputs=True`` names the outputs of its submodules by
their path relative to the region (``attn/query``, ``mlp``), so the built-in
selective policies, whose patterns include ``*attn/*`` and ``*mlp/*``, work
on a model that was never tagged.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> import remat_toolkit as rt
  >>> class Block(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.Dense(4, name="mlp")(jnp.tanh(x))
  >>> class Model(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return Block()(Block()(x))
  >>> model = rt.remat_modules(Model(), {"Block": "save-ffn"})
  >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
  >>> sorted(variables["params"])
  ['Block_0', 'Block_1']
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import functools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from remat_toolkit import _compat as compat
from remat_toolkit import tags
from remat_toolkit import transform

__all__ = ["remat_modules"]


# ---------------------------------------------------------------- rules

@dataclasses.dataclass(frozen=True)
class _Rules:
  """Validated rules: (pattern, policy) in the order given; first match wins."""

  items: tuple[tuple[str, Any], ...]

  def matching(self, class_name: str, path: str) -> list[tuple[str, Any]]:
    """Every rule that matches the module, in order (``*`` crosses ``/``)."""
    return [(pattern, policy) for pattern, policy in self.items
            if fnmatch.fnmatchcase(class_name, pattern)
            or fnmatch.fnmatchcase(path, pattern)]


def _validate_rules(rules: Any) -> _Rules:
  if not isinstance(rules, Mapping):
    raise TypeError(
        f"rules must map a module class name or module-path glob to a policy, "
        f"got {rules!r}; e.g. {{'Block': 'save-attention', '*/mlp': None}}.")
  if not rules:
    raise ValueError(
        "rules is empty; give at least one rule, e.g. {'Block': 'save-ffn'}.")
  items = []
  for pattern, policy in rules.items():
    if not isinstance(pattern, str) or not pattern:
      raise TypeError(
          f"rule keys must be module class names or module-path globs "
          f"(non-empty strings), got {pattern!r}; e.g. 'Block' or 'Block_*'.")
    transform._validate_policy(policy, f"rule {pattern!r}")
    items.append((pattern, policy))
  return _Rules(tuple(items))


def _report_unmatched(rules: _Rules, matched: set[str],
                      seen: Mapping[str, str], strict: bool,
                      stacklevel: int) -> None:
  """Warns (or raises) about rules that matched no module; lists what exists."""
  missing = [p for p, _ in rules.items if p not in matched]
  if not missing:
    return
  classes = sorted(set(seen.values()))
  paths = sorted(p for p in seen if p)
  if len(paths) > 20:
    paths = paths[:20] + [f"... ({len(paths)} in all)"]
  message = (
      f"remat_modules: rule(s) {missing} match no module. Rules match a "
      f"module class name or a module path glob; this model has classes "
      f"{classes} and paths {paths}.")
  if strict:
    raise ValueError(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel)


def _tag_tree(tree: Any, name: str) -> Any:
  return jax.tree_util.tree_map(
      lambda x: tags.tag(x, name) if isinstance(x, jax.Array) else x, tree)


def _region_name(path: str, class_name: str) -> str:
  return f"module {path or '<root>'} ({class_name})"


# ---------------------------------------------------------------- linen

@dataclasses.dataclass
class _LinenCall:
  """Per-call state of the interceptor: the active region and what was seen."""

  region: tuple[str, ...] | None = None
  entering: tuple[str, ...] | None = None
  seen: dict[str, str] = dataclasses.field(default_factory=dict)
  matched: set[str] = dataclasses.field(default_factory=set)


_linen_call: contextvars.ContextVar[_LinenCall | None] = contextvars.ContextVar(
    "remat_toolkit_linen_rules", default=None)


def _linen_interceptor(rules: _Rules, tag_outputs: bool):
  """Sees every submodule call: opens regions, tags outputs inside them."""

  def interceptor(next_fun, args, kwargs, ctx):
    state = _linen_call.get()
    module = ctx.module
    if state is None or ctx.method_name != "__call__" or module.scope is None:
      return next_fun(*args, **kwargs)
    path = tuple(str(p) for p in module.path)
    class_name = type(module).__name__
    state.seen.setdefault("/".join(path), class_name)
    if state.entering == path:
      # The lifted clone of a matched module: run its body inside the region.
      state.entering = None
      return _run_in_region(state, path, next_fun, args, kwargs)
    hits = rules.matching(class_name, "/".join(path))
    state.matched.update(pattern for pattern, _ in hits)
    if state.region is not None:  # regions do not nest
      out = next_fun(*args, **kwargs)
      rel = path[len(state.region):]
      if tag_outputs and rel and path[:len(state.region)] == state.region:
        out = _tag_tree(out, "/".join(rel))
      return out
    if not hits:
      return next_fun(*args, **kwargs)
    return _open_region(state, module, path, hits[0][1], args, kwargs)

  return interceptor


def _open_region(state: _LinenCall, module: Any, path: tuple[str, ...],
                 policy: Any, args: tuple, kwargs: dict) -> Any:
  """Calls ``module`` through a lifted remat; its clone re-enters the
  interceptor, which then runs the body with the region active."""
  call = type(module).__call__
  where = _region_name("/".join(path), type(module).__name__)
  spec = transform._spec_for(call, policy, True, (), where, method=True)
  lifted = compat.linen_decorator_lift_transform(
      transform._linen_transform, call, spec=spec)
  state.entering = path
  try:
    return lifted(module, *args, **kwargs)
  finally:
    state.entering = None


def _run_in_region(state: _LinenCall, path: tuple[str, ...], next_fun,
                   args, kwargs) -> Any:
  outer = state.region
  state.region = path
  try:
    return next_fun(*args, **kwargs)
  finally:
    state.region = outer


@contextlib.contextmanager
def _linen_rules_active(rules: _Rules, tag_outputs: bool, strict: bool
                        ) -> Iterator[None]:
  from flax import linen as nn
  if _linen_call.get() is not None:  # already inside this model's call
    yield
    return
  state = _LinenCall()
  token = _linen_call.set(state)
  try:
    with nn.intercept_methods(_linen_interceptor(rules, tag_outputs)):
      yield
  finally:
    _linen_call.reset(token)
  # Raised from the user's init/apply call: contextlib and the wrapper between.
  _report_unmatched(rules, state.matched, state.seen, strict, stacklevel=6)


def _linen_with_rules(model: Any, rules: _Rules, tag_outputs: bool,
                      strict: bool) -> Any:
  from flax import linen as nn
  cls = type(model)

  def entry(name: str):
    base = getattr(cls, name)

    @nn.nowrap
    @functools.wraps(base)
    def method(self, *args, **kwargs):
      with _linen_rules_active(rules, tag_outputs, strict):
        return base(self, *args, **kwargs)
    return method

  namespace = {name: entry(name) for name in ("init", "init_with_output",
                                              "apply")}
  namespace["__module__"] = cls.__module__
  namespace["__qualname__"] = cls.__qualname__
  # Same class name: auto-generated names and reprs do not change.
  sub = type(cls.__name__, (cls,), namespace)
  attrs = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
           if f.init}
  return sub(**attrs)


# ---------------------------------------------------------------- NNX

_nnx_classes: dict[tuple[type, str, Any, bool], type] = {}


def _nnx_region_class(cls: type, where: str, policy: Any) -> type:
  key = (cls, "region", where, policy)
  if key not in _nnx_classes:
    spec = transform._spec_for(cls.__call__, policy, True, (), where,
                               method=True)
    call = transform._region_from_spec(cls.__call__, spec)
    _nnx_classes[key] = type(cls.__name__, (cls,), {
        "__call__": call, "__module__": cls.__module__,
        "__qualname__": cls.__qualname__})
  return _nnx_classes[key]


def _nnx_tagging_class(cls: type, name: str) -> type:
  key = (cls, "tag", name, True)
  if key not in _nnx_classes:
    base_call = cls.__call__

    @functools.wraps(base_call)
    def call(self, *args, **kwargs):
      return _tag_tree(base_call(self, *args, **kwargs), name)

    _nnx_classes[key] = type(cls.__name__, (cls,), {
        "__call__": call, "__module__": cls.__module__,
        "__qualname__": cls.__qualname__})
  return _nnx_classes[key]


def _nnx_with_rules(model: Any, rules: _Rules, tag_outputs: bool,
                    strict: bool) -> Any:
  from flax import nnx
  model = nnx.clone(model)
  modules = [(tuple(str(p) for p in path), node)
             for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Module)]
  seen = {"/".join(path): type(node).__name__ for path, node in modules}
  matched: set[str] = set()
  regions: list[tuple[tuple[str, ...], Any, Any]] = []
  for path, node in sorted(modules, key=lambda item: len(item[0])):
    hits = rules.matching(type(node).__name__, "/".join(path))
    matched.update(pattern for pattern, _ in hits)
    if hits and not any(path[:len(r)] == r for r, _, _ in regions):
      regions.append((path, node, hits[0][1]))  # regions do not nest
  _report_unmatched(rules, matched, seen, strict, stacklevel=4)
  wrapped: set[int] = set()
  for region_path, region_node, policy in regions:
    if tag_outputs:
      for path, node in modules:
        rel = path[len(region_path):]
        if (path[:len(region_path)] == region_path and rel
            and id(node) not in wrapped):
          wrapped.add(id(node))
          node.__class__ = _nnx_tagging_class(type(node), "/".join(rel))
    where = _region_name("/".join(region_path), type(region_node).__name__)
    region_node.__class__ = _nnx_region_class(type(region_node), where, policy)
  return model


# ---------------------------------------------------------------- public API

def remat_modules(model: Any, rules: Mapping[str, Any], *,
                  tag_outputs: bool = True, strict: bool = False) -> Any:
  """Makes every module matched by ``rules`` one remat region.

  Args:
    model: a linen Module (unbound, as passed to ``init`` / ``apply``) or an
      NNX Module.
    rules: maps a module class name or module-path glob (``"Block"``,
      ``"Block_*"``, ``"*/attn"``, ``"blocks/*"``) to a policy: a name, a
      :class:`Policy`, a raw JAX policy, or None for the ambient policy. The
      first matching rule wins; a module inside a matched module is not made
      a region of its own (regions do not nest).
    tag_outputs: name the outputs of submodules inside each region by their
      path relative to the region (``attn/query``), so module-name patterns
      of policies (``*attn/*``, ``*mlp/*``) select them.
    strict: raise instead of warning when a rule matches no module.

  Returns:
    A model used exactly like ``model``. Linen: a module with the same fields
    and variables; its ``init`` / ``init_with_output`` / ``apply`` apply the
    rules. NNX: a copy (``nnx.clone``: the same values, new Variables) whose
    matching submodules are regions; train the copy.

  Raises:
    TypeError: if ``model`` is not a linen or NNX Module, or for malformed
      rules.
    ValueError: for an unknown policy name, or (with ``strict=True``) a rule
      that matches no module. For linen, rules are checked when the model is
      first run, since only then are its submodules known.
  """
  from flax import linen as nn
  from flax import nnx
  checked = _validate_rules(rules)
  if isinstance(model, nn.Module):
    if model.scope is not None:
      raise TypeError(
          f"remat_modules takes an unbound linen Module (the one passed to "
          f"init/apply), got a bound {type(model).__name__}; call it on the "
          "top-level model.")
    return _linen_with_rules(model, checked, bool(tag_outputs), bool(strict))
  if isinstance(model, nnx.Module):
    return _nnx_with_rules(model, checked, bool(tag_outputs), bool(strict))
  raise TypeError(
      f"remat_modules takes a linen or NNX Module instance, got {model!r} of "
      f"type {type(model).__name__}; for a function use rt.remat(fn, policy).")
