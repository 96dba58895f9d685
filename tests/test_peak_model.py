"""The buffer model behind rt.peak's prediction, rule by rule, on steps small
enough to follow by hand (the prediction against XLA's figure is in
tests/test_peak.py)."""

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import scanned_sine

from remat_toolkit._src.analysis import liveness
from remat_toolkit._src.analysis import packing

MiB = 2 ** 20

BF16 = jnp.bfloat16
W = jnp.ones((256, 256))
W_BYTES = 256 * 256 * 4


def _peak(fn, args, argnums, phases, **options):
  step = jax.make_jaxpr(jax.grad(fn, argnums=argnums))(*args)
  return liveness.predict_peak(step.jaxpr, phases, **options)


def test_a_gradient_is_written_in_its_output_buffer():
  """dW = transpose(x^T g): the product dies in the transpose that makes the
  output, so XLA writes it in the output's buffer: held are w, x, dW and the
  forward's x @ w, never a second (256, 256) buffer."""
  x = jnp.ones((8, 256))
  peak = _peak(lambda w, x: jnp.tanh(x @ w).sum(), (W, x), 0,
               ["parameter", "input"])
  assert peak.bytes == 2 * W_BYTES + 2 * x.size * 4
  assert not [v for v in peak.live
              if v.primitive == "dot_general" and v.shape == (256, 256)]


def test_a_16_bit_product_the_backward_reads_is_kept_in_16_bits():
  """XLA:CPU multiplies bfloat16 in float32, but the product the backward
  pass reads waits in bfloat16."""
  x = jnp.ones((512, 256))

  def f(w1, w2, x):
    xb = x.astype(BF16)
    return ((xb @ w1.astype(BF16)) * (xb @ w2.astype(BF16))).astype(
        jnp.float32).sum()
  peak = _peak(f, (W, W, x), (0, 1), ["parameter", "parameter", "input"],
               upcast_low_precision_matmuls=True)
  kept = [v for v in peak.live
          if v.phase == "kept residual" and v.primitive == "dot_general"]
  assert kept and all(v.dtype == "bfloat16" and v.nbytes == 512 * 256 * 2
                      for v in kept)


def _two_cast_layers(ws, x):
  for w in ws:
    x = jax.checkpoint(lambda w, x: jnp.tanh(x @ w.astype(BF16)))(w, x) + x
  return x.astype(jnp.float32).sum()


@pytest.mark.parametrize("merge", [True, False])
def test_a_parameter_is_cast_once_where_xla_merges_the_casts(merge):
  """The backward pass casts each layer's weight again (remat). Where XLA
  merges the two casts, the forward's cast of every layer waits for the
  backward pass (kept); where it does not, each pass casts for itself and
  no cast waits."""
  x = jnp.ones((16, 256), BF16)
  step = jax.make_jaxpr(jax.grad(_two_cast_layers))([W, W], x)
  peak = liveness.predict_peak(step.jaxpr, ["parameter"] * 3,
                               upcast_low_precision_matmuls=True,
                               merge_argument_casts=merge)
  waiting = [v for v in peak.live if v.phase == "kept residual"
             and v.primitive == "convert_element_type" and v.shape == W.shape]
  assert len(waiting) == (2 if merge else 0)


def _scanned_matmul(w, xs):
  def body(carry, x):
    return carry + (x @ w.astype(BF16)).astype(jnp.float32), None
  return jax.lax.scan(body, jnp.zeros(xs.shape[1:], jnp.float32), xs)[0]


@pytest.mark.parametrize("convert", [True, False])
def test_a_loops_16_bit_stacked_input_converted_whole_where_xla_does(convert):
  """The jax 0.10 XLA:CPU converts a scan's bfloat16 stacked input its body
  multiplies to float32 before the loop: one more buffer, twice the input."""
  xs = jax.ShapeDtypeStruct((12, 16, 128), BF16)
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  step = jax.make_jaxpr(_scanned_matmul)(w, xs)
  peak = liveness.predict_peak(step.jaxpr, ["parameter", "input"],
                               upcast_low_precision_matmuls=True,
                               convert_loop_inputs=convert)
  copies = [v for v in peak.live if v.shape == (12, 16, 128)
            and v.dtype == "float32"]
  assert [v.nbytes for v in copies] == ([12 * 16 * 128 * 4] if convert else [])


@pytest.mark.parametrize("convert", [True, False])
def test_a_loop_input_read_elementwise_is_converted_whole_and_freed(convert):
  """Where XLA converts a loop's 16-bit stacked inputs whole, it converts
  one the body only computes on elementwise too (XLA:CPU does that math in
  float32), and frees the 16-bit original once converted when the loop is
  its last reader: at the loop the float32 copy takes its place."""
  w = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((12, 16, 128), BF16)
  step = jax.make_jaxpr(scanned_sine)(w, x)
  peak = liveness.predict_peak(step.jaxpr, ["parameter", "input"],
                               out_phases=["output"],
                               upcast_low_precision_matmuls=True,
                               convert_loop_inputs=convert)
  stacked = [(v.dtype, v.primitive, v.nbytes) for v in peak.live
             if v.shape == (12, 16, 128) and v.primitive != "argument"]
  elements = 12 * 16 * 128
  if convert:
    assert stacked == [("float32", "convert_element_type", 4 * elements)]
  else:
    assert stacked == [("bfloat16", "mul", 2 * elements)]


def test_an_argument_the_step_never_reads_is_not_held():
  """jax.jit drops an argument nothing reads (a batch field the loss
  ignores) from the compiled program: it is not in the peak, and a donated
  one lends no buffer to an output."""
  x = jnp.ones((128, 256))
  unused = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  loss = lambda w, x, u: jnp.tanh(x @ w).sum()  # noqa: E731
  with_unused = _peak(loss, (W, x, unused), 0, ["parameter", "input", "input"])
  without = _peak(lambda w, x: loss(w, x, None), (W, x), 0,
                  ["parameter", "input"])
  assert with_unused.bytes == without.bytes
  assert not [v for v in with_unused.live if v.shape == (1024, 1024)]
  # A donated argument of the gradient's type, never read: W's gradient
  # still needs a buffer of its own.
  donated = _peak(lambda w, x, spare: loss(w, x, None), (W, x, W), 0,
                  ["parameter", "input", "optimizer state"],
                  donated=[False, False, True])
  assert donated.bytes == without.bytes
  assert [v.phase for v in donated.live if v.primitive == "output"] == [
      "gradient"]


def _one_layer(w, x):
  return jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x)


def test_a_scan_of_one_iteration_is_the_layer_itself():
  """XLA removes a loop of one trip and runs its body inline: a scan over
  one layer holds what that layer called once holds, no loop buffers."""
  x = jnp.ones((128, 256))

  def scanned(ws, x):
    return jax.lax.scan(lambda x, w: (_one_layer(w, x), None), x, ws)[0].sum()

  looped = _peak(scanned, (W[None], x), 0, ["parameter", "input"])
  once = _peak(lambda w, x: _one_layer(w, x).sum(), (W, x), 0,
               ["parameter", "input"])
  assert looped.bytes == once.bytes == 2 * W_BYTES + 2 * x.size * 4
  # Two iterations are a loop: its stacked residual is held.
  two = _peak(scanned, (jnp.stack([W, W]), x), 0, ["parameter", "input"])
  assert [v.shape for v in two.live if v.phase == "kept residual"] == [
      (2, 128, 256)]



def test_temporaries_are_packed_in_one_block_as_xla_lays_them_out():
  """XLA lays temporaries out in one block, the larger (or the longer-lived)
  first, each in the tightest gap that fits: a block can be larger than
  what is ever live at once. Never smaller; equal where no gap is left."""
  def largest_live(spans):
    return max(sum(b for first, last, b in spans if first <= k <= last)
               for k in range(max(last for _, last, _ in spans) + 1))
  gapped = [(1, 1, 5 * MiB), (0, 2, 2 * MiB), (2, 5, 4 * MiB), (4, 5, 5 * MiB)]
  assert largest_live(gapped) == 9 * MiB
  assert packing.packed_bytes(gapped) == 11 * MiB
  # Largest first would leave a gap (10 MiB: the 3 MiB buffer lands on the
  # 5 and 4 MiB ones' offsets, the 2 MiB one on top); longest-lived first
  # leaves none (9 MiB, all that is live at step 1): the better is taken.
  ordered = [(2, 2, 5 * MiB), (0, 3, 3 * MiB), (0, 1, 2 * MiB), (1, 1, 4 * MiB)]
  assert packing.packed_bytes(ordered) == largest_live(ordered) == 9 * MiB
  chain = [(k, k + 1, MiB) for k in range(6)]
  assert packing.packed_bytes(chain) == largest_live(chain) == 2 * MiB

