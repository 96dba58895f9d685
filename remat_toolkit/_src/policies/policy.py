"""The :class:`Policy` value: what a remat region keeps, offloads or recomputes.

A policy is data. It is lowered, at trace time, to exactly one of JAX's own
policy constructors, so it means the same thing under both of JAX's remat
implementations (``jax_remat3`` off and on).

Example:
  >>> import remat_toolkit as rt
  >>> p = rt.Policy(name="keep-up", save=["ffn.up"])
  >>> print(p.lowering(names=["ffn.up", "ffn.down"]))
  jax.checkpoint_policies.save_only_these_names('ffn.up')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

import jax

from remat_toolkit._src.core import compat
from remat_toolkit._src.core.globs import glob_match
from remat_toolkit._src.core.globs import is_glob
from remat_toolkit._src.policies import region_keys
from remat_toolkit._src.policies import tags

__all__ = ["Policy", "Lowering", "MATMUL_MODES", "MEMORY_KINDS",
           "normalize_name", "unrunnable_reason", "lookup_policy",
           "install_name_lookup", "policy_of", "BOUNDARY_ONLY", "SAVE_EVERYTHING", "BASELINES"]

#: Values of :attr:`Policy.matmuls`.
MATMUL_MODES: dict[str, str] = {
    "none": "matmul outputs are not kept for their own sake",
    "all": "keep every matmul/convolution output (jax dots_saveable)",
    "no-batch": "keep matmul outputs without batch dimensions "
                "(jax dots_with_no_batch_dims_saveable)",
    "offload-no-batch": "offload matmul outputs without batch dimensions "
                        "to host memory (jax offload_dot_with_no_batch_dims)",
}

#: Memory kinds accepted for ``offload_src`` / ``offload_dst``.
MEMORY_KINDS: tuple[str, ...] = ("device", "pinned_host", "unpinned_host")

def normalize_name(name: str) -> str:
  """Canonical policy name: lower case, ``_`` and ``-`` interchangeable."""
  return name.strip().lower().replace("_", "-")


def _as_name_tuple(field: str, value: Any) -> tuple[str, ...]:
  if isinstance(value, str) or not isinstance(value, Iterable):
    raise TypeError(
        f"Policy.{field} must be a list of checkpoint names or glob patterns, "
        f"got {value!r}; write e.g. {field}=['attn.q', 'ffn.*'].")
  items = tuple(value)
  for item in items:
    if not isinstance(item, str) or not item:
      raise TypeError(
          f"Policy.{field} entries must be non-empty strings, got {item!r} "
          f"in {list(items)!r}.")
  return items


@dataclasses.dataclass(frozen=True)
class Policy:
  """A named remat policy, as data.

  Attributes:
    name: the policy's name (case-insensitive; ``-`` and ``_`` alike).
    description: one line: what it costs and when to use it.
    save: checkpoint names or glob patterns kept in device memory (matched
      ignoring case; see :meth:`expand`).
    offload: checkpoint names or glob patterns moved to host memory.
    exclude: checkpoint names or glob patterns that ``save``/``offload``
      never select, even where one of their globs matches: a module path
      that looks like attention but is not (a squeeze-and-excitation gate
      named ``attention``) stays recomputed.
    matmuls: ``"none"``, ``"all"``, ``"no-batch"`` or ``"offload-no-batch"``;
      see :data:`MATMUL_MODES`. Cannot be combined with ``save``/``offload``,
      since no single JAX constructor expresses the union.
    offload_src: memory kind offloaded from (default ``"device"``).
    offload_dst: memory kind offloaded to (default ``"pinned_host"``).
    save_everything: keep every residual (no recomputation at all).
    aliases: other names this policy answers to.
    jax_policy: a policy of JAX's own (see :meth:`from_jax`); when set, the
      policy lowers to it unchanged and the other fields must be defaults.
    regions: a per-region policy: ``(region, policy)`` pairs (a mapping is
      accepted), each region a key (``layers_3``, ``transformer/h/0``,
      ``#2`` for the third region of a plain function) or a glob
      (``layers_*``), each policy a :class:`Policy` or a catalogue name.
      Every remat region reading this policy takes the policy of the first
      pair that matches its key (see :meth:`for_region`); a region that
      matches none keeps only its inputs, and says so. When set, the other
      fields must be defaults. Plans made with ``per_layer=True`` are such
      policies.

  Example:
    >>> import remat_toolkit as rt
    >>> rt.Policy(name="p", save=["attn.*"]).lowering(names=["attn.q", "x"])
    Lowering(constructor='save_only_these_names', args=('attn.q',))
  """

  name: str
  description: str = ""
  save: tuple[str, ...] = ()
  offload: tuple[str, ...] = ()
  exclude: tuple[str, ...] = ()
  matmuls: str = "none"
  offload_src: str = "device"
  offload_dst: str = "pinned_host"
  save_everything: bool = False
  aliases: tuple[str, ...] = ()
  jax_policy: Any = None
  regions: tuple[tuple[str, Policy], ...] = ()

  @classmethod
  def from_jax(cls, jax_policy: Any, name: str | None = None) -> Policy:
    """Wraps a policy of JAX's own, so it goes wherever a Policy goes.

    Args:
      jax_policy: a ``jax.checkpoint_policies`` policy or any callable JAX
        accepts as ``jax.checkpoint(policy=...)``.
      name: how results call it; default: the callable's qualified name.

    Returns:
      A :class:`Policy` that lowers to ``jax_policy`` itself.

    Raises:
      TypeError: if ``jax_policy`` is not callable.

    Example:
      >>> import jax
      >>> import remat_toolkit as rt
      >>> p = rt.Policy.from_jax(jax.checkpoint_policies.dots_saveable)
      >>> p.name, p.to_jax() is jax.checkpoint_policies.dots_saveable
      ('dots_saveable', True)
    """
    if not callable(jax_policy) or isinstance(jax_policy, Policy):
      raise TypeError(
          f"Policy.from_jax takes a JAX checkpoint policy (a callable such as "
          f"jax.checkpoint_policies.dots_saveable), got {jax_policy!r}.")
    if name is None:
      name = _jax_policy_name(jax_policy)
    return cls(name=name, jax_policy=jax_policy,
               description="a policy of JAX's own, used as given")

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.strip():
      raise TypeError(f"Policy.name must be a non-empty string, got {self.name!r}.")
    if not isinstance(self.description, str):
      raise TypeError(
          f"Policy.description must be a string, got {self.description!r}.")
    object.__setattr__(self, "save", _as_name_tuple("save", self.save))
    object.__setattr__(self, "offload", _as_name_tuple("offload", self.offload))
    object.__setattr__(self, "exclude", _as_name_tuple("exclude", self.exclude))
    object.__setattr__(self, "aliases", _as_name_tuple("aliases", self.aliases))
    if not isinstance(self.matmuls, str) or self.matmuls not in MATMUL_MODES:
      raise ValueError(
          f"Policy.matmuls must be one of {sorted(MATMUL_MODES)}, "
          f"got {self.matmuls!r}.")
    for field in ("offload_src", "offload_dst"):
      value = getattr(self, field)
      if value not in MEMORY_KINDS:
        raise ValueError(
            f"Policy.{field} must be one of {list(MEMORY_KINDS)}, got {value!r}.")
    if self.jax_policy is not None and (
        self.save or self.offload or self.exclude or self.matmuls != "none"
        or self.save_everything):
      raise ValueError(
          f"Policy {self.name!r} wraps a JAX policy and also sets "
          "save/offload/exclude/matmuls/save_everything; the JAX policy alone "
          "decides what is kept, so leave those fields at their defaults.")
    object.__setattr__(self, "regions", _as_regions(self.name, self.regions))
    if self.regions and (self.save or self.offload or self.exclude
                         or self.matmuls != "none" or self.save_everything
                         or self.jax_policy is not None):
      raise ValueError(
          f"Policy {self.name!r} assigns policies per region and also sets "
          "save/offload/exclude/matmuls/save_everything/jax_policy; a "
          "per-region policy decides through its regions alone, so leave "
          "those fields "
          "at their defaults (or add a region pattern '*' for the rest).")
    if not isinstance(self.save_everything, bool):
      raise TypeError(
          f"Policy.save_everything must be true or false, got "
          f"{self.save_everything!r}.")
    both = sorted(set(self.save) & set(self.offload))
    if both:
      raise ValueError(
          f"Policy {self.name!r}: {both} appear in both save and offload; "
          "a tensor is either kept on device or offloaded, remove it from one.")
    if self.matmuls != "none" and (self.save or self.offload):
      raise ValueError(
          f"Policy {self.name!r} sets matmuls={self.matmuls!r} together with "
          "save/offload names; no single JAX policy constructor expresses "
          "that union (under jax_remat3 a combined callable silently "
          "recomputes everything). Tag the matmul outputs and list their "
          "names in save instead.")
    if self.save_everything and (self.save or self.offload
                                 or self.matmuls != "none"):
      raise ValueError(
          f"Policy {self.name!r} sets save_everything together with "
          "save/offload/matmuls; save_everything already keeps everything.")

  # ------------------------------------------------------------ queries

  @property
  def key(self) -> str:
    """The normalised name used for lookup."""
    return normalize_name(self.name)

  @property
  def offloads(self) -> bool:
    """Whether this policy moves anything to host memory."""
    if self.regions:
      return any(p.offloads for _, p in self.regions)
    if self.jax_policy is not None:
      return compat.jax_policy_offloads(self.jax_policy)
    return bool(self.offload) or self.matmuls == "offload-no-batch"

  @property
  def is_jax_policy(self) -> bool:
    """Whether this wraps a policy of JAX's own (see :meth:`from_jax`)."""
    return self.jax_policy is not None

  @property
  def is_per_region(self) -> bool:
    """Whether this policy assigns a policy per region (see ``regions``)."""
    return bool(self.regions)

  def for_region(self, key: str) -> Policy | None:
    """The policy a region of key ``key`` takes; None if no pair matches.

    The first pair whose region is ``key``, or a glob matching it, wins.

    Example:
      >>> import remat_toolkit as rt
      >>> p = rt.Policy(name="mix", regions={"layers_0": "save-ffn",
      ...                                    "layers_*": "save-attention"})
      >>> p.for_region("layers_0").name, p.for_region("layers_7").name
      ('save-ffn', 'save-attention')
      >>> p.for_region("head") is None
      True
    """
    if not self.regions:
      return self
    for pattern, policy in self.regions:
      if region_keys.key_matches(key, pattern):
        return policy
    return None

  @property
  def patterns(self) -> tuple[str, ...]:
    """Every name and pattern this policy selects, kept or offloaded."""
    return self.save + self.offload

  def expand(self, names: Iterable[str] | None = None
             ) -> tuple[frozenset[str], frozenset[str]]:
    """Expands ``save``/``offload`` against ``names``.

    Matching ignores case (``*attention/q`` selects T5's
    ``layer/0/SelfAttention/q``), and the result holds the names as they are
    spelt in ``names``, which is what JAX compares exactly. Exact names are
    always kept as written, and also select the names present that differ
    from them only in case; glob patterns select the matching names present.

    Args:
      names: checkpoint names present in the function; default: the
        vocabulary, the MaxText names and every name tagged so far.

    Returns:
      ``(saved, offloaded)`` sets of concrete names.
    """
    pool = tags.known_names() if names is None else frozenset(names)
    return (_expand(self.save, pool, self.exclude),
            _expand(self.offload, pool, self.exclude))

  def matches(self, name: str) -> bool:
    """Whether checkpoint name ``name`` is selected by ``save`` or ``offload``
    (ignoring case, as :meth:`expand` does)."""
    if any(_name_matches(name, p) for p in self.exclude):
      return False
    return any(_name_matches(name, p) for p in self.patterns)

  def lowering(self, names: Iterable[str] | None = None,
               region: str | None = None) -> Lowering:
    """The JAX policy constructor call this policy lowers to, as data.

    Args:
      names: checkpoint names to expand glob patterns against (see
        :meth:`expand`).
      region: the key of the region being lowered; a per-region policy
        lowers the policy of that region (``nothing_saveable`` where none
        matches), other policies ignore it.

    Raises:
      ValueError: if patterns put one name in both save and offload, or a
        per-region policy is lowered without a region.
    """
    if self.regions:
      if region is None:
        raise ValueError(
            f"Policy {self.name!r} assigns policies per region, so it is "
            "lowered for one region at a time: pass region=, or let each "
            "remat region lower it when traced (rt.use_policy).")
      chosen = self.for_region(region)
      return (Lowering("nothing_saveable") if chosen is None
              else chosen.lowering(names))
    if self.jax_policy is not None:
      return Lowering(self.name, raw=self.jax_policy)
    if self.save_everything:
      return Lowering("everything_saveable")
    simple = {"all": "dots_saveable",
              "no-batch": "dots_with_no_batch_dims_saveable"}
    if self.matmuls in simple:
      return Lowering(simple[self.matmuls])
    if self.matmuls == "offload-no-batch":
      return Lowering("offload_dot_with_no_batch_dims",
                      (self.offload_src, self.offload_dst))
    saved, offloaded = self.expand(names)
    clash = sorted(saved & offloaded)
    if clash:
      raise ValueError(
          f"Policy {self.name!r}: the names {clash} match both a save and an "
          "offload pattern; make the patterns disjoint.")
    if offloaded:
      return Lowering("save_and_offload_only_these_names",
                      (tuple(sorted(saved)), tuple(sorted(offloaded)),
                       self.offload_src, self.offload_dst))
    if saved:
      return Lowering("save_only_these_names", tuple(sorted(saved)))
    return Lowering("nothing_saveable")

  def to_jax(self, names: Iterable[str] | None = None,
             region: str | None = None) -> Any:
    """Lowers to one of JAX's own policy constructors.

    Equal lowerings give the same JAX object on every supported JAX release,
    so JAX's caches (keyed on the policy) are shared.

    Args:
      names: checkpoint names to expand glob patterns against (see
        :meth:`expand`).
      region: the key of the region being lowered (see :meth:`lowering`).

    Returns:
      A ``jax.checkpoint_policies`` policy.

    Raises:
      ValueError: if the policy offloads and this JAX's ``jax_remat3`` (on)
        cannot offload (it would silently recompute everything), or if
        patterns put one name in both save and offload.
    """
    lowering = self.lowering(names, region)
    if lowering.offloads:
      reason = unrunnable_reason(self)
      if reason is not None:
        raise ValueError(reason)
    return lowering.to_jax()

  def describe_lowering(self, names: Iterable[str] | None = None) -> str:
    """The JAX call this policy lowers to, as source text (per region for a
    per-region policy)."""
    if self.regions:
      return "\n".join(f"{key}: {policy.describe_lowering(names)}"
                       for key, policy in self.regions)
    return str(self.lowering(names))

  def keeps_summary(self) -> str:
    """A short phrase for tables: what stays on device."""
    if self.regions:
      return "per region: " + _count_summary(self.regions)
    if self.jax_policy is not None:
      return f"what JAX's {self.name} keeps"
    if self.save_everything:
      return "everything"
    if self.matmuls in ("all", "no-batch"):
      return {"all": "all matmul outputs",
              "no-batch": "matmul outputs w/o batch dims"}[self.matmuls]
    if self.save:
      return ", ".join(self.save)
    return "region inputs only"

  def offloads_summary(self) -> str:
    """A short phrase for tables: what goes to host memory."""
    if self.regions:
      offloading = [(k, p) for k, p in self.regions if p.offloads]
      return ("per region: " + _count_summary(offloading)) if offloading else "-"
    if self.matmuls == "offload-no-batch":
      return "matmul outputs w/o batch dims"
    return ", ".join(self.offload) if self.offload else "-"


def _as_regions(name: str, regions: Any) -> tuple[tuple[str, Policy], ...]:
  """``regions`` as validated ``(key, Policy)`` pairs, in the order given."""
  if not regions:
    return ()
  given = list(regions.items()) if hasattr(regions, "items") else regions
  pairs: list[tuple[Any, ...]] | None = None
  if not isinstance(given, (str, bytes)):
    try:
      pairs = [tuple(pair) for pair in given]
    except TypeError:
      pairs = None
  if pairs is None or any(len(pair) != 2 for pair in pairs):
    raise TypeError(
        f"Policy.regions must map region keys to policies, got {regions!r}; "
        "e.g. regions={'layers_0': 'save-attention', 'layers_*': "
        "'boundary-only'}.")
  out = []
  for key, policy in pairs:
    if not isinstance(key, str) or not key:
      raise TypeError(
          f"Policy {name!r}: region keys must be non-empty strings (a module "
          f"path, a glob or '#k'), got {key!r}.")
    resolved = _region_policy(name, key, policy)
    out.append((key, resolved))
  return tuple(out)


# How a policy name becomes a Policy: the catalogue's lookup. The catalogue
# holds Policy values, so it sits above this module and installs its lookup
# here when it is imported (install_name_lookup); a per-region policy written
# with names reads it.
_name_lookup: Callable[[str], Policy] | None = None


def install_name_lookup(lookup: Callable[[str], Policy]) -> None:
  """Sets how policy names in ``regions`` (and policy files) are looked up."""
  global _name_lookup
  _name_lookup = lookup


def lookup_policy(name: str) -> Policy:
  """The policy called ``name`` (by the installed lookup: the catalogue's).

  Raises:
    ValueError: for an unknown name (the catalogue's message).
  """
  if _name_lookup is None:
    raise ValueError(f"no catalogue to look the policy {name!r} up in; "
                     "import remat_toolkit first.")
  return _name_lookup(name)


def _region_policy(name: str, key: str, policy: Any) -> Policy:
  if isinstance(policy, str):
    policy = lookup_policy(policy)
  elif callable(policy) and not isinstance(policy, Policy):
    policy = Policy.from_jax(policy)
  if not isinstance(policy, Policy):
    raise TypeError(
        f"Policy {name!r}: region {key!r} must map to a policy name, a "
        f"Policy or a jax.checkpoint_policies policy, got {policy!r}.")
  if policy.regions:
    raise ValueError(
        f"Policy {name!r}: region {key!r} maps to the per-region policy "
        f"{policy.name!r}; a region takes one policy, so give that region "
        "the policy its own key maps to.")
  return policy


def _count_summary(regions: Iterable[tuple[str, Policy]]) -> str:
  counts: dict[str, int] = {}
  for _, policy in regions:
    counts[policy.name] = counts.get(policy.name, 0) + 1
  return ", ".join(f"{name} x{count}" for name, count in counts.items())


def _jax_policy_name(jax_policy: Any) -> str:
  """``jax.checkpoint_policies``' own name for a policy, else its qualname."""
  # The documented names first: several are also exported under aliases.
  documented = ("everything_saveable", "nothing_saveable", "dots_saveable",
                "dots_with_no_batch_dims_saveable")
  for name in (*documented, *sorted(dir(jax.checkpoint_policies))):
    if not name.startswith("_") and getattr(
        jax.checkpoint_policies, name, None) is jax_policy:
      return name
  return (getattr(jax_policy, "__qualname__", None)
          or type(jax_policy).__name__)


def policy_of(value: Any) -> Policy | None:
  """The :class:`Policy` ``value`` is or carries (a plan's ``policy``), else
  None. A plan is known by what it holds, so this layer needs no planner."""
  if isinstance(value, Policy):
    return value
  carried = getattr(value, "policy", None)
  return carried if isinstance(carried, Policy) else None


def unrunnable_reason(policy: Policy) -> str | None:
  """Why ``policy`` cannot run on this JAX now, or None when it can.

  The one place this is decided, and the one message for it: entry points
  given one policy raise it as a ``ValueError``; those given many record it
  as a skipped policy and warn.
  """
  if not policy.offloads or not compat.offloading_unsupported():
    return None
  return (f"Policy {policy.name!r} offloads to host memory, but "
          f"{compat.offloading_refusal()}; or use a policy that saves "
          "instead of offloading.")


def _name_matches(name: str, pattern: str) -> bool:
  # Case is ignored: module paths are spelt SelfAttention in one model and
  # attn in another, and one catalogue serves both.
  return glob_match(name, pattern, ignore_case=True)


def _expand(patterns: tuple[str, ...], pool: frozenset[str],
            exclude: tuple[str, ...] = ()) -> frozenset[str]:
  out: set[str] = set()
  for p in patterns:
    if not is_glob(p):
      out.add(p)  # kept as written even when absent, as JAX would
    out.update(n for n in pool if _name_matches(n, p))
  return frozenset(n for n in out
                   if not any(_name_matches(n, e) for e in exclude))


@dataclasses.dataclass(frozen=True)
class Lowering:
  """A call of one of JAX's checkpoint-policy constructors, as data.

  The same value on every JAX release, whatever object that release's
  constructor returns (a class instance up to jax 0.11, a function from
  0.12), so lowerings can be compared, hashed and printed.

  Attributes:
    constructor: the name in ``jax.checkpoint_policies``.
    args: its arguments (for ``save_and_offload_only_these_names``: saved
      names, offloaded names, source and destination memory kinds).

  Example:
    >>> import remat_toolkit as rt
    >>> print(rt.Policy(name="p", matmuls="all").lowering())
    jax.checkpoint_policies.dots_saveable
  """

  constructor: str
  args: tuple = ()
  raw: Any = dataclasses.field(default=None, repr=False)

  def to_jax(self) -> Any:
    """The JAX policy object (one object per distinct lowering)."""
    if self.raw is not None:
      return self.raw
    return compat.jax_policy(self.constructor, *self.args)

  @property
  def saved_names(self) -> frozenset[str]:
    """Checkpoint names kept on device (empty for non-name policies)."""
    if self.constructor == "save_only_these_names":
      return frozenset(self.args)
    if self.constructor == "save_and_offload_only_these_names":
      return frozenset(self.args[0])
    return frozenset()

  @property
  def offloads(self) -> bool:
    """Whether the JAX policy moves residuals to host memory."""
    if self.raw is not None:
      return compat.jax_policy_offloads(self.raw)
    return self.constructor in ("offload_dot_with_no_batch_dims",
                                "save_and_offload_only_these_names")

  @property
  def offloaded_names(self) -> frozenset[str]:
    """Checkpoint names moved to host memory."""
    if self.constructor == "save_and_offload_only_these_names":
      return frozenset(self.args[1])
    return frozenset()

  def __str__(self) -> str:
    if self.raw is not None:
      return f"{self.constructor} (a JAX policy, used as given)"
    call = f"jax.checkpoint_policies.{self.constructor}"
    if self.constructor == "save_and_offload_only_these_names":
      saved, offloaded, src, dst = self.args
      return (f"{call}(\n"
              f"    names_which_can_be_saved={list(saved)!r},\n"
              f"    names_which_can_be_offloaded={list(offloaded)!r},\n"
              f"    offload_src={src!r}, offload_dst={dst!r})")
    if self.args or self.constructor in ("save_only_these_names",):
      return f"{call}({', '.join(repr(a) for a in self.args)})"
    return call


# ------------------------------------------------------------ the baselines
# Every result is measured against these two, so they are values of the
# code, not catalogue entries: the catalogue lists them, but no policy file
# can replace what "boundary-only" or "% of save-everything" means.

#: The least a remat region can keep: its inputs. Also the ambient policy
#: when no ``use_policy`` block is active.
BOUNDARY_ONLY = Policy(
    name="boundary-only",
    description=("Least memory: keeps only each remat region's inputs and "
                 "recomputes the whole region in the backward pass (about "
                 "one extra forward pass); use when activations do not fit "
                 "any other way."),
    aliases=("full", "save_nothing", "nothing-saveable"))

#: The reference every "% of save-everything" figure is relative to.
SAVE_EVERYTHING = Policy(
    name="save-everything",
    description=("No recomputation and the most activation memory: the "
                 "baseline every comparison is measured against; use when "
                 "memory is not the constraint."),
    aliases=("everything-saveable", "no-remat"), save_everything=True)

#: The baselines, which the catalogue holds from the start.
BASELINES: tuple[Policy, ...] = (BOUNDARY_ONLY, SAVE_EVERYTHING)
