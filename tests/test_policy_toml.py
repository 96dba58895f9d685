"""White-box: the policy file reader and writer agree: what one writes the other reads.

The writer has no public face of its own (``rt.save_policy`` writes a plan's
policy), so both are used here through the module's ``__all__``; the files
are also read back through the public ``rt.load_policies``.
"""

import jax
import pytest

import remat_toolkit as rt
from remat_toolkit._src.policies import policy_toml

POLICIES = [
    rt.Policy(name="plain"),
    rt.Policy(name="names", description='quotes " and \\ and\nnewlines',
              save=["attn.q", "mlp[[]0][*]"], aliases=["NAMES_ALIAS"]),
    rt.Policy(name="offloads", save=["a"], offload=["b", "c"],
              offload_dst="pinned_host"),
    rt.Policy(name="matmuls", matmuls="no-batch"),
    rt.Policy(name="everything", save_everything=True),
    rt.Policy(name="unpinned", offload=["x"], offload_dst="unpinned_host"),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_written_files_read_back_equal(policy, tmp_path):
  path = tmp_path / f"{policy.name}.toml"
  path.write_text(policy_toml.policy_toml(policy), encoding="utf-8")
  assert policy_toml.parse_policy_file(path) == policy
  assert rt.load_policies(path) == [policy]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_records_read_back_equal_but_for_aliases(policy):
  record = policy_toml.policy_record(policy)
  read = policy_toml.policy_from_mapping(record)
  assert read == rt.Policy(**{**vars(policy), "aliases": ()})


def test_a_jax_policy_cannot_be_written():
  wrapped = rt.Policy.from_jax(jax.checkpoint_policies.dots_saveable)
  with pytest.raises(ValueError, match="cannot hold"):
    policy_toml.policy_toml(wrapped)


def test_reader_errors_name_the_file_and_key(tmp_path):
  path = tmp_path / "bad.toml"
  path.write_text('name = "x"\nsave = "attn.q"\n', encoding="utf-8")
  with pytest.raises(ValueError, match=r"bad\.toml: key 'save' must be a list"):
    policy_toml.parse_policy_file(path)
