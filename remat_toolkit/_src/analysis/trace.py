"""A loss function traced once, and read under any policy.

:class:`TracedProgram` traces ``fn`` once with every region that reads the
ambient policy lowered to a marker of its key (:func:`remat_toolkit._src.
lowering.substitute_ambient`), then substitutes each policy's lowering into
the traced program, region by region: comparing many policies, or giving
each region a policy of its own, re-traces no Python code. The residuals'
bytes are counted in :mod:`remat_toolkit._src.analysis.residuals`, their per-device
share in :mod:`remat_toolkit._src.analysis.sharding`.

It only measures (:meth:`TracedProgram.measure`: residuals, FLOPs, kernels
run again, per-device shares, XLA's figures). Saying what the figures mean
for the user, and when they may mislead, is the report builder's
(:mod:`remat_toolkit._src.analysis.report`): it diagnoses a program once and
each policy once, however many results read them.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.analysis.trace import TracedProgram
  >>> f = rt.remat(lambda x: jnp.sin(jnp.sin(x)).sum())
  >>> program = TracedProgram(f, (jax.ShapeDtypeStruct((4,), jnp.float32),))
  >>> program.regions
  1
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from remat_toolkit._src.analysis import flops as _flops
from remat_toolkit._src.analysis import regions as _regions
from remat_toolkit._src.analysis import residuals as _residuals
from remat_toolkit._src.analysis import sharding as _sharding
from remat_toolkit._src.analysis.shared_steps import Asked
from remat_toolkit._src.analysis.shared_steps import sharing
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr
from remat_toolkit._src.core.arg_paths import argument_module_paths
from remat_toolkit._src.policies import lowering
from remat_toolkit._src.policies import region_inputs
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.resolve import SAVE_EVERYTHING
from remat_toolkit._src.results.analysis import RecomputedKernel
from remat_toolkit._src.results.analysis import Residual
from remat_toolkit._src.results.analysis import kept_bytes

__all__ = ["TracedProgram", "Measurement", "PolicyRefused", "cpu_scheduler_setting"]

_CUDNN_REFUSAL = (
    "the model calls a cuDNN kernel (jax.nn.dot_product_attention with "
    "implementation='cudnn'), which JAX cannot trace without a GPU; analyse it "
    "with implementation='xla' (or None), or run the analysis on a GPU.")


class PolicyRefused(ValueError):
  """JAX cannot differentiate the program under one policy (JAX's limit,
  not the program's: other policies may run)."""


@dataclasses.dataclass(frozen=True)
class Measurement:
  """One policy measured on a traced program (:meth:`TracedProgram.measure`).

  Figures only: what a result says about them is found and composed by
  :mod:`remat_toolkit._src.analysis.report`.

  Attributes:
    residuals: what the training step keeps for the backward pass, in the
      order JAX saves them; each with its per-device share when measured.
    activation_matmuls: per residual, whether a ``dot_general`` of two
      activations (neither operand a parameter) made it.
    backward_flops: matmul/conv FLOPs of the backward pass, recompute
      included.
    recomputed_kernels: the kernels whose forward runs again in the backward
      pass.
    device_shares: per residual, the bytes one device holds; None when not
      measured or the arguments are not sharded over several devices.
    xla: XLA's ``memory_analysis()`` figures when measured with ``compile``.
  """

  residuals: tuple[Residual, ...]
  activation_matmuls: tuple[bool, ...]
  backward_flops: int
  recomputed_kernels: tuple[RecomputedKernel, ...]
  device_shares: tuple[int, ...] | None = None
  xla: dict[str, Any] | None = None

  @property
  def per_device_activation_bytes(self) -> int | None:
    """Activation bytes one device holds, when the shares were measured."""
    if self.device_shares is None:
      return None
    return kept_bytes(self.residuals, sizes=self.device_shares)


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
    self._modules = ["/".join(p) for p in argument_module_paths(args)]
    self._markers = lowering.RegionMarkers()
    treedef = self._treedef

    def flat_fn(*xs):
      return fn(*jax.tree_util.tree_unflatten(treedef, xs))

    self._layout = _sharding.layout_of(self._leaves)
    try:
      closed, out_shape = self._trace(flat_fn)
    except compat.ShardingTypeError as e:
      if self._layout.mesh is None:  # concrete devices: the user's to fix
        raise
      # Not written for explicit sharding: trace it on Auto axes, where XLA
      # decides the shardings, and measure them by compiling.
      self._leaves, self._layout = _sharding.auto_axes(self._leaves,
                                                       self._layout, e)
      self._markers = lowering.RegionMarkers()
      closed, out_shape = self._trace(flat_fn)
    out_leaves = jax.tree_util.tree_leaves(out_shape)
    if (len(out_leaves) != 1 or out_leaves[0].shape != ()
        or not jax.numpy.issubdtype(out_leaves[0].dtype, jax.numpy.inexact)):
      raise ValueError(
          f"fn must return a scalar floating-point loss, got "
          f"{jax.tree_util.tree_map(lambda s: f'{s.dtype}{list(s.shape)}', out_shape)}; "
          "reduce it, e.g. return loss.mean().")
    # Marked before regions are shared: identical layers stay identical.
    closed = closed.replace(jaxpr=_flops.mark_kernels(closed.jaxpr))
    self.jaxpr = closed.replace(jaxpr=_regions.share_identical_regions(
        closed.jaxpr, self._markers))
    self.regions = _regions.count_remat_regions(closed.jaxpr, self._markers)
    self.forward_flops = _flops.count_matmul_flops(closed.jaxpr)
    self._root = _root_scope(closed.jaxpr)
    self._region_names = _region_name_sets(self.jaxpr.jaxpr, self._markers)
    self._own_regions: list[tuple[str, str]] | None = None
    self._matmuls: _flops.MatmulCounts | None = None
    self._custom_vjps: list[_flops.KernelForward] | None = None
    self._kinds: list[tuple[str, ...]] | None = None
    self._arguments: dict[tuple[int, str], Residual] = {}
    self._steps: dict[Any, _residuals.TracedStep] = {}
    # Per lowering, the lowering whose step it shares (:meth:`_step_key`),
    # and what each traced lowering's JAX policies were asked.
    self._same_step: dict[Any, Any] = {}
    self._asked: dict[Any, Asked] = {}
    # Per policy (by identity, the policy kept): its lowering and the inputs
    # its regions name (:meth:`_lowering`).
    self._lowerings: dict[int, tuple[Policy, Any]] = {}
    # Residual origins per traced step: policies that share a step (names
    # the model lacks, :meth:`_step_key`) share one walk of it.
    self._origins_of: dict[Any, list[_residuals.ResidualOrigin]] = {}
    self._baseline_step: _residuals.TracedStep | None = None
    self.kernel_sites = _flops.kernel_work(closed.jaxpr)

  def _trace(self, flat_fn):
    with lowering.substitute_ambient(self._markers), _sharding.tracing(
        self._layout):
      try:
        return _jaxpr.trace_program(flat_fn, self._leaves)
      except RuntimeError as err:
        if compat.is_cudnn_unavailable(err):
          raise ValueError(_CUDNN_REFUSAL) from err
        raise

  @property
  def layout(self) -> _sharding.Layout:
    """How the arguments are spread over devices, and how that is measured."""
    return self._layout

  @property
  def names(self) -> frozenset[str]:
    """Checkpoint names present anywhere in the program."""
    return _jaxpr.names_in(self.jaxpr.jaxpr)

  @property
  def leaves(self) -> list[Any]:
    """The arguments' leaves, abstract (``jax.ShapeDtypeStruct``)."""
    return list(self._leaves)

  @property
  def marker(self) -> lowering.RegionMarkers:
    """The placeholders the ambient regions were traced with, one per key."""
    return self._markers

  @property
  def region_keys(self) -> tuple[str, ...]:
    """The key of every region that reads the ambient policy, in program
    order (one key may stand for several region executions: a region in a
    ``scan``, a module called twice)."""
    return tuple(self._region_names)

  def unseen_inputs(self, key: str) -> int:
    """How many inputs of the regions of ``key`` arrive as arguments of a
    ``jax.jit`` the program calls (which no policy moves to the host)."""
    return self._markers.unseen_of(key)

  def region_names(self, key: str) -> frozenset[str]:
    """Checkpoint names inside the regions of key ``key``."""
    return self._region_names[key]

  def region_kinds(self) -> list[tuple[str, ...]]:
    """The region keys grouped by kind, in program order.

    Keys of one kind compute the same thing on the same input types, as
    often per step (structurally identical layers), so a policy changes
    their residuals alike.
    """
    if self._kinds is None:
      signatures: dict[str, list[tuple[str, int]]] = {}
      text: dict[int, str] = {}  # shared bodies are read once
      for eqn, trips in _jaxpr.walk_with_trips(self.jaxpr.jaxpr):
        if compat.is_remat(eqn) and compat.remat_policy_of(eqn) in self._markers:
          key = self._markers.key_of(compat.remat_policy_of(eqn))
          body_id = id(compat.remat_body_of(eqn))
          if body_id not in text:
            text[body_id] = _regions.region_signature(eqn)
          signatures.setdefault(key, []).append((text[body_id], trips))
      kinds: dict[tuple, list[str]] = {}
      for key in self.region_keys:
        kinds.setdefault(tuple(signatures[key]), []).append(key)
      self._kinds = [tuple(keys) for keys in kinds.values()]
    return self._kinds

  @property
  def ambient_names(self) -> frozenset[str]:
    """Checkpoint names inside the regions that read the ambient policy."""
    return frozenset().union(*self._region_names.values())

  @property
  def shadowed_regions(self) -> int:
    """Regions reading the ambient policy that sit inside a region with a
    policy of its own (a model that remats itself), where the outer wins."""
    return _regions.count_shadowed_regions(self.jaxpr.jaxpr, self._markers)

  @property
  def ambient_matmuls(self) -> _flops.MatmulCounts:
    """The matmul equations inside the regions that read the ambient policy."""
    if self._matmuls is None:
      self._matmuls = _flops.count_region_matmuls(
          self.jaxpr.jaxpr,
          lambda eqn: compat.remat_policy_of(eqn) in self._markers)
    return self._matmuls

  @property
  def ambient_custom_vjps(self) -> list[_flops.KernelForward]:
    """The ``custom_vjp`` kernels inside the regions that read the ambient
    policy, with the names and matmuls of their forward rules."""
    if self._custom_vjps is None:
      self._custom_vjps = _flops.custom_vjp_forwards(
          self.jaxpr.jaxpr,
          lambda eqn: compat.remat_policy_of(eqn) in self._markers)
      if self._root:
        self._custom_vjps = [
            dataclasses.replace(f, module_path=_strip_root(f.module_path,
                                                           self._root))
            for f in self._custom_vjps]
    return self._custom_vjps

  @property
  def own_policy_regions(self) -> list[tuple[str, str]]:
    """``(where, policy)`` of each remat region that has its own policy."""
    if self._own_regions is None:
      root = self._root
      self._own_regions = _regions.own_policy_regions(
          self.jaxpr.jaxpr, self._markers,
          lambda path: _strip_root(path, root) if root else path)
    return self._own_regions

  def lowered(self, policy: Policy) -> tuple[Any, ...]:
    """The JAX policy each region key gets under ``policy``, in key order."""
    return self._lowering(policy)[0]

  def _lowering(self, policy: Policy
                ) -> tuple[tuple[Any, ...], tuple[tuple[bool, ...] | None, ...]]:
    """:meth:`lowered`, and the inputs each region key names under
    ``policy`` when its policy moves them (:mod:`~remat_toolkit._src.
    policies.region_inputs`), in key order; made once per policy (a
    comparison reads them several times per policy, and a model of many
    layers has as many keys)."""
    memo = self._lowerings.get(id(policy))
    if memo is not None and memo[0] is policy:  # a Policy never changes
      return memo[1]
    # Lowering expands name patterns: once per distinct (policy, names), not
    # once per layer.
    done: dict[tuple[int, frozenset[str]], Any] = {}
    selects: dict[int, bool] = {}  # per region policy, not per layer
    out = []
    masks = []
    for key, names in self._region_names.items():
      chosen = policy.for_region(key)
      if id(chosen) not in selects:
        selects[id(chosen)] = region_inputs.selects_inputs(chosen)
      mask = self._markers.inputs_of(key)
      if mask is None or not any(mask) or not selects[id(chosen)]:
        mask = None
      masks.append(mask)
      if mask:
        names = names | {region_inputs.INPUT_NAME}
      memo_key = (id(chosen), names)
      if memo_key not in done:
        done[memo_key] = policy.to_jax(names, region=key)
      out.append(done[memo_key])
    result = (tuple(out), tuple(masks))
    self._lowerings[id(policy)] = (policy, result)
    return result

  @property
  def paths(self) -> list[str]:
    """The pytree path of each argument leaf (``jax.tree_util.keystr``)."""
    return list(self._paths)

  @property
  def root(self) -> str:
    """The model's root scope (a Flax model's class name), or ``""``."""
    return self._root

  def module_path(self, path: str) -> str:
    """``path`` as results show it: the model's root scope dropped."""
    return _strip_root(path, self._root) if self._root else path

  def substituted(self, policy: Policy):
    """The traced program (a jaxpr over :attr:`leaves`, with the constants
    ``self.jaxpr.consts``) with every ambient region under ``policy``."""
    return self._substituted(policy)

  def _substituted(self, policy: Policy,
                   jax_policies: Sequence[Any] | None = None):
    """The program under ``policy``; with ``jax_policies``, those stand in
    for :meth:`lowered`'s (one per key, each an ``AskedPolicy``)."""
    lowered, masks = self._lowering(policy)
    keys = tuple(self._region_names)
    mapping = dict(zip(keys, lowered if jax_policies is None else jax_policies,
                       strict=True))
    mask_of = dict(zip(keys, masks, strict=True))
    named: dict[tuple[int, tuple[bool, ...]], Any] = {}  # shared bodies stay so

    def body_for(marker, body):
      mask = mask_of[self._markers.key_of(marker)]
      if mask is None:
        return body
      if (id(body), mask) not in named:
        named[(id(body), mask)] = region_inputs.name_body_inputs(body, mask)
      return named[(id(body), mask)]

    return _regions.substitute_policy(
        self.jaxpr.jaxpr, self._markers,
        lambda marker, _: mapping[self._markers.key_of(marker)], body_for)

  def step(self, policy: Policy) -> _residuals.TracedStep:
    """The traced training step under ``policy`` (cached per lowering, and
    shared by lowerings that decide alike on this program:
    :meth:`_step_key`)."""
    return self._steps[self._step_key(policy)]

  def _step_key(self, policy: Policy) -> Any:
    """The lowering whose traced step ``policy``'s is: its own, or an
    earlier one's that its JAX policies answer alike.

    JAX's partial evaluation (remat2) reads a region's policy only by
    calling it on an equation; the trace is otherwise the same for the same
    program. A step is traced with each JAX policy behind an
    ``AskedPolicy`` (:mod:`~remat_toolkit._src.analysis.shared_steps`)
    that records what it was asked; a lowering whose
    policies give the same answers to every one of those questions, on the
    same program (the same inputs named) and shared by the same region keys,
    would make the same trace, question by question: its step, residuals and
    FLOPs are that one's (on GPT-2, 3 of the catalogue's 25 policies decide
    as another does: save-attention as maxtext-save-dot-with-context, for
    one). Only lowerings of the toolkit's own policies are compared: a raw
    JAX policy is the user's code, called as JAX calls it.
    """
    key = self.lowered(policy)
    if key in self._same_step:
      return self._same_step[key]
    masks = self._lowering(policy)[1]
    shared = sharing(key)
    if self._ours(policy):
      for other, asked in self._asked.items():
        if asked.alike(key, masks, shared):
          self._same_step[key] = other
          return other
    # remat3 reads a policy's type, not only its answers, and a raw JAX
    # policy of the user's may answer by more than the question (or count
    # the calls): those are traced as they are, and share no step.
    record = not compat.remat3_enabled() and self._ours(policy)
    asking = Asked.of(key, masks, shared) if record else None
    jaxpr = self._substituted(
        policy, None if asking is None else asking.policies)
    try:
      with _sharding.tracing(self._layout):
        self._steps[key] = _residuals.trace_training_step(
            jaxpr, self.jaxpr.consts, self._leaves, self.forward_flops,
            kernels=bool(self.kernel_sites))
    except TypeError as e:
      if not compat.is_reduce_precision_refusal(e):
        raise
      raise PolicyRefused(
          f"JAX cannot differentiate fn under {policy.name!r}: with jax_remat3 "
          f"off it rounds each value a remat region keeps with "
          f"reduce_precision, which refuses this one ({e}). Choose a policy "
          "that keeps no such value (boundary-only keeps only the regions' "
          "inputs), or turn jax_remat3 on.") from None
    except NotImplementedError as e:
      # JAX's remat refuses some effects (io_callback) inside a region.
      sites = _regions.effects_in_remat_regions(self.jaxpr.jaxpr)
      if not sites:
        raise
      where = ", ".join(f"{s.primitive} at {s.source or s.module_path or '?'}"
                        for s in sites)
      raise ValueError(
          f"fn cannot be differentiated: JAX refuses effects inside a remat "
          f"region ({e}); found {where}. Move the callback out of the remat "
          "region, or make it a jax.debug.callback.") from None
    if asking is not None:
      self._asked[key] = asking
    self._same_step[key] = key
    return key

  def _ours(self, policy: Policy) -> bool:
    """Whether every region key lowers ``policy`` to one of JAX's own
    policy constructors (no raw JAX policy given by the user)."""
    return not any(chosen is not None and chosen.is_jax_policy
                   for chosen in map(policy.for_region, self._region_names))

  @property
  def baseline_step_flops(self) -> int:
    """Forward + backward FLOPs of a step with the ambient regions removed."""
    return self.forward_flops + self.baseline_step.backward_flops

  def recompute_flops(self, policy: Policy) -> int:
    """FLOPs a step under ``policy`` runs beyond the step without remat."""
    total = self.forward_flops + self.step(policy).backward_flops
    return max(total - self.baseline_step_flops, 0)

  @property
  def baseline_step(self) -> _residuals.TracedStep:
    """The training step with the ambient regions removed (no remat)."""
    if self._baseline_step is None:
      if compat.remat3_enabled():
        # jax 0.10's remat3 everything_saveable recomputes un-named values.
        self._baseline_step = self._inlined_step()
      else:
        try:
          self._baseline_step = self.step(SAVE_EVERYTHING)
        except PolicyRefused:  # a value JAX will not keep (a complex one)
          self._baseline_step = self._inlined_step()
    return self._baseline_step

  def _inlined_step(self) -> _residuals.TracedStep:
    """The training step of the program with its ambient regions inlined."""
    jaxpr = _regions.inline_regions(self.jaxpr.jaxpr, self._markers)
    with _sharding.tracing(self._layout):
      return _residuals.trace_training_step(
          jaxpr, self.jaxpr.consts, self._leaves, self.forward_flops,
          kernels=bool(self.kernel_sites))

  def recomputed_kernels(self, policy: Policy) -> tuple[RecomputedKernel, ...]:
    """The kernels whose forward runs again in the backward pass under
    ``policy``: their work over the training step beyond the work of the
    same step without remat (a backward rule that re-runs part of its own
    forward by design is not counted)."""
    if not self.kernel_sites:
      return ()
    per_run = _kernel_work_by_site(self.kernel_sites, self._root)
    work = _kernel_work_by_site(self.step(policy).kernel_work, self._root,
                                per_run)
    base = _kernel_work_by_site(self.baseline_step.kernel_work, self._root,
                                per_run)
    found = []
    for site, done in work.items():
      without = base.get(site, _flops.KernelWork())
      extra = done.flops - without.flops
      launches = done.launches - without.launches
      if extra > 0 or launches > 0:
        runs = _flops.extra_runs(extra, launches, per_run.get(site))
        found.append(RecomputedKernel(site[0], site[1], max(extra, 0), runs))
    return tuple(found)

  def residuals(self, policy: Policy) -> list[Residual]:
    """What ``policy`` keeps, without the per-device shares :meth:`measure`
    adds."""
    return [self._residual(o) for o in self._origins(policy)]

  def _origins(self, policy: Policy) -> list[_residuals.ResidualOrigin]:
    key = self._step_key(policy)
    if key not in self._origins_of:
      step = self._steps[key]
      self._origins_of[key] = _residuals.residual_origins(
          step.jaxpr, 1, step.num_residuals)
    return self._origins_of[key]

  def _residual(self, o: _residuals.ResidualOrigin) -> Residual:
    if o.kind == "argument" and o.arg_index is not None:
      # The same parameters are residuals under most policies: made once.
      key = (o.arg_index, o.memory_kind)
      if key not in self._arguments:
        self._arguments[key] = self._make_residual(o)
      return self._arguments[key]
    return self._make_residual(o)

  def _make_residual(self, o: _residuals.ResidualOrigin) -> Residual:
    label = ""
    path = o.module_path
    if o.kind == "argument" and o.arg_index is not None:  # an argument has one
      label = self._paths[o.arg_index]
      path = self._modules[o.arg_index]
    elif self._root:
      path = _strip_root(path, self._root)
    return Residual(
        shape=tuple(int(d) for d in o.aval.shape), dtype=str(o.aval.dtype),
        nbytes=_residuals.aval_nbytes(o.aval), kind=o.kind, name=o.name,
        module_path=path, primitive=o.primitive, source=o.source,
        memory_kind=o.memory_kind, stacked=o.stacked, label=label,
        kernel=o.kernel)

  def measure(self, policy: Policy, *, device_shares: bool = True,
              compile: bool = False) -> Measurement:
    """What the training step keeps and computes under ``policy``.

    Args:
      policy: the policy every ambient region takes.
      device_shares: also find each residual's per-device share, where the
        arguments are sharded (this may compile, here or in a subprocess).
      compile: also compile ``jit(grad(fn))`` for XLA's memory analysis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import remat_toolkit as rt
      >>> from remat_toolkit._src.analysis.trace import TracedProgram
      >>> f = rt.remat(lambda x: jnp.sin(rt.tag(jnp.sin(x), "ffn.up")).sum())
      >>> program = TracedProgram(f, (jax.ShapeDtypeStruct((4,), jnp.float32),))
      >>> m = program.measure(rt.get_policy("save-ffn"))
      >>> [(r.kind, r.name, r.nbytes) for r in m.residuals]
      [('argument', None, 16), ('activation', 'ffn.up', 16)]
      >>> m.per_device_activation_bytes is None  # unsharded arguments
      True
    """
    step = self.step(policy)
    origins = self._origins(policy)
    residuals = tuple(self._residual(o) for o in origins)
    # Per-device shares, by the method the arguments' shardings allow
    # (read off the trace, or compiled here or in a subprocess).
    shares = (_sharding.residual_device_bytes(origins, self._leaves, step,
                                              self._layout)
              if device_shares else None)
    if shares is not None:
      residuals = tuple(dataclasses.replace(r, per_device_nbytes=b)
                        for r, b in zip(residuals, shares, strict=True))
    return Measurement(
        residuals=residuals,
        activation_matmuls=tuple(o.activation_matmul for o in origins),
        backward_flops=step.backward_flops,
        recomputed_kernels=self.recomputed_kernels(policy),
        device_shares=None if shares is None else tuple(shares),
        xla=self.xla_memory(policy) if compile else None)

  def xla_memory(self, policy: Policy) -> dict[str, Any]:
    """XLA's ``memory_analysis()`` of ``jit(grad(fn))`` under ``policy``.

    Raises:
      ValueError: for arguments on an ``AbstractMesh`` (no devices here to
        compile for), or a backend XLA gives no memory analysis on.
    """
    if self._layout.mesh is not None:
      raise ValueError(
          f"compile=True compiles for this machine's devices, but the "
          f"arguments are sharded on the abstract mesh {self._layout.mesh} "
          f"({self._layout.devices} devices); drop compile=True (the per-device "
          f"figures come from {self._layout.method!r}), or shard the arguments "
          "over jax.devices().")
    jaxpr = self._substituted(policy)
    consts = self.jaxpr.consts
    diff = tuple(i for i, x in enumerate(self._leaves)
                 if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))

    def loss(*xs):
      return compat.eval_jaxpr(jaxpr, consts, *xs)[0]

    compiled = jax.jit(jax.grad(loss, argnums=diff)).lower(*self._leaves).compile()
    stats = compiled.memory_analysis()
    if stats is None:
      raise ValueError(
          f"compile=True reads XLA's memory analysis, which the "
          f"{jax.default_backend()!r} backend does not provide; drop "
          "compile=True.")
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


def _kernel_work_by_site(work: Mapping[tuple[str, str], _flops.KernelWork],
                         root: str,
                         sites: Mapping[tuple[str, str], Any] | None = None
                         ) -> dict[tuple[str, str], _flops.KernelWork]:
  """Kernel work keyed by (kernel, module path as residuals read it).

  Differentiating a program can stack a call's scopes on scopes JAX kept
  from an earlier trace of a shared body (``layers_1/layers_0/...``); the
  kernel's call site is then the longest of the primal program's ``sites``
  its path starts with.
  """
  merged: dict[tuple[str, str], _flops.KernelWork] = {}
  for (kernel, path), w in work.items():
    path = _strip_root(path, root) if root else _dedup(path)
    known = [p for k, p in (sites or ()) if k == kernel
             and (path == p or path.startswith(p + "/") or not p)]
    site = (kernel, max(known, key=len) if known else path)
    total = merged.setdefault(site, _flops.KernelWork())
    total.flops += w.flops
    total.launches += w.launches
    total.calls += w.calls
  return merged


def _dedup(path: str) -> str:
  parts = path.split("/")
  return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


def _strip_root(path: str, root: str) -> str:
  # Flax names the root scope after the model class, and a transform lifted
  # over a method gets the scope "Root.method": drop the class name in both.
  parts = path.split("/")
  if parts and parts[0] == root:
    parts = parts[1:]
  parts = [p[len(root) + 1:] if p.startswith(root + ".") else p for p in parts]
  # A transform lifted over a method scopes the module's name once more
  # ("Block_0/Block_0"): one module, one path component.
  return _dedup("/".join(parts))


def _region_name_sets(jaxpr, markers) -> dict[str, frozenset[str]]:
  """Region key -> checkpoint names in its regions, keys in program order."""
  found: dict[str, frozenset[str]] = {}

  def record(marker, names):
    key = markers.key_of(marker)
    found[key] = found.get(key, frozenset()) | names
    return marker

  _regions.substitute_policy(jaxpr, markers, record)
  return found
