"""The Policy value: validation, hashing, pattern expansion and lowering."""

import dataclasses

import jax
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from shared_helpers import name_p
from shared_helpers import offloading_unsupported
from shared_helpers import remat3
from shared_helpers import remat3_honours

import remat_toolkit as rt
from remat_toolkit.results import Lowering

cp = jax.checkpoint_policies
MATMUL_MODES = ("none", "all", "no-batch", "offload-no-batch")


def _builtins():
  """Every built-in policy, the two baselines included."""
  return [rt.get_policy(name) for name in rt.list_policies()]


# ------------------------------------------------------------ validation

BAD_FIELDS = [
    ({"name": ""}, TypeError, "Policy.name"),
    ({"name": 3}, TypeError, "Policy.name"),
    ({"description": 3}, TypeError, "Policy.description"),
    ({"save": "attn.q"}, TypeError, "Policy.save"),
    ({"save": ["attn.q", 1]}, TypeError, "Policy.save"),
    ({"save": [""]}, TypeError, "Policy.save"),
    ({"offload": 5}, TypeError, "Policy.offload"),
    ({"offload": "attn.q"}, TypeError, "Policy.offload"),
    ({"aliases": "minimal"}, TypeError, "Policy.aliases"),
    ({"matmuls": "some"}, ValueError, "Policy.matmuls"),
    ({"matmuls": None}, ValueError, "Policy.matmuls"),
    ({"offload_src": "gpu"}, ValueError, "Policy.offload_src"),
    ({"offload_dst": "hbm"}, ValueError, "Policy.offload_dst"),
    ({"save_everything": "yes"}, TypeError, "Policy.save_everything"),
    ({"save": ["attn.q"], "offload": ["attn.q"]}, ValueError,
     "both save and offload"),
    ({"save": ["attn.q"], "matmuls": "all"}, ValueError, "matmuls='all'"),
    ({"save_everything": True, "save": ["attn.q"]}, ValueError,
     "save_everything"),
]


@pytest.mark.parametrize("fields,error,message", BAD_FIELDS,
                         ids=[str(f) for f, _, _ in BAD_FIELDS])
def test_each_bad_field_is_named_in_the_error(fields, error, message):
  with pytest.raises(error) as info:
    rt.Policy(**{"name": "p", **fields})
  assert message in str(info.value)
  assert "\n" not in str(info.value)


def test_lists_become_tuples_and_the_value_is_frozen():
  p = rt.Policy(name="p", save=["attn.q"], offload=["ffn.up"], aliases=["q"])
  assert p.save == ("attn.q",) and p.offload == ("ffn.up",)
  assert p.aliases == ("q",)
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.save = ("ffn.down",)


def test_equal_policies_hash_equal():
  a = rt.Policy(name="p", save=["attn.q", "attn.k"])
  b = rt.Policy(name="p", save=("attn.q", "attn.k"))
  assert a == b and hash(a) == hash(b)
  assert len({a, b, rt.Policy(name="p", save=["attn.q"])}) == 2
  assert {a: 1}[b] == 1


def test_every_builtin_is_hashable():
  assert len({p: p.name for p in _builtins()}) == len(_builtins())


def test_key_normalises_case_and_separators():
  assert rt.Policy(name=" Save_QKV ").key == "save-qkv"


def test_offloads_and_matches():
  assert rt.Policy(name="p", offload=["attn.q"]).offloads
  assert rt.Policy(name="p", matmuls="offload-no-batch").offloads
  assert not rt.Policy(name="p", save=["attn.q"]).offloads
  p = rt.Policy(name="p", save=["attn.*"], offload=["ffn.up"])
  assert p.matches("attn.q") and p.matches("ffn.up")
  assert not p.matches("ffn.down")


# ------------------------------------------------------------ lowering


def test_lowering_for_each_matmuls_mode(remat_mode):
  policies = {mode: rt.Policy(name="p", matmuls=mode) for mode in MATMUL_MODES}
  assert policies["none"].lowering() == Lowering("nothing_saveable")
  assert policies["all"].lowering() == Lowering("dots_saveable")
  assert (policies["no-batch"].lowering()
          == Lowering("dots_with_no_batch_dims_saveable"))
  assert policies["none"].to_jax() is cp.nothing_saveable
  assert policies["all"].to_jax() is cp.dots_saveable
  assert policies["no-batch"].to_jax() is cp.dots_with_no_batch_dims_saveable
  offload = policies["offload-no-batch"]
  assert offload.lowering() == Lowering("offload_dot_with_no_batch_dims",
                                        ("device", "pinned_host"))
  if offloading_unsupported():
    with pytest.raises(ValueError, match="jax_remat3"):
      offload.to_jax()
  else:
    assert offload.to_jax() is Lowering("offload_dot_with_no_batch_dims",
                                        ("device", "pinned_host")).to_jax()


def test_equal_lowerings_give_one_jax_object_on_every_release():
  # jax 0.12's constructors return a fresh closure per call; JAX's caches
  # and the analyzer's are keyed on the policy object.
  a = rt.Policy(name="a", save=["ffn.up", "attn.q"]).to_jax()
  b = rt.Policy(name="b", save=["attn.q", "ffn.up"]).to_jax()
  assert a is b
  assert a is not rt.Policy(name="c", save=["attn.q"]).to_jax()


def test_save_everything_and_save_names_lowering():
  assert (rt.Policy(name="p", save_everything=True).to_jax()
          is cp.everything_saveable)
  assert (rt.Policy(name="p", save=["ffn.up", "attn.q"]).lowering()
          == Lowering("save_only_these_names", ("attn.q", "ffn.up")))


def test_offload_lowers_to_save_and_offload(remat_mode):
  p = rt.Policy(name="p", save=["attn.k"], offload=["attn.q"],
                offload_dst="unpinned_host")
  assert p.lowering() == Lowering(
      "save_and_offload_only_these_names",
      (("attn.k",), ("attn.q",), "device", "unpinned_host"))
  assert "unpinned_host" in p.describe_lowering()
  if offloading_unsupported():
    with pytest.raises(ValueError, match=f"jax {jax.__version__}"):
      p.to_jax()
  else:
    assert p.to_jax() is p.lowering().to_jax()


def test_globs_expand_against_the_given_names():
  p = rt.Policy(name="p", save=["attn.*", "ffn.[ud]*", "mlpwi_?"])
  names = ["attn.q", "attn.k", "ffn.up", "ffn.down", "ffn.gate", "mlpwi_0",
           "mlpwi", "block.input"]
  saved, offloaded = p.expand(names)
  assert saved == {"attn.q", "attn.k", "ffn.up", "ffn.down", "mlpwi_0"}
  assert offloaded == frozenset()
  assert p.lowering(names).saved_names == saved


def test_exact_names_are_kept_even_when_absent_from_names():
  p = rt.Policy(name="p", save=["my.tensor", "attn.*"])
  assert p.lowering(names=[]).saved_names == {"my.tensor"}
  assert p.lowering(names=["attn.v"]).saved_names == {"attn.v", "my.tensor"}


def test_default_names_are_the_vocabulary_and_maxtext_names():
  saved = rt.Policy(name="p", save=["ffn.*", "mlpwi*"]).lowering().saved_names
  expected = {n for n in rt.names.VOCABULARY if n.startswith("ffn.")}
  expected |= {n for n in rt.names.MAXTEXT_NAMES if n.startswith("mlpwi")}
  assert expected <= saved
  assert all(n.startswith(("ffn.", "mlpwi")) for n in saved)


def test_patterns_matching_nothing_keep_nothing():
  assert (rt.Policy(name="p", save=["nothing.*"]).to_jax(["attn.q"])
          is cp.nothing_saveable)


def test_pattern_clash_between_save_and_offload(remat_mode):
  p = rt.Policy(name="p", save=["attn.*"], offload=["attn.q"])
  with pytest.raises(ValueError, match=r"\['attn.q'\].*both a save and an "
                                       r"offload"):
    p.to_jax(names=["attn.q", "attn.k"])
  # Without attn.q present only the exact name is offloaded: no clash.
  assert p.lowering(names=["attn.k"]).offloaded_names == {"attn.q"}


@settings(max_examples=50, deadline=None)
@given(exact=st.sets(st.sampled_from(sorted(rt.names.VOCABULARY)), min_size=1),
       pool=st.sets(st.sampled_from(sorted(rt.names.VOCABULARY)
                                    + list(rt.names.MAXTEXT_NAMES))))
def test_exact_names_lower_to_themselves(exact, pool):
  lowered = rt.Policy(name="p", save=sorted(exact)).lowering(pool)
  assert lowered.saved_names == exact


# ------------------------------------------------------------ only JAX's own


_JAX_CONSTRUCTORS = ("everything_saveable", "nothing_saveable",
                     "dots_saveable", "dots_with_no_batch_dims_saveable",
                     "save_only_these_names",
                     "save_and_offload_only_these_names",
                     "offload_dot_with_no_batch_dims")


@pytest.mark.parametrize("policy", _builtins(), ids=lambda p: p.name)
def test_builtins_lower_only_to_jax_constructors(policy, monkeypatch):
  def stub(*names):
    raise AssertionError("lowered to save_anything_except_these_names")
  monkeypatch.setattr(cp, "save_anything_except_these_names", stub)
  lowering = policy.lowering()
  assert lowering.constructor in _JAX_CONSTRUCTORS
  with remat3(False):
    assert policy.to_jax() is Lowering(lowering.constructor,
                                       lowering.args).to_jax()


@pytest.mark.parametrize("policy", [p for p in _builtins() if not p.offloads],
                         ids=lambda p: p.name)
def test_builtins_that_save_keep_their_meaning_under_remat3(policy):
  with remat3(True):
    assert remat3_honours(policy.to_jax())


@pytest.mark.parametrize("policy", [p for p in _builtins() if not p.offloads],
                         ids=lambda p: p.name)
def test_describe_lowering_is_what_to_jax_returns(policy):
  described = eval(policy.describe_lowering(), {"jax": jax})  # noqa: S307
  lowered = policy.to_jax()
  aval = jax.core.ShapedArray((2,), jax.numpy.float32)
  for name in sorted(set(rt.names.VOCABULARY) | set(rt.names.MAXTEXT_NAMES)):
    assert (described(name_p, aval, name=name)
            == lowered(name_p, aval, name=name)), name


@pytest.mark.parametrize("policy", [p for p in _builtins() if p.offloads],
                         ids=lambda p: p.name)
def test_describe_lowering_names_the_offload_constructor(policy):
  text = policy.describe_lowering()
  assert text.startswith("jax.checkpoint_policies." + policy.lowering().constructor)
  assert "pinned_host" in text
  # Offloading is refused while remat3 cannot offload: compare with it off.
  with remat3(False):
    described = eval(text, {"jax": jax})  # noqa: S307
    lowered = policy.to_jax()
  assert type(described) is type(lowered)  # a fresh closure on 0.12
