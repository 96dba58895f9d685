"""Findings: why figures may not be the asked policy's own, worded once.

A finding is a sentence a result carries in its ``warnings`` and raises once
as a ``UserWarning``; it is a :class:`Finding`, a string that also says what
kind of finding it is, so results pick findings out by kind, never by their
wording. The findings a region raises when it is traced (a policy that keeps
none of its names, a per-region policy with no policy for the region) and
the same findings on a result are worded by the one function here; the
analysis detects the others on a traced program
(:mod:`remat_toolkit._src.analysis.diagnose`).

One switch silences them: inside :func:`quiet`, nothing is raised, and
results still carry their findings.

Example:
  >>> from remat_toolkit._src.policies import findings
  >>> f = findings.keeps_none("save-ffn", ["ffn.up"], [], "remat region 'layers_0'")
  >>> f.kind, f.policy
  ('keeps-none', 'save-ffn')
  >>> f.startswith("policy 'save-ffn' keeps none of its names")
  True
  >>> with findings.quiet():
  ...   findings.warn_once([f])
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence

__all__ = ["Finding", "KINDS", "SELECTS_NOTHING", "keeps_none",
           "uncovered_regions", "brief", "warn_once", "warn_at_trace", "quiet",
           "forget_trace_warnings"]

#: Every kind of finding, and what it says.
KINDS: dict[str, str] = {
    "no-region": "the function has no remat region at all",
    "own-policies": "no region, or only some, read the ambient policy",
    "shadowed": "regions sit inside the model's own remat regions",
    "inputs-unseen": "a region's inputs arrive through a jit: not moved",
    "keeps-none": "a name policy keeps none of its names in this model",
    "keeps-only-inputs": "a matmul policy passes over every matmul",
    "drops-convolutions": "a matmul policy keeps dots but no convolution",
    "uncovered-regions": "a per-region policy names no policy for a region",
    "unknown-regions": "a per-region policy names regions the model lacks",
    "kernel-rerun": "a kernel's forward runs again in the backward pass",
    "modes-differ": "the two remat modes keep a custom_vjp kernel differently",
    "activation-matmuls": "a matmul policy keeps S x S attention logits",
    "effects": "effects inside remat regions run again in the recompute",
    "traced-differently": "the function traces differently each time",
    "ignored-by-remat3": "jax_remat3 ignores a JAX policy: full recompute",
    "unrunnable": "the policy cannot run on this JAX now",
    "xla-remat": "XLA rematerialized instructions itself to fit memory",
    "xla-merged-recompute": "XLA merged a policy's recomputation into the forward pass",
    "cpu-scheduler": "XLA:CPU's default scheduler hides remat's effect",
    "device-limit": "the step's peak is above the device's memory limit",
    "prediction-off": "the predicted peak is off XLA's figure by more than 10%",
    "no-names": "no region reading the ambient policy holds a checkpoint name",
    "not-additive": "regions interact: a per-region plan is measured, not proven",
    "not-checked": "a check could not run (JAX refused the program)",
    "note": "how a figure was measured",
}

#: The kinds that say a policy keeps no more than ``boundary-only`` here.
SELECTS_NOTHING = frozenset({"keeps-none", "keeps-only-inputs"})


class Finding(str):
  """One finding: its sentence, the kind of finding and the policy it is on.

  A ``str`` (what ``warnings`` of every result hold, printed and compared as
  text) that also carries :attr:`kind` (a key of :data:`KINDS`) and
  :attr:`policy` (a policy's name, or None for the function).
  """

  kind: str
  policy: str | None

  def __new__(cls, message: str, kind: str, policy: str | None = None
              ) -> Finding:
    if kind not in KINDS:
      raise ValueError(f"unknown finding kind {kind!r}; one of {sorted(KINDS)}")
    self = super().__new__(cls, message)
    self.kind = kind
    self.policy = policy
    return self

  def __reduce__(self):
    return (Finding, (str(self), self.kind, self.policy))


def brief(items: Sequence[str], limit: int) -> str:
  """The first ``limit`` items quoted, then how many more."""
  shown = ", ".join(repr(i) for i in items[:limit])
  more = len(items) - limit
  return shown + (f" and {more} more" if more > 0 else "")


def keeps_none(policy: str, patterns: Sequence[str], present: Sequence[str],
               where: str) -> Finding:
  """A name policy whose names are all absent from ``where``.

  Args:
    policy: the policy's name.
    patterns: the names and globs it asks for.
    present: the checkpoint names ``where`` holds.
    where: what holds them (``"the regions that take it"``, a region).
  """
  held = (f"the names in {where} are {brief(list(present), 6)}" if present
          else f"there is no checkpoint name in {where}")
  return Finding(
      f"policy {policy!r} keeps none of its names in this model: it asks for "
      f"{brief(list(patterns), 4)}, but {held}, so it keeps only the region "
      "inputs, as boundary-only does. Tag the tensors to keep with "
      "remat_toolkit.tag(x, name), or choose a policy whose names exist "
      "(remat_toolkit.list_policies()).", "keeps-none", policy)


def uncovered_regions(policy: str, keys: Sequence[str], *,
                      positional: bool = False) -> Finding:
  """A per-region policy that names no policy for the regions ``keys``.

  Args:
    policy: the per-region policy's name.
    keys: the region keys it has no policy for.
    positional: whether they are regions of plain functions, keyed ``#k``.
  """
  why = ("; regions of plain functions are keyed by position in the order "
         "they are traced inside one use_policy block, so trace each planned "
         "function in a use_policy block of its own" if positional else "")
  return Finding(
      f"per-region policy {policy!r} has no policy for the remat region(s) "
      f"{brief(list(keys), 6)}, so they keep only their inputs, as "
      f"boundary-only does{why}; plan this model (remat_toolkit.plan(..., "
      "per_layer=True)) or add a pattern such as '*' to its regions.",
      "uncovered-regions", policy)


_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remat_toolkit_quiet_findings", default=False)
_raised_at_trace: set[str] = set()


@contextlib.contextmanager
def quiet(active: bool = True) -> Iterator[None]:
  """Nothing is raised inside (when ``active``); results still carry their
  findings.

  For callers that show the results themselves (the command line), for
  entry points whose result carries what regions would raise when traced,
  and for entry points built on others, so that one call raises one set.
  """
  token = _quiet.set(bool(active) or _quiet.get())
  try:
    yield
  finally:
    _quiet.reset(token)


def warn_once(messages: Iterable[str], stacklevel: int = 3) -> None:
  """Raises each of a new result's findings once, as a ``UserWarning``.

  ``stacklevel`` 3 points at the caller of the public function that calls
  this. Nothing is raised inside :func:`quiet`.
  """
  if _quiet.get():
    return
  for message in dict.fromkeys(messages):
    warnings.warn(message, UserWarning, stacklevel=stacklevel)


def warn_at_trace(finding: Finding, stacklevel: int = 4) -> None:
  """Raises a finding of a region being traced, once per process.

  A model traced again (another jit, another policy's analysis) says it
  once; :func:`forget_trace_warnings` lets it say it again.
  """
  if _quiet.get() or finding in _raised_at_trace:
    return
  _raised_at_trace.add(str(finding))
  warnings.warn(finding, UserWarning, stacklevel=stacklevel)


def forget_trace_warnings() -> None:
  """Forgets which trace-time findings were raised, so they are raised again."""
  _raised_at_trace.clear()
