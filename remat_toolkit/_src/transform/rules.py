"""Policies for models one cannot edit: :func:`remat_modules`.

Rules map a module class name or a module-path glob to a policy; every module
that matches becomes one remat region, and the model is used exactly as
before (same variables, same ``init`` / ``apply`` or call signature). Without
rules, the repeated blocks are found from the model's module tree (see
:func:`remat_modules`), and :func:`remat_summary` says what was chosen.

Inside a region, ``tag_outputs=True`` names the outputs of its submodules by
their path relative to the region (``attn/query``, ``mlp``), so the built-in
selective policies, whose patterns include ``*attn/*`` and ``*mlp/*``, work
on a model that was never tagged. Block discovery and :class:`RematSummary`
are in :mod:`~remat_toolkit._src.transform.discovery`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import TypeVar

import jax

from remat_toolkit._src.core import compat
from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.core.globs import glob_match
from remat_toolkit._src.policies import resolve
from remat_toolkit._src.policies import tags
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import warn_at_trace
from remat_toolkit._src.policies.resolve import PolicyLike
from remat_toolkit._src.transform import discovery
from remat_toolkit._src.transform import nnx_paths
from remat_toolkit._src.transform import remat as transform
from remat_toolkit._src.transform.discovery import Path
from remat_toolkit._src.transform.discovery import RematSummary

__all__ = ["remat_modules", "remat_summary"]


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
            if glob_match(class_name, pattern) or glob_match(path, pattern)]


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
    items.append((pattern, transform.validate_policy(policy,
                                                     f"rule {pattern!r}")))
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
  applications: dict[str, int] = dataclasses.field(default_factory=dict)
  # Paths of the model's own nn.remat modules, by class name.
  foreign: dict[tuple[str, ...], str] = dataclasses.field(default_factory=dict)
  shadow_said: bool = False


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
    if state is None or module.scope is None:
      return next_fun(*args, **kwargs)
    if compat.is_linen_remat(module):
      state.foreign.setdefault(_lifted_path(module), type(module).__name__)
    if ctx.method_name != "__call__":
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
    _warn_if_shadowed(state, path, hits[0][1])
    state.regions.setdefault("/".join(path), class_name)
    # A shared layer applied N times is one region module, N regions in JAX.
    state.applications["/".join(path)] = (
        state.applications.get("/".join(path), 0) + 1)
    return _open_region(state, module, path, hits[0][1], args, kwargs)

  return interceptor


def _lifted_path(module: Any) -> tuple[str, ...]:
  """The path of a lifted module whose wrapper (not its ``__call__``) runs:
  the wrapper runs in its parent's scope."""
  path = tuple(str(p) for p in module.path)
  if module.name is not None and (not path or path[-1] != str(module.name)):
    path = tuple(str(p) for p in module.scope.path) + (str(module.name),)
  return path


def _warn_if_shadowed(state: _LinenCall, path: tuple[str, ...],
                      policy: PolicyLike) -> None:
  """Says so, once, when the model's own ``nn.remat`` is or encloses a
  module made a region: the model's region recomputes everything in it by
  its own policy, so a policy asked for here changes nothing."""
  outer = next((p for p in (path[:k] for k in range(len(path), -1, -1))
                if p in state.foreign), None)
  if outer is None or state.shadow_said:
    return
  state.shadow_said = True  # once per trace: the first region names the rest
  asked = (resolve.current_policy() if policy is None
           else resolve.resolve_policy(policy))
  if asked.name == "boundary-only":  # nothing to lose: it keeps the inputs
    return
  where = "/".join(path)
  warn_at_trace(Finding(
      f"remat_modules made {where!r} (and any like it) a region, but the "
      "model's own remat "
      f"region {'/'.join(outer)!r} ({state.foreign[outer]}, "
      "made by nn.remat) is or encloses it: the model's region recomputes "
      "everything in it by its own policy, so policy "
      f"{asked.name!r} changes nothing there. Re-policy the model's own "
      "regions instead, rt.repolicy(loss, policy), or turn the model's remat "
      "off (Hugging Face: gradient_checkpointing=False).",
      "shadowed", asked.name))


def _open_region(state: _LinenCall, module: Any, path: tuple[str, ...],
                 policy: PolicyLike, args: tuple, kwargs: dict) -> Any:
  """Calls ``module`` through a lifted remat; its clone re-enters the
  interceptor, which then runs the body with the region active."""
  call = type(module).__call__
  where = _region_name("/".join(path), type(module).__name__)
  spec = transform.region_spec(call, policy, True, (), where, method=True)
  lifted = compat.linen_decorator_lift_transform(
      transform.linen_transform, call, spec=spec)
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
  if not state.seen:
    # A jitted method (nn.jit) replayed its cached trace: no module ran, so
    # this call tells nothing new about the regions.
    return
  model.summary = discovery.summarize(model.name, model.rules is None,
                                      state.regions, state.applications)
  # Raised from the user's init/apply call: contextlib and the wrapper between.
  _report_unmatched(rules, state.matched, state.seen, model.strict,
                    stacklevel=6)


@dataclasses.dataclass
class _Recorded:
  """What one abstract trace of a linen model saw of its modules."""

  seen: dict[Path, str] = dataclasses.field(default_factory=dict)
  flow: discovery.Flow = dataclasses.field(default_factory=discovery.Flow)
  # The first output of each call, by id, and the module that made it first
  # (a container returns its last layer's); the values are kept alive so
  # that an id is not reused during the trace.
  outputs: dict[int, tuple[Path, Any]] = dataclasses.field(
      default_factory=dict)

  def call(self, path: Path, args: Any, out: Any) -> None:
    flow = self.flow
    flow.calls[path] = flow.calls.get(path, 0) + 1
    first = jax.tree_util.tree_leaves(args)[:1]
    if first and id(first[0]) in self.outputs:
      flow.fed_by.setdefault(path, set()).add(self.outputs[id(first[0])][0])
    leaves = jax.tree_util.tree_leaves(out)[:1]
    if leaves:
      maker = self.outputs.setdefault(id(leaves[0]), (path, leaves[0]))[0]
      if maker != path:
        flow.returns[path] = maker


def _record_linen(module: Any, entry: Any, args: tuple, kwargs: dict
                  ) -> _Recorded:
  """Every module the entry call reaches, by path, how many times its
  ``__call__`` ran and what fed it, from one abstract trace
  (``jax.eval_shape``: nothing is computed or allocated)."""
  from flax import linen as nn
  recorded = _Recorded()

  def recorder(next_fun, a, k, ctx):
    if ctx.module.scope is None:
      return next_fun(*a, **k)
    path = tuple(str(p) for p in ctx.module.path)
    recorded.seen.setdefault(path, type(ctx.module).__name__)
    out = next_fun(*a, **k)
    if ctx.method_name == "__call__":
      recorded.call(path, a, out)
    return out

  def trace() -> None:
    # The outputs may hold non-array values eval_shape cannot return.
    with nn.intercept_methods(recorder):
      entry(module, *args, **kwargs)

  token = _discovering.set(True)
  try:
    # A jitted method (nn.jit) traced before would hit its cache and never
    # call the modules behind it, hiding them from the recorder.
    with compat.fresh_trace_key():
      jax.eval_shape(trace)
  except Exception as error:
    error.add_note(
        "(raised while remat_modules traced the model abstractly to find its "
        "repeated blocks; pass rules, e.g. {'Block': None}, to skip that.)")
    raise
  finally:
    _discovering.reset(token)
  return recorded


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
    recorded = _record_linen(module, entry, args, kwargs)
    blocks = discovery.find_blocks(recorded.seen, set(recorded.flow.calls),
                                   recorded.flow)
    if not blocks:
      model.summary = RematSummary(model=model.name, auto=True)
      # Raised from the user's init/apply call: the wrapper is between.
      discovery.report_no_blocks(model.name, recorded.seen, model.strict,
                                 stacklevel=4, calls=recorded.flow.calls)
    model.found[key] = _Rules(tuple(("/".join(p), None) for p in blocks),
                              exact=True) if blocks else None
  return model.found[key]


#: The model ``remat_modules`` is given, returned as the same type.
_Model = TypeVar("_Model")


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

# By (class, "region", where, policy) or (class, "tag", name, True).
_nnx_classes: dict[tuple[type, str, str, Any], type] = {}

# Summaries of the NNX models remat_modules returned, by id, held no longer
# than the models (an attribute would change the model's graph definition,
# and a module need not be hashable).
_nnx_summaries: dict[int, tuple[weakref.ref, RematSummary]] = {}


def _remember_nnx(model: Any, summary: RematSummary) -> None:
  for key in [key for key, (ref, _) in _nnx_summaries.items()
              if ref() is None]:
    del _nnx_summaries[key]
  _nnx_summaries[id(model)] = (weakref.ref(model), summary)


def _nnx_region_class(cls: type, where: str, policy: PolicyLike) -> type:
  key = (cls, "region", where, policy)
  if key not in _nnx_classes:
    spec = transform.region_spec(cls.__call__, policy, True, (), where,
                               method=True)
    call = transform.region_from_spec(cls.__call__, spec)
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
    classes = {path: type(node).__name__ for path, node in modules}
    blocks = discovery.find_blocks(classes)
    if not blocks:
      discovery.report_no_blocks(type(model).__name__, classes, strict,
                                 stacklevel=4)
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
  nnx_paths.name_nnx_modules(model)
  order = {path: i for i, (path, _) in enumerate(modules)}
  _remember_nnx(model, discovery.summarize(
      type(model).__name__, rules is None,
      {"/".join(path): type(node).__name__
       for path, node, _ in sorted(regions, key=lambda r: order[r[0]])}))
  return model


# ---------------------------------------------------------------- public API

def remat_modules(model: _Model, rules: Mapping[str, PolicyLike] | None = None,
                  *, tag_outputs: bool = True, strict: bool = False) -> _Model:
  """Makes every module matched by ``rules``, or every repeated block, one
  remat region.

  Without rules, the blocks are found from the model's module tree: the
  outermost stacks of two or more sibling modules that contain submodules
  and are named by one stem and consecutive indices (``transformer/h/0``,
  ``transformer/h/1`` in Hugging Face GPT-2; ``layers_0``, ``Block_1`` in
  plain Flax; ``encoder/block/0`` and ``decoder/block/0`` in T5: both
  stacks). For linen, discovery follows the block that repeats along the
  depth: the layers of a stack of stages (ResNet's
  ``encoder/stages/0/layers/1``), not a convolutional feature extractor
  before another stack (Wav2Vec2), and a shared layer applied N times
  (ALBERT) when nothing else repeats. Each becomes a region that reads the
  ambient policy (as the rule ``None`` does), and :func:`remat_summary` says
  what was chosen, counting applications. A linen
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
  check_flag("tag_outputs", tag_outputs)
  check_flag("strict", strict)
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

  Example:
    >>> from flax import nnx
    >>> import remat_toolkit as rt
    >>> class Block(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.mlp = nnx.Linear(4, 4, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.mlp(x)
    >>> class Model(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.first, self.second = Block(rngs), Block(rngs)
    ...   def __call__(self, x):
    ...     return self.second(self.first(x))
    >>> model = rt.remat_modules(Model(nnx.Rngs(0)), {"Block": "save-ffn"})
    >>> print(rt.remat_summary(model))
    remat_modules rules matched Block (2 regions: first, second)
  """
  state = getattr(type(model), "_remat_toolkit_model", None)
  if isinstance(state, _LinenModel):
    return state.summary
  entry = _nnx_summaries.get(id(model))
  if entry is not None and entry[0]() is model:
    return entry[1]
  raise TypeError(
      f"remat_summary takes a model returned by rt.remat_modules, got "
      f"{type(model).__name__}; call it on that model (for NNX, the copy "
      f"remat_modules returned, not a later nnx.clone or nnx.merge of it).")
