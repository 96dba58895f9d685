"""XLA's buffers at its peak (``rt.peak(..., compile=True).xla_live``), each
described by the module and pass that made it, as ``live`` describes the
prediction's."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit._src.analysis import xla_buffers

# A compiled step as ``compiled.as_text()`` writes it, cut to what matters:
# XLA's own instructions (a loop fusion, a convert it added) carry no op
# metadata; the fused computation and the convert's operand do. @B and @F
# stand for the backward and forward passes' op-name prefixes.
_HLO = textwrap.dedent("""\
    HloModule jit_step

    %fused_computation.1 (param_0.1: f32[4,8]) -> f32[4,8] {
      %param_0.1 = f32[4,8]{1,0} parameter(0)
      %e.1 = f32[4,8]{1,0} exponential(%param_0.1)
      ROOT %mul.1 = f32[4,8]{1,0} multiply(%e.1, %param_0.1), @M
    }

    ENTRY %main.2 (p_0_.1: f32[4,8]) -> (f32[4,8]) {
      %p_0_.1 = f32[4,8]{1,0} parameter(0)
      %sin.1 = f32[4,8]{1,0} sine(%p_0_.1), metadata={op_name="@F/layers_0/jvp(attn)/jit(_w)/sin"}
      %wrapped_convert.1 = bf16[4,8]{1,0} convert(%sin.1)
      %multiply_fusion = f32[4,8]{1,0} fusion(%sin.1), kind=kLoop, calls=%fused_computation.1
      %cos.1 = f32[4,8]{1,0} cosine(%multiply_fusion), metadata={op_name="@B/layers_0/attn/cos"}
      ROOT %tuple.1 = (f32[4,8]{1,0}) tuple(%cos.1)
    }
    """).replace("@M", 'metadata={op_name="@B/layers_0/mlp/mul"}').replace(
        "@B", "jit(step)/transpose(jvp(Model))").replace(
        "@F", "jit(step)/jvp(Model)")
_LIVE_RANGES = textwrap.dedent("""\
    Live ranges at 3 (peak):
      wrapped_convert.1{}: 64 bytes
      multiply_fusion{}: 128 bytes
    """)


def test_an_instruction_xla_made_is_described_by_what_it_computes():
  """A fusion is its fused computation's root (here a backward multiply),
  a convert XLA added is its operand (a forward sine): neither reads as a
  forward buffer of no module. Transforms unwrap to the scope they wrap
  (``jvp(attn)``: remat3 writes a region's module so); a jitted call's
  name is no module. The model's own scope (``Model``) stays: ``rt.peak``
  drops it, as from ``live``."""
  peak = xla_buffers.scheduled_peak(_HLO, _LIVE_RANGES)
  found = {b.instruction: (b.phase, b.module_path, b.primitive)
           for b in peak.live}
  assert found["multiply_fusion"] == ("backward", "Model/layers_0/mlp", "mul")
  assert found["wrapped_convert.1"] == ("forward", "Model/layers_0/attn", "sin")
  assert found["cos.1"] == ("output", "Model/layers_0/attn", "cos")
  assert peak.temp_bytes == 64 + 128


def _module_paths(params):
  """Every module path of a Flax model, read off its parameters' paths."""
  paths = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    keys = [k for k in keys if k not in ("params", "value")]
    paths |= {"/".join(keys[:n]) for n in range(1, len(keys))}
  return paths


def test_xla_buffers_name_the_models_own_modules():
  """Each buffer XLA holds at its peak names a module of the model, as the
  prediction's ``live`` does: the remat region's scope, which JAX writes
  twice in an op name (``layers_0/jvp(GPT)/layers_0/mlp``), said once, and
  an einsum's spec, which names no module, left out."""
  fn, args = models.build_loss("tiny")
  p = rt.peak(fn, *args, policy="boundary-only", compile=True)
  # the embedding's method, the tied output layer, names a module too
  modules = _module_paths(args[0]) | {"embed.attend"}
  named = {b.module_path for b in p.xla_live
           if b.phase in ("forward", "backward") and b.module_path}
  assert named, p.xla_live
  assert named <= modules, sorted(named - modules)


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + jnp.tanh(nn.Dense(x.shape[-1], name="dense")(x))


class _Layers(nn.Module):
  @nn.compact
  def __call__(self, x):
    for j in range(2):
      x = _Layer(name=str(j))(x)
    return x


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return _Layers(name="layer")(x)


class _Blocks(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = rt.remat(_Block)(name=str(i))(x)
    return x


class _T5Like(nn.Module):
  """T5's module tree: ``block/0/layer/0/...``, the same name at two depths."""

  @nn.compact
  def __call__(self, x):
    return _Blocks(name="block")(x)


def test_a_name_met_again_deeper_is_not_taken_for_a_repeat():
  """``block/0/layer/0/dense`` is a module of its own: the prediction's
  ``live`` and XLA's buffers name it whole, not ``block/0/dense``."""
  model = _T5Like()
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  modules = _module_paths(params)
  assert "block/1/layer/1/dense" in modules
  loss = lambda params, x: jnp.mean(model.apply(params, x) ** 2)  # noqa: E731
  p = rt.peak(loss, params, x, policy="save-everything", compile=True)
  named = {t.module_path for t in p.live
           if t.phase not in ("parameter", "input", "gradient") and t.module_path}
  named |= {b.module_path for b in p.xla_live
            if b.phase in ("forward", "backward") and b.module_path}
  assert any("/layer/" in path for path in named), named
  assert named <= modules, sorted(named - modules)
