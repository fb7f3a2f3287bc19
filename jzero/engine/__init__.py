"""The engine: ``initialize`` (config to Engine), the Engine, its checks, Flax/Equinox models.

Import direction: imports the core (:mod:`jzero.config`, :mod:`jzero.plan`, :mod:`jzero.step`,
:mod:`jzero.replay`, :mod:`jzero.distributed`, :mod:`jzero.optim`) and, lazily, the disk tiers
(:mod:`jzero.nvme`, :mod:`jzero.checkpoint`, :mod:`jzero.weights`, :mod:`jzero.profiler`);
imported by ``jzero train``
and :mod:`jzero.memory`'s measured report. Nothing in the core imports it back.

* :mod:`~jzero.engine.settings`: the config read once: a validated config turned into the
  core's typed options (``PlanOptions``, ``StepOptions``, ``Precision``, ``RematPolicy``); the
  only module that maps config fields onto the core's arguments.
* :mod:`~jzero.engine.build`: :func:`initialize` (also ``jzero.initialize``).
* :mod:`~jzero.engine.engine`: :class:`Engine`, a thin shell over the pure plan and step.
* :mod:`~jzero.engine.auto_stage`: ``zero_optimization.stage: auto``, the cheapest setting
  whose compiled step fits the device memory, chosen at the first batch.
* :mod:`~jzero.engine.checks`: a plan against ``stage3_max_live_parameters``, a state before a save.
* :mod:`~jzero.engine.flax_adapter`: Flax models in, plain pytrees inside (the one Flax import).
* :mod:`~jzero.engine.equinox_adapter`: Equinox models in, plain pytrees inside (the one
  Equinox import, made only when an Equinox model is given).
"""

from jzero.engine.build import initialize as initialize
from jzero.engine.engine import Engine as Engine
from jzero.engine.flax_adapter import Adapted as Adapted
from jzero.engine.flax_adapter import adapt as adapt

__all__ = [
    "adapt",
    "Adapted",
    "Engine",
    "initialize",
]
