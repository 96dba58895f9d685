"""Pins what the analyzer relies on of JAX's kernels, per JAX release.

``custom_vjp`` calls, their forward rules and names in both remat modes,
Pallas calls and kernel marks, cuDNN's refusal on a machine without a GPU.
Part of the compatibility layer's pins (``test_compat.py``).
"""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import jax_release as _release

from remat_toolkit._src.analysis import flops as _flops
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr

cp = jax.checkpoint_policies


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()),
                    reason="a GPU traces cuDNN attention")
def test_cudnn_refusal_without_a_gpu_is_recognised():
  q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)
  with pytest.raises(RuntimeError) as caught:
    jax.make_jaxpr(lambda x: jax.nn.dot_product_attention(
        x, x, x, implementation="cudnn"))(q)
  assert compat.is_cudnn_unavailable(caught.value)
  assert not compat.is_cudnn_unavailable(RuntimeError("other"))


#: Whether a name inside a custom_vjp's forward rule is kept by a policy
#: that names it, per release, for (jax_remat3, jax_custom_vjp3). remat3
#: treats the kernel as opaque; on 0.12 jax_custom_vjp3 lets it see inside,
#: on 0.10 it does not. None: not yet measured on that release.
CUSTOM_VJP_NAMES_KEPT = {
    "0.10": {(False, False): True, (False, True): True,
             (True, False): False, (True, True): False},
    "0.11": None,
    "0.12": {(False, False): True, (False, True): True,
             (True, False): False, (True, True): True},
}


@jax.custom_vjp
def _kernel(x):
  return jnp.sin(x) * 2


def _kernel_fwd(x):
  s = jax.ad_checkpoint.checkpoint_name(jnp.sin(x), "kernel.res")
  return s * 2, (s, jnp.cos(x))


def _kernel_bwd(res, g):
  _, c = res
  return (2 * c * g,)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


@pytest.mark.parametrize("custom_vjp3", [False, True], ids=["cvjp2", "cvjp3"])
@pytest.mark.parametrize("remat3_on", [False, True], ids=["remat2", "remat3"])
def test_names_inside_a_custom_vjp_forward_per_mode(remat3_on, custom_vjp3):
  if not compat.has_custom_vjp3_flag():
    pytest.skip("this JAX has no jax_custom_vjp3")
  before = jax.config.jax_custom_vjp3
  jax.config.update("jax_custom_vjp3", custom_vjp3)
  try:
    with compat.remat3(remat3_on):
      # Made inside: jax 0.10 picks the remat implementation when
      # jax.checkpoint wraps the function.
      f = jax.checkpoint(lambda x: _kernel(jnp.tanh(x)),
                         policy=cp.save_only_these_names("kernel.res"))
      kept = any("kernel.res" in d
                 for _, d in compat.saved_residuals(f, jnp.ones(8)))
  finally:
    jax.config.update("jax_custom_vjp3", before)
  if not remat3_on:
    assert kept  # remat2 traces the forward rule inline: the policy sees it
  elif not custom_vjp3:
    assert not kept  # remat3 re-binds the kernel whole: names inside ignored
  measured = CUSTOM_VJP_NAMES_KEPT.get(_release())
  if measured is not None:
    assert kept is measured[(remat3_on, custom_vjp3)]


def test_remat3_sees_into_a_custom_vjp_as_measured():
  measured = CUSTOM_VJP_NAMES_KEPT.get(_release())
  for custom_vjp3 in (False, True):
    sees = compat.remat3_sees_into_custom_vjp(custom_vjp3)
    if measured is not None and compat.has_remat3_flag():
      assert sees is measured[(True, custom_vjp3)]
  aligned = compat.has_custom_vjp3_flag() and compat.remat3_sees_into_custom_vjp(True)
  expected = "jax_custom_vjp3" if aligned else "jax_remat3"
  assert f"jax.config.update('{expected}'" in compat.custom_vjp_alignment()


# ------------------------------------------------------------ kernels

def _one_eqn(fn, *args, keep=lambda e: True):
  """The first equation of ``fn``'s program (at any depth) ``keep`` takes."""
  closed = jax.make_jaxpr(fn)(*args)
  return next(e for e in _jaxpr.walk(closed.jaxpr) if keep(e))


@pytest.mark.parametrize("fn,primitive", [
    (jax.jit(jnp.sin), "jit"),
    (jax.nn.relu, "custom_jvp_call"),
    (_kernel, "custom_vjp_call"),
    (jax.checkpoint(jnp.sin), "remat"),
], ids=["jit", "custom_jvp_call", "custom_vjp_call", "remat"])
def test_call_like_equations_are_found_by_their_shape(fn, primitive, remat_mode):
  eqn = _one_eqn(fn, jnp.ones(8),
                 keep=lambda e: e.primitive.name.startswith(primitive[:6])
                 or compat.is_remat(e))
  body = compat.call_body(eqn)
  assert body is not None
  assert len(body.invars) == len(eqn.invars)
  assert len(body.outvars) == len(eqn.outvars)


def _while(x):
  return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2),
                            (0, x))[1]


@pytest.mark.parametrize("fn,primitive", [
    (lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0],
     "scan"),
    (lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), "cond"),
    (_while, "while"),
], ids=["scan", "cond", "while"])
def test_loops_and_branches_are_not_call_like(fn, primitive):
  eqn = _one_eqn(fn, jnp.ones(8), keep=lambda e: e.primitive.name == primitive)
  assert compat.call_body(eqn) is None


#: The call primitive JAX wraps a custom_vjp forward rule's loop in, in the
#: forward program of jax.vjp under remat2: jax 0.12 replaced closed_call by
#: eval_jaxpr. None: not yet measured on that release.
FORWARD_CALL_PRIMITIVE = {"0.10": "closed_call", "0.11": None, "0.12": "eval_jaxpr"}


def _inline_scan_kernel(x):
  # Called in a custom_vjp's forward rule: JAX traces it inline (remat2).
  return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]


def test_the_forward_call_primitive_is_looked_through():
  @jax.custom_vjp
  def kernel(x):
    return _inline_scan_kernel(x)

  kernel.defvjp(lambda x: (_inline_scan_kernel(x), x), lambda x, g: (g,))

  def forward(x):
    f = jax.checkpoint(lambda x: kernel(x).sum(), policy=cp.everything_saveable)
    out, vjp_fn = jax.vjp(f, x)
    return out, jax.tree_util.tree_leaves(vjp_fn)

  with compat.remat3(False):  # jax 0.10 picks the mode when wrapping
    closed = jax.make_jaxpr(forward)(jnp.ones(4))
  calls = [e for e in closed.jaxpr.eqns if compat.call_body(e) is not None]
  assert calls, "the loop of the forward rule is wrapped in a call"
  measured = FORWARD_CALL_PRIMITIVE.get(_release())
  if measured is not None:
    assert {e.primitive.name for e in calls} == {measured}
  assert compat.call_body(calls[0]).eqns[0].primitive.name == "scan"


def test_kernel_names_and_forward_rules():
  eqn = _one_eqn(_kernel, jnp.ones(8), keep=compat.is_custom_vjp_call)
  assert compat.kernel_name(eqn) == "_kernel"
  assert _jaxpr.names_in(compat.custom_vjp_forward(eqn)) == {"kernel.res"}
  assert compat.kernel_name(_one_eqn(jnp.sin, jnp.ones(8))) is None


def test_custom_vjp3_calls_are_kernels_with_their_forward_rule():
  if not compat.has_custom_vjp3_flag():
    pytest.skip("this JAX has no jax_custom_vjp3")
  before = compat.custom_vjp3_enabled()
  jax.config.update("jax_custom_vjp3", True)
  try:
    # Made with the flag on: jax 0.10 picks the implementation there.
    kernel = jax.custom_vjp(lambda x: _kernel_fwd(x)[0])
    kernel.defvjp(_kernel_fwd, _kernel_bwd)
    eqn = _one_eqn(kernel, jnp.ones(8), keep=compat.is_custom_vjp_call)
    assert compat.kernel_name(eqn) == "<lambda>"
    assert _jaxpr.names_in(compat.custom_vjp_forward(eqn)) == {"kernel.res"}
    assert compat.hidden_jaxprs(eqn), "its primal function is a nested jaxpr"
  finally:
    jax.config.update("jax_custom_vjp3", before)


def test_a_custom_vjp_backward_rule_is_python_in_the_linearized_program():
  _, vjp_fn = jax.vjp(_kernel, jnp.ones(8))
  linear = getattr(vjp_fn, "jaxpr", None)
  if linear is None:
    pytest.skip("this JAX keeps no linearized jaxpr in the VJP")
  assert any(map(compat.has_python_transpose, _jaxpr.walk(linear)))


@jax.custom_vjp
def _matmul_kernel(w, x):
  return x @ w


_matmul_kernel.defvjp(lambda w, x: (x @ w, (w, x)),
                      lambda res, g: (res[1].T @ g, g @ res[0].T))


@pytest.mark.parametrize("policy", ["nothing", "everything"])
def test_a_kernel_mark_rides_onto_what_differentiation_makes(policy, remat_mode):
  """The mark on a kernel's equation reaches its forward rule's equations
  and its backward rule's, and a forward run again, in either mode."""
  policies = {"nothing": cp.nothing_saveable, "everything": cp.everything_saveable}
  args = (jnp.ones((4, 4)), jnp.ones((2, 4)))
  with compat.remat3(remat_mode):
    f = jax.checkpoint(lambda w, x: jnp.sin(_matmul_kernel(w, x)).sum(),
                       policy=policies[policy])
    closed = jax.make_jaxpr(f)(*args)
    marked = _flops.mark_kernels(closed.jaxpr)

    def step(*xs):
      def loss(*ys):
        return compat.eval_jaxpr(marked, closed.consts, *ys)[0]
      return jax.value_and_grad(loss, argnums=(0, 1))(*xs)

    traced = jax.make_jaxpr(step)(*args)
  live = compat.dce_jaxpr(traced.jaxpr, [True] * len(traced.jaxpr.outvars))
  work = _flops.kernel_work(live)
  assert list(work) == [("_matmul_kernel", "")]
  matmul = 2 * 2 * 4 * 4
  # The forward and the backward rule's two matmuls; nothing_saveable runs
  # the forward again (so does jax 0.10's remat3 everything_saveable: it
  # keeps only named values).
  again = policy == "nothing" or (remat_mode and not
                                  compat.remat3_everything_keeps_unnamed())
  assert work[("_matmul_kernel", "")].flops == matmul * (4 if again else 3)


def test_module_scopes_leave_out_kernel_marks_and_jax_scopes():
  eqn = _one_eqn(jnp.sin, jnp.ones(2))
  marked = compat.mark_kernel(compat.prefix_scopes(eqn, ()), "k")
  assert compat.module_scopes(marked) == compat.module_scopes(eqn)
  assert compat.kernel_mark_of(marked) == ("k", compat.module_scopes(eqn))
  assert compat.kernel_mark_of(eqn) is None

  @jax.checkpoint
  def f(x):
    return jnp.sin(jnp.sin(x))

  with compat.remat3(True):
    closed = jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(jnp.ones(2))
  raw = {getattr(s, "name", None) for e in _jaxpr.walk(closed.jaxpr)
         for s in e.source_info.name_stack.stack}
  assert "rematted_computation" in raw  # JAX's own scope around the rerun
  assert not any("rematted_computation" in compat.module_scopes(e)
                 for e in _jaxpr.walk(closed.jaxpr))


def test_pallas_calls_carry_their_grid_and_maybe_a_cost_estimate():
  try:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
  except ImportError as e:
    pytest.skip(f"no Pallas TPU flash attention in this JAX: {e}")
  q = jax.ShapeDtypeStruct((1, 1, 128, 128), jnp.float32)
  eqn = _one_eqn(lambda x: fa.flash_attention(x, x, x), q,
                 keep=compat.is_pallas_call)
  assert compat.pallas_grid_size(eqn) >= 1
  # XLA's count of the reference: 4 * T * S * D plus 2 per logit.
  assert compat.pallas_cost_flops(eqn) == 4 * 128 ** 3 + 2 * 128 ** 2
  assert compat.call_body(eqn) is None  # its body works on refs
  assert compat.kernel_name(eqn) == "_flash_attention_kernel"

#: Whether ``jax.custom_vjp`` returns hijax's ``custom_vjp3`` class (fields
#: ``f``, ``static_argnums``, ``symz``, ``opt_remat``) while
#: ``jax_custom_vjp3`` is on, per release; jax 0.12 keeps its own class and
#: switches at call time. None: not yet measured on that release.
CUSTOM_VJP3_IS_ANOTHER_CLASS = {"0.10": True, "0.11": None, "0.12": False}


def _sin_power(n, x):
  return jnp.sin(x) ** n


def _sin_power_fwd(n, x):
  return jnp.sin(x) ** n, (jnp.sin(x), jnp.cos(x))


def _sin_power_bwd(n, res, g):
  s, c = res
  return (n * s ** (n - 1) * c * g,)


@contextlib.contextmanager
def _custom_vjp3(on):
  """jax_custom_vjp3 set to ``on`` inside the block (the test skipped where
  this JAX has no such flag and ``on`` asks for it), then restored."""
  if on and not compat.has_custom_vjp3_flag():
    pytest.skip("this JAX has no jax_custom_vjp3")
  before = compat.custom_vjp3_enabled()
  if compat.has_custom_vjp3_flag():
    jax.config.update("jax_custom_vjp3", on)
  try:
    yield
  finally:
    if compat.has_custom_vjp3_flag():
      jax.config.update("jax_custom_vjp3", before)


@pytest.mark.parametrize("custom_vjp3", [False, True], ids=["cvjp2", "cvjp3"])
def test_custom_vjp_rules_read_either_class(custom_vjp3):
  with _custom_vjp3(custom_vjp3):
    kernel = jax.custom_vjp(_sin_power, nondiff_argnums=(0,))
    undefined = compat.custom_vjp_rules(kernel)
    kernel.defvjp(_sin_power_fwd, _sin_power_bwd, optimize_remat=True)
  assert (undefined.fwd, undefined.bwd) == (None, None)
  rules = compat.custom_vjp_rules(kernel)
  assert rules == compat.CustomVJPRules(
      _sin_power, _sin_power_fwd, _sin_power_bwd, (0,), False, True, None)
  assert compat.custom_vjp_rules(_sin_power) is None
  assert compat.custom_vjp_rules(jax.jit(kernel, static_argnums=0)) is None
  measured = CUSTOM_VJP3_IS_ANOTHER_CLASS.get(_release())
  if custom_vjp3 and measured is not None:
    assert (not isinstance(kernel, jax.custom_vjp)) is measured



def _sine_kernel(kept):
  @jax.custom_vjp
  def kernel(x):
    return jnp.sin(x)
  kernel.defvjp(lambda x: (jnp.sin(x), (jnp.cos(x), x)[:kept]),
                lambda residuals, g: (g * residuals[0],))
  return kernel


def _defaulted_kernel(kept):
  """A kernel whose rules take what they keep as a default argument."""
  @jax.custom_vjp
  def kernel(x):
    return jnp.sin(x)
  kernel.defvjp(lambda x, k=kept: (jnp.sin(x), (jnp.cos(x), x)[:k]),
                lambda residuals, g: (g * residuals[0],))
  return kernel


@pytest.mark.parametrize("custom_vjp3", [False, True], ids=["cvjp2", "cvjp3"])
def test_rule_fingerprints_tell_kernels_apart_by_what_they_compute(custom_vjp3):
  """custom_vjp and custom_jvp calls carry their rules behind JAX's per-call
  wrappers (or, under jax_custom_vjp3, on their primitive); the fingerprint
  reaches the rules: one kernel called twice, or made twice alike (a kernel
  made per layer), fingerprints alike; a kernel whose rules close over
  another value does not, nor does another custom_jvp function."""
  with _custom_vjp3(custom_vjp3):
    one, one_again, two = _sine_kernel(1), _sine_kernel(1), _sine_kernel(2)
    by_default = [_defaulted_kernel(k) for k in (1, 2)]
    closed = jax.make_jaxpr(lambda x: one(one(x)) + one_again(x) + two(x)
                            + jax.nn.relu(jax.nn.relu(x)) + jax.nn.softplus(x)
                            + by_default[0](x) + by_default[1](x)
                            )(jnp.ones(3))
  found = [compat.rule_fingerprint(e) for e in _jaxpr.walk(closed.jaxpr)]
  ruled = [f for f in found if f]
  assert len(ruled) == 9, found
  kernels, relus, softplus = ruled[:4], ruled[4:6], ruled[6]
  assert kernels[0] == kernels[1] == kernels[2] != kernels[3]
  assert relus[0] == relus[1] != softplus
  assert ruled[7] != ruled[8]  # one rule's code, other default arguments
