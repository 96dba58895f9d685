"""Pins what the per-device analysis relies on of JAX's meshes, per JAX release.

For meshes larger than this machine (``jax.sharding.AbstractMesh``): where a
residual's sharding is read, when XLA decides it, and what exports. Part of
the compatibility layer's pins (``test_compat.py``).
"""

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import jax_residuals

from remat_toolkit._src.core import compat


def _abstract(axis_types, shape=(64, 4)):
  from jax.sharding import AbstractMesh
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = AbstractMesh(shape, ("data", "model"), axis_types=axis_types)

  def sds(shape, *spec):
    return jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=NamedSharding(mesh, P(*spec)))

  return mesh, sds


def _mlp(w1, w2, x):
  h = jax.checkpoint(lambda w1, x: jnp.tanh(x @ w1))(w1, x)
  return (h @ w2).mean()


def test_explicit_axes_put_every_residuals_sharding_in_its_type():
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P
  mesh, sds = _abstract((AxisType.Explicit,) * 2)

  def loss(w1, w2, x):
    h = jax.checkpoint(lambda w1, x: jnp.tanh(x @ w1))(w1, x)
    return jnp.matmul(h, w2, out_sharding=P("data", None)).mean()

  args = (sds((512, 2048), None, "model"), sds((2048, 512), "model", None),
          sds((1024, 512), "data", None))
  with jax.sharding.use_abstract_mesh(mesh):
    saved = jax_residuals(loss, *args)
  activations = [r.aval for r in saved if r.kind != "argument"]
  assert activations
  for aval in activations:
    s = compat.aval_sharding(aval)
    assert s.mesh == mesh
  tanh = [a for a in activations if a.shape == (1024, 2048)]
  assert [compat.aval_sharding(a).spec for a in tanh] == [P("data", "model")]
  assert compat.aval_sharding(tanh[0]).shard_shape((1024, 2048)) == (16, 512)


def test_auto_axes_leave_shardings_to_xla():
  from jax.sharding import AxisType
  mesh, sds = _abstract((AxisType.Auto,) * 2)
  args = (sds((512, 2048), None, "model"), sds((2048, 512), "model", None),
          sds((1024, 512), "data", None))
  saved = compat.saved_residuals(_mlp, *args)
  assert all(all(p is None for p in compat.aval_sharding(a).spec)
             for a, _ in saved)


def test_a_bare_partition_spec_needs_the_abstract_mesh_as_context():
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P
  mesh, sds = _abstract((AxisType.Explicit,) * 2)
  x = sds((1024, 512), "data", None)
  w = sds((512, 256), None, None)
  fn = lambda x, w: jnp.matmul(x, w, out_sharding=P("data", None))  # noqa: E731
  with pytest.raises(ValueError, match="not under a mesh context"):
    jax.make_jaxpr(fn)(x, w)
  with jax.sharding.use_abstract_mesh(mesh):
    jax.make_jaxpr(fn)(x, w)


def test_contracting_a_sharded_dimension_raises_sharding_type_error():
  from jax.sharding import AxisType
  _, sds = _abstract((AxisType.Explicit,) * 2)
  with pytest.raises(compat.ShardingTypeError, match="Contracting dimensions"):
    jax.make_jaxpr(_mlp)(sds((512, 2048), None, "model"),
                         sds((2048, 512), "model", None),
                         sds((1024, 512), "data", None))


def test_an_abstract_mesh_has_no_device_set():
  from jax.sharding import AxisType
  _, sds = _abstract((AxisType.Auto,) * 2)
  s = sds((64, 4), "data", None).sharding
  with pytest.raises(ValueError, match="device_set"):
    s.device_set  # noqa: B018
  assert s.num_devices == 256


def test_exported_programs_pickle_without_their_vjp():
  from jax.sharding import AxisType
  mesh, sds = _abstract((AxisType.Auto,) * 2, shape=(4, 2))
  args = (sds((8, 32), None, "model"), sds((16, 8), "data", None))
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(
        jax.jit(lambda w, x: [jnp.tanh(x @ w)]), platforms=["cpu"])(*args)
  back = compat.unpickle_exported(compat.pickle_exported(exported))
  # The worker reads shapes and dtypes (jax 0.12's unpickled avals compare
  # unequal to the originals in other ways).
  for field in ("in_avals", "out_avals"):
    assert ([(a.shape, a.dtype) for a in getattr(back, field)]
            == [(a.shape, a.dtype) for a in getattr(exported, field)])
  assert back.nr_devices == 8
  assert back.mlir_module() == exported.mlir_module()


def test_host_callbacks_do_not_export_on_an_abstract_mesh():
  from jax.sharding import AxisType
  mesh, sds = _abstract((AxisType.Auto,) * 2, shape=(4, 2))

  def noisy(x):
    jax.debug.print("{}", x.sum())
    return x * 2

  with pytest.raises((ValueError, NotImplementedError)):
    with jax.sharding.use_abstract_mesh(mesh):
      jax.export.export(jax.jit(noisy), platforms=["cpu"])(
          sds((16, 8), "data", None))
