"""Text, HTML and DataFrames of the step's peak (:class:`Peak`)."""

from __future__ import annotations

import html
from typing import Any

from remat_toolkit._src.core import format as fmt
from remat_toolkit._src.display.common import require
from remat_toolkit._src.results.base import summary_lines
from remat_toolkit._src.results.base import to_dataframe
from remat_toolkit._src.results.base import to_html
from remat_toolkit._src.results.base import to_text
from remat_toolkit._src.results.peak import Peak

#: Live tensors a text or HTML rendering lists (largest first); the
#: DataFrame and ``to_dict`` hold them all.
SHOWN = 12
_STATE = ("parameter", "input", "optimizer state", "gradient", "output",
          "argument")


@summary_lines.register
def peak_summary(result: Peak) -> list[str]:
  """The peak's headline figures and warnings, one line each."""
  lines = [
      f"peak of one step under {result.policy}: "
      f"{fmt.format_bytes(result.bytes)} predicted, at the {result.when} "
      f"({result.step}; XLA:{result.backend.upper()} buffer model)",
      f"kept for the backward pass (rt.analyze): "
      f"{fmt.format_bytes(result.kept_bytes)}"]
  if result.xla_bytes is not None:
    flags = result.xla_flags or "(unset)"
    lines.append(
        f"XLA's figure (compiled; argument + output + temp - alias): "
        f"{fmt.format_bytes(result.xla_bytes)}, prediction "
        f"{result.error:+.1%}; XLA_FLAGS={flags}")
  else:
    # The walk follows the program's order, not XLA's schedule (far apart
    # on some unrolled programs): say how to check it.
    lines.append("not compiled: compile=True (--compile) adds XLA's own "
                 "figure and the buffers live at its peak")
  lines.extend(f"warning: {w}" for w in result.warnings)
  return lines


def _phase_rows(result: Peak) -> list[list[str]]:
  xla = result.xla_by_phase() or {}
  total = max(result.bytes, 1)
  return [[phase, fmt.format_bytes(n), f"{100.0 * n / total:.1f}%"]
          for phase, n in result.by_phase().items()] + (
      [["(XLA) " + phase, fmt.format_bytes(n), ""] for phase, n in xla.items()])


def _live_rows(result: Peak) -> list[list[str]]:
  rows = []
  for t in sorted(result.live, key=lambda t: -t.nbytes)[:SHOWN]:
    rows.append([fmt.format_bytes(t.nbytes), t.phase, t.module_path or "-",
                 t.what, f"{t.dtype}{list(t.shape)}"])
  return rows


def _xla_rows(result: Peak) -> list[list[str]]:
  buffers = [b for b in result.xla_live or () if b.phase not in _STATE]
  return [[fmt.format_bytes(b.nbytes), b.phase, b.module_path or "-",
           b.primitive or "-", b.shape or b.instruction]
          for b in sorted(buffers, key=lambda b: -abs(b.nbytes))[:SHOWN]]


_LIVE_HEADERS = ["bytes", "phase", "module", "what", "shape"]


@to_text.register
def _(result: Peak) -> str:
  parts = [*peak_summary(result), "",
           fmt.text_table(["phase", "bytes", "share"], _phase_rows(result),
                          right=[False, True, True]), "",
           f"largest tensors live at the predicted peak ({result.when}):",
           fmt.text_table(_LIVE_HEADERS, _live_rows(result),
                          right=[True, False, False, False, False])]
  if result.xla_live is not None:
    parts += ["", "largest buffers live at XLA's peak (besides arguments and "
              "outputs):",
              fmt.text_table(_LIVE_HEADERS, _xla_rows(result),
                             right=[True, False, False, False, False])]
  return "\n".join(parts)


@to_html.register
def _(result: Peak) -> str:
  lines = "<br>".join(html.escape(line, quote=False)
                      for line in peak_summary(result))
  out = [f"<div><p style='font-family:monospace'>{lines}</p>",
         fmt.html_table(["phase", "bytes", "share"], _phase_rows(result),
                        caption="Bytes at the peak, by phase"),
         fmt.html_table(_LIVE_HEADERS, _live_rows(result),
                        caption=f"Largest tensors live at the predicted peak "
                                f"({result.when})")]
  if result.xla_live is not None:
    out.append(fmt.html_table(_LIVE_HEADERS, _xla_rows(result),
                              caption="Largest buffers live at XLA's peak"))
  return "".join(out) + "</div>"


@to_dataframe.register
def _(result: Peak) -> Any:
  pd = require("pandas", "to_dataframe")
  return pd.DataFrame(result.rows())
