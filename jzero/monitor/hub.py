"""The config's monitors on process 0 (:class:`Monitors`) and what a train step logs to them
(:class:`TrainLog`)."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jzero import profiler
from jzero.config import Config, ConfigError
from jzero.monitor.writers import CsvWriter, Event, TensorBoardWriter, WandbWriter

__all__ = ["TAGS", "Monitors", "TrainLog", "check_available", "open_monitors", "tag"]

TAGS: Mapping[str, str] = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
}
"""The tags of the step's metrics that DeepSpeed names; every other metric ``name`` is
``Train/Samples/<name>`` (``grad_norm``, ``skipped``, ``nonfinite``, ``samples_per_s``,
``tokens_per_s``, ``mfu``, ``peak_bytes``, ``eval_loss``, a model's aux values)."""


def tag(name: str) -> str:
    """The monitor tag of metric ``name``."""
    return TAGS.get(name, f"Train/Samples/{name}")


def check_available(cfg: Config) -> None:
    """Raises ``ConfigError`` when an enabled monitor's package is not installed."""
    if cfg.wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "wandb.enabled is true, but the wandb package is not installed. Install jzero's "
            "wandb extra (pip install 'jzero[wandb]', or pip install wandb), or set "
            "wandb.enabled: false."
        )


class Monitors:
    """The enabled monitors of one process (none but on process 0): DeepSpeed's
    ``engine.monitor``, whose :meth:`write_events` takes ``(tag, value, step)`` events."""

    def __init__(self, writers: Sequence[Any] = ()):
        self.writers = list(writers)

    @property
    def enabled(self) -> bool:
        """True when this process writes to a monitor."""
        return bool(self.writers)

    def write_events(self, events: Sequence[Event]) -> None:
        """Writes ``(tag, value, step)`` events to every monitor; non-finite values are kept
        (a NaN loss is worth seeing)."""
        events = [(name, float(value), int(step)) for name, value, step in events]
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        """Flushes and closes every monitor (the wandb run is finished); idempotent."""
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close()


def open_monitors(
    cfg: Config,
    *,
    process_index: int,
    default_dir: str | Path | None = None,
    fresh: bool = True,
) -> Monitors:
    """The config's enabled monitors, on process 0; no writers elsewhere.

    Args:
      cfg: the config (its ``tensorboard``, ``csv_monitor`` and ``wandb`` sections).
      process_index: this process's index (``jax.process_index()``).
      default_dir: where a monitor with an empty ``output_path`` writes (``jzero train``'s
        ``train.log_dir``); ``None`` for the working directory.
      fresh: the run starts at step 0, so CSV files are started anew (else appended to).
    """
    if process_index != 0:
        return Monitors()
    check_available(cfg)
    base = Path(default_dir) if default_dir is not None else Path.cwd()

    def job_dir(section: Any) -> Path:
        return Path(section.output_path or base) / section.job_name

    writers: list[Any] = []
    if cfg.tensorboard.enabled:
        writers.append(TensorBoardWriter(job_dir(cfg.tensorboard)))
    if cfg.csv_monitor.enabled:
        writers.append(CsvWriter(job_dir(cfg.csv_monitor), fresh=fresh))
    if cfg.wandb.enabled:
        w = cfg.wandb
        directory = Path(default_dir) if default_dir is not None else None
        writers.append(
            WandbWriter(
                project=w.project,
                group=w.group,
                team=w.team,
                directory=directory,
                config=cfg.to_dict(),
            )
        )
    return Monitors(writers)


class TrainLog:
    """What a train step writes to the monitors: its metrics under their tags, and the
    throughput (samples/s, tokens/s), MFU and peak bytes per device of the step.

    The step's time runs from its call to its values on the host (the first step's holds its
    compilation). The previous step's values were read too, so the devices were idle at the
    call: it is the step's own time, without the loop's work between steps (data, evaluation),
    as DeepSpeed's throughput timer counts it.

    Args:
      monitors: where to write.
      samples_per_step: the global batch (the x-axis advances by it).
      tokens_per_sample: tokens in a sample for ``tokens_per_s``; ``None`` leaves it out.
      model_flops: the model's FLOPs of a step, for ``mfu``; ``None`` leaves it out.
      peak_flops: the device's peak FLOP/s, for ``mfu``.
      devices: the devices the step runs on, for ``mfu``.
      peak_bytes: the peak memory per device, or ``None`` where it cannot be read.
    """

    def __init__(
        self,
        monitors: Monitors,
        *,
        samples_per_step: int,
        tokens_per_sample: int | None = None,
        model_flops: float | None = None,
        peak_flops: float | None = None,
        devices: int = 1,
        peak_bytes: Callable[[], int | None] = lambda: None,
    ):
        self.monitors = monitors
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.model_flops = model_flops
        self.peak_flops = peak_flops
        self.devices = devices
        self.peak_bytes = peak_bytes

    def log(self, metrics: Mapping[str, Any], step: int, started: float) -> dict[str, float]:
        """Writes step ``step``'s events (waiting for its values); returns them by name.

        ``started``: when the step was called (``time.perf_counter()``).
        """
        values = {name: float(v) for name, v in metrics.items()}
        seconds = time.perf_counter() - started
        if seconds > 0:
            values["samples_per_s"] = self.samples_per_step / seconds
            if self.tokens_per_sample:
                values["tokens_per_s"] = self.samples_per_step * self.tokens_per_sample / seconds
            if self.model_flops:
                mfu = profiler.mfu(self.model_flops, seconds, self.devices, self.peak_flops)
                if mfu is not None:
                    values["mfu"] = mfu
        peak = self.peak_bytes()
        if peak is not None:
            values["peak_bytes"] = float(peak)
        samples = step * self.samples_per_step
        self.monitors.write_events([(tag(k), v, samples) for k, v in values.items()])
        return values
