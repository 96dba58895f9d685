"""Never silent on conv nets and all-batched matmuls.

``save-matmuls`` lowers to JAX's ``dots_saveable``, which keeps no
convolution under jax 0.10's remat3; ``save-matmuls-no-batch`` never keeps a
convolution nor a matmul with a batch dimension. Where either keeps nothing
beyond the region inputs, every result says so. Each test asserts the
warning against JAX's own ``saved_residuals``: it appears exactly when the
policy keeps what ``boundary-only`` keeps.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from shared_helpers import dots_saveable_keeps_convs
from shared_helpers import jax_accounting
from shared_helpers import residuals

import remat_toolkit as rt

S = jax.ShapeDtypeStruct
MATMUL_POLICIES = ["save-matmuls", "save-matmuls-no-batch"]
CONV_CAUSE = "keeps no convolution output while jax_remat3 is on"
BATCH_CAUSE = "the no-batch rule"


def _conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


_conv_region = rt.remat(lambda w, x: jnp.sin(_conv(x, w)))


def conv_loss(w, x):
  return _conv_region(w, x).sum()


CONV_ARGS = (S((3, 3, 2, 4), jnp.float32), S((2, 8, 8, 2), jnp.float32))


# Every matmul batched, as under vmap or in an MoE einsum with an expert dim.
_batched_region = rt.remat(
    lambda w, x: jnp.sin(jnp.einsum("bnd,bde->bne", x, w)))


def batched_loss(w, x):
  return _batched_region(w, x).sum()


BATCHED_ARGS = (S((3, 4, 4), jnp.float32), S((3, 2, 4), jnp.float32))


_vmapped_region = rt.remat(jax.vmap(lambda w, x: jnp.sin(x @ w)))


def vmapped_loss(w, x):
  return _vmapped_region(w, x).sum()


# A conv net with one projection: the no-batch rule keeps the projection.
_mixed_region = rt.remat(
    lambda w, p, x: jnp.sin(jnp.sin(_conv(x, w)).reshape(2, -1) @ p))


def mixed_loss(w, p, x):
  return _mixed_region(w, p, x).sum()


MIXED_ARGS = (CONV_ARGS[0], S((256, 3), jnp.float32), CONV_ARGS[1])


class ConvBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.Conv(4, (3, 3))(x)
    return x + nn.Conv(4, (3, 3))(jnp.sin(y))


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = ConvBlock()(x)
    return x


def _linen_conv_loss():
  model = rt.remat_modules(ConvNet(), {"ConvBlock": None})
  x = S((2, 8, 8, 4), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  return (lambda p, x: jnp.sum(jnp.sin(model.apply(p, x)))), (params, x)


def _keeps_only_inputs(loss, args, policy):
  """JAX's own verdict: ``policy`` keeps what ``boundary-only`` keeps."""
  return (jax_accounting(loss, args, policy)
          == jax_accounting(loss, args, "boundary-only"))


def _passed_over(warnings_, policy):
  return [w for w in warnings_ if w.startswith(f"policy {policy!r} keeps")
          and "nothing beyond the region inputs" in w]


def _drops_convs(warnings_, policy):
  return [w for w in warnings_ if w.startswith(f"policy {policy!r} keeps")
          and "drops every convolution's" in w]


def _keeps_a_conv(loss, args, policy):
  """JAX's own verdict: a convolution output is among the residuals."""
  def under(*a):
    with rt.use_policy(policy):
      return loss(*a)
  return any(what == "output of conv_general_dilated"
             for _, _, what in residuals(under, *args))


def _analyzed(loss, args, policy):
  with warnings.catch_warnings(record=True) as raised:
    warnings.simplefilter("always")
    report = rt.analyze(loss, *args, policy=policy)
  return report, [str(w.message) for w in raised]


CASES = {
    "conv": (conv_loss, CONV_ARGS),
    "batched-einsum": (batched_loss, BATCHED_ARGS),
    "vmap": (vmapped_loss, BATCHED_ARGS),
    "conv-and-projection": (mixed_loss, MIXED_ARGS),
}


@pytest.mark.parametrize("policy", MATMUL_POLICIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_warned_exactly_when_jax_keeps_only_the_inputs(remat_mode, case,
                                                       policy):
  loss, args = CASES[case]
  report, raised = _analyzed(loss, args, policy)
  expected = _keeps_only_inputs(loss, args, policy)
  found = _passed_over(report.warnings, policy)
  assert bool(found) is expected, (case, policy, report.warnings)
  assert _passed_over(raised, policy) == found
  for message in found:
    assert "nothing beyond the region inputs" in message
    assert "remat_toolkit.tag" in message


def test_a_conv_net_with_a_projection_says_its_convs_are_dropped(remat_mode):
  report, raised = _analyzed(mixed_loss, MIXED_ARGS, "save-matmuls")
  found = _drops_convs(report.warnings, "save-matmuls")
  assert bool(found) is not _keeps_a_conv(mixed_loss, MIXED_ARGS,
                                          "save-matmuls")
  assert _drops_convs(raised, "save-matmuls") == found


def test_the_cases_cover_both_outcomes(remat_mode):
  # Pins the premise: the no-batch rule keeps nothing on the conv net and
  # the all-batched regions in both modes, but keeps the projection.
  for case in ("conv", "batched-einsum", "vmap"):
    assert _keeps_only_inputs(*CASES[case], "save-matmuls-no-batch")
  assert not _keeps_only_inputs(mixed_loss, MIXED_ARGS, "save-matmuls-no-batch")
  assert not _keeps_only_inputs(batched_loss, BATCHED_ARGS, "save-matmuls")
  assert (_keeps_only_inputs(conv_loss, CONV_ARGS, "save-matmuls")
          is not dots_saveable_keeps_convs())


def test_the_conv_warning_names_the_cause_and_the_fixes(remat_mode):
  report, _ = _analyzed(conv_loss, CONV_ARGS, "save-matmuls")
  found = _passed_over(report.warnings, "save-matmuls")
  if dots_saveable_keeps_convs():
    assert found == []
    return
  (message,) = found
  assert CONV_CAUSE in message and "1 convolution" in message
  assert "jax_remat3', False" in message and "name policy" in message


def test_the_no_batch_warning_names_what_the_regions_hold(remat_mode):
  report, _ = _analyzed(batched_loss, BATCHED_ARGS, "save-matmuls-no-batch")
  (message,) = _passed_over(report.warnings, "save-matmuls-no-batch")
  assert BATCH_CAUSE in message and "1 batched dot_general" in message
  assert message.endswith("or use save-matmuls.")
  conv_report, _ = _analyzed(conv_loss, CONV_ARGS, "save-matmuls-no-batch")
  (on_convs,) = _passed_over(conv_report.warnings, "save-matmuls-no-batch")
  # save-matmuls is offered only where it keeps the convolution.
  assert on_convs.endswith("or use save-matmuls.") is not _keeps_only_inputs(
      conv_loss, CONV_ARGS, "save-matmuls")


@pytest.mark.parametrize("policy", MATMUL_POLICIES)
def test_linen_conv_blocks_under_remat_modules(remat_mode, policy):
  loss, args = _linen_conv_loss()
  report, _ = _analyzed(loss, args, policy)
  expected = _keeps_only_inputs(loss, args, policy)
  assert bool(_passed_over(report.warnings, policy)) is expected
  if policy == "save-matmuls-no-batch":
    assert expected  # nn.Conv is a convolution: the rule never keeps it


@pytest.mark.parametrize("policy", MATMUL_POLICIES)
def test_verify_is_not_ok_silently(remat_mode, policy):
  with warnings.catch_warnings(record=True) as raised:
    warnings.simplefilter("always")
    result = rt.verify(conv_loss, *CONV_ARGS, policy=policy)
  found = _passed_over(result.warnings, policy)
  assert bool(found) is _keeps_only_inputs(conv_loss, CONV_ARGS, policy)
  assert _passed_over([str(w.message) for w in raised], policy) == found
  assert result.ok is True  # the gradients are right; only the saving is empty
  if found:
    assert result.no_op == "boundary-only" and not result.passed
    assert set(found) <= set(result.problems)


def test_compare_lists_each_passed_over_policy_once(remat_mode):
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    comparison = rt.compare(conv_loss, *CONV_ARGS, policies=[
        "boundary-only", *MATMUL_POLICIES])
  for policy in MATMUL_POLICIES:
    found = _passed_over(comparison.warnings, policy)
    assert len(found) == int(_keeps_only_inputs(conv_loss, CONV_ARGS, policy))
    assert found == _passed_over(comparison.reports[policy].warnings, policy)
    assert (policy in comparison.silent_policies()) is bool(found)
  assert _passed_over(comparison.warnings, "boundary-only") == []
