"""Pipeline parallelism: a model's stacked layers split into contiguous stages over the
``pipe`` mesh axis (or, interleaved, ``V`` chunks a stage), micro-batches moved between
neighbouring stages by ``ppermute``.

This module holds what is independent of ZeRO and of the model: the schedules (which stage
runs which micro-batch's forward or backward pass in each time slot) and the engine that runs a
schedule inside ``shard_map`` with ``pipe`` manual, given one *stage unit* (a function that
runs one micro-batch through the stage's own layers, see
:mod:`jzero.parallel.pipeline.layer_split`).

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
* **Interleaved 1F1B** (Megatron's): each stage holds ``V`` chunks of ``L / (P V)`` layers,
  the model's chunks ``s, P + s, ...``, and runs each pass on one chunk; the forward passes go
  in groups of ``P`` micro-batches chunk by chunk (the backward passes the last chunk first),
  after ``2 (P - 1 - s) + (V - 1) P`` warm-up forwards. A slot is a chunk's pass, ``1 / V`` of a
  stage's, so the idle fraction falls to ``(P - 1) / (M V + P - 1)``; messages wrap from the
  last stage to the first (the next chunk) and back. The caller hands each stage its chunks in
  its rows (:class:`RunOptions`' ``chunked``).
* **Zero-bubble (ZB-H1)** splits each backward pass in two
  (:mod:`jzero.parallel.pipeline.backward_split`): the input gradient (B), which the previous stage
  waits for, and the weight gradient (W), which nobody waits for. Each stage runs, in each
  slot, the first that is ready of: the oldest B, the next forward while fewer than ``P``
  micro-batches are in flight on it (forward done, W not: 1F1B's most), the oldest W. So the
  W passes fill what would be the bubble: at ``P = 4, M = 8`` a stage idles 17% of its slots
  (1F1B: 27%), and in the time model where slots run in lockstep (:attr:`Schedule.step_time`)
  the step takes 29 forward-times against 1F1B's 40.
* **What the backward pass needs is kept per pass, in places the table gives out.** A
  forward pass is ``jax.vjp`` of the stage unit; what the pullback needs (its residuals: saved
  activations, as the stage's activation checkpointing policy decides) is written into a
  place of the residuals' buffer and read back by the pass's backward (or weight) pass. A
  residual that is one of the stage's parameters is not buffered (the pullback reads the
  parameter itself). The table gives each value the least place free when it is written
  (:class:`jzero.choices.schedules.Buffer`), so a buffer has as many places as values alive at
  once: ``M`` under GPipe, ``P`` under 1F1B. That is the whole difference in activation
  memory between the two schedules, and the compiled program's temporaries show it.
* **Only the transfers the schedule needs.** A forward pass's activations go to the next
  stage, a backward pass's input gradient to the previous one, and nothing else moves: each
  micro-batch crosses each stage boundary once forward and once back, ``2 M (P - 1)``
  messages a step. A stage runs one pass a slot, so it sends at most one message, and no two
  stages send to the same one in a slot (checked when the table is built), so one
  ``ppermute`` a slot carries them all, with exactly that slot's ``(source, target)`` pairs.
  The pairs differ from slot to slot while a permute's pairs are fixed in the program, so the
  distinct pair sets (``3P`` or so) are the branches of one ``lax.switch`` indexed by the slot
  number: every device takes the same branch, so the collective matches, and a slot where no
  stage sends runs none. Where one stage would receive an activation and a gradient in one
  slot (zero-bubble, interleaving), the slot runs two permutes, one each way. A received
  message waits in its buffer's place (one or two; one more is a sink for a slot that
  received nothing) until its pass runs.
* **The loss runs on the last stage only, the embedding on the first only** (the unit's two
  ``lax.cond``, :func:`jzero.parallel.pipeline.stage_unit`), the loss's gradient seeded on
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
from jzero.choices.schedules import Schedule, bubble_fraction, make_schedule, pair_table
from jzero.distributed.mesh import PIPE_AXIS

__all__ = [
    "PIPE_AXIS",
    "SCHEDULES",
    "Residuals",
    "RunOptions",
    "Schedule",
    "bubble_fraction",
    "make_schedule",
    "run",
    "run_forward",
]


def _deliver(axis: str, pairs: tuple[tuple[int, int], ...]) -> Callable[[list[Any]], list[Any]]:
    """One slot's transfer: a permute with exactly ``pairs``; zeros when nobody sends."""
    if not pairs:
        return lambda msg: [jnp.zeros_like(x) for x in msg]
    return lambda msg: [jax.lax.ppermute(x, axis, list(pairs)) for x in msg]


def _stage_rows(table: np.ndarray, axis: str) -> jax.Array:
    """``[T]``: this device's column of a schedule table (its stage's)."""
    return jnp.asarray(table)[:, jax.lax.axis_index(axis)]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What :func:`run` takes besides the unit, its inputs and the schedule: the pipeline's
    axis, and what some schedules (zero-bubble, interleaved) and ZeRO stages (2) need."""

    axis: str = PIPE_AXIS
    """The mesh axis of the stages, manual inside the caller's ``shard_map``."""
    reduce: Callable[[list[jax.Array]], list[jax.Array]] | None = None
    """Applied to each backward pass's parameter gradients before they are added up (ZeRO
    stage 2's reduce-scatter of each micro-batch's gradients: the sums then hold this device's
    shard only); the identity when None."""
    split_backward: Callable[..., Any] | None = None
    """What cuts the unit's backward pass into input- and weight-gradient passes
    (:func:`jzero.parallel.pipeline.split_backward`), which the zero-bubble schedule needs."""
    chunked: Sequence[bool] | None = None
    """Per parameter, whether it is split in the schedule's ``V`` chunks of layers (its leading
    dimension: chunk ``v`` the ``v``-th ``1 / V`` of the stage's rows), the others whole in
    every chunk; an interleaved schedule needs it."""


def run(
    unit: Callable[..., tuple[Any, Any]],
    params: list[jax.Array],
    micro_batches: Any,
    carry: Sequence[jax.ShapeDtypeStruct],
    schedule: Schedule,
    seed: jax.Array,
    *,
    grad_dtypes: Sequence[Any],
    options: RunOptions | None = None,
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
      options: the pipeline's axis and what some schedules and stages need besides
        (:class:`RunOptions`); ``None``: its defaults.

    Returns:
      ``(grads, outs)``: the parameters' gradients summed over the micro-batches (this stage's
      share; zero for a parameter the stage does not use), and ``outs`` summed over the
      micro-batches on the last stage (zeros elsewhere).
    """
    o = options if options is not None else RunOptions()
    axis, reduce, split_backward, chunked = o.axis, o.reduce, o.split_backward, o.chunked
    p, v = schedule.stages, schedule.virtual
    position = jax.lax.axis_index(axis)  # this device's place along the pipeline
    mb0 = jax.tree.map(lambda x: x[0], micro_batches)
    zero_carry = [jnp.zeros(c.shape, c.dtype) for c in carry]
    if schedule.kind == "zero_bubble" and split_backward is None:
        raise ValueError("the zero_bubble schedule needs split_backward (jzero.rewrite's)")
    if v > 1 and chunked is None:
        raise ValueError("an interleaved schedule needs `chunked`, the leaves split in chunks")
    chunked = list(chunked) if v > 1 else [False] * len(params)
    rows_of = [x.shape[0] // v if c else 0 for x, c in zip(params, chunked, strict=True)]

    def chunk_of(c: jax.Array | int) -> list[jax.Array]:  # chunk c's parameters (all: V = 1)
        return [jax.lax.dynamic_slice_in_dim(x, c * n, n, 0) if n else x
                for x, n in zip(params, rows_of, strict=True)]  # fmt: skip

    def ends(c: jax.Array | int) -> tuple[jax.Array, jax.Array]:  # the model's first, last chunk
        return (position == 0) & (c == 0), (position == p - 1) & (c == v - 1)

    def fixed_of(i: jax.Array, c: jax.Array) -> list[jax.Array]:  # the unit's other arguments
        return [*ends(c), *_leaves(micro_batches, i)]

    cut = split_backward if schedule.kind == "zero_bubble" else None
    passes = _passes(unit, chunk_of(0), zero_carry, *ends(0), mb0, cut)
    out_shapes = passes.outs

    def buffer(name: str, shapes: Sequence[Any]) -> list[jax.Array]:
        places = schedule.buffers[name].count + 1  # the last one a sink
        return [jnp.zeros((places, *s.shape), s.dtype) for s in shapes]

    def put(buf: list[jax.Array], vals: Sequence[jax.Array], slot: jax.Array) -> list[jax.Array]:
        return [jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0) for b, x in
                zip(buf, vals, strict=True)]  # fmt: skip

    def get(buf: list[jax.Array], slot: jax.Array) -> list[jax.Array]:
        return [jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in buf]

    def zeros(shapes: Sequence[Any]) -> list[jax.Array]:
        return [jnp.zeros(x.shape, x.dtype) for x in shapes]

    out_zeros = [jnp.zeros(o.shape, _wide(o.dtype)) for o in out_shapes]
    reduce = reduce if reduce is not None else (lambda gs: gs)
    unit_grads = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in chunk_of(0)]
    grad_shapes = [jax.ShapeDtypeStruct(r.shape, d) for r, d in zip(
        jax.eval_shape(reduce, unit_grads), grad_dtypes, strict=True)]  # fmt: skip

    def d_outs(last: jax.Array) -> list[jax.Array]:  # the loss's cotangent: seeded on the last
        ds = [jnp.zeros(o.shape, o.dtype) for o in out_shapes]
        loss_dtype = out_shapes[0].dtype
        ds[0] = jnp.where(last, seed.astype(loss_dtype), 0).astype(loss_dtype)
        return ds

    def summed(d_params: list[jax.Array]) -> list[jax.Array]:
        return [d.astype(g.dtype) for d, g in zip(reduce(d_params), grad_shapes, strict=True)]

    # The passes return what they produce; the buffers are read and written outside the
    # switch, so they stay in place in the loop's carry (a buffer passed through a
    # conditional is copied in and out: measured 4.7x the step time at K = 8). What a pass
    # sends (a forward pass's activations, a backward pass's input gradient) is one message.
    # Each takes (micro-batch, chunk, its parameters, fwd_in, res, bwd_in, kept) and returns
    # (res, message, outs, gradients, kept).
    def forward(i: jax.Array, ch: jax.Array, ps: list[Any], c_in: list[Any], saved: list[Any],
                d_carry: list[Any], kept: list[Any]) -> Any:  # fmt: skip
        c_out, outs, new = passes.forward(ps, c_in, fixed_of(i, ch))
        c_out = [x.astype(c.dtype) for x, c in zip(c_out, carry, strict=True)]
        outs = [o.astype(z.dtype) for o, z in zip(outs, out_zeros, strict=True)]
        return new, c_out, outs, zeros(grad_shapes), zeros(passes.kept)

    def backward(i: jax.Array, ch: jax.Array, ps: list[Any], c_in: list[Any], saved: list[Any],
                 d_carry: list[Any], kept: list[Any]) -> Any:  # fmt: skip
        fixed = fixed_of(i, ch)
        last = fixed[1]
        d_carry = [jnp.where(last, jnp.zeros_like(d), d) for d in d_carry]
        d_in, d_params, new_kept = passes.backward(ps, fixed, saved, d_carry, d_outs(last))
        d_in = [d.astype(c.dtype) for d, c in zip(d_in, carry, strict=True)]
        grads = zeros(grad_shapes) if d_params is None else summed(d_params)
        return zeros(passes.saved), d_in, out_zeros, grads, new_kept

    def weight(i: jax.Array, ch: jax.Array, ps: list[Any], c_in: list[Any], saved: list[Any],
               d_carry: list[Any], kept: list[Any]) -> Any:  # fmt: skip
        fixed = fixed_of(i, ch)
        d_params = passes.weight(ps, fixed, saved, kept, d_outs(fixed[1]))
        return zeros(passes.saved), zero_carry, out_zeros, summed(d_params), zeros(passes.kept)

    def idle(i: jax.Array, ch: jax.Array, ps: list[Any], c_in: list[Any], saved: list[Any],
             d_carry: list[Any], kept: list[Any]) -> Any:  # fmt: skip
        return zeros(passes.saved), zero_carry, out_zeros, zeros(grad_shapes), zeros(passes.kept)

    # One permute per slot, with exactly the (source, target) pairs that slot's passes send
    # to (two where one stage receives an activation and a gradient in one slot): a table of
    # the distinct pair sets, read with the slot's number. Every device takes the same branch
    # (the index depends on the slot alone), so the collective matches; a device that sends
    # nothing is in no pair, and a slot nobody sends in has no permute.
    branches = [_deliver(axis, pairs) for pairs in schedule.patterns]
    table = [jnp.asarray(schedule.pattern[:, j]) for j in range(schedule.pattern.shape[1])]
    kinds = (idle, forward, backward, weight) if passes.split else (idle, forward, backward)
    names = ("fwd_in", "res", "bwd_in", "kept")

    def add(sums: list[jax.Array], d: list[jax.Array], c: jax.Array) -> list[jax.Array]:
        """Chunk ``c``'s gradients added into its rows (all of a leaf not split in chunks)."""
        out = []
        for g, x, n in zip(sums, d, rows_of, strict=True):
            if n:
                x = jax.lax.dynamic_slice_in_dim(g, c * n, n, 0) + x
                out.append(jax.lax.dynamic_update_slice_in_dim(g, x, c * n, 0))
            else:
                out.append(g + x)
        return out

    def body(state: dict[str, Any], row: dict[str, jax.Array]) -> tuple[dict[str, Any], None]:
        t, op, i, c = row["t"], row["op"], row["micro"], row["chunk"]
        new, send, outs, d_params, new_kept = jax.lax.switch(
            op,
            kinds,
            i,
            c,
            chunk_of(c),
            *(get(state[n], row[f"{n}.read"]) for n in names),
        )
        got = jax.lax.switch(table[0][t], branches, send)
        if schedule.pattern.shape[1] > 1 and schedule.pattern[:, 1].any():
            other = jax.lax.switch(table[1][t], branches, send)
            got_back = [jnp.where(table[1][t] > 0, b, a) for a, b in zip(got, other, strict=True)]
        else:
            got_back = got
        # What arrived waits for its pass in the place the schedule gave it.
        written = {"fwd_in": got, "bwd_in": got_back, "res": new, "kept": new_kept}
        state = {n: put(state[n], written[n], row[f"{n}.write"]) for n in names} | {
            "grads": add(state["grads"], d_params, c),
            "outs": [a + o for a, o in zip(state["outs"], outs, strict=True)],
        }  # fmt: skip
        return state, None

    grad_sums = [jax.ShapeDtypeStruct((g.shape[0] * v, *g.shape[1:]) if n else g.shape, g.dtype)
                 for g, n in zip(grad_shapes, rows_of, strict=True)]  # fmt: skip
    state = {
        "fwd_in": buffer("fwd_in", carry),
        "bwd_in": buffer("bwd_in", carry),
        "res": buffer("res", passes.saved),
        "kept": buffer("kept", passes.kept),
        "grads": zeros(grad_sums),
        "outs": out_zeros,
    }
    tables = {"op": schedule.op, "micro": schedule.micro, "chunk": schedule.chunks}
    for n in names:
        tables[f"{n}.read"] = schedule.buffers[n].read
        tables[f"{n}.write"] = schedule.buffers[n].write
    rows = {name: _stage_rows(x, axis) for name, x in tables.items()}
    rows["t"] = jnp.arange(schedule.num_slots, dtype=jnp.int32)
    state, _ = jax.lax.scan(body, state, rows)
    return state["grads"], state["outs"]


@dataclasses.dataclass(frozen=True)
class _Passes:
    """A stage unit's passes as :func:`run` calls them (flat lists throughout).

    ``forward(params, carry_in, fixed) -> (carry_out, outs, saved)``;
    ``backward(params, fixed, saved, d_carry_out, d_outs) -> (d_carry_in, d_params, kept)``,
    ``d_params`` None where the weight pass computes them;
    ``weight(params, fixed, saved, kept, d_outs) -> d_params`` (split backward only).
    ``fixed`` is ``[first, last, *micro-batch leaves]``.
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    weight: Callable[..., Any] | None
    saved: tuple[jax.ShapeDtypeStruct, ...]
    kept: tuple[jax.ShapeDtypeStruct, ...]
    outs: tuple[jax.ShapeDtypeStruct, ...]
    split: bool


def _passes(
    unit: Callable[..., Any], params: list[jax.Array], carry: list[jax.Array], first: jax.Array,
    last: jax.Array, mb: Any, split: Callable[..., Any] | None,
) -> _Passes:  # fmt: skip
    """The unit's passes: a forward pass keeping the pullback's residuals and one backward
    pass (GPipe, 1F1B), or the backward split into input- and weight-gradient passes
    (:func:`jzero.parallel.pipeline.split_backward`, zero-bubble)."""
    treedef = jax.tree.structure(mb)

    def call(ps: list[Any], c: list[Any], fixed: list[Any]) -> Any:
        return unit(ps, c, fixed[0], fixed[1], treedef.unflatten(fixed[2:]))

    fixed0 = [first, last, *jax.tree.leaves(mb)]
    if split is not None:
        halves = split(call, params, carry, fixed0)
        outs = jax.eval_shape(lambda ps, c, f: halves.forward(ps, c, f)[1], params, carry, fixed0)

        def backward(ps: list[Any], fixed: list[Any], saved: list[Any], d_carry: list[Any],
                     d_outs: list[Any]) -> Any:  # fmt: skip
            d_in, kept = halves.input_grad(ps, fixed, saved, d_carry, d_outs)
            return d_in, None, kept

        return _Passes(halves.forward, backward, halves.weight_grad, halves.saved, halves.kept,
                       tuple(outs), True)  # fmt: skip

    residuals = Residuals()  # the pullback's, but the parameters (read again, not kept)

    def forward(ps: list[Any], c: list[Any], fixed: list[Any]) -> Any:
        (c_out, outs), vjp = jax.vjp(lambda ps, c: call(ps, c, fixed), ps, c)
        return c_out, outs, residuals.keep(vjp, ps)

    _, outs, saved = jax.eval_shape(forward, params, carry, fixed0)

    def backward(ps: list[Any], fixed: list[Any], saved: list[Any], d_carry: list[Any],
                 d_outs: list[Any]) -> Any:  # fmt: skip
        d_params, d_in = residuals.rebuild(saved, ps)((d_carry, d_outs))
        return d_in, d_params, []

    return _Passes(forward, backward, None, tuple(saved), (), tuple(outs), False)


class Residuals:
    """A pullback's residuals minus those among ``sources`` (the values it was taken of, read
    again instead of kept: a stage's parameters), and the pullback rebuilt from the kept
    ones. The layout is read on the first trace; every later trace is of the same function,
    so it matches."""

    def __init__(self) -> None:
        self.layout: tuple[Any, list[int]] | None = None

    def keep(self, pullback: Any, sources: Sequence[Any]) -> list[Any]:
        """The residuals to keep, in order."""
        leaves, tree = jax.tree.flatten(pullback)
        ids = {id(x): j for j, x in enumerate(sources)}
        which = [ids.get(id(x), -1) for x in leaves]
        if self.layout is None:
            self.layout = (tree, which)
        return [x for x, j in zip(leaves, which, strict=True) if j < 0]

    def rebuild(self, kept: Sequence[Any], sources: Sequence[Any]) -> Any:
        """The pullback, from what :meth:`keep` kept and the same ``sources``."""
        assert self.layout is not None, "keep() is traced before rebuild()"
        tree, which = self.layout
        it = iter(kept)
        return jax.tree.unflatten(tree, [next(it) if j < 0 else sources[j] for j in which])

    @property
    def count(self) -> int:
        """How many residuals are kept."""
        assert self.layout is not None
        return sum(j < 0 for j in self.layout[1])


def _leaves(micro_batches: Any, i: jax.Array) -> list[jax.Array]:
    """Micro-batch ``i``'s leaves."""
    return jax.tree.leaves(_take(micro_batches, i))


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
    pattern, patterns = pair_table(
        [(tuple((s, s + 1) for s in range(p - 1) if 0 <= t - s < m),) for t in range(m + p - 1)]
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
        got = jax.lax.switch(jnp.asarray(pattern[:, 0])[t], branches, sent)
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
