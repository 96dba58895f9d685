"""The machine a benchmark ran on, printed by every script in ``benchmarks/``.

A figure without its machine, versions and XLA flags cannot be compared, so
each script starts with ``print(describe_machine())`` and stores
``machine_info()`` beside any JSON it writes.

Example:
  >>> import _machine
  >>> "jax" in _machine.machine_info()
  True
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

__all__ = ["describe_machine", "machine_info"]


def _cpu_model() -> str:
  # /proc/cpuinfo names the model on Linux; platform.processor() is often
  # empty there, but is the only answer on macOS.
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown CPU"


def _memory_bytes() -> int | None:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def _cores() -> int:
  # The cores this process may use, which is what a benchmark gets.
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _accelerators() -> list[str]:
  import jax
  devices = [d for d in jax.devices() if d.platform != "cpu"]
  kinds: dict[str, int] = {}
  for d in devices:
    kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
  return [f"{n} x {kind}" for kind, n in kinds.items()]


def machine_info() -> dict[str, Any]:
  """The machine, library versions and JAX settings, as a dict for JSON."""
  import jax
  memory = _memory_bytes()
  return {
      "cpu": _cpu_model(),
      "cores": _cores(),
      "memory_gib": round(memory / 2**30, 1) if memory else None,
      "accelerators": _accelerators(),
      "backend": jax.default_backend(),
      "python": platform.python_version(),
      "jax": _version("jax"),
      "jaxlib": _version("jaxlib"),
      "flax": _version("flax"),
      "optax": _version("optax"),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "jax_remat3": bool(jax.config.jax_remat3),
  }


def describe_machine() -> str:
  """Two lines: the hardware, then the software and flags a figure depends on."""
  info = machine_info()
  memory = f", {info['memory_gib']} GiB RAM" if info["memory_gib"] else ""
  accel = "; " + ", ".join(info["accelerators"]) if info["accelerators"] else ""
  hardware = (f"machine: {info['cpu']}, {info['cores']} cores{memory}{accel} "
              f"(JAX backend: {info['backend']})")
  software = (f"python {info['python']}, jax {info['jax']}, jaxlib "
              f"{info['jaxlib']}, flax {info['flax']}, optax {info['optax']}; "
              f"XLA_FLAGS={info['xla_flags'] or '(unset)'}; "
              f"jax_remat3={info['jax_remat3']}")
  return f"{hardware}\n{software}"


if __name__ == "__main__":
  print(describe_machine())
