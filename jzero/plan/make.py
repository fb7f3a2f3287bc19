"""The sharding plan: one ``NamedSharding`` per leaf of params, gradients, optimizer state, batch.

:func:`make_plan` builds the :class:`Plan` (:mod:`jzero.plan.plan`) from the leaf rule (ZeRO's,
:mod:`jzero.parallel.zero.leaf_rule`: which dimension of each leaf is sharded) and the host-memory
choice (:mod:`jzero.plan.memory_kinds`: which leaves rest in host memory); the leaf rule's public
names are importable from :mod:`jzero.parallel.zero`, the others' from :mod:`jzero.plan`.

Decisions:

* What the plan is told beyond the params, the optimizer, the mesh and the stage is one typed
  value, :class:`~jzero.plan.options.PlanOptions` (made from a config by
  :mod:`jzero.engine.settings`; by hand, ``PlanOptions().replace(persistence_threshold=0)``
  sets fields by name). What only the loss's trace knows (``layer_dims``, ``pipe_leaves``) is
  passed beside it.
* The plan is computed from abstract values only (``jax.ShapeDtypeStruct``), so it exists before
  any parameter is allocated and works for meshes larger than the machine (an abstract mesh).
* Leaf rule: each leaf is sharded on its leading dimension, padded to a multiple of the shard
  count where that does not divide it (:mod:`jzero.plan.padding`), a stacked-layer dimension a
  ``scan`` consumes stays whole at stage 3, small parameters persist whole at stage 3, and a
  user's own ``PartitionSpec`` is kept (see :mod:`jzero.parallel.zero.leaf_rule` for the reasons).
* Optimizer-state shardings come from ``optax.tree_map_params``, so any optax chain works,
  and every state leaf rests in the layout its update computes it in (no resharding of the
  state in the step): a parameter's mirror (Adam's moments) exactly as the parameter's
  gradient; a state leaf of its own shape (8-bit Adam's block scales, factored moments) keeps
  the parameter's own axes (``expert``, ``model``, ``pipe``) on the leading dimensions it
  shares with it and is split over the remaining state axes on the parameter's state
  dimension (else a dimension they divide, else whole); non-parameter state (counts) is
  replicated. Mirrors rest padded like their parameter (``Plan.stored_opt_state``). An expert
  leaf's scales resting over ``data`` x ``expert`` (the dense layout) while its moments
  computed over ``expert`` then ``data`` made XLA reshard the experts' state every step.
* The stage decides which category is sharded by reading :mod:`jzero.plan.stages`; nothing here
  branches on the stage number.
* Hybrid sharding (a ``replica`` axis beside ``data``, FSDP's HSDP and DeepSpeed's MiCS): the
  batch is split over both axes, and every sharded category is sharded over ``data`` only and
  replicated over ``replica``. ZeRO++'s hierarchical partition (``hpz``) instead shards the
  gradients and optimizer state over ``replica`` x ``data`` (all devices) and keeps the
  parameters at rest sharded over ``data`` only, the secondary copy that stage 3's gathers
  read within a host. A state leaf is then sharded over ``("data", "replica")`` on one
  dimension: each ``data`` shard is split again into ``replica`` pieces, which is the layout a
  reduce-scatter over ``data`` followed by one over ``replica`` leaves.
* A mesh axis of more than one device that is neither ``data``, ``replica`` nor named by any
  parameter's partition spec would make its devices compute the same rows: an error.
* The options ride in the plan as the grouped values they came in (``plan.options.comm``,
  ``plan.options.zero``, ...), so the step and the replay read them from one place and no field
  copies them; ``make_plan`` refuses the quantization a stage has no collective for, and keeps
  bucket sizes only where the step's own reductions use them (stages 0-2 with
  ``overlap_comm``): the plan's options are those in effect.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero._util import divisors, dotted, under_trace
from jzero.choices.stages import StageSpec, check_offload, stage_spec
from jzero.distributed import DATA_AXIS, REPLICA_AXIS
from jzero.parallel.zero.leaf_rule import (
    axis_entry,
    divisible_dim,
    leaf_plan,
    spec_axis_names,
    spec_with,
)
from jzero.plan.memory_kinds import (
    offloaded_leaves,
    with_kind,
)
from jzero.plan.options import CommOptions, ParallelOptions, PlanOptions, ZeroOptions
from jzero.plan.plan import Plan
from jzero.plan.precision import cast_floating

__all__ = ["make_plan"]

PyTree = Any


def _path_str(path: Any) -> str:
    return dotted(path) or "<root>"


def _nbytes(x: Any) -> int:
    return int(math.prod(x.shape)) * np.dtype(x.dtype).itemsize


def make_plan(
    abstract_params: PyTree,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    stage: int | StageSpec,
    options: PlanOptions | None = None,
    *,
    layer_dims: Sequence[int | None] | None = None,
    pipe_leaves: Sequence[bool] | None = None,
) -> Plan:
    """Derives the sharding plan for a stage from abstract params, an optax transform and a mesh.

    Args:
      abstract_params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (only shapes are read).
      optimizer: the optax transformation whose state is to be sharded.
      mesh: the device mesh; the options' ``axis`` must be one of its axes.
      stage: a ZeRO stage (0-3) or its :class:`~jzero.choices.stages.StageSpec`.
      options: the :class:`~jzero.plan.options.PlanOptions` (ZeRO's settings, the collectives',
        the other parallelisms' layout, the precision); ``None``: the defaults.
      layer_dims: per leaf (``jax.tree.leaves`` order), the stacked-layer dimension a ``scan``
        consumes, or ``None``; from :func:`jzero.rewrite.gather.layer_dims`. Stage 3 never
        shards it.
      pipe_leaves: per leaf, whether the loss's layer scan consumes it
        (:func:`jzero.parallel.pipeline.split_at_layers`): its stacked dimension is split over the
        options' ``pipe_axis`` (the stages' layers); ``None`` before the loss was traced.

    Returns:
      The :class:`Plan`.
    """
    options = options if options is not None else PlanOptions()
    zero, comm, par, precision = options.zero, options.comm, options.parallel, options.precision
    spec = stage if isinstance(stage, StageSpec) else stage_spec(stage)
    if zero.offload_optimizer is not None:
        check_offload(spec, "optimizer")
    if zero.offload_params is not None:
        check_offload(spec, "optimizer+params")
    zero_axes = _zero_axes(mesh, par)
    abstract_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), abstract_params
    )
    if precision.mixed:  # the master weights are float32 whatever the user's params were
        abstract_params = cast_floating(abstract_params, jnp.float32)
    elif precision.low_precision_masters:  # the params are the masters, in their 16-bit dtype
        abstract_params = cast_floating(abstract_params, precision.master_dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    bases = _spec_bases(flat, treedef, mesh, par.param_specs, zero_axes)
    traced = layer_dims is not None
    layer_dims = tuple(layer_dims) if traced else (None,) * len(flat)
    if len(layer_dims) != len(flat):
        raise ValueError(
            f"layer_dims has {len(layer_dims)} entries but the params have {len(flat)} leaves; "
            "pass one stacked-layer dimension (or None) per leaf."
        )
    bases = _parallel_bases(flat, bases, mesh, par, zero_axes, pipe_leaves, layer_dims)
    replica = REPLICA_AXIS if REPLICA_AXIS in mesh.shape else None
    if zero.hpz and (replica is None or not spec.shard_params):
        raise ValueError(
            "zero_hpz_partition_size (ZeRO++ hpZ) needs stage 3 and a mesh with a "
            f"{REPLICA_AXIS!r} axis (the hosts) beside {par.axis!r} (one host's devices); got "
            f"stage {spec.stage} and mesh {dict(mesh.shape)}. Set zero_optimization.stage to "
            "3, or zero_hpz_partition_size to 1."
        )
    hpz = bool(zero.hpz)
    _check_comm(spec, comm)
    buckets = bool(comm.overlap_comm) and not spec.shard_params
    state_axes = (*zero_axes, replica) if hpz else zero_axes

    def shards(b: P) -> int:  # a leaf's ZeRO shard count: over the state axes its spec leaves
        own = spec_axis_names(b)
        return math.prod(int(mesh.shape[a]) for a in state_axes if a not in own)

    leaves = tuple(
        leaf_plan(_path_str(path), x, b, shards(b), spec, zero.persistence_threshold, ld,
                   zero.padding)
        for (path, x), b, ld in zip(flat, bases, layer_dims, strict=True)
    )  # fmt: skip

    def shardings(dims: list[int | None], axes: tuple[str, ...] = zero_axes) -> PyTree:
        return treedef.unflatten(
            [
                NamedSharding(mesh, spec_with(b, len(leaf.shape), d, axes))
                for leaf, b, d in zip(leaves, bases, dims, strict=True)
            ]
        )

    state_dims = [leaf.state_dim for leaf in leaves]
    params_sh = with_kind(shardings([leaf.param_dim for leaf in leaves]), zero.offload_params)
    update_sh = shardings(state_dims, state_axes)
    grads_sh = update_sh if spec.reduce_scatter else shardings([None] * len(leaves))
    replicated = NamedSharding(mesh, P())

    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)

    def fit(state_leaf: Any, sharding: NamedSharding, index: int) -> Any:
        if isinstance(state_leaf, optax.MaskedNode):  # a leaf the mask leaves out: no state
            return state_leaf
        if tuple(state_leaf.shape) == leaves[index].shape:
            return sharding
        # A state leaf of its own shape (8-bit Adam's scales, a factored moment) rests where its
        # update computes it, from its parameter's layout.
        shape, leaf = tuple(state_leaf.shape), leaves[index]
        axes = state_axes if spec.shard_opt_state else ()
        return NamedSharding(mesh, _own_shape_spec(shape, leaf, bases[index], mesh, axes))

    def stored(state_leaf: Any, _: Any, index: int) -> Any:
        """The state leaf as it rests: a parameter's mirror padded like the parameter's
        gradient and master."""
        if isinstance(state_leaf, optax.MaskedNode) or not hasattr(state_leaf, "shape"):
            return state_leaf
        if tuple(state_leaf.shape) != leaves[index].shape:
            return state_leaf
        return jax.ShapeDtypeStruct(leaves[index].stored_shape(), state_leaf.dtype)

    def per_state_leaf(fn: Any, non_params: Any) -> PyTree:
        """``fn(state leaf, its parameter's update sharding, its parameter's index)`` over the
        optimizer state (``non_params`` on state that mirrors no parameter)."""
        return under_trace(  # optax initialises on placeholders eagerly: compile nothing
            lambda: optax.tree_map_params(
                optimizer,
                fn,
                abstract_opt_state,
                update_sh,
                treedef.unflatten(list(range(len(leaves)))),
                transform_non_params=non_params,
                is_leaf=lambda x: isinstance(x, optax.MaskedNode),
            )
        )

    opt_sh = per_state_leaf(fit, lambda _: replicated)
    stored_opt_state = per_state_leaf(stored, lambda x: x)
    # Any leaf that is not an array (e.g. optax's MaskedNode) needs no sharding; keep structure.
    opt_sh = jax.tree.map(
        lambda s, x: s if hasattr(x, "shape") else replicated,
        opt_sh,
        abstract_opt_state,
    )
    opt_sh, master_sh = _offloaded_state(
        zero, leaves, opt_sh, update_sh, optimizer, abstract_params, abstract_opt_state, treedef
    )
    # The batch's rows are split over every batch axis but seq and context (whose devices
    # share rows).
    shared = (par.seq_axis, par.context_axis)
    row_axes = tuple(a for a in ((replica,) if replica else ()) + zero_axes if a not in shared)
    applied = dataclasses.replace(
        options,
        zero=dataclasses.replace(
            zero,
            reshard_after_forward=bool(zero.reshard_after_forward),
            prefetch_bucket_size=int(zero.prefetch_bucket_size),
            hpz=hpz,
        ),
        # Buckets group the step's own reductions and gathers: stages 0-2, with overlap_comm.
        comm=CommOptions(
            overlap_comm=bool(comm.overlap_comm),
            reduce_bucket_size=comm.reduce_bucket_size if buckets else None,
            allgather_bucket_size=comm.allgather_bucket_size if buckets else None,
            quantized_weights=int(comm.quantized_weights),
            quantized_gradients=int(comm.quantized_gradients),
        ),
        parallel=dataclasses.replace(par, tp_rules=tuple(par.tp_rules or ())),
    )
    return Plan(
        stage=spec,
        mesh=mesh,
        abstract_params=abstract_params,
        leaves=leaves,
        params=params_sh,
        grads=grads_sh,
        update_layout=update_sh,
        abstract_opt_state=abstract_opt_state,
        opt_state=opt_sh,
        stored_opt_state=stored_opt_state,
        batch=NamedSharding(mesh, P(axis_entry(row_axes))),
        replicated=replicated,
        options=applied,
        master=master_sh if precision.mixed else None,
        base_specs=bases,
        layers_traced=traced,
    )


def _zero_axes(mesh: Mesh, par: ParallelOptions) -> tuple[str, ...]:
    """The axes ZeRO shards over, each one of the mesh's; the sequence and context axes
    among them."""
    zero_axes = (par.axis,) if isinstance(par.axis, str) else tuple(par.axis)
    for name in zero_axes:
        if name not in mesh.shape:
            raise ValueError(
                f"The mesh has no axis {name!r}; its axes are {list(mesh.shape)}. "
                f"Build the mesh with jzero.make_mesh or name its data-parallel axis {name!r}."
            )
    for field, name in (("seq_axis", par.seq_axis), ("context_axis", par.context_axis)):
        if name is not None and name not in zero_axes:
            raise ValueError(
                f"{field} {name!r} must be one of the axes ZeRO shards over {zero_axes}."
            )
    return zero_axes


def _spec_bases(
    flat: Sequence[tuple[Any, Any]],
    treedef: Any,
    mesh: Mesh,
    param_specs: PyTree | None,
    zero_axes: tuple[str, ...],
) -> tuple[P, ...]:
    """Each leaf's own partition spec (``P()`` without ``param_specs``), checked against the
    mesh and the axes ZeRO places itself."""
    if param_specs is None:
        return tuple(P() for _ in flat)
    bases = tuple(treedef.flatten_up_to(param_specs))
    for (path, _), b in zip(flat, bases, strict=True):
        missing = [a for a in jax.tree.leaves(tuple(b)) if a not in mesh.shape]
        if missing:
            raise ValueError(
                f"The partition spec {b} of {_path_str(path)} names mesh axes {missing}, but "
                f"the mesh has {list(mesh.shape)}. Add them to the config's mesh section "
                f"(e.g. mesh: {{data: -1, {missing[0]}: 2}}) or remove them from the "
                "annotation."
            )
        taken = [a for a in zero_axes if a in jax.tree.leaves(tuple(b))]
        if taken:
            raise ValueError(
                f"The partition spec {b} of {_path_str(path)} already uses the "
                f"{'data axis' if taken[0] == DATA_AXIS else 'axis'} {taken[0]!r} ZeRO "
                f"shards over; jzero places it itself. Remove {taken[0]!r} from it."
            )
    return bases


def _parallel_bases(
    flat: Sequence[tuple[Any, Any]],
    bases: tuple[P, ...],
    mesh: Mesh,
    par: ParallelOptions,
    zero_axes: tuple[str, ...],
    pipe_leaves: Sequence[bool] | None,
    layer_dims: Sequence[int | None],
) -> tuple[P, ...]:
    """The bases with the pipeline's and the experts' axes added, every mesh axis used."""
    if par.pipe_axis is not None and pipe_leaves is not None:
        stages = int(mesh.shape[par.pipe_axis])
        bases = _on_pipe(flat, bases, pipe_leaves, par.pipe_axis, stages, par.pipe_virtual)
    if par.expert_axis is not None and par.expert_axis not in zero_axes:
        raise ValueError(
            f"expert_axis {par.expert_axis!r} must be one of the axes ZeRO shards over {zero_axes}."
        )
    if par.expert_axis is not None and par.expert_leaves is not None:
        bases = _on_experts(
            flat, bases, par.expert_leaves, par.expert_axis, int(mesh.shape[par.expert_axis]),
            par.num_experts, layer_dims,
        )  # fmt: skip
    waiting = (
        *((par.pipe_axis,) if par.pipe_axis else ()),
        *(("model",) if par.tp_waiting else ()),
    )
    _check_axes_used(mesh, (*zero_axes, *waiting), bases)
    return bases


def _own_shape_spec(
    shape: tuple[int, ...], leaf: Any, base: P, mesh: Mesh, state_axes: tuple[str, ...]
) -> P:
    """The spec of an optimizer-state leaf whose shape is not its parameter's (8-bit Adam's
    block scales ``shape[:-1] + (blocks,)``, a factored moment): the layout its update computes
    it in, from the parameter's. It keeps the parameter's own axes (``expert``, ``model``,
    ``pipe``) on the leading dimensions it shares with the parameter, and goes over the state
    axes the parameter's spec leaves free (``state_axes``; none at stage 0) on the parameter's
    state dimension when it shares that and they divide it, else on its leading dimension they
    divide, else on none (it is small)."""
    common = 0
    while common < min(len(shape), len(leaf.shape)) and shape[common] == leaf.shape[common]:
        common += 1
    entries = [base[d] if d < min(len(base), common) else None for d in range(len(shape))]
    own = spec_axis_names(entries)
    axes = tuple(a for a in state_axes if a not in own)
    count = math.prod(int(mesh.shape[a]) for a in axes)
    free = [e is None for e in entries]
    d = leaf.state_dim
    if d is None or d >= common or leaf.merged > 1 or not free[d] or shape[d] % count:
        d = divisible_dim(shape, count, free)
    return spec_with(P(*entries), len(shape), d, axes)


def _offloaded_state(
    zero: ZeroOptions,
    leaves: Sequence[Any],
    opt_sh: PyTree,
    update_sh: PyTree,
    optimizer: optax.GradientTransformation,
    abstract_params: PyTree,
    abstract_opt_state: PyTree,
    treedef: Any,
) -> tuple[PyTree, PyTree]:
    """The optimizer state's and the masters' shardings with ``offload_optimizer``'s memory
    kind: on every leaf, or at ``offload_ratio`` < 1 on the state and masters of the
    parameter leaves :func:`offloaded_leaves` picks."""
    kind = zero.offload_optimizer
    host_leaves = offloaded_leaves(leaves, zero.offload_ratio)
    if kind is None or len(host_leaves) == len(leaves):
        return with_kind(opt_sh, kind), with_kind(update_sh, kind)
    from jzero.subgroups import param_leaf_owner

    owner = param_leaf_owner(optimizer, abstract_params, abstract_opt_state)
    flat_sh, sh_def = jax.tree.flatten(opt_sh)
    opt_sh = sh_def.unflatten(
        [
            x.with_memory_kind(kind) if o in host_leaves else x
            for x, o in zip(flat_sh, owner, strict=True)
        ]
    )
    master_sh = treedef.unflatten(
        [
            x.with_memory_kind(kind) if i in host_leaves else x
            for i, x in enumerate(jax.tree.leaves(update_sh))
        ]
    )
    return opt_sh, master_sh


def _on_pipe(
    flat: Sequence[tuple[Any, Any]],
    bases: Sequence[P],
    pipe_leaves: Sequence[bool],
    pipe_axis: str,
    stages: int,
    virtual: int = 1,
) -> tuple[P, ...]:
    """The bases with ``pipe_axis`` on the stacked-layer dimension (0) of the leaves the layer
    scan consumes (pipeline parallelism: each stage holds ``L / P`` consecutive layers; under
    interleaving ``virtual`` chunks of ``L / (P V)``)."""
    out = []
    for (path, x), b, piped in zip(flat, bases, pipe_leaves, strict=True):
        if not piped:
            out.append(b)
            continue
        layers = int(x.shape[0])
        if virtual > 1 and layers % (stages * virtual):
            raise ValueError(
                f"pipeline.virtual_stages: {stages} stages of {virtual} chunks each do not "
                f"divide the {layers} layers of {_path_str(path)} (shape {tuple(x.shape)}); "
                f"each chunk holds an equal share. Use stages x virtual_stages among the "
                f"divisors of {layers} ({', '.join(map(str, divisors(layers)))})."
            )
        if layers % stages:
            raise ValueError(
                f"pipeline.stages: {stages} does not divide the {layers} layers of "
                f"{_path_str(path)} (shape {tuple(x.shape)}); each stage holds an equal share of "
                f"consecutive layers. Use a number of stages among the divisors of {layers} "
                f"({', '.join(map(str, divisors(layers)))}), or {layers} layers a multiple of "
                f"{stages}."
            )
        entries = list(b) + [None] * (len(x.shape) - len(b))
        if entries[0] is not None:
            raise ValueError(
                f"The partition spec {b} of {_path_str(path)} splits its stacked-layer dimension "
                f"over {entries[0]!r}, which pipeline parallelism splits over {pipe_axis!r}; "
                "remove that entry."
            )
        entries[0] = pipe_axis
        out.append(P(*entries))
    return tuple(out)


def _on_experts(
    flat: Sequence[tuple[Any, Any]],
    bases: Sequence[P],
    expert_leaves: Sequence[bool],
    expert_axis: str,
    size: int,
    num_experts: int | None,
    layer_dims: Sequence[int | None],
) -> tuple[P, ...]:
    """The bases with ``expert_axis`` on each expert leaf's experts dimension: the first of
    ``num_experts`` elements (any size when ``None``) that is not its stacked-layer one."""
    out = []
    for (path, x), b, expert, ld in zip(flat, bases, expert_leaves, layer_dims, strict=True):
        if not expert:
            out.append(b)
            continue
        shape = tuple(x.shape)
        entries = list(b) + [None] * (len(shape) - len(b))
        dims = [
            d
            for d, m in enumerate(shape)
            if d != ld and entries[d] is None and (num_experts is None or m == num_experts)
        ]
        if not dims:
            raise ValueError(
                f"expert_parallel: {_path_str(path)} (shape {shape}) is an expert parameter but "
                + (
                    f"has no free dimension of num_experts={num_experts} elements"
                    if num_experts is not None
                    else "has no free dimension"
                )
                + " to split over the expert axis; give expert leaves their experts dimension "
                "first (after a stacked-layer one), or leave this leaf out of "
                "expert_parallel.expert_params."
            )
        d = dims[0]
        if shape[d] % size:
            raise ValueError(
                f"expert_parallel.autoep_size: {size} does not divide the {shape[d]} experts of "
                f"{_path_str(path)} (dimension {d} of shape {shape}); each device of the expert "
                f"axis holds an equal share of the experts. Use an autoep_size among the "
                f"divisors of {shape[d]} ({', '.join(map(str, divisors(shape[d])))})."
            )
        entries[d] = expert_axis
        out.append(P(*entries))
    return tuple(out)


def _check_comm(spec: StageSpec, comm: CommOptions) -> None:
    """The bucket sizes and ZeRO++ quantization this stage can use (clear errors otherwise)."""
    quantized_weights, quantized_gradients = comm.quantized_weights, comm.quantized_gradients
    for name, size in (
        ("reduce_bucket_size", comm.reduce_bucket_size),
        ("allgather_bucket_size", comm.allgather_bucket_size),
    ):
        if size is not None and (isinstance(size, bool) or int(size) != size or size < 1):
            raise ValueError(
                f"{name}={size!r} is not a bucket size; pass a number of elements >= 1, or None "
                "for one collective per leaf."
            )
    for name, bits in (
        ("quantized_weights", quantized_weights),
        ("quantized_gradients", quantized_gradients),
    ):
        if bits not in (0, 4, 8):
            raise ValueError(f"{name}={bits!r}: pass 8 or 4 bits a value, or 0 for exact.")
    if quantized_weights and not spec.shard_params:
        raise ValueError(
            f"quantized_weights (ZeRO++ qwZ) quantizes stage 3's parameter all-gathers, but "
            f"stage {spec.stage} keeps parameters whole and gathers none. Use stage 3, or "
            "quantized_weights=0."
        )
    if quantized_gradients and not spec.reduce_scatter:
        raise ValueError(
            f"quantized_gradients (ZeRO++ qgZ) replaces the gradient reduce-scatter, but stage "
            f"{spec.stage} all-reduces its gradients. Use stage 1, 2 or 3, or "
            "quantized_gradients=0."
        )


def _check_axes_used(mesh: Mesh, zero_axes: tuple[str, ...], bases: Sequence[P]) -> None:
    """Refuses a mesh axis of several devices that neither splits the batch (``data``,
    ``replica``) nor any parameter (a partition spec): its devices would compute the same
    rows, a silent multiple of the compute."""
    used = {a for b in bases for a in jax.tree.leaves(tuple(b))}
    axis = zero_axes[0]
    for name, size in mesh.shape.items():
        if size > 1 and name not in (*zero_axes, REPLICA_AXIS) and name not in used:
            raise ValueError(
                f"mesh axis {name!r} ({size} devices) is neither {axis!r}, {REPLICA_AXIS!r} nor "
                "named by any parameter's partition spec, so its devices would all compute the "
                f"same rows ({size}x redundant work). Rename it to {REPLICA_AXIS!r} to replicate "
                f"ZeRO's shards across it (e.g. across hosts), fold it into {axis!r} (mesh: "
                f"{{{axis}: -1}}), or give parameters partition specs over it "
                "(jzero.InitOptions(param_specs=...), nnx.with_partitioning)."
            )
