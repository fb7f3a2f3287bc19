"""The pure jitted step: TrainState, gradients, update, streamed update, make_train_step.

Import direction: imports :mod:`jzero.plan`, :mod:`jzero.parallel` (each parallelism's hooks),
:mod:`jzero.rewrite`, :mod:`jzero.comm`, :mod:`jzero.subgroups`; imported by
:mod:`jzero.engine` and :mod:`jzero.nvme`. It holds no state.

* :mod:`~jzero.step.options`: :class:`StepOptions`, the step's settings as one typed value
  (:mod:`jzero.engine.settings` makes it from a config).
* :mod:`~jzero.step.state`: :class:`TrainState`, its shardings, the state before step 1.
* :mod:`~jzero.step.gradients`: the one data-parallel gradient step: the loss on each device's
  rows, accumulation, the parallelisms' hooks (:mod:`jzero.parallel`), unscale and clip.
* :mod:`~jzero.step.update`: the optax update on the shards, then params at rest.
* :mod:`~jzero.step.streaming`: the offloaded update streamed over sub-groups.
* :mod:`~jzero.step.train_step`: :func:`make_train_step` and :func:`make_eval_step`.
"""

from jzero.step.gradients import LossFn as LossFn
from jzero.step.options import StepOptions as StepOptions
from jzero.step.state import TrainState as TrainState
from jzero.step.state import find_learning_rate as find_learning_rate
from jzero.step.state import from_logical as from_logical
from jzero.step.state import init_train_state as init_train_state
from jzero.step.state import is_abstract as is_abstract
from jzero.step.state import logical_shardings as logical_shardings
from jzero.step.state import logical_state as logical_state
from jzero.step.state import logical_view as logical_view
from jzero.step.state import relayout as relayout
from jzero.step.state import restore_target as restore_target
from jzero.step.state import state_shardings as state_shardings
from jzero.step.state import stored_state as stored_state
from jzero.step.streaming import streamed_groups as streamed_groups
from jzero.step.streaming import streamed_update as streamed_update
from jzero.step.train_step import make_eval_step as make_eval_step
from jzero.step.train_step import make_gradient_step as make_gradient_step
from jzero.step.train_step import make_train_step as make_train_step
from jzero.step.update import params_at_rest as params_at_rest

__all__ = [
    "find_learning_rate",
    "from_logical",
    "init_train_state",
    "logical_shardings",
    "logical_view",
    "logical_state",
    "LossFn",
    "make_eval_step",
    "make_gradient_step",
    "make_train_step",
    "params_at_rest",
    "relayout",
    "StepOptions",
    "restore_target",
    "state_shardings",
    "stored_state",
    "streamed_groups",
    "streamed_update",
    "TrainState",
]
