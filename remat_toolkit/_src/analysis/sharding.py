"""Per-device figures for sharded programs, by one of three methods.

When the analysed arguments carry shardings (sharded ``jax.Array`` s, or
``jax.ShapeDtypeStruct(..., sharding=...)``), each residual's per-device size
is the bytes of its largest shard. Which sharding a residual gets is found
by the first method that applies (:func:`layout_of` decides; the report's
``per_device_method`` says which gave its figures):

- :data:`TRACED` ("traced shardings"): the arguments are on a
  ``jax.sharding.AbstractMesh`` whose axes are all ``Explicit``. JAX then
  carries every value's sharding in its type, residuals included, so each
  residual's shard shape is read off the traced program: no compile, and
  no device needed, whatever the mesh's size. The function must be written
  for explicit sharding; when JAX's tracing refuses it
  (``ShardingTypeError``), the program is traced again with the mesh's axes
  ``Auto`` and measured by :data:`SUBPROCESS` (see :func:`auto_axes`).
- :data:`COMPILED_HERE` ("compiled here"): concrete shardings on devices
  this process has. The traced step's forward part is compiled with the
  residuals as its outputs, the arguments sharded as given and the outputs
  left to XLA's sharding propagation: what a jitted training step holds on
  one device, up to XLA's freedom to reshard internal values.
- :data:`SUBPROCESS` ("compiled in a subprocess"): an ``AbstractMesh`` with
  ``Auto`` axes, larger than this machine or not. The same forward part is
  exported with ``jax.export`` and compiled for ``mesh.size`` simulated CPU
  devices in a subprocess (:mod:`remat_toolkit._src.analysis.simulated_devices`).

Replicated dimensions count whole on every device in all three.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import AbstractMesh, AxisType, NamedSharding
  >>> from jax.sharding import PartitionSpec as P
  >>> from remat_toolkit._src.analysis import sharding
  >>> sharding.device_count([jax.ShapeDtypeStruct((4,), jnp.float32)])
  1
  >>> sharding.shard_nbytes((8, 4), "float32", None)
  128
  >>> mesh = AbstractMesh((64, 4), ("data", "model"),
  ...                     axis_types=(AxisType.Explicit,) * 2)
  >>> x = jax.ShapeDtypeStruct((1024, 512), jnp.float32,
  ...                          sharding=NamedSharding(mesh, P("data", None)))
  >>> layout = sharding.layout_of([x])
  >>> layout.devices, layout.method
  (256, 'traced shardings')
  >>> sharding.shard_nbytes(x.shape, x.dtype, x.sharding)  # 1024/64 rows
  32768
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import NamedSharding

from remat_toolkit._src.analysis import regions as _regions
from remat_toolkit._src.analysis import residuals as _residuals
from remat_toolkit._src.analysis import simulated_devices
from remat_toolkit._src.core import compat
from remat_toolkit._src.core import jaxpr as _jaxpr

__all__ = ["device_count", "shard_nbytes", "Layout", "layout_of", "tracing",
           "auto_axes", "residual_device_bytes", "TRACED", "COMPILED_HERE",
           "SUBPROCESS", "METHODS"]

#: Shard shapes read off the traced program (Explicit axes of an AbstractMesh).
TRACED = "traced shardings"
#: Compiled for this process's devices (concrete shardings).
COMPILED_HERE = "compiled here"
#: Compiled for simulated CPU devices in a subprocess (AbstractMesh, Auto axes).
SUBPROCESS = "compiled in a subprocess"
METHODS = (TRACED, COMPILED_HERE, SUBPROCESS)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the arguments are spread over devices, and how to measure it.

  Attributes:
    devices: devices the arguments are spread over (1 when unsharded).
    method: one of :data:`METHODS`, or None when unsharded.
    mesh: the ``AbstractMesh`` of abstract shardings (None for concrete).
    note: why the method is not the obvious one (empty if it is).
  """

  devices: int = 1
  method: str | None = None
  mesh: Any = None
  note: str = ""


def _mesh_devices(sharding: Any) -> int:
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, AbstractMesh):  # no device_set: it has no devices
    return mesh.size
  return len(getattr(sharding, "device_set", ()) or ())


def device_count(leaves: Sequence[Any]) -> int:
  """Devices the arguments are spread over (1 when none carries a sharding)."""
  counts = [_mesh_devices(getattr(x, "sharding", None)) for x in leaves]
  return max(counts + [1])


def shard_nbytes(shape: Sequence[int], dtype: Any, sharding: Any) -> int:
  """Bytes of the largest shard of a ``shape``/``dtype`` value on one device.

  Args:
    shape: the global shape.
    dtype: its dtype.
    sharding: a ``jax.sharding.Sharding``, or None for a value every device
      holds whole.

  Returns:
    The bytes one device holds.
  """
  local = tuple(shape) if sharding is None else sharding.shard_shape(tuple(shape))
  return int(math.prod(local)) * _residuals.dtype_itemsize(dtype)


def layout_of(leaves: Sequence[Any]) -> Layout:
  """How the arguments' shardings are measured (see the module docstring).

  Raises:
    ValueError: arguments on two different abstract meshes, or some on an
      abstract mesh and some on devices.
  """
  shardings = [getattr(x, "sharding", None) for x in leaves]
  meshes = {mesh for mesh in (getattr(s, "mesh", None) for s in shardings)
            if isinstance(mesh, AbstractMesh)}
  devices = device_count(leaves)
  if not meshes:
    return Layout(devices, COMPILED_HERE) if devices > 1 else Layout()
  if len(meshes) > 1:
    raise ValueError(
        f"the arguments are sharded over {len(meshes)} different abstract "
        f"meshes ({', '.join(sorted(map(str, meshes)))}); put them all on one "
        "jax.sharding.AbstractMesh.")
  (mesh,) = meshes
  concrete = [s for s in shardings if s is not None
              and not isinstance(getattr(s, "mesh", None), AbstractMesh)]
  if concrete:
    raise ValueError(
        f"some arguments are sharded on the abstract mesh {mesh} and others on "
        f"devices ({concrete[0]}); give every argument a NamedSharding on the "
        "same jax.sharding.AbstractMesh (or every one on the same devices).")
  if mesh.size <= 1:
    return Layout()
  if all(t == AxisType.Explicit for t in mesh.axis_types):
    return Layout(mesh.size, TRACED, mesh)
  return Layout(mesh.size, SUBPROCESS, mesh)


def tracing(layout: Layout) -> contextlib.AbstractContextManager:
  """The context to trace the program in: the abstract mesh, if any.

  Under it, a model may name shardings by ``PartitionSpec`` alone (e.g.
  ``jnp.matmul(a, b, out_sharding=P("data", None))``), as under
  ``jax.set_mesh`` on real devices.
  """
  if layout.mesh is None:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(layout.mesh)


def auto_axes(leaves: Sequence[Any], layout: Layout, error: Exception
              ) -> tuple[list[Any], Layout]:
  """The arguments and layout with every mesh axis ``Auto``.

  For a function JAX cannot trace with explicit sharding (``error`` says
  why): on ``Auto`` axes the shardings are XLA's to propagate, so they are
  measured by compiling (:data:`SUBPROCESS`).
  """
  mesh = layout.mesh
  auto = AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names),
                      axis_types=(AxisType.Auto,) * len(mesh.axis_names))

  def retyped(x):
    s = getattr(x, "sharding", None)
    if s is None:
      return x
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(auto, s.spec,
                                                 memory_kind=s.memory_kind))

  first = str(error).strip().splitlines()[0] if str(error).strip() else ""
  note = (f"fn is not written for explicit sharding ({type(error).__name__}: "
          f"{first}), so its per-device figures were compiled for the mesh "
          f"with Auto axes; to read them off the trace, give each such "
          f"operation an out_sharding (e.g. jnp.matmul(a, b, "
          f"out_sharding=P('data', None))).")
  return [retyped(x) for x in leaves], Layout(layout.devices, SUBPROCESS, auto,
                                              note)


def residual_device_bytes(origins: Sequence[_residuals.ResidualOrigin],
                          leaves: Sequence[Any], step: _residuals.TracedStep,
                          layout: Layout) -> list[int] | None:
  """The bytes one device holds of each residual, by ``layout.method``.

  Args:
    origins: the step's residuals (:func:`residuals.residual_origins`).
    leaves: the abstract arguments (with their shardings).
    step: the traced training step the residuals were read from.
    layout: what :func:`layout_of` found.

  Returns:
    One figure per origin, or None when the arguments are not sharded over
    several devices.

  Raises:
    ValueError: a program that cannot be compiled in a subprocess (it calls
      the host), or that JAX or XLA refuses for these shardings.
  """
  if layout.method is None:
    return None
  if layout.method == TRACED:
    shardings = [compat.aval_sharding(o.aval) for o in origins]
  else:
    variables = [o.var for o in origins]
    if layout.method == COMPILED_HERE:
      shardings = _residuals.residual_shardings(step.jaxpr, variables,
                                                list(leaves))
    else:
      return _subprocess_bytes(origins, leaves, step, layout)
  return [shard_nbytes(o.aval.shape, o.aval.dtype, s)
          for o, s in zip(origins, shardings, strict=True)]


def _subprocess_bytes(origins, leaves, step, layout: Layout) -> list[int]:
  run, kept, forward = _residuals.residual_program(
      step.jaxpr, [o.var for o in origins])
  # A host callback runs Python of this process: no other process can
  # compile it (jax.export refuses), so say which one and what to do.
  calls = sorted({e.primitive.name for e in _jaxpr.walk(forward)
                  if e.primitive.name in _regions.CALLBACK_PRIMITIVES})
  if calls:
    raise ValueError(
        f"fn cannot be compiled for the {layout.devices} devices of "
        f"{layout.mesh} in a subprocess: it calls the host (primitive "
        f"{', '.join(calls)}, as jax.pure_callback, io_callback and "
        "jax.debug.print do), which only this process can run. Leave the "
        "callback out of the loss you analyse, give the mesh Explicit axes "
        "(figures read off the trace, nothing compiled), or shard the "
        "arguments over this machine's devices.")
  shapes = iter(simulated_devices.output_shard_shapes(run, list(leaves),
                                                      layout.mesh))
  out = []
  for o, is_kept in zip(origins, kept, strict=True):
    local = next(shapes) if is_kept else tuple(o.aval.shape)
    out.append(int(math.prod(local)) * _residuals.dtype_itemsize(o.aval.dtype))
  return out
