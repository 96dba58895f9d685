"""Never silent: finding, on a traced program, why figures may mislead.

A result whose figures are not the policy's own says so: in its
``warnings`` field, in its text and HTML, and once as a ``UserWarning``.
Every entry point (analyze, compare, memory_breakdown, verify, plan, bench)
asks this module through the report builder
(:mod:`remat_toolkit._src.analysis.report`, which runs it once per program
and once per policy), so they say them alike: a function with no remat region,
regions with a policy of their own, a policy that keeps none of its names
in this model, a matmul policy that passes over the model's matmuls
(convolutions, batched einsums); and on models with attention: a kernel
whose forward runs again in the backward pass, a ``custom_vjp`` kernel the
two remat modes keep differently, a matmul policy keeping S x S attention
logits. Each is a :class:`~remat_toolkit._src.policies.findings.Finding`;
those a region also raises when it is traced are worded in that module.

Example:
  >>> import jax.numpy as jnp
  >>> from remat_toolkit._src.analysis import diagnose
  >>> from remat_toolkit._src.analysis.trace import TracedProgram
  >>> program = TracedProgram(lambda x: jnp.sin(x).sum(), (jnp.ones(4),))
  >>> [f.kind for f in diagnose.region_warnings(program)]
  ['no-region']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import Protocol

from remat_toolkit._src.analysis import flops as _flops
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import format as fmt
from remat_toolkit._src.policies import region_inputs
from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.policies.findings import brief
from remat_toolkit._src.policies.findings import keeps_none
from remat_toolkit._src.policies.findings import uncovered_regions
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.results.analysis import kept_bytes

__all__ = ["Regions", "region_warnings", "unmatched_names_warning",
           "matmul_warning", "unseen_inputs_warning", "selection_warnings",
           "per_region_warnings", "own_policy_text", "kernel_warnings",
           "kernel_rerun_warning", "custom_vjp_mode_warning",
           "activation_matmul_warning"]


class Regions(Protocol):
  """What :func:`region_warnings` reads: how many regions take the ambient
  policy, and the regions with a policy of their own (a traced program, or
  the report builder's
  :class:`~remat_toolkit._src.analysis.report.ProgramFindings`, which read
  them once)."""

  # Properties: the findings only read them, and most are computed.
  @property
  def regions(self) -> int: ...
  @property
  def shadowed_regions(self) -> int: ...
  @property
  def own_policy_regions(self) -> Sequence[tuple[str, str]]: ...


class TracedProgram(Regions, Protocol):
  """What the findings read of a traced program
  (:class:`~remat_toolkit._src.analysis.trace.TracedProgram` is one): its
  regions, and what the regions that read the ambient policy hold."""

  @property
  def region_keys(self) -> tuple[str, ...]: ...
  @property
  def ambient_names(self) -> frozenset[str]: ...
  @property
  def ambient_matmuls(self) -> _flops.MatmulCounts: ...
  @property
  def ambient_custom_vjps(self) -> list[_flops.KernelForward]: ...
  def unseen_inputs(self, key: str) -> int: ...



def own_policy_text(regions: Sequence[tuple[str, str]], limit: int = 3) -> str:
  """``(where, policy)`` pairs of regions with their own policy, in words."""
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


def region_warnings(program: Regions, policy: str | None = None
                    ) -> list[Finding]:
  """Why ``policy`` (None: any policy asked for) may not shape the figures.

  Covers a function with no remat region, one whose regions all have their
  own policy, and one where only some regions read the ambient policy.
  """
  subject = (f"policy {policy!r} changes nothing" if policy
             else "no policy changes anything")
  own = program.own_policy_regions
  if not program.regions and not own:
    return [Finding(
        f"fn has no remat region at all, so {subject} and nothing is "
        "recomputed; wrap its blocks with remat_toolkit.remat (policy left as "
        "None) or use remat_toolkit.remat_modules.", "no-region", policy)]
  if not program.regions:
    return [Finding(
        f"no remat region in fn reads the ambient policy, so {subject}: the "
        f"figures are those of the regions' own policies; "
        f"{own_policy_text(own)}. Build the regions with policy left as None "
        "(remat_toolkit.remat, remat_toolkit.remat_modules) so that they take "
        "the policy analysed.", "own-policies", policy)]
  if own and program.shadowed_regions:
    return [Finding(_shadowed_warning(program, subject, own), "shadowed",
                    policy)]
  if own:
    what = f"policy {policy!r}" if policy else "the policy asked for"
    total = program.regions + len(own)
    verb = "has its own policy and ignores" if len(own) == 1 else (
        "have their own policy and ignore")
    takes = "takes" if program.regions == 1 else "take"
    return [Finding(
        f"{len(own)} of {total} remat regions {verb} {what}: "
        f"{own_policy_text(own)}; only the other {program.regions} {takes} "
        "it, so the figures mix policies. Build those regions with policy "
        "left as None to let them take it.", "own-policies", policy)]
  return []


def _shadowed_warning(program: Regions, subject: str,
                      own: Sequence[tuple[str, str]]) -> str:
  """Regions nested in the model's own regions: the outer policy wins."""
  shadowed, total = program.shadowed_regions, program.regions
  if shadowed == total:
    head = (f"every one of the {total} remat regions that read the ambient "
            f"policy sits inside a remat region the model makes itself, "
            f"whose own policy decides what is saved, so {subject}")
  else:
    head = (f"{shadowed} of the {total} remat regions that read the ambient "
            f"policy sit inside a remat region the model makes itself, whose "
            f"own policy decides what they save; only the other "
            f"{total - shadowed} take the policy analysed, so the figures "
            "mix policies")
  return (f"{head}: {own_policy_text(own)}. Re-policy the model's own regions "
          "with remat_toolkit.repolicy(fn) instead of adding regions inside "
          "them.")


def unmatched_names_warning(program: TracedProgram, policy: Any
                            ) -> Finding | None:
  """Says so when a name-based policy matches no name its regions hold.

  Such a policy keeps only the region inputs, as ``boundary-only`` does,
  whatever its name promises. Policies that select by something else
  (matmuls, everything, a policy of JAX's own) are never flagged.
  """
  if (not isinstance(policy, Policy) or not program.regions
      or policy.save_everything or policy.matmuls != "none"
      or not policy.patterns or region_inputs.selects_inputs(policy)):
    return None  # a policy offloading block.input names the inputs itself
  present = sorted(program.ambient_names)
  if any(policy.matches(n) for n in present):
    return None
  return keeps_none(policy.name, policy.patterns, present,
                    "the regions that take it")


def _plural(count: int, word: str) -> str:
  return f"{count} {word}{'s' if count != 1 else ''}"


def matmul_warning(program: TracedProgram, policy: Any) -> Finding | None:
  """Says so when a matmul policy passes over the matmuls the regions hold.

  ``matmuls="all"`` lowers to ``dots_saveable``, which keeps no convolution
  under jax 0.10's remat3 (probed, :func:`compat.dots_saveable_keeps_convs`);
  ``"no-batch"`` / ``"offload-no-batch"`` keep only ``dot_general`` outputs
  without batch dimensions, never a convolution nor a ``vmap``-ed or MoE
  einsum. Counted on the regions that take the policy.
  """
  if (not isinstance(policy, Policy) or not program.regions
      or policy.matmuls == "none"):
    return None
  found = program.ambient_matmuls
  head = f"policy {policy.name!r} "
  if policy.matmuls == "all":
    if not found.convs or compat.dots_saveable_keeps_convs():
      return None
    dots = found.unbatched_dots + found.batched_dots
    what = (f"{head}keeps nothing beyond the region inputs, as boundary-only does"
            if not dots else
            f"{head}keeps the outputs of its "
            f"{_plural(dots, 'dot_general')} but drops every convolution's")
    return Finding(f"{what}: the regions that take it hold "
            f"{_plural(found.convs, 'convolution')}, and JAX's dots_saveable "
            "keeps no convolution output while jax_remat3 is on in this JAX. "
            "Tag the convolution outputs with remat_toolkit.tag(x, name) and "
            "keep them with a name policy, or turn remat3 off "
            "(jax.config.update('jax_remat3', False)).",
            "drops-convolutions" if dots else "keeps-only-inputs", policy.name)
  if found.unbatched_dots or not (found.batched_dots or found.convs):
    return None
  held = " and ".join(
      _plural(n, word) for n, word in (
          (found.batched_dots, "batched dot_general"),
          (found.convs, "convolution")) if n)
  # save-matmuls is advice only where dots_saveable keeps one of them.
  all_rule = found.batched_dots or compat.dots_saveable_keeps_convs()
  return Finding(f"{head}keeps nothing beyond the region inputs, as boundary-only does: "
          f"the regions that take it hold only {held}, and the no-batch rule "
          "(JAX's dots_with_no_batch_dims_saveable) keeps no convolution and "
          "no matmul with a batch dimension (vmap, MoE or attention einsums). "
          "Tag the tensors to keep with remat_toolkit.tag(x, name) and keep "
          "them with a name policy"
          + (", or use save-matmuls." if all_rule else "."),
          "keeps-only-inputs", policy.name)


def selection_warnings(program: TracedProgram, policy: Any) -> list[Finding]:
  """Why ``policy`` keeps less than it promises here: names it asks for that
  the regions lack, matmuls of a kind its rule passes over."""
  return [w for w in (unmatched_names_warning(program, policy),
                      matmul_warning(program, policy),
                      unseen_inputs_warning(program, policy)) if w]


def unseen_inputs_warning(program: TracedProgram, policy: Any
                          ) -> Finding | None:
  """Regions whose policy moves their inputs, but whose inputs arrive as
  arguments of a ``jax.jit`` the program calls: whether they were computed
  cannot be seen there, so they stay on the device
  (:func:`~remat_toolkit._src.policies.region_inputs.unseen_inputs`)."""
  if not isinstance(policy, Policy):
    return None
  keys = [k for k in program.region_keys if program.unseen_inputs(k)
          and region_inputs.selects_inputs(policy.for_region(k))]
  if not keys:
    return None
  count = sum(program.unseen_inputs(k) for k in keys)
  return Finding(
      f"policy {policy.name!r} moves region inputs, but {count} input(s) of "
      f"{brief(keys, 4)} arrive as arguments of a jax.jit the program calls: "
      "whether the program computed them (activations to move) or was given "
      "them (parameters, held on the device anyway) cannot be seen from "
      "inside the jit, so they stay on the device. Call the function without "
      "jax.jit inside the traced program, or re-policy the whole program, "
      "rt.repolicy(loss, policy), which sees through the jit.",
      "inputs-unseen", policy.name)


def per_region_warnings(program: TracedProgram, policy: Any) -> list[Finding]:
  """What a per-region policy leaves out in this model, and what it names
  that this model does not have."""
  if not isinstance(policy, Policy) or not policy.is_per_region:
    return []
  keys = program.region_keys
  found = []
  uncovered = [k for k in keys if policy.for_region(k) is None]
  if uncovered:
    found.append(uncovered_regions(
        policy.name, uncovered,
        positional=all(region_keys.is_positional(k) for k in uncovered)))
  unused = [pattern for pattern, _ in policy.regions
            if not any(region_keys.key_matches(k, pattern) for k in keys)]
  if unused:
    found.append(Finding(
        f"per-region policy {policy.name!r} names {brief(unused, 6)}, which "
        f"are no remat region of this model (it has {brief(list(keys), 6)}): "
        "it was planned for another model or another layout.",
        "unknown-regions", policy.name))
  return found


def _remat3_note() -> str:
  """What to change where remat3 ignores names inside a custom_vjp."""
  if not compat.remat3_enabled() or compat.remat3_sees_into_custom_vjp():
    return ""
  return (" With jax_remat3 on, this JAX keeps nothing from inside a "
          "custom_vjp kernel's forward rule, names included; "
          f"{compat.custom_vjp_alignment()} lets a policy keep them.")


def _kernel_places(pairs: Sequence[tuple[str, str]]) -> str:
  """``'mha' (at layers_0, layers_1)`` for (kernel, module path) pairs."""
  by_kernel: dict[str, list[str]] = {}
  for kernel, path in pairs:
    by_kernel.setdefault(kernel, []).append(path or "the top level")
  return "; ".join(
      f"{kernel!r} (at {', '.join(list(dict.fromkeys(paths))[:4])}"
      + (f" and {len(set(paths)) - 4} more" if len(set(paths)) > 4 else "")
      + ")" for kernel, paths in by_kernel.items())


def kernel_rerun_warning(policy: str, recomputed: Sequence[Any]
                         ) -> Finding | None:
  """Says which kernels run their forward again in the backward pass.

  ``recomputed`` holds :class:`~remat_toolkit._src.results.analysis.RecomputedKernel`
  entries of one report.
  """
  if not recomputed:
    return None
  kernels = {k.kernel for k in recomputed}
  runs = sum(k.runs for k in recomputed)
  flops = sum(k.flops for k in recomputed)
  return Finding(f"policy {policy!r} runs the forward of kernel"
          f"{'s' if len(kernels) > 1 else ''} "
          f"{_kernel_places([(k.kernel, k.module_path) for k in recomputed])} "
          f"again in the backward pass ({runs:g} more run"
          f"{'s' if runs != 1 else ''} per step, {fmt.format_flops(flops)}): "
          "a kernel's backward rule reads residuals its forward computes (a "
          "flash kernel's output and log-sum-exp), which the policy does not "
          "keep; a checkpoint name on the kernel's output keeps that output, "
          "not them. Name them inside the kernel's forward "
          "(remat_toolkit.tag_residuals(kernel, name), or splash attention's "
          "residual_checkpoint_name) and keep that name with the policy."
          + _remat3_note(), "kernel-rerun", policy)


def _forward_selection(policy: Policy, forward: Any) -> str | None:
  """What ``policy`` selects inside a custom_vjp forward rule, in words."""
  names = sorted(n for n in forward.names if policy.matches(n))
  if names:
    return f"the names {brief(names, 4)}"
  found = forward.matmuls
  if policy.matmuls == "all" and (found.unbatched_dots or found.batched_dots
                                  or found.convs):
    return "the matmul outputs"
  if policy.matmuls in ("no-batch", "offload-no-batch") and found.unbatched_dots:
    return "the matmul outputs without batch dimensions"
  return None


def custom_vjp_mode_warning(program: TracedProgram, policy: Any
                            ) -> Finding | None:
  """Says so when the two remat modes keep a custom_vjp kernel's residuals
  differently under ``policy``.

  With ``jax_remat3`` off JAX traces a custom_vjp's forward rule inline and
  the policy sees the names and matmuls in it; remat3 treats the kernel as
  opaque unless ``jax_custom_vjp3`` is on and honoured
  (:func:`compat.remat3_sees_into_custom_vjp`).
  """
  if (not isinstance(policy, Policy) or policy.is_per_region
      or policy.is_jax_policy or policy.save_everything
      or not program.regions or compat.remat3_sees_into_custom_vjp()):
    return None
  hits: dict[str, list[tuple[str, str]]] = {}
  for forward in program.ambient_custom_vjps:
    what = _forward_selection(policy, forward)
    if what is not None:
      hits.setdefault(what, []).append((forward.kernel, forward.module_path))
  if not hits:
    return None
  what, places = next(iter(hits.items()))
  align = compat.custom_vjp_alignment()
  fix = (f"{align} lets remat3 see inside on this JAX"
         if "custom_vjp3" in align else
         f"jax_custom_vjp3 does not let remat3 see inside on this JAX; run "
         f"with {align}")
  return Finding(
      f"policy {policy.name!r} keeps {what} inside the forward rule of "
      f"custom_vjp kernel {_kernel_places(places)} with jax_remat3 off but "
      "not with it on (remat3 treats a custom_vjp as opaque and "
      f"recomputes it), so the two remat modes keep different residuals: "
      f"{fix}.", "modes-differ", policy.name)


def activation_matmul_warning(policy: Any, kept: Sequence[Any],
                              activation_bytes: int) -> Finding | None:
  """Says so when a matmul policy keeps matmuls of two activations.

  ``kept`` holds the report's residuals made by a ``dot_general`` neither
  of whose operands is a parameter (attention logits, probabilities times
  values: :func:`_jaxpr.multiplies_activations`).
  """
  if not isinstance(policy, Policy) or policy.matmuls == "none" or not kept:
    return None
  total = sum(r.nbytes for r in kept)
  largest = max(kept, key=lambda r: r.nbytes)
  shape = f"{largest.dtype}[{','.join(map(str, largest.shape))}]"
  inside = f" in kernel {largest.kernel!r}" if largest.kernel else ""
  stacked = (f", stacked over {largest.stacked} steps" if largest.stacked > 1
             else "")
  return Finding(f"policy {policy.name!r} keeps the outputs of "
          f"{_plural(len(kept), 'matmul')} between two activations "
          "(neither operand a parameter), "
          f"{fmt.format_bytes(total)} of its "
          f"{fmt.format_bytes(activation_bytes)}: attention logits, S x S per "
          f"head, and the like (the largest {shape}{stacked} at "
          f"{largest.module_path or 'the top level'}{inside}), which a "
          "flash-attention kernel exists not to store. A name policy "
          "(save-attention, save-projections-and-context) keeps the "
          "projections without them.", "activation-matmuls", policy.name)


def kernel_warnings(program: TracedProgram, policy: Any, residuals: Sequence[Any],
                    activation_matmuls: Sequence[bool],
                    recomputed: Sequence[Any]) -> list[Finding]:
  """What a report on a model with kernels or attention must say: kernels
  run again, remat modes that disagree on a kernel, and S x S matmul
  outputs a matmul policy keeps."""
  name = getattr(policy, "name", str(policy))
  kept = [r for r, flag in zip(residuals, activation_matmuls, strict=True)
          if flag and r.kind == "activation"]
  # The report's activation_bytes: counted kinds on the device.
  counted = kept_bytes(residuals)
  found = [kernel_rerun_warning(name, recomputed),
           custom_vjp_mode_warning(program, policy),
           activation_matmul_warning(policy, kept, counted)]
  return [w for w in found if w]
