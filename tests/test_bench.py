"""Tests of the training-step benchmark and the largest-batch search.

Shapes are tiny and steps few: these tests check what is measured and how
figures relate, never how fast anything is.
"""

import contextlib
import io
import json
import math

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import offloading_unsupported
from shared_helpers import remat3
from shared_helpers import run_cli
from shared_helpers import scanned_mlp_args as make_args
from shared_helpers import scanned_mlp_loss as scanned_loss

import remat_toolkit as rt

RECORD_FIELDS = {"policy", "step_time_s", "tokens_per_s", "peak_bytes",
                 "compile_time_s", "relative_step_time", "grad_accum",
                 "micro_batch", "global_batch", "loss_first", "loss_last"}


@pytest.fixture(scope="module")
def result():
  params, batch = make_args()
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    out = rt.bench(scanned_loss, params, batch, policies=["boundary-only"],
                   grad_accum=[1, 2], steps=2, warmup=1)
  return out, err.getvalue()


# ---------------------------------------------------------------- bench

def test_records_have_the_fields_and_sane_values(result):
  res, _ = result
  assert [(r.policy, r.grad_accum) for r in res.records] == [
      ("save-everything", 1), ("boundary-only", 1),
      ("save-everything", 2), ("boundary-only", 2)]
  for row in res.rows():
    assert RECORD_FIELDS <= set(row)
  for r in res.records:
    assert r.step_time_min_s <= r.step_time_s <= r.step_time_max_s
    assert r.step_time_min_s > 0 and r.compile_time_s > 0
    assert r.global_batch == 8 and r.micro_batch == 8 // r.grad_accum
    assert r.tokens_per_step == 8  # no token ids: one "token" per example
    assert r.tokens_per_s == pytest.approx(r.tokens_per_step / r.step_time_s)
    assert r.peak_bytes == (r.argument_bytes + r.output_bytes + r.temp_bytes
                            - r.alias_bytes)
    # The state is donated: the new params and optimizer state alias it.
    assert r.alias_bytes > 0
    assert math.isfinite(r.loss_first) and r.loss_last < r.loss_first
  assert sorted(r.run_order for r in res.records) == [1, 2, 3, 4]


def test_each_policy_reaches_the_compiled_step(result):
  # Under scan, XLA:CPU's temporaries track what the backward pass keeps:
  # recomputing everything must need less than saving everything.
  res, _ = result
  for accum in (1, 2):
    saved = res.record("save-everything", accum)
    remat = res.record("boundary-only", accum)
    assert remat.temp_bytes < saved.temp_bytes


def test_remat_does_not_change_the_training_math(result):
  res, _ = result
  base = res.baseline
  for r in res.records:
    assert r.loss_first == pytest.approx(base.loss_first, rel=1e-5)
    assert r.loss_last == pytest.approx(base.loss_last, rel=1e-4)


def test_relative_figures_are_relative_to_save_everything_of_the_run(result):
  res, _ = result
  base = res.baseline
  assert base.policy == "save-everything" and base.grad_accum == 1
  assert [r.is_baseline for r in res.records] == [True, False, False, False]
  for r in res.records:
    assert r.relative_step_time == pytest.approx(r.step_time_s / base.step_time_s)
    assert r.relative_tokens_per_s == pytest.approx(r.tokens_per_s / base.tokens_per_s)
    assert r.relative_peak_bytes == pytest.approx(r.peak_bytes / base.peak_bytes)
    assert r.relative_compile_time == pytest.approx(
        r.compile_time_s / base.compile_time_s)
  assert base.relative_step_time == 1.0


def test_cpu_run_says_what_its_figures_mean(result):
  res, progress = result
  text = str(res)
  assert "boundary-only" in text and "CPU figures" in text
  assert "XLA_FLAGS=" in text and "scheduler" in text
  assert "[1/8] save-everything: compiling..." in progress
  assert "[8/8]" in progress


def test_csv_and_json_hold_every_record(result):
  res, _ = result
  lines = res.to_csv().splitlines()
  assert len(lines) == 1 + len(res.records)
  assert lines[0].startswith("policy,grad_accum,")
  assert [r["policy"] for r in json.loads(res.to_json())["records"]] == [
      r.policy for r in res.records]


# ---------------------------------------------------------------- memory

def test_largest_batch_stops_at_the_cap_and_at_nothing_fits():
  args = make_args(abstract=True)
  roomy = rt.largest_batch(scanned_loss, *args, budget="1GiB", policies=[],
                           max_batch=3, progress=False)
  fit = roomy.fits["save-everything"]
  assert (fit.batch, fit.hit_cap, fit.over_batch) == (3, True, None)
  assert [n for n, _ in fit.tries] == [3]  # the prediction starts at the cap, which fits
  tight = rt.largest_batch(scanned_loss, *args, budget=1024, policies=[],
                           max_batch=4, progress=False)
  fit = tight.fits["save-everything"]
  assert (fit.batch, fit.bytes, fit.over_batch) == (0, None, 1)
  assert fit.over_bytes > 1024


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,error,match", [
    ({"policies": ["no-such-policy"]}, ValueError, "no-such-policy"),
    ({"policies": "boundary-only"}, TypeError, "list"),
    ({"steps": 0}, ValueError, "steps"),
    ({"steps": 1.5}, TypeError, "steps"),
    ({"warmup": -1}, ValueError, "warmup"),
    ({"grad_accum": 3}, ValueError, "8 examples"),
    ({"grad_accum": []}, ValueError, "grad_accum"),
    ({"seq": 32}, ValueError, "built-in"),
    ({"optimizer": "adamish"}, ValueError, "'adamish'.*adamw"),
    ({"optimizer": 1e-3}, TypeError, "optax"),
])
def test_bench_rejects_bad_input(kwargs, error, match):
  params, batch = make_args()
  with pytest.raises(error, match=match):
    rt.bench(scanned_loss, params, batch, progress=False, **kwargs)


def test_bench_rejects_bad_models():
  params, batch = make_args()
  with pytest.raises(ValueError, match="Unknown model config"):
    rt.bench("no-such-model", progress=False)
  with pytest.raises(TypeError, match="no positional"):
    rt.bench("tiny", params, progress=False)
  with pytest.raises(TypeError, match="loss_fn, params, batch"):
    rt.bench(scanned_loss, params, progress=False)
  with pytest.raises(ValueError, match="disagree"):
    rt.bench(scanned_loss, params, {"x": batch["x"], "y": batch["y"][:4]},
             progress=False)
  with pytest.raises(ValueError, match="scalar"):
    rt.bench(scanned_loss, params, {"x": jnp.ones(())}, progress=False)


@pytest.mark.parametrize("budget,error", [("lots", ValueError),
                                          ("-1GiB", ValueError),
                                          ([2.5], TypeError),
                                          (float("inf"), ValueError)])
def test_largest_batch_rejects_a_budget_that_is_not_a_size(budget, error):
  with pytest.raises(error, match="size"):
    rt.largest_batch(scanned_loss, *make_args(abstract=True), budget=budget)


def test_largest_batch_rejects_a_bad_cap():
  with pytest.raises(ValueError, match="max_batch"):
    rt.largest_batch(scanned_loss, *make_args(abstract=True), budget="1GiB",
                     max_batch=0)


# ---------------------------------------------------------------- CLI

@pytest.mark.slow
def test_cli_bench_json_parses():
  # One policy (the baseline) keeps it to one compile of the built-in model.
  status, out, _ = run_cli("bench", "--model", "tiny", "--steps", "2",
                             "--warmup", "1", "--seq", "8", "--quiet",
                             "--json", "save-everything")
  assert status == 0
  (record,) = json.loads(out)["records"]
  assert RECORD_FIELDS <= set(record)
  assert record["policy"] == "save-everything"
  # The built-in's batch is token ids: tokens = examples x sequence.
  assert record["tokens_per_step"] == 2 * 8
  assert record["relative_step_time"] == 1.0


def test_cli_largest_batch_json_parses():
  status, out, _ = run_cli("bench", "--model", "tiny", "--quiet", "--json",
                             "--max-batch-under", "1GiB", "--max-batch-cap",
                             "1", "save-everything")
  assert status == 0
  (fit,) = json.loads(out)["fits"]
  assert (fit["policy"], fit["batch"], fit["hit_cap"]) == ("save-everything", 1, True)


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "steps must be at least 1"),
    (["no-such-policy"], "no-such-policy"),
    (["--max-batch-under", "lots"], "not a memory size"),
    (["--model", "no-such-model"], "Unknown model config"),
])
def test_cli_bench_bad_input_exits_2_with_one_line(argv, message):
  status, out, err = run_cli("bench", "--quiet", *argv)
  assert status == 2 and out == ""
  assert message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- options

def test_time_limit_keeps_the_baseline_and_lists_the_rest():
  # A limit shorter than any compile: the baseline is compiled whatever the
  # limit, nothing after it.
  params, batch = make_args()
  res = rt.bench((scanned_loss, (params, batch)), policies=["boundary-only"],
                 steps=1, warmup=0, time_limit_s=1e-9, progress=False)
  assert [r.policy for r in res.records] == ["save-everything"]
  assert "time limit" in res.skipped["boundary-only"]
  assert "skipped boundary-only" in str(res)
  with pytest.raises(ValueError, match="time_limit_s"):
    rt.bench(scanned_loss, params, batch, time_limit_s=0, progress=False)


def test_cli_bench_runs_a_user_model(tmp_path, monkeypatch):
  (tmp_path / "bench_user_model.py").write_text(
      "import jax.numpy as jnp\n"
      "def make():\n"
      "  loss = lambda w, b: jnp.mean((b['x'] @ w) ** 2)\n"
      "  return loss, (jnp.ones((4, 4)), {'x': jnp.ones((6, 4))})\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  status, out, _ = run_cli("bench", "--model", "bench_user_model:make",
                             "--steps", "1", "--warmup", "0", "--quiet",
                             "--grad-accum", "3", "--csv", "save-everything")
  assert status == 0
  header, row = out.splitlines()
  record = dict(zip(header.split(","), row.split(","), strict=True))
  assert (record["global_batch"], record["micro_batch"]) == ("6", "2")
  status, _, err = run_cli("bench", "--model", "bench_user_model:make",
                             "--seq", "8", "--quiet")
  assert status == 2 and "built-in models only" in err


def _failing_under(policy_name, error):
  """scanned_loss, except that tracing it under ``policy_name`` raises."""
  def loss(params, batch):
    if rt.current_policy().name == policy_name:
      raise error
    return scanned_loss(params, batch)
  return loss


def test_a_policy_that_fails_is_reported_not_fatal():
  params, batch = make_args()
  oom = RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore detail")
  res = rt.bench(_failing_under("save-ffn", oom), params, batch,
                 policies=["save-ffn"], steps=1, warmup=0, progress=False)
  assert [r.policy for r in res.records] == ["save-everything"]
  assert res.skipped["save-ffn"] == (
      "failed to compile: RuntimeError: RESOURCE_EXHAUSTED: out of memory")
  # Without the baseline there is nothing to compare with: that failure raises.
  with pytest.raises(RuntimeError, match="boom"):
    rt.bench(_failing_under("save-everything", RuntimeError("boom")), params,
             batch, progress=False)


def test_bench_takes_abstract_shapes_like_every_other_verb():
  params, batch = make_args(abstract=True)
  res = rt.bench(scanned_loss, params, batch, policies=["boundary-only"],
                 steps=1, warmup=0, progress=False)
  assert [r.policy for r in res.records] == ["save-everything", "boundary-only"]
  assert all(r.step_time_s > 0 for r in res.records)
  assert "synthetic values" in str(res)


# ---------------------------------------------------------------- policies

def test_largest_batch_takes_any_policy_like():
  # A raw JAX policy resolves as everywhere else (Policy.from_jax).
  args = make_args(abstract=True)
  raw = jax.checkpoint_policies.nothing_saveable
  search = rt.largest_batch(scanned_loss, *args, budget="1GiB", max_batch=1,
                            policies=[raw, "save-everything"], progress=False)
  assert len(search.fits) == 2 and next(iter(search.fits)) == "save-everything"


@pytest.mark.pins_mode
def test_an_offloading_policy_that_cannot_run_is_skipped_with_the_one_message():
  with remat3(True):
    if not offloading_unsupported():
      pytest.skip(f"jax {jax.__version__}'s remat3 offloads: nothing to refuse")
    args = make_args(abstract=True)
    reason = "Policy 'offload-qkv' offloads to host memory, but"
    with pytest.warns(UserWarning, match=reason):
      search = rt.largest_batch(scanned_loss, *args, budget="1GiB",
                                max_batch=1, policies=["offload-qkv"],
                                progress=False)
  assert list(search.fits) == ["save-everything"]
  assert search.skipped["offload-qkv"].startswith(reason)
  assert f"skipped offload-qkv: {reason}" in str(search)
