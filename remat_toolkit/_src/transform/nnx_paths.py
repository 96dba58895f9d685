"""Module paths for NNX: what makes residuals read ``layers/0/attn/query``.

NNX modules do not know where they sit in a model, and unlike linen they
push no name scopes, so nothing in a jaxpr says which module made a value.
A module whose class is a "scoped" subclass (same name, one per class and
path) pushes ``jax.named_scope`` with its attribute path (``layers/0/attn``)
around its methods, as linen does. The path lives in the class, and NNX
records classes in graph definitions, so it survives ``nnx.split`` /
``nnx.merge`` and the copies NNX transforms (``nnx.scan``) make.

:func:`name_nnx_modules` gives a whole model its paths; a remat region whose
modules have none names them by class inside the region
(:func:`region_scopes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["name_nnx_modules", "region_scopes", "path_of"]

_nnx_module_path: contextvars.ContextVar[tuple[str, ...] | None] = (
    contextvars.ContextVar("remat_toolkit_nnx_module_path", default=None))

_scoped_classes: dict[tuple[type, tuple[str, ...]], type | None] = {}


@contextlib.contextmanager
def _module_scope(path: tuple[str, ...], method: str | None = None,
                  root_name: str = "") -> Iterator[None]:
  """The name scope of a call of module ``path``, relative to its caller's."""
  current = _nnx_module_path.get()
  rel = (path[len(current):] if current is not None
         and path[:len(current)] == current else path)
  # The model itself is scoped by its class name, as linen's root is; the
  # analyzer drops that root from every path.
  label = "/".join(rel) or (root_name if current is None else "")
  if label and method:
    label = f"{label}.{method}"  # linen's format: ``embed.attend``
  token = _nnx_module_path.set(path)
  try:
    with jax.named_scope(label) if label else contextlib.nullcontext():
      yield
  finally:
    _nnx_module_path.reset(token)


def _unscoped(cls: type) -> type:
  return cls.__dict__.get("_remat_toolkit_unscoped", cls)


def _scoped_path(node: Any) -> tuple[str, ...] | None:
  return type(node).__dict__.get("_remat_toolkit_path")


def path_of(node: Any) -> tuple[str, ...] | None:
  """The attribute path :func:`name_nnx_modules` gave a module, if any."""
  return _scoped_path(node)


def _scoped_method_names(cls: type) -> list[str]:
  """``__call__`` and the public methods a module class adds to nnx.Module."""
  from flax import nnx
  names: list[str] = []
  for klass in cls.__mro__:
    for name, value in vars(klass).items():
      if name in names or not callable(value) or isinstance(value, type):
        continue
      if name == "__call__" or (
          not name.startswith("_") and inspect.isfunction(value)
          and not hasattr(nnx.Module, name)):
        names.append(name)
  return names


def _scoped_method(method: Callable[..., Any], path: tuple[str, ...],
                   name: str, class_name: str) -> Callable[..., Any]:
  @functools.wraps(method)
  def scoped(self, *args, **kwargs):
    with _module_scope(path, None if name == "__call__" else name,
                       class_name):
      return method(self, *args, **kwargs)
  return scoped


def _scoped_class(cls: type, path: tuple[str, ...]) -> type | None:
  """``cls`` whose methods run in the name scope of ``path`` (None: cannot)."""
  cls = _unscoped(cls)
  key = (cls, path)
  if key not in _scoped_classes:
    namespace: dict[str, Any] = {
        name: _scoped_method(getattr(cls, name), path, name, cls.__name__)
        for name in _scoped_method_names(cls)}
    namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__,
                     _remat_toolkit_path=path, _remat_toolkit_unscoped=cls)
    try:
      # Same name: reprs, errors and auto-generated names do not change.
      _scoped_classes[key] = type(cls.__name__, (cls,), namespace)
    except TypeError:  # a class that refuses subclasses keeps no path
      _scoped_classes[key] = None
  return _scoped_classes[key]


def _scope_graph(node: Any, prefix: tuple[str, ...]
                 ) -> list[tuple[Any, type]]:
  """Gives every module in ``node``'s graph its path; returns the changes."""
  from flax import nnx
  changed = []
  for path, sub in nnx.iter_graph(node):
    if not isinstance(sub, nnx.Module):
      continue
    scoped = _scoped_class(type(sub), prefix + tuple(str(p) for p in path))
    if scoped is not None and scoped is not type(sub):
      changed.append((sub, type(sub)))
      sub.__class__ = scoped
  return changed


def name_nnx_modules(model: Any) -> Any:
  """Makes the analyzer attribute ``model``'s values to its submodules.

  Each module's class becomes a subclass of the same name that pushes the
  module's attribute path (``layers/0/attn``, where linen says
  ``layers_0/attn``) as a ``jax.named_scope`` around its methods, and the
  model's class name around its own (the root the analyzer drops, as for
  linen). Values, what is saved and the compiled program are unchanged; only
  the ops' names carry the path. Modules added later have no path; a module
  called from outside the model is named by its full path.

  ``rt.remat_modules`` and the built-in NNX GPT call it themselves; call it
  on any other NNX model before ``rt.analyze`` to read residuals by module
  path rather than by class (``Block/attn/query``).

  Args:
    model: an NNX Module, changed in place.

  Returns:
    ``model``.

  Raises:
    TypeError: if ``model`` is not an NNX Module instance.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import remat_toolkit as rt
    >>> class Block(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.mlp = nnx.Linear(2, 2, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.mlp(x)
    >>> model = rt.name_nnx_modules(Block(nnx.Rngs(0)))
    >>> {str(e.source_info.name_stack)
    ...  for e in jax.make_jaxpr(model)(jnp.ones((1, 2))).eqns}
    {'Block/mlp'}
  """
  from flax import nnx
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"name_nnx_modules takes an NNX Module instance, got {model!r} of "
        f"type {type(model).__name__}; linen modules are named by Flax "
        "already.")
  _scope_graph(model, ())
  return model


@contextlib.contextmanager
def region_scopes(nodes: Sequence[Any], self_node: Any) -> Iterator[None]:
  """Module paths inside a region whose modules were given none.

  Without the model at hand, a module is named by its class, its submodules
  by their attribute paths below it (``Block/attn/query``). The classes are
  put back before NNX records the region's graph updates.
  """
  changed: list[tuple[Any, type]] = []
  try:
    for node in nodes:
      if _scoped_path(node) is None:
        changed += _scope_graph(node, (type(node).__name__,))
    path = None if self_node is None else _scoped_path(self_node)
    with _module_scope(path) if path is not None else contextlib.nullcontext():
      yield
  finally:
    for sub, cls in reversed(changed):
      sub.__class__ = cls
