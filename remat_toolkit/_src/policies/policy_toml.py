"""Policy files: the TOML reader and writer, side by side.

The catalogue reads built-in and user policy files with
:func:`parse_policy_file`; ``rt.save_policy`` writes them with
:func:`policy_toml`. Both know the same keys, so what one writes the other
reads back equal.

``exclude`` lists names or globs that ``save``/``offload`` never select, even
where one of their globs matches (a squeeze-and-excitation gate named
``attention`` is not attention).

A per-region policy has a ``[regions]`` table (region key or glob -> policy
name, in order) and may define the policies it names in ``[[policies]]``
tables; names not defined there are looked up in the catalogue when the
file is read.

Example:
  >>> import tomllib
  >>> import remat_toolkit as rt
  >>> from remat_toolkit._src.policies import policy_toml
  >>> p = rt.Policy(name="mine", save=["attn.q", "attn.k"])
  >>> text = policy_toml.policy_toml(p)
  >>> policy_toml.policy_from_mapping(tomllib.loads(text)) == p
  True
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat_toolkit._src.policies.policy import MATMUL_MODES
from remat_toolkit._src.policies.policy import MEMORY_KINDS
from remat_toolkit._src.policies.policy import Policy
from remat_toolkit._src.policies.policy import lookup_policy
from remat_toolkit._src.policies.policy import normalize_name

__all__ = ["parse_policy_file", "policy_from_mapping", "policy_toml",
           "policy_record"]

# What each key of a policy file holds, as error messages say it.
_FIELDS: dict[str, str] = {
    "name": "a string",
    "description": "a string",
    "aliases": "a list of strings",
    "save": "a list of checkpoint names or glob patterns",
    "offload": "a list of checkpoint names or glob patterns",
    "exclude": "a list of checkpoint names or glob patterns save/offload never select",
    "matmuls": f"one of {sorted(MATMUL_MODES)}",
    "offload_src": f"one of {list(MEMORY_KINDS)}",
    "offload_dst": f"one of {list(MEMORY_KINDS)}",
    "save_everything": "true or false",
    "regions": "a table of region key (or glob) = policy name",
    "policies": "an array of policy tables ([[policies]])",
}
_TYPES: dict[str, type[Any]] = {
    "name": str, "description": str, "aliases": list, "save": list,
    "offload": list, "exclude": list, "matmuls": str, "offload_src": str, "offload_dst": str,
    "save_everything": bool, "regions": dict, "policies": list,
}


# ===================================================================== reader

def parse_policy_file(path: str | os.PathLike) -> Policy:
  """Reads one policy from a TOML file, validating every key.

  Raises:
    ValueError: naming the file, the key and what was expected.
  """
  path = Path(path)
  try:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
  except tomllib.TOMLDecodeError as e:
    raise ValueError(f"{path}: not valid TOML ({e}).") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not a UTF-8 text file ({e}).") from None
  return policy_from_mapping(data, source=str(path))


def policy_from_mapping(data: Mapping[str, Any], *, source: str = "policy"
                        ) -> Policy:
  """Builds a :class:`Policy` from parsed TOML, with errors naming ``source``."""
  unknown = sorted(set(data) - set(_FIELDS))
  if unknown:
    raise ValueError(
        f"{source}: unknown key(s) {unknown}; a policy file may contain "
        f"{', '.join(_FIELDS)}.")
  if "name" not in data:
    raise ValueError(f"{source}: missing key 'name' (expected {_FIELDS['name']}).")
  for key, value in data.items():
    if not isinstance(value, _TYPES[key]):
      raise ValueError(
          f"{source}: key {key!r} must be {_FIELDS[key]}, got {value!r}.")
    item_type = {"policies": dict, "regions": str}.get(key, str)
    items = value.values() if key == "regions" else value
    if _TYPES[key] in (list, dict) and not all(
        isinstance(v, item_type) for v in items):
      raise ValueError(
          f"{source}: key {key!r} must be {_FIELDS[key]}, got {value!r}.")
  fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                            for k, v in data.items()
                            if k not in ("regions", "policies")}
  if "policies" in data and "regions" not in data:
    raise ValueError(f"{source}: key 'policies' defines the policies of a "
                     "per-region policy, but there is no [regions] table.")
  if "regions" in data:
    fields["regions"] = _regions(data, source)
  try:
    return Policy(**fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{source}: {e}") from None


def _regions(data: Mapping[str, Any], source: str) -> list[tuple[str, Any]]:
  """The ``[regions]`` table with its policy names resolved: those defined
  in the file's ``[[policies]]`` first, then the catalogue's."""
  defined: dict[str, Policy] = {}
  for i, table in enumerate(data.get("policies", [])):
    policy = policy_from_mapping(table, source=f"{source} [[policies]] #{i}")
    if policy.is_per_region:
      raise ValueError(f"{source}: [[policies]] #{i} ({policy.name!r}) is "
                       "per-region itself; a region takes one policy.")
    defined[policy.key] = policy
  out = []
  for region, name in data["regions"].items():
    found = defined.get(normalize_name(name))
    if found is None:
      try:
        found = lookup_policy(name)
      except ValueError as e:
        raise ValueError(
            f"{source}: region {region!r} names the policy {name!r}, which "
            f"neither the file's [[policies]] nor the catalogue defines: "
            f"{e}") from None
    out.append((region, found))
  return out


# ===================================================================== writer

def policy_toml(policy: Policy) -> str:
  """The policy as a policy file's text: the keys that differ from defaults.

  Raises:
    ValueError: for a policy wrapping a JAX policy, which no file can hold.
  """
  if policy.is_jax_policy:
    raise ValueError(
        f"Policy {policy.name!r} wraps a JAX policy object, which a policy "
        "file cannot hold; write its save/offload names as a Policy instead.")
  if policy.is_per_region:
    return _per_region_toml(policy)
  lines = [f"name = {_toml_string(policy.name)}",
           f"description = {_toml_string(policy.description)}"]
  if policy.aliases:
    lines.append(f"aliases = {_toml_list(policy.aliases)}")
  if policy.save:
    lines.append(f"save = {_toml_list(policy.save)}")
  if policy.offload:
    lines.append(f"offload = {_toml_list(policy.offload)}")
  if policy.exclude:
    lines.append(f"exclude = {_toml_list(policy.exclude)}")
  if policy.matmuls != "none":
    lines.append(f"matmuls = {_toml_string(policy.matmuls)}")
  if policy.save_everything:
    lines.append("save_everything = true")
  if policy.offload_src != "device":
    lines.append(f"offload_src = {_toml_string(policy.offload_src)}")
  if policy.offload_dst != "pinned_host":
    lines.append(f"offload_dst = {_toml_string(policy.offload_dst)}")
  return "\n".join(lines)


def _per_region_toml(policy: Policy) -> str:
  """A per-region policy: its regions by policy name, and the policies the
  catalogue does not hold as they are, defined in the file."""
  lines = [f"name = {_toml_string(policy.name)}",
           f"description = {_toml_string(policy.description)}"]
  if policy.aliases:
    lines.append(f"aliases = {_toml_list(policy.aliases)}")
  lines += ["", "[regions]"]
  defined: dict[str, Policy] = {}
  for region, sub in policy.regions:
    lines.append(f"{_toml_string(region)} = {_toml_string(sub.name)}")
    try:
      known = lookup_policy(sub.name) == sub
    except ValueError:
      known = False
    if not known:
      if defined.setdefault(sub.key, sub) != sub:
        raise ValueError(
            f"Policy {policy.name!r} gives regions two different policies "
            f"named {sub.name!r}; a file names each policy once, so rename "
            "one of them.")
  for sub in defined.values():
    lines += ["", "[[policies]]", policy_toml(sub)]
  return "\n".join(lines)


def policy_record(policy: Policy) -> dict[str, Any]:
  """The policy as plain data (JSON), every key a policy file may hold but
  ``aliases``; :func:`policy_from_mapping` reads it back."""
  if policy.is_per_region:
    return {"name": policy.name, "description": policy.description,
            "regions": {region: sub.name for region, sub in policy.regions},
            "policies": [policy_record(sub) for sub in
                         {s.key: s for _, s in policy.regions}.values()]}
  return {"name": policy.name, "description": policy.description,
          "save": list(policy.save), "offload": list(policy.offload),
          "exclude": list(policy.exclude),
          "matmuls": policy.matmuls, "save_everything": policy.save_everything,
          "offload_src": policy.offload_src, "offload_dst": policy.offload_dst}


def _toml_string(text: str) -> str:
  # JSON string escapes (\" \\ \n \uXXXX) are valid TOML basic strings.
  return json.dumps(text)


def _toml_list(items: Sequence[str]) -> str:
  return "[\n" + "".join(f"  {_toml_string(i)},\n" for i in items) + "]"
