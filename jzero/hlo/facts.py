"""Collective communication read from a compiled program: how jzero proves its claims.

Three parts, every name importable from :mod:`jzero.hlo`:

* the program's text and its parsing (:mod:`jzero.hlo.parse`: :func:`program_text`,
  :func:`replica_groups`);
* the bytes of its collectives (:mod:`jzero.hlo.collective_bytes`: :func:`collectives` per kind,
  with
  executions multiplied by loop trip counts and the bytes of the full buffer each moves,
  :func:`collectives_by_axes` per mesh axes spanned, :func:`collectives_by_dtype`);
* here, how they are scheduled and laid out:

``layout_copies(compiled)`` lists the copies and transposes next to a collective: the
re-layouts XLA adds when a collective runs along a minor dimension of its buffer.

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

``unordered_collectives(compiled)`` lists the collectives of the entry computation that
neither wait for nor feed a ``while`` loop holding collectives: XLA may run them at any time
during that loop. XLA:CPU then runs them in different orders on different devices, which can
leave devices waiting in different collectives until its rendezvous timeout aborts the step;
jzero's steps keep this list empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from jzero.hlo.parse import (
    INSTR,
    INSTR_NAME,
    KINDS,
    compiled_text,
    computations,
    operand_names,
    shape_bytes,
)

__all__ = [
    "AsyncCollective",
    "LayoutCopy",
    "LoopCollective",
    "async_collectives",
    "layout_copies",
    "loop_collectives",
    "unordered_collectives",
]


@dataclass(frozen=True)
class LayoutCopy:
    """A copy or transpose that feeds a collective or reads its result: a re-layout."""

    name: str
    bytes: int
    collective: str
    line: str


_LAYOUT_OPS = ("copy", "transpose")


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
    comps, _ = computations(compiled_text(compiled))
    kinds = {f"{k}{s}" for k in KINDS for s in ("", "-start", "-done")}

    def root_op(name: str) -> str | None:
        lines = comps.get(name, [])
        if len(lines) > 3:  # more than parameter(s) and the root: real computation
            return None
        for line in lines:
            m = INSTR.match(line)
            if line.lstrip().startswith("ROOT") and m:
                return m.group(2)
        return None

    found: list[LayoutCopy] = []
    for lines in comps.values():
        info: dict[str, tuple[str, str, list[str], str]] = {}
        for line in lines:
            n, m = INSTR_NAME.match(line), INSTR.match(line)
            if not (n and m):
                continue
            shape, op, rest = m.groups()
            if op == "fusion":
                callee = re.search(r"calls=%?([\w.\-]+)", line)
                inner = root_op(callee.group(1)) if callee else None
                op = inner if inner in _LAYOUT_OPS else op
            info[n.group(1)] = (op, shape, operand_names(rest), line)
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
                size = sum(shape_bytes(shape))
                kind = touches[0].removesuffix("-start").removesuffix("-done")
                found.append(LayoutCopy(name, size, kind, line.strip()[:200]))
    return found


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
            m = INSTR.match(inner)
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
    comps, _ = computations(compiled_text(compiled))
    found: list[AsyncCollective] = []
    for comp, lines in comps.items():
        instrs = []
        for line in lines:
            n, m = INSTR_NAME.match(line), INSTR.match(line)
            if n and m:
                instrs.append((n.group(1), m.group(2), operand_names(m.group(3)), line))
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
    comps, _ = computations(compiled_text(compiled))
    bodies = []
    for lines in comps.values():
        for line in lines:
            m = INSTR.match(line)
            body = re.search(r"\bbody=%?([\w.\-]+)", line)
            if m and m.group(2) == "while" and body and body.group(1) not in bodies:
                bodies.append(body.group(1))

    def holds_matmul(name: str, depth: int = 0) -> bool:
        for line in comps.get(name, []):
            m = INSTR.match(line)
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
        n, m = INSTR_NAME.match(line), INSTR.match(line)
        if n and m:
            operands = operand_names(m.group(3))
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


@dataclass(frozen=True)
class UnorderedCollective:
    """A collective of the entry computation with no dependence either way on ``loop``."""

    kind: str
    name: str
    loop: str


def unordered_collectives(compiled: Any) -> list[UnorderedCollective]:
    """Every collective of the entry computation that neither waits for nor feeds a ``while``
    of the entry whose body (or a computation it calls) holds a collective.

    Dependences are data operands and control predecessors, followed through the entry
    computation.

    Args:
      compiled: a ``jax.stages.Compiled`` or its ``as_text()``.

    Returns:
      One :class:`UnorderedCollective` per (collective, loop) pair without an order.
    """
    comps, entry = computations(compiled_text(compiled))
    if entry is None:
        return []

    def holds_collective(name: str, depth: int = 0) -> bool:
        for line in comps.get(name, []):
            m = INSTR.match(line)
            if m and m.group(2).removesuffix("-start") in KINDS:
                return True
            for callee in re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line):
                if depth < 8 and holds_collective(callee, depth + 1):
                    return True
        return False

    ops: dict[str, str] = {}
    preds: dict[str, list[str]] = {}
    loops: list[str] = []
    for line in comps.get(entry, []):
        n, m = INSTR_NAME.match(line), INSTR.match(line)
        if not (n and m):
            continue
        name, op = n.group(1), m.group(2)
        ops[name] = op
        control = re.search(r"control-predecessors=\{([^}]*)\}", line)
        preds[name] = operand_names(m.group(3)) + (
            re.findall(r"%([\w.\-]+)", control.group(1)) if control else []
        )
        body = re.search(r"\bbody=%?([\w.\-]+)", line)
        if op == "while" and body and holds_collective(body.group(1)):
            loops.append(name)

    ancestors: dict[str, set[str]] = {}
    for name in ops:  # the text lists every instruction after its operands
        seen: set[str] = set()
        for p in preds[name]:
            if p in ops:
                seen.add(p)
                seen |= ancestors.get(p, set())
        ancestors[name] = seen
    found = []
    for name, op in ops.items():
        base = op.removesuffix("-start")
        if base not in KINDS or op.endswith("-done"):
            continue
        for loop in loops:
            if loop not in ancestors[name] and name not in ancestors[loop]:
                found.append(UnorderedCollective(base, name, loop))
    return found
