"""Formatting shared by every report: byte sizes, FLOPs, text and HTML tables."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence

__all__ = ["format_bytes", "format_flops", "text_table", "html_table", "parse_bytes",
           "warnings_html", "natural_key", "prose_html"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_PARSE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def format_bytes(n: float, digits: int = 1) -> str:
  """Human-readable binary size, with ``digits`` decimals above bytes.

  Example:
    >>> format_bytes(33554432)
    '32.0 MiB'
    >>> format_bytes(512), format_bytes(2**30 * 1.875, digits=3)
    ('512 B', '1.875 GiB')
  """
  n = float(n)
  for unit in _UNITS:
    if abs(n) < 1024 or unit == _UNITS[-1]:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def parse_bytes(value: int | float | str) -> int:
  """Bytes from a number or a size string such as ``"8GiB"`` or ``"1.5 GB"``.

  Units are case-insensitive. ``K``/``M``/``G``/``T`` and ``KiB``/``MiB``/
  ``GiB``/``TiB`` are binary (``"2G"`` is 2 * 2**30 bytes); ``KB``/``MB``/
  ``GB``/``TB`` are decimal (``"2GB"`` is 2 * 10**9 bytes), as in
  ``jax.devices()[0].memory_stats()`` versus a vendor's data sheet. A float
  number of bytes is rounded down.

  Raises:
    ValueError: if the value is negative, not finite, or not a size.
    TypeError: if the value is neither a number nor a string.

  Example:
    >>> parse_bytes("8GiB")
    8589934592
    >>> parse_bytes("2GB")
    2000000000
    >>> parse_bytes(1024)
    1024
  """
  if isinstance(value, bool) or not isinstance(value, (int, float, str)):
    raise TypeError(
        f"A memory size must be a number of bytes or a string like '8GiB', "
        f"got {value!r} of type {type(value).__name__}.")
  if isinstance(value, (int, float)):
    amount, unit = value, "b"
  else:
    text = value.strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):] or "b"
    try:
      parsed: float | None = float(number)
    except ValueError:
      parsed = None
    if parsed is None or unit not in _PARSE_UNITS:
      raise ValueError(
          f"{value!r} is not a memory size; write bytes as a number or a "
          "string such as '512MiB', '8GiB' (binary) or '1.5GB' (decimal).")
    amount = parsed
  if not math.isfinite(amount):
    raise ValueError(f"A memory size must be finite, got {value!r}.")
  if amount < 0:
    raise ValueError(
        f"A memory size cannot be negative, got {value!r}; give a "
        "non-negative number of bytes or a string such as '512MiB' or '8GiB'.")
  return int(amount * _PARSE_UNITS[unit])


def format_flops(n: float) -> str:
  """Human-readable FLOP count.

  Example:
    >>> format_flops(2.5e12)
    '2.50 TFLOP'
  """
  n = float(n)
  for unit in ("", "K", "M", "G", "T", "P", "E"):
    if abs(n) < 1000 or unit == "E":
      return f"{n:.0f} FLOP" if unit == "" else f"{n:.2f} {unit}FLOP"
    n /= 1000
  raise AssertionError("unreachable")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
               *, right: Sequence[bool] | None = None) -> str:
  """A fixed-width table; numeric-looking columns can be right-aligned.

  Example:
    >>> print(text_table(["a", "b"], [["x", 1]], right=[False, True]))
    a  b
    -  -
    x  1
  """
  cells = [[str(c) for c in row] for row in rows]
  widths = [max([len(h)] + [len(r[i]) for r in cells])
            for i, h in enumerate(headers)]
  right = list(right) if right is not None else [False] * len(headers)

  def fmt(row):
    parts = [c.rjust(w) if r else c.ljust(w)
             for c, w, r in zip(row, widths, right, strict=True)]
    return "  ".join(parts).rstrip()

  lines = [fmt(headers), fmt(["-" * w for w in widths])]
  lines.extend(fmt(r) for r in cells)
  return "\n".join(lines)


_NUMERIC = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?\s*(%|x|[KMGTP]?i?B|[KMGTP]?FLOP|s)?$")


def _is_numeric(cell: object) -> bool:
  """Whether a cell reads as a number (``12.5 MiB``, ``3.2%``, ``4``)."""
  return isinstance(cell, (int, float)) or bool(_NUMERIC.match(str(cell).strip()))


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
               *, caption: str | None = None,
               highlight: Sequence[bool] | None = None) -> str:
  """An HTML table for notebooks, laid out for reading.

  Columns take the width of their content (notebook styles fix the layout
  otherwise, wrapping names over lines), cells do not wrap, and a column
  whose cells all read as numbers is right-aligned, as in the text tables.
  ``highlight`` bolds whole rows.

  Example:
    >>> html_table(["policy", "bytes"], [["a", "1.0 KiB"]]).count("right")
    2
  """
  columns = list(zip(*rows, strict=True)) if rows else [()] * len(headers)
  align = ["right" if col and all(_is_numeric(c) or str(c) in ("-", "")
                                  for c in col)
           and any(_is_numeric(c) for c in col) else "left"
           for col in columns]
  cell = "padding:2px 8px;white-space:nowrap;text-align:{}"
  out = ['<table style="border-collapse:collapse;font-family:monospace;'
         'table-layout:auto;width:auto">']
  if caption:
    out.append(f"<caption style='text-align:left'>{html.escape(caption)}</caption>")
  out.append("<thead><tr>" + "".join(
      f"<th style='{cell.format(a)}'>{html.escape(h)}</th>"
      for h, a in zip(headers, align, strict=True)) + "</tr></thead><tbody>")
  for i, row in enumerate(rows):
    bold = ";font-weight:bold" if highlight is not None and highlight[i] else ""
    out.append("<tr>" + "".join(
        f"<td style='{cell.format(a)}{bold}'>{html.escape(str(c))}</td>"
        for c, a in zip(row, align, strict=True)) + "</tr>")
  out.append("</tbody></table>")
  return "".join(out)


def prose_html(text: str) -> str:
  """A sentence as HTML: escaped, its ```code``` spans set as code.

  Example:
    >>> prose_html("run `remat-toolkit plan` <now>")
    'run <code>remat-toolkit plan</code> &lt;now&gt;'
  """
  return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text, quote=False))


def natural_key(text: str) -> tuple:
  """Sorts ``layers_2`` before ``layers_10``: digit runs compare as numbers.

  Example:
    >>> sorted(["layers_10", "layers_2"], key=natural_key)
    ['layers_2', 'layers_10']
  """
  return tuple(int(part) if part.isdigit() else part
               for part in re.split(r"(\d+)", text))


def warnings_html(warnings: Sequence[str]) -> str:
  """A result's warnings as HTML paragraphs, set apart so none is missed.

  Example:
    >>> warnings_html(["policy 'x' changes nothing"])
    "<p style='color:#b45309;font-family:monospace'>warning: policy 'x' changes nothing</p>"
  """
  return "".join(
      "<p style='color:#b45309;font-family:monospace'>warning: "
      f"{html.escape(w, quote=False)}</p>" for w in warnings)
