"""What a :class:`~jzero.plan.Plan` costs and how it reads: bytes per device and the table
:func:`describe` prints (stage 3's largest gather is ZeRO's step part's:
:func:`jzero.parallel.zero.largest_gathered`).

Decisions:

* The report is functions of a plan, not methods on it: the plan is the shardings, the leaves
  and the options; what is counted or printed from them lives here, read by the engine
  (``engine.describe()``), the memory report, the auto stage, the CLI and the benchmarks.
* Bytes are counted from the shardings' shard shapes (``NamedSharding.shard_shape``), so an
  uneven or replicated leaf is counted as it is laid out; params in the compute dtype,
  gradients in the accumulator dtype when micro-batches are accumulated. State in host memory
  (offloaded) is counted apart from state in device memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jzero.plan.memory_kinds import is_host
from jzero.plan.options import CommOptions
from jzero.plan.plan import Plan

__all__ = ["describe", "host_state_bytes", "model_state_bytes"]

PyTree = Any


def _per_device_bytes(tree: PyTree, shardings: PyTree) -> int:
    """Bytes one device holds of ``tree`` (abstract or concrete) laid out by ``shardings``."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        shard = s.shard_shape(tuple(x.shape))
        total += int(math.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def _state_trees(plan: Plan, accumulation_steps: int) -> list[tuple[str, PyTree, PyTree]]:
    """(category, abstract tree, shardings) of everything a device keeps for training."""
    precision = plan.options.precision
    grad_acc = plan.grads if plan.stage.shard_grads else plan.params_replicated()
    dtypes = jax.tree.leaves(plan.compute_params)
    if accumulation_steps > 1:
        dtypes = [
            jax.ShapeDtypeStruct((), precision.accumulator(x.dtype))
            for x in jax.tree.leaves(plan.abstract_params)
        ]
    treedef = jax.tree.structure(plan.abstract_params)
    grads = treedef.unflatten(
        [
            jax.ShapeDtypeStruct(leaf.stored_shape(plan.stage.shard_grads), d.dtype)
            for leaf, d in zip(plan.leaves, dtypes, strict=True)
        ]
    )
    parts = [("params", plan.stored_params, plan.params), ("grads", grads, grad_acc)]
    if precision.mixed:
        parts.append(("master_params", plan.stored_update, plan.master))
    parts.append(("opt_state", plan.stored_opt(), plan.opt_state))
    return parts


def _bytes_where(plan: Plan, host: bool, accumulation_steps: int) -> dict[str, int]:
    out = {}
    for name, tree, shardings in _state_trees(plan, accumulation_steps):
        pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
        kept = [(x, s) for x, s in pairs if is_host(s) == host]
        out[name] = _per_device_bytes([x for x, _ in kept], [s for _, s in kept])
    return out


def model_state_bytes(plan: Plan, accumulation_steps: int = 1) -> dict[str, int]:
    """Per-device bytes in *device* memory of params, gradients, master weights (mixed
    precision only) and optimizer state.

    Params are counted in the compute dtype. The gradient is full-size at stages 0-1 and one
    shard at stages 2-3, in the compute dtype, or in the accumulator dtype when
    ``accumulation_steps > 1``. Offloaded state is counted by :func:`host_state_bytes`.
    """
    return _bytes_where(plan, False, accumulation_steps)


def host_state_bytes(plan: Plan, accumulation_steps: int = 1) -> dict[str, int]:
    """Per-device bytes in *host* memory (offloaded), with the keys of
    :func:`model_state_bytes`."""
    return _bytes_where(plan, True, accumulation_steps)


def _token_split(plan: Plan) -> str:
    """The line naming how each row's tokens are split: ring attention over ``context``,
    Ulysses over ``seq``, or both."""
    par = plan.options.parallel
    parts = []
    if par.context_axis:
        parts.append(
            f"{par.context_axis!r} ({plan.context_size} devices, ring attention: two zig-zag "
            f"chunks of {2 * plan.context_size} each)"
        )
    if par.seq_axis:
        parts.append(f"{par.seq_axis!r} ({plan.seq_size} devices, Ulysses: contiguous)")
    return (
        f"tokens: each row's split over {' then '.join(parts)}; these devices share the rows "
        f"and ZeRO shards over them too"
    )


def describe(plan: Plan) -> str:
    """A table of every leaf: shape, spec per category, per-device bytes, what stayed whole;
    above it the stage, the mesh and the other parallelisms, below it the bytes per device,
    the precision, the communication options, the padding and the leaves left whole."""
    zero, comm, par = plan.options.zero, plan.options.comm, plan.options.parallel
    n = plan.num_shards
    tp_rules = tuple(par.tp_rules or ())
    rules = tp_rules or ("",) * len(plan.leaves)
    rows = [("leaf", "shape", "dtype", "params", "grads", "opt state", "bytes/device")]
    if tp_rules:
        rows[0] += ("tensor parallel",)
    flat_p = jax.tree.leaves(plan.params)
    flat_g = jax.tree.leaves(plan.grads)
    flat_c = jax.tree.leaves(plan.compute_params)
    for leaf, sp, sg, c, rule in zip(plan.leaves, flat_p, flat_g, flat_c, rules, strict=True):
        nbytes = math.prod(sp.shard_shape(leaf.param_shape)) * np.dtype(c.dtype).itemsize
        shape = "x".join(map(str, leaf.shape)) or "()"
        if leaf.padding:
            shape += f" (+{leaf.padding} on dim {leaf.state_dim})"
        rows.append(
            (
                leaf.path,
                shape,
                np.dtype(c.dtype).name,
                str(tuple(sp.spec)) + (" host" if is_host(sp) else ""),
                str(tuple(sg.spec)),
                str(tuple(sg.spec)) if plan.stage.shard_opt_state else "()",
                f"{nbytes:,}",
            )
            + ((rule,) if tp_rules else ())
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"ZeRO stage {plan.stage.stage} ({plan.stage.description}) over "
        f"{' x '.join(plan.zero_axes)}={n} of mesh {dict(plan.mesh.shape)}",
    ]
    if plan.replica_axis:
        lines.append(
            f"hybrid: {plan.num_replicas} replicas; "
            + (
                f"hpZ: gradients and optimizer state over replica x data "
                f"({plan.state_shards} shards), params at rest over data ({n} shards)"
                if zero.hpz
                else "every shard replicated across the replica axis, gradient shards "
                "all-reduced over it"
            )
        )
    if par.pipe_axis:
        split = sum(plan.pipelined)
        lines.append(
            f"pipeline: {plan.pipe_size} stages over {par.pipe_axis!r}, schedule "
            f"{par.pipe_schedule}"
            + (f" ({par.pipe_virtual} chunks of layers per stage)" if par.pipe_virtual > 1 else "")
            + "; "
            + (
                f"{split} stacked-layer leaves split into consecutive layers per stage, "
                + (
                    "each stage's rows its chunks in turn (the model's s, P + s, ...), "
                    if par.pipe_virtual > 1
                    else ""
                )  # fmt: skip
                + "the rest whole on every stage"
                if plan.layers_traced
                else "the layer scan's leaves are split when the loss is first traced"
            )
        )
    if par.expert_axis:
        experts = [leaf.path for leaf, e in zip(plan.leaves, plan.experts, strict=True) if e]
        others = "x".join(a for a in plan.zero_axes if a != par.expert_axis)
        lines.append(
            f"experts: {len(experts)} expert leaves split over {par.expert_axis!r} "
            f"({plan.expert_size} devices, each holding its share of the experts), ZeRO over "
            f"{others or 'no other axis'} for them, over all of "
            f"{'x'.join(plan.zero_axes)} for the rest: " + ", ".join(experts)
        )
    if par.seq_axis or par.context_axis:
        lines.append(_token_split(plan))
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        "each leaf is sharded on its leading dimension (contiguous shards), padded with "
        "zeros to a multiple of the shard count where that does not divide it (+N)"
        + (
            "; a stacked-layer dimension a scan consumes stays whole, so each layer is "
            "gathered on its own"
            if plan.stage.shard_params and any(d is not None for d in plan.layer_dims)
            else ""
        )
    )
    for where, totals in (
        ("device", model_state_bytes(plan)),
        ("host", host_state_bytes(plan)),
    ):
        if where == "host" and not any(totals.values()):
            continue
        lines.append(
            f"per-device model state in {where} memory: "
            + ", ".join(f"{k} {v:,} B" for k, v in totals.items())
            + f", total {sum(totals.values()):,} B"
        )
    if plan.options.precision.mixed:
        lines.append(
            f"mixed precision: compute {np.dtype(plan.options.precision.compute_dtype).name}, "
            "float32 master weights laid out with the optimizer state"
        )
    lines.extend(_communication(comm))
    padded = [leaf for leaf in plan.leaves if leaf.padding]
    if padded:
        extra = sum(
            leaf.padding * math.prod(leaf.shape) // leaf.shape[leaf.state_dim] for leaf in padded
        )
        lines.append(
            f"padding: {len(padded)} leaves rest padded, {extra:,} zero elements in all "
            f"({extra / max(1, sum(math.prod(x.shape) for x in plan.leaves)):.2%} of the "
            "parameters), never read by the loss, the norms or the update"
        )
    if tp_rules:
        model = {a: n for a, n in plan.mesh.shape.items() if a == "model"}
        lines.append(
            f"tensor parallel (AutoTP) over {model}: Megatron's column, row and vocabulary "
            "splits; ZeRO shards a dimension the model axis leaves free"
        )
        lines.extend(_split_by(plan, rules))
        loose = [leaf.path for leaf, r in zip(plan.leaves, rules, strict=True)
                 if r.startswith("no rule")]  # fmt: skip
        if loose:
            lines.append(
                f"leaves no tensor-parallel rule matched, replicated over model "
                f"({len(loose)}; give them a tensor_parallel.tp_plan entry to split them): "
                + ", ".join(loose)
            )
    whole = [leaf for leaf in plan.leaves if leaf.note]
    if whole:
        lines.append("leaves ZeRO left whole on every device:")
        lines.extend(f"  {leaf.path}: {leaf.note}" for leaf in whole)
    return "\n".join(lines)


def _split_by(plan: Plan, rules: Sequence[str]) -> list[str]:
    """One line per way AutoTP split leaves over ``model``: by name, from the program, by the
    ``tp_plan`` or the user's own annotation, each with the leaves it split."""
    methods: dict[str, list[str]] = {}
    for leaf, rule, spec in zip(plan.leaves, rules, plan.base_specs or (), strict=False):
        if "model" not in str(tuple(spec)):
            continue
        how = (
            "tp_plan" if rule.startswith("tp_plan")
            else "your annotation" if rule == "your annotation"
            else "from the program" if "(from the program)" in rule
            else "by name"
        )  # fmt: skip
        methods.setdefault(how, []).append(leaf.path)
    return [
        f"  split {how} ({len(paths)}): {', '.join(paths)}"
        for how in ("by name", "from the program", "tp_plan", "your annotation")
        if (paths := methods.get(how))
    ]


def _communication(comm: CommOptions) -> list[str]:
    """The ``communication:`` line for the collectives' options in effect (none: no line)."""
    parts = []
    if comm.overlap_comm:
        parts.append("overlap_comm")
    for name, size in (
        ("reduce", comm.reduce_bucket_size),
        ("all-gather", comm.allgather_bucket_size),
    ):
        if size is not None:
            parts.append(f"{name} buckets of {size:,} elements")
    if comm.quantized_weights:
        parts.append(f"ZeRO++ qwZ: int{comm.quantized_weights} parameter gathers")
    if comm.quantized_gradients:
        parts.append(f"ZeRO++ qgZ: int{comm.quantized_gradients} gradient reduce-scatters")
    return ["communication: " + ", ".join(parts)] if parts else []
