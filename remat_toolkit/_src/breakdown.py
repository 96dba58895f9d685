"""Where a training step's memory goes, and whether remat can help.

Remat only trades activation memory for recomputation. When parameters,
gradients or optimizer state take most of the memory, no policy rescues an
out-of-memory error; :func:`memory_breakdown` says which case you are in, and
how far remat could move the activations (``boundary-only`` to
``save-everything``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def layer(w, x):
  ...   return jnp.tanh(x @ w)
  >>> loss = lambda w, x: layer(w, x).sum()
  >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  >>> x = jax.ShapeDtypeStruct((8, 256), jnp.float32)
  >>> b = rt.memory_breakdown(loss, w, x, optimizer="adamw")
  >>> b.param_bytes, b.optimizer_bytes, b.dominant
  (262144, 524292, 'optimizer state')
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from remat_toolkit._src import resolve
from remat_toolkit._src.findings import warn_once
from remat_toolkit._src.format import format_bytes
from remat_toolkit._src.rendered import Rendered
from remat_toolkit._src.resolve import PolicyLike
from remat_toolkit._src.trace import TracedProgram
from remat_toolkit._src.trace import cpu_scheduler_setting

__all__ = ["Breakdown", "memory_breakdown", "OPTIMIZERS", "resolve_optimizer"]

#: Optimizers accepted by name (``optimizer="adamw"``); the learning rate does
#: not change the state's size.
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "adamw": lambda: optax.adamw(1e-3),
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-3),
    "sgd": lambda: optax.sgd(1e-3),
    "momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-3),
}

#: The categories of a breakdown, in display order.
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer state",
                               "activations", "inputs")
_STATE = ("parameters", "gradients", "optimizer state")


def resolve_optimizer(optimizer: Any) -> tuple[Any, str]:
  """An optax ``GradientTransformation`` and a display name.

  Args:
    optimizer: a name from :data:`OPTIMIZERS` or anything with an ``init``
      method (an optax ``GradientTransformation``).

  Raises:
    ValueError: for an unknown name.
    TypeError: for anything else.
  """
  if isinstance(optimizer, str):
    key = optimizer.strip().lower().replace("_", "")
    if key not in OPTIMIZERS:
      raise ValueError(
          f"Unknown optimizer {optimizer!r}; known names are "
          f"{sorted(OPTIMIZERS)}, or pass an optax GradientTransformation.")
    return OPTIMIZERS[key](), key
  if callable(getattr(optimizer, "init", None)):
    cls = type(optimizer)
    # optax's transformations are all one NamedTuple class
    # (GradientTransformationExtraArgs): its name says nothing to a user.
    if cls.__module__.split(".")[0] == "optax":
      return optimizer, "optax optimizer"
    return optimizer, cls.__name__
  raise TypeError(
      f"optimizer must be an optax GradientTransformation or a name such as "
      f"'adamw', got {optimizer!r}.")


def _tree_bytes(tree: Any, *, inexact_only: bool = False) -> int:
  total = 0
  for leaf in jax.tree_util.tree_leaves(tree):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      leaf = np.asarray(leaf)
    dtype = np.dtype(leaf.dtype)
    # jnp.issubdtype knows bfloat16 and the float8 types are floating.
    if inexact_only and not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
      continue
    total += int(np.prod(leaf.shape, dtype=np.int64)) * dtype.itemsize
  return total


@dataclasses.dataclass(frozen=True)
class Breakdown(Rendered):
  """Bytes per category of one training step, and what remat can change.

  Attributes:
    param_bytes: the parameters (``fn``'s first argument).
    grad_bytes: their gradients (floating-point leaves only).
    optimizer_bytes: the optimizer state (0 without an optimizer).
    activation_bytes: activations kept on device for the backward pass under
      ``policy``.
    offloaded_bytes: activations moved to host memory under ``policy``.
    input_bytes: the batch (``fn``'s other arguments).
    boundary_only_bytes: activations under ``boundary-only``: the least remat
      keeps.
    save_everything_bytes: activations under ``save-everything``: no remat.
    recompute_percent: recompute FLOPs of ``policy``, in percent of a
      no-remat step.
    policy: the analysed policy's name.
    optimizer: the optimizer's name (None without one).
    remat_regions: remat regions that read the ambient policy.
    xla_temp_bytes: XLA's temporary buffer size for ``jit(grad(fn))`` under
      ``policy`` (only with ``compile=True``).
    xla_note: the backend (and CPU scheduler) that figure was taken with.
    warnings: why the activations may not be the policy's own (see
      :func:`remat_toolkit._src.findings.policy_warnings`).
  """

  param_bytes: int
  grad_bytes: int
  optimizer_bytes: int
  activation_bytes: int
  offloaded_bytes: int
  input_bytes: int
  boundary_only_bytes: int
  save_everything_bytes: int
  recompute_percent: float
  policy: str
  optimizer: str | None
  remat_regions: int
  xla_temp_bytes: int | None = None
  xla_note: str = ""
  warnings: tuple[str, ...] = ()

  # ------------------------------------------------------------ totals
  def categories(self) -> dict[str, int]:
    """Bytes per category, in :data:`CATEGORIES` order."""
    return dict(zip(CATEGORIES, (self.param_bytes, self.grad_bytes,
                                 self.optimizer_bytes, self.activation_bytes,
                                 self.input_bytes), strict=True))

  @property
  def total_bytes(self) -> int:
    """Device bytes held at the start of the backward pass (XLA's
    temporaries come on top)."""
    return sum(self.categories().values())

  @property
  def state_bytes(self) -> int:
    """Parameters, gradients and optimizer state: what remat cannot touch."""
    return self.param_bytes + self.grad_bytes + self.optimizer_bytes

  @property
  def dominant(self) -> str:
    """The largest category (ties go to the first in display order)."""
    cats = self.categories()
    return max(CATEGORIES, key=lambda c: (cats[c], -CATEGORIES.index(c)))

  @property
  def remat_helps(self) -> bool:
    """Whether activations are the largest category, so remat is the tool."""
    return self.dominant == "activations"

  def total_with(self, activation_bytes: int) -> int:
    """The total if activations took ``activation_bytes`` instead."""
    return self.total_bytes - self.activation_bytes + activation_bytes

  @property
  def verdict(self) -> str:
    """One paragraph: is remat the right tool for this step's memory?"""
    lo, hi = self.boundary_only_bytes, self.save_everything_bytes
    span = (f"Remat moves activations between {format_bytes(lo)} "
            f"(boundary-only) and {format_bytes(hi)} (save-everything), "
            f"a total of {format_bytes(self.total_with(lo))} to "
            f"{format_bytes(self.total_with(hi))}.")
    if self.remat_regions == 0:
      return ("fn has no remat region that reads the ambient policy, so no "
              "policy changes its memory; wrap its blocks with "
              "remat_toolkit.remat to let remat help.")
    if self.dominant in _STATE:
      share = 100.0 * self.state_bytes / max(self.total_bytes, 1)
      verb = "dominates" if self.dominant == "optimizer state" else "dominate"
      return (f"The {self.dominant} {verb}: "
              f"parameters, gradients and optimizer state take "
              f"{format_bytes(self.state_bytes)} ({share:.0f}% of the total). "
              "Remat cannot rescue an out-of-memory error caused mainly by "
              "optimizer state or model parameters; shard them (FSDP/ZeRO), "
              "use a lighter optimizer or a lower precision. " + span)
    if self.dominant == "activations":
      return ("Activations dominate, so remat is the right tool. " + span
              + " `remat-toolkit plan --budget SIZE` finds the policy with "
              "the least recompute for a budget.")
    return ("The inputs dominate; remat does not change them. " + span)

  # ------------------------------------------------------------ display
  def rows(self) -> list[dict[str, Any]]:
    """One record per category (the table's data)."""
    total = max(self.total_bytes, 1)
    notes = {
        "parameters": "held for the whole step",
        "gradients": "one per floating-point parameter",
        "optimizer state": self.optimizer or "no optimizer given",
        "activations": f"kept for backward under {self.policy}"
                       + (f"; {format_bytes(self.offloaded_bytes)} more on host"
                          if self.offloaded_bytes else ""),
        "inputs": "the batch",
    }
    return [{"category": c, "bytes": b, "share": 100.0 * b / total,
             "note": notes[c]} for c, b in self.categories().items()]

  def summary_lines(self) -> list[str]:
    """The headline figures and warnings, one line each."""
    from remat_toolkit._src import display
    return display.breakdown_summary(self)

  def to_dict(self) -> dict[str, Any]:
    """Plain data: every field, the totals, the dominant category, the verdict."""
    out = dataclasses.asdict(self)
    out["warnings"] = list(self.warnings)
    out.update(total_bytes=self.total_bytes, dominant=self.dominant,
               remat_helps=self.remat_helps, verdict=self.verdict)
    return out

  def to_json(self, **kwargs: Any) -> str:
    """:meth:`to_dict` as JSON."""
    return json.dumps(self.to_dict(), **kwargs)


def memory_breakdown(fn: Callable[..., Any], params: Any, *batch: Any,
                     optimizer: Any = None,
                     policy: PolicyLike = None,
                     compile: bool = False) -> Breakdown:
  """Bytes of parameters, gradients, optimizer state and activations.

  The model is traced once (nothing is allocated: pass
  ``jax.ShapeDtypeStruct`` leaves or ``jax.eval_shape`` results); the same
  trace gives the activations under ``policy``, ``boundary-only`` and
  ``save-everything``.

  Args:
    fn: ``fn(params, *batch)`` returns a scalar loss.
    params: the parameters (gradients are taken of its floating leaves).
    *batch: the other arguments.
    optimizer: an optax ``GradientTransformation`` or a name from
      :data:`OPTIMIZERS` (e.g. ``"adamw"``); its state's size comes from
      ``jax.eval_shape(optimizer.init, params)``.
    policy: a name, a :class:`Policy`, a raw ``jax.checkpoint_policies``
      policy, or None for the ambient policy.
    compile: also compile ``jit(grad(fn))`` for XLA's temporary bytes (slow).

  Returns:
    A :class:`Breakdown` (its ``warnings``, each raised once as a
    ``UserWarning``, are those of :func:`remat_toolkit.analyze`).

  Raises:
    ValueError: unknown policy or optimizer name, an offloading policy this
      JAX cannot run now (under ``jax_remat3``), non-scalar loss.
    TypeError: a policy of the wrong type, a non-array argument, an
      optimizer without ``init``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @rt.remat
    ... def layer(w, x):
    ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
    >>> loss = lambda w, x: layer(w, x).sum()
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> b = rt.memory_breakdown(loss, w, x, optimizer="sgd", policy="save-ffn")
    >>> b.param_bytes, b.activation_bytes, b.boundary_only_bytes
    (256, 128, 0)
  """
  resolved = resolve.require_runnable(resolve.resolve_policy(policy))
  opt, opt_name = (None, None) if optimizer is None else resolve_optimizer(optimizer)
  program = TracedProgram(fn, (params, *batch))
  report = program.report(resolved, compile=compile)
  # The range remat spans is the built-in constants', whatever the
  # catalogue holds under their names.
  least = program.report(resolve.BOUNDARY_ONLY).activation_bytes
  most = program.report(resolve.SAVE_EVERYTHING).activation_bytes
  opt_bytes = 0
  if opt is not None:
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    opt_bytes = _tree_bytes(jax.eval_shape(opt.init, abstract))
  xla_temp, note = None, ""
  if compile and report.xla:
    xla_temp = int(report.xla["temp_bytes"])
    note = report.xla.get("backend", "")
    if note == "cpu":
      note = f"cpu, {cpu_scheduler_setting()}"
  result = Breakdown(
      param_bytes=_tree_bytes(params),
      grad_bytes=_tree_bytes(params, inexact_only=True),
      optimizer_bytes=opt_bytes,
      activation_bytes=report.activation_bytes,
      offloaded_bytes=report.offloaded_bytes,
      input_bytes=_tree_bytes(batch),
      boundary_only_bytes=least,
      save_everything_bytes=most,
      recompute_percent=report.recompute_percent,
      policy=resolved.name, optimizer=opt_name,
      remat_regions=program.regions, xla_temp_bytes=xla_temp, xla_note=note,
      warnings=report.warnings)
  warn_once(result.warnings)
  return result
