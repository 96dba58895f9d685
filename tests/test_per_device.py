"""Per-device figures and budgets, on meshes larger than this machine.

The 64 x 4 tests plan a model of about 30 GiB (parameters and activations)
on abstract shapes over ``AbstractMesh((64, 4), ("data", "model"))`` with
Explicit axes: JAX carries every value's sharding in its type, so the
figures are read off the trace in this process, nothing is allocated or
compiled, and they are checked against hand-computed shard sizes and JAX's
own ``saved_residuals``. The subprocess method (Auto axes: compiled for
simulated CPU devices) is checked against the in-process method on 8
simulated devices; those tests start subprocesses and are marked slow.
"""

import json
import math
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from shared_helpers import jax_residuals
from shared_helpers import run_on_simulated_devices

import remat_toolkit as rt

MIB = 2**20
GIB = 2**30
EXPLICIT = (AxisType.Explicit, AxisType.Explicit)
AUTO = (AxisType.Auto, AxisType.Auto)
# 64-way data parallel x 4-way tensor parallel, on no devices at all.
MESH = AbstractMesh((64, 4), ("data", "model"), axis_types=EXPLICIT)
# Tokens per step, model width, MLP width, blocks: float32 parameters of
# 4 GiB, a 2 GiB input, and 4 GiB per block of MLP activations.
T, D, H, L = 65536, 8192, 16384, 4
UP_SHARD = T * H * 4 // (64 * 4)  # [T, H] as P("data", "model"): 16 MiB
X_SHARD = T * D * 4 // 64  # [T, D] as P("data", None): 32 MiB, whole per "model"


def sharded(mesh, shape, *spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))


@rt.remat
def block(w_up, w_down, x):
  # Written for explicit sharding: x @ w_up is sharded ("data", "model"); the
  # second matmul contracts "model", so its output sharding is spelled out.
  h = rt.tag(x @ w_up, "ffn.up")
  a = rt.tag(jax.nn.gelu(h), "ffn.act")
  y = jnp.matmul(a, w_down, out_sharding=P("data", None))
  return x + rt.tag(y, "ffn.down")


def loss(params, x):
  for w_up, w_down in params:
    x = block(w_up, w_down, x)
  return jnp.mean(x ** 2)


def big_args(mesh=MESH):
  params = [(sharded(mesh, (D, H), None, "model"),
             sharded(mesh, (H, D), "model", None)) for _ in range(L)]
  return params, sharded(mesh, (T, D), "data", None)


def nbytes(x):
  return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def jax_shard_bytes(fn, policy, args, mesh=MESH):
  """Per-device bytes of each activation residual, by JAX's saved_residuals."""
  with jax.sharding.use_abstract_mesh(mesh):
    saved = jax_residuals(fn, *args, policy=policy)
  return sorted(math.prod(r.aval.sharding.shard_shape(r.shape))
                * np.dtype(r.dtype).itemsize
                for r in saved if r.kind != "argument")


def our_shard_bytes(report):
  return sorted(r.per_device_nbytes for r in report.activations)


# ------------------------------------------------------------ 64 x 4, traced


def test_the_model_is_bigger_than_this_machine():
  params, x = big_args()
  report = rt.analyze(loss, params, x, policy="save-ffn")
  param_bytes = sum(nbytes(a) for a in jax.tree.leaves(params))
  assert param_bytes + nbytes(x) + report.activation_bytes > 24 * GIB


@pytest.mark.parametrize("policy, expected", [
    ("boundary-only", L * X_SHARD),  # the blocks' inputs and the loss's x
    ("save-ffn", L * X_SHARD + L * UP_SHARD),
])
def test_per_device_bytes_are_the_hand_computed_shards(remat_mode, policy,
                                                       expected):
  del remat_mode
  report = rt.analyze(loss, *big_args(), policy=policy)
  assert report.devices == 256
  assert report.per_device_method == "traced shardings"
  for r in report.activations:
    assert r.per_device_nbytes == {(T, H): UP_SHARD, (T, D): X_SHARD}[r.shape]
    assert r.nbytes == r.per_device_nbytes * (256 if r.shape == (T, H) else 64)
  assert report.per_device_activation_bytes == expected
  assert report.activation_bytes_per_device == expected
  assert report.to_dict()["per_device_method"] == "traced shardings"
  assert "per device (256 devices; traced shardings)" in str(report)


@pytest.mark.parametrize("policy", ["boundary-only", "save-ffn", "save-everything"])
def test_per_device_bytes_match_jax_saved_residuals(remat_mode, policy):
  del remat_mode
  args = big_args()
  report = rt.analyze(loss, *args, policy=policy)
  assert our_shard_bytes(report) == jax_shard_bytes(loss, policy, args)


def test_compare_shows_the_per_device_column_and_method():
  c = rt.compare(loss, *big_args(), policies=["boundary-only", "save-ffn"])
  assert [row["activation_bytes_per_device"] for row in c.rows()] == [
      L * X_SHARD, L * X_SHARD + L * UP_SHARD]
  assert {row["per_device_method"] for row in c.rows()} == {"traced shardings"}
  assert "per device = what one of 256 devices holds (traced shardings)" in str(c)


def test_plan_fits_the_budget_per_device_not_in_total():
  args = big_args()
  budget = L * X_SHARD + 2 * UP_SHARD  # 160 MiB: ffn.up of two blocks fits
  with pytest.raises(ValueError, match="No policy fits the activation budget"):
    rt.plan(loss, *args, budget=budget)  # in total it is GiBs
  uniform = rt.plan(loss, *args, budget=budget, per_device=True)
  per_layer = rt.plan(loss, *args, budget=budget, per_device=True,
                      per_layer=True)
  for p in (uniform, per_layer):
    assert p.per_device and p.devices == 256
    assert p.per_device_method == "traced shardings"
    assert p.kept_bytes == p.activation_bytes_per_device <= budget
    assert p.activation_bytes > 40 * budget
    assert p.estimated_peak == p.kept_bytes + p.workspace_bytes
    # JAX's own residuals under the planned policy hold the same per device.
    assert sum(jax_shard_bytes(loss, p.policy, args)) == p.kept_bytes
  # Keeping ffn.up in every block (192 MiB) does not fit; in two does.
  assert uniform.decisions["ffn.up"] == "recompute"
  assert per_layer.activation_bytes_per_device == budget
  assert per_layer.recompute_flops < uniform.recompute_flops
  assert all(f.activation_bytes <= budget for f in uniform.named if f.fits)


def test_plan_says_per_device_in_text_dict_and_policy_file():
  p = rt.plan(loss, *big_args(), budget="200MiB", per_device=True)
  text = str(p)
  assert "budget 200.0 MiB (kept activations per device)" in text
  assert "per device (256 devices, traced shardings;" in text
  data = p.to_dict()
  assert data["per_device"] is True and data["devices"] == 256
  assert data["per_device_method"] == "traced shardings"
  assert data["activation_bytes_per_device"] == p.kept_bytes
  assert data["activation_bytes"] == p.activation_bytes > p.kept_bytes
  assert "kept activations per device" in p.policy.description
  assert "per device" in p.policy.description


def test_default_keeps_total_budgets_and_old_keys():
  # Arguments small enough for total budgets, on the same 64 x 4 mesh.
  params = [(sharded(MESH, (8, 16), None, "model"),
             sharded(MESH, (16, 8), "model", None))] * 2
  x = sharded(MESH, (128, 8), "data", None)
  p = rt.plan(loss, params, x, budget="64KiB")
  assert not p.per_device and p.kept_bytes == p.activation_bytes <= 64 * 1024
  data = p.to_dict()
  assert data["per_device"] is False
  assert {"policy", "budget", "bounds", "activation_bytes", "estimated_peak",
          "named", "regions"} <= set(data)


# ------------------------------------------------------------ bad inputs


def _plain_loss(w, x):
  return jnp.mean(block_auto(w, w.T, x) ** 2)


@rt.remat
def block_auto(w_up, w_down, x):
  h = rt.tag(x @ w_up, "ffn.up")
  return x + rt.tag(jnp.tanh(h) @ w_down, "ffn.down")


def test_per_device_without_shardings_says_how_to_give_them():
  args = (jax.ShapeDtypeStruct((8, 16), jnp.float32),
          jax.ShapeDtypeStruct((4, 8), jnp.float32))
  with pytest.raises(ValueError, match="carry no sharding.*AbstractMesh"):
    rt.plan(_plain_loss, *args, budget="1KiB", per_device=True)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_per_device_must_be_a_bool(value):
  args = (jax.ShapeDtypeStruct((8, 16), jnp.float32),
          jax.ShapeDtypeStruct((4, 8), jnp.float32))
  with pytest.raises(TypeError, match=f"per_device must be True or False, got {value!r}"):
    rt.plan(_plain_loss, *args, budget="1KiB", per_device=value)


def test_arguments_on_two_meshes_are_refused():
  other = AbstractMesh((8, 32), ("data", "model"), axis_types=EXPLICIT)
  w = sharded(MESH, (8, 16), None, "model")
  x = sharded(other, (64, 8), "data", None)
  with pytest.raises(ValueError, match="2 different abstract meshes"):
    rt.analyze(_plain_loss, w, x)


def test_compile_needs_devices_not_an_abstract_mesh():
  w = sharded(MESH, (8, 16), None, "model")
  with pytest.raises(ValueError, match="compile=True compiles for this machine"):
    rt.analyze(lambda w: jnp.mean(jnp.tanh(w) ** 2), w, compile=True)


def test_host_callbacks_cannot_be_compiled_in_a_subprocess():
  # Refused before any subprocess starts: the export fails here.
  mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=AUTO)

  @rt.remat
  def noisy(w, x):
    h = rt.tag(x @ w, "ffn.up")
    jax.debug.print("mean {}", h.mean())
    return jnp.tanh(h).sum()

  with pytest.raises(ValueError, match="cannot be compiled for the 8 devices.*"
                     "calls the host.*Explicit axes"):
    rt.analyze(noisy, sharded(mesh, (8, 8), None, "model"),
               sharded(mesh, (16, 8), "data", None), policy="save-ffn")


# ------------------------------------------------------------ subprocesses

SMALL = dict(B=32, D=16, H=64)
POLICIES = ("boundary-only", "save-ffn", "save-everything")


def small_loss(params, x):
  for w_up, w_down in params:
    x = block_auto(w_up, w_down, x)
  return jnp.mean(x ** 2)


def small_args(mesh):
  b, d, h = SMALL["B"], SMALL["D"], SMALL["H"]
  params = [(sharded(mesh, (d, h), None, "model"),
             sharded(mesh, (h, d), "model", None))] * 2
  return params, sharded(mesh, (b, d), "data", None)


def small_figures(mesh):
  out = {}
  for policy in POLICIES:
    r = rt.analyze(small_loss, *small_args(mesh), policy=policy)
    out[policy] = [r.per_device_method, r.devices, r.per_device_activation_bytes,
                   [x.per_device_nbytes for x in r.residuals]]
  p = rt.plan(small_loss, *small_args(mesh), budget=out["save-ffn"][2],
              per_device=True)
  out["plan"] = [p.per_device_method, p.kept_bytes, p.decisions]
  return out


_HERE = textwrap.dedent('''
    import json, sys
    import jax
    from jax.sharding import AxisType
    sys.path.insert(0, sys.argv[1])
    import test_per_device as t
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=t.AUTO)
    print(json.dumps({"devices": jax.device_count(),
                      "figures": t.small_figures(mesh)}))
''')


@pytest.fixture(scope="module")
def eight_devices():
  """The in-process method's figures, on 8 simulated devices (a subprocess)."""
  return run_on_simulated_devices(_HERE, Path(__file__).parent)


@pytest.mark.slow
def test_subprocess_method_matches_compiling_on_eight_devices(eight_devices):
  assert eight_devices["devices"] == 8
  here = eight_devices["figures"]
  mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=AUTO)
  there = json.loads(json.dumps(small_figures(mesh)))
  for policy in POLICIES:
    assert here[policy][0] == "compiled here"
    assert there[policy][0] == "compiled in a subprocess"
    assert there[policy][1:] == here[policy][1:], policy
  assert here["plan"][0] == "compiled here"
  assert there["plan"][0] == "compiled in a subprocess"
  assert there["plan"][1:] == here["plan"][1:]
  # Batch-sharded activations: an eighth... of the "data" axis's 4 ways.
  r = rt.analyze(small_loss, *small_args(mesh), policy="boundary-only")
  assert r.per_device_activation_bytes * 4 == r.activation_bytes


@pytest.mark.slow
def test_explicit_mesh_falls_back_to_auto_axes_for_code_not_written_for_it():
  auto = AbstractMesh((4, 2), ("data", "model"), axis_types=AUTO)
  explicit = AbstractMesh((4, 2), ("data", "model"), axis_types=EXPLICIT)
  with pytest.warns(UserWarning, match="not written for explicit sharding"):
    r = rt.analyze(small_loss, *small_args(explicit), policy="save-ffn")
  assert r.per_device_method == "compiled in a subprocess"
  assert "ShardingTypeError" in r.warnings[-1]
  expected = rt.analyze(small_loss, *small_args(auto), policy="save-ffn")
  assert our_shard_bytes(r) == our_shard_bytes(expected)
  with pytest.warns(UserWarning, match="not written for explicit sharding"):
    p = rt.plan(small_loss, *small_args(explicit), budget=r.activation_bytes,
                per_device=True)
  assert p.per_device_method == "compiled in a subprocess"
  assert any("ShardingTypeError" in w for w in p.warnings)


@pytest.mark.slow
def test_sixteen_devices_in_a_subprocess():
  mesh = AbstractMesh((16,), ("data",), axis_types=(AxisType.Auto,))
  params = [(sharded(mesh, (16, 64)), sharded(mesh, (64, 16)))] * 2
  x = sharded(mesh, (64, 16), "data")
  r = rt.analyze(small_loss, params, x, policy="save-ffn")
  assert (r.devices, r.per_device_method) == (16, "compiled in a subprocess")
  assert r.per_device_activation_bytes * 16 == r.activation_bytes
