"""The engine: ``initialize`` (config to Engine), the Engine, its checks, Flax/Equinox models.

Import direction: imports the core (:mod:`jzero.config`, :mod:`jzero.plan`, :mod:`jzero.step`,
:mod:`jzero.rewrite`, :mod:`jzero.distributed`, :mod:`jzero.optim`) and, lazily, the disk tiers
(:mod:`jzero.nvme`, :mod:`jzero.checkpoint`, :mod:`jzero.weights`, :mod:`jzero.profiler`,
:mod:`jzero.monitor`); imported by the demo (``jzero train``, ``jzero plan``:
:mod:`jzero.demo`). Nothing in the core imports it back, nor does :mod:`jzero.memory` (its
measured report takes an engine from its caller).

* :mod:`~jzero.engine.settings`: the config read once: a validated config turned into the
  core's typed options (``PlanOptions``, ``StepOptions``, ``Precision``, ``RematPolicy``); the
  only module that maps config fields onto the core's arguments.
* :mod:`~jzero.engine.build`: :func:`initialize` (also ``jzero.initialize``), a sequence of
  named steps, and its rarer settings, :class:`InitOptions` (also ``jzero.InitOptions``).
* :mod:`~jzero.engine.engine`: :class:`Engine`, a thin shell that keeps the state and
  delegates to the modules below.
* :mod:`~jzero.engine.steps`: the one builder of the train step, whatever the offload tier,
  and the step ``flops_profiler`` profiles.
* :mod:`~jzero.engine.layout`: the stacked-layer dimensions the loss's scans consume, and the
  leaves a re-plan for them moves.
* :mod:`~jzero.engine.figures`: the model's FLOPs of a step and the peak memory per device,
  each computed only there.
* :mod:`~jzero.engine.saving`: the engine's checkpoints, written and read back.
* :mod:`~jzero.engine.auto_stage`: ``zero_optimization.stage: auto``, the cheapest setting
  whose compiled step fits the device memory, chosen at the first batch.
* :mod:`~jzero.engine.checks`: a plan against ``stage3_max_live_parameters``, a state before a save.
* :mod:`~jzero.engine.flax_adapter`: Flax models in, plain pytrees inside (the one Flax import).
* :mod:`~jzero.engine.equinox_adapter`: Equinox models in, plain pytrees inside (the one
  Equinox import, made only when an Equinox model is given).

The names load on first use (:func:`jzero._util.lazy_exports`): ``initialize`` and
``Engine`` import no Flax; :func:`adapt` (and ``initialize`` given a Flax model) does.
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero.engine.build import InitOptions as InitOptions
    from jzero.engine.build import initialize as initialize
    from jzero.engine.engine import Engine as Engine
    from jzero.engine.flax_adapter import Adapted as Adapted
    from jzero.engine.flax_adapter import adapt as adapt

__all__ = [
    "adapt",
    "Adapted",
    "Engine",
    "InitOptions",
    "initialize",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "InitOptions": "jzero.engine.build.InitOptions",
        "initialize": "jzero.engine.build.initialize",
        "Engine": "jzero.engine.engine.Engine",
        "Adapted": "jzero.engine.flax_adapter.Adapted",
        "adapt": "jzero.engine.flax_adapter.adapt",
    },
)
