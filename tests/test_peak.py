"""rt.peak: the step's peak predicted, and XLA's figure and buffers beside it.

XLA's figure is checked against ``memory_analysis()`` of the same step
exactly; the prediction against XLA's figure within 10% runs in a process of
its own (the XLA:CPU scheduler setting the docs recommend only takes effect
before JAX starts), on both layouts, several policies and both remat modes.
"""

import json
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from shared_helpers import run_on_simulated_devices
from shared_helpers import xla_step_bytes

import remat_toolkit as rt
from remat_toolkit.results import Peak

S = jax.ShapeDtypeStruct
D, H, N = 64, 256, 32


@rt.remat
def _block(p, x):
  h = rt.tag(x @ p["up"], "ffn.up")
  return x + rt.tag(jnp.tanh(h), "ffn.act") @ p["down"]


def loss(params, x):
  for p in params:
    x = _block(p, x)
  return jnp.mean(x ** 2)


PARAMS = [{"up": S((D, H), jnp.float32), "down": S((H, D), jnp.float32)}
          for _ in range(3)]
X = S((N, D), jnp.float32)
PARAM_BYTES = 3 * 2 * D * H * 4


@pytest.mark.parametrize("policy", ["boundary-only", "save-everything"])
def test_xla_bytes_is_memory_analysis_and_both_lists_sum(policy, remat_mode):
  del remat_mode
  p = rt.peak(loss, PARAMS, X, policy=policy, compile=True)
  assert isinstance(p, Peak)
  assert p.xla_bytes == xla_step_bytes(loss, (PARAMS, X), policy)
  assert sum(b.nbytes for b in p.xla_live) == p.xla_bytes
  assert sum(t.nbytes for t in p.live) == p.bytes
  assert {b.phase for b in p.xla_live} >= {"argument", "output"}


def _compiled_tanh_count(policy):
  """How many ``tanh`` the compiled step computes (3 blocks: 3 in the
  forward pass, 3 more where the backward pass recomputes them)."""
  with rt.use_policy(policy):
    text = jax.jit(jax.grad(loss)).lower(PARAMS, X).compile().as_text()
  return len(re.findall(r"\btanh\(", text))


@pytest.mark.parametrize("policy", ["boundary-only", "save-ffn"])
def test_a_recomputation_xla_merged_into_the_forward_pass_is_said(policy,
                                                                  remat_mode):
  """Read from the compiled program itself: where XLA computes each block's
  tanh once although the policy recomputes it, the result says XLA merged
  the recomputation (XLA:CPU of jax 0.10 does, in plain jax.checkpoint
  regions); where it computes it twice, or the policy keeps it, it does not."""
  del remat_mode
  p = rt.peak(loss, PARAMS, X, policy=policy, compile=True)
  merged = policy == "boundary-only" and _compiled_tanh_count(policy) == 3
  kinds = [w.kind for w in p.warnings]
  assert ("xla-merged-recompute" in kinds) == merged, (kinds, merged)
  if merged:
    assert "boundary-only" in next(w for w in p.warnings
                                    if w.kind == "xla-merged-recompute")


def test_a_backend_without_memory_analysis_gets_a_clear_error(monkeypatch):
  """compile=True on a backend whose compiled programs report no memory
  analysis: a ValueError naming the backend and the fix, from rt.peak and
  rt.analyze alike, not an AttributeError from inside."""
  monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: None)
  with pytest.raises(ValueError, match="does not provide; drop compile=True"):
    rt.peak(loss, PARAMS, X, policy="boundary-only", compile=True)
  with pytest.raises(ValueError, match="does not provide; drop compile=True"):
    rt.analyze(loss, PARAMS, X, policy="boundary-only", compile=True)


def test_state_held_for_the_whole_step_by_hand():
  p = rt.peak(loss, PARAMS, X, policy="save-ffn")
  phases = p.by_phase()
  assert phases["parameter"] == PARAM_BYTES
  assert phases["gradient"] == PARAM_BYTES
  assert phases["input"] == N * D * 4
  assert p.bytes > 2 * PARAM_BYTES
  assert p.when.startswith(("forward of", "backward of"))
  assert p.xla_bytes is None and p.xla_live is None and p.error is None


def test_kept_residuals_are_live_and_named():
  """Under save-ffn the blocks' ffn.up and ffn.act outputs wait for the
  backward pass; under boundary-only only the block inputs do."""
  keep = rt.peak(loss, PARAMS, X, policy="save-ffn")
  kept = {t.name for t in keep.live if t.phase == "kept residual"}
  assert kept & {"ffn.up", "ffn.act"}
  assert keep.kept_bytes == rt.analyze(loss, PARAMS, X,
                                       policy="save-ffn").activation_bytes
  bare = rt.peak(loss, PARAMS, X, policy="boundary-only")
  assert not {t.name for t in bare.live if t.phase == "kept residual"} & {
      "ffn.up", "ffn.act"}
  assert bare.bytes < keep.bytes


def test_optimizer_step_holds_the_state_once(remat_mode):
  del remat_mode
  adam = optax.adam(1e-3)
  p = rt.peak(loss, PARAMS, X, policy="boundary-only", optimizer=adam,
              compile=True)
  state = sum(np.prod(s.shape) * s.dtype.itemsize for s in
              jax.tree_util.tree_leaves(jax.eval_shape(adam.init, PARAMS)))
  assert p.by_phase()["optimizer state"] == state
  assert "gradient" not in p.by_phase()  # donated: new parameters in place
  assert p.xla_bytes == xla_step_bytes(loss, (PARAMS, X), "boundary-only", adam)
  assert "adam" in p.step or "optax" in p.step



def test_an_argument_the_step_never_reads_is_in_neither_figure(remat_mode):
  """A batch field the loss ignores: jax.jit drops it from the compiled
  step, and the prediction leaves it out too (it was counted, 4 MiB over)."""
  del remat_mode
  field = S((1024, 1024), jnp.float32)
  bare = rt.peak(loss, PARAMS, X, policy="boundary-only", compile=True)
  more = rt.peak(lambda params, x, field: loss(params, x), PARAMS, X, field,
                 policy="boundary-only", compile=True)
  assert (more.bytes, more.xla_bytes) == (bare.bytes, bare.xla_bytes)
  assert not [t for t in more.live if t.shape == (1024, 1024)]

def test_renders_as_text_html_json_and_rows():
  p = rt.peak(loss, PARAMS, X, policy="save-ffn")
  text = str(p)
  assert "predicted" in text and p.when in text
  # Uncompiled, the report says how to check the prediction; compiled, it
  # shows XLA's figure instead.
  assert "not compiled: compile=True" in text
  compiled = str(rt.peak(loss, PARAMS, X, policy="save-ffn", compile=True))
  assert "XLA's figure" in compiled and "not compiled" not in compiled
  assert "<table" in p._repr_html_()
  data = json.loads(p.to_json())
  assert data["bytes"] == p.bytes and data["by_phase"] == p.by_phase()
  rows = p.rows()
  assert len(rows) == len(p.live)
  assert rows[0]["nbytes"] == max(t.nbytes for t in p.live)


def test_cpu_scheduler_finding(monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("an XLA:CPU finding")
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.warns(UserWarning, match="scheduler"):
    p = rt.peak(loss, PARAMS, X, policy="boundary-only", compile=True)
  assert "cpu-scheduler" in {w.kind for w in p.warnings}
  assert p.xla_flags == ""


def _lookup_loss(table, ids):
  return jnp.sum(jnp.tanh(table[ids]))


def test_a_prediction_off_xla_s_figure_says_so():
  """The finding follows the error, both ways. An embedding lookup's
  gradient is a scatter-add XLA writes in its zero-filled buffer, which the
  model holds apart (a known gap, on the benchmarks page), so its prediction
  is far over XLA's figure today; the blocks above are predicted within
  10%. Should the gap close, put another off case here."""
  table, ids = S((4096, 256), jnp.float32), S((64,), jnp.int32)
  off = rt.peak(_lookup_loss, table, ids, compile=True)
  close = rt.peak(loss, PARAMS, X, policy="boundary-only", compile=True)
  for p in (off, close):
    kinds = [w.kind for w in p.warnings]
    assert ("prediction-off" in kinds) is (not p.within_tolerance), (p.error, kinds)
  assert not off.within_tolerance and close.within_tolerance
  message = str(next(w for w in off.warnings if w.kind == "prediction-off"))
  assert f"{off.error:+.0%}" in message and "compile=True" in message


@pytest.mark.parametrize("call, error, match", [
    (lambda: rt.peak(loss, PARAMS, X, policy="no-such-policy"), ValueError,
     "no-such-policy"),
    (lambda: rt.peak(loss, PARAMS, X, optimizer="nope"), ValueError,
     "optimizer"),
    (lambda: rt.peak(loss, PARAMS, X, optimizer=3), TypeError, "optimizer"),
    (lambda: rt.peak(loss), TypeError, "arguments"),
    (lambda: rt.peak("loss", PARAMS, X), TypeError, "callable"),
    (lambda: rt.peak(lambda n, x: jnp.sum(x ** 2), S((2,), jnp.int32), X),
     ValueError, "first argument"),
    (lambda: rt.peak(lambda p, x: (x @ p[0]["up"]), PARAMS, X), ValueError,
     "scalar"),
])
def test_bad_input_is_named(call, error, match):
  with pytest.raises(error, match=match):
    call()


# The prediction against XLA's figure, with the scheduler setting the docs
# recommend, in a process of its own: the built-in GPT-2 small shape cut to
# 4 layers, seq 256, batch 4 (benchmarks/peak_accuracy.py's), unrolled and
# scanned, under several policies and both remat modes: within 10% (the
# worst measured: +8.4%, save-everything unrolled under remat3 on jax 0.10.2;
# -8.9%, the same on jax 0.12.0.1).
_TOLERANCE = 0.10
_ACCURACY = textwrap.dedent("""
    import json, warnings
    import remat_toolkit as rt
    from remat_toolkit import models
    from shared_helpers import remat3
    warnings.simplefilter("ignore")
    cfg = models.get_config("gpt2-small").replace(
        num_layers=4, seq_len=256, batch_size=4)
    rows = []
    for mode in (False, True):
      with remat3(mode):
        for scan in (False, True):
          loss, args = models.build_loss(cfg, scan=scan)
          for policy in ("boundary-only", "save-attention",
                         "recompute-attention-core", "save-everything"):
            p = rt.peak(loss, *args, policy=policy, compile=True)
            rows.append([mode, scan, policy, p.bytes, p.xla_bytes])
        # The Adam train step, scanned: its gradients are temporaries
        # waiting for their update, and XLA's block of temporaries is
        # larger than what is live at its peak (packing).
        loss, args = models.build_loss(cfg, scan=True)
        for policy in ("boundary-only", "save-everything"):
          p = rt.peak(loss, *args, policy=policy, optimizer="adam",
                      compile=True)
          rows.append([mode, "scan, adam", policy, p.bytes, p.xla_bytes])
    print(json.dumps(rows))
""")


@pytest.mark.slow
def test_prediction_within_ten_percent_of_xla_and_same_order():
  script = ("import os\nos.environ['XLA_FLAGS'] = "
            "'--xla_cpu_enable_concurrency_optimized_scheduler=false'\n"
            + _ACCURACY)
  rows = run_on_simulated_devices(script, count=1)
  for mode, scan, policy, predicted, xla in rows:
    assert abs(predicted / xla - 1) <= _TOLERANCE, (
        mode, scan, policy, predicted, xla)
  for mode in (False, True):
    for scan in (False, True, "scan, adam"):
      table = [(p, x) for m, s, _, p, x in rows if m == mode and s == scan]
      for p1, x1 in table:
        for p2, x2 in table:
          if x1 > 1.05 * x2:
            assert p1 > p2, (mode, scan, table)


#: A 64 KiB array the loss closes over (a table, as a rotary embedding's).
_TABLE = np.linspace(0.0, 1.0, 256 * 64, dtype=np.float32).reshape(256, 64)


def _table_loss(w, x):
  return _block_with_table(w, x).sum() + jnp.asarray(_TABLE).sum()


_block_with_table = rt.remat(lambda w, x: jnp.tanh(x @ w))


def test_a_closed_over_array_is_a_constant_outside_the_peak(remat_mode):
  """XLA compiles a closed-over array into the program as a constant, which
  its figure (argument + output + temp - alias) leaves out: so does the
  prediction (it had counted it as an input, 64 KiB over a 48 KiB step)."""
  del remat_mode
  w, x = S((64, 64), jnp.float32), S((32, 64), jnp.float32)
  p = rt.peak(_table_loss, w, x, policy="boundary-only", compile=True)
  assert not [t for t in p.live if t.primitive == "constant"]
  assert p.within_tolerance, (p.bytes, p.xla_bytes)
