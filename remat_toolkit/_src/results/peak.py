"""The step's peak as data: what is live at the worst moment, predicted and XLA's.

Example:
  >>> from remat_toolkit._src.results.peak import LiveTensor
  >>> t = LiveTensor(shape=(4, 8), dtype="float32", nbytes=128,
  ...                phase="kept residual", module_path="mlp", name="ffn.up",
  ...                primitive="dot_general")
  >>> t.what
  'ffn.up'
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from remat_toolkit._src.policies.findings import Finding
from remat_toolkit._src.results import base as render
from remat_toolkit._src.results.base import Result

__all__ = ["LiveTensor", "XlaBuffer", "Peak", "PREDICTION_TOLERANCE"]

#: How far the prediction may be from XLA's figure before a result says so.
PREDICTION_TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class LiveTensor:
  """One tensor live at the predicted peak.

  Attributes:
    shape: its shape.
    dtype: the dtype it is stored in (``float32`` for a 16-bit matmul operand
      XLA:CPU computes in float32).
    nbytes: bytes it holds.
    phase: ``"parameter"``, ``"input"``, ``"optimizer state"``,
      ``"gradient"``, ``"output"`` (what a train step returns),
      ``"kept residual"`` (made by the forward pass, read by the backward
      pass), ``"forward transient"`` or ``"backward transient"``; one
      ``"packing"`` entry (no tensor) holds the gaps XLA's layout of the
      temporaries leaves beyond what is live at the peak.
    module_path: the module that made it, or an argument's pytree path.
    name: its checkpoint name, if any.
    primitive: the primitive that made it (``"argument"``, ``"output"``).
  """

  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  phase: str
  module_path: str
  name: str | None
  primitive: str

  @property
  def what(self) -> str:
    """Its name, else the primitive that made it."""
    return self.name or f"<{self.primitive}>"


@dataclasses.dataclass(frozen=True)
class XlaBuffer:
  """One buffer live at XLA's peak, read from the compiled program.

  Attributes:
    instruction: the HLO instruction that wrote it (``name{i}`` for element
      ``i`` of a tuple); for the one ``"packing"`` entry, what it stands
      for: the bytes XLA's temporary allocation holds beyond the buffers
      live at its peak, or (negative) the temporaries XLA laid in output or
      donated buffers before they were written, which ``memory_analysis()``
      counts once, as outputs.
    shape: its HLO shape, e.g. ``f32[1024,3072]``.
    nbytes: bytes.
    phase: ``"argument"``, ``"output"``, ``"forward"``, ``"backward"`` or
      ``"packing"``.
    module_path: the module its op name names.
    primitive: the JAX primitive its op name ends with.
  """

  instruction: str
  shape: str
  nbytes: int
  phase: str
  module_path: str
  primitive: str


@dataclasses.dataclass(frozen=True)
class Peak(Result):
  """The peak device bytes of one training step under one policy.

  Attributes:
    policy: the policy's name.
    bytes: the predicted peak: arguments, outputs and what is live at the
      worst moment of the step, from the program without compiling it.
    live: the tensors live at the predicted peak; their bytes sum to
      :attr:`bytes`.
    when: where the predicted peak falls, e.g. ``"backward of layers_0/attn"``.
    kept_bytes: activation bytes the policy keeps for the backward pass
      (:func:`remat_toolkit.analyze`'s ``activation_bytes``), for reference.
    step: what was measured: ``"jax.grad of the first argument"`` or the
      optimizer's train step.
    backend: the XLA backend modelled (``"cpu"``, ``"gpu"``, ``"tpu"``).
    xla_bytes: with ``compile=True``, XLA's figure: argument + output +
      temp - alias bytes of ``memory_analysis()``; else None.
    xla_live: with ``compile=True``, the buffers live at XLA's peak; their
      bytes sum to :attr:`xla_bytes`.
    xla_flags: ``XLA_FLAGS`` as they were when the step was compiled
      (None without ``compile=True``).
    warnings: findings (XLA's own remat, the CPU scheduler setting, the
      device's limit, a prediction off XLA's figure).
  """

  policy: str
  bytes: int
  live: tuple[LiveTensor, ...]
  when: str
  kept_bytes: int
  step: str
  backend: str
  xla_bytes: int | None = None
  xla_live: tuple[XlaBuffer, ...] | None = None
  xla_flags: str | None = None
  warnings: tuple[Finding, ...] = ()

  @property
  def error(self) -> float | None:
    """``bytes / xla_bytes - 1``: how far the prediction is from XLA's figure."""
    if not self.xla_bytes:
      return None
    return self.bytes / self.xla_bytes - 1.0

  @property
  def within_tolerance(self) -> bool | None:
    """Whether the prediction is within :data:`PREDICTION_TOLERANCE`."""
    error = self.error
    return None if error is None else abs(error) <= PREDICTION_TOLERANCE

  def by_phase(self) -> dict[str, int]:
    """Predicted bytes per phase, largest first."""
    return _grouped((t.phase, t.nbytes) for t in self.live)

  def by_module(self, depth: int | None = 1) -> dict[str, int]:
    """Predicted bytes of the activations and transients per module prefix
    (parameters, inputs, gradients, optimizer state and packing left out)."""
    state = {"parameter", "input", "optimizer state", "gradient", "output",
             "packing"}
    return _grouped(
        ("/".join(t.module_path.split("/")[:depth] if depth else
                  t.module_path.split("/")) or "(top level)", t.nbytes)
        for t in self.live if t.phase not in state)

  def xla_by_phase(self) -> dict[str, int] | None:
    """XLA's bytes per phase, largest first (None without ``compile=True``)."""
    if self.xla_live is None:
      return None
    return _grouped((b.phase, b.nbytes) for b in self.xla_live)

  def rows(self) -> list[dict[str, Any]]:
    """One record per live tensor at the predicted peak, largest first."""
    return [dataclasses.asdict(t) | {"shape": list(t.shape)}
            for t in sorted(self.live, key=lambda t: -t.nbytes)]

  def summary_lines(self) -> list[str]:
    """The headline figures and warnings, one line each."""
    return render.summary_lines(self)

  def to_dict(self) -> dict[str, Any]:
    """Plain data: every field, the error against XLA and the phase totals."""
    out = dataclasses.asdict(self)
    out["live"] = [dict(t, shape=list(t["shape"])) for t in out["live"]]
    out["warnings"] = list(self.warnings)
    out.update(error=self.error, by_phase=self.by_phase(),
               xla_by_phase=self.xla_by_phase())
    return out


def _grouped(pairs) -> dict[str, int]:
  out: dict[str, int] = defaultdict(int)
  for key, n in pairs:
    out[key] += n
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))
