"""The replay of a traced loss: stage 3's gathers moved to their uses, layers checkpointed.

The interpreter half of :mod:`jzero.rewrite.gather`: :class:`Interpreter` runs a jaxpr equation by
equation with each sharded parameter standing as a pending gather (:mod:`jzero.rewrite.pending`),
and re-emits scans and layers where their gathers and checkpoints belong.

Decisions:

* When a ``scan`` consumes a pending gather as a scanned operand (stacked layers, layer dim
  leading), the shard itself is scanned and the all-gather is placed *inside* the scan body,
  which is re-traced under ``jax.checkpoint`` with a policy that saves only matmul outputs
  (``dots_no_batch``, :data:`remat_save_policy`; the ``activation_checkpointing`` policy when
  one is set, see :mod:`jzero.rewrite.remat`), so no gathered weight is kept for the backward pass.
  The
  backward pass therefore gathers each layer again and reduce-scatters its gradient (the
  transpose of an all-gather): ZeRO-3's 3x volume, with one layer's full weights live at a time.
* Stage 2's whole parameters with a sharded gradient (:class:`jzero.rewrite.pending.Scattered`)
  go the same way without a gather: a scan scans the whole stack beside the gradient's
  stand-in and reads each layer through :func:`jzero.rewrite.pending.scatter_grad`, whose
  transpose reduce-scatters that layer's gradient in the backward loop; the body is
  checkpointed only where the policy says so. Any other use reads the whole value there.
* Any other use (a model written as a Python loop over layers, embeddings, a final norm, a tied
  embedding used twice) gathers the whole leaf right at that use, inside a custom VJP whose
  backward pass gathers it again instead of keeping the gathered weight alive from the
  forward pass (FSDP's reshard-after-forward). Two things make that hold on every backend,
  both measured on CPU, where a Python loop of 16 layers of 512x512 kept 16.1 MiB of
  temporaries without them and 4.0 MiB with them (the same layers as a scan: 4.1 MiB):
  each gather is tied (``tied``: the shard plus zero times one element) to an operand of its
  use, or in the backward pass to the use's cotangent, so XLA's scheduler cannot hoist every
  layer's gather to the start of the step; and the backward gather is thereby a different
  value, which XLA's CSE cannot merge with the forward one (``jax.checkpoint`` cannot do this
  on CPU: its optimization barriers are expanded away before CSE runs).
* ``overlap`` (``overlap_comm``): a scan that gathers weights is re-emitted by
  :func:`jzero.rewrite.overlap.overlapped_scan`, which carries each layer's gathered weights
  one
  iteration ahead in the forward and the backward loop, reduce-scatters each layer's gradient
  beside the next layer's backward pass and keeps no gathered weight for the backward pass
  (the same values, the same collectives; measured on 8 CPU devices: the temporaries grow by
  the same bytes per layer as without it, plus a constant two layers' weights).
* Policy ``none`` would keep the gathered weights, so with gathered weights it keeps only what
  depends on the layer's input: the body is re-emitted eqn by eqn and each such value tagged
  with ``checkpoint_name`` (``save_anything_except_these_names`` saves everything in JAX
  0.10.2). Measured, 16 layers of 512x512 (16 MiB) at stage 3: 4.5 MiB of temporaries and
  two all-gathers per layer, as the default; saving everything: 20.8 MiB and one all-gather.
* Activation checkpointing at every stage: every scan reached outside other scans (through
  nested ``jit`` calls too) is re-emitted with its body under ``jax.checkpoint``, and each
  layer of a model written as a Python loop (:func:`jzero.rewrite.trace.find_layers`) as one
  checkpointed function (:func:`jzero.rewrite.trace.remat_layer`). Inside such a layer stage 3
  gathers plainly: the recomputation gathers again and also serves the backward pass, two
  gathers per weight as in a scan. Scans inside other higher-order primitives (``cond``,
  ``while``, custom derivatives, the model's own ``jax.checkpoint``) are left as written.
* DeepSpeed's stage-3 knobs act on the uses outside scans and checkpointed layers, from the
  gather order one recording pass (``record``) finds (:mod:`jzero.rewrite.prefetch`):
  ``stage3_prefetch_bucket_size`` ties a forward gather to an earlier use's operand
  (``anchors``), ``stage3_max_reuse_distance`` gathers a leaf reused soon enough once and keeps
  it (``kept``), within ``stage3_max_live_parameters``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.ad_checkpoint
from jax.extend import core as jex_core

from jzero.rewrite.overlap import can_overlap, overlapped_scan
from jzero.rewrite.pending import Pending, Scattered
from jzero.rewrite.prefetch import GatherEvent
from jzero.rewrite.remat import LAYER_INPUT, RematPolicy
from jzero.rewrite.trace import (
    STAGE_MARK,
    Partition,
    Segment,
    bind,
    eval_tagged,
    first_element,
    has_scan,
    inner_jaxpr,
    named,
    remat_layer,
    tied,
)

__all__ = ["GATHERED", "PARTITIONED", "GatherOptions", "Interpreter", "remat_save_policy"]

# Matmul outputs (the activations) are kept for the backward pass; everything else in a
# gathered layer, the gathered weights first of all, is recomputed there. Measured on the
# built-in GPT (8 layers of d=256, stage 3, 8 devices): saving all but the all-gather outputs
# left 48 MiB of temporaries (weight-derived values were saved), this policy 18 MiB, saving
# nothing 11 MiB at the cost of a second forward pass.
remat_save_policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

GATHERED = "jzero_gathered_weight"  # the name of a gathered weight kept for backward

PARTITIONED = "jzero_partitioned_input"  # a layer's input saved split over the model axes


@dataclasses.dataclass(frozen=True)
class GatherOptions:
    """How stage 3 gathers its parameters and what a checkpointed layer saves: the settings of
    :func:`jzero.rewrite.gather_at_use` beside the leaves and the remat policy. The defaults gather
    each parameter exactly at its use, again in the backward pass.

    DeepSpeed's stage-3 knobs (``prefetch``, ``reuse_distance``, ``max_live``) are read by
    :func:`~jzero.rewrite.gather_at_use`'s recording pass, ZeRO++'s (``bits``, ``grad_bits``) by
    each pending gather, the rest by the :class:`Interpreter`.
    """

    grad_dtype: Any = None
    """The dtype the gradients' reduce-scatter runs in; ``None``: the shard's."""
    reshard: bool = True
    """Gather each weight again in the backward pass (FSDP's ``reshard_after_forward``);
    ``False`` keeps the forward's gathered weights for the backward pass instead: one
    all-gather per weight, not two, and every gathered weight alive until its backward use."""
    prefetch: int = 0
    """DeepSpeed's ``stage3_prefetch_bucket_size``: a use's gather may start this many gathered
    elements ahead of it (:func:`~jzero.rewrite.prefetch.prefetch_anchors`); 0: at its use."""
    reuse_distance: int | None = None
    """DeepSpeed's ``stage3_max_reuse_distance``: leaves reused within this many elements are
    gathered once and kept (:func:`~jzero.rewrite.prefetch.kept_leaves`); ``None``: none."""
    max_live: int | None = None
    """DeepSpeed's ``stage3_max_live_parameters``, the cap on what reuse keeps."""
    bits: int = 0
    """ZeRO++ qwZ: every gather of a floating parameter sends it quantized to this many bits
    (8 or 4; :func:`jzero.comm.quantization.quantized_all_gather`); 0: exact."""
    grad_bits: int = 0
    """ZeRO++ qgZ: every gather's transpose (the gradient's reduce-scatter) is the quantized
    all-to-all of :func:`jzero.comm.quantization.quantized_psum_scatter`; 0: exact."""
    overlap: bool = False
    """``overlap_comm``: a scan that gathers weights fetches each layer one iteration ahead, in
    the forward and the backward pass, and reduce-scatters each layer's gradient beside the next
    layer's backward pass (:func:`jzero.rewrite.overlap.overlapped_scan`). Scans that keep
    gathered weights (``reshard=False``), tag activations (policy ``none``), partition or
    offload them, run in reverse, have one iteration or a non-floating carry gather at their
    own iteration as without it."""
    partition: Partition | None = None
    """DeepSpeed's ``partition_activations``: each checkpointed layer's saved input split over
    the mesh's model-parallel axes (:class:`jzero.rewrite.trace.Partition`)."""


class Interpreter:
    """Replays a jaxpr, moving the gathers of pending parameters as late as their uses allow,
    and re-emitting each scan's body under ``jax.checkpoint`` where ``policy`` asks for it.

    ``policy`` None: only the scans that gather weights are checkpointed, with
    :data:`remat_save_policy` (stage 3's default); a :class:`~jzero.rewrite.remat.RematPolicy`:
    every scan reached outside other scans (see :mod:`jzero.rewrite.remat` for what each policy
    keeps).
    ``options``: the gather's dtype, resharding, overlap and activation partition
    (:class:`GatherOptions`; its other fields are the caller's). ``shards``: the size of the
    axis; ``kept`` and ``anchors``: what a recording pass (``record``) found.
    """

    def __init__(
        self,
        axis_name: str | None,
        options: GatherOptions | None = None,
        policy: RematPolicy | None = None,
        *,
        shards: int = 1,
        kept: frozenset[int] = frozenset(),
        anchors: Sequence[int] = (),
        record: bool = False,
    ):
        options = options if options is not None else GatherOptions()
        self.axis_name = axis_name
        self.overlap = options.overlap  # gather each scanned layer one iteration ahead
        self.grad_dtype = options.grad_dtype
        self.policy: RematPolicy | None = policy
        self.reshard = options.reshard  # gather again in the backward pass (see ``gather_at_use``)
        self.shards = shards  # the size of the axis
        self.kept = kept  # leaves gathered once and kept (``stage3_max_reuse_distance``)
        self.anchors = list(anchors)  # per use, the use its gather waits for (prefetch)
        self.record = record  # only record the gather order (:class:`GatherEvent`), gather nothing
        self.partition = options.partition  # saved layer inputs split over model axes
        self.events: list[GatherEvent] = []
        self._firsts: list[Any] = []  # per use so far, one element of its first operand
        self._kept_values: dict[Any, Any] = {}
        self._by_stage: set[int] = set()  # ids of values the same on a stage's devices

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        segments: dict[int, Segment] | None = None,
    ) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex_core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        k, eqns = 0, jaxpr.eqns
        while k < len(eqns):
            seg = segments.get(k) if segments else None
            if seg is not None:
                outs = self._layer(eqns[seg.start : seg.stop], seg, [read(v) for v in seg.live_in])
                env.update(zip(seg.live_out, outs, strict=True))
                k = seg.stop
                continue
            eqn = eqns[k]
            invals = [read(v) for v in eqn.invars]
            if any(isinstance(x, (Pending, Scattered)) for x in invals) or self._rewrites(eqn):
                outs = self._eqn(eqn, invals)
            else:
                outs = bind(eqn, invals)
            if self._marks_stage(eqn, invals):
                self._by_stage.add(id(outs[0]))
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
            k += 1
        return [read(v) for v in jaxpr.outvars]

    def _layer(self, eqns: Sequence[Any], seg: Segment, vals: list[Any]) -> list[Any]:
        """One layer of a Python loop, checkpointed by the policy (:func:`remat_layer`).

        Its parameters come in as shards and are gathered at their uses inside, plainly: the
        backward pass recomputes the layer, gathers included, so no gathered weight is saved.
        """
        vals = [self.materialize(x) if isinstance(x, Scattered) else x for x in vals]
        pend = [x if isinstance(x, Pending) else None for x in vals]
        if self.record:
            leaves = {p.index: p.numel(self.shards) for p in pend if p is not None}
            self.events.append(GatherEvent(leaves, "layer", sum(leaves.values())))
        arrays = [x.shard if p is not None else x for x, p in zip(vals, pend, strict=True)]
        out_pend: list[Any] = [None] * len(seg.live_out)

        def body(arrays: list[Any]) -> list[Any]:
            env: dict[Any, Any] = {}
            for v, x, p in zip(seg.live_in, arrays, pend, strict=True):
                env[v] = x if p is None else dataclasses.replace(p, shard=x)

            def read(v: Any) -> Any:
                return v.val if isinstance(v, jex_core.Literal) else env[v]

            gathered: dict[Any, Any] = {}
            for eqn in eqns:
                invals = [read(v) for v in eqn.invars]
                if not any(isinstance(x, Pending) for x in invals):
                    outs = bind(eqn, invals)
                elif eqn.primitive.name == "convert_element_type":
                    outs = self._eqn(eqn, invals)
                else:
                    anchor = [x for x in invals if not isinstance(x, Pending)]
                    for i, x in enumerate(invals):
                        if isinstance(x, Pending):
                            if x.key not in gathered:
                                gathered[x.key] = self.materialize(x, anchor)
                            invals[i] = gathered[x.key]
                    outs = bind(eqn, invals)
                env.update(zip(eqn.outvars, outs, strict=True))
            outs = []
            for i, v in enumerate(seg.live_out):
                x = read(v)
                if isinstance(x, Pending):  # a cast parameter another layer uses
                    out_pend[i], x = x, x.shard
                outs.append(x)
            return outs

        if self.record or self.policy is None or not self.policy.active:
            outs = body(arrays)
        else:
            split = seg.activations_in  # the saved activations, not the weights
            outs = remat_layer(body, self.policy, self.partition, split)(arrays)
        return [
            x if p is None else dataclasses.replace(p, shard=x)
            for x, p in zip(outs, out_pend, strict=True)
        ]

    def _rewrites(self, eqn: Any) -> bool:
        """Whether an eqn without pending operands holds a scan the policy checkpoints."""
        if self.policy is None or not self.policy.active:
            return False
        if eqn.primitive.name == "scan":
            return True
        inner = inner_jaxpr(eqn)
        return inner is not None and has_scan(inner.jaxpr)

    def materialize(self, x: Any, anchor: Any = None) -> Any:
        """``x`` gathered if pending (tied to ``anchor``, see :func:`tied`), read with its
        gradient scattered if :class:`Scattered`; else ``x``."""
        if isinstance(x, Scattered):
            return x.take(self.grad_dtype)
        if not isinstance(x, Pending):
            return x
        if self.record:  # the right shape, nothing gathered
            shape = list(x.shard.shape)
            shards = x.shards or self.shards
            shape[x.dim] = x.size if x.size is not None else shape[x.dim] * shards
            return jax.numpy.zeros(shape, x.dtype or x.shard.dtype)
        shard = x.shard if anchor is None else tied(x.shard, anchor)
        return x.gather(self.axis_name, self.grad_dtype, shard=shard)

    def _eqn(self, eqn: Any, invals: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        inner = inner_jaxpr(eqn)
        if name == "convert_element_type" and isinstance(invals[0], Scattered):
            # The cast's transpose brings the cotangent back; the scatter runs on it as cast.
            p = invals[0]
            return [dataclasses.replace(p, whole=p.whole.astype(eqn.params["new_dtype"]))]
        if inner is None and name != "scan" and any(isinstance(x, Scattered) for x in invals):
            # Any use but a scan's scanned operand reads the whole value there.
            invals = [self.materialize(x) if isinstance(x, Scattered) else x for x in invals]
            if not any(isinstance(x, Pending) for x in invals):
                return bind(eqn, invals)
        if name == "convert_element_type" and isinstance(invals[0], Pending):
            p = invals[0]
            # Narrowing (or same-width) casts run on the shard, so the gather moves fewer
            # bytes; a widening cast (a bf16 parameter upcast by the model) runs after it.
            new = jax.numpy.dtype(eqn.params["new_dtype"])
            if new.itemsize <= p.shard.dtype.itemsize:
                return [dataclasses.replace(p, shard=p.shard.astype(new), dtype=None)]
            return [dataclasses.replace(p, dtype=new)]
        if inner is not None:
            return self.run(inner.jaxpr, inner.consts, invals)
        if name == "scan":
            return self._scan(eqn, invals)
        if name == "cond" and id(invals[0]) in self._by_stage and not self._ordered:
            return self._cond(eqn, invals)
        return self._use(eqn, invals)

    @property
    def _ordered(self) -> bool:
        """Whether gathers follow a recorded order (prefetch anchors, kept leaves): then a
        branch's uses would be numbered apart from the recording's, so a ``cond`` gathers
        before it."""
        return self.record or bool(self.anchors) or bool(self.kept)

    def _marks_stage(self, eqn: Any, invals: list[Any]) -> bool:
        """Whether ``eqn`` makes a value every device of a pipeline stage shares: a stage
        unit's first/last-stage predicate (:data:`jzero.rewrite.trace.STAGE_MARK`), or a
        cast of one (``lax.cond`` casts its predicate to the branch index)."""
        name = eqn.primitive.name
        if name == "name" and eqn.params.get("name") == STAGE_MARK:
            return True
        return name == "convert_element_type" and bool(invals) and id(invals[0]) in self._by_stage

    def _cond(self, eqn: Any, invals: list[Any]) -> list[Any]:
        """A ``cond`` or ``switch`` reading pending parameters: each branch replayed with them
        pending, so a parameter is gathered only in the branch that runs (a pipeline's head
        on its last stage). Only for an index every device of a stage shares (a stage
        unit's predicate, :meth:`_marks_stage`): the devices a gather spans, a stage's data
        group, then take the same branch. A ``cond`` on anything else (a value of the batch,
        which differs across the group) gathers before it, as any use does. With ``reshard``
        each branch is checkpointed, as a use's custom derivative is: its backward pass
        gathers again and recomputes the branch, so what it keeps is its inputs (measured on
        a pipelined GPT at stage 3: keeping the head's logits instead grew the step's
        temporaries by 10%), and each weight is gathered once each way."""
        index, ops = invals[0], invals[1:]
        pend = [i for i, x in enumerate(ops) if isinstance(x, Pending)]
        others = [None if isinstance(x, Pending) else x for x in ops]

        def branch(closed: Any) -> Callable[[list[Any], list[Any]], list[Any]]:
            def run(shards: list[Any], others: list[Any]) -> list[Any]:
                vals = list(others)
                for i, shard in zip(pend, shards, strict=True):
                    vals[i] = dataclasses.replace(ops[i], shard=shard)
                return self.run(closed.jaxpr, closed.consts, vals)

            return run

        shards = [ops[i].shard for i in pend]
        branches = [branch(b) for b in eqn.params["branches"]]
        if not self.reshard:
            return jax.lax.switch(index, branches, shards, others)
        # As a use outside a branch keeps nothing gathered for the backward pass: the branch is
        # checkpointed, and inside it a use gathers plainly (the recomputation gathers again,
        # so each weight is gathered once forward and once backward, as elsewhere).
        self.reshard = False
        try:
            return jax.lax.switch(index, [jax.checkpoint(b) for b in branches], shards, others)
        finally:
            self.reshard = True

    def _use(self, eqn: Any, invals: list[Any]) -> list[Any]:
        """A use of pending parameters outside a scan: gathered there, and again in the
        backward pass (see the module's decisions), unless the leaf is kept (reuse distance).

        The forward gather waits for one element of this use's operands, or of an earlier
        use's when prefetch lets it start there (``anchors``)."""
        j = len(self._firsts)
        operands = [x for x in invals if not isinstance(x, Pending)]
        # Only prefetch ties a gather to an earlier use's operand: without it, no element is
        # taken (the op would be traced on every use for nothing).
        self._firsts.append(first_element(operands) if self.anchors else None)
        if self.record:
            leaves = {x.index: x.numel(self.shards) for x in invals if isinstance(x, Pending)}
            self.events.append(GatherEvent(leaves, "use", max(leaves.values())))
            return bind(eqn, [self.materialize(x) for x in invals])
        invals = list(invals)
        for i, x in enumerate(invals):
            if isinstance(x, Pending) and x.index in self.kept:  # gathered once, kept
                if x.key not in self._kept_values:
                    self._kept_values[x.key] = self.materialize(x, operands)
                invals[i] = self._kept_values[x.key]
        if not self.reshard:  # the gathered value is kept for the backward pass
            return bind(eqn, [self.materialize(x) for x in invals])
        pending = [i for i, x in enumerate(invals) if isinstance(x, Pending)]
        if not pending:
            return bind(eqn, invals)
        others = [None if isinstance(x, Pending) else x for x in invals]
        early = self.anchors[j] if j < len(self.anchors) else j
        ahead = [self._firsts[early]] if early < j and self._firsts[early] is not None else []
        axis_name, grad_dtype = self.axis_name, self.grad_dtype

        def run(shards: list[Any], others: list[Any], anchor: Any) -> list[Any]:
            vals = list(others)
            for i, shard in zip(pending, shards, strict=True):
                vals[i] = invals[i].gather(axis_name, grad_dtype, shard=tied(shard, anchor))
            return bind(eqn, vals)

        @jax.custom_vjp
        def use(shards: list[Any], others: list[Any], ahead: list[Any]) -> list[Any]:
            return run(shards, others, ahead or others)

        def fwd(shards: list[Any], others: list[Any], ahead: list[Any]) -> tuple[list[Any], Any]:
            # The residuals are the shards, not the gathered values.
            return use(shards, others, ahead), (shards, others, ahead)

        def bwd(res: Any, cts: list[Any]) -> tuple[Any, Any, Any]:
            shards, others, ahead = res
            d_shards, d_others = jax.vjp(lambda sh, ot: run(sh, ot, cts), shards, others)[1](cts)
            return d_shards, d_others, [jax.numpy.zeros_like(a) for a in ahead]

        use.defvjp(fwd, bwd)
        return use([invals[i].shard for i in pending], others, ahead)

    def _overlapped(
        self,
        eqn: Any,
        consts: list[Any],
        init: list[Any],
        xs: list[Any],
        pending: list[Any],
        policy: Any,
    ) -> list[Any]:
        """A scan that gathers weights, with each layer's gathers one iteration ahead (forward
        and backward) and each layer's reduce-scatter beside the next layer's backward pass
        (:func:`jzero.rewrite.overlap.overlapped_scan`); the same values and gradients."""
        p = eqn.params
        axis_name, grad_dtype = self.axis_name, self.grad_dtype

        def fetch(pend: Any) -> Callable[[Any], Any] | None:
            if pend is None:
                return None
            return lambda shard: pend.gather(axis_name, grad_dtype, shard=shard, dim=pend.dim - 1)

        carry, ys = overlapped_scan(
            _layer_fn(p["jaxpr"], p["num_carry"]),
            [fetch(x) for x in pending],
            consts,
            init,
            xs,
            p["length"],
            policy,
        )
        return [*carry, *ys]

    def _body_policy(self, gathers: bool) -> Any:
        """The ``jax.checkpoint`` policy of a scan body (None: not checkpointed)."""
        if self.policy is None:
            return remat_save_policy if gathers else None
        if self.policy.active or gathers:
            # ``none`` with gathered weights is checkpointed too: its policy keeps every tagged
            # activation (see ``tag`` in :meth:`_scan`) and re-gathers the weights.
            return self.policy.jax_policy()
        return None

    def _scan(self, eqn: Any, invals: list[Any]) -> list[Any]:
        """A scan with pending operands (gathered in its body) or one the policy checkpoints."""
        p = eqn.params
        if self.record:
            leaves = {x.index: x.numel(self.shards) for x in invals if isinstance(x, Pending)}
            if leaves:
                self.events.append(GatherEvent(leaves, "scan", max(leaves.values()) // p["length"]))
            return bind(eqn, [self.materialize(x) for x in invals])
        num_consts, num_carry = p["num_consts"], p["num_carry"]
        consts = [self.materialize(x) for x in invals[:num_consts]]
        init = [self.materialize(x) for x in invals[num_consts : num_consts + num_carry]]
        xs = invals[num_consts + num_carry :]
        # A pending operand scanned over its sharded dim can't be gathered per slice.
        xs = [x if not isinstance(x, Pending) or x.dim != 0 else self.materialize(x) for x in xs]
        gathers = any(isinstance(x, Pending) for x in xs)
        # Stage 2: a whole parameter scanned over its layers is read one layer at a time, and
        # each layer's gradient reduce-scattered in the backward loop.
        scatters = [x if isinstance(x, Scattered) else None for x in xs]
        policy = self._body_policy(gathers)
        if policy is None and not any(scatters):
            return bind(eqn, [*consts, *init, *xs])
        body_closed = p["jaxpr"]
        pending = [x if isinstance(x, Pending) else None for x in xs]
        xs_vals = [
            x.shard if isinstance(x, Pending) else (x.whole, x.stand_in) if s is not None else x
            for x, s in zip(xs, scatters, strict=True)
        ]
        axis_name, grad_dtype = self.axis_name, self.grad_dtype
        offload = self.policy is not None and self.policy.offload
        tag = gathers and self.policy is not None and not self.policy.active
        keep = gathers and not self.reshard
        if keep:  # the gathered weights are saved for the backward pass as well
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names(GATHERED)
            )
        part = self.partition
        if part is not None and not offload:  # the layer's input is saved as a slice
            policy = jax.checkpoint_policies.save_from_both_policies(
                policy, jax.checkpoint_policies.save_only_these_names(PARTITIONED)
            )
        num_xs = len(xs)
        if (
            self.overlap
            and gathers
            and not (tag or keep or offload or part is not None or p["reverse"])
            and not any(scatters)
            and can_overlap(init, body_closed.out_avals[num_carry:], p["length"])
        ):  # overlap_comm: each layer's weights gathered one iteration ahead
            return self._overlapped(eqn, consts, init, xs_vals, pending, policy)

        def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            if part is not None:  # saved split over the model axes, used whole
                name = LAYER_INPUT if offload else PARTITIONED
                carry = [part.join(named(part.split(c), name)) for c in carry]
            elif offload:  # the layer's input, kept in host memory
                carry = [named(c, LAYER_INPUT) for c in carry]
            x = [
                xi if p is None else p.gather(axis_name, grad_dtype, shard=xi, dim=p.dim - 1)
                for xi, p in zip(x, pending, strict=True)
            ]
            x = [
                xi if s is None else s.take(grad_dtype, *xi)
                for xi, s in zip(x, scatters, strict=True)
            ]
            if keep:
                x = [
                    xi if p is None else named(xi, GATHERED)
                    for xi, p in zip(x, pending, strict=True)
                ]
            args = [*consts, *carry, *x]
            if tag:
                live = [False] * num_consts + [True] * num_carry + [False] * num_xs
                outs = eval_tagged(body_closed.jaxpr, body_closed.consts, args, live)
            else:
                outs = jax.core.eval_jaxpr(body_closed.jaxpr, body_closed.consts, *args)
            return list(outs[:num_carry]), list(outs[num_carry:])

        if policy is not None:
            body = jax.checkpoint(body, policy=policy)
        carry, ys = jax.lax.scan(
            body,
            init,
            xs_vals,
            length=p["length"],
            reverse=p["reverse"],
            unroll=p["unroll"],
        )
        return [*carry, *ys]


def _layer_fn(closed: Any, num_carry: int) -> Callable[..., Any]:
    """A scan body as ``layer(carry, x, consts) -> (carry, ys)``."""

    def layer(carry: list[Any], x: list[Any], consts: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *consts, *carry, *x)
        return list(outs[:num_carry]), list(outs[num_carry:])

    return layer
