"""The analyzer reports what JAX itself saves, with names, bytes and FLOPs."""

import json

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import jax_accounting
from shared_helpers import jax_residuals
from shared_helpers import remat3
from shared_helpers import remat3_everything_keeps_unnamed
from shared_helpers import remat3_offloads
from shared_helpers import runnable_policies

import remat_toolkit as rt

S = jax.ShapeDtypeStruct
D, H, B, L = 16, 64, 8, 3


@rt.remat
def block(w_up, w_down, x):
  n = rt.tag(x * 2.0, "ffn.norm")
  h = rt.tag(n @ w_up, "ffn.up")
  a = rt.tag(jnp.tanh(h), "ffn.act")
  q = rt.tag(x @ w_up[:, :D], "attn.q")
  return x + rt.tag(a @ w_down, "ffn.down") + jnp.sin(q)


def unrolled_loss(params, x):
  for w_up, w_down in params:
    x = block(w_up, w_down, x)
  return (x ** 2).mean()


def scanned_loss(params, x):
  def body(carry, w):
    return block(w[0], w[1], carry), None
  x, _ = jax.lax.scan(body, x, params)
  return (x ** 2).mean()


UNROLLED_ARGS = ([(S((D, H), jnp.float32), S((H, D), jnp.float32))] * L,
                 S((B, D), jnp.float32))
SCANNED_ARGS = ((S((L, D, H), jnp.float32), S((L, H, D), jnp.float32)),
                S((B, D), jnp.float32))
PROGRAMS = {"unrolled": (unrolled_loss, UNROLLED_ARGS),
            "scan": (scanned_loss, SCANNED_ARGS)}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_bytes_and_counts_equal_jax_saved_residuals(remat_mode, program):
  fn, args = PROGRAMS[program]
  comparison = rt.compare(fn, *args, policies=runnable_policies())
  for name, report in comparison.reports.items():
    count, act_bytes, n_args = jax_accounting(fn, args, name)
    assert len(report.residuals) == count, name
    assert report.activation_bytes + report.offloaded_bytes == act_bytes, name
    assert sum(r.kind == "argument" for r in report.residuals) == n_args, name


def test_policies_really_differ(remat_mode):
  comparison = rt.compare(*PROGRAMS["unrolled"][:1], *UNROLLED_ARGS,
                          policies=["boundary-only", "save-ffn", "save-everything"])
  r = comparison.reports
  assert (r["boundary-only"].activation_bytes < r["save-ffn"].activation_bytes
          < r["save-everything"].activation_bytes)
  assert {x.name for x in r["save-ffn"].activations} >= {"ffn.up"}
  assert not any(x.name == "ffn.up" for x in r["boundary-only"].activations)


def test_names_and_stacking_recovered_inside_scan(remat_mode):
  report = rt.analyze(scanned_loss, *SCANNED_ARGS, policy="save-ffn")
  up = [r for r in report.activations if r.name == "ffn.up"]
  assert len(up) == 1
  assert up[0].stacked == L and up[0].shape == (L, B, H)
  assert up[0].nbytes == L * B * H * 4
  assert up[0].primitive == "dot_general"
  # JAX's own report loses the name inside scan.
  plain = jax_residuals(scanned_loss, *SCANNED_ARGS, policy="save-ffn")
  assert not any(r.name == "ffn.up" for r in plain)
  assert (L, B, H) in [r.shape for r in plain if r.primitive == "scan"]


def test_offloaded_residuals_are_host_bytes():
  with remat3(False):
    report = rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy="offload-attention")
  q = [r for r in report.activations if r.name == "attn.q"]
  assert len(q) == L and all(r.memory_kind == "host" for r in q)
  assert report.offloaded_bytes == L * B * D * 4
  assert report.activation_bytes == sum(
      r.nbytes for r in report.activations if r.memory_kind == "device")


def test_offload_under_remat3_runs_or_is_skipped_with_reason():
  with remat3(True):
    comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                            policies=["offload-attention", "boundary-only"])
    if remat3_offloads():  # jax >= 0.11: remat3 offloads too
      report = rt.analyze(unrolled_loss, *UNROLLED_ARGS,
                          policy="offload-attention")
      assert report.offloaded_bytes == L * B * D * 4
      assert not comparison.skipped
      return
    with pytest.raises(ValueError, match=f"jax {jax.__version__}"):
      rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy="offload-attention")
  assert "offload-attention" in comparison.skipped
  assert "jax_remat3" in str(comparison)


# ------------------------------------------------------------------ FLOPs

@rt.remat
def dense_pair(w1, w2, x):
  return jnp.tanh(x @ w1) @ w2


def dense_chain(params, x):
  for w1, w2 in params:
    x = dense_pair(w1, w2, x)
  return x.sum()


def test_flops_match_hand_arithmetic_for_a_dense_chain(remat_mode):
  m, k, n, layers = 4, 8, 32, 2
  args = ([(S((k, n), jnp.float32), S((n, k), jnp.float32))] * layers,
          S((m, k), jnp.float32))
  per_matmul = 2 * m * k * n
  comparison = rt.compare(dense_chain, *args,
                          policies=["save-everything", "boundary-only", "save-matmuls"])
  keep_all = comparison.reports["save-everything"]
  assert keep_all.forward_flops == 2 * layers * per_matmul
  # Backward: each matmul needs two (d_input, d_weight) of the same size.
  assert keep_all.baseline_step_flops == 3 * keep_all.forward_flops
  if remat_mode and not remat3_everything_keeps_unnamed():
    # jax 0.10's remat3 everything_saveable keeps only named values: x @ w1
    # is redone.
    assert keep_all.recompute_flops == layers * per_matmul
  else:
    assert keep_all.recompute_flops == 0
    assert keep_all.backward_flops == 2 * keep_all.forward_flops
  # Full recompute redoes only x @ w1: tanh's output feeds the second
  # matmul's weight gradient, and the second matmul's output is never needed.
  none = comparison.reports["boundary-only"]
  assert none.recompute_flops == layers * per_matmul
  assert none.recompute_percent == pytest.approx(
      100 * layers * per_matmul / (3 * 2 * layers * per_matmul))
  assert comparison.reports["save-matmuls"].recompute_flops == 0


def test_scan_flops_count_every_iteration(remat_mode):
  unrolled = rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy="boundary-only")
  scanned = rt.analyze(scanned_loss, *SCANNED_ARGS, policy="boundary-only")
  assert scanned.forward_flops == unrolled.forward_flops
  assert scanned.recompute_flops == unrolled.recompute_flops > 0
  assert scanned.backward_flops == unrolled.backward_flops


# ------------------------------------------------------------------ API

def test_abstract_inputs_are_never_allocated():
  # 4 x 16 GiB of f32 weights: allocating them would exhaust this machine.
  big = 65536
  args = ([(S((big, big), jnp.float32), S((big, big), jnp.float32))] * 2,
          S((1, big), jnp.float32))
  report = rt.analyze(dense_chain, *args, policy="boundary-only")
  assert report.argument_bytes >= 2 * big * big * 4


def test_concrete_and_abstract_inputs_agree():
  key = jax.random.key(0)
  params = [(jax.random.normal(key, (D, H)), jax.random.normal(key, (H, D)))] * L
  x = jnp.ones((B, D))
  concrete = rt.analyze(unrolled_loss, params, x, policy="save-ffn")
  abstract = rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy="save-ffn")
  assert concrete.to_dict() == abstract.to_dict()


def test_ambient_policy_is_the_default():
  with rt.use_policy("save-ffn"):
    report = rt.analyze(unrolled_loss, *UNROLLED_ARGS)
  assert report.policy == "save-ffn"


def test_groupings_sum_to_totals():
  report = rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy="save-everything")
  total = report.activation_bytes + report.offloaded_bytes
  assert sum(report.by_name().values()) == total
  assert sum(report.by_primitive().values()) == total
  assert sum(report.by_module(depth=None).values()) == total


@pytest.mark.parametrize("bad, error, match", [
    (lambda p, x: unrolled_loss(p, x) * jnp.ones(3), ValueError, "scalar"),
    (lambda p, x: jnp.zeros(()), ValueError, None),
])
def test_non_scalar_loss_is_rejected(bad, error, match):
  if match is None:  # a scalar that does not depend on the inputs is fine
    rt.analyze(bad, *UNROLLED_ARGS, policy="boundary-only")
    return
  with pytest.raises(error, match=match):
    rt.analyze(bad, *UNROLLED_ARGS, policy="boundary-only")


def test_inputs_without_float_leaves_are_rejected():
  with pytest.raises(ValueError, match="floating-point"):
    rt.analyze(lambda t: t.sum().astype(jnp.float32), S((3,), jnp.int32))


def test_non_array_argument_is_rejected():
  with pytest.raises(TypeError, match="ShapeDtypeStruct"):
    rt.analyze(lambda p, s: p.sum(), S((3,), jnp.float32), "text")


@pytest.mark.parametrize("policy, error", [
    (3, TypeError), ("save-atention", ValueError)])
def test_bad_policy_is_rejected(policy, error):
  with pytest.raises(error, match="policy"):
    rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy=policy)


RAW_POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names(
        "ffn.up", "ffn.down"),
}


@pytest.mark.parametrize("raw", sorted(RAW_POLICIES))
def test_a_raw_jax_policy_keeps_what_jax_says(remat_mode, raw):
  policy = RAW_POLICIES[raw]
  count, act_bytes, n_args = jax_accounting(unrolled_loss, UNROLLED_ARGS, policy)
  report = rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy=policy)
  assert len(report.residuals) == count
  assert report.activation_bytes == act_bytes > 0
  assert sum(r.kind == "argument" for r in report.residuals) == n_args
  comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                          policies=[policy, "boundary-only"])
  assert comparison.reports[report.policy].activation_bytes == act_bytes
  breakdown = rt.memory_breakdown(unrolled_loss, *UNROLLED_ARGS, policy=policy)
  assert breakdown.activation_bytes == act_bytes


@pytest.mark.parametrize("name", ["save-everything", "boundary-only", "no-remat",
                                  "full"])
def test_no_policy_replaces_a_baseline(name, tmp_path):
  """The baselines every figure is measured against are the code's own:
  neither a registered policy nor a user's file takes their name."""
  before = rt.get_policy(name)
  with pytest.raises(ValueError, match="baseline every result is measured"):
    rt.register_policy(rt.Policy(name=name, save=["ffn.up"]), override=True)
  (tmp_path / "mine.toml").write_text(f'name = "{name}"\nsave = ["ffn.up"]\n')
  with pytest.raises(ValueError, match="name your policy differently"):
    rt.load_policies(tmp_path / "mine.toml", override=True)
  assert rt.get_policy(name) is before


def _refusal(call):
  with pytest.raises(ValueError) as info:
    call()
  return str(info.value)


def test_one_offloading_policy_is_refused_alike_everywhere():
  if remat3_offloads():
    pytest.skip(f"jax {jax.__version__}'s remat3 offloads: nothing to refuse")
  with remat3(True):
    messages = {
        "analyze": _refusal(lambda: rt.analyze(
            unrolled_loss, *UNROLLED_ARGS, policy="offload-attention")),
        "memory_breakdown": _refusal(lambda: rt.memory_breakdown(
            unrolled_loss, *UNROLLED_ARGS, policy="offload-attention")),
        "verify": _refusal(lambda: rt.verify(
            unrolled_loss, *UNROLLED_ARGS, policy="offload-attention",
            check_values=False)),
    }
    with pytest.warns(UserWarning) as raised:
      comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                              policies=["offload-attention", "boundary-only"])
  assert len(set(messages.values())) == 1, messages
  message = messages["analyze"]
  assert "'offload-attention'" in message and "jax_remat3" in message
  # Given many policies, the same reason is a skip and a warning.
  assert comparison.skipped == {"offload-attention": message}
  assert message in [str(w.message) for w in raised]
  assert list(comparison.reports) == ["boundary-only"]


def test_compare_rejects_a_single_string():
  with pytest.raises(TypeError, match="list"):
    rt.compare(unrolled_loss, *UNROLLED_ARGS, policies="save-ffn")


def test_no_ambient_region_warns():
  with pytest.warns(UserWarning, match="no remat region"):
    comparison = rt.compare(lambda w, x: (x @ w).sum(), S((4, 4), jnp.float32),
                            S((2, 4), jnp.float32), policies=["boundary-only"])
  assert comparison.regions == 0


def test_pareto_marks_only_undominated_rows():
  with remat3(False):
    comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                            policies=["boundary-only", "save-ffn", "save-everything",
                                      "save-matmuls", "offload-attention"])
  rows = {r["policy"]: r for r in comparison.rows()}
  cost = {n: (r["activation_bytes"], r["recompute_flops"], r["offloaded_bytes"])
          for n, r in rows.items()}
  for name, mine in cost.items():
    dominated = any(all(o <= m for o, m in zip(other, mine, strict=True)) and other != mine
                    for other in cost.values())
    assert rows[name]["pareto"] == (not dominated), name
  # Offloading trades host transfers for device bytes: it must not hide
  # boundary-only, which moves nothing.
  assert rows["boundary-only"]["pareto"]
  assert rows["save-everything"]["percent_of_save_everything"] == 100.0


def test_largest_column_leaves_out_what_every_policy_keeps():
  comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                          policies=["boundary-only", "save-ffn"])
  assert comparison.distinctive("save-ffn")[0] == "ffn.up"
  assert "ffn.up" not in comparison.distinctive("boundary-only")


def test_displays():
  comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                          policies=["boundary-only", "save-ffn", "save-everything"])
  text = str(comparison)
  assert "boundary-only" in text and "recompute" in text and "KiB" in text
  assert "<table" in comparison._repr_html_()
  assert json.loads(comparison.to_json())["rows"][0]["policy"] == "boundary-only"
  report = comparison.reports["save-ffn"]
  assert "ffn.up" in str(report) and "<table" in report._repr_html_()
  data = json.loads(report.to_json())
  assert len(data["residuals"]) == len(report.residuals)
  frame = report.to_dataframe()
  assert len(frame) == len(report.residuals)
  assert set(frame.columns) >= {"shape", "dtype", "nbytes", "kind", "name",
                                "module_path", "primitive", "source",
                                "memory_kind", "stacked"}
  assert len(comparison.to_dataframe()) == 3


def test_plot_draws_every_policy():
  import matplotlib
  matplotlib.use("Agg")
  comparison = rt.compare(unrolled_loss, *UNROLLED_ARGS,
                          policies=["boundary-only", "save-ffn", "save-everything"])
  ax = comparison.plot()
  assert len(ax.texts) == 3


def test_compile_adds_xla_memory_with_scheduler_note():
  report = rt.analyze(unrolled_loss, *UNROLLED_ARGS, policy="boundary-only",
                      compile=True)
  assert report.xla["temp_bytes"] >= 0 and report.xla["argument_bytes"] > 0
  if jax.default_backend() == "cpu":
    assert "scheduler" in report.xla["scheduler"]


def test_a_captured_prng_key_is_counted_with_its_bytes(remat_mode):
  # A key closed over by a region is a constant residual of extended dtype
  # key<fry>, which numpy cannot size.
  key = jax.random.key(0)

  @rt.remat
  def region(w, x):
    return jnp.tanh(x @ w + jax.random.normal(key, (4, 8)))

  def loss(w, x):
    return region(w, x).sum()

  args = (jnp.ones((8, 8)), jnp.ones((4, 8)))
  report = rt.analyze(loss, *args, policy="boundary-only")
  keys = [r for r in report.residuals if r.dtype.startswith("key")]
  theirs = [r for r in jax_residuals(loss, *args) if r.dtype.startswith("key")]
  assert len(keys) == len(theirs)
  assert all(r.nbytes == 8 and r.kind == "constant" for r in keys)
  assert all(r.nbytes == 8 and r.kind == "constant" for r in theirs)
