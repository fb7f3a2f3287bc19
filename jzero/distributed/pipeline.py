"""Pipeline parallelism: a model's stacked layers split into contiguous stages over the
``pipe`` mesh axis, micro-batches moved between neighbouring stages by ``ppermute``.

This module holds what is independent of ZeRO and of the model: the schedules (which stage
runs which micro-batch's forward or backward pass in each time slot) and the engine that runs a
schedule inside ``shard_map`` with ``pipe`` manual, given one *stage unit* (a function that
runs one micro-batch through the stage's own layers, see :mod:`jzero.replay.layer_split`).

Decisions:

* **One engine, schedules as tables.** A schedule is computed in Python before tracing, by
  simulating unit-time forward (F) and backward (B) passes: each stage runs its next pass in
  a slot once its input arrived in an earlier slot. The result is a table of ``(pass,
  micro-batch)`` per slot and stage, which the compiled step reads with the stage's index
  (``axis_index('pipe')``): one ``lax.scan`` over the slots, one ``lax.switch`` on the pass.
  GPipe runs every forward pass, then every backward pass; 1F1B warms up with
  ``P - 1 - s`` forwards on stage ``s`` and then alternates one forward and one backward.
  Both take ``2 (M + P - 1)`` slots for ``M`` micro-batches on ``P`` stages, so the idle
  fraction of a stage is ``(P - 1) / (M + P - 1)`` for both (:func:`bubble_fraction`).
* **What the backward pass needs is kept per micro-batch, in ``K`` slots.** A forward pass
  is ``jax.vjp`` of the stage unit; what the pullback needs (its residuals: saved activations,
  as the stage's activation checkpointing policy decides) is written into buffer slot
  ``micro-batch % K`` and read back by that micro-batch's backward pass. A residual that is
  one of the stage's parameters is not buffered (the pullback reads the parameter itself).
  ``K`` is the most micro-batches in flight on a stage (forward done, backward not):
  ``M`` under GPipe, ``P`` under 1F1B. That is the whole difference in activation memory
  between the two schedules, and the compiled program's temporaries show it.
* **Only the transfers the schedule needs.** A forward pass's activations go to the next
  stage, a backward pass's input gradient to the previous one, and nothing else moves: each
  micro-batch crosses each stage boundary once forward and once back, ``2 M (P - 1)``
  messages a step. A stage runs one pass a slot, so it sends at most one message, and no two
  stages send to the same one in a slot (checked when the table is built), so one
  ``ppermute`` a slot carries them all, with exactly that slot's ``(source, target)`` pairs.
  The pairs differ from slot to slot while a permute's pairs are fixed in the program, so the
  distinct pair sets (``3P`` or so) are the branches of one ``lax.switch`` indexed by the slot
  number: every device takes the same branch, so the collective matches, and a slot where no
  stage sends runs none. A received message waits in a buffer of ``K + 1`` slots (the last
  one a sink for a slot that received nothing) until its pass runs.
* **The loss runs on the last stage only, the embedding on the first only** (the unit's two
  ``lax.cond``, :func:`jzero.replay.layer_split.stage_unit`), the loss's gradient seeded on
  the last. What the layers read besides their carry (positions, masks) runs on every stage.
  At ZeRO stage 3 the head's and the embedding's gathers run inside those conditionals, so
  only the stage that uses a leaf gathers it.
* **Gradients reduced per micro-batch at stages 2-3**: ``run``'s ``reduce`` is applied to
  each backward pass's gradients before they are added up (stage 2's reduce-scatter over the
  stage's data group), so the sums hold a shard, as stage 2 does without a pipeline.
* **Evaluation is pipelined too** (:func:`run_forward`): forward passes only, stage ``s``
  running micro-batch ``t - s`` in slot ``t``, sending only where it ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jzero.choices.pipeline import SCHEDULES
from jzero.distributed.mesh import PIPE_AXIS

__all__ = [
    "PIPE_AXIS",
    "SCHEDULES",
    "Schedule",
    "bubble_fraction",
    "make_schedule",
    "run",
    "run_forward",
]


IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as tables, one row per time slot, one column per stage.

    Attributes:
      kind: ``"gpipe"`` or ``"1f1b"``.
      stages: ``P``; micro_batches: ``M``.
      op: ``[T, P]``: :data:`IDLE`, :data:`FORWARD` or :data:`BACKWARD`.
      micro: ``[T, P]``: the micro-batch that pass runs (0 when idle).
      recv_forward: ``[T, P]``: the micro-batch whose activations arrive from the previous
        stage at the start of the slot, or -1.
      recv_backward: ``[T, P]``: likewise the gradient from the next stage, or -1.
      slots: ``K``, the buffer slots per stage (the most micro-batches in flight).
      patterns: the distinct sets of ``(source, target)`` stages that send in one slot (the
        empty set first).
      pattern: ``[T]``: per slot, the index in :attr:`patterns` of the stages that send what
        the slot's passes produced (delivered at the start of the next slot).
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
    pattern: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def num_slots(self) -> int:
        """``T``, the time slots of one step."""
        return int(self.op.shape[0])

    @property
    def transfers(self) -> np.ndarray:
        """``[P]``: the messages each stage sends in one step (activations or gradients)."""
        sent = np.zeros(self.stages, np.int64)
        for t in range(self.num_slots):
            for src, _ in self.patterns[int(self.pattern[t])]:
                sent[src] += 1
        return sent

    @property
    def bubble(self) -> float:
        """The fraction of a stage's slots it is idle, read from the table."""
        return float((self.op == IDLE).sum() / self.op.size)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle fraction, ``(P - 1) / (M + P - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def _orders(kind: str, p: int, m: int) -> list[list[tuple[int, int]]]:
    """Per stage, its passes in the order it runs them."""
    orders = []
    for s in range(p):
        if kind == "gpipe":
            orders.append([(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)])
            continue
        warm = min(p - 1 - s, m)
        seq = [(FORWARD, i) for i in range(warm)]
        for i in range(m - warm):
            seq += [(FORWARD, warm + i), (BACKWARD, i)]
        seq += [(BACKWARD, i) for i in range(m - warm, m)]
        orders.append(seq)
    return orders


def make_schedule(kind: str, stages: int, micro_batches: int) -> Schedule:
    """Simulates ``kind`` on ``stages`` stages and ``micro_batches`` micro-batches.

    Raises:
      ValueError: for an unknown kind, or fewer micro-batches than stages.
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
    orders = _orders(kind, p, m)
    done: dict[tuple[int, int, int], int] = {}  # (stage, pass, micro) -> slot it ran in
    nxt = [0] * p
    rows: list[list[tuple[int, int]]] = []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        row = []
        for s in range(p):
            if nxt[s] >= len(orders[s]):
                row.append((IDLE, 0))
                continue
            op, i = orders[s][nxt[s]]
            if op == FORWARD:
                ready = s == 0 or done.get((s - 1, FORWARD, i), t) < t
            else:
                ready = done.get((s, FORWARD, i), t) < t and (
                    s == p - 1 or done.get((s + 1, BACKWARD, i), t) < t
                )
            row.append((op, i) if ready else (IDLE, 0))
        for s, (op, i) in enumerate(row):
            if op != IDLE:
                done[(s, op, i)] = t
                nxt[s] += 1
        rows.append(row)
        if len(rows) > 4 * (m + p) + 8:  # pragma: no cover - a schedule bug, never user input
            raise RuntimeError(f"the {kind} schedule for P={p}, M={m} does not finish")
    op = np.array([[r[0] for r in row] for row in rows], np.int32)
    micro = np.array([[r[1] for r in row] for row in rows], np.int32)
    rf = -np.ones_like(op)
    rb = -np.ones_like(op)
    for t in range(len(rows) - 1):
        for s in range(p):
            if op[t, s] == FORWARD and s < p - 1:
                rf[t + 1, s + 1] = micro[t, s]
            if op[t, s] == BACKWARD and s > 0:
                rb[t + 1, s - 1] = micro[t, s]
    slots = _slots_needed(op, micro, rf, rb, m)
    pattern, patterns = _pair_table(
        [
            tuple(
                (s, s + 1 if op[t, s] == FORWARD else s - 1)
                for s in range(p)
                if (op[t, s] == FORWARD and s < p - 1) or (op[t, s] == BACKWARD and s > 0)
            )
            for t in range(len(rows))
        ]
    )
    return Schedule(kind, p, m, op, micro, rf, rb, slots, patterns, pattern)


def _pair_table(per_slot: Sequence[tuple[tuple[int, int], ...]]) -> tuple[np.ndarray, tuple]:
    """``(pattern [T], patterns)``: the distinct pair sets (the empty one first) and per slot
    the index of its own."""
    patterns: list[tuple[tuple[int, int], ...]] = [()]
    pattern = np.zeros(len(per_slot), np.int32)
    for t, pairs in enumerate(per_slot):
        if len({dst for _, dst in pairs}) < len(pairs):  # pragma: no cover - a schedule bug
            raise RuntimeError(f"a schedule sends two messages to one stage in slot {t}")
        if pairs not in patterns:
            patterns.append(pairs)
        pattern[t] = patterns.index(pairs)
    return pattern, tuple(patterns)


def _deliver(axis: str, pairs: tuple[tuple[int, int], ...]) -> Callable[[list[Any]], list[Any]]:
    """One slot's transfer: a permute with exactly ``pairs``; zeros when nobody sends."""
    if not pairs:
        return lambda msg: [jnp.zeros_like(x) for x in msg]
    return lambda msg: [jax.lax.ppermute(x, axis, list(pairs)) for x in msg]


def _slots_needed(op: np.ndarray, micro: np.ndarray, rf: np.ndarray, rb: np.ndarray, m: int) -> int:
    """The least ``K`` for which ``micro % K`` never overwrites a buffered value still needed:
    for the residuals (forward to backward) and the two message buffers (arrival to use)."""
    t_max, p = op.shape
    lives: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]  # (micro, start, end)
    for s in range(p):
        when = {(int(op[t, s]), int(micro[t, s])): t for t in range(t_max) if op[t, s] != IDLE}
        for i in range(m):
            lives[s].append((i, when[(FORWARD, i)], when[(BACKWARD, i)]))
    for k in range(1, m + 1):
        if all(_fits(lv, k) for lv in lives) and all(
            _fits(_arrivals(table, op, micro, s, kind), k)
            for s in range(p)
            for table, kind in ((rf, FORWARD), (rb, BACKWARD))
        ):
            return k
    return m


def _arrivals(
    table: np.ndarray, op: np.ndarray, micro: np.ndarray, s: int, kind: int
) -> list[tuple[int, int, int]]:
    out = []
    for t in range(table.shape[0]):
        i = int(table[t, s])
        if i >= 0:
            use = next(u for u in range(t, op.shape[0]) if (op[u, s], micro[u, s]) == (kind, i))
            out.append((i, t, use))
    return out


def _fits(lives: Sequence[tuple[int, int, int]], k: int) -> bool:
    """No two values sharing a slot ``micro % k`` are alive at once."""
    for a in lives:
        for b in lives:
            if a[0] < b[0] and a[0] % k == b[0] % k and b[1] <= a[2]:
                return False
    return True


def _stage_rows(table: np.ndarray, axis: str) -> jax.Array:
    """``[T]``: this device's column of a schedule table (its stage's)."""
    return jnp.asarray(table)[:, jax.lax.axis_index(axis)]


def run(
    unit: Callable[..., tuple[Any, Any]],
    params: list[jax.Array],
    micro_batches: Any,
    carry: Sequence[jax.ShapeDtypeStruct],
    schedule: Schedule,
    seed: jax.Array,
    *,
    grad_dtypes: Sequence[Any],
    axis: str = PIPE_AXIS,
    reduce: Callable[[list[jax.Array]], list[jax.Array]] | None = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Runs ``schedule``: every micro-batch through every stage, forward and backward.

    Must be called inside ``shard_map`` with ``axis`` manual; each device holds its stage's
    parameters.

    Args:
      unit: ``unit(params, carry_in, first, last, micro_batch) -> (carry_out, outs)``: one
        micro-batch through this stage. ``first``/``last`` say whether this is the first or
        the last stage; ``outs`` is a list whose first entry is the (scalar) loss, meaningful
        on the last stage (zeros elsewhere).
      params: the stage's parameters (a flat list).
      micro_batches: a pytree whose leaves lead with ``M``, the micro-batches.
      carry: the layer scan's carry, the activations passed between stages.
      schedule: from :func:`make_schedule`.
      seed: the loss's cotangent (1, or the fp16 loss scale), in the loss's dtype.
      grad_dtypes: per parameter, the dtype its gradient is accumulated in.
      reduce: applied to each backward pass's parameter gradients before they are added up
        (ZeRO stage 2's reduce-scatter of each micro-batch's gradients: the sums then hold
        this device's shard only); the identity when None.

    Returns:
      ``(grads, outs)``: the parameters' gradients summed over the micro-batches (this stage's
      share; zero for a parameter the stage does not use), and ``outs`` summed over the
      micro-batches on the last stage (zeros elsewhere).
    """
    p, k = schedule.stages, schedule.slots
    position = jax.lax.axis_index(axis)  # this device's place along the pipeline
    first, last = position == 0, position == p - 1
    mb0 = jax.tree.map(lambda x: x[0], micro_batches)

    def pull(mb: Any) -> Callable[..., Any]:  # the unit of one micro-batch, of (params, carry)
        return lambda ps, c: unit(ps, c, first, last, mb)

    zero_carry = [jnp.zeros(c.shape, c.dtype) for c in carry]

    # What the pullback keeps, read from one trace: its tree, and which residuals are params.
    probe: dict[str, Any] = {}

    def residuals(ps: list[jax.Array], c: list[jax.Array], mb: Any) -> list[jax.Array]:
        (c_out, outs), vjp = jax.vjp(pull(mb), ps, c)
        leaves, tree = jax.tree.flatten(vjp)
        ids = {id(x): j for j, x in enumerate(ps)}
        probe["tree"], probe["param_of"] = tree, [ids.get(id(x), -1) for x in leaves]
        probe["outs"] = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
        return [x for x, j in zip(leaves, probe["param_of"], strict=True) if j < 0]

    res_shapes = jax.eval_shape(residuals, params, zero_carry, mb0)
    tree, param_of, out_shapes = probe["tree"], probe["param_of"], probe["outs"]

    def buffer(shapes: Sequence[Any]) -> list[jax.Array]:
        return [jnp.zeros((k + 1, *s.shape), s.dtype) for s in shapes]

    def put(buf: list[jax.Array], vals: Sequence[jax.Array], slot: jax.Array) -> list[jax.Array]:
        return [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), slot, 0) for b, v in
                zip(buf, vals, strict=True)]  # fmt: skip

    def get(buf: list[jax.Array], slot: jax.Array) -> list[jax.Array]:
        return [jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in buf]

    def slot_of(i: jax.Array) -> jax.Array:
        return jnp.where(i >= 0, i % k, k)

    def zeros(shapes: Sequence[Any]) -> list[jax.Array]:
        return [jnp.zeros(x.shape, x.dtype) for x in shapes]

    out_zeros = [jnp.zeros(o.shape, _wide(o.dtype)) for o in out_shapes]
    reduce = reduce if reduce is not None else (lambda gs: gs)
    full_grads = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in params]
    grad_shapes = [jax.ShapeDtypeStruct(r.shape, d) for r, d in zip(
        jax.eval_shape(reduce, full_grads), grad_dtypes, strict=True)]  # fmt: skip

    # The passes return what they produce; the buffers are read and written outside the
    # switch, so they stay in place in the loop's carry (a buffer passed through a
    # conditional is copied in and out: measured 4.7x the step time at K = 8). What a pass
    # sends (a forward pass's activations, a backward pass's input gradient) is one message.
    def forward(i: jax.Array, c_in: list[Any], kept: list[Any], d_carry: list[Any]) -> Any:
        mb = _take(micro_batches, i)
        (c_out, outs), vjp = jax.vjp(pull(mb), params, c_in)
        leaves = jax.tree.leaves(vjp)
        new = [x for x, j in zip(leaves, param_of, strict=True) if j < 0]
        c_out = [x.astype(c.dtype) for x, c in zip(c_out, carry, strict=True)]
        outs = [o.astype(z.dtype) for o, z in zip(outs, out_zeros, strict=True)]
        return new, c_out, outs, zeros(grad_shapes)

    def backward(i: jax.Array, c_in: list[Any], kept: list[Any], d_carry: list[Any]) -> Any:
        kept_iter = iter(kept)
        leaves = [next(kept_iter) if j < 0 else params[j] for j in param_of]
        vjp = jax.tree.unflatten(tree, leaves)
        d_carry = [jnp.where(last, jnp.zeros_like(d), d) for d in d_carry]
        d_outs = [jnp.zeros(o.shape, o.dtype) for o in out_shapes]
        loss_dtype = out_shapes[0].dtype
        d_outs[0] = jnp.where(last, seed.astype(loss_dtype), 0).astype(loss_dtype)
        d_params, d_in = vjp((d_carry, d_outs))
        d_in = [d.astype(c.dtype) for d, c in zip(d_in, carry, strict=True)]
        d_params = [d.astype(g.dtype) for d, g in zip(reduce(d_params), grad_shapes,
                    strict=True)]  # fmt: skip
        return zeros(res_shapes), d_in, out_zeros, d_params

    def idle(i: jax.Array, c_in: list[Any], kept: list[Any], d_carry: list[Any]) -> Any:
        return zeros(res_shapes), zero_carry, out_zeros, zeros(grad_shapes)

    # One permute per slot, with exactly the (source, target) pairs that slot's passes send
    # to: a table of the distinct pair sets, read with the slot's number. Every device takes
    # the same branch (the index depends on the slot alone), so the collective matches; a
    # device that sends nothing is in no pair, and a slot nobody sends in has no permute.
    branches = [_deliver(axis, pairs) for pairs in schedule.patterns]

    def body(state: dict[str, Any], row: tuple[jax.Array, ...]) -> tuple[dict[str, Any], None]:
        t, op, i, rf, rb = row
        slot = i % k
        new, send, outs, d_params = jax.lax.switch(
            op,
            (idle, forward, backward),
            i,
            get(state["fwd_in"], slot),
            get(state["res"], slot),
            get(state["bwd_in"], slot),
        )
        got = jax.lax.switch(jnp.asarray(schedule.pattern)[t], branches, send)
        state = {  # what arrived waits for its pass in the slot its micro-batch names
            "fwd_in": put(state["fwd_in"], got, slot_of(rf)),
            "bwd_in": put(state["bwd_in"], got, slot_of(rb)),
            "res": put(state["res"], new, jnp.where(op == FORWARD, slot, k)),
            "grads": [g + d for g, d in zip(state["grads"], d_params, strict=True)],
            "outs": [a + o for a, o in zip(state["outs"], outs, strict=True)],
        }
        return state, None

    state = {
        "fwd_in": buffer(carry),
        "bwd_in": buffer(carry),
        "res": buffer(res_shapes),
        "grads": zeros(grad_shapes),
        "outs": out_zeros,
    }
    arrive_f = np.concatenate([schedule.recv_forward[1:], -np.ones_like(schedule.op[:1])])
    arrive_b = np.concatenate([schedule.recv_backward[1:], -np.ones_like(schedule.op[:1])])
    rows = (
        jnp.arange(schedule.num_slots, dtype=jnp.int32),
        *(_stage_rows(t, axis) for t in (schedule.op, schedule.micro, arrive_f, arrive_b)),
    )
    state, _ = jax.lax.scan(body, state, rows)
    return state["grads"], state["outs"]


def run_forward(
    unit: Callable[..., tuple[Any, Any]],
    params: list[jax.Array],
    micro_batches: Any,
    carry: Sequence[jax.ShapeDtypeStruct],
    stages: int,
    *,
    axis: str = PIPE_AXIS,
) -> list[jax.Array]:
    """Every micro-batch through every stage, forward only (an evaluation): stage ``s`` runs
    micro-batch ``t - s`` in slot ``t`` on what stage ``s - 1`` sent in slot ``t - 1``, so
    ``M + P - 1`` slots and no activations kept. Sends only where a stage ran, one permute a
    slot (the table of pair sets, as :func:`run`). Called as :func:`run` is; returns ``outs``
    summed over the micro-batches on the last stage (zeros elsewhere)."""
    p = int(stages)
    m = int(jax.tree.leaves(micro_batches)[0].shape[0])
    position = jax.lax.axis_index(axis)
    first, last = position == 0, position == p - 1
    mb0 = jax.tree.map(lambda x: x[0], micro_batches)
    zero_carry = [jnp.zeros(c.shape, c.dtype) for c in carry]
    out_shapes = jax.eval_shape(lambda c: unit(params, c, first, last, mb0)[1], zero_carry)
    out_zeros = [jnp.zeros(o.shape, _wide(o.dtype)) for o in out_shapes]
    # Stage s runs micro-batch t - s in slot t and sends it on.
    pattern, patterns = _pair_table(
        [tuple((s, s + 1) for s in range(p - 1) if 0 <= t - s < m) for t in range(m + p - 1)]
    )
    branches = [_deliver(axis, q) for q in patterns]

    def body(state: tuple[list[Any], list[Any]], t: jax.Array) -> tuple[Any, None]:
        received, sums = state
        i = t - position
        active = (i >= 0) & (i < m)

        def stage(c_in: list[Any]) -> tuple[list[Any], list[Any]]:
            mb = _take(micro_batches, jnp.clip(i, 0, m - 1))
            c_out, outs = unit(params, c_in, first, last, mb)
            c_out = [x.astype(c.dtype) for x, c in zip(c_out, carry, strict=True)]
            return c_out, [o.astype(z.dtype) for o, z in zip(outs, out_zeros, strict=True)]

        def rest(c_in: list[Any]) -> tuple[list[Any], list[Any]]:
            return zero_carry, out_zeros

        sent, outs = jax.lax.cond(active, stage, rest, received)
        got = jax.lax.switch(jnp.asarray(pattern)[t], branches, sent)
        return (got, [a + o for a, o in zip(sums, outs, strict=True)]), None

    (_, sums), _ = jax.lax.scan(
        body, (zero_carry, out_zeros), jnp.arange(m + p - 1, dtype=jnp.int32)
    )
    return sums


def _take(micro_batches: Any, i: jax.Array) -> Any:
    """Micro-batch ``i`` of ``micro_batches`` (leaves leading with ``M``)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), micro_batches)


def _wide(dtype: Any) -> Any:
    """The dtype a sum over micro-batches is kept in: at least float32 for a floating value."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype
