"""What :func:`jzero.plan.make_plan` is told beyond the params, the optimizer, the mesh and the
stage: typed, frozen values, one per concern.

Decisions:

* The plan's options are values, not a config: :class:`PlanOptions` holds ZeRO's own settings
  (:class:`ZeroOptions`), the collectives' (:class:`CommOptions`), the other parallelisms'
  layout (:class:`ParallelOptions`) and the run's :class:`~jzero.plan.precision.Precision`.
  :mod:`jzero.engine.settings` makes them from a validated config, once; code that builds a
  plan by hand makes them directly, or names the fields it changes:
  ``PlanOptions().replace(persistence_threshold=0)`` sends each name to the group that holds it
  (no two groups share a field name).
* What the loss's trace decides (the stacked-layer dimensions, the leaves a pipeline splits)
  is not an option: ``make_plan`` takes it beside them (``layer_dims=``, ``pipe_leaves=``).
* Nothing here reads a config or validates: the values are checked where they are used
  (``make_plan``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jzero.distributed import DATA_AXIS
from jzero.plan.precision import Precision

__all__ = ["CommOptions", "ParallelOptions", "PlanOptions", "ZeroOptions"]

PyTree = Any


@dataclass(frozen=True)
class ZeroOptions:
    """What ZeRO does beyond its stage's row: persistence, offload, stage 3's gathers.

    Attributes:
      persistence_threshold: stage 3 keeps parameters with fewer elements whole
        (DeepSpeed's ``stage3_param_persistence_threshold``).
      offload_optimizer: a host memory kind (``"pinned_host"``) for the optimizer state and the
        master weights, at stages 1-3 (DeepSpeed's ``offload_optimizer``), or ``None``.
      offload_params: a host memory kind for the parameters at rest, at stage 3 only
        (DeepSpeed's ``offload_param``), or ``None``.
      offload_ratio: the fraction of the optimizer-state bytes offloaded (DeepSpeed's
        ``offload_optimizer.ratio``): the state and masters of whole parameter leaves go to
        host memory, the largest first, each taken when it brings the offloaded bytes closer
        to the fraction; the rest stays in device memory.
      reshard_after_forward: at stage 3, drop each gathered weight after its forward use and
        gather it again in the backward pass (3 Psi of traffic, about one layer live); ``False``
        keeps it until its backward use (2 Psi, all gathered weights live at the peak). FSDP2's
        switch of that name.
      prefetch_bucket_size: at stage 3, how many gathered elements a use's gather may run
        ahead of it (DeepSpeed's ``stage3_prefetch_bucket_size``; 0: at the use).
      max_reuse_distance: at stage 3, a parameter reused within this many elements of other
        gathered parameters is gathered once and kept (DeepSpeed's
        ``stage3_max_reuse_distance``); ``None``: every use gathers.
      max_live_parameters: at stage 3, the cap on gathered elements alive at once (DeepSpeed's
        ``stage3_max_live_parameters``): it bounds what reuse keeps; ``None``: no cap.
      hpz: ZeRO++'s hierarchical partition: gradients and optimizer state are sharded over
        ``replica`` x ``data``, parameters at rest over ``data`` only (the secondary copy);
        needs a ``replica`` axis and a stage that shards parameters. A mesh with a ``replica``
        axis without it is hybrid sharding.
      padding: shard a leaf whose leading dimension the shard count does not divide by padding
        it (:mod:`jzero.plan.padding`); ``False``: no padding, such a leaf is split on a later
        dimension that divides, else stays whole (the NVMe tier's files need it).
    """

    persistence_threshold: int = 100_000
    offload_optimizer: str | None = None
    offload_params: str | None = None
    offload_ratio: float = 1.0
    reshard_after_forward: bool = True
    prefetch_bucket_size: int = 0
    max_reuse_distance: int | None = None
    max_live_parameters: int | None = None
    hpz: bool = False
    padding: bool = True


@dataclass(frozen=True)
class CommOptions:
    """The collectives' options: ``overlap_comm``, its buckets, ZeRO++'s quantization.

    Attributes:
      overlap_comm: DeepSpeed's ``overlap_comm``: stage 3 gathers each scanned layer one
        iteration ahead (:func:`jzero.rewrite.gather.gather_at_use`'s ``overlap``), stages 0-2
        reduce the gradients in buckets (below), and on a GPU the step is compiled with XLA's
        options for asynchronous collectives (:func:`jzero.comm.overlap.compiler_options`).
      reduce_bucket_size: at stages 0-2 with ``overlap_comm``, the most gradient elements one
        reduction carries: consecutive leaves are reduced together up to it (one collective
        per bucket); ``None``: one collective per leaf. The bucket sizes (elements, >= 1)
        apply with ``overlap_comm`` at the stages that keep parameters whole (0-2), and are
        ``None`` in the plan's options otherwise.
      allgather_bucket_size: likewise for the all-gather of the updated parameters (stages
        1-2).
      quantized_weights: ZeRO++ qwZ: stage 3's parameter gathers send this many bits a value
        (8 or 4); 0: exact. Needs a stage that shards parameters (3).
      quantized_gradients: ZeRO++ qgZ: every gradient reduce-scatter over the data axis is a
        quantized all-to-all of this many bits a value (8 or 4) summed in float32 on the
        receiving device; 0: exact. Needs a stage that reduce-scatters (1-3).
    """

    overlap_comm: bool = False
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    quantized_weights: int = 0
    quantized_gradients: int = 0


@dataclass(frozen=True)
class ParallelOptions:
    """Where the other parallelisms put the leaves: the axes ZeRO shards over, the user's or
    AutoTP's partition specs, the sequence, context, pipeline and expert axes.

    Attributes:
      axis: the data-parallel mesh axis, or a tuple of the axes ZeRO shards over
        (``("data", "seq")`` under sequence parallelism: DeepSpeed shards ZeRO's state over
        the sequence-parallel ranks too).
      param_specs: optional ``PartitionSpec`` per parameter leaf on *other* mesh axes, kept.
      tp_rules: per leaf, the tensor-parallel rule behind its ``param_specs`` entry (AutoTP,
        :func:`jzero.parallel.tensor.autotp_specs`), shown by
        :func:`jzero.plan.describe`; a tuple in the plan's options (empty without AutoTP).
      tp_waiting: AutoTP's specs wait for the model's program, read at the first batch
        (:func:`jzero.engine.resolve.read_program`): until then the ``model`` axis may split
        nothing.
      seq_axis: the sequence-parallel axis (Ulysses), one of ``axis``'s: the batch's rows are
        not split over it (its devices share the batch's rows and each computes the loss of
        its own tokens, :mod:`jzero.parallel.sequence`).
      context_axis: the context-parallel axis (ring attention), one of ``axis``'s: as
        ``seq_axis``, the batch's rows are not split over it (each device holds two zig-zag
        chunks of every row, :mod:`jzero.parallel.sequence.ring`).
      pipe_axis: the pipeline mesh axis (``pipe``), or ``None`` without pipeline parallelism:
        the leaves the layer scan consumes are split over it on their stacked dimension (their
        base spec names it), every other leaf is whole on each stage.
      pipe_schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"`` or ``"zero_bubble"``
        (:mod:`jzero.parallel.pipeline`).
      pipe_virtual: the chunks of layers each pipeline stage holds (``interleaved_1f1b``).
      expert_axis: the expert-parallel axis (:mod:`jzero.parallel.expert`), one of
        ``axis``'s: ZeRO shards the dense leaves over all of ``axis``, and each expert leaf
        rests split over ``expert_axis`` on its experts dimension, ZeRO sharding it over the
        other axes only (DeepSpeed's expert data-parallel group).
      expert_leaves: per leaf, whether it holds experts (a leading experts dimension, after
        the stacked-layer one where a scan consumes the leaf).
      num_experts: the experts of each expert leaf, to find its experts dimension (the first
        of that size that is not the stacked-layer one); ``None``: the first such dimension.
    """

    axis: str | tuple[str, ...] = DATA_AXIS
    param_specs: PyTree | None = None
    tp_rules: Sequence[str] | None = None
    tp_waiting: bool = False
    seq_axis: str | None = None
    context_axis: str | None = None
    pipe_axis: str | None = None
    pipe_schedule: str = "1f1b"
    pipe_virtual: int = 1
    expert_axis: str | None = None
    expert_leaves: Sequence[bool] | None = None
    num_experts: int | None = None


_GROUPS = ("zero", "comm", "parallel")


@dataclass(frozen=True)
class PlanOptions:
    """Everything :func:`jzero.plan.make_plan` is told beyond params, optimizer, mesh and stage.

    Attributes:
      zero: ZeRO's own settings.
      comm: the collectives' settings.
      parallel: the other parallelisms' layout.
      precision: the run's dtypes; under mixed precision the float32 master weights get the
        optimizer state's layout. With 16-bit masters (``precision.master_dtype``) the floating
        params are planned in that dtype, with no master copy; pass the optimizer wrapped in
        :func:`jzero.optim.float32_update` so its state and update are float32.
    """

    zero: ZeroOptions = field(default_factory=ZeroOptions)
    comm: CommOptions = field(default_factory=CommOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    precision: Precision = field(default_factory=Precision)

    def replace(self, **fields: Any) -> PlanOptions:
        """These options with fields replaced by name: ``precision`` or any field of a group
        (``persistence_threshold=0``, ``overlap_comm=True``, ``axis=("data", "seq")``).

        Raises:
          TypeError: for a name no group has, listing the names there are.
        """
        groups: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        top = {}
        for name, value in fields.items():
            if name in {f.name for f in dataclasses.fields(self)}:
                top[name] = Precision() if name == "precision" and value is None else value
                continue
            owner = [g for g in _GROUPS if name in _field_names(getattr(self, g))]
            if not owner:
                known = sorted({n for g in _GROUPS for n in _field_names(getattr(self, g))})
                raise TypeError(
                    f"PlanOptions.replace got an unexpected keyword argument {name!r}; the "
                    f"plan's options are precision and {', '.join(known)}."
                )
            groups[owner[0]][name] = value
        new = dataclasses.replace(self, **top) if top else self
        changed = {g: dataclasses.replace(getattr(new, g), **kw) for g, kw in groups.items() if kw}
        return dataclasses.replace(new, **changed) if changed else new


def _field_names(value: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(value)}
