"""Policies for models one cannot edit: :func:`remat_modules`.

Rules map a module class name or a module-path glob to a policy; every module
that matches becomes one remat region, and the model is used exactly as
before (same variables, same ``init`` / ``apply`` or call signature). Without
rules, the repeated blocks are found from the model's module tree (see
:func:`remat_modules`), and :func:`remat_summary` says what was chosen.

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
import re
import warnings
import weakref
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any

import jax

from remat_toolkit._src import compat as compat
from remat_toolkit._src import tags
from remat_toolkit._src import transform

__all__ = ["RematSummary", "remat_modules", "remat_summary"]


# ---------------------------------------------------------------- rules

@dataclasses.dataclass(frozen=True)
class _Rules:
  """Validated rules: (pattern, policy) in the order given; first match wins.

  ``exact`` rules are module paths, matched literally: the blocks that
  discovery chose, named so that nothing else can match them.
  """

  items: tuple[tuple[str, Any], ...]
  exact: bool = False

  def matching(self, class_name: str, path: str) -> list[tuple[str, Any]]:
    """Every rule that matches the module, in order (``*`` crosses ``/``)."""
    if self.exact:
      return [(p, policy) for p, policy in self.items if p == path]
    return [(pattern, policy) for pattern, policy in self.items
            if fnmatch.fnmatchcase(class_name, pattern)
            or fnmatch.fnmatchcase(path, pattern)]


def _validate_rules(rules: Any) -> _Rules:
  if not isinstance(rules, Mapping):
    raise TypeError(
        f"rules must map a module class name or module-path glob to a policy, "
        f"got {rules!r}; e.g. {{'Block': 'save-attention', '*/mlp': None}}, "
        f"or leave rules out to find the repeated blocks automatically.")
  if not rules:
    raise ValueError(
        "rules is empty; give at least one rule, e.g. {'Block': 'save-ffn'}, "
        "or leave rules out to find the repeated blocks automatically.")
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
  if not missing or rules.exact:
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


# ---------------------------------------------------------------- discovery

# A module name ending in an index: HF's ``h/0``, Flax's auto-names
# ``Block_1``, user names ``layers_3`` or ``block2``.
_INDEXED = re.compile(r"(.*?)_?(\d+)")

_Path = tuple[str, ...]


def _find_blocks(modules: Mapping[_Path, str],
                 callable_paths: set[_Path] | None = None) -> list[_Path]:
  """The paths of a model's repeated blocks, in the order of ``modules``.

  A stack is two or more sibling modules with one name stem and consecutive
  indices (``h/0``, ``h/1``; ``layers_0``, ``layers_1``) that each contain
  submodules: a Dense repeats too, but a region around one layer only moves
  its input. A stack inside a member of another stack (the experts of a
  block, T5's sub-layers ``layer/0``, ``layer/1``) is left out, as regions do
  not nest; every outermost stack counts, so both the encoder and the
  decoder stack of a seq2seq model become regions.

  Args:
    modules: module class name by path, in call (or graph) order.
    callable_paths: the modules a region can wrap (linen: those called
      through ``__call__``); None: all.
  """
  parents = {path[:k] for path in modules for k in range(len(path))}
  stacks: dict[tuple[_Path, str], dict[int, _Path]] = {}
  for path in modules:
    if not path or path not in parents:
      continue
    if callable_paths is not None and path not in callable_paths:
      continue
    match = _INDEXED.fullmatch(path[-1])
    if match:
      stacks.setdefault((path[:-1], match.group(1)), {})[
          int(match.group(2))] = path
  found: list[_Path] = []
  # Shallowest first, so that a stack nested in a chosen one is seen after it.
  for (parent, _), members in sorted(stacks.items(),
                                     key=lambda item: len(item[0][0])):
    indices = sorted(members)
    if len(indices) < 2 or indices[-1] - indices[0] != len(indices) - 1:
      continue
    if any(parent[:len(block)] == block for block in found):
      continue
    found.extend(members[i] for i in indices)
  order = {path: i for i, path in enumerate(modules)}
  return sorted(found, key=order.__getitem__)


def _report_no_blocks(model_name: str, modules: Mapping[_Path, str],
                      strict: bool, stacklevel: int) -> None:
  """Warns (or raises) that discovery found nothing; names what to pass."""
  parents = {path[:k] for path in modules for k in range(len(path))}
  composite = sorted({cls for path, cls in modules.items()
                      if path and path in parents})
  example = composite[0] if composite else "MyBlock"
  listed = (f"its submodule classes that contain modules are {composite[:20]}"
            if composite else "none of its submodules contains modules")
  message = (
      f"remat_modules found no repeated blocks in {model_name}: no module kind "
      f"with submodules repeats under indexed sibling names (h/0, h/1 or "
      f"layers_0, layers_1), so no remat region was made. Pass rules naming "
      f"the block class or path, e.g. rt.remat_modules(model, "
      f"{{{example!r}: None}}); {listed}.")
  if strict:
    raise ValueError(message)
  warnings.warn(message, UserWarning, stacklevel=stacklevel)


def _abbreviate(regions: tuple[str, ...]) -> str:
  """``h/0, h/1`` as is; a run of three or more indexed siblings as
  ``h/0 .. h/11``."""
  runs: list[list[str]] = []
  previous = None
  for region in regions:
    parent, _, name = region.rpartition("/")
    match = _INDEXED.fullmatch(name)
    key = (parent, match.group(1), int(match.group(2))) if match else None
    if (key and previous and key[:2] == previous[:2]
        and key[2] == previous[2] + 1):
      runs[-1].append(region)
    else:
      runs.append([region])
    previous = key
  return ", ".join(run[0] + " .. " + run[-1] if len(run) > 2
                   else ", ".join(run) for run in runs)


@dataclasses.dataclass(frozen=True)
class RematSummary:
  """What :func:`remat_modules` made remat regions of; ``print`` it.

  Attributes:
    model: the model's class name.
    auto: True when the blocks were found automatically (no rules given).
    classes: the class names of the region modules, in order of first region.
    regions: the module path of each region (``transformer/h/0``), in call
      order (linen) or graph order (NNX).
    ran: False for a linen model that has not run yet: its submodules, and so
      its regions, are known at its first ``init`` / ``apply``.
  """

  model: str
  auto: bool
  classes: tuple[str, ...] = ()
  regions: tuple[str, ...] = ()
  ran: bool = True

  def __str__(self) -> str:
    if not self.ran:
      return (f"remat_modules has not chosen regions of {self.model} yet: a "
              f"linen model's submodules are known when it runs; call its "
              f"init or apply first.")
    if not self.regions:
      if self.auto:
        return (f"remat_modules found no repeated blocks in {self.model}: no "
                f"remat regions. Pass rules, e.g. "
                f"rt.remat_modules(model, {{'MyBlock': None}}).")
      return (f"remat_modules rules matched no module of {self.model}: no "
              f"remat regions.")
    verb = "chose" if self.auto else "rules matched"
    count = len(self.regions)
    return (f"remat_modules {verb} {', '.join(self.classes)} ({count} "
            f"region{'' if count == 1 else 's'}: "
            f"{_abbreviate(self.regions)})")


def _summary(model_name: str, auto: bool,
             regions: Mapping[str, str]) -> RematSummary:
  """Regions listed stack by stack (in order of first use), each stack by
  index: ``Block()(Block()(x))`` calls ``Block_1`` first."""
  stacks: dict[tuple[str, str], int] = {}
  keys = {}
  for path in regions:
    parts = path.split("/") if path else []
    key = []
    for depth, name in enumerate(parts):
      match = _INDEXED.fullmatch(name)
      stem, index = (match.group(1), int(match.group(2))) if match else (
          name, 0)
      stack = ("/".join(parts[:depth]), stem)
      key.append((stacks.setdefault(stack, len(stacks)), index))
    keys[path] = tuple(key)
  ordered = sorted(regions, key=keys.__getitem__)
  return RematSummary(
      model=model_name, auto=auto,
      classes=tuple(dict.fromkeys(regions[path] for path in ordered)),
      regions=tuple(path or "<root>" for path in ordered))


# ---------------------------------------------------------------- linen

@dataclasses.dataclass
class _LinenModel:
  """One :func:`remat_modules` result, shared by its clones: its rules, the
  blocks discovery found (per entry ``method``) and the latest summary."""

  name: str
  rules: _Rules | None
  tag_outputs: bool
  strict: bool
  summary: RematSummary
  found: dict[Any, _Rules | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _LinenCall:
  """Per-call state of the interceptor: the active region and what was seen."""

  region: tuple[str, ...] | None = None
  entering: tuple[str, ...] | None = None
  seen: dict[str, str] = dataclasses.field(default_factory=dict)
  matched: set[str] = dataclasses.field(default_factory=set)
  regions: dict[str, str] = dataclasses.field(default_factory=dict)


_linen_call: contextvars.ContextVar[_LinenCall | None] = contextvars.ContextVar(
    "remat_toolkit_linen_rules", default=None)

# Set while discovery traces the model, so that the nested entry calls of
# that trace (``init`` calls ``init_with_output``) run the plain model.
_discovering: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remat_toolkit_linen_discovery", default=False)


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
    state.regions.setdefault("/".join(path), class_name)
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
def _linen_rules_active(rules: _Rules, model: _LinenModel) -> Iterator[None]:
  from flax import linen as nn
  state = _LinenCall()
  token = _linen_call.set(state)
  try:
    with nn.intercept_methods(_linen_interceptor(rules, model.tag_outputs)):
      yield
  finally:
    _linen_call.reset(token)
  model.summary = _summary(model.name, model.rules is None, state.regions)
  # Raised from the user's init/apply call: contextlib and the wrapper between.
  _report_unmatched(rules, state.matched, state.seen, model.strict,
                    stacklevel=6)


def _record_linen(module: Any, entry: Any, args: tuple, kwargs: dict
                  ) -> tuple[dict[_Path, str], set[_Path]]:
  """Every module the entry call reaches, by path, from one abstract trace
  (``jax.eval_shape``: nothing is computed or allocated)."""
  from flax import linen as nn
  seen: dict[_Path, str] = {}
  called: set[_Path] = set()

  def recorder(next_fun, a, k, ctx):
    if ctx.module.scope is not None:
      path = tuple(str(p) for p in ctx.module.path)
      seen.setdefault(path, type(ctx.module).__name__)
      if ctx.method_name == "__call__":
        called.add(path)
    return next_fun(*a, **k)

  def trace() -> None:
    # The outputs may hold non-array values eval_shape cannot return.
    with nn.intercept_methods(recorder):
      entry(module, *args, **kwargs)

  token = _discovering.set(True)
  try:
    jax.eval_shape(trace)
  except Exception as error:
    error.add_note(
        "(raised while remat_modules traced the model abstractly to find its "
        "repeated blocks; pass rules, e.g. {'Block': None}, to skip that.)")
    raise
  finally:
    _discovering.reset(token)
  return seen, called


def _discover_linen(model: _LinenModel, module: Any, entry: Any, args: tuple,
                    kwargs: dict) -> _Rules | None:
  """The blocks of the model as this entry call runs it; found once per
  ``method`` (an ``apply(method=...)`` may reach a different part)."""
  key = kwargs.get("method")
  try:
    hash(key)
  except TypeError:
    key = id(key)
  if key not in model.found:
    seen, called = _record_linen(module, entry, args, kwargs)
    blocks = _find_blocks(seen, called)
    if not blocks:
      model.summary = RematSummary(model=model.name, auto=True)
      # Raised from the user's init/apply call: the wrapper is between.
      _report_no_blocks(model.name, seen, model.strict, stacklevel=4)
    model.found[key] = _Rules(tuple(("/".join(p), None) for p in blocks),
                              exact=True) if blocks else None
  return model.found[key]


def _linen_with_rules(model: Any, rules: _Rules | None, tag_outputs: bool,
                      strict: bool) -> Any:
  from flax import linen as nn
  cls = type(model)
  state = _LinenModel(
      name=cls.__name__, rules=rules, tag_outputs=tag_outputs, strict=strict,
      summary=RematSummary(model=cls.__name__, auto=rules is None, ran=False))

  def entry(name: str):
    base = getattr(cls, name)

    @nn.nowrap
    @functools.wraps(base)
    def method(self, *args, **kwargs):
      if _linen_call.get() is not None or _discovering.get():
        # Nested in this model's own call (init calls init_with_output).
        return base(self, *args, **kwargs)
      active = rules
      if active is None:
        active = _discover_linen(state, self, base, args, kwargs)
        if active is None:
          return base(self, *args, **kwargs)
      with _linen_rules_active(active, state):
        return base(self, *args, **kwargs)
    return method

  namespace = {name: entry(name) for name in ("init", "init_with_output",
                                              "apply")}
  namespace["__module__"] = cls.__module__
  namespace["__qualname__"] = cls.__qualname__
  namespace["_remat_toolkit_model"] = state
  # Same class name: auto-generated names and reprs do not change.
  sub = type(cls.__name__, (cls,), namespace)
  attrs = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
           if f.init}
  return sub(**attrs)


# ---------------------------------------------------------------- NNX

_nnx_classes: dict[tuple[type, str, Any, bool], type] = {}

# Summaries of the NNX models remat_modules returned, by id, held no longer
# than the models (an attribute would change the model's graph definition,
# and a module need not be hashable).
_nnx_summaries: dict[int, tuple[weakref.ref, RematSummary]] = {}


def _remember_nnx(model: Any, summary: RematSummary) -> None:
  for key in [key for key, (ref, _) in _nnx_summaries.items()
              if ref() is None]:
    del _nnx_summaries[key]
  _nnx_summaries[id(model)] = (weakref.ref(model), summary)


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


def _nnx_with_rules(model: Any, rules: _Rules | None, tag_outputs: bool,
                    strict: bool) -> Any:
  from flax import nnx
  model = nnx.clone(model)
  modules = [(tuple(str(p) for p in path), node)
             for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Module)]
  seen = {"/".join(path): type(node).__name__ for path, node in modules}
  regions: list[tuple[tuple[str, ...], Any, Any]] = []
  if rules is None:
    by_path = dict(modules)
    blocks = _find_blocks({path: type(node).__name__ for path, node in modules})
    if not blocks:
      _report_no_blocks(type(model).__name__,
                        {path: type(node).__name__ for path, node in modules},
                        strict, stacklevel=4)
    regions = [(path, by_path[path], None) for path in blocks]
  else:
    matched: set[str] = set()
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
  # NNX pushes no module scopes; this names values by module path, as linen.
  transform.name_nnx_modules(model)
  order = {path: i for i, (path, _) in enumerate(modules)}
  _remember_nnx(model, _summary(
      type(model).__name__, rules is None,
      {"/".join(path): type(node).__name__
       for path, node, _ in sorted(regions, key=lambda r: order[r[0]])}))
  return model


# ---------------------------------------------------------------- public API

def remat_modules(model: Any, rules: Mapping[str, Any] | None = None, *,
                  tag_outputs: bool = True, strict: bool = False) -> Any:
  """Makes every module matched by ``rules``, or every repeated block, one
  remat region.

  Without rules, the blocks are found from the model's module tree: the
  outermost stacks of two or more sibling modules that contain submodules
  and are named by one stem and consecutive indices (``transformer/h/0``,
  ``transformer/h/1`` in Hugging Face GPT-2; ``layers_0``, ``Block_1`` in
  plain Flax; ``encoder/block/0`` and ``decoder/block/0`` in T5: both
  stacks). Each becomes a region that reads the ambient policy (as the rule
  ``None`` does), and :func:`remat_summary` says what was chosen. A linen
  model's submodules are known only when it runs, so its blocks are found at
  its first ``init`` / ``init_with_output`` / ``apply`` (per ``method=``),
  from one extra abstract trace (``jax.eval_shape``: nothing is computed or
  allocated).

  Args:
    model: a linen Module (unbound, as passed to ``init`` / ``apply``) or an
      NNX Module.
    rules: maps a module class name or module-path glob (``"Block"``,
      ``"Block_*"``, ``"*/attn"``, ``"blocks/*"``) to a policy: a name, a
      :class:`Policy`, a raw JAX policy, or None for the ambient policy. The
      first matching rule wins; a module inside a matched module is not made
      a region of its own (regions do not nest). None (the default): find
      the repeated blocks, as above; rules given always win.
    tag_outputs: name the outputs of submodules inside each region by their
      path relative to the region (``attn/query``), so module-name patterns
      of policies (``*attn/*``, ``*mlp/*``) select them.
    strict: raise instead of warning when a rule matches no module, or when
      no repeated block is found.

  Returns:
    A model used exactly like ``model``. Linen: a module with the same fields
    and variables; its ``init`` / ``init_with_output`` / ``apply`` apply the
    rules. NNX: a copy (``nnx.clone``: the same values, new Variables) whose
    matching submodules are regions; train the copy.

  Raises:
    TypeError: if ``model`` is not a linen or NNX Module, or for malformed
      rules.
    ValueError: for an unknown policy name, or (with ``strict=True``) a rule
      that matches no module or a model with no repeated blocks. For linen,
      this is checked when the model is first run, since only then are its
      submodules known.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import remat_toolkit as rt
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return x + nn.Dense(4, name="mlp")(jnp.tanh(x))
    >>> class Model(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return Block()(Block()(x))
    >>> model = rt.remat_modules(Model())
    >>> _ = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((2, 4)))
    >>> print(rt.remat_summary(model))
    remat_modules chose Block (2 regions: Block_0, Block_1)
  """
  from flax import linen as nn
  from flax import nnx
  checked = None if rules is None else _validate_rules(rules)
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


def remat_summary(model: Any) -> RematSummary:
  """What :func:`remat_modules` made remat regions of in ``model``.

  Args:
    model: a model :func:`remat_modules` returned.

  Returns:
    A :class:`RematSummary`; ``print`` it for one line such as
    ``remat_modules chose FlaxGPT2Block (2 regions: transformer/h/0,
    transformer/h/1)``. Linen: the regions of the latest ``init`` /
    ``apply`` (``ran=False`` before the first). NNX: the regions of the
    returned copy.

  Raises:
    TypeError: if ``model`` did not come from :func:`remat_modules` (for NNX,
      a copy made later by ``nnx.clone`` or ``nnx.merge`` has none either).
  """
  state = getattr(type(model), "_remat_toolkit_model", None)
  if isinstance(state, _LinenModel):
    return state.summary
  ref, summary = _nnx_summaries.get(id(model), (None, None))
  if ref is not None and ref() is model:
    return summary
  raise TypeError(
      f"remat_summary takes a model returned by rt.remat_modules, got "
      f"{type(model).__name__}; call it on that model (for NNX, the copy "
      f"remat_modules returned, not a later nnx.clone or nnx.merge of it).")
