"""Pipeline parallelism's room: the schedules, the engine that runs one over ``pipe``.

* :mod:`~jzero.parallel.pipeline.schedule`: the schedules (GPipe, 1F1B, interleaved,
  zero-bubble) as tables, and the engine that runs one inside ``shard_map`` with ``pipe``
  manual (:func:`run`, :func:`run_forward`).
"""

from jzero.parallel.pipeline.schedule import SCHEDULES as SCHEDULES
from jzero.parallel.pipeline.schedule import Residuals as Residuals
from jzero.parallel.pipeline.schedule import RunOptions as RunOptions
from jzero.parallel.pipeline.schedule import Schedule as Schedule
from jzero.parallel.pipeline.schedule import bubble_fraction as bubble_fraction
from jzero.parallel.pipeline.schedule import make_schedule as make_schedule
from jzero.parallel.pipeline.schedule import run as run
from jzero.parallel.pipeline.schedule import run_forward as run_forward

__all__ = [
    "bubble_fraction",
    "make_schedule",
    "Residuals",
    "run",
    "run_forward",
    "RunOptions",
    "Schedule",
    "SCHEDULES",
]
