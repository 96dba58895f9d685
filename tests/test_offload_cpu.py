"""Offloading policies on the CPU backend (jax_remat3 off).

XLA:CPU has a ``pinned_host`` memory kind, so the offloading policies lower
and run: a jitted gradient moves the selected residuals with ``device_put``
to host memory (on CPU both live in RAM, so only the accounting differs).
The analyzer must count them as host bytes, not device bytes, exactly as
JAX's own ``saved_residuals`` marks them (``float32<host>[...]``). Under
``jax_remat3``, which would silently recompute instead, they raise.
"""

import jax
import pytest
from shared_helpers import QUICK_XLA
from shared_helpers import assert_gradients_close
from shared_helpers import concrete
from shared_helpers import count_host_offloads
from shared_helpers import jax_residuals
from shared_helpers import remat3
from shared_helpers import remat3_offloads

import remat_toolkit as rt
from remat_toolkit import models

#: Each offloading policy and the policy that keeps the same tensors on device.
SAVING_TWIN = {
    "offload-attention": "save-attention",
    "offload-qkv": "save-qkv",
    "maxtext-qkv-proj-offloaded": "save-qkv",  # the built-in has no fused qkv
    "offload-projections": "save-projections",
    "offload-matmuls-no-batch": "save-matmuls-no-batch",
    # Each region's input, which every region keeps on the device anyway.
    "offload-boundaries": "boundary-only",
}
OFFLOADING = sorted(SAVING_TWIN)
CONFIG = models.get_config("tiny", num_layers=2, d_model=16, num_heads=2,
                           d_ff=32, seq_len=8, batch_size=2, dropout_rate=0.0)


# Every test here sets the mode itself (this fixture, or remat3(True) where
# it checks the refusal), so CI's JAX_REMAT3=1 pass leaves the file out.
pytestmark = pytest.mark.pins_mode


@pytest.fixture(autouse=True)
def _remat2():
  with remat3(False):
    yield


def test_the_builtin_offloading_policies_are_these():
  assert OFFLOADING == [n for n in rt.list_policies()
                        if rt.get_policy(n).offloads]


def test_pin_cpu_backend_has_a_pinned_host_memory_kind():
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  assert "pinned_host" in kinds


def test_offloading_gradients_run_jitted_on_cpu_and_equal_no_remat():
  fn, args = models.build_loss(CONFIG)
  reference, _ = models.build_loss(CONFIG, remat=False)
  params, batch = concrete(args)

  def every_policy(params, batch):
    out = [jax.value_and_grad(reference)(params, batch)]
    for name in OFFLOADING:
      with rt.use_policy(name):
        out.append(jax.value_and_grad(fn)(params, batch))
    return out

  reference, *results = jax.jit(every_policy).lower(
      params, batch).compile(QUICK_XLA)(params, batch)
  for name, result in zip(OFFLOADING, results, strict=True):
    assert_gradients_close(result, reference, 1e-5, name)


@pytest.mark.parametrize("policy", OFFLOADING)
def test_the_gradient_really_moves_residuals_to_host(policy):
  fn, args = models.build_loss(CONFIG)
  with rt.use_policy(policy):
    step = jax.make_jaxpr(jax.value_and_grad(fn))(*args)
  with rt.use_policy(SAVING_TWIN[policy]):
    kept = jax.make_jaxpr(jax.value_and_grad(fn))(*args)
  assert count_host_offloads(step.jaxpr) > 0
  assert count_host_offloads(kept.jaxpr) == 0


def jax_host_and_device_bytes(fn, args, policy):
  kept = [r for r in jax_residuals(fn, *args, policy=policy)
          if r.kind != "argument"]
  return (sum(r.nbytes for r in kept if r.memory_kind == "host"),
          sum(r.nbytes for r in kept if r.memory_kind == "device"))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("policy", OFFLOADING)
def test_report_counts_offloaded_residuals_as_host_bytes(policy, framework):
  fn, args = models.build_loss(CONFIG, framework=framework)
  comparison = rt.compare(fn, *args, policies=[policy, SAVING_TWIN[policy]])
  off = comparison.reports[policy]
  twin = comparison.reports[SAVING_TWIN[policy]]
  host, device = jax_host_and_device_bytes(fn, args, policy)
  assert (off.offloaded_bytes, off.activation_bytes) == (host, device)
  assert off.offloaded_bytes > 0
  # The same tensors, moved: device bytes drop by exactly what went to host.
  assert off.offloaded_bytes + off.activation_bytes == twin.activation_bytes
  assert twin.offloaded_bytes == 0
  assert off.activation_bytes_per_device == off.activation_bytes
  assert off.to_dict()["offloaded_bytes"] == host
  hosted = [r for r in off.activations if r.memory_kind == "host"]
  if rt.get_policy(policy).offload:  # offloaded by name
    assert {r.name for r in hosted} <= set(rt.get_policy(policy).offload)
  else:  # offloaded matmul outputs
    assert {r.primitive for r in hosted} == {"dot_general"}


@pytest.mark.parametrize("policy", OFFLOADING)
def test_offloading_under_remat3_raises_a_clear_error(policy):
  if remat3_offloads():
    pytest.skip(f"jax {jax.__version__}'s remat3 offloads: nothing to refuse")
  fn, args = models.build_loss(CONFIG)
  with remat3(True):
    with pytest.raises(ValueError, match=rf"{policy}.*jax_remat3.*silently"):
      rt.analyze(fn, *args, policy=policy)
    with pytest.raises(ValueError, match=r"jax_remat3"):
      with rt.use_policy(policy):
        jax.eval_shape(jax.grad(fn), *args)
    with pytest.raises(ValueError, match=r"jax_remat3"):
      rt.verify(fn, *args, policy=policy, check_values=False)
