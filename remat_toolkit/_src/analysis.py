"""The residual analyzer: what a policy keeps for the backward pass, and its cost.

The model is traced once. Every remat region that reads the ambient policy is
then given each policy in turn inside the traced program, so comparing many
policies re-traces no Python code.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> @rt.remat
  ... def block(w, x):
  ...   return jnp.tanh(rt.tag(x @ w, "ffn.up"))
  >>> loss = lambda w, x: block(w, x).sum()
  >>> args = (jax.ShapeDtypeStruct((8, 8), jnp.float32),
  ...         jax.ShapeDtypeStruct((4, 8), jnp.float32))
  >>> rt.analyze(loss, *args, policy="save-ffn").activation_bytes
  128
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import html
import json
import os
import warnings as _warnings
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from remat_toolkit._src import catalog
from remat_toolkit._src import compat as compat
from remat_toolkit._src import context
from remat_toolkit._src import jaxpr as _jaxpr
from remat_toolkit._src import lowering
from remat_toolkit._src import residuals as _residuals
from remat_toolkit._src.format import format_bytes
from remat_toolkit._src.format import format_flops
from remat_toolkit._src.format import html_table
from remat_toolkit._src.format import text_table
from remat_toolkit._src.format import warnings_html
from remat_toolkit._src.policy import Policy

__all__ = ["Residual", "ResidualReport", "analyze", "compare", "Comparison",
           "TracedProgram", "policy_warnings", "quiet_warnings"]

_BASELINE = "save-everything"


@dataclasses.dataclass(frozen=True)
class Residual:
  """One value kept from the forward pass for the backward pass.

  Attributes:
    shape: the stored shape (a scan-stacked residual includes its scan axis).
    dtype: dtype name.
    nbytes: bytes held, every scan iteration included.
    kind: ``"argument"`` (a parameter or input, held anyway) or
      ``"activation"`` (kept only for the backward pass).
    name: its checkpoint name, if it has one (also inside scan bodies).
    module_path: where in the model it was made, e.g. ``layers_3/attn``.
    primitive: the primitive that computed it.
    source: ``file:line (function)`` of the code that made it.
    memory_kind: ``"device"`` or ``"host"`` (offloaded).
    stacked: the scan length it is stacked over (1 outside scans).
    label: for arguments, the pytree path of the argument leaf.
  """

  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  kind: str
  name: str | None
  module_path: str
  primitive: str
  source: str
  memory_kind: str
  stacked: int = 1
  label: str = ""

  @property
  def what(self) -> str:
    """A short description: the name, else the primitive or argument path."""
    if self.kind == "argument":
      return self.label or "argument"
    return self.name or f"<{self.primitive}>"


def _group(residuals: Iterable[Residual], key: Callable[[Residual], str]
           ) -> dict[str, int]:
  out: dict[str, int] = defaultdict(int)
  for r in residuals:
    out[key(r)] += r.nbytes
  return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


@dataclasses.dataclass(frozen=True)
class ResidualReport:
  """What one policy keeps, where, how many bytes, and what it recomputes.

  Attributes:
    policy: the policy's name.
    residuals: every residual, arguments included.
    forward_flops: matmul/conv FLOPs of the forward pass.
    backward_flops: matmul/conv FLOPs of the backward pass, recompute included.
    recompute_flops: FLOPs this policy adds over the same step without remat.
    baseline_step_flops: forward + backward FLOPs of a step without remat.
    remat_regions: remat regions that took this policy.
    xla: XLA ``memory_analysis()`` figures when analysed with ``compile=True``.
    devices: number of devices the arguments are sharded over (1 if none).
    per_device_activation_bytes: activation bytes held by one device, when
      the arguments carry shardings.
    warnings: why the figures may not be this policy's own: no region reads
      it, regions with their own policy ignore it, or it keeps none of its
      names in this model (see :func:`policy_warnings`).
  """

  policy: str
  residuals: tuple[Residual, ...]
  forward_flops: int
  backward_flops: int
  recompute_flops: int
  baseline_step_flops: int
  remat_regions: int
  xla: Mapping[str, Any] | None = None
  devices: int = 1
  per_device_activation_bytes: int | None = None
  warnings: tuple[str, ...] = ()

  # ------------------------------------------------------------ totals
  @property
  def activations(self) -> tuple[Residual, ...]:
    return tuple(r for r in self.residuals if r.kind == "activation")

  @property
  def activation_bytes(self) -> int:
    """Activation bytes kept in device memory."""
    return sum(r.nbytes for r in self.activations if r.memory_kind == "device")

  @property
  def offloaded_bytes(self) -> int:
    """Activation bytes moved to host memory."""
    return sum(r.nbytes for r in self.activations if r.memory_kind == "host")

  @property
  def argument_bytes(self) -> int:
    """Bytes of arguments (parameters, inputs) the backward pass reads."""
    return sum(r.nbytes for r in self.residuals if r.kind == "argument")

  @property
  def activation_bytes_per_device(self) -> int:
    """Device activation bytes on one device (total when unsharded)."""
    if self.per_device_activation_bytes is None:
      return self.activation_bytes
    return self.per_device_activation_bytes

  @property
  def recompute_percent(self) -> float:
    """Recompute FLOPs as a percentage of a no-remat training step."""
    if not self.baseline_step_flops:
      return 0.0
    return 100.0 * self.recompute_flops / self.baseline_step_flops

  # ------------------------------------------------------------ groupings
  def by_module(self, depth: int | None = 1, *, kind: str = "activation"
                ) -> dict[str, int]:
    """Bytes per module-path prefix of ``depth`` components (None: full)."""
    def key(r):
      parts = [p for p in r.module_path.split("/") if p]
      return "/".join(parts[:depth] if depth else parts) or "(top level)"
    return _group((r for r in self.residuals if r.kind == kind), key)

  def by_name(self, *, kind: str = "activation") -> dict[str, int]:
    """Bytes per checkpoint name (unnamed residuals by ``<primitive>``)."""
    return _group((r for r in self.residuals if r.kind == kind),
                  lambda r: r.what)

  def by_primitive(self, *, kind: str = "activation") -> dict[str, int]:
    """Bytes per producing primitive."""
    return _group((r for r in self.residuals if r.kind == kind),
                  lambda r: r.primitive)

  # ------------------------------------------------------------ display
  def __repr__(self) -> str:
    return (f"ResidualReport(policy={self.policy!r}, "
            f"residuals={len(self.residuals)}, "
            f"activation_bytes={self.activation_bytes}, "
            f"offloaded_bytes={self.offloaded_bytes}, "
            f"recompute_flops={self.recompute_flops}"
            + (f", warnings={len(self.warnings)}" if self.warnings else "")
            + ")")

  def summary_lines(self) -> list[str]:
    lines = [
        f"policy {self.policy}: {len(self.activations)} activation residuals, "
        f"{format_bytes(self.activation_bytes)} on device"
        + (f", {format_bytes(self.offloaded_bytes)} offloaded to host"
           if self.offloaded_bytes else "")
        + f"; arguments held for backward {format_bytes(self.argument_bytes)}",
        f"FLOPs: forward {format_flops(self.forward_flops)}, backward "
        f"{format_flops(self.backward_flops)}, recompute "
        f"{format_flops(self.recompute_flops)} "
        f"({self.recompute_percent:.1f}% of a no-remat step)",
    ]
    if self.per_device_activation_bytes is not None:
      lines.append(f"per device ({self.devices} devices): "
                   f"{format_bytes(self.per_device_activation_bytes)} activations")
    if self.xla:
      lines.append("XLA: " + ", ".join(
          f"{k} {format_bytes(v) if isinstance(v, int) else v}"
          for k, v in self.xla.items()))
    lines.extend(f"warning: {w}" for w in self.warnings)
    return lines

  def table(self, *, depth: int | None = 2, limit: int = 40) -> str:
    """Per-module, per-name table of activation residuals."""
    rows: dict[tuple[str, str], list] = {}
    for r in self.activations:
      parts = [p for p in r.module_path.split("/") if p]
      module = "/".join(parts[:depth] if depth else parts) or "(top level)"
      row = rows.setdefault((module, r.what), [0, 0, r.memory_kind, r.stacked])
      row[0] += 1
      row[1] += r.nbytes
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][1])
    total = max(self.activation_bytes + self.offloaded_bytes, 1)
    body = [[m, w, n, format_bytes(b), f"{100 * b / total:.1f}%", mk,
             s if s > 1 else ""]
            for (m, w), (n, b, mk, s) in ordered[:limit]]
    if len(ordered) > limit:
      rest = sum(v[1] for _, v in ordered[limit:])
      body.append(["...", f"{len(ordered) - limit} more", "",
                   format_bytes(rest), f"{100 * rest / total:.1f}%", "", ""])
    return text_table(["module", "residual", "count", "bytes", "share",
                       "memory", "stacked"], body,
                      right=[False, False, True, True, True, False, True])

  def __str__(self) -> str:
    return "\n".join(self.summary_lines() + ["", self.table()])

  def _repr_html_(self) -> str:
    summary = "<br>".join(html.escape(line, quote=False)
                          for line in self.summary_lines())
    modules = html_table(["module", "bytes"], [
        [m, format_bytes(b)] for m, b in self.by_module(depth=2).items()],
        caption="Activation bytes by module")
    names = html_table(["residual", "bytes"], [
        [n, format_bytes(b)] for n, b in self.by_name().items()],
        caption="Activation bytes by name")
    return (f"<div><p style='font-family:monospace'>{summary}</p>"
            f"<div style='display:flex;gap:2em'>{modules}{names}</div></div>")

  def to_dict(self) -> dict[str, Any]:
    """Plain data: totals, FLOPs and one entry per residual."""
    return {
        "policy": self.policy,
        "activation_bytes": self.activation_bytes,
        "offloaded_bytes": self.offloaded_bytes,
        "argument_bytes": self.argument_bytes,
        "activation_bytes_per_device": self.activation_bytes_per_device,
        "devices": self.devices,
        "forward_flops": self.forward_flops,
        "backward_flops": self.backward_flops,
        "recompute_flops": self.recompute_flops,
        "recompute_percent": self.recompute_percent,
        "remat_regions": self.remat_regions,
        "xla": dict(self.xla) if self.xla else None,
        "warnings": list(self.warnings),
        "residuals": [dataclasses.asdict(r) for r in self.residuals],
    }

  def to_json(self, **kwargs: Any) -> str:
    """:meth:`to_dict` as JSON."""
    return json.dumps(self.to_dict(), **kwargs)

  def to_dataframe(self):
    """One row per residual (needs pandas)."""
    pd = _require("pandas", "to_dataframe")
    return pd.DataFrame([dataclasses.asdict(r) for r in self.residuals])


def _require(module: str, what: str):
  try:
    return __import__(module)
  except ImportError:
    raise ImportError(
        f"{what} needs {module}; install it with "
        f"`pip install 'remat-toolkit[display]'`.") from None


# ==================================================================== engine

class TracedProgram:
  """A loss function traced once, analysable under any policy.

  Args:
    fn: returns a scalar loss.
    args: its arguments: arrays, ``jax.ShapeDtypeStruct`` or pytrees of them.

  Raises:
    TypeError: if ``fn`` is not callable or an argument leaf is not an array.
    ValueError: if ``fn`` does not return a scalar, or no argument is a
      floating-point array (nothing to differentiate).
  """

  def __init__(self, fn: Callable[..., Any], args: Sequence[Any]):
    if not callable(fn):
      raise TypeError(f"fn must be a callable returning a scalar loss, got {fn!r}.")
    leaves, self._treedef = jax.tree_util.tree_flatten(args)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(args)[0]]
    self._leaves = [_as_abstract(x, p) for x, p in zip(leaves, paths, strict=True)]
    if not any(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
               for x in self._leaves):
      raise ValueError(
          "No argument of fn is a floating-point array, so there is nothing to "
          "differentiate and no residual to analyse; pass the parameters "
          "(e.g. analyze(loss, params, batch)).")
    self._paths = paths
    self._marker = compat.policy_marker("ambient_region")
    treedef = self._treedef

    def flat_fn(*xs):
      return fn(*jax.tree_util.tree_unflatten(treedef, xs))

    with lowering.substitute_ambient(self._marker):
      try:
        closed, out_shape = _jaxpr.trace_program(flat_fn, self._leaves)
      except (TypeError, ValueError):
        raise
    out_leaves = jax.tree_util.tree_leaves(out_shape)
    if (len(out_leaves) != 1 or out_leaves[0].shape != ()
        or not jax.numpy.issubdtype(out_leaves[0].dtype, jax.numpy.inexact)):
      raise ValueError(
          f"fn must return a scalar floating-point loss, got "
          f"{jax.tree_util.tree_map(lambda s: f'{s.dtype}{list(s.shape)}', out_shape)}; "
          "reduce it, e.g. return loss.mean().")
    self.jaxpr = closed.replace(jaxpr=_jaxpr.share_identical_regions(
        closed.jaxpr, self._marker))
    self.regions = _jaxpr.count_remat_regions(closed.jaxpr, self._marker)
    self.forward_flops = _jaxpr.count_matmul_flops(closed.jaxpr)
    self._root = _root_scope(closed.jaxpr)
    self._region_names = _region_name_sets(closed.jaxpr, self._marker)
    self._own_regions: list[tuple[str, str]] | None = None
    self._steps: dict[Any, tuple[Any, int]] = {}
    self._baseline_flops: int | None = None

  @property
  def names(self) -> frozenset[str]:
    """Checkpoint names present anywhere in the program."""
    return _jaxpr.names_in(self.jaxpr.jaxpr)

  @property
  def ambient_names(self) -> frozenset[str]:
    """Checkpoint names inside the regions that read the ambient policy."""
    return frozenset().union(*self._region_names)

  @property
  def own_policy_regions(self) -> list[tuple[str, str]]:
    """``(where, policy)`` of each remat region that has its own policy."""
    if self._own_regions is None:
      self._own_regions = _own_policy_regions(self.jaxpr.jaxpr, self._marker,
                                              self._root)
    return self._own_regions

  def lowered(self, policy: Policy) -> tuple[Any, ...]:
    """The JAX policy each distinct region name-set gets under ``policy``."""
    return tuple(policy.to_jax(names) for names in self._region_names)

  def _substituted(self, policy: Policy):
    mapping = dict(zip(self._region_names, self.lowered(policy), strict=True))
    return _jaxpr.substitute_policy(
        self.jaxpr.jaxpr, self._marker, lambda names: mapping[names])

  def step(self, policy: Policy) -> _residuals.TracedStep:
    """The traced training step under ``policy`` (cached per lowering)."""
    key = self.lowered(policy)
    if key not in self._steps:
      jaxpr = self._substituted(policy)
      try:
        self._steps[key] = _residuals.trace_training_step(
            jaxpr, self.jaxpr.consts, self._leaves, self.forward_flops)
      except NotImplementedError as e:
        # JAX's remat refuses some effects (io_callback) inside a region.
        sites = _jaxpr.effects_in_remat_regions(self.jaxpr.jaxpr)
        if not sites:
          raise
        where = ", ".join(f"{s.primitive} at {s.source or s.module_path or '?'}"
                          for s in sites)
        raise ValueError(
            f"fn cannot be differentiated: JAX refuses effects inside a remat "
            f"region ({e}); found {where}. Move the callback out of the remat "
            "region, or make it a jax.debug.callback.") from None
    return self._steps[key]

  @property
  def baseline_step_flops(self) -> int:
    """Forward + backward FLOPs of a step with the ambient regions removed."""
    if self._baseline_flops is None:
      if compat.remat3_enabled():
        # jax 0.10's remat3 everything_saveable recomputes un-named values.
        jaxpr = _jaxpr.inline_regions(self.jaxpr.jaxpr, self._marker)
        step = _residuals.trace_training_step(jaxpr, self.jaxpr.consts,
                                             self._leaves, self.forward_flops)
      else:
        step = self.step(catalog.get_policy(_BASELINE))
      self._baseline_flops = self.forward_flops + step.backward_flops
    return self._baseline_flops

  def residuals(self, policy: Policy) -> list[Residual]:
    step = self.step(policy)
    origins = _residuals.residual_origins(step.jaxpr, 1, step.num_residuals)
    return [self._residual(o) for o in origins]

  def _residual(self, o: _residuals.ResidualOrigin) -> Residual:
    label = ""
    path = o.module_path
    if o.kind == "argument":
      if o.arg_index is not None:
        label = self._paths[o.arg_index]
        path = _path_from_label(label)
      else:
        label = "constant"
    elif self._root:
      path = _strip_root(path, self._root)
    return Residual(
        shape=tuple(int(d) for d in o.aval.shape), dtype=str(o.aval.dtype),
        nbytes=_residuals.aval_nbytes(o.aval), kind=o.kind, name=o.name,
        module_path=path, primitive=o.primitive, source=o.source,
        memory_kind=o.memory_kind, stacked=o.stacked, label=label)

  def report(self, policy: Policy, *, compile: bool = False) -> ResidualReport:
    """The :class:`ResidualReport` of ``policy`` on this program."""
    residuals = tuple(self.residuals(policy))
    step = self.step(policy)
    base = self.baseline_step_flops
    total = self.forward_flops + step.backward_flops
    devices, per_device = _per_device(residuals, self._leaves, step)
    return ResidualReport(
        policy=policy.name, residuals=residuals,
        forward_flops=self.forward_flops,
        backward_flops=step.backward_flops,
        recompute_flops=max(total - base, 0), baseline_step_flops=base,
        remat_regions=self.regions,
        xla=self.xla_memory(policy) if compile else None,
        devices=devices, per_device_activation_bytes=per_device,
        warnings=tuple(policy_warnings(self, policy)))

  def xla_memory(self, policy: Policy) -> dict[str, Any]:
    """XLA's ``memory_analysis()`` of ``jit(grad(fn))`` under ``policy``."""
    jaxpr = self._substituted(policy)
    consts = self.jaxpr.consts
    diff = tuple(i for i, x in enumerate(self._leaves)
                 if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))

    def loss(*xs):
      return compat.eval_jaxpr(jaxpr, consts, *xs)[0]

    compiled = jax.jit(jax.grad(loss, argnums=diff)).lower(*self._leaves).compile()
    stats = compiled.memory_analysis()
    out: dict[str, Any] = {
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
    }
    host_temp = getattr(stats, "host_temp_size_in_bytes", 0)
    if host_temp:
      out["host_temp_bytes"] = int(host_temp)
    out["backend"] = jax.default_backend()
    if jax.default_backend() == "cpu":
      out["scheduler"] = cpu_scheduler_setting()
    return out


def cpu_scheduler_setting() -> str:
  """Which XLA:CPU scheduler compiled figures were taken with."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_cpu_enable_concurrency_optimized_scheduler=false" in flags:
    return "concurrency-optimized scheduler off (temp bytes track the policy)"
  return ("concurrency-optimized scheduler on (XLA:CPU default; it keeps buffers "
          "alive, hiding remat's effect; set XLA_FLAGS="
          "--xla_cpu_enable_concurrency_optimized_scheduler=false)")


def _as_abstract(x: Any, path: str) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and sharding is not None and len(
        getattr(sharding, "device_set", ())) > 1:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
  if isinstance(x, (bool, int, float, complex)):
    return jax.ShapeDtypeStruct((), np.asarray(x).dtype)
  raise TypeError(
      f"Argument leaf {path or '(root)'} is {x!r} of type {type(x).__name__}; "
      "analyze takes arrays or jax.ShapeDtypeStruct leaves (close over other "
      "values in fn, e.g. with functools.partial).")


def _root_scope(jaxpr) -> str:
  """The model's root scope (Flax names it after the class), if all share it."""
  firsts = {_jaxpr.module_path(e).split("/")[0].split(".")[0]
            for e in jaxpr.eqns}
  firsts.discard("")
  return firsts.pop() if len(firsts) == 1 else ""


def _strip_root(path: str, root: str) -> str:
  # Flax names the root scope after the model class, and a transform lifted
  # over a method gets the scope "Root.method": drop the class name in both.
  parts = path.split("/")
  if parts and parts[0] == root:
    parts = parts[1:]
  parts = [p[len(root) + 1:] if p.startswith(root + ".") else p for p in parts]
  # A transform lifted over a method scopes the module's name once more
  # ("Block_0/Block_0"): one module, one path component.
  deduped = [p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]]
  return "/".join(deduped)


def _region_name_sets(jaxpr, marker) -> tuple[frozenset[str], ...]:
  found: list[frozenset[str]] = []

  def record(names):
    if names not in found:
      found.append(names)
    return marker

  _jaxpr.substitute_policy(jaxpr, marker, record)
  return tuple(found)


def _path_from_label(label: str) -> str:
  keys = [k.strip("'\"") for k in label.replace("]", "").split("[") if k]
  keys = [k for k in keys[1:] if k not in ("params", "'params'")]
  return "/".join(keys[:-1])


def _per_device(residuals, leaves, step) -> tuple[int, int | None]:
  # The residuals' shardings are read from the traced step compiled with the
  # arguments' shardings (see sharding.py); unsharded programs skip that.
  from remat_toolkit._src import sharding as _sharding
  return _sharding.per_device_activation_bytes(residuals, leaves, step)


# ============================================================ never silent
#
# A result whose figures are not the asked policy's own says so: in its
# ``warnings`` field, in its text and HTML, and once as a UserWarning. The
# detection lives here so that every entry point (and verify) words it alike.

_KEEPS_NONE = "keeps none of its names in this model"
_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remat_toolkit_quiet_result_warnings", default=False)


def _brief(items: Sequence[str], limit: int) -> str:
  shown = ", ".join(repr(i) for i in items[:limit])
  more = len(items) - limit
  return shown + (f" and {more} more" if more > 0 else "")


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


def _own_policy_regions(jaxpr, marker, root: str) -> list[tuple[str, str]]:
  found = []
  for eqn in _jaxpr.walk(jaxpr):
    if not compat.is_remat(eqn) or compat.remat_policy_of(eqn) is marker:
      continue
    path = _jaxpr.module_path(eqn)
    path = _strip_root(path, root) if root else path
    where = path or _jaxpr.source_of(eqn) or "the top level"
    names = _jaxpr.names_in(compat.remat_body_of(eqn))
    found.append((where, _policy_label(compat.remat_policy_of(eqn), names)))
  return found


def _own_policy_text(regions: Sequence[tuple[str, str]], limit: int = 3) -> str:
  by_policy: dict[str, list[str]] = {}
  for where, label in regions:
    by_policy.setdefault(label, []).append(where)
  parts = []
  for label, wheres in by_policy.items():
    sites = list(dict.fromkeys(wheres))
    shown = ", ".join(sites[:limit]) + (
        f" and {len(sites) - limit} more" if len(sites) > limit else "")
    count = len(wheres)
    parts.append(f"{count} region{'s use' if count > 1 else ' uses'} {label}, "
                 f"at {shown}")
  return "; ".join(parts)


def region_warnings(program: TracedProgram, policy: str | None = None
                    ) -> list[str]:
  """Why ``policy`` (None: any policy asked for) may not shape the figures.

  Covers a function with no remat region, one whose regions all have their
  own policy, and one where only some regions read the ambient policy.
  """
  subject = (f"policy {policy!r} changes nothing" if policy
             else "no policy changes anything")
  own = program.own_policy_regions
  if not program.regions and not own:
    return [f"fn has no remat region at all, so {subject} and nothing is "
            "recomputed; wrap its blocks with remat_toolkit.remat (policy "
            "left as None) or use remat_toolkit.remat_modules."]
  if not program.regions:
    return [f"no remat region in fn reads the ambient policy, so {subject}: "
            f"the figures are those of the regions' own policies; "
            f"{_own_policy_text(own)}. Build the regions with policy left "
            "as None (remat_toolkit.remat, remat_toolkit.remat_modules) so "
            "that they take the policy analysed."]
  if own:
    what = f"policy {policy!r}" if policy else "the policy asked for"
    total = program.regions + len(own)
    verb = "has its own policy and ignores" if len(own) == 1 else (
        "have their own policy and ignore")
    takes = "takes" if program.regions == 1 else "take"
    return [f"{len(own)} of {total} remat regions {verb} {what}: "
            f"{_own_policy_text(own)}; only the other {program.regions} "
            f"{takes} it, so the figures mix policies. Build those regions "
            "with policy left as None to let them take it."]
  return []


def unmatched_names_warning(program: TracedProgram, policy: Any) -> str | None:
  """Says so when a name-based policy matches no name its regions hold.

  Such a policy keeps only the region inputs, as ``boundary-only`` does,
  whatever its name promises. Policies that select by something else
  (matmuls, everything) are never flagged.
  """
  if (not isinstance(policy, Policy) or not program.regions
      or policy.save_everything or policy.matmuls != "none"
      or not policy.patterns):
    return None
  present = sorted(program.ambient_names)
  if any(policy.matches(n) for n in present):
    return None
  held = (f"hold {_brief(present, 6)}" if present
          else "hold no checkpoint names")
  return (f"policy {policy.name!r} {_KEEPS_NONE}: it "
          f"asks for {_brief(list(policy.patterns), 4)}, but the regions that "
          f"take it {held}, so it keeps only the region inputs, as "
          "boundary-only does. Tag the tensors to keep with "
          "remat_toolkit.tag(x, name), or choose a policy whose names exist "
          "(remat_toolkit.list_policies()).")


def policy_warnings(program: TracedProgram, policy: Any, *,
                    asked: bool = True) -> list[str]:
  """Every reason the figures of ``policy`` on ``program`` may mislead.

  Args:
    program: the traced function.
    policy: a :class:`Policy` or anything with a ``name``.
    asked: False when the caller did not choose the policy (the function is
      examined as it is): regions with their own policy are then expected.
  """
  name = getattr(policy, "name", None)
  found = []
  if asked or not (program.regions or program.own_policy_regions):
    found.extend(region_warnings(program, name))
  unmatched = unmatched_names_warning(program, policy)
  if unmatched:
    found.append(unmatched)
  return found


def warn_once(messages: Iterable[str], stacklevel: int = 3) -> None:
  """Raises each of a new result's warnings once, as a UserWarning.

  ``stacklevel`` 3 points at the caller of the public function that calls
  this. Nothing is raised inside :func:`quiet_warnings`.
  """
  if _quiet.get():
    return
  for message in dict.fromkeys(messages):
    _warnings.warn(message, UserWarning, stacklevel=stacklevel)


@contextlib.contextmanager
def quiet_warnings():
  """Results made inside still carry their warnings but raise none.

  For callers that show the results themselves (the command line), and for
  entry points built on others, so that one call raises one set.
  """
  token = _quiet.set(True)
  try:
    yield
  finally:
    _quiet.reset(token)


@contextlib.contextmanager
def trace_time_name_warnings_silenced(active: bool = True):
  """Hides the trace-time "names absent" warning while a result reports it.

  ``rt.remat`` regions warn when traced under a policy whose names are
  absent (context.warn_if_unmatched); a result that already carries the
  same finding raises it once, not twice.
  """
  if not active:
    yield
    return
  with _warnings.catch_warnings():
    _warnings.filterwarnings(
        "ignore", message=r"Policy .* but none of them is present",
        category=UserWarning)
    yield


# ==================================================================== API

def _resolve_policy(policy: str | Policy | None) -> Policy:
  if policy is None:
    return context.current_policy()
  if not isinstance(policy, (str, Policy)):
    raise TypeError(
        f"policy must be a policy name or remat_toolkit.Policy, got {policy!r}; "
        "e.g. policy='save-attention' (see remat_toolkit.list_policies()).")
  return catalog.get_policy(policy)


def analyze(fn: Callable[..., Any], *args: Any,
            policy: str | Policy | None = None,
            compile: bool = False) -> ResidualReport:
  """Which residuals ``fn``'s backward pass keeps under ``policy``.

  Args:
    fn: returns a scalar loss, e.g. ``loss(params, batch)``; its remat regions
      built with ``policy=None`` take the analysed policy.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees (nothing is allocated).
    policy: a name or :class:`Policy`; default: the ambient policy.
    compile: also lower ``jit(grad(fn))`` and add XLA's memory analysis.

  Returns:
    A :class:`ResidualReport`; its ``warnings`` say when the figures are not
    the policy's own (each is also raised once as a ``UserWarning``).

  Raises:
    ValueError: unknown policy name, non-scalar loss, no float argument.
    TypeError: a policy that is not a name/Policy, or a non-array argument.
  """
  resolved = _resolve_policy(policy)
  report = TracedProgram(fn, args).report(resolved, compile=compile)
  warn_once(report.warnings)
  return report


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Every policy's :class:`ResidualReport` on one function, side by side.

  Attributes:
    reports: policy name -> report, in the order compared.
    skipped: policy name -> why it was not analysed (e.g. offloading under
      ``jax_remat3``).
    regions: remat regions that took the compared policies.
    warnings: why some figures may not be the policies' own: said once for
      the function (no region reads the policy, regions with their own
      policy), then once per policy that keeps none of its names.
  """

  reports: Mapping[str, ResidualReport]
  skipped: Mapping[str, str]
  regions: int
  warnings: tuple[str, ...] = ()

  def __repr__(self) -> str:
    return (f"Comparison(policies={list(self.reports)}, "
            f"skipped={list(self.skipped)}, regions={self.regions}"
            + (f", warnings={len(self.warnings)}" if self.warnings else "")
            + ")")

  @property
  def baseline(self) -> ResidualReport | None:
    return self.reports.get(_BASELINE)

  def pareto(self) -> dict[str, bool]:
    """Policies no other policy beats on device bytes, recompute and offload.

    Offloaded bytes count as a cost of their own (host transfers), so an
    offloading policy does not hide the policies that move nothing.
    """
    items = {n: (r.activation_bytes, r.recompute_flops, r.offloaded_bytes)
             for n, r in self.reports.items()}
    return {n: not any(all(o <= v for o, v in zip(other, mine, strict=True))
                       and other != mine for other in items.values())
            for n, mine in items.items()}

  def distinctive(self, name: str, top: int = 2) -> list[str]:
    """The largest residual groups of ``name`` not kept alike by every policy.

    Residuals every compared policy keeps (the loss's softmax, say) say
    nothing about the choice between policies, so they are left out.
    """
    def keys(report):
      counts: dict[tuple, int] = defaultdict(int)
      for r in report.activations:
        counts[(r.what, r.module_path, r.nbytes)] += 1
      return counts

    per_policy = {n: keys(r) for n, r in self.reports.items()}
    common = {k: min(c.get(k, 0) for c in per_policy.values())
              for k in per_policy[name]}
    groups: dict[str, int] = defaultdict(int)
    for (what, _, nbytes), count in per_policy[name].items():
      groups[what] += (count - common[(what, _, nbytes)]) * nbytes
    ranked = sorted((b, w) for w, b in groups.items() if b > 0)
    return [w for _, w in reversed(ranked[-top:])]

  def rows(self) -> list[dict[str, Any]]:
    """One record per policy (the table's data)."""
    base = self.baseline.activation_bytes if self.baseline else None
    pareto = self.pareto()
    rows = []
    for name, r in self.reports.items():
      top = self.distinctive(name)
      rows.append({
          "policy": name,
          "activation_bytes": r.activation_bytes,
          "percent_of_save_everything": (100.0 * r.activation_bytes / base
                                         if base else None),
          "offloaded_bytes": r.offloaded_bytes,
          "recompute_flops": r.recompute_flops,
          "recompute_percent": r.recompute_percent,
          "num_residuals": len(r.activations),
          "largest": top,
          "xla_temp_bytes": (r.xla or {}).get("temp_bytes"),
          "activation_bytes_per_device": r.activation_bytes_per_device,
          "pareto": pareto[name],
          "keeps_none_of_its_names": name in self._silent(),
      })
    return rows

  def _silent(self) -> frozenset[str]:
    """Policies that keep none of their names in this model."""
    return frozenset(n for n, r in self.reports.items()
                     if any(w.startswith(f"policy {n!r} {_KEEPS_NONE}")
                            for w in r.warnings))

  def _table_rows(self) -> tuple[list[str], list[list[str]]]:
    headers = ["policy", "activations", "% of save-everything", "offloaded",
               "recompute", "residuals", "largest", "pareto"]
    has_xla = any(r.xla for r in self.reports.values())
    sharded = any(r.devices > 1 for r in self.reports.values())
    if sharded:
      headers.insert(2, "per device")
    if has_xla:
      headers.insert(len(headers) - 1, "XLA temp")
    body = []
    for row in self.rows():
      mark = " !" if row["keeps_none_of_its_names"] else ""
      line = [row["policy"] + mark, format_bytes(row["activation_bytes"]),
              "" if row["percent_of_save_everything"] is None
              else f"{row['percent_of_save_everything']:.1f}%",
              format_bytes(row["offloaded_bytes"]) if row["offloaded_bytes"] else "-",
              f"{row['recompute_percent']:.1f}%", str(row["num_residuals"]),
              ", ".join(row["largest"]), "*" if row["pareto"] else ""]
      if sharded:
        line.insert(2, format_bytes(row["activation_bytes_per_device"]))
      if has_xla:
        line.insert(len(line) - 1, format_bytes(row["xla_temp_bytes"] or 0))
      body.append(line)
    return headers, body

  def __str__(self) -> str:
    headers, body = self._table_rows()
    right = [h not in ("policy", "largest") for h in headers]
    lines = [text_table(headers, body, right=right)]
    if self.baseline:
      b = self.baseline
      lines.append(
          f"\nforward {format_flops(b.forward_flops)}, no-remat step "
          f"{format_flops(b.baseline_step_flops)} (matmul FLOPs); "
          f"{self.regions} remat regions; largest = biggest residuals this "
          "policy keeps that not every policy keeps; * = Pareto-optimal (no "
          "policy is as good on device bytes, recompute and offload, and "
          "better on one)")
    for name, why in self.skipped.items():
      lines.append(f"skipped {name}: {why}")
    if self._silent():
      lines.append("! = keeps none of its names in this model (see warnings)")
    lines.extend(f"warning: {w}" for w in self.warnings)
    return "\n".join(lines)

  def _repr_html_(self) -> str:
    headers, body = self._table_rows()
    pareto = [row["pareto"] for row in self.rows()]
    notes = "".join(f"<p>skipped {html.escape(n)}: {html.escape(w)}</p>"
                    for n, w in self.skipped.items())
    if self._silent():
      notes += "<p>! = keeps none of its names in this model (see warnings)</p>"
    return (html_table(headers, body,
                       caption="Policies compared (bold: Pareto-optimal)",
                       highlight=pareto) + notes + warnings_html(self.warnings))

  def to_dict(self) -> dict[str, Any]:
    return {"rows": self.rows(), "skipped": dict(self.skipped),
            "regions": self.regions, "warnings": list(self.warnings)}

  def to_json(self, **kwargs: Any) -> str:
    return json.dumps(self.to_dict(), **kwargs)

  def to_dataframe(self):
    """One row per policy (needs pandas)."""
    pd = _require("pandas", "to_dataframe")
    return pd.DataFrame(self.rows())

  def plot(self, ax=None):
    """Memory vs recompute scatter, Pareto front joined (needs matplotlib)."""
    _require("matplotlib", "plot")
    import matplotlib.pyplot as plt
    if ax is None:
      _, ax = plt.subplots(figsize=(7, 4.5))
    rows = self.rows()
    xs = [r["recompute_percent"] for r in rows]
    ys = [r["activation_bytes"] / 2**20 for r in rows]
    ax.scatter(xs, ys, c=["tab:red" if r["pareto"] else "tab:gray" for r in rows])
    for r, x, y in zip(rows, xs, ys, strict=True):
      ax.annotate(r["policy"], (x, y), fontsize=7, xytext=(3, 3),
                  textcoords="offset points")
    front = sorted((x, y) for r, x, y in zip(rows, xs, ys, strict=True) if r["pareto"])
    if front:
      ax.plot(*zip(*front, strict=True), color="tab:red", lw=1)
    ax.set_xlabel("recompute FLOPs (% of a no-remat step)")
    ax.set_ylabel("activation memory kept (MiB)")
    ax.set_title("remat policies: memory vs recompute")
    return ax


def compare(fn: Callable[..., Any], *args: Any,
            policies: Sequence[str | Policy] | None = None,
            compile: bool = False) -> Comparison:
  """Analyses ``fn`` under several policies, tracing the model once.

  Args:
    fn: returns a scalar loss; see :func:`analyze`.
    *args: arrays or ``jax.ShapeDtypeStruct`` pytrees.
    policies: names or Policies; default: every policy in the catalogue.
    compile: add XLA's memory analysis per policy (slow: one compile each).

  Returns:
    A :class:`Comparison`; its ``warnings`` (each raised once as a
    ``UserWarning``) name the policies whose figures are not their own.
  """
  if policies is None:
    chosen = [catalog.get_policy(n) for n in catalog.list_policies()]
  else:
    if isinstance(policies, (str, Policy)):
      raise TypeError(
          f"policies must be a list of names, got {policies!r}; "
          f"write policies=[{policies!r}].")
    chosen = [_resolve_policy(p) for p in policies]
  program = TracedProgram(fn, args)
  reports: dict[str, ResidualReport] = {}
  skipped: dict[str, str] = {}
  for policy in chosen:
    if policy.name in reports or policy.name in skipped:
      continue
    if policy.offloads and compat.offloading_unsupported():
      skipped[policy.name] = ("offloads to host memory, but "
                              + compat.offloading_refusal())
      continue
    reports[policy.name] = program.report(policy, compile=compile)
  found = region_warnings(program) + [
      w for w in (unmatched_names_warning(program, p) for p in chosen
                  if p.name in reports) if w]
  comparison = Comparison(reports=reports, skipped=skipped,
                          regions=program.regions,
                          warnings=tuple(dict.fromkeys(found)))
  warn_once(comparison.warnings)
  return comparison
