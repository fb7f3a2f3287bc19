"""DeepSpeed's monitors: the training metrics as TensorBoard events, CSV files and a wandb run.

Import direction: imports :mod:`jzero.config` and :mod:`jzero.profiler` only;
:mod:`jzero.engine` and :mod:`jzero.train` import it.

* :mod:`~jzero.monitor.writers`: one writer per backend (``tensorboardX``, ``csv``,
  ``wandb``), each given ``(tag, value, step)`` events as DeepSpeed's ``write_events`` is.
* :mod:`~jzero.monitor.hub`: :class:`Monitors` (the config's enabled writers, on process 0
  only), :class:`TrainLog` (what a train step logs: its metrics, throughput, MFU, peak
  bytes; :func:`train_log` sets it up for an engine) and :class:`StepRates` (a step's
  samples/s, tokens/s and MFU from its time, computed only there: the engine's monitors and
  ``jzero train`` read them; :func:`step_rates` gathers an engine's inputs, tracing the model's
  FLOPs only where the device's peak is known).

Decisions:

* **DeepSpeed's names and layout.** The config sections are DeepSpeed's (``tensorboard``,
  ``csv_monitor``, ``wandb``), the files go to ``<output_path>/<job_name>``, the loss, learning
  rate and loss scale carry DeepSpeed's tags (``Train/Samples/train_loss``,
  ``Train/Samples/lr``, ``Train/Samples/loss_scale``) and the x-axis is the samples trained,
  as DeepSpeed's ``global_samples``. jzero's own metrics follow the same pattern
  (``Train/Samples/grad_norm``, ``skipped``, ``samples_per_s``, ``tokens_per_s``, ``mfu``,
  ``peak_bytes``, ``eval_loss``; :data:`TAGS`).
* **Process 0 writes.** The other processes get a :class:`Monitors` with no writers, so they
  neither open files nor wait for the step's values.
* **The engine logs.** ``engine.train_step`` writes each step's events when a monitor is on
  (``jzero train`` adds the eval loss), and ``engine.monitor.write_events`` takes a user's own,
  as DeepSpeed's ``engine.monitor`` does. Reading a step's values waits for the step, so a run
  without monitors never does.
* **Optional backends are checked before training.** ``wandb`` is an extra
  (``pip install 'jzero[wandb]'``); :func:`check_available` names it at ``initialize``, before
  any model is built.
"""

from __future__ import annotations

from jzero.monitor.hub import TAGS as TAGS
from jzero.monitor.hub import Monitors as Monitors
from jzero.monitor.hub import StepRates as StepRates
from jzero.monitor.hub import TrainLog as TrainLog
from jzero.monitor.hub import check_available as check_available
from jzero.monitor.hub import open_monitors as open_monitors
from jzero.monitor.hub import step_rates as step_rates
from jzero.monitor.hub import tag as tag
from jzero.monitor.hub import train_log as train_log

__all__ = [
    "TAGS",
    "Monitors",
    "StepRates",
    "TrainLog",
    "check_available",
    "open_monitors",
    "step_rates",
    "tag",
    "train_log",
]
