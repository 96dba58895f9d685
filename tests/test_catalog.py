"""The catalogue: built-ins, aliases, user files, and malformed files."""

import os
import textwrap
from pathlib import Path

import jax.numpy as jnp
import pytest
from shared_helpers import policy_sources

import remat_toolkit as rt

POLICY_PATH_ENV = "REMAT_TOOLKIT_POLICY_PATH"


def _lookups():
  """Every name and alias, and the policy it resolves to."""
  names = rt.list_policies()
  aliases = sorted(a for n in names for a in rt.get_policy(n).aliases)
  return names, {n: rt.get_policy(n) for n in names + aliases}


def _write(folder, filename, text):
  path = folder / filename
  path.write_text(textwrap.dedent(text), encoding="utf-8")
  return path


# ------------------------------------------------------------ built-ins

FIELD_ALIASES = {
    # MaxText remat_policy values (src/maxtext/layers/decoders.py,
    # Decoder.get_remat_policy).
    "full": "boundary-only",
    "minimal": "save-projections",
    "minimal_with_context": "save-projections-and-context",
    "save_dot_with_context_except_mlp": "maxtext-save-dot-with-context",
    "save_qkv_proj": "save-qkv",
    "save_out_proj": "save-out-proj",
    "save_dot_except_mlp": "maxtext-save-dot-except-mlp",
    "save_dot_except_mlpwi": "maxtext-save-dot-except-mlpwi",
    "qkv_proj_offloaded": "maxtext-qkv-proj-offloaded",
    "minimal_offloaded": "offload-projections",
    # Praxis AutodiffCheckpointType values (praxis/layers/checkpoint_policy.py).
    "save_nothing": "boundary-only",
    "save_everything": "save-everything",
    "save_dot_only": "save-matmuls",
    "save_dot_with_no_batch_dims": "save-matmuls-no-batch",
    "save_qkv_out_proj": "praxis-save-qkv-out-proj",
    "save_context": "praxis-save-context",
    "save_encoded_and_out_proj": "praxis-save-encoded-and-out-proj",
    # JAX's own constructor names.
    "checkpoint_dots_with_no_batch_dims": "save-matmuls-no-batch",
}


@pytest.mark.parametrize("alias,name", sorted(FIELD_ALIASES.items()))
def test_field_names_resolve(alias, name):
  assert rt.get_policy(alias).name == name


def test_aliases_mean_what_the_field_means():
  assert rt.get_policy("save_dot_only").matmuls == "all"
  assert rt.get_policy("save_dot_with_no_batch_dims").matmuls == "no-batch"
  assert rt.get_policy("save_everything").save_everything
  assert not rt.get_policy("full").patterns
  assert set(rt.get_policy("qkv_proj_offloaded").offload) >= {
      "query_proj", "key_proj", "value_proj"}
  assert "mlpwi" in rt.get_policy("minimal").save
  assert "context" in rt.get_policy("minimal_with_context").save
  assert "context" not in rt.get_policy("minimal").save
  assert "mlpwo" in rt.get_policy("save_dot_except_mlpwi").save
  assert "mlpwo" not in rt.get_policy("save_dot_except_mlp").save


@pytest.mark.parametrize("spelling", [
    "SAVE-QKV", "Save_Qkv", "save_qkv", " save-qkv ", "SAVE_QKV_PROJ",
    "save-qkv-proj"])
def test_names_ignore_case_and_separators(spelling):
  assert rt.get_policy(spelling).name == "save-qkv"


def test_list_policies_is_the_sorted_builtins():
  names = rt.list_policies()
  folders = {Path(source).parent for source in policy_sources().values()
             if source.endswith(".toml")}
  assert len(folders) == 1, folders
  files = {f.stem for f in folders.pop().glob("*.toml")}
  assert names == sorted(names)
  # The two baselines are the code's own; every other built-in is a file.
  assert set(names) == files | {"boundary-only", "save-everything"}
  assert not files & {"boundary-only", "save-everything"}
  assert len(names) >= 12


def test_every_builtin_says_what_it_costs():
  for name in rt.list_policies():
    description = rt.get_policy(name).description
    assert description and "\n" not in description, name


def test_a_policy_is_returned_as_is():
  p = rt.Policy(name="mine", save=["attn.q"])
  assert rt.get_policy(p) is p


def test_unknown_name_lists_close_and_valid_names():
  with pytest.raises(ValueError) as info:
    rt.get_policy("save-atention")
  message = str(info.value)
  assert "'save-atention'" in message
  assert "Did you mean 'save-attention'" in message
  assert "Valid names:" in message
  assert all(name in message for name in rt.list_policies())
  assert "\n" not in message


def test_non_string_name_is_a_type_error():
  with pytest.raises(TypeError, match="by name"):
    rt.get_policy(3)


# ------------------------------------------------------------ user policies

GOOD = """
    name = "keep-qk"
    description = "Keeps q and k."
    aliases = ["qk"]
    save = ["attn.q", "attn.k"]
"""


def test_load_a_file(tmp_path):
  path = _write(tmp_path, "qk.toml", GOOD)
  added = rt.load_policies(path)
  assert [p.name for p in added] == ["keep-qk"]
  assert rt.get_policy("QK") == rt.Policy(
      name="keep-qk", description="Keeps q and k.", aliases=["qk"],
      save=["attn.q", "attn.k"])
  assert policy_sources()["keep-qk"] == str(path)
  assert "keep-qk" in rt.list_policies()


def test_load_a_folder(tmp_path):
  _write(tmp_path, "a.toml", GOOD)
  _write(tmp_path, "b.toml", """
      name = "offload-up"
      offload = ["ffn.up"]
      offload_dst = "unpinned_host"
  """)
  _write(tmp_path, "notes.txt", "not a policy")
  added = rt.load_policies(tmp_path)
  assert sorted(p.name for p in added) == ["keep-qk", "offload-up"]
  assert rt.get_policy("offload_up").offload_dst == "unpinned_host"


def test_missing_path_is_file_not_found(tmp_path):
  before = _lookups()
  with pytest.raises(FileNotFoundError, match="missing.toml"):
    rt.load_policies(tmp_path / "missing.toml")
  assert _lookups() == before


def test_register_a_python_policy():
  p = rt.register_policy(rt.Policy(name="py-policy", save=["attn.q"]))
  assert rt.get_policy("py_policy") is p
  assert policy_sources()["py-policy"] == "python"


def test_policy_path_variable(tmp_path, monkeypatch):
  first, second = tmp_path / "one", tmp_path / "two"
  first.mkdir()
  second.mkdir()
  _write(first, "qk.toml", GOOD)
  _write(second, "up.toml", 'name = "keep-up"\nsave = ["ffn.up"]\n')
  monkeypatch.setenv(POLICY_PATH_ENV,
                     f"{first}{os.pathsep}{second}")
  assert rt.get_policy("qk").name == "keep-qk"
  assert rt.get_policy("keep-up").save == ("ffn.up",)
  assert {"keep-qk", "keep-up"} <= set(rt.list_policies())


def test_policy_path_variable_overrides_builtins(tmp_path, monkeypatch):
  _write(tmp_path, "qkv.toml", 'name = "save-qkv"\nsave = ["attn.q"]\n')
  monkeypatch.setenv(POLICY_PATH_ENV, str(tmp_path))
  assert rt.get_policy("save-qkv").save == ("attn.q",)
  assert policy_sources()["save-qkv"] == str(tmp_path / "qkv.toml")


def test_bad_policy_path_variable_keeps_raising(tmp_path, monkeypatch):
  _write(tmp_path, "bad.toml", 'name = "x"\nkeep = ["attn.q"]\n')
  monkeypatch.setenv(POLICY_PATH_ENV, str(tmp_path))
  for _ in range(2):  # not only on the first lookup
    with pytest.raises(ValueError, match=r"bad\.toml.*'keep'"):
      rt.get_policy("save-qkv")
  monkeypatch.delenv(POLICY_PATH_ENV)
  assert rt.get_policy("save-qkv").name == "save-qkv"
  assert "x" not in rt.list_policies()


# ------------------------------------------------------------ override


def test_existing_name_needs_override(tmp_path):
  path = _write(tmp_path, "qkv.toml", 'name = "Save_QKV"\nsave = ["attn.q"]\n')
  before = _lookups()
  with pytest.raises(ValueError, match=r"qkv\.toml: key 'name'.*'save-qkv'.*"
                                       r"override=True"):
    rt.load_policies(path)
  assert _lookups() == before


def test_existing_alias_needs_override(tmp_path):
  path = _write(tmp_path, "m.toml",
                'name = "mine"\naliases = ["minimal"]\nsave = ["attn.q"]\n')
  before = _lookups()
  with pytest.raises(ValueError, match=r"m\.toml: key 'aliases'.*'minimal'"):
    rt.load_policies(path)
  assert _lookups() == before


def test_override_replaces_a_policy_and_its_aliases(tmp_path):
  path = _write(tmp_path, "qkv.toml", 'name = "save-qkv"\nsave = ["attn.q"]\n')
  rt.load_policies(path, override=True)
  assert rt.get_policy("save-qkv").save == ("attn.q",)
  # The replaced policy's aliases went with it.
  with pytest.raises(ValueError, match="Unknown remat policy 'save_qkv_proj'"):
    rt.get_policy("save_qkv_proj")


def test_override_of_an_alias_moves_only_the_alias(tmp_path):
  path = _write(tmp_path, "m.toml", 'name = "minimal"\nsave = ["attn.q"]\n')
  rt.load_policies(path, override=True)
  assert rt.get_policy("minimal").save == ("attn.q",)
  # The policy that answered to "minimal" is still there under its own name.
  assert "mlpwi" in rt.get_policy("save-projections").save
  assert "save-projections" in rt.list_policies()


def test_override_with_an_alias_equal_to_a_policy_name_replaces_it(tmp_path):
  path = _write(tmp_path, "m.toml",
                'name = "mine"\naliases = ["save-ffn"]\nsave = ["ffn.up"]\n')
  rt.load_policies(path, override=True)
  assert rt.get_policy("save-ffn").name == "mine"
  assert "save-ffn" not in rt.list_policies()


def test_reloading_the_same_file_with_override(tmp_path):
  path = _write(tmp_path, "qk.toml", GOOD)
  rt.load_policies(path)
  rt.load_policies(path, override=True)
  assert rt.get_policy("qk").name == "keep-qk"


# ------------------------------------------------------------ malformed

MALFORMED = {
    "not TOML": ('name = "x"\nsave = [\n', "not valid TOML"),
    "missing name": ('save = ["attn.q"]\n', "missing key 'name'"),
    "unknown key": ('name = "x"\nkeep = ["attn.q"]\n', "unknown key(s) ['keep']"),
    "name type": ("name = 3\n", "key 'name' must be a string"),
    "description type": ('name = "x"\ndescription = ["a"]\n',
                         "key 'description' must be a string"),
    "aliases type": ('name = "x"\naliases = "y"\n',
                     "key 'aliases' must be a list of strings"),
    "aliases entry type": ('name = "x"\naliases = [1]\n',
                           "key 'aliases' must be a list of strings"),
    "save type": ('name = "x"\nsave = "attn.q"\n', "key 'save' must be a list"),
    "save entry type": ('name = "x"\nsave = ["attn.q", 2]\n',
                        "key 'save' must be a list"),
    "offload type": ('name = "x"\noffload = 1\n', "key 'offload' must be a list"),
    "matmuls type": ('name = "x"\nmatmuls = true\n', "key 'matmuls' must be one of"),
    "offload_src type": ('name = "x"\noffload_src = 1\n',
                         "key 'offload_src' must be one of"),
    "offload_dst type": ('name = "x"\noffload_dst = ["pinned_host"]\n',
                         "key 'offload_dst' must be one of"),
    "save_everything type": ('name = "x"\nsave_everything = "yes"\n',
                             "key 'save_everything' must be true or false"),
    "save and offload": ('name = "x"\nsave = ["attn.q"]\noffload = ["attn.q"]\n',
                         "['attn.q'] appear in both save and offload"),
    "unknown matmuls": ('name = "x"\nmatmuls = "some"\n', "Policy.matmuls must be"),
    "unknown offload_src": ('name = "x"\noffload = ["attn.q"]\n'
                            'offload_src = "gpu"\n', "Policy.offload_src must be"),
    "unknown offload_dst": ('name = "x"\noffload = ["attn.q"]\n'
                            'offload_dst = "hbm"\n', "Policy.offload_dst must be"),
    "duplicate name": ('name = "save_ffn"\n',
                       "key 'name': policy name 'save-ffn' already exists"),
    "duplicate alias": ('name = "x"\naliases = ["MINIMAL"]\n',
                        "key 'aliases': policy name 'minimal' already exists"),
    "a baseline's name": ('name = "boundary_only"\n',
                          "key 'name': policy name 'boundary-only' is the built-in"),
    "a baseline's alias": ('name = "x"\naliases = ["FULL"]\n',
                           "key 'aliases': policy name 'full' is the built-in"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_names_file_and_key_and_changes_nothing(case, tmp_path):
  text, expected = MALFORMED[case]
  path = _write(tmp_path, "bad_policy.toml", text)
  before = _lookups()
  with pytest.raises(ValueError) as info:
    rt.load_policies(path)
  message = str(info.value)
  assert message.startswith(f"{path}:")
  assert expected in message
  assert _lookups() == before


def test_folder_with_one_bad_file_adds_nothing(tmp_path):
  _write(tmp_path, "a_good.toml", GOOD)
  bad = _write(tmp_path, "b_bad.toml", 'name = "y"\nmatmuls = "most"\n')
  before = _lookups()
  with pytest.raises(ValueError, match=f"^{bad}: .*matmuls"):
    rt.load_policies(tmp_path)
  assert _lookups() == before
  with pytest.raises(ValueError, match="Unknown remat policy"):
    rt.get_policy("keep-qk")


def test_folder_with_a_name_twice_adds_nothing(tmp_path):
  _write(tmp_path, "a.toml", GOOD)
  _write(tmp_path, "b.toml", 'name = "other"\naliases = ["keep_qk"]\n')
  before = _lookups()
  with pytest.raises(ValueError, match=r"b\.toml: policy name 'keep-qk' is "
                                       r"also defined in .*a\.toml"):
    rt.load_policies(tmp_path)
  assert _lookups() == before


def test_a_policy_file_is_a_policy_everywhere(tmp_path):
  """The one resolver reads a .toml path wherever a policy is accepted, as
  the command line does, without registering it."""
  path = tmp_path / "keep-up.toml"
  path.write_text('name = "keep-up"\nsave = ["ffn.up"]\n')
  f = rt.remat(lambda x: jnp.sin(rt.tag(jnp.sin(x), "ffn.up")).sum())
  for given in (path, str(path)):
    report = rt.analyze(f, jnp.ones(4), policy=given)
    assert report.policy == "keep-up"
    assert [r.name for r in report.activations] == ["ffn.up"]
  assert "keep-up" not in rt.list_policies()
  with pytest.raises(FileNotFoundError, match="missing.toml.*does not exist"):
    rt.analyze(f, jnp.ones(4), policy=str(tmp_path / "missing.toml"))
