"""Compiling a program for N simulated CPU devices, in a subprocess.

A mesh larger than this machine (``jax.sharding.AbstractMesh((64, 4), ...)``)
has no devices to compile for here, and ``--xla_force_host_platform_device_count``
only takes effect before JAX starts its backend. So the program is exported
here (``jax.export``, for the CPU platform, with the arguments' shardings)
and compiled in a Python subprocess that JAX started with ``N`` CPU
devices; the subprocess rebuilds the mesh (same shape, axis names and axis
types) over its devices and answers with the shard shape XLA gives each
output. Only shardings cross the process boundary, never values: nothing is
allocated or run.

The subprocess is a worker kept for the life of this process, one per
device count (at most :data:`MAX_WORKERS` at once), so a planner measuring
dozens of policies pays Python's and JAX's start-up once and one compile per
policy. Measured on this project's CPU machines (2 cores): about 1.5 s to
start a worker for 16 or 256 devices, then 0.1 to 0.3 s per compile of a
small MLP.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import AbstractMesh, AxisType, NamedSharding
  >>> from jax.sharding import PartitionSpec as P
  >>> from remat_toolkit._src.analysis import simulated_devices
  >>> mesh = AbstractMesh((16,), ("data",), axis_types=(AxisType.Auto,))
  >>> x = jax.ShapeDtypeStruct((64, 8), jnp.float32,
  ...                          sharding=NamedSharding(mesh, P("data")))
  >>> simulated_devices.output_shard_shapes(
  ...     lambda x: [jnp.tanh(x), x.sum(0)], [x], mesh)  # doctest: +SKIP
  [(4, 8), (8,)]
"""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from remat_toolkit._src.core import compat

__all__ = ["output_shard_shapes", "shutdown", "MAX_WORKERS"]

#: Workers kept alive at once (each holds a JAX CPU client, about 300 MB).
MAX_WORKERS = 2

_BOOT = "from remat_toolkit._src.analysis.simulated_devices import serve; serve()"
_HEADER = struct.Struct(">Q")  # the length of each pickled message
# Configuration that changes how XLA partitions, copied to the worker when
# this JAX has it (set at run time, it is not in the environment).
_CONFIG = ("jax_use_shardy_partitioner",)


def output_shard_shapes(fn: Callable[..., Sequence[Any]], leaves: Sequence[Any],
                        mesh: Any) -> list[tuple[int, ...]]:
  """The shard shape of each output of ``fn(*leaves)`` on ``mesh``'s devices.

  Args:
    fn: returns a flat list of arrays.
    leaves: ``jax.ShapeDtypeStruct`` s, sharded on ``mesh`` (or unsharded:
      XLA chooses, as ``jit`` does for an argument without a sharding).
    mesh: a ``jax.sharding.AbstractMesh``; the worker rebuilds it with the
      same shape, axis names and axis types over ``mesh.size`` CPU devices.

  Returns:
    One shape per output: what one device holds of it (its largest shard).

  Raises:
    ValueError: ``jax.export`` refused the program (e.g. it calls the host:
      ``jax.pure_callback``, ``jax.debug.print``), or XLA refused to compile
      it for these shardings.
    RuntimeError: the worker died (its error output is in the message).
  """
  with jax.sharding.use_abstract_mesh(mesh):
    try:
      exported = jax.export.export(jax.jit(fn), platforms=["cpu"])(*leaves)
    except (ValueError, NotImplementedError) as e:
      raise ValueError(
          f"the program could not be exported to compile it for {mesh.size} "
          f"simulated CPU devices ({type(e).__name__}: {e}); host callbacks "
          "(jax.pure_callback, jax.debug.print) cannot be, and JAX may say "
          "what else it refused.") from None
  request = {
      "program": compat.pickle_exported(exported),
      "mesh": (tuple(mesh.axis_sizes), tuple(mesh.axis_names),
               tuple(t.name for t in mesh.axis_types)),
      "in": [_spec_of(x, mesh) for x in leaves],
      "config": {k: jax.config.values[k] for k in _CONFIG
                 if k in jax.config.values},
  }
  answer = _worker(mesh.size).ask(request)
  if answer[0] == "error":
    raise ValueError(
        f"XLA could not compile the program for {mesh.size} simulated CPU "
        f"devices on {mesh}: {answer[1]}")
  return [tuple(s) for s in answer[1]]


def _spec_of(x: Any, mesh: Any) -> tuple[Any, Any] | None:
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return None
  if getattr(sharding, "mesh", None) != mesh:
    raise ValueError(
        f"an argument is sharded as {sharding}, not on the mesh {mesh} the "
        "others use; put every argument on one mesh.")
  return sharding.spec, sharding.memory_kind


# ---------------------------------------------------------------- the parent


class _Worker:
  """A subprocess whose JAX has ``devices`` CPU devices."""

  def __init__(self, devices: int):
    self.devices = devices
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    # The worker imports this very package, wherever it was imported from.
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    self._stderr = tempfile.TemporaryFile()
    self._process = subprocess.Popen(
        [sys.executable, "-c", _BOOT], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=self._stderr)
    self._lock = threading.Lock()

  def ask(self, request: dict) -> tuple:
    with self._lock:
      try:
        _send(self._process.stdin, request)
        answer = _receive(self._process.stdout)
      except (BrokenPipeError, EOFError, OSError):
        answer = None
      if answer is None:
        self.close()
        _WORKERS.pop(self.devices, None)
        raise RuntimeError(
            f"the subprocess compiling for {self.devices} simulated CPU "
            f"devices stopped; its error output ends with:\n{self._tail()}")
      return answer

  def _tail(self) -> str:
    self._stderr.seek(0)
    return self._stderr.read().decode(errors="replace")[-3000:]

  def close(self) -> None:
    if self._process.poll() is None:
      try:
        if self._process.stdin is not None:  # a pipe: opened with PIPE
          self._process.stdin.close()  # the worker ends at end of input
        self._process.wait(timeout=10)
      except (OSError, subprocess.TimeoutExpired):
        self._process.kill()
        self._process.wait()


_WORKERS: dict[int, _Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(devices: int) -> _Worker:
  with _WORKERS_LOCK:
    worker = _WORKERS.pop(devices, None)
    if worker is None or worker._process.poll() is not None:
      worker = _Worker(devices)
    _WORKERS[devices] = worker  # most recently used last
    while len(_WORKERS) > MAX_WORKERS:
      _WORKERS.pop(next(iter(_WORKERS))).close()
    return worker


@atexit.register
def shutdown() -> None:
  """Ends every worker (they also end when this process does)."""
  with _WORKERS_LOCK:
    while _WORKERS:
      _WORKERS.popitem()[1].close()


def _send(stream: Any, message: Any) -> None:
  data = pickle.dumps(message)
  stream.write(_HEADER.pack(len(data)) + data)
  stream.flush()


def _receive(stream: Any) -> Any:
  header = stream.read(_HEADER.size)
  if len(header) < _HEADER.size:
    return None
  (size,) = _HEADER.unpack(header)
  data = stream.read(size)
  if len(data) < size:
    return None
  return pickle.loads(data)


# ---------------------------------------------------------------- the worker


def serve() -> None:  # pragma: no cover - runs in the subprocess
  """The worker's loop: one request in, one answer out, until end of input."""
  # Answers go to the real stdout; anything else printed goes to stderr.
  answers = os.fdopen(os.dup(1), "wb")
  os.dup2(2, 1)
  requests = sys.stdin.buffer
  meshes: dict[tuple, Any] = {}
  while True:
    request = _receive(requests)
    if request is None:
      return
    answer: tuple[str, Any]  # the compiled shapes, or the error's text
    try:
      answer = ("ok", _compile(request, meshes))
    except Exception as e:  # noqa: BLE001 - reported to the parent
      answer = ("error", f"{type(e).__name__}: {e}")
    _send(answers, answer)


def _compile(request: dict, meshes: dict[tuple, Any]) -> list[tuple[int, ...]]:
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  for key, value in request["config"].items():
    jax.config.update(key, value)
  sizes, names, types = request["mesh"]
  key = (sizes, names, types)
  if key not in meshes:
    meshes[key] = jax.make_mesh(sizes, names,
                                axis_types=tuple(AxisType[t] for t in types))
  mesh = meshes[key]
  exported = compat.unpickle_exported(request["program"])
  args = []
  for aval, spec in zip(exported.in_avals, request["in"], strict=True):
    sharding = None if spec is None else NamedSharding(mesh, spec[0],
                                                       memory_kind=spec[1])
    args.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding))
  compiled = jax.jit(exported.call).lower(*args).compile()
  shardings = jax.tree.leaves(compiled.output_shardings,
                              is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
  return [tuple(int(d) for d in s.shard_shape(tuple(a.shape)))
          for s, a in zip(shardings, exported.out_avals, strict=True)]
