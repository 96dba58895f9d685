"""The analyzer on the built-in GPT: the worked example, FLOPs, CLI."""

import json
import re
import sys
import textwrap

import pytest
from shared_helpers import jax_residuals
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models

MIB = 2**20


def stream_residuals(report, shape):
  """Activation residuals of the residual-stream shape, outside the final norm."""
  return [r for r in report.activations
          if r.shape[-3:] == shape and r.dtype == "bfloat16"
          and not r.module_path.startswith("ln_f")]


@pytest.mark.parametrize("group, regions", [(1, 24), (4, 6)])
def test_seed_example_boundary_bytes_scanned(group, regions):
  fn, args = models.build_loss("seed-example", group=group, scan=True)
  report = rt.analyze(fn, *args, policy="boundary-only")
  # One residual-stream tensor: micro-batch 2 x seq 2048 x hidden 4096, bf16.
  assert 2 * 2048 * 4096 * 2 == 32 * MIB
  inputs = stream_residuals(report, (2, 2048, 4096))
  assert len(inputs) == 1 and inputs[0].stacked == regions
  assert inputs[0].nbytes == regions * 32 * MIB


def test_seed_example_boundary_bytes_unrolled_in_six_regions():
  fn, args = models.build_loss("seed-example", group=4, scan=False)
  report = rt.analyze(fn, *args, policy="boundary-only")
  inputs = stream_residuals(report, (2, 2048, 4096))
  assert [r.nbytes for r in inputs] == [32 * MIB] * 6
  # The region inputs are the embedding and every fourth block's output.
  assert sorted(r.module_path.split("/")[-1] for r in inputs if r.name) == [
      f"layers_{i}" for i in (11, 15, 19, 3, 7)]


def test_gpt_flops_match_hand_arithmetic(remat_mode):
  cfg = models.get_config("tiny")
  b, s, d, f, v = cfg.batch_size, cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.vocab_size
  fn, args = models.build_loss(cfg, scan=False)
  comparison = rt.compare(fn, *args, policies=["save-everything", "boundary-only",
                                               "save-matmuls"])
  projections = 4 * 2 * b * s * d * d          # q, k, v, out
  attention = 2 * (2 * b * s * s * d)          # q k^T and probs v, all heads
  ffn = 2 * (2 * b * s * d * f)                # up and down
  head = 2 * b * s * d * v                     # tied LM head
  forward = cfg.num_layers * (projections + attention + ffn) + head
  keep_all = comparison.reports["save-everything"]
  assert keep_all.forward_flops == forward
  # Every matmul has two differentiable operands: backward is twice forward.
  assert keep_all.baseline_step_flops == 3 * forward
  # Full recompute redoes every block matmul but the FFN down projection,
  # whose output only feeds the block's last residual add (the attention
  # output projection is redone: the FFN's layer norm needs x + attn.out).
  redo = cfg.num_layers * (projections + attention + 2 * b * s * d * f)
  assert comparison.reports["boundary-only"].recompute_flops == redo
  if not remat_mode:
    assert keep_all.recompute_flops == 0
    assert comparison.reports["save-matmuls"].recompute_flops == 0


@pytest.mark.slow
def test_cli_compare_prints_every_policy():
  status, out, _ = run_cli("compare", "--model", "tiny")
  assert status == 0
  for name in rt.list_policies():
    assert name in out
  assert "Pareto" in out


def test_cli_compare_json_and_policy_subset():
  status, out, _ = run_cli("compare", "boundary-only", "save-ffn", "--model",
                           "tiny", "--scan", "--json")
  assert status == 0
  rows = json.loads(out)["rows"]
  assert [r["policy"] for r in rows] == ["boundary-only", "save-ffn"]


def test_cli_analyze_shows_modules():
  status, out, _ = run_cli("analyze", "--policy", "save-ffn", "--model", "tiny")
  assert status == 0
  assert "layers_0/mlp" in out and "ffn.up" in out


def test_cli_user_model(tmp_path, monkeypatch):
  (tmp_path / "my_model.py").write_text(textwrap.dedent("""
      import jax, jax.numpy as jnp
      import remat_toolkit as rt

      @rt.remat
      def block(w, x):
        return jnp.tanh(rt.tag(x @ w, "ffn.up"))

      def build():
        S = jax.ShapeDtypeStruct
        return (lambda w, x: block(w, x).sum(),
                (S((8, 8), jnp.float32), S((4, 8), jnp.float32)))
  """))
  monkeypatch.syspath_prepend(str(tmp_path))
  status, out, _ = run_cli("compare", "--model", "my_model:build", "boundary-only",
                           "save-ffn", "--json")
  assert status == 0
  rows = {r["policy"]: r for r in json.loads(out)["rows"]}
  assert rows["save-ffn"]["activation_bytes"] > rows["boundary-only"]["activation_bytes"]
  sys.modules.pop("my_model", None)


@pytest.mark.parametrize("argv, message", [
    (("compare", "--model", "gpt3"), "gpt3"),
    (("compare", "--model", "no_such_module:build"), "no_such_module"),
    (("compare", "--model", "tiny", "save-atention"), "save-attention"),
    (("analyze", "--model", "tiny", "--group", "two"), "--group"),
])
def test_cli_user_errors_exit_2_with_one_line(argv, message):
  status, out, err = run_cli(*argv)
  assert status == 2
  assert message in err and "Traceback" not in err


# ---------------------------------------------------------------- NNX paths

def linen_spelling(path, scan):
  """An NNX attribute path in linen's spelling: ``layers/0`` is ``layers_0``;
  the scanned stack's blocks (``layers/blocks``) are linen's ``layers``."""
  if scan:
    return path.replace("layers/blocks", "layers", 1)
  return re.sub(r"^layers/(\d+)", r"layers_\1", path)


def saved_bytes(fn, args, policy):
  """Activation bytes of JAX's own saved_residuals under ``policy``."""
  return sum(r.nbytes for r in jax_residuals(fn, *args, policy=policy)
             if r.kind not in ("argument", "constant"))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_nnx_residuals_name_submodules_as_linen_does(remat_mode, scan):
  reports = {}
  for framework in models.FRAMEWORKS:
    fn, args = models.build_loss("tiny", scan=scan, framework=framework)
    reports[framework] = rt.analyze(fn, *args, policy="save-matmuls")
    assert reports[framework].activation_bytes == saved_bytes(
        fn, args, "save-matmuls"), framework

  def records(framework, spell=lambda p: p):
    # The scan's carried input sits in the stack module in NNX and at the
    # top level in linen: where the scan is, not a submodule's value.
    return sorted((spell(r.module_path), r.what, r.shape, r.nbytes)
                  for r in reports[framework].activations
                  if r.primitive != "input")

  nnx_paths = {r.module_path for r in reports["nnx"].activations}
  expected = ({"layers/blocks/attn/query", "layers/blocks/mlp/up"} if scan
              else {f"layers/{i}/attn/{p}" for i in (0, 1)
                    for p in ("query", "key", "value", "out")})
  assert expected | {"ln_f", "embed.attend"} <= nnx_paths
  assert records("nnx", lambda p: linen_spelling(p, scan)) == records("linen")
