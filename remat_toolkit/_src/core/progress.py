"""What a long run shows while it works, and when it stops starting more.

:class:`Progress` prints ``[i/n] policy: what`` lines, :class:`Deadline`
holds a run's time limit, and :func:`one_line` shortens a policy's failure
for the result's ``skipped`` table; the benchmark and the batch search share
them.

Example:
  >>> import io
  >>> from remat_toolkit._src.core.progress import Progress
  >>> out = io.StringIO()
  >>> tracker = Progress(2, True, stream=out)
  >>> tracker.start("boundary-only", "compiling...")
  >>> out.getvalue().splitlines()
  ['[1/2] boundary-only: compiling...']
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "Deadline", "one_line"]


class Progress:
  """``[i/n] policy: what`` lines on stderr; rewritten in place on a terminal."""

  def __init__(self, total: int, enabled: bool, stream: TextIO | None = None):
    self.total, self.enabled = total, enabled
    self.stream = stream or sys.stderr
    self.count = 0
    self.inline = enabled and getattr(self.stream, "isatty", lambda: False)()

  def start(self, label: str, what: str) -> None:
    self.count += 1
    self.update(label, what)

  def update(self, label: str, what: str, *, detail: bool = False) -> None:
    if not self.enabled or (detail and not self.inline):
      return
    text = f"[{self.count}/{self.total}] {label}: {what}"
    if self.inline:
      self.stream.write("\r\033[K" + text)
    else:
      self.stream.write(text + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.inline:
      self.stream.write("\r\033[K")
      self.stream.flush()


class Deadline:
  """Whether a run's time limit has passed (never, without one)."""

  def __init__(self, limit_s: float | None):
    if limit_s is not None and (isinstance(limit_s, bool) or not isinstance(
        limit_s, (int, float)) or limit_s <= 0):
      raise ValueError(f"time_limit_s must be a positive number of seconds "
                       f"or None, got {limit_s!r}.")
    self.limit_s = limit_s
    self.start = time.perf_counter()

  @property
  def reason(self) -> str:
    return f"the time limit of {self.limit_s:g} s was reached before it started"

  def expired(self) -> bool:
    return (self.limit_s is not None
            and time.perf_counter() - self.start > self.limit_s)


def one_line(error: Exception) -> str:
  """An exception as one line, for a skipped policy's reason."""
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
