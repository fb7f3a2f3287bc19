"""Collective bytes: per kind, per mesh axes and per dtype, read from a compiled program.

The byte-accounting half of :mod:`jzero.hlo`; the text it reads is parsed by
:mod:`jzero.hlo.parse`.

Decisions:

* ``collectives(compiled)`` walks the optimized HLO text from the entry computation,
  multiplies each collective by the trip count of every ``while`` loop around it (XLA
  annotates ``known_trip_count``; before it does, a scan's bound is read from its condition),
  and reports per kind the number of executions and the bytes of the *full* buffer each one
  moves:

  * all-gather: the gathered (output) buffer,
  * reduce-scatter: the reduced (input) buffer, i.e. the output times the group size,
  * all-reduce: the reduced buffer.

  With these conventions ZeRO's volumes read directly, in units of the parameter bytes Psi:
  stage 0 all-reduces Psi (2 Psi on the wire), stages 1-2 reduce-scatter Psi and all-gather
  Psi, stage 3 all-gathers 2 Psi (forward and backward) and reduce-scatters Psi.
  ``wire_bytes`` counts an all-reduce twice (a reduce-scatter plus an all-gather), as the ZeRO
  paper does.
* **A conditional read from a schedule table.** A ``conditional`` inside a loop runs one
  branch per iteration. When its branch index is computed from a constant integer table with
  one entry per iteration of the loop around it (how :mod:`jzero.parallel.pipeline` picks
  each slot's transfers: the table indexed by the slot number), branch ``j`` is counted as
  often as the table names it (values clamped to the branches, as ``lax.switch`` does).
  Any other conditional counts each branch every time it runs: an upper bound.
* Async forms (``-start``) count their results once, ``-done`` not at all; a combined
  collective (a tuple) counts every buffer it moves.
* ``collectives_by_axes(compiled, mesh)`` splits the same counts by the mesh axes each
  collective's device groups span (:func:`jzero.hlo.parse.replica_groups`), which is how
  hybrid sharding's claim (only ``1/data`` of the gradient bytes cross the ``replica`` axis,
  i.e. the hosts) is read from the program. ``collectives_by_dtype`` splits them by element
  type (ZeRO++'s ``s8`` bytes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jzero.hlo.parse import (
    DTYPE_BYTES,
    INSTR,
    KINDS,
    SHAPE,
    compiled_text,
    computations,
    operand_names,
    replica_groups,
    shape_bytes,
    source_target_pairs,
)

__all__ = [
    "CollectiveStats",
    "collectives",
    "collectives_by_axes",
    "collectives_by_dtype",
    "permute_sends",
]

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


def _group_size(line: str) -> int:
    """Devices in each group of a collective, from :func:`replica_groups` (every spelling,
    the ``mesh[...]`` one included); 1 when the line names no groups."""
    return len(replica_groups(line, 1)[0])


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


_CONST_TABLE = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*s32\[(\d+)\]\{0\}\s+constant\(\{([-0-9, ]*)\}\)")


def _branch_times(
    line: str, lines: list[str], times: int, trip: int, branches: int
) -> list[int] | None:
    """Per branch of the ``conditional`` on ``line``, how often it runs, when its index reads a
    constant table of ``trip`` entries (one per iteration of the loop it runs in); else None."""
    m = INSTR.match(line)
    if not m or "branch_computations=" not in line or trip <= 1 or times % trip:
        return None
    index = operand_names(m.group(3))[0].strip().lstrip("%")
    tables = {t.group(1): t for t in map(_CONST_TABLE.match, lines) if t}
    found = None
    for other in lines:
        name = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", other)
        if name and name.group(1) == index:
            found = INSTR.match(other)
            break
    if found is None:
        return None
    used = [tables[o.strip().lstrip("%")] for o in operand_names(found.group(3))
            if o.strip().lstrip("%") in tables]  # fmt: skip
    if len(used) != 1 or int(used[0].group(2)) != trip:
        return None
    values = np.clip([int(v) for v in used[0].group(3).split(",")], 0, branches - 1)
    return [times // trip * int((values == j).sum()) for j in range(branches)]


def _walk(compiled: Any) -> Iterator[tuple[str, int, int, str]]:
    """Every collective executed by a compiled program: ``(kind, full-buffer bytes, times per
    call, instruction line)``, loops multiplied out."""
    comps, entry = computations(compiled_text(compiled, tables=True))
    if entry is None:
        return

    def visit(
        name: str, times: int, depth: int = 0, trip: int = 1
    ) -> Iterator[tuple[str, int, int, str]]:
        if depth > 64 or name not in comps:
            return
        for line in comps[name]:
            m = INSTR.match(line)
            if not m:
                continue
            shape, op, _ = m.groups()
            base = op.removesuffix("-start")
            if base in KINDS and not op.endswith("-done"):
                sizes = shape_bytes(shape)
                if op.endswith("-start") and base != "all-reduce":
                    # Async forms return (operands, results): keep the results.
                    sizes = sizes[len(sizes) // 2 :]
                if sizes:
                    # A combined collective returns a tuple: it moves all of its buffers.
                    size = sum(sizes)
                    if base == "reduce-scatter":
                        size *= _group_size(line)
                    yield base, size, times, line
            loop = _trip_count(line, comps) if op == "while" else trip
            inner = times * (loop if op == "while" else 1)
            callees = [c for callee in _CALLEES.findall(line)
                       for c in re.findall(r"%?([\w.\-]+)", callee)]  # fmt: skip
            each = None
            if op == "conditional":  # read only there: it scans the computation's lines
                each = _branch_times(line, comps[name], times, trip, len(callees))
            if each is None:
                each = [inner] * len(callees)
            for c, n in zip(callees, each, strict=True):
                if n:
                    yield from visit(c, n, depth + 1, loop)

    yield from visit(entry, 1)


def collectives(compiled: Any) -> dict[str, CollectiveStats]:
    """Per collective kind, executions and full-buffer bytes per call of a compiled program.

    Args:
      compiled: a ``jax.stages.Compiled`` or its ``as_text()``.

    Returns:
      ``{kind: CollectiveStats}`` for every kind in :data:`KINDS` (zero when absent).
    """
    stats = {k: CollectiveStats(k) for k in KINDS}
    for kind, size, times, _ in _walk(compiled):
        stats[kind].count += times
        stats[kind].bytes += size * times
    return stats


def _axes_spanned(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of any group differ (mesh order)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    spanned: set[str] = set()
    for g in groups:
        coords = np.array(np.unravel_index(np.asarray(g), sizes)).T
        for i, name in enumerate(names):
            if len(set(coords[:, i].tolist())) > 1:
                spanned.add(name)
    return tuple(n for n in names if n in spanned)


def collectives_by_axes(
    compiled: Any, mesh: Any
) -> dict[tuple[str, ...], dict[str, CollectiveStats]]:
    """:func:`collectives`, split by the mesh axes each collective's groups span.

    Device ids in the program are positions in the mesh's device order (SPMD partition ids),
    so a group's ids are read as mesh coordinates.

    Args:
      compiled: a ``jax.stages.Compiled`` (of a step jitted over ``mesh``) or its text.
      mesh: the ``jax.sharding.Mesh`` (or a mapping of axis name to size, in mesh order).

    Returns:
      ``{axes: {kind: CollectiveStats}}``, e.g. ``("data",)`` for collectives within each
      data group, ``("replica",)`` across replicas, ``("replica", "data")`` over every device,
      ``("pipe",)`` for a collective-permute between neighbouring pipeline stages. Only the
      axes present appear.
    """
    shape = dict(getattr(mesh, "shape", mesh))
    n = math.prod(shape.values())
    out: dict[tuple[str, ...], dict[str, CollectiveStats]] = {}
    for kind, size, times, line in _walk(compiled):
        # A permute's groups are its (source, target) pairs: the axes its transfers cross.
        pairs = source_target_pairs(line) if kind == "collective-permute" else []
        axes = _axes_spanned(pairs or replica_groups(line, n), shape)
        stats = out.setdefault(axes, {k: CollectiveStats(k) for k in KINDS})
        stats[kind].count += times
        stats[kind].bytes += size * times
    return out


def permute_sends(compiled: Any) -> dict[int, int]:
    """Bytes each device sends by ``collective-permute`` per call: every ``(source, target)``
    pair of a permute moves its buffer from the source (a device in no pair sends nothing),
    loops and schedule tables multiplied out. Keys are device (partition) ids; devices that
    send nothing are absent."""
    sent: dict[int, int] = {}
    for kind, size, times, line in _walk(compiled):
        if kind == "collective-permute":
            for src, _ in source_target_pairs(line):
                sent[src] = sent.get(src, 0) + size * times
    return sent


def collectives_by_dtype(compiled: Any) -> dict[str, dict[str, CollectiveStats]]:
    """:func:`collectives`, split by the element type each collective moves (``f32``, ``bf16``,
    ``s8`` for ZeRO++'s quantized bytes, ...): ``{kind: {dtype: CollectiveStats}}``, only the
    kinds and dtypes present. Read from :func:`program_text` to see 16-bit collectives on CPU.
    """
    out: dict[str, dict[str, CollectiveStats]] = {}
    for kind, size, times, line in _walk(compiled):
        m = INSTR.match(line)
        found = [d for d, _ in SHAPE.findall(m.group(1) if m else line) if d in DTYPE_BYTES]
        dtype = found[-1] if found else "?"  # async forms list operands, then results
        stats = out.setdefault(kind, {}).setdefault(dtype, CollectiveStats(kind))
        stats.count += times
        stats.bytes += size * times
    return out
