"""What is live at XLA's peak, read from the compiled, scheduled program.

XLA's buffer assignment decides which buffers are live together; with
``xla_dump_to`` it writes its live ranges, the buffers live at its peak among
them (``*-live-range.txt``). :func:`compile_with_buffers` compiles with that
dump into a temporary folder and reads it back; :func:`scheduled_peak`
describes each buffer from the compiled module's text
(``compiled.as_text()``), whose op metadata
(``op_name="jit(f)/transpose(jvp(GPT))/layers_1/mlp/up/dot_general"``) says
which module made it and whether it belongs to the backward pass
(``transpose``). Arguments and outputs are listed whole, as
``memory_analysis()`` counts them.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from remat_toolkit._src.analysis.xla_buffers import compile_with_buffers
  >>> f = jax.jit(jax.grad(lambda w, x: jnp.tanh(x @ w).sum()))
  >>> compiled, peak = compile_with_buffers(
  ...     f.lower(jnp.ones((64, 64)), jnp.ones((8, 64))))
  >>> peak.argument_bytes, peak.output_bytes
  (18432, 16384)
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Any

from remat_toolkit._src.results.peak import XlaBuffer

__all__ = ["ScheduledPeak", "scheduled_peak", "shape_bytes",
           "compile_with_buffers", "peak_buffers", "describe_op_name"]

_ITEM_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(
    r"(?:calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# How far an unnamed instruction is followed back through its operands.
_OPERAND_DEPTH = 4
# Scopes JAX writes itself in an op name (lowering remat, loops, calls, a
# jitted call's name), which name no module.
_JAX_SCOPE = re.compile(r"^(jit|pjit|checkpoint|remat|rematted_computation|"
                        r"custom_jvp_call|custom_vjp_call|while|body|cond|"
                        r"scan|closed_call|core_call|eval_jaxpr)(\(.*\))?$")
# A transform applied to the scope it wraps: JAX writes the name stack
# [jvp, transpose, block_0] as "transpose(jvp(block_0))"; "jvp()" wraps none.
_TRANSFORM = re.compile(r"^\w+\((.*)\)$")


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (``f32[4,8]{1,0}``, or a tuple: the sum)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _ITEM_BYTES.get(dtype, 4)
  return total


@dataclasses.dataclass(frozen=True)
class ScheduledPeak:
  """The walk's result: buffers at the peak, and what it counted.

  Attributes:
    live: arguments, outputs and the temporaries live at the peak.
    argument_bytes: the entry parameters' bytes.
    output_bytes: the outputs' bytes.
    temp_bytes: the temporaries' bytes at the peak.
    instruction: the instruction running at the peak.
    rematerialized: instructions XLA rematerialized itself (``.remat`` in
      their names).
  """

  live: tuple[XlaBuffer, ...]
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  instruction: str
  rematerialized: int


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  called: list[str]
  op_name: str
  root: bool
  fusion_kind: str = ""


def _matching(text: str, start: int) -> int:
  """Index just past the bracket closing the one at ``text[start]``."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for k in range(start, len(text)):
    c = text[k]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return k + 1
  return len(text)


def _parse_instruction(line: str) -> _Instr | None:
  text = line.strip()
  root = text.startswith("ROOT ")
  if root:
    text = text[5:]
  if " = " not in text:
    return None
  name, rest = text.split(" = ", 1)
  name = name.lstrip("%")
  if rest.startswith("("):
    end = _matching(rest, 0)
  else:
    end = rest.find(" ")
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  opcode = rest[:paren]
  close = _matching(rest, paren)
  operands = _OPERAND.findall(rest[paren:close])
  attrs = rest[close:]
  called = _CALLED.findall(attrs)
  for group in _BRANCHES.findall(attrs):
    called += _OPERAND.findall(group)
  op_name = _OP_NAME.search(attrs)
  kind = re.search(r"kind=(k\w+)", attrs)
  return _Instr(name, shape, opcode, operands, called,
                op_name.group(1) if op_name else "", root,
                kind.group(1) if kind else "")


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str]:
  comps: dict[str, list[_Instr]] = {}
  entry = ""
  current: list[_Instr] | None = None
  for line in text.splitlines():
    stripped = line.strip()
    if current is None:
      if stripped.endswith("{") and "->" in stripped:
        head = stripped.split(" ", 2)
        is_entry = head[0] == "ENTRY"
        name = (head[1] if is_entry else head[0]).lstrip("%")
        current = comps.setdefault(name, [])
        if is_entry:
          entry = name
      continue
    if stripped == "}":
      current = None
      continue
    instr = _parse_instruction(stripped)
    if instr is not None:
      current.append(instr)
  return comps, entry


def describe_op_name(op_name: str) -> tuple[str, str, str]:
  """``(phase, module path, primitive)`` of an HLO op name JAX wrote (of the
  first, where XLA merged several instructions' names: ``"a/mul;a/add"``)."""
  parts = [p for p in op_name.split(";")[0].split("/") if p]
  backward = any(p.startswith("transpose(") for p in parts)
  primitive = parts[-1] if parts else ""
  scopes = [_scope_of(p) for p in parts[:-1]]
  return ("backward" if backward else "forward"), "/".join(filter(None, scopes)), primitive


def _scope_of(part: str) -> str:
  """The module scope one element of an op name names, or ``""``."""
  while True:
    # jnp.einsum is a call named by its spec ("bhqk,bkhd->bqhd"): no module.
    if _JAX_SCOPE.match(part) or "->" in part:
      return ""
    transformed = _TRANSFORM.match(part)
    if transformed is None:
      return part
    part = transformed.group(1)


_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_PEAK_LINE = re.compile(r"^\s*([\w.\-]+)\{([0-9,]*)\}: (\d+) bytes")


def tuple_element(shape: str, index: str) -> str:
  """The element of a tuple shape at ``index`` (``"3"``, or ``"1,0"``)."""
  for k in filter(None, index.split(",")):
    if not shape.startswith("("):
      return shape
    body = re.sub(r"/\*[^*]*\*/", "", shape[1:_matching(shape, 0) - 1])
    parts, depth, start = [], 0, 0
    for pos, c in enumerate(body):
      if c in "([{":
        depth += 1
      elif c in ")]}":
        depth -= 1
      elif c == "," and depth == 0:
        parts.append(body[start:pos].strip())
        start = pos + 1
    parts.append(body[start:].strip())
    shape = parts[int(k)] if int(k) < len(parts) else shape
  return shape


def peak_buffers(live_range_text: str) -> list[tuple[str, str, int]]:
  """``(instruction, tuple index, bytes)`` of each buffer XLA lists live at
  its peak, from the ``*-live-range.txt`` file ``xla_dump_to`` writes."""
  found: list[tuple[str, str, int]] = []
  inside = False
  for line in live_range_text.splitlines():
    if _PEAK_HEADER.match(line):
      inside = True
      continue
    if inside:
      m = _PEAK_LINE.match(line)
      if not m:
        break
      found.append((m.group(1), m.group(2), int(m.group(3))))
  return found


def scheduled_peak(hlo_text: str, live_range_text: str = "") -> ScheduledPeak:
  """The buffers live at XLA's peak, described from the compiled module.

  Args:
    hlo_text: ``compiled.as_text()`` of a compiled step.
    live_range_text: XLA's live-range dump of the same module (its buffers
      live at the peak); without it, the temporaries are one entry.
  """
  comps, entry = _computations(hlo_text)
  instrs = comps.get(entry, [])
  by_name = {i.name: i for i in instrs}
  for comp in comps.values():
    for i in comp:
      by_name.setdefault(i.name, i)
  params = [i for i in instrs if i.opcode == "parameter"]
  outputs = _root_buffers(next((i for i in instrs if i.root), None), by_name)
  live: list[XlaBuffer] = []
  for i in params:
    live.append(XlaBuffer(i.name, _plain(i.shape), shape_bytes(i.shape),
                          "argument", _argument_path(i.name), "parameter"))
  out_names = {i.name for i in outputs}
  for i in outputs:
    _, path, prim = describe_op_name(_op_name(i, comps, by_name))
    live.append(XlaBuffer(i.name, _plain(i.shape), shape_bytes(i.shape),
                          "output", path, prim or i.opcode))
  param_names = {i.name for i in params}
  temp = 0
  first = ""
  for name, index, size in peak_buffers(live_range_text):
    if name in param_names or name in out_names:
      continue
    instr = by_name.get(name)
    phase, path, prim = describe_op_name(
        _op_name(instr, comps, by_name) if instr else "")
    shape = _plain(tuple_element(instr.shape, index)) if instr else ""
    label = f"{name}{{{index}}}" if index else name
    live.append(XlaBuffer(label, shape, size, phase, path,
                          prim or (instr.opcode if instr else "")))
    temp += size
    first = first or name
  remat = sum(1 for c in comps.values() for i in c if ".remat" in i.name)
  return ScheduledPeak(
      live=tuple(live), argument_bytes=sum(b.nbytes for b in live[:len(params)]),
      output_bytes=sum(b.nbytes for b in live if b.phase == "output"),
      temp_bytes=temp, instruction=first, rematerialized=remat)


def _op_name(instr: _Instr, comps: dict[str, list[_Instr]],
             by_name: dict[str, _Instr], depth: int = 0) -> str:
  """The op name JAX wrote for ``instr``, or what it computes where XLA left
  none: an instruction XLA made (a fusion, a copy, a convert it added)
  carries no metadata, but the fused computation it calls does (its root, or
  the named instruction nearest the root), and a copy or convert is its
  operand's. Without this a backward fusion reads as a forward buffer of no
  module."""
  if instr.op_name:
    return instr.op_name
  for called in instr.called:
    body = comps.get(called, [])
    root = next((i for i in body if i.root), None)
    if root is not None and root.op_name:
      return root.op_name
    named = next((i.op_name for i in reversed(body) if i.op_name), "")
    if named:
      return named
  if depth < _OPERAND_DEPTH:
    for operand in instr.operands:
      source = by_name.get(operand)
      if source is not None and source.opcode != "parameter":
        found = _op_name(source, comps, by_name, depth + 1)
        if found:
          return found
  return ""


def _root_buffers(root: _Instr | None, by_name: dict[str, _Instr]
                  ) -> list[_Instr]:
  """The instructions whose values the step returns (a tuple's elements)."""
  if root is None:
    return []
  names = root.operands if root.opcode == "tuple" else [root.name]
  return [by_name[n] for n in names
          if n in by_name and by_name[n].opcode != "parameter"]


def _plain(shape: str) -> str:
  """An HLO shape without its layout: ``f32[4,8]{1,0}`` -> ``f32[4,8]``."""
  return re.sub(r"\{[^{}]*\}", "", shape)


def _argument_path(name: str) -> str:
  # JAX names parameters after their pytree path: params__layers_0____mlp...
  text = re.sub(r"\.\d+$", "", name)
  parts = [p for p in re.split(r"_{2,}", text) if p]
  return "/".join(parts)


def compile_with_buffers(lowered: Any) -> tuple[Any, ScheduledPeak]:
  """Compiles ``lowered`` and reads XLA's own buffers live at its peak.

  The dump goes to a temporary folder, removed afterwards. A backend that
  refuses the dump option, or writes no live ranges, still compiles: the
  temporaries are then one entry.
  """
  with tempfile.TemporaryDirectory(prefix="remat-toolkit-xla-") as folder:
    try:
      compiled = lowered.compile(compiler_options={"xla_dump_to": folder})
    except Exception:  # noqa: BLE001 (an option this backend does not take)
      compiled = lowered.compile()
    ranges = sorted(glob.glob(os.path.join(folder, "*after_optimizations-live-range.txt")))
    text = ""
    if ranges:
      with open(ranges[-1], encoding="utf-8") as f:
        text = f.read()
  return compiled, scheduled_peak(compiled.as_text(), text)
