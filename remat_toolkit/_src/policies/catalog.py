"""The catalogue of named policies: built-ins, user files, lookup by name.

Built-in policies are TOML files shipped with the package. Users add their own
with :func:`load_policies` or the ``REMAT_TOOLKIT_POLICY_PATH`` variable
(paths separated by ``os.pathsep``, each a file or a folder of ``*.toml``).

Example:
  >>> import remat_toolkit as rt
  >>> rt.get_policy("MINIMAL").name
  'save-projections'
  >>> "boundary-only" in rt.list_policies()
  True
"""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from remat_toolkit._src.core.checks import check_flag
from remat_toolkit._src.policies.policy import BASELINES
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.policy import install_name_lookup
from remat_toolkit._src.policies.policy import normalize_name
from remat_toolkit._src.policies.policy import policy_of
from remat_toolkit._src.policies.policy_toml import parse_policy_file
from remat_toolkit._src.policies.policy_toml import policy_toml

# parse_policy_file lives beside the writer in policy_toml; the command line
# and the tests still reach it as catalog.parse_policy_file.

__all__ = ["get_policy", "list_policies", "load_policies", "register_policy",
           "save_policy",
           "policy_source", "aliases", "isolated", "POLICY_PATH_ENV",
           "builtin_policy_dir"]

POLICY_PATH_ENV = "REMAT_TOOLKIT_POLICY_PATH"

#: Where the catalogue says the baselines come from.
BUILT_IN = "built in (the baseline every result is measured against)"


def builtin_policy_dir() -> Path:
  """Folder of the built-in policy files (wheel or source checkout)."""
  package = Path(__file__).resolve().parents[2]  # remat_toolkit/
  installed = package / "_builtin_policies"
  if installed.is_dir():
    return installed
  return package.parent / "policies"


class _Registry:
  """Policies by normalised name, plus aliases; updated all-or-nothing."""

  def __init__(self):
    self._lock = threading.RLock()
    self._policies: dict[str, Policy] = {}
    self._aliases: dict[str, str] = {}
    self._sources: dict[str, str] = {}
    self._loaded_env: str | None = None
    self._builtins_loaded = False

  def copy(self) -> _Registry:
    """An independent registry holding the same policies."""
    self._ensure_loaded()
    with self._lock:
      other = _Registry()
      other._policies = dict(self._policies)
      other._aliases = dict(self._aliases)
      other._sources = dict(self._sources)
      other._loaded_env = self._loaded_env
      other._builtins_loaded = self._builtins_loaded
      return other

  def aliases(self) -> dict[str, str]:
    with self._lock:
      return dict(self._aliases)

  def _ensure_loaded(self) -> None:
    with self._lock:
      if not self._builtins_loaded:
        self._builtins_loaded = True
        self.add([(p, BUILT_IN) for p in BASELINES]
                 + _read_path(builtin_policy_dir()), override=False)
      env = os.environ.get(POLICY_PATH_ENV, "")
      if env and env != self._loaded_env:
        loaded: list[tuple[Policy, str]] = []
        for part in env.split(os.pathsep):
          if part:
            loaded.extend(_read_path(Path(part), origin=POLICY_PATH_ENV))
        self.add(loaded, override=True)
        # Only once it loaded: a bad file keeps raising until it is fixed.
        self._loaded_env = env

  def add(self, items: list[tuple[Policy, str]], *, override: bool) -> None:
    with self._lock:
      policies = dict(self._policies)
      aliases = dict(self._aliases)
      sources = dict(self._sources)
      for policy, source in items:
        keys = [policy.key, *(normalize_name(a) for a in policy.aliases)]
        for i, key in enumerate(keys):
          owner = aliases.get(key, key if key in policies else None)
          if owner is None:
            continue
          field = "name" if i == 0 else "aliases"
          if sources.get(owner) == BUILT_IN:
            raise ValueError(
                f"{source}: key {field!r}: policy name {key!r} is the built-in "
                f"{owner!r}, the baseline every result is measured against, "
                "which no policy replaces; name your policy differently.")
          if not override:
            raise ValueError(
                f"{source}: key {field!r}: policy name {key!r} already exists "
                f"(defined in {sources.get(owner, 'the catalogue')}); rename it "
                "or load with override=True to replace it.")
          # Overriding a policy's name replaces that policy; overriding one of
          # its aliases only moves the alias, the policy itself stays.
          if key in aliases:
            del aliases[key]
          else:
            _drop(key, policies, aliases, sources)
        if policy.key in policies:
          _drop(policy.key, policies, aliases, sources)
        policies[policy.key] = policy
        sources[policy.key] = source
        for alias in keys[1:]:
          aliases[alias] = policy.key
      self._policies, self._aliases, self._sources = policies, aliases, sources

  def get(self, name: str) -> Policy:
    self._ensure_loaded()
    key = normalize_name(name)
    with self._lock:
      key = self._aliases.get(key, key)
      if key in self._policies:
        return self._policies[key]
      valid = sorted(self._policies)
      aliases = sorted(self._aliases)
    close = difflib.get_close_matches(key, valid + aliases, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    # Suggestions may be aliases, so the list names them too.
    raise ValueError(
        f"Unknown remat policy {name!r}.{hint} Valid names: {', '.join(valid)}; "
        f"their aliases: {', '.join(aliases)} (run `remat-toolkit list`, or "
        "add your own with remat_toolkit.load_policies(path)).")

  def names(self) -> list[str]:
    self._ensure_loaded()
    with self._lock:
      return sorted(self._policies)

  def source(self, name: str) -> str:
    key = self.get(name).key
    with self._lock:
      return self._sources[key]


def _drop(key: str, policies: dict, aliases: dict, sources: dict) -> None:
  policies.pop(key, None)
  sources.pop(key, None)
  for alias in [a for a, k in aliases.items() if k == key]:
    del aliases[alias]


_REGISTRY = _Registry()


@contextlib.contextmanager
def isolated(*, fresh: bool = False) -> Iterator[None]:
  """The catalogue inside the block is put back as it was afterwards.

  The catalogue is process-global; tests and examples that register or load
  policies run inside this so they leave nothing behind.

  Args:
    fresh: start the block from the built-ins alone (no policies registered
      or loaded before it).
  """
  global _REGISTRY
  saved = _REGISTRY
  _REGISTRY = _Registry() if fresh else saved.copy()
  try:
    yield
  finally:
    _REGISTRY = saved


def aliases() -> dict[str, str]:
  """Every alias and the canonical name it stands for."""
  _REGISTRY._ensure_loaded()
  return _REGISTRY.aliases()


def get_policy(name: str | Policy) -> Policy:
  """Looks a policy up by name or alias (case-insensitive, ``-`` = ``_``).

  Args:
    name: a policy name or alias, or a :class:`Policy` (returned as is).

  Returns:
    The :class:`Policy`.

  Raises:
    ValueError: for an unknown name, listing the closest and all valid names.
    TypeError: if ``name`` is neither a string nor a Policy.

  Example:
    >>> import remat_toolkit as rt
    >>> rt.get_policy("save_qkv_proj").name
    'save-qkv'
  """
  if isinstance(name, Policy):
    return name
  if not isinstance(name, str):
    raise TypeError(
        f"A policy is chosen by name (a string) or given as a "
        f"remat_toolkit.Policy, got {name!r} of type {type(name).__name__}; "
        "e.g. policy='save-attention'.")
  return _REGISTRY.get(name)


def list_policies() -> list[str]:
  """The canonical names of every policy in the catalogue, sorted.

  Example:
    >>> import remat_toolkit as rt
    >>> [p for p in rt.list_policies() if p.startswith("save-ffn")]
    ['save-ffn']
  """
  return _REGISTRY.names()


def policy_source(name: str) -> str:
  """The file a policy was read from (or ``"python"``)."""
  return _REGISTRY.source(name)


def load_policies(path: str | os.PathLike, *, override: bool = False
                  ) -> list[Policy]:
  """Adds the policies in a TOML file, or in every ``*.toml`` of a folder.

  Either every policy in ``path`` is added or, on any error, none is.

  Args:
    path: a ``.toml`` file or a folder of them.
    override: replace existing policies of the same name or alias.

  Returns:
    The policies added.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    ValueError: for a malformed file, naming the file, the key and what was
      expected, or a name that exists already without ``override=True``.

  Example:
    >>> import pathlib, tempfile
    >>> import remat_toolkit as rt
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "keep-q.toml").write_text(
    ...     "name = 'keep-q'\\nsave = ['attn.q']\\n")
    >>> [p.name for p in rt.load_policies(folder)]
    ['keep-q']
    >>> rt.get_policy("keep_q").save
    ('attn.q',)
  """
  check_flag("override", override)
  _REGISTRY._ensure_loaded()
  items = _read_path(Path(path))
  _REGISTRY.add(items, override=override)
  return [p for p, _ in items]


def register_policy(policy: Any, *, override: bool = False) -> Policy:
  """Adds a :class:`Policy` built in Python, or a plan's, to the catalogue.

  Plans (:func:`remat_toolkit.plan`) are not registered on their own, to
  keep the catalogue to what the user chose: register one to use it by name.

  Args:
    policy: the policy to add, or a plan (its ``policy``).
    override: replace an existing policy of the same name or alias.

  Returns:
    The :class:`Policy` added, so the call can wrap its construction.

  Raises:
    TypeError: if ``policy`` is neither a :class:`Policy` nor a plan.
    ValueError: if its name or an alias exists already without
      ``override=True``.

  Example:
    >>> import remat_toolkit as rt
    >>> _ = rt.register_policy(rt.Policy(name="keep-ffn-up", save=["ffn.up"]))
    >>> "keep-ffn-up" in rt.list_policies()
    True
  """
  check_flag("override", override)
  resolved = _policy_argument("register_policy", policy)
  _REGISTRY._ensure_loaded()
  _REGISTRY.add([(resolved, "python")], override=override)
  return resolved


def save_policy(policy: Any, path: str | os.PathLike) -> Path:
  """Writes a :class:`Policy`, or a plan's, as a policy file.

  :func:`load_policies` reads it back equal; ``--policy-file`` and every
  ``policy=`` argument take the path too.

  Args:
    policy: the policy to write, or a plan (its ``policy``, whose
      description says what the plan keeps and recomputes).
    path: the ``.toml`` file to write.

  Returns:
    The path written.

  Raises:
    TypeError: if ``policy`` is neither a :class:`Policy` nor a plan.
    ValueError: if ``path`` is a folder, or the policy wraps a JAX policy
      object (which no file can hold).

  Example:
    >>> import pathlib, tempfile
    >>> import remat_toolkit as rt
    >>> mine = rt.Policy(name="keep-ffn-up", save=["ffn.up"])
    >>> with tempfile.TemporaryDirectory() as folder:
    ...   path = rt.save_policy(mine, pathlib.Path(folder) / "mine.toml")
    ...   rt.load_policies(path) == [mine]
    True
  """
  resolved = _policy_argument("save_policy", policy)
  path = Path(path)
  if path.is_dir():
    raise ValueError(
        f"save_policy needs a file path, got the folder {str(path)!r}; write "
        f"e.g. {str(path / (resolved.name + '.toml'))!r}.")
  text = policy_toml(resolved)
  path.write_text(f"# Written by remat_toolkit.save_policy.\n{text}\n",
                  encoding="utf-8")
  return path


def _policy_argument(function: str, value: Any) -> Policy:
  policy = policy_of(value)
  if policy is None:
    raise TypeError(
        f"{function} takes a remat_toolkit.Policy or a plan, got {value!r}; "
        f"build one first, e.g. rt.{function}(rt.Policy(name='mine', "
        "save=['attn.q'])), or read a file with rt.load_policies(path).")
  return policy


def _read_path(path: Path, origin: str | None = None) -> list[tuple[Policy, str]]:
  if not path.exists():
    where = f" (from {origin})" if origin else ""
    raise FileNotFoundError(
        f"Policy path {str(path)!r}{where} does not exist; give a .toml file or "
        "a folder of .toml files.")
  files = sorted(path.glob("*.toml")) if path.is_dir() else [path]
  items = [(parse_policy_file(f), str(f)) for f in files]
  seen: dict[str, str] = {}
  for policy, source in items:
    for key in [policy.key, *(normalize_name(a) for a in policy.aliases)]:
      if key in seen:
        raise ValueError(
            f"{source}: policy name {key!r} is also defined in {seen[key]}; "
            "each name and alias must be unique.")
      seen[key] = source
  return items


# Names in a per-region policy (and in a policy file's [regions]) are looked
# up here.
install_name_lookup(get_policy)
