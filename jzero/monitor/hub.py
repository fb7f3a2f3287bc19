"""The config's monitors on process 0 (:class:`Monitors`), what a train step logs to them
(:class:`TrainLog`, set up for an engine by :func:`train_log`) and a step's throughput
(:class:`StepRates`: samples/s, tokens/s, MFU, computed here only; ``jzero train`` reads them
too)."""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jzero import profiler
from jzero.config import Config, ConfigError
from jzero.monitor.writers import CsvWriter, Event, TensorBoardWriter, WandbWriter

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


@dataclasses.dataclass(frozen=True)
class StepRates:
    """A step's throughput from its time: the one place samples/s, tokens/s and MFU are
    computed (the monitors' :class:`TrainLog` and ``jzero train``'s metrics lines read them).

    Attributes:
      samples_per_step: the global batch.
      tokens_per_sample: tokens in a sample, for tokens/s; ``None``: no tokens/s.
      model_flops: the model's FLOPs of a step, for MFU; ``None``: no MFU.
      peak_flops: the device's peak FLOP/s, for MFU.
      devices: the devices the step runs on, for MFU.
    """

    samples_per_step: int
    tokens_per_sample: int | None = None
    model_flops: float | None = None
    peak_flops: float | None = None
    devices: int = 1

    def samples_per_s(self, seconds: float) -> float:
        """Samples a second, for a step of ``seconds``."""
        return self.samples_per_step / seconds

    def tokens_per_s(self, seconds: float) -> float | None:
        """Tokens a second, for a step of ``seconds``; ``None`` without ``tokens_per_sample``."""
        if not self.tokens_per_sample:
            return None
        return self.samples_per_step * self.tokens_per_sample / seconds

    def mfu(self, seconds: float) -> float | None:
        """Model FLOPs utilisation of a step of ``seconds`` (:func:`jzero.profiler.mfu`);
        ``None`` without the model's FLOPs or the device's peak."""
        if not self.model_flops:
            return None
        return profiler.mfu(self.model_flops, seconds, self.devices, self.peak_flops)

    def of(self, seconds: float) -> dict[str, float]:
        """The figures that exist for a step of ``seconds``, by metric name
        (``samples_per_s``, ``tokens_per_s``, ``mfu``); none for a step of no measurable time."""
        if seconds <= 0:
            return {}
        values = {
            "samples_per_s": self.samples_per_s(seconds),
            "tokens_per_s": self.tokens_per_s(seconds),
            "mfu": self.mfu(seconds),
        }
        return {name: value for name, value in values.items() if value is not None}


def step_rates(engine: Any, batch: Any) -> StepRates:
    """The :class:`StepRates` of ``engine``'s step (a :class:`jzero.Engine`) on global batches
    of ``batch``'s shapes (arrays or ``jax.ShapeDtypeStruct``).

    The samples are its ``train_batch_size``, the tokens its ``tokens_per_sample``. Where the
    device's peak FLOP/s is known (:func:`jzero.profiler.peak_flops`: its table, or
    ``flops_profiler.peak_flops``), the model's FLOPs of a step come from
    ``engine.model_flops(batch)`` (traced once per batch shape); elsewhere (CPU) there is no MFU
    and nothing is traced.
    """
    peak = profiler.peak_flops(engine.mesh.devices.flat[0], engine.config.flops_profiler.peak_flops)
    return StepRates(
        samples_per_step=engine.train_batch_size,
        tokens_per_sample=engine.tokens_per_sample,
        model_flops=engine.model_flops(batch) if peak is not None else None,
        peak_flops=peak,
        devices=engine.mesh.devices.size,
    )


class TrainLog:
    """What a train step writes to the monitors: its metrics under their tags, and the
    throughput (samples/s, tokens/s), MFU and peak bytes per device of the step.

    The step's time runs from its call to its values on the host (the first step's holds its
    compilation). The previous step's values were read too, so the devices were idle at the
    call: it is the step's own time, without the loop's work between steps (data, evaluation),
    as DeepSpeed's throughput timer counts it. The rates are :class:`StepRates`'.

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
        self.rates = StepRates(
            samples_per_step, tokens_per_sample, model_flops, peak_flops, devices
        )
        self.peak_bytes = peak_bytes

    def log(self, metrics: Mapping[str, Any], step: int, started: float) -> dict[str, float]:
        """Writes step ``step``'s events (waiting for its values); returns them by name.

        ``started``: when the step was called (``time.perf_counter()``).
        """
        values = {name: float(v) for name, v in metrics.items()}
        values.update(self.rates.of(time.perf_counter() - started))
        peak = self.peak_bytes()
        if peak is not None:
            values["peak_bytes"] = float(peak)
        samples = step * self.rates.samples_per_step
        self.monitors.write_events([(tag(k), v, samples) for k, v in values.items()])
        return values


def train_log(engine: Any, batch: Any, peak_bytes: Callable[[], int | None]) -> TrainLog:
    """The :class:`TrainLog` of ``engine``'s monitors (``engine.monitor``), set up at its first
    monitored step on the global ``batch``: its :func:`step_rates` and ``peak_bytes``
    (the engine's figure, :mod:`jzero.engine.figures`)."""
    rates = step_rates(engine, batch)
    return TrainLog(engine.monitor, **dataclasses.asdict(rates), peak_bytes=peak_bytes)
