"""The pipeline schedules as tables, computed in Python before anything is traced
(:func:`make_schedule`): which stage runs which micro-batch's forward, backward or weight pass in
each time slot, what each slot sends to whom, and where each buffered value waits. The pipeline's
engine (:mod:`jzero.parallel.pipeline.schedule`, whose decisions say why the tables are as they
are) runs a table inside ``jit``; the cost model (:mod:`jzero.costs`) and the estimate read its
bubble. NumPy only; the package's ``__init__`` does not load it (the config and ``jzero
estimate`` without a pipeline run without NumPy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jzero.choices.pipeline import SCHEDULES

__all__ = [
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "WEIGHT",
    "Buffer",
    "Schedule",
    "bubble_fraction",
    "make_schedule",
    "pair_table",
]


IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class Buffer:
    """Where one of a stage's buffers keeps each value, per slot: ``count`` places, and per
    slot and stage the place written at the slot's end and the one read in it (``count``,
    the buffer's sink, where there is none). Places are given out as values come and go
    (the least free one), so ``count`` is the most values alive at once."""

    count: int
    write: np.ndarray
    read: np.ndarray


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as tables, one row per time slot, one column per stage.

    Attributes:
      kind: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``.
      stages: ``P``; micro_batches: ``M``; virtual: ``V``, the chunks of layers each stage
        holds (1 but under ``interleaved_1f1b``; chunk ``v`` of stage ``s`` is the model's
        ``v P + s``-th of ``P V``).
      op: ``[T, P]``: :data:`IDLE`, :data:`FORWARD`, :data:`BACKWARD` (under zero-bubble the
        input gradient only) or :data:`WEIGHT` (zero-bubble's weight gradient).
      micro: ``[T, P]``: the micro-batch that pass runs (0 when idle).
      recv_forward: ``[T, P]``: the pass whose activations arrive from the previous stage at
        the start of the slot, as its chunk times ``M`` plus its micro-batch, or -1.
      recv_backward: ``[T, P]``: likewise the gradient from the next stage, or -1.
      slots: ``K``, the most passes in flight on a stage (forward done, its residuals not
        yet released), the places of its residuals' buffer.
      patterns: the distinct sets of ``(source, target)`` stages that send in one slot (the
        empty set first).
      pattern: ``[T, 2]``: per slot, the index in :attr:`patterns` of the stages that send
        what the slot's passes produced (delivered at the start of the next slot): one permute
        (column 0; column 1 is 0, no permute), or two where one stage would receive both an
        activation and a gradient (column 0 the activations, column 1 the gradients).
    """

    kind: str
    stages: int
    micro_batches: int
    op: np.ndarray
    micro: np.ndarray
    recv_forward: np.ndarray
    recv_backward: np.ndarray
    slots: int
    patterns: tuple[tuple[tuple[int, int], ...], ...] = ((),)
    pattern: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 2), np.int32))
    virtual: int = 1
    chunk: np.ndarray | None = None  # [T, P]: the chunk a pass runs (None: all 0)
    buffers: dict[str, Buffer] = dataclasses.field(default_factory=dict)
    """The places of each buffer (``"res"``: the residuals, forward to backward or weight
    pass; ``"kept"``: input to weight pass; ``"fwd_in"``, ``"bwd_in"``: the messages,
    arrival to use)."""

    @property
    def chunks(self) -> np.ndarray:
        """``[T, P]``: the chunk of layers each pass runs (0 but under interleaving)."""
        return np.zeros_like(self.op) if self.chunk is None else self.chunk

    @property
    def num_slots(self) -> int:
        """``T``, the time slots of one step."""
        return int(self.op.shape[0])

    @property
    def transfers(self) -> np.ndarray:
        """``[P]``: the messages each stage sends in one step (activations or gradients)."""
        sent = np.zeros(self.stages, np.int64)
        for index in self.pattern.reshape(-1):
            for src, _ in self.patterns[int(index)]:
                sent[src] += 1
        return sent

    @property
    def bubble(self) -> float:
        """The fraction of a stage's slots it is idle, read from the table."""
        return float((self.op == IDLE).sum() / self.op.size)

    @property
    def pass_times(self) -> np.ndarray:
        """``[T, P]``: each pass's time in forward passes of a whole stage: a forward pass 1, a
        backward pass 2 (its input and weight gradients), or 1 each where the backward is
        split into the two (zero-bubble)."""
        split = bool((self.op == WEIGHT).any())
        times = np.array([0.0, 1.0, 1.0 if split else 2.0, 1.0])
        return times[self.op] / self.virtual  # a chunk holds 1/V of the stage's layers

    @property
    def step_time(self) -> float:
        """One step's time in forward passes of a whole stage, the slots run in lockstep (as
        the compiled step runs them: each slot's permute waits for its senders), each slot as
        long as its longest pass."""
        return float(self.pass_times.max(axis=1).sum())

    @property
    def time_bubble(self) -> float:
        """The fraction of :attr:`step_time` a stage is idle (averaged over the stages): the
        bubble weighted by what each slot costs. 1F1B's is above its slot bubble, since a
        steady-state slot holds one stage's forward beside another's longer backward."""
        return float(1 - self.pass_times.sum() / (self.step_time * self.stages))


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle fraction, ``(P - 1) / (M + P - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def _orders(kind: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per stage, its passes ``(pass, chunk, micro-batch)`` in the order it runs them."""
    orders = []
    for s in range(p):
        if kind == "gpipe":
            orders.append([(op, 0, i) for op in (FORWARD, BACKWARD) for i in range(m)])
            continue
        # 1F1B, and Megatron's interleaved 1F1B: the forward passes in groups of P
        # micro-batches, chunk by chunk (the backward passes likewise, the last chunk first);
        # a warm-up of forward passes, then one forward and one backward in turn.
        ahead, back = [], []
        for k in range(m * v):
            group, r = divmod(k, p * v)
            i = group * p + r % p
            ahead.append((FORWARD, r // p, i))
            back.append((BACKWARD, v - 1 - r // p, i))
        warm = min(p - 1 - s if v == 1 else 2 * (p - 1 - s) + (v - 1) * p, m * v)
        seq = ahead[:warm]
        for k in range(m * v - warm):
            seq += [ahead[warm + k], back[k]]
        seq += back[m * v - warm :]
        orders.append(seq)
    return orders


def _ready(done: dict[tuple[int, int, int], int], n: int, j: int, op: int, i: int, t: int) -> bool:
    """Whether (virtual) stage ``j`` of ``n`` may run pass ``op`` of micro-batch ``i`` in slot
    ``t``: what it needs ran in an earlier slot (a forward pass needs the previous stage's, a
    backward pass this stage's forward and the next stage's backward, a weight pass this
    stage's backward)."""
    if op == FORWARD:
        return j == 0 or done.get((j - 1, FORWARD, i), t) < t
    if op == WEIGHT:
        return done.get((j, BACKWARD, i), t) < t
    return done.get((j, FORWARD, i), t) < t and (
        j == n - 1 or done.get((j + 1, BACKWARD, i), t) < t
    )


def _ordered_rows(kind: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """GPipe's and the 1F1B schedules' slots: each stage runs its passes in its fixed order,
    each in the first slot its input is ready."""
    orders = _orders(kind, p, m, v)
    done: dict[tuple[int, int, int], int] = {}  # (virtual stage, pass, micro) -> its slot
    nxt = [0] * p
    rows: list[list[tuple[int, int, int]]] = []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        row = []
        for s in range(p):
            if nxt[s] >= len(orders[s]):
                row.append((IDLE, 0, 0))
                continue
            op, c, i = orders[s][nxt[s]]
            row.append((op, c, i) if _ready(done, p * v, c * p + s, op, i, t) else (IDLE, 0, 0))
        for s, (op, c, i) in enumerate(row):
            if op != IDLE:
                done[(c * p + s, op, i)] = t
                nxt[s] += 1
        rows.append(row)
        if len(rows) > 4 * (m * v + p) + 8:  # pragma: no cover - a schedule bug
            raise RuntimeError(f"the {kind} schedule for P={p}, M={m}, V={v} does not finish")
    return rows


def _zero_bubble_rows(p: int, m: int) -> list[list[tuple[int, int, int]]]:
    """ZB-H1's slots: each stage runs, in each slot, the first of these that is ready: the
    oldest micro-batch's input-gradient pass (the previous stage waits for it), the next
    forward pass while fewer than ``P`` micro-batches are in flight on the stage (forward
    done, weight pass not: 1F1B's most), the oldest weight-gradient pass (nobody waits for it,
    so it fills what would be the bubble)."""
    done: dict[tuple[int, int, int], int] = {}
    ran: list[set[tuple[int, int]]] = [set() for _ in range(p)]  # per stage, (pass, micro)
    rows: list[list[tuple[int, int, int]]] = []
    nxt_f = [0] * p
    while len(done) < 3 * p * m:
        t = len(rows)
        row = []
        for s in range(p):
            in_flight = nxt_f[s] - sum(op == WEIGHT for op, _ in ran[s])
            choice = (IDLE, 0)
            pending_b = [i for i in range(m) if (BACKWARD, i) not in ran[s]
                         and _ready(done, p, s, BACKWARD, i, t)]  # fmt: skip
            pending_w = [i for i in range(m) if (WEIGHT, i) not in ran[s]
                         and _ready(done, p, s, WEIGHT, i, t)]  # fmt: skip
            if pending_b:
                choice = (BACKWARD, pending_b[0])
            elif nxt_f[s] < m and in_flight < p and _ready(done, p, s, FORWARD, nxt_f[s], t):
                choice = (FORWARD, nxt_f[s])
            elif pending_w:
                choice = (WEIGHT, pending_w[0])
            row.append(choice)
        for s, (op, i) in enumerate(row):
            if op != IDLE:
                done[(s, op, i)] = t
                ran[s].add((op, i))
                nxt_f[s] += op == FORWARD
        rows.append([(op, 0, i) for op, i in row])
        if len(rows) > 6 * (m + p) + 8:  # pragma: no cover - a schedule bug, never user input
            raise RuntimeError(f"the zero_bubble schedule for P={p}, M={m} does not finish")
    return rows


def make_schedule(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Simulates ``kind`` on ``stages`` stages and ``micro_batches`` micro-batches, each stage
    holding ``virtual_stages`` chunks of layers (``interleaved_1f1b`` only).

    Raises:
      ValueError: for an unknown kind, fewer micro-batches than stages, or chunks that the
        schedule does not take (interleaving also needs the micro-batches in groups of
        ``stages``).
    """
    if kind not in SCHEDULES:
        raise ValueError(
            f"pipeline.schedule: {kind!r} is not a schedule jzero has; use one of "
            f"{', '.join(SCHEDULES)}."
        )
    p, m = int(stages), int(micro_batches)
    if m < p:
        raise ValueError(
            f"pipeline.stages: {p} needs at least {p} micro-batches to fill the pipeline, but "
            f"gradient_accumulation_steps is {m}; set gradient_accumulation_steps to {p} or more "
            f"(a multiple of {p}, e.g. {2 * p}, keeps the bubble smaller)."
        )
    v = int(virtual_stages)
    if v != 1 and kind != "interleaved_1f1b":
        raise ValueError(
            f"pipeline.virtual_stages: {v} chunks of layers per stage need pipeline.schedule: "
            f"interleaved_1f1b, but the schedule is {kind}; set the schedule, or "
            "virtual_stages: 1."
        )
    if kind == "interleaved_1f1b" and (v < 2 or m % p):
        raise ValueError(
            f"pipeline.schedule: interleaved_1f1b runs the micro-batches in groups of "
            f"pipeline.stages ({p}) over at least 2 chunks of layers per stage, but "
            f"gradient_accumulation_steps is {m} and pipeline.virtual_stages {v}; set "
            f"gradient_accumulation_steps to a multiple of {p} and virtual_stages to 2 or more."
        )
    if kind == "zero_bubble":
        rows = _zero_bubble_rows(p, m)
    else:
        rows = _ordered_rows(kind, p, m, v)
    op, chunk, micro = (np.array([[r[n] for r in row] for row in rows], np.int32) for n in range(3))
    key = chunk * m + micro  # a pass's buffers are named by its chunk and micro-batch
    n = p * v
    rf = -np.ones_like(op)
    rb = -np.ones_like(op)
    ahead: list[tuple[tuple[int, int], ...]] = []
    back: list[tuple[tuple[int, int], ...]] = []
    for t in range(len(rows)):
        fwd, bwd = [], []
        for s in range(p):
            j = int(chunk[t, s]) * p + s  # the virtual stage
            if op[t, s] == FORWARD and j < n - 1:  # to virtual stage j + 1
                fwd.append((s, (s + 1) % p))
                if t + 1 < len(rows):
                    rf[t + 1, (s + 1) % p] = ((j + 1) // p) * m + micro[t, s]
            if op[t, s] == BACKWARD and j > 0:  # to virtual stage j - 1
                bwd.append((s, (s - 1) % p))
                if t + 1 < len(rows):
                    rb[t + 1, (s - 1) % p] = ((j - 1) // p) * m + micro[t, s]
        ahead.append(tuple(fwd))
        back.append(tuple(bwd))
    buffers = _allocate(op, key, rf, rb)
    pattern, patterns = pair_table(
        [
            (tuple(sorted(a + b)), ()) if not {d for _, d in a} & {d for _, d in b} else (a, b)
            for a, b in zip(ahead, back, strict=True)
        ]
    )
    return Schedule(
        kind, p, m, op, micro, rf, rb, buffers["res"].count, patterns, pattern, v,
        chunk if v > 1 else None, buffers,
    )  # fmt: skip


def pair_table(
    per_slot: Sequence[Sequence[tuple[tuple[int, int], ...]]],
) -> tuple[np.ndarray, tuple]:
    """``(pattern [T, n], patterns)``: the distinct pair sets (the empty one first) and per
    slot the index of each of its ``n`` permutes' sets."""
    patterns: list[tuple[tuple[int, int], ...]] = [()]
    pattern = np.zeros((len(per_slot), len(per_slot[0]) if per_slot else 1), np.int32)
    for t, permutes in enumerate(per_slot):
        for j, pairs in enumerate(permutes):
            if len({dst for _, dst in pairs}) < len(pairs):  # pragma: no cover - a schedule bug
                raise RuntimeError(f"a schedule sends two messages to one stage in slot {t}")
            if pairs not in patterns:
                patterns.append(pairs)
            pattern[t, j] = patterns.index(pairs)
    return pattern, tuple(patterns)


def _allocate(op: np.ndarray, key: np.ndarray, rf: np.ndarray, rb: np.ndarray) -> dict[str, Buffer]:
    """Each buffer's places (:class:`Buffer`). A value is written at the end of one slot and
    read in later ones (reads come before the slot's writes), so a place is free again for a
    value written in the slot of its last read. ``key`` names a pass's values (its chunk times
    ``M`` plus its micro-batch)."""
    t_max, p = op.shape
    split = bool((op == WEIGHT).any())  # residuals live until the weight pass, if there is one
    lives: dict[str, list[list[tuple[int, list[int]]]]] = {
        name: [[] for _ in range(p)] for name in ("res", "kept", "fwd_in", "bwd_in")
    }  # per buffer and stage: (written in, [read in, ...])
    for s in range(p):
        when = {(int(op[t, s]), int(key[t, s])): t for t in range(t_max) if op[t, s] != IDLE}
        for (o, k), t in when.items():
            if o == FORWARD:
                uses = [when[(BACKWARD, k)]] + ([when[(WEIGHT, k)]] if split else [])
                lives["res"][s].append((t, uses))
            elif o == WEIGHT:
                lives["kept"][s].append((when[(BACKWARD, k)], [t]))
        for name, table, kind in (("fwd_in", rf, FORWARD), ("bwd_in", rb, BACKWARD)):
            for t in range(1, t_max):
                if table[t, s] >= 0:  # sent in slot t - 1, written at its end
                    lives[name][s].append((t - 1, [when[(kind, int(table[t, s]))]]))
    out = {}
    for name, per_stage in lives.items():
        count = max([_places(lv)[0] for lv in per_stage] + [0])
        write = np.full((t_max, p), count, np.int32)
        read = np.full((t_max, p), count, np.int32)
        for s, lv in enumerate(per_stage):
            for (start, uses), place in zip(lv, _places(lv)[1], strict=True):
                write[start, s] = place
                for u in uses:
                    read[u, s] = place
        out[name] = Buffer(count, write, read)
    return out


def _places(lives: Sequence[tuple[int, list[int]]]) -> tuple[int, list[int]]:
    """The least free place for each value in the order they are written: ``(count, place
    of each)``; a place is free from the slot of its value's last read."""
    free_from: list[int] = []  # per place, the slot from which it is free
    places = [0] * len(lives)
    for n in sorted(range(len(lives)), key=lambda n: lives[n][0]):
        start, uses = lives[n]
        place = next((c for c, f in enumerate(free_from) if f <= start), len(free_from))
        if place == len(free_from):
            free_from.append(0)
        free_from[place] = max(uses)
        places[n] = place
    return len(free_from), places
