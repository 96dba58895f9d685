"""Bad input, everywhere: one table of what each public entry point rejects.

Every row calls one public function (or CLI command) with one bad input and
states the error it must raise and what its message must say: the offending
value and the fix. Every row also checks that the error is ours (a builtin
``ValueError``/``TypeError``/``FileNotFoundError``, never a JAX-internal
exception), fits on one line, and left no partial state behind (catalogue
and ambient policy unchanged). The table of bad inputs in docs/how-to/verify.md is this one.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from shared_helpers import policy_sources
from shared_helpers import remat3
from shared_helpers import remat3_offloads
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models

POLICY_PATH_ENV = "REMAT_TOOLKIT_POLICY_PATH"

S = jax.ShapeDtypeStruct
W = S((4, 4), jnp.float32)
X = S((2, 4), jnp.float32)
W_INT = S((4, 4), jnp.int32)
X_INT = S((2, 4), jnp.int32)


@rt.remat
def _block(w, x):
  return jnp.tanh(rt.tag(x @ w, "ffn.up"))


def good_loss(w, x):
  return _block(w, x).sum()


def two_block_loss(w, x):
  return _block(w, _block(w, x)).sum()  # keeps an activation between them


def vector_loss(w, x):
  return _block(w, x)  # not reduced to a scalar


def int_loss(w, x):
  return (x @ w).sum().astype(jnp.float32)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(x)


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _Block()(x)


def _custom_vjp_kernel():
  kernel = jax.custom_vjp(jnp.sin)
  kernel.defvjp(lambda x: (jnp.sin(x), (jnp.cos(x),)),
                lambda res, g: (res[0] * g,))
  return kernel


def _init_with_rules(rules, strict):
  model = rt.remat_modules(_Model(), rules, strict=strict)
  return model.init(jax.random.key(0), jnp.ones((2, 4)))


@dataclasses.dataclass(frozen=True)
class Case:
  """One bad input: where it goes, what it is, what must be raised."""

  where: str
  bad_input: str
  call: Callable[[], Any]
  error: type[Exception]
  says: tuple[str, ...]  # regexes the message must match (value, fix)


CASES = [
    # ---- non-scalar loss
    Case("analyze", "loss returns a vector",
         lambda: rt.analyze(vector_loss, W, X), ValueError,
         (r"scalar", r"float32\[2, ?4\]", r"loss\.mean\(\)")),
    Case("compare", "loss returns a vector",
         lambda: rt.compare(vector_loss, W, X, policies=["save-ffn"]),
         ValueError, (r"scalar", r"float32\[2, ?4\]", r"loss\.mean\(\)")),
    Case("verify", "loss returns a vector",
         lambda: rt.verify(vector_loss, W, X), ValueError,
         (r"scalar", r"float32\[2, ?4\]", r"loss\.mean\(\)")),
    Case("plan", "loss returns a vector",
         lambda: rt.plan(vector_loss, W, X, budget="1MiB"), ValueError,
         (r"scalar", r"float32\[2, ?4\]", r"loss\.mean\(\)")),
    Case("memory_breakdown", "loss returns a vector",
         lambda: rt.memory_breakdown(vector_loss, W, X), ValueError,
         (r"scalar", r"float32\[2, ?4\]", r"loss\.mean\(\)")),
    Case("frontier", "loss returns a vector",
         lambda: rt.frontier(vector_loss, W, X), ValueError,
         (r"scalar", r"float32\[2, ?4\]", r"loss\.mean\(\)")),
    # ---- no floating-point input
    Case("analyze", "no floating-point argument",
         lambda: rt.analyze(int_loss, W_INT, X_INT), ValueError,
         (r"floating-point", r"pass the parameters")),
    Case("compare", "no floating-point argument",
         lambda: rt.compare(int_loss, W_INT, X_INT), ValueError,
         (r"floating-point", r"pass the parameters")),
    Case("verify", "no floating-point argument",
         lambda: rt.verify(int_loss, W_INT, X_INT), ValueError,
         (r"floating-point", r"pass the parameters")),
    Case("plan", "no floating-point argument",
         lambda: rt.plan(int_loss, W_INT, X_INT, budget="1MiB"), ValueError,
         (r"floating-point", r"pass the parameters")),
    Case("memory_breakdown", "no floating-point argument",
         lambda: rt.memory_breakdown(int_loss, W_INT, X_INT), ValueError,
         (r"floating-point", r"pass the parameters")),
    # The parameters are checked before fn is traced: an integer in their
    # place would fail inside fn, in JAX's words.
    Case("peak", "an integer where the parameters go",
         lambda: rt.peak(good_loss, 3, X), ValueError,
         (r"first argument", r"floating-point", r"pass the parameters first")),
    Case("compare", "peak=True, integer parameters",
         lambda: rt.compare(good_loss, W_INT, X, peak=True), ValueError,
         (r"first argument", r"floating-point", r"pass the parameters first")),
    Case("analyze", "argument leaf is a string",
         lambda: rt.analyze(good_loss, W, "x"), TypeError,
         (r"'x'", r"ShapeDtypeStruct", r"functools\.partial")),
    # ---- None or a non-string policy where a name is required
    Case("get_policy", "None", lambda: rt.get_policy(None), TypeError,
         (r"None", r"policy='save-attention'")),
    Case("get_policy", "an int", lambda: rt.get_policy(3), TypeError,
         (r"\b3\b", r"policy='save-attention'")),
    Case("use_policy", "None", lambda: rt.use_policy(None).__enter__(),
         TypeError, (r"None", r"rt\.use_policy\('save-ffn'\)")),
    Case("analyze", "policy=3", lambda: rt.analyze(good_loss, W, X, policy=3),
         TypeError, (r"\b3\b", r"policy='save-attention'")),
    Case("compare", "policies='save-ffn' (a string, not a list)",
         lambda: rt.compare(good_loss, W, X, policies="save-ffn"), TypeError,
         (r"'save-ffn'", r"policies=\['save-ffn'\]")),
    Case("compare", "policies=[3]",
         lambda: rt.compare(good_loss, W, X, policies=[3]), TypeError,
         (r"\b3\b", r"policies", r"'save-attention'")),
    Case("verify", "policy=3", lambda: rt.verify(good_loss, W, X, policy=3),
         TypeError, (r"\b3\b", r"policy='save-attention'")),
    Case("verify", "rtol='tight'",
         lambda: rt.verify(good_loss, W, X, rtol="tight"), TypeError,
         (r"'tight'", r"rtol=1e-5")),
    Case("verify", "rtol=-1", lambda: rt.verify(good_loss, W, X, rtol=-1.0),
         ValueError, (r"-1\.0", r"rtol=1e-5")),
    Case("memory_breakdown", "policy=3",
         lambda: rt.memory_breakdown(good_loss, W, X, policy=3), TypeError,
         (r"\b3\b", r"policy='save-attention'")),
    Case("remat", "policy=3",
         lambda: rt.remat(lambda x: x, policy=3), TypeError,
         (r"\b3\b", r"policy='save-attention'")),
    Case("remat_modules", "a rule's policy is 3",
         lambda: rt.remat_modules(_Model(), {"_Block": 3}), TypeError,
         (r"\b3\b", r"policy='save-attention'")),
    Case("register_policy", "a name instead of a Policy",
         lambda: rt.register_policy("save-ffn"), TypeError,
         (r"'save-ffn'", r"Policy\(name=")),
    Case("Policy", "name=None", lambda: rt.Policy(name=None), TypeError,
         (r"None", r"non-empty string")),
    Case("Policy", "save='attn.q' (a string, not a list)",
         lambda: rt.Policy(name="p", save="attn.q"), TypeError,
         (r"'attn\.q'", r"save=\['attn\.q', 'ffn\.\*'\]")),
    Case("tag", "name=None", lambda: rt.tag(jnp.ones(2), None), TypeError,
         (r"None", r"'ffn\.up'")),
    # ---- unknown policy name (ambient or explicit)
    Case("use_policy", "unknown name",
         lambda: rt.use_policy("save-atention").__enter__(), ValueError,
         (r"'save-atention'", r"Did you mean 'save-attention'")),
    Case("get_policy", "unknown name", lambda: rt.get_policy("nope"),
         ValueError, (r"'nope'", r"Valid names: boundary-only")),
    Case("analyze", "unknown policy",
         lambda: rt.analyze(good_loss, W, X, policy="nope"), ValueError,
         (r"'nope'", r"Valid names: boundary-only")),
    Case("compare", "unknown policy in the list",
         lambda: rt.compare(good_loss, W, X, policies=["save-ffn", "nope"]),
         ValueError, (r"'nope'", r"Valid names: boundary-only")),
    Case("verify", "unknown policy",
         lambda: rt.verify(good_loss, W, X, policy="nope"), ValueError,
         (r"'nope'", r"Valid names: boundary-only")),
    Case("remat", "unknown policy",
         lambda: rt.remat(lambda x: x, policy="nope"), ValueError,
         (r"'nope'", r"Valid names: boundary-only")),
    Case("remat_modules", "unknown policy in a rule",
         lambda: rt.remat_modules(_Model(), {"_Block": "nope"}), ValueError,
         (r"'nope'", r"Valid names: boundary-only")),
    Case("verify", "an offloading policy under jax_remat3",
         lambda: _under_remat3(lambda: rt.verify(
             good_loss, W, X, policy="offload-qkv", check_values=False)),
         ValueError, (r"'offload-qkv'", r"jax 0\.", r"jax_remat3', False")),
    Case("analyze", "an offloading policy under jax_remat3",
         lambda: _under_remat3(lambda: rt.analyze(
             good_loss, W, X, policy="offload-qkv")),
         ValueError, (r"'offload-qkv'", r"jax 0\.", r"jax_remat3', False")),
    Case("memory_breakdown", "an offloading policy under jax_remat3",
         lambda: _under_remat3(lambda: rt.memory_breakdown(
             good_loss, W, X, policy="offload-qkv")),
         ValueError, (r"'offload-qkv'", r"jax 0\.", r"jax_remat3', False")),
    Case("get_policy", "a misspelt alias",
         lambda: rt.get_policy("save_qkv_prj"), ValueError,
         (r"Did you mean 'save-qkv-proj'", r"their aliases: .*save-qkv-proj")),
    # ---- budgets
    Case("plan", "budget='lots'",
         lambda: rt.plan(good_loss, W, X, budget="lots"), ValueError,
         (r"'lots'", r"'512MiB'")),
    Case("plan", "budget='-1'", lambda: rt.plan(good_loss, W, X, budget="-1"),
         ValueError, (r"cannot be negative", r"'-1'")),
    Case("plan", "budget=float('nan')",
         lambda: rt.plan(good_loss, W, X, budget=float("nan")), ValueError,
         (r"must be finite",)),
    Case("plan", "budget=-1", lambda: rt.plan(good_loss, W, X, budget=-1),
         ValueError, (r"-1", r"'\d+(MiB|GiB)'")),
    Case("plan", "budget below the smallest achievable",
         lambda: rt.plan(two_block_loss, W, X, budget=1), ValueError,
         (r"\b1\b|1 B", r"smallest|least|at least")),
    Case("frontier", "budgets='lots'",
         lambda: rt.frontier(good_loss, W, X, budgets="lots"), (TypeError,
                                                               ValueError),
         (r"'lots'", r"sizes")),
    Case("largest_batch", "budget='lots'",
         lambda: rt.largest_batch("tiny", budget="lots", progress=False),
         ValueError, (r"'lots'", r"'512MiB'")),
    # ---- per-region plans and policies
    Case("plan", "per_layer='yes'",
         lambda: rt.plan(good_loss, W, X, budget="1MiB", per_layer="yes"),
         TypeError, (r"per_layer", r"'yes'", r"True or False")),
    Case("plan", "per_device=1",
         lambda: rt.plan(good_loss, W, X, budget="1MiB", per_device=1),
         TypeError, (r"per_device", r"\b1\b", r"True or False")),
    Case("plan", "per_device=True with unsharded arguments",
         lambda: rt.plan(good_loss, W, X, budget="1MiB", per_device=True),
         ValueError, (r"no sharding", r"NamedSharding\(mesh", r"drop per_device")),
    Case("frontier", "per_layer=1",
         lambda: rt.frontier(good_loss, W, X, per_layer=1), TypeError,
         (r"per_layer", r"\b1\b", r"True or False")),
    # A truthy string would silently mean True.
    Case("analyze", "compile='yes'",
         lambda: rt.analyze(good_loss, W, X, compile="yes"), TypeError,
         (r"compile", r"'yes'", r"True or False")),
    Case("compare", "peak='no'",
         lambda: rt.compare(good_loss, W, X, peak="no"), TypeError,
         (r"peak", r"'no'", r"True or False")),
    Case("peak", "compile=1",
         lambda: rt.peak(good_loss, W, X, compile=1), TypeError,
         (r"compile", r"\b1\b", r"True or False")),
    Case("memory_breakdown", "compile=None",
         lambda: rt.memory_breakdown(good_loss, W, X, compile=None), TypeError,
         (r"compile", r"None", r"True or False")),
    Case("verify", "strict='no'",
         lambda: rt.verify(good_loss, W, X, strict="no"), TypeError,
         (r"strict", r"'no'", r"True or False")),
    Case("Policy", "regions={'layers_0': 3}",
         lambda: rt.Policy(name="p", regions={"layers_0": 3}), TypeError,
         (r"'layers_0'", r"\b3\b", r"policy name, a Policy")),
    Case("Policy", "regions='layers_0'",
         lambda: rt.Policy(name="p", regions="layers_0"), TypeError,
         (r"'layers_0'", r"regions=\{'layers_0': 'save-attention'")),
    Case("Policy", "regions together with save",
         lambda: rt.Policy(name="p", regions={"*": "save-ffn"}, save=["a"]),
         ValueError, (r"'p'", r"per region", r"defaults")),
    Case("Policy", "a region mapped to a per-region policy",
         lambda: rt.Policy(name="p", regions={"*": rt.Policy(
             name="q", regions={"*": "save-ffn"})}), ValueError,
         (r"'q'", r"region '\*'", r"takes one policy")),
    Case("Plan.rules", "a uniform plan",
         lambda: rt.plan(good_loss, W, X, budget="1MiB").rules, ValueError,
         (r"per_layer=True", r"plan\.policy")),
    Case("Plan.rules", "regions of a plain function (by position)",
         lambda: rt.plan(good_loss, W, X, budget="1MiB", per_layer=True).rules,
         ValueError, (r"'#0'", r"rt\.use_policy\(plan\)")),
    # ---- policy paths that do not exist
    Case("load_policies", "missing file",
         lambda: rt.load_policies("no/such/policies.toml"), FileNotFoundError,
         (r"no/such/policies\.toml", r"\.toml file or a folder")),
    # ---- rules that match nothing
    Case("remat_modules", "strict=True, a rule matching no module",
         lambda: _init_with_rules({"Attention": "save-ffn"}, strict=True),
         ValueError, (r"'Attention'", r"_Block", r"class name or a module path")),
    Case("remat_modules", "empty rules", lambda: rt.remat_modules(_Model(), {}),
         ValueError, (r"empty", r"\{'Block': 'save-ffn'\}")),
    # ---- layouts, benchmarks
    Case("remat", "static_argnums=(-1,)",
         lambda: rt.remat(lambda x: x, static_argnums=(-1,)), ValueError,
         (r"-1", r"self not counted")),
    Case("remat_chain", "group=0",
         lambda: rt.remat_chain([jnp.sin], jnp.ones(2), group=0), ValueError,
         (r"\b0\b", r"group=4")),
    Case("repolicy", "not a function",
         lambda: rt.repolicy(42), TypeError, (r"\b42\b", r"rt\.repolicy\(loss\)")),
    Case("repolicy", "unknown policy",
         lambda: rt.repolicy(good_loss, "save-evrything"), ValueError,
         (r"'save-evrything'", r"'save-everything'")),
    Case("repolicy", "policy of the wrong type",
         lambda: rt.repolicy(good_loss, 3.5), TypeError,
         (r"3\.5", r"policy='save-attention'")),
    Case("repolicy", "regions not a path or glob",
         lambda: rt.repolicy(good_loss, regions=3), TypeError,
         (r"got 3\b", r"regions='layers_\*'")),
    Case("repolicy", "empty list of regions",
         lambda: rt.repolicy(good_loss, regions=[]), TypeError,
         (r"got \[\]", r"regions='layers_\*'")),
    Case("scan_layers", "group that does not divide the layers",
         lambda: rt.scan_layers(_Block, 4, group=3), ValueError,
         (r"group=3", r"one of \[1, 2, 4\] or group='sqrt'")),
    Case("scan_layers", "one policy per region, too few",
         lambda: rt.scan_layers(_Block, 4, policy=["save-ffn"] * 3),
         ValueError, (r"3 policies", r"4 remat regions",
                      r"per_layer=True\) with 4 layers", r"pass 4 policies")),
    Case("scan_layers", "a per-region policy keyed by patterns",
         lambda: rt.scan_layers(_Block, 4, policy=rt.Policy(
             name="by-glob", regions={"layers_*": "save-ffn"})), ValueError,
         (r"'by-glob'", r"'layers_\*'", r"one region key per remat region")),
    Case("bench", "unknown policy",
         lambda: rt.bench("tiny", policies=["nope"], progress=False),
         ValueError, (r"'nope'", r"Valid names: boundary-only")),
    Case("register_policy", "override='no'",
         lambda: rt.register_policy(rt.Policy(name="p", save=["a"]),
                                    override="no"), TypeError,
         (r"override", r"'no'", r"True or False")),
    Case("remat_modules", "strict='no'",
         lambda: rt.remat_modules(_Model(), strict="no"), TypeError,
         (r"strict", r"'no'", r"True or False")),
    Case("scan_layers", "remat='no'",
         lambda: rt.scan_layers(_Block, 2, remat="no"), TypeError,
         (r"remat", r"'no'", r"True or False")),
    Case("remat_chain", "prevent_cse='no'",
         lambda: rt.remat_chain([jnp.tanh], jnp.ones(2), prevent_cse="no"),
         TypeError, (r"prevent_cse", r"'no'", r"True or False")),
    Case("bench", "progress='no'",
         lambda: rt.bench("tiny", steps=1, progress="no"), TypeError,
         (r"progress", r"'no'", r"True or False")),
    Case("largest_batch", "progress=0",
         lambda: rt.largest_batch("tiny", budget="1GiB", progress=0), TypeError,
         (r"progress", r"\b0\b", r"True or False")),
    Case("bench", "steps=0", lambda: rt.bench("tiny", steps=0, progress=False),
         ValueError, (r"\b0\b", r"at least 1")),
    # ---- built-in models
    Case("models.build_loss", "unknown config",
         lambda: models.build_loss("gpt5"), ValueError,
         (r"'gpt5'", r"known configs")),
    Case("models.build_loss", "unknown framework",
         lambda: models.build_loss("tiny", framework="torch"), ValueError,
         (r"'torch'", r"linen")),
    Case("models.build_loss", "unknown attention core",
         lambda: models.build_loss("tiny", attention="fast"), ValueError,
         (r"'fast'", r"'naive', 'dot_product', 'flash'")),
    Case("models.build_loss", "dropout with the flash kernel",
         lambda: models.build_loss("tiny", attention="flash", dropout=True),
         ValueError, (r"'flash'", r"dropout_rate=0\.1",
                      r"attention='naive'|dropout=False")),
    # ---- kernels
    Case("tag_residuals", "a plain function",
         lambda: rt.tag_residuals(jnp.sin, "attn.context"), TypeError,
         (r"jax\.custom_vjp", r"pass the custom_vjp kernel itself")),
    Case("tag_residuals", "an empty name",
         lambda: rt.tag_residuals(_custom_vjp_kernel(), ""), ValueError,
         (r"''", r"'attn\.context'")),
]


def _under_remat3(call):
  if remat3_offloads():
    pytest.skip(f"jax {jax.__version__}'s remat3 offloads: nothing to refuse")
  with remat3(True):
    return call()


def _state() -> tuple:
  """What a failed call must not change: each policy, where it comes from,
  and the ambient policy."""
  names = rt.list_policies()
  sources = policy_sources()
  assert list(sources) == names
  return (tuple(sources.items()), tuple(rt.get_policy(n) for n in names),
          rt.current_policy())


def _check_error(error: BaseException, expected, patterns) -> None:
  assert isinstance(error, expected), repr(error)
  # Ours, not JAX's: a builtin exception type with a one-line message.
  assert type(error).__module__ == "builtins", type(error)
  message = str(error)
  assert "\n" not in message.strip(), message
  for pattern in patterns:
    assert re.search(pattern, message), (pattern, message)


def _case_id(case):
  return f"{case.where}: {case.bad_input}" if isinstance(case, Case) else None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bad_input(case):
  before = _state()
  with pytest.raises(Exception) as info:
    case.call()
  _check_error(info.value, case.error, case.says)
  assert _state() == before


# ------------------------------------------------------------ malformed TOML

#: One malformed policy file per field (and per whole-file mistake).
MALFORMED_TOML = {
    "syntax": ('name = "p', (r"not valid TOML",)),
    "missing name": ('save = ["attn.q"]', (r"missing key 'name'",)),
    "unknown key": ('name = "p"\nsvae = ["attn.q"]',
                    (r"\['svae'\]", r"may contain name, description")),
    "name": ("name = 3", (r"'name'", r"must be a string", r"\b3\b")),
    "name empty": ('name = ""', (r"non-empty string", r"''")),
    "description": ('name = "p"\ndescription = 1',
                    (r"'description'", r"must be a string")),
    "aliases": ('name = "p"\naliases = "q"',
                (r"'aliases'", r"list of strings", r"'q'")),
    "alias clash": ('name = "p"\naliases = ["minimal"]',
                    (r"'minimal'", r"already exists", r"override=True")),
    "save": ('name = "p"\nsave = "attn.q"',
             (r"'save'", r"list of checkpoint names", r"'attn\.q'")),
    "save entries": ('name = "p"\nsave = [1]',
                     (r"'save'", r"list of checkpoint names", r"\[1\]")),
    "offload": ('name = "p"\noffload = [true]',
                (r"'offload'", r"list of checkpoint names")),
    "exclude": ('name = "p"\nexclude = "*attention"',
                (r"'exclude'", r"list of checkpoint names", r"'\*attention'")),
    "exclude entries": ('name = "p"\nsave = ["attn.*"]\nexclude = [2]',
                        (r"'exclude'", r"list of checkpoint names", r"\[2\]")),
    "save and offload": ('name = "p"\nsave = ["attn.q"]\noffload = ["attn.q"]',
                         (r"\['attn\.q'\]", r"remove it from one")),
    "matmuls": ('name = "p"\nmatmuls = "some"',
                (r"matmuls", r"'some'", r"'no-batch'")),
    "matmuls with save": ('name = "p"\nmatmuls = "all"\nsave = ["attn.q"]',
                          (r"matmuls='all'", r"list their names in save")),
    "offload_src": ('name = "p"\noffload_src = "disk"',
                    (r"offload_src", r"'disk'", r"pinned_host")),
    "offload_dst": ('name = "p"\noffload_dst = 4',
                    (r"'offload_dst'", r"\b4\b", r"pinned_host")),
    "save_everything": ('name = "p"\nsave_everything = "yes"',
                        (r"'save_everything'", r"true or false", r"'yes'")),
    "save_everything with save":
        ('name = "p"\nsave_everything = true\nsave = ["attn.q"]',
         (r"save_everything", r"already keeps everything")),
    "regions": ('name = "p"\nregions = "layers_0"',
                (r"'regions'", r"a table of region key")),
    "regions entry": ('name = "p"\n[regions]\n"layers_0" = 3',
                      (r"'regions'", r"a table of region key", r"\b3\b")),
    "regions policy": ('name = "p"\n[regions]\n"layers_0" = "nope"',
                       (r"region 'layers_0'", r"'nope'", r"\[\[policies\]\]")),
    "policies without regions": ('name = "p"\n[[policies]]\nname = "q"',
                                 (r"'policies'", r"no \[regions\] table")),
    "duplicate name": ('name = "save-ffn"',
                       (r"'save-ffn'", r"already exists", r"override=True")),
}


@pytest.mark.parametrize("field", sorted(MALFORMED_TOML))
def test_malformed_policy_file(field, tmp_path):
  text, patterns = MALFORMED_TOML[field]
  path = tmp_path / "bad.toml"
  path.write_text(text + "\n")
  good = tmp_path / "good.toml"  # loaded together with bad.toml: all or none
  good.write_text('name = "fine-policy"\nsave = ["ffn.up"]\n')
  before = _state()
  for target in (path, tmp_path):
    with pytest.raises(Exception) as info:
      rt.load_policies(target)
    _check_error(info.value, ValueError, (re.escape(str(path)), *patterns))
    assert _state() == before
  with pytest.raises(ValueError, match="Unknown remat policy 'fine-policy'"):
    rt.get_policy("fine-policy")


@pytest.mark.parametrize("field", ["syntax", "matmuls", "save_everything"])
def test_malformed_policy_file_in_the_environment(field, tmp_path, monkeypatch):
  text, patterns = MALFORMED_TOML[field]
  path = tmp_path / "bad.toml"
  path.write_text(text + "\n")
  monkeypatch.setenv(POLICY_PATH_ENV, str(path))
  with pytest.raises(ValueError) as info:
    rt.get_policy("save-ffn")
  _check_error(info.value, ValueError, patterns)
  monkeypatch.delenv(POLICY_PATH_ENV)
  assert rt.get_policy("save-ffn").name == "save-ffn"


def test_missing_policy_path_in_the_environment(tmp_path, monkeypatch):
  missing = tmp_path / "nowhere"
  monkeypatch.setenv(POLICY_PATH_ENV, str(missing))
  with pytest.raises(FileNotFoundError) as info:
    rt.get_policy("save-ffn")
  _check_error(info.value, FileNotFoundError,
               (re.escape(str(missing)), POLICY_PATH_ENV,
                r"\.toml file or a folder"))


def test_a_failed_use_policy_leaves_the_ambient_policy_alone():
  with rt.use_policy("save-ffn"):
    with pytest.raises(ValueError):
      with rt.use_policy("nope"):
        pass  # pragma: no cover - never entered
    assert rt.current_policy().name == "save-ffn"
  assert rt.current_policy().name == "boundary-only"


# ------------------------------------------------------------ CLI

@dataclasses.dataclass(frozen=True)
class CliCase:
  argv: tuple[str, ...]
  bad_input: str
  says: tuple[str, ...]


CLI_CASES = [
    CliCase(("show", "nope"), "unknown policy",
            (r"'nope'", r"remat-toolkit list")),
    CliCase(("show", "no/such.toml"), "policy file that does not exist",
            (r"no/such\.toml", r"give a policy name")),
    CliCase(("list", "--policy-file", "no/such/dir"),
            "--policy-file path that does not exist",
            (r"no/such/dir", r"\.toml file or a folder")),
    CliCase(("analyze", "--model", "tiny", "--policy", "nope"),
            "unknown policy", (r"'nope'", r"Valid names")),
    CliCase(("compare", "--model", "tiny", "nope"), "unknown policy",
            (r"'nope'", r"Valid names")),
    CliCase(("peak", "--model", "tiny", "nope"), "unknown policy",
            (r"'nope'", r"Valid names")),
    CliCase(("peak", "save-ffn", "--policy", "save-qkv"), "two policies",
            (r"'save-ffn'", r"'save-qkv'", r"give one")),
    CliCase(("verify", "--policy", "nope", "--no-values"), "unknown policy",
            (r"'nope'", r"Valid names")),
    CliCase(("verify", "--model", "gpt5", "--no-values"), "unknown model",
            (r"'gpt5'", r"known configs")),
    CliCase(("analyze", "--model", "tiny", "--group", "two"),
            "group that is not a number", (r"'two'", r"'sqrt'")),
    CliCase(("analyze", "--model", "no_such_module:make"),
            "MODULE:FUNCTION that does not import",
            (r"no_such_module", r"MODULE:FUNCTION")),
    CliCase(("plan", "--model", "tiny", "--budget", "lots"),
            "budget that is not a size", (r"'lots'", r"'512MiB'")),
]


@pytest.mark.parametrize("case", CLI_CASES,
                         ids=lambda c: f"{' '.join(c.argv[:1])}: {c.bad_input}")
def test_cli_bad_input(case):
  before = _state()
  status, _, err = run_cli(*case.argv)
  message = err.strip()
  assert status == 2, (status, message)
  assert message.startswith("remat-toolkit: error: ") and "\n" not in message
  assert "Traceback" not in message
  for pattern in case.says:
    assert re.search(pattern, message), (pattern, message)
  assert _state() == before


@pytest.mark.parametrize("field", ["syntax", "matmuls", "save"])
def test_cli_malformed_policy_file(field, tmp_path):
  text, patterns = MALFORMED_TOML[field]
  path = tmp_path / "bad.toml"
  path.write_text(text + "\n")
  for argv in (["show", str(path)], ["list", "--policy-file", str(path)]):
    status, _, err = run_cli(*argv)
    assert status == 2
    for pattern in patterns:
      assert re.search(pattern, err), (argv, pattern, err)


_USER_MODEL = (
    "import jax\n"
    "import jax.numpy as jnp\n"
    "import remat_toolkit as rt\n"
    "@rt.remat\n"
    "def block(w, x):\n"
    "  return jnp.tanh(rt.tag(x @ w, 'ffn.up'))\n"
    "def make(batch=2):\n"
    "  loss = lambda w, x: block(w, x).sum()\n"
    "  return loss, (jax.ShapeDtypeStruct((4, 4), jnp.float32),\n"
    "                jax.ShapeDtypeStruct((batch, 4), jnp.float32))\n"
    "def fixed():\n"
    "  return make()\n")


def _cli(argv):
  status, out, err = run_cli(*argv)
  return status, out, err.strip()


def test_cli_user_model_from_the_current_folder(tmp_path, monkeypatch):
  (tmp_path / "cwd_user_model.py").write_text(_USER_MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", [p for p in sys.path
                                    if p not in ("", str(tmp_path))])
  status, out, err = _cli(["analyze", "--model", "cwd_user_model:make",
                           "--policy", "save-ffn", "--json"])
  assert status == 0, err
  assert json.loads(out)["activation_bytes"] == 2 * 4 * 4


def test_cli_user_model_options_reach_the_function_or_fail(tmp_path,
                                                           monkeypatch):
  (tmp_path / "opt_user_model.py").write_text(_USER_MODEL)
  monkeypatch.chdir(tmp_path)
  status, out, err = _cli(["analyze", "--model", "opt_user_model:make",
                           "--batch", "8", "--policy", "save-ffn", "--json"])
  assert status == 0, err
  assert json.loads(out)["activation_bytes"] == 8 * 4 * 4
  status, _, err = _cli(["analyze", "--model", "opt_user_model:fixed",
                         "--batch", "8", "--seq", "4"])
  assert status == 2
  assert err.startswith("remat-toolkit: error: ") and "\n" not in err
  assert re.search(r"--batch, --seq given, but fixed\(\) takes no 'batch', "
                   r"'seq' argument", err), err
