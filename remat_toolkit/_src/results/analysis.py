"""The analyzer's results as data: residuals, one policy's report, a comparison.

These classes hold numbers and names only. Their text, HTML and DataFrame
forms are rendered by :mod:`remat_toolkit._src.display`; their bytes are
counted in :mod:`remat_toolkit._src.analysis.residuals`.

Example:
  >>> from remat_toolkit._src.results.analysis import Residual
  >>> r = Residual(shape=(4, 8), dtype="float32", nbytes=128,
  ...              kind="activation", name="ffn.up", module_path="mlp",
  ...              primitive="dot_general", source="", memory_kind="device")
  >>> r.what
  'ffn.up'
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import cast

from remat_toolkit._src.core.format import natural_key
from remat_toolkit._src.core.pareto import pareto_flags
from remat_toolkit._src.policies.findings import SELECTS_NOTHING
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.results import base as render
from remat_toolkit._src.results.base import Result
from remat_toolkit._src.results.peak import Peak

__all__ = ["Residual", "RecomputedKernel", "ResidualReport", "Comparison", "kept_bytes",
           "Verification"]

#: The residual kinds counted in ``activation_bytes`` (and
#: ``offloaded_bytes``): every one JAX's ``saved_residuals`` lists except
#: ``from the argument``, so the totals equal JAX's own.
COUNTED_KINDS = ("activation", "constant", "literal")


def kept_bytes(residuals: Iterable[Any], memory_kind: str = "device", *,
               sizes: Iterable[int] | None = None) -> int:
  """The activation bytes of ``residuals`` in ``memory_kind``: the one sum
  behind every result's ``activation_bytes`` and ``offloaded_bytes``.

  Args:
    residuals: :class:`Residual`-like values (``kind``, ``memory_kind``,
      ``nbytes``).
    memory_kind: ``"device"`` (kept) or ``"host"`` (offloaded).
    sizes: per residual, the bytes to count instead of its ``nbytes`` (one
      device's share of a sharded residual).
  """
  residuals = list(residuals)
  counts = [r.nbytes for r in residuals] if sizes is None else list(sizes)
  return sum(n for r, n in zip(residuals, counts, strict=True)
             if r.kind in COUNTED_KINDS and r.memory_kind == memory_kind)


@dataclasses.dataclass(frozen=True)
class Residual:
  """One value kept from the forward pass for the backward pass.

  Attributes:
    shape: the stored shape (a scan-stacked residual includes its scan axis).
    dtype: dtype name.
    nbytes: bytes held, every scan iteration included.
    kind: what JAX's ``saved_residuals`` calls it: ``"argument"`` (``from
      the argument``: a parameter or input, held anyway), ``"constant"``
      (``from a constant``: an array the function closes over),
      ``"literal"`` (``from a literal``: a scalar such as a Python float)
      or ``"activation"`` (``named ...`` or ``output of ...``: computed by
      the forward pass).
    name: its checkpoint name, if it has one (also inside scan bodies).
    module_path: where in the model it was made, e.g. ``layers_3/attn``.
    primitive: the primitive that computed it.
    source: ``file:line (function)`` of the code that made it.
    memory_kind: ``"device"`` or ``"host"`` (offloaded).
    stacked: the scan length it is stacked over (1 outside scans).
    label: for arguments, the pytree path of the argument leaf.
    per_device_nbytes: bytes one device holds (its largest shard), when the
      arguments are sharded over several devices; None otherwise.
    kernel: the kernel that made it, None elsewhere: the name of a
      ``jax.custom_vjp`` function (its forward rule computed the value, e.g.
      a flash-attention kernel's output or log-sum-exp) or of a Pallas
      kernel (``pallas_call``), also when a jitted function wraps it.
      :attr:`module_path` is where the kernel was called.
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
  per_device_nbytes: int | None = None
  kernel: str | None = None

  @property
  def device_share(self) -> int:
    """Bytes one device holds: :attr:`per_device_nbytes`, else all of it."""
    return self.nbytes if self.per_device_nbytes is None else self.per_device_nbytes

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
  # Largest first; equal groups (identical layers) in layer order.
  return dict(sorted(out.items(), key=lambda kv: (-kv[1], natural_key(kv[0]))))


def module_prefix(module_path: str, depth: int | None) -> str:
  """The first ``depth`` components of a module path (None: all of them)."""
  parts = [p for p in module_path.split("/") if p]
  return "/".join(parts[:depth] if depth else parts) or "(top level)"


@dataclasses.dataclass(frozen=True)
class RecomputedKernel:
  """A kernel whose forward runs again in the backward pass.

  Its backward rule reads residuals its forward made (a flash kernel's
  output and log-sum-exp) that the policy did not keep, so the backward
  pass runs the whole forward again, as a step without remat would not.

  Attributes:
    kernel: the kernel's name (see :attr:`Residual.kernel`).
    module_path: where it is called.
    flops: FLOPs of the forward run again, per training step (matmul
      FLOPs, or what a Pallas kernel's ``cost_estimate`` declares).
    runs: how many more times the forward runs per step than without remat
      (a kernel in a scan over layers runs once per layer); a fraction when
      only part of its forward runs again.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> @jax.custom_vjp
    ... def kernel(x, w):
    ...   return jnp.tanh(x @ w)
    >>> def kernel_fwd(x, w):  # its backward reads h, not the output
    ...   h = x @ w
    ...   return jnp.tanh(h), (x, w, h)
    >>> def kernel_bwd(res, g):
    ...   x, w, h = res
    ...   d = g * (1 - jnp.tanh(h) ** 2)
    ...   return d @ w.T, x.T @ d
    >>> kernel.defvjp(kernel_fwd, kernel_bwd)
    >>> block = rt.remat(lambda x, w: kernel(x, w))
    >>> args = (jax.ShapeDtypeStruct((8, 16), jnp.float32),
    ...         jax.ShapeDtypeStruct((16, 16), jnp.float32))
    >>> loss = lambda x, w: block(x, w).sum()
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter("ignore")
    ...   report = rt.analyze(loss, *args, policy="boundary-only")
    >>> report.recomputed_kernels
    (RecomputedKernel(kernel='kernel', module_path='', flops=4096, runs=1.0),)
  """

  kernel: str
  module_path: str
  flops: int
  runs: float

  @property
  def where(self) -> str:
    """``kernel at module/path`` (or the kernel alone at the top level)."""
    return f"{self.kernel} at {self.module_path}" if self.module_path else self.kernel


@dataclasses.dataclass(frozen=True)
class ResidualReport(Result):
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
    per_device_method: how the per-device figures were found, when the
      arguments carry shardings: ``"traced shardings"`` (read off the
      program traced on an ``AbstractMesh`` of ``Explicit`` axes),
      ``"compiled here"`` (compiled for this process's devices) or
      ``"compiled in a subprocess"`` (compiled for ``devices`` simulated CPU
      devices); see :mod:`remat_toolkit._src.analysis.sharding`.
    warnings: why the figures may not be this policy's own: no region reads
      it, regions with their own policy ignore it, or it keeps none of its
      names in this model; kernels that run again, remat modes that keep a
      kernel's residuals differently, matmuls of two activations (S x S
      attention logits) a matmul policy keeps (see
      :func:`remat_toolkit._src.analysis.report.build_report`).
    recomputed_kernels: the kernels (``custom_vjp`` or Pallas) whose forward
      runs again in the backward pass under this policy, with the FLOPs of
      that re-run (counted in :attr:`recompute_flops` too); empty when every
      kernel's residuals are kept. Residuals made by a kernel carry
      :attr:`Residual.kernel`.
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
  warnings: tuple[Finding, ...] = ()
  per_device_method: str | None = None
  recomputed_kernels: tuple[RecomputedKernel, ...] = ()

  # ------------------------------------------------------------ totals
  @property
  def activations(self) -> tuple[Residual, ...]:
    """The residuals counted in the activation totals (all but arguments)."""
    return tuple(r for r in self.residuals if r.kind in COUNTED_KINDS)

  @property
  def activation_bytes(self) -> int:
    """Bytes kept in device memory for the backward pass, beyond arguments.

    Counts the kinds in :data:`COUNTED_KINDS`: what JAX's
    ``saved_residuals`` lists as ``named ...``, ``output of ...``, ``from a
    constant`` and ``from a literal``; not ``from the argument`` (see
    :attr:`argument_bytes`). Offloaded residuals are in
    :attr:`offloaded_bytes`. So it equals the bytes of JAX's list less its
    arguments, on device.

    >>> import jax, jax.numpy as jnp
    >>> import remat_toolkit as rt
    >>> table = jnp.ones((8, 8))  # closed over: JAX's "from a constant"
    >>> report = rt.analyze(lambda x: jnp.sin(x @ table).sum(), jnp.ones((2, 8)))
    >>> sorted((r.kind, r.nbytes) for r in report.residuals)
    [('activation', 64), ('constant', 256)]
    >>> report.activation_bytes
    320
    """
    return kept_bytes(self.residuals)

  @property
  def offloaded_bytes(self) -> int:
    """Activation bytes moved to host memory."""
    return kept_bytes(self.residuals, "host")

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
  def bytes_by_kind(self) -> dict[str, int]:
    """Bytes per residual kind (``argument``, ``constant``, ...)."""
    return _group(self.residuals, lambda r: r.kind)

  def _of_kind(self, kind: str | None) -> tuple[Residual, ...]:
    """Residuals of ``kind``; None: those counted in the activation totals."""
    if kind is None:
      return self.activations
    return tuple(r for r in self.residuals if r.kind == kind)

  def by_module(self, depth: int | None = 1, *, kind: str | None = None
                ) -> dict[str, int]:
    """Bytes per module-path prefix of ``depth`` components (None: full).

    ``kind`` selects one residual kind; None: every kind counted in
    :attr:`activation_bytes`.
    """
    return _group(self._of_kind(kind),
                  lambda r: module_prefix(r.module_path, depth))

  def by_name(self, *, kind: str | None = None) -> dict[str, int]:
    """Bytes per checkpoint name (unnamed residuals by ``<primitive>``)."""
    return _group(self._of_kind(kind),
                  lambda r: r.what)

  def by_primitive(self, *, kind: str | None = None) -> dict[str, int]:
    """Bytes per producing primitive."""
    return _group(self._of_kind(kind),
                  lambda r: r.primitive)

  def by_kernel(self) -> dict[str, int]:
    """Activation bytes made by each kernel (residuals with a
    :attr:`Residual.kernel`)."""
    return _group((r for r in self.activations if r.kernel),
                  lambda r: cast(str, r.kernel))  # kept: those with one

  def kernel_reruns(self) -> dict[str, tuple[float, int]]:
    """Per kernel whose forward runs again: ``(runs, FLOPs)`` over its call
    sites (:attr:`recomputed_kernels` summed by kernel)."""
    found: dict[str, tuple[float, int]] = {}
    for k in self.recomputed_kernels:
      runs, flops = found.get(k.kernel, (0.0, 0))
      found[k.kernel] = (runs + k.runs, flops + k.flops)
    return found

  @property
  def kernel_recompute_flops(self) -> int:
    """FLOPs of the kernel forwards that run again (:attr:`recomputed_kernels`)."""
    return sum(k.flops for k in self.recomputed_kernels)

  # ------------------------------------------------------------ data out
  def to_dict(self) -> dict[str, Any]:
    """Plain data: totals, FLOPs and one entry per residual."""
    return {
        "policy": self.policy,
        "activation_bytes": self.activation_bytes,
        "offloaded_bytes": self.offloaded_bytes,
        "argument_bytes": self.argument_bytes,
        "bytes_by_kind": self.bytes_by_kind(),
        "activation_bytes_per_device": self.activation_bytes_per_device,
        "devices": self.devices,
        "per_device_method": self.per_device_method,
        "forward_flops": self.forward_flops,
        "backward_flops": self.backward_flops,
        "recompute_flops": self.recompute_flops,
        "recompute_percent": self.recompute_percent,
        "remat_regions": self.remat_regions,
        "xla": dict(self.xla) if self.xla else None,
        "warnings": list(self.warnings),
        "recomputed_kernels": [dataclasses.asdict(k)
                               for k in self.recomputed_kernels],
        "residuals": [dataclasses.asdict(r) for r in self.residuals],
    }


  # ------------------------------------------------------------ display
  def __repr__(self) -> str:
    return (f"ResidualReport(policy={self.policy!r}, "
            f"residuals={len(self.residuals)}, "
            f"activation_bytes={self.activation_bytes}, "
            f"offloaded_bytes={self.offloaded_bytes}, "
            f"recompute_flops={self.recompute_flops}"
            + (f", recomputed_kernels={len(self.recomputed_kernels)}"
               if self.recomputed_kernels else "")
            + (f", warnings={len(self.warnings)}" if self.warnings else "")
            + ")")

  def summary_lines(self) -> list[str]:
    """The report's headline figures and warnings, one line each."""
    return render.summary_lines(self)

  def table(self, *, depth: int | None = 2, limit: int = 40) -> str:
    """Per-module, per-name table of activation residuals."""
    return render.table(self, depth=depth, limit=limit)


@dataclasses.dataclass(frozen=True)
class Comparison(Result):
  """Every policy's :class:`ResidualReport` on one function, side by side.

  Attributes:
    reports: policy name -> report, in the order compared.
    skipped: policy name -> why it was not analysed (e.g. offloading under
      ``jax_remat3``).
    regions: remat regions that took the compared policies.
    warnings: why some figures may not be the policies' own: said once for
      the function (no region reads the policy, regions with their own
      policy), then once per policy that keeps none of its names.
    baseline: the report of the built-in ``save-everything`` (the constant
      :data:`remat_toolkit._src.policies.resolve.SAVE_EVERYTHING`, whatever the
      catalogue holds under that name) when ``save-everything`` is among the
      compared policies; the "% of save-everything" column is relative to it.
    peaks: policy name -> the :class:`~remat_toolkit.results.Peak` of one
      ``jax.grad`` step under it, when compared with ``peak=True`` (with
      XLA's figure too when also ``compile=True``); else None.
  """

  reports: Mapping[str, ResidualReport]
  skipped: Mapping[str, str]
  regions: int
  warnings: tuple[Finding, ...] = ()
  baseline: ResidualReport | None = None
  peaks: Mapping[str, Peak] | None = None

  def __repr__(self) -> str:
    return (f"Comparison(policies={list(self.reports)}, "
            f"skipped={list(self.skipped)}, regions={self.regions}"
            + (f", warnings={len(self.warnings)}" if self.warnings else "")
            + ")")

  def pareto(self) -> dict[str, bool]:
    """Policies no other policy beats on device bytes, recompute and offload.

    Offloaded bytes count as a cost of their own (host transfers), so an
    offloading policy does not hide the policies that move nothing.
    """
    criteria = [(r.activation_bytes, r.recompute_flops, r.offloaded_bytes)
                for r in self.reports.values()]
    return dict(zip(self.reports, pareto_flags(criteria), strict=True))

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

  def silent_policies(self) -> frozenset[str]:
    """Policies that keep none of their names, or none of the model's
    matmuls, in this model."""
    return frozenset(n for n, r in self.reports.items()
                     if any(getattr(w, "kind", None) in SELECTS_NOTHING
                            for w in r.warnings))

  def rows(self) -> list[dict[str, Any]]:
    """One record per policy (the table's data)."""
    base = self.baseline.activation_bytes if self.baseline else None
    pareto = self.pareto()
    silent = self.silent_policies()
    rows = []
    for name, r in self.reports.items():
      rows.append({
          "policy": name,
          "activation_bytes": r.activation_bytes,
          "percent_of_save_everything": (100.0 * r.activation_bytes / base
                                         if base else None),
          "offloaded_bytes": r.offloaded_bytes,
          "recompute_flops": r.recompute_flops,
          "recompute_percent": r.recompute_percent,
          "num_residuals": len(r.activations),
          "largest": self.distinctive(name),
          "xla_temp_bytes": (r.xla or {}).get("temp_bytes"),
          "activation_bytes_per_device": r.activation_bytes_per_device,
          "per_device_method": r.per_device_method,
          "pareto": pareto[name],
          "keeps_none_of_its_names": name in silent,
          "recomputed_kernels": [k.where for k in r.recomputed_kernels],
          "kernel_recompute_flops": r.kernel_recompute_flops,
      })
      if self.peaks is not None:
        rows[-1]["peak_bytes"] = self.peaks[name].bytes
        if self.compiled_peaks:
          rows[-1]["xla_peak_bytes"] = self.peaks[name].xla_bytes
    return rows

  @property
  def compiled_peaks(self) -> bool:
    """Whether the peaks carry XLA's figure (``peak=True, compile=True``)."""
    return any(p.xla_bytes is not None for p in (self.peaks or {}).values())

  def to_dict(self) -> dict[str, Any]:
    """Plain data: the rows, skipped policies, regions and warnings; with
    peaks, each policy's predicted and XLA's peak bytes and when it falls."""
    out = {"rows": self.rows(), "skipped": dict(self.skipped),
           "regions": self.regions, "warnings": list(self.warnings)}
    if self.peaks is not None:
      out["peaks"] = {name: {"bytes": p.bytes, "xla_bytes": p.xla_bytes,
                             "when": p.when}
                      for name, p in self.peaks.items()}
    return out


  def plot(self, ax=None, *, max_bytes: int | None = None,
           memory: str = "kept"):
    """Memory (x) vs recompute (y), Pareto front joined (needs matplotlib);
    returns the axes.

    ``max_bytes`` ends the memory axis there (points beyond are left
    out of view and unlabelled), to look closely at the low end.
    ``memory="peak"`` puts each policy's predicted peak of one step on the
    memory axis instead of the activations it keeps (needs a comparison
    made with ``peak=True``).
    """
    return render.plot(self, ax=ax, max_bytes=max_bytes, memory=memory)


@dataclasses.dataclass(frozen=True)
class Verification(Result):
  """What :func:`verify` found about one policy on one function.

  Attributes:
    policy: the policy's name (or the JAX policy's repr).
    ok: gradients with remat equal gradients without remat within
      tolerance; None when values were not checked.
    max_abs_diff: ``max |g_remat - g_ref|`` over every gradient leaf (and
      the loss); None when values were not checked.
    max_rel_diff: the largest per-leaf ``max |g_remat - g_ref| / max |g_ref|``.
    worst_leaf: the argument path of the leaf with the largest relative
      difference.
    rtol: relative tolerance used.
    atol: absolute tolerance used.
    inputs: where the values came from: ``"given"``, ``"random (seed=N)"``
      for abstract arguments, or ``"not checked"``.
    reference: what the gradients were compared with.
    no_op: ``"save-everything"`` or ``"boundary-only"`` when the policy keeps
      exactly what that policy keeps although it names something else.
    warnings: regions that do not take the policy (none reads it, or some
      have their own), a policy that keeps none of its names in this model,
      effects recomputed inside remat regions, traces that differ, policies
      ignored by the remat implementation in use.
    regions: remat regions that took the policy (ambient regions).
    activation_bytes: device activation bytes the policy keeps.
    offloaded_bytes: activation bytes it moves to host memory.
  """

  policy: str
  ok: bool | None
  max_abs_diff: float | None
  max_rel_diff: float | None
  worst_leaf: str
  rtol: float
  atol: float
  inputs: str
  reference: str
  no_op: str | None
  warnings: tuple[Finding, ...]
  regions: int
  activation_bytes: int
  offloaded_bytes: int

  @property
  def problems(self) -> list[str]:
    """Every finding, one sentence each; empty when all is well."""
    found = []
    if self.ok is False:
      found.append(
          f"gradients with remat differ from gradients without remat: max "
          f"abs diff {self.max_abs_diff:.3g}, max rel diff "
          f"{self.max_rel_diff:.3g} (worst at {self.worst_leaf}), above "
          f"rtol={self.rtol:g}, atol={self.atol:g}")
    if self.no_op is not None:
      found.append(
          f"policy {self.policy!r} is a no-op: it keeps exactly what "
          f"{self.no_op!r} keeps")
    found.extend(self.warnings)
    return found

  @property
  def passed(self) -> bool:
    """No problem found (unchecked gradient values do not count as one)."""
    return not self.problems

  def summary_lines(self) -> list[str]:
    """What was found, one line each."""
    return render.summary_lines(self)

  def to_dict(self) -> dict[str, Any]:
    """Plain data, with ``passed`` and ``problems``."""
    out = dataclasses.asdict(self)
    out["warnings"] = list(self.warnings)
    out["passed"] = self.passed
    out["problems"] = self.problems
    return out

