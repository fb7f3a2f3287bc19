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

``collectives_by_axes(compiled, mesh)`` splits the same counts by the mesh axes each
collective's device groups span (read from its ``replica_groups`` in any of XLA's three
spellings: explicit lists, iota ``[G,S]<=[dims]T(perm)``, and ``mesh[...] device_ids=...
{axes}``), which is how hybrid sharding's claim (only ``1/data`` of the gradient bytes cross the
``replica`` axis, i.e. the hosts) is read from the program.

``async_collectives(compiled)`` lists the collectives a scheduled program runs asynchronously
(``all-gather-start`` ... ``all-gather-done``, and ``async-start`` ... ``async-done`` around a
reduce-scatter or all-to-all, as XLA's GPU backend emits them) and the compute scheduled
between each start and its done: the communication that is hidden behind work. The CPU
backend runs every collective synchronously, so on CPU the list is empty.

``loop_collectives(compiled)`` says, for every collective inside a ``while`` body (a scan over
layers), whether it reads a matmul of the same iteration and whether a matmul of the same
iteration reads it: a gather fetched one layer ahead does neither, a gather at its own layer
feeds the layer's matmuls. This is how stage 3's ``overlap_comm`` is checked on CPU, where
nothing runs asynchronously.
"""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "AsyncCollective",
    "CollectiveStats",
    "KINDS",
    "LayoutCopy",
    "LoopCollective",
    "async_collectives",
    "collectives",
    "collectives_by_axes",
    "collectives_by_dtype",
    "replica_groups",
    "layout_copies",
    "loop_collectives",
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


def _walk(compiled: Any) -> Iterator[tuple[str, int, int, str]]:
    """Every collective executed by a compiled program: ``(kind, full-buffer bytes, times per
    call, instruction line)``, loops multiplied out."""
    comps, entry = _computations(_text(compiled))
    if entry is None:
        return

    def visit(name: str, times: int, depth: int = 0) -> Iterator[tuple[str, int, int, str]]:
        if depth > 64 or name not in comps:
            return
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op, _ = m.groups()
            base = op.removesuffix("-start")
            if base in KINDS and not op.endswith("-done"):
                sizes = _shape_bytes(shape)
                if op.endswith("-start") and base != "all-reduce":
                    # Async forms return (operands, results): keep the results.
                    sizes = sizes[len(sizes) // 2 :]
                if sizes:
                    # A combined collective returns a tuple: it moves all of its buffers.
                    size = sum(sizes)
                    if base == "reduce-scatter":
                        size *= _group_size(line)
                    yield base, size, times, line
            inner = times * (_trip_count(line, comps) if op == "while" else 1)
            for callee in _CALLEES.findall(line):
                for c in re.findall(r"%?([\w.\-]+)", callee):
                    yield from visit(c, inner, depth + 1)

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


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",") if d]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return ids


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of one collective instruction, as lists of device ids.

    Reads the three spellings XLA prints: ``replica_groups={{0,1},{2,3}}``, the iota form
    ``replica_groups=[2,2]<=[4]`` (optionally ``T(1,0)``), and the mesh form
    ``replica_groups=mesh['a'=2,'b'=2], device_ids=([4]) {'a'}`` (groups along the axes in
    braces). An empty or absent list is one group of all ``num_devices``.
    """
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}", line
    )
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids_text = (m.group(2) or "").strip()
        iota = re.fullmatch(r"\[([0-9,]*)\](?:T\(([0-9,]*)\))?", ids_text)
        if iota:
            ids = _iota(iota.group(1), iota.group(2)).reshape(-1)
        elif ids_text:
            ids = np.array([int(x) for x in re.findall(r"\d+", ids_text)])
        else:
            ids = np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        along = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        rest = [i for i in range(len(sizes)) if i not in along]
        size = math.prod(sizes[i] for i in along)
        return grid.transpose(rest + along).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?", line)
    if m:
        groups, size = int(m.group(1)), int(m.group(2))
        return _iota(m.group(3), m.group(4)).reshape(groups, size).tolist()
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m:
        found = [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))
        ]
        found = [g for g in found if g]
        if found:
            return found
    return [list(range(num_devices))]


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
      data group, ``("replica",)`` across replicas, ``("replica", "data")`` over every device.
      Only the axes present appear.
    """
    shape = dict(getattr(mesh, "shape", mesh))
    n = math.prod(shape.values())
    out: dict[tuple[str, ...], dict[str, CollectiveStats]] = {}
    for kind, size, times, line in _walk(compiled):
        axes = _axes_spanned(replica_groups(line, n), shape)
        stats = out.setdefault(axes, {k: CollectiveStats(k) for k in KINDS})
        stats[kind].count += times
        stats[kind].bytes += size * times
    return out


def collectives_by_dtype(compiled: Any) -> dict[str, dict[str, CollectiveStats]]:
    """:func:`collectives`, split by the element type each collective moves (``f32``, ``bf16``,
    ``s8`` for ZeRO++'s quantized bytes, ...): ``{kind: {dtype: CollectiveStats}}``, only the
    kinds and dtypes present. Read from :func:`program_text` to see 16-bit collectives on CPU.
    """
    out: dict[str, dict[str, CollectiveStats]] = {}
    for kind, size, times, line in _walk(compiled):
        m = _INSTR.match(line)
        found = [d for d, _ in _SHAPE.findall(m.group(1) if m else line) if d in _DTYPE_BYTES]
        dtype = found[-1] if found else "?"  # async forms list operands, then results
        stats = out.setdefault(kind, {}).setdefault(dtype, CollectiveStats(kind))
        stats.count += times
        stats.bytes += size * times
    return out


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


@dataclass(frozen=True)
class AsyncCollective:
    """A collective that runs asynchronously, and what is scheduled while it is in flight.

    Attributes:
      kind: the collective (one of :data:`KINDS`).
      start: the name of its start instruction (``all-gather-start``, ``async-start``, ...).
      done: the name of its done instruction.
      computation: the computation both are in (a ``while`` body for a scan's collectives).
      between: the opcodes scheduled after the start and before the done, bookkeeping
        (tuples, bitcasts, parameters, constants) left out; other collectives' starts and
        dones included.
      compute: how many of ``between`` are compute (not collective starts or dones): the work
        the collective's transfer can hide behind. 0 means it is asynchronous in form only.
    """

    kind: str
    start: str
    done: str
    computation: str
    between: tuple[str, ...]
    compute: int


_BOOKKEEPING = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier",
    "partition-id", "replica-id", "after-all", "add-dependency",
}  # fmt: skip


def _async_kind(op: str, line: str, comps: dict[str, list[str]]) -> str | None:
    """The collective an async start runs, or None when ``op`` starts none."""
    base = op.removesuffix("-start")
    if op.endswith("-start") and base in KINDS:
        return base
    if op == "async-start":
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        for inner in comps.get(callee.group(1), []) if callee else []:
            m = _INSTR.match(inner)
            if m and m.group(2) in KINDS:
                return m.group(2)
    return None


def async_collectives(compiled: Any) -> list[AsyncCollective]:
    """Every asynchronous collective of a scheduled program, with the work it overlaps.

    Reads the instruction order of each computation (a compiled module is scheduled: its text
    lists instructions in execution order) and pairs each start with the done that consumes
    it.

    Args:
      compiled: a ``jax.stages.Compiled`` or its ``as_text()``.

    Returns:
      One :class:`AsyncCollective` per start/done pair, per computation (each counted once, not
      per loop iteration); empty for a program whose collectives are synchronous (CPU).
    """
    comps, _ = _computations(_text(compiled))
    found: list[AsyncCollective] = []
    for comp, lines in comps.items():
        instrs = []
        for line in lines:
            n, m = _NAME.match(line), _INSTR.match(line)
            if n and m:
                instrs.append((n.group(1), m.group(2), _operands(m.group(3)), line))
        for i, (name, op, _, line) in enumerate(instrs):
            kind = _async_kind(op, line, comps)
            if kind is None:
                continue
            end = next(
                (
                    j
                    for j in range(i + 1, len(instrs))
                    if instrs[j][1].endswith("-done") and name in instrs[j][2]
                ),
                None,
            )
            if end is None:
                continue
            between = tuple(
                other for _, other, _, _ in instrs[i + 1 : end] if other not in _BOOKKEEPING
            )
            compute = sum(1 for other in between if not other.endswith(("-start", "-done")))
            found.append(AsyncCollective(kind, name, instrs[end][0], comp, between, compute))
    return found


@dataclass(frozen=True)
class LoopCollective:
    """A collective in a ``while`` body, and its data dependences within one iteration.

    Attributes:
      kind: the collective (one of :data:`KINDS`).
      name: its instruction name.
      body: the ``while`` body computation.
      after_compute: its operand depends on a matmul of the same iteration (it cannot start
        before that matmul is done).
      feeds_compute: a matmul of the same iteration depends on its result (that matmul waits
        for it). A collective with neither is free to run beside the iteration's compute.
    """

    kind: str
    name: str
    body: str
    after_compute: bool
    feeds_compute: bool


_MATMUL_OPS = ("dot", "convolution")


def loop_collectives(compiled: Any) -> list[LoopCollective]:
    """Every collective of every ``while`` body, with what it waits for and what waits for it.

    A matmul is a ``dot`` or ``convolution``, a fusion whose computation holds one, or a GEMM
    custom call (GPU). Dependences are followed within the body only, through any instruction.

    Args:
      compiled: a ``jax.stages.Compiled`` or its ``as_text()``.

    Returns:
      One :class:`LoopCollective` per collective instruction in a loop body (its ``-done`` half
      not counted separately).
    """
    comps, _ = _computations(_text(compiled))
    bodies = []
    for lines in comps.values():
        for line in lines:
            m = _INSTR.match(line)
            body = re.search(r"\bbody=%?([\w.\-]+)", line)
            if m and m.group(2) == "while" and body and body.group(1) not in bodies:
                bodies.append(body.group(1))

    def holds_matmul(name: str, depth: int = 0) -> bool:
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            if m.group(2) in _MATMUL_OPS:
                return True
            callee = re.search(r"calls=%?([\w.\-]+)", line)
            if m.group(2) == "fusion" and callee and depth < 8:
                if holds_matmul(callee.group(1), depth + 1):
                    return True
        return False

    found: list[LoopCollective] = []
    for body in bodies:
        found += _body_collectives(body, comps.get(body, []), holds_matmul)
    return found


def _body_collectives(body: str, lines: list[str], holds_matmul: Any) -> list[LoopCollective]:
    """:func:`loop_collectives` of one ``while`` body."""
    ops: dict[str, tuple[str, list[str], str]] = {}
    users: dict[str, list[str]] = {}
    for line in lines:
        n, m = _NAME.match(line), _INSTR.match(line)
        if n and m:
            operands = _operands(m.group(3))
            ops[n.group(1)] = (m.group(2), operands, line)
            for o in operands:
                users.setdefault(o, []).append(n.group(1))

    def matmul(name: str) -> bool:
        op, _, line = ops[name]
        if op in _MATMUL_OPS:
            return True
        if op == "custom-call":
            return bool(re.search(r"gemm|matmul", line, re.I))
        callee = re.search(r"calls=%?([\w.\-]+)", line)
        return op == "fusion" and callee is not None and holds_matmul(callee.group(1))

    def reaches(start: str, edges: dict[str, list[str]]) -> bool:
        seen, todo = set(), list(edges.get(start, []))
        while todo:
            x = todo.pop()
            if x in seen or x not in ops:
                continue
            seen.add(x)
            if matmul(x):
                return True
            todo.extend(edges.get(x, []))
        return False

    operands = {name: ops_[1] for name, ops_ in ops.items()}
    found = []
    for name, (op, _, _) in ops.items():
        base = op.removesuffix("-start")
        if base in KINDS and not op.endswith("-done"):
            found.append(
                LoopCollective(base, name, body, reaches(name, operands), reaches(name, users))
            )
    return found
