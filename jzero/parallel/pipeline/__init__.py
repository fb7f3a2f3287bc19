"""Pipeline parallelism's room: the schedules, the engine that runs one, the loss cut into
stage units, and the pipeline's part of the step.

* :mod:`~jzero.parallel.pipeline.schedule`: the schedules (GPipe, 1F1B, interleaved,
  zero-bubble) as tables, and the engine that runs one inside ``shard_map`` with ``pipe``
  manual (:func:`run`, :func:`run_forward`).
* :mod:`~jzero.parallel.pipeline.layer_split`: the loss cut at its layer scan into the unit
  each stage runs (:func:`split_at_layers`, :func:`stage_unit`).
* :mod:`~jzero.parallel.pipeline.backward_split`: a stage unit's backward pass split into
  input- and weight-gradient passes (the zero-bubble schedule's).
* :mod:`~jzero.parallel.pipeline.step`: the hooks the step calls under a pipelined plan:
  :func:`pipelined_grads` (training), :func:`pipelined_loss` (evaluation).
"""

from jzero.parallel.pipeline.backward_split import split_backward as split_backward
from jzero.parallel.pipeline.layer_split import NoLayerScan as NoLayerScan
from jzero.parallel.pipeline.layer_split import split_at_layers as split_at_layers
from jzero.parallel.pipeline.layer_split import stage_unit as stage_unit
from jzero.parallel.pipeline.schedule import SCHEDULES as SCHEDULES
from jzero.parallel.pipeline.schedule import Residuals as Residuals
from jzero.parallel.pipeline.schedule import RunOptions as RunOptions
from jzero.parallel.pipeline.schedule import Schedule as Schedule
from jzero.parallel.pipeline.schedule import bubble_fraction as bubble_fraction
from jzero.parallel.pipeline.schedule import make_schedule as make_schedule
from jzero.parallel.pipeline.schedule import run as run
from jzero.parallel.pipeline.schedule import run_forward as run_forward
from jzero.parallel.pipeline.step import pipelined_grads as pipelined_grads
from jzero.parallel.pipeline.step import pipelined_loss as pipelined_loss
from jzero.parallel.pipeline.step import scatters_each_micro_batch as scatters_each_micro_batch

__all__ = [
    "bubble_fraction",
    "make_schedule",
    "NoLayerScan",
    "pipelined_grads",
    "pipelined_loss",
    "Residuals",
    "run",
    "run_forward",
    "RunOptions",
    "scatters_each_micro_batch",
    "Schedule",
    "SCHEDULES",
    "split_at_layers",
    "split_backward",
    "stage_unit",
]
