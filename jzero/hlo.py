"""Collective communication read from a compiled program: how jzero proves its claims.

``collectives(compiled)`` walks the optimized HLO text from the entry computation, multiplies
each collective by the trip count of every ``while`` loop around it (XLA annotates
``known_trip_count``), and reports per kind the number of executions and the bytes of the
*full* buffer each one moves:

* all-gather: the gathered (output) buffer,
* reduce-scatter: the reduced (input) buffer, i.e. the output times the group size,
* all-reduce: the reduced buffer.

With these conventions ZeRO's volumes read directly, in units of the parameter bytes Psi:
stage 0 all-reduces Psi (2 Psi on the wire), stages 1-2 reduce-scatter Psi and all-gather Psi,
stage 3 all-gathers 2 Psi (forward and backward) and reduce-scatters Psi. ``wire_bytes`` counts
an all-reduce twice (a reduce-scatter plus an all-gather), as the ZeRO paper does.
"""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CollectiveStats",
    "KINDS",
    "LayoutCopy",
    "collectives",
    "layout_copies",
    "program_text",
]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_CALLEES = re.compile(
    r"\b(?:body|calls|to_apply|true_computation|false_computation|branch_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


@dataclass
class CollectiveStats:
    """Executions and full-buffer bytes of one kind of collective per step."""

    kind: str
    count: int = 0
    bytes: int = 0

    @property
    def wire_bytes(self) -> int:
        """Bytes in the ZeRO paper's accounting: an all-reduce counts twice."""
        return 2 * self.bytes if self.kind == "all-reduce" else self.bytes


def _shape_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * _DTYPE_BYTES[dtype])
    return out


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    return 1


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    if m:
        return int(m.group(1))
    # Before XLA annotates trip counts, read a scan's loop bound from its condition: a
    # counter from 0 compared "less than" a constant.
    cond = re.search(r"condition=%?([\w.\-]+)", line)
    body = comps.get(cond.group(1), []) if cond else []
    if any("direction=LT" in b for b in body):
        bounds = [re.search(r"s32\[\] constant\((\d+)\)", b) for b in body]
        found = [int(b.group(1)) for b in bounds if b]
        if len(found) == 1:
            return found[0]
    return 1


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """The HLO text's computations (name -> instruction lines) and the entry's name."""
    comps: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith(" "):
                current = comps.setdefault(m.group(1), [])
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            continue
        if line.strip() == "}":
            current = None
            continue
        current.append(line)
    return comps, entry


def _text(compiled: Any) -> str:
    if isinstance(compiled, str):
        return compiled
    return compiled.as_text()


def collectives(compiled: Any) -> dict[str, CollectiveStats]:
    """Per collective kind, executions and full-buffer bytes per call of a compiled program.

    Args:
      compiled: a ``jax.stages.Compiled`` or its ``as_text()``.

    Returns:
      ``{kind: CollectiveStats}`` for every kind in :data:`KINDS` (zero when absent).
    """
    comps, entry = _computations(_text(compiled))
    stats = {k: CollectiveStats(k) for k in KINDS}
    if entry is None:
        return stats

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 64 or name not in comps:
            return
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op, _ = m.groups()
            base = op.removesuffix("-start")
            if base in stats and not op.endswith("-done"):
                sizes = _shape_bytes(shape)
                if op.endswith("-start") and base != "all-reduce":
                    # Async forms return (operands, results): keep the results.
                    sizes = sizes[len(sizes) // 2 :]
                if sizes:
                    # A combined collective returns a tuple: it moves all of its buffers.
                    size = sum(sizes)
                    if base == "reduce-scatter":
                        size *= _group_size(line)
                    stats[base].count += times
                    stats[base].bytes += size * times
            inner = times * (_trip_count(line, comps) if op == "while" else 1)
            for callee in _CALLEES.findall(line):
                for c in re.findall(r"%?([\w.\-]+)", callee):
                    visit(c, inner, depth + 1)

    visit(entry, 1)
    return stats


@dataclass(frozen=True)
class LayoutCopy:
    """A copy or transpose that feeds a collective or reads its result: a re-layout."""

    name: str
    bytes: int
    collective: str
    line: str


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_LAYOUT_OPS = ("copy", "transpose")


def _operands(rest: str) -> list[str]:
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def layout_copies(compiled: Any) -> list[LayoutCopy]:
    """Every copy or transpose adjacent to a collective in a compiled program.

    A re-layout is a ``copy`` or ``transpose`` instruction, or a fusion that wraps only one of
    them (``wrapped_copy``), whose operand is the result of a collective or whose result is an
    operand of one. Such instructions appear when a collective runs along a minor dimension of
    its buffer's layout: XLA moves the data to make that dimension major and back, costing a
    read and a write of the buffer each time.

    Args:
      compiled: a ``jax.stages.Compiled`` or its ``as_text()``.

    Returns:
      One :class:`LayoutCopy` per such instruction (each counted once per program, not per
      loop iteration), its output bytes and the collective kind it touches.
    """
    comps, _ = _computations(_text(compiled))
    kinds = {f"{k}{s}" for k in KINDS for s in ("", "-start", "-done")}

    def root_op(name: str) -> str | None:
        lines = comps.get(name, [])
        if len(lines) > 3:  # more than parameter(s) and the root: real computation
            return None
        for line in lines:
            m = _INSTR.match(line)
            if line.lstrip().startswith("ROOT") and m:
                return m.group(2)
        return None

    found: list[LayoutCopy] = []
    for lines in comps.values():
        info: dict[str, tuple[str, str, list[str], str]] = {}
        for line in lines:
            n, m = _NAME.match(line), _INSTR.match(line)
            if not (n and m):
                continue
            shape, op, rest = m.groups()
            if op == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", line)
                inner = root_op(callee.group(1)) if callee else None
                op = inner if inner in _LAYOUT_OPS else op
            info[n.group(1)] = (op, shape, _operands(rest), line)
        for name, (op, shape, operands, line) in info.items():
            if op not in _LAYOUT_OPS:
                continue
            touches = [info[o][0] for o in operands if o in info and info[o][0] in kinds]
            touches += [
                other_op
                for other_op, _, other_operands, _ in info.values()
                if other_op in kinds and name in other_operands
            ]
            if touches:
                size = sum(_shape_bytes(shape))
                kind = touches[0].removesuffix("-start").removesuffix("-done")
                found.append(LayoutCopy(name, size, kind, line.strip()[:200]))
    return found


def program_text(lowered: Any) -> str:
    """The HLO of a lowered step after SPMD partitioning, with the collectives' own dtypes.

    The CPU backend has no 16-bit collectives: after partitioning, its compiler widens each
    bf16/fp16 all-reduce, reduce-scatter and all-gather to float32 (``all-reduce-promotion``),
    so its final program would hide a 16-bit ``communication_data_type``. This returns the
    module just before that rewrite (the program jzero emits, as a GPU runs it); on backends
    without the rewrite it is the compiled program itself.

    Args:
      lowered: a ``jax.stages.Lowered`` (e.g. ``engine.lower(batch)``).

    Returns:
      HLO text for :func:`collectives`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": "all-reduce-promotion"}
        )
        found = sorted(glob.glob(os.path.join(tmp, "*before_all-reduce-promotion*.txt")))
        if not found:
            return compiled.as_text()
        with open(found[-1]) as f:
            return f.read()
