"""Where every leaf lives: the stage table, precision, memory kinds, Plan, make_plan.

Import direction: imports :mod:`jzero.choices` (the stage table), ZeRO's leaf rule
(:mod:`jzero.parallel.zero.leaf_rule`, which the plan is made from), :mod:`jzero.costs` (the
layout's value), :mod:`jzero.distributed` (the mesh axes) and :mod:`jzero.subgroups` (which
leaves share an update group); imported by the step, the engine, the NVMe tier, memory,
checkpoint and weights. It runs nothing: a plan is data, and it reads no config
(:mod:`jzero.engine.settings` makes its options).

* ``stages``: the one table of what each ZeRO stage shards; no other module branches on the
  stage number. It is :mod:`jzero.choices.stages` (``jzero.plan.stages`` is that module), below
  the config too, so the config validates a stage against the rows the plan is made from.
* :mod:`~jzero.plan.precision`: dtypes and DeepSpeed's loss scaling.
* :mod:`~jzero.plan.memory_kinds`: host offload (``offload_optimizer``, ``offload_param``) as
  JAX memory kinds on shardings.
* :mod:`~jzero.plan.padding`: leaves whose sharded dimension the shard count does not divide
  rest padded with zeros, and are used at their logical shapes.
* :mod:`~jzero.plan.plan`: the :class:`Plan`: the shardings, the leaves and the options it
  was made with, and what follows from them.
* :mod:`~jzero.plan.options`: what ``make_plan`` is told beyond them, as typed values
  (:class:`PlanOptions`: :class:`ZeroOptions`, :class:`CommOptions`, :class:`ParallelOptions`
  and the :class:`Precision`); :mod:`jzero.engine.settings` makes them from a config.
* :mod:`~jzero.plan.make`: :func:`make_plan`, the plan built from abstract params, an
  optimizer, a mesh, a stage and its options, each leaf placed by ZeRO's leaf rule
  (:mod:`jzero.parallel.zero.leaf_rule`: which dimension is sharded, and why one stays whole).
* :mod:`~jzero.plan.report`: what a plan costs and how it reads: :func:`model_state_bytes`,
  :func:`host_state_bytes` (bytes per device) and :func:`describe` (the table
  ``engine.describe()`` prints).
"""

from jzero.choices import stages as stages
from jzero.choices.stages import OFFLOADS as OFFLOADS
from jzero.choices.stages import STAGES as STAGES
from jzero.choices.stages import StageSpec as StageSpec
from jzero.choices.stages import check_offload as check_offload
from jzero.choices.stages import formula_text as formula_text
from jzero.choices.stages import stage_spec as stage_spec
from jzero.choices.stages import stages_allowing as stages_allowing
from jzero.distributed import DATA_AXIS as DATA_AXIS
from jzero.plan.make import make_plan as make_plan
from jzero.plan.memory_kinds import HOST_MEMORY_KINDS as HOST_MEMORY_KINDS
from jzero.plan.memory_kinds import PINNED_HOST as PINNED_HOST
from jzero.plan.memory_kinds import UNPINNED_HOST as UNPINNED_HOST
from jzero.plan.memory_kinds import available_memory_kinds as available_memory_kinds
from jzero.plan.memory_kinds import check_memory_kind as check_memory_kind
from jzero.plan.memory_kinds import is_host as is_host
from jzero.plan.memory_kinds import on_device as on_device
from jzero.plan.options import CommOptions as CommOptions
from jzero.plan.options import ParallelOptions as ParallelOptions
from jzero.plan.options import PlanOptions as PlanOptions
from jzero.plan.options import ZeroOptions as ZeroOptions
from jzero.plan.padding import cut_leaf as cut_leaf
from jzero.plan.padding import even_sharding as even_sharding
from jzero.plan.padding import logical_copies as logical_copies
from jzero.plan.padding import to_logical as to_logical
from jzero.plan.padding import to_stored as to_stored
from jzero.plan.padding import update_view as update_view
from jzero.plan.plan import Plan as Plan
from jzero.plan.precision import LossScaleState as LossScaleState
from jzero.plan.precision import Precision as Precision
from jzero.plan.precision import cast_floating as cast_floating
from jzero.plan.precision import next_loss_scale as next_loss_scale
from jzero.plan.report import describe as describe
from jzero.plan.report import host_state_bytes as host_state_bytes
from jzero.plan.report import model_state_bytes as model_state_bytes

__all__ = [
    "available_memory_kinds",
    "cast_floating",
    "check_memory_kind",
    "check_offload",
    "CommOptions",
    "cut_leaf",
    "DATA_AXIS",
    "describe",
    "even_sharding",
    "formula_text",
    "HOST_MEMORY_KINDS",
    "host_state_bytes",
    "PINNED_HOST",
    "UNPINNED_HOST",
    "is_host",
    "logical_copies",
    "LossScaleState",
    "make_plan",
    "model_state_bytes",
    "next_loss_scale",
    "OFFLOADS",
    "on_device",
    "ParallelOptions",
    "Plan",
    "PlanOptions",
    "Precision",
    "stage_spec",
    "STAGES",
    "stages_allowing",
    "StageSpec",
    "to_logical",
    "to_stored",
    "update_view",
    "ZeroOptions",
]
