"""One writer per monitor backend, each taking DeepSpeed's ``(tag, value, step)`` events."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CsvWriter", "Event", "TensorBoardWriter", "WandbWriter"]

Event = tuple[str, float, int]
"""``(tag, value, step)``: DeepSpeed's event; the step is the samples trained."""


class TensorBoardWriter:
    """Event files in ``log_dir`` through ``tensorboardX`` (no TensorFlow), flushed after every
    batch of events so a live TensorBoard (and a crash) sees every step written."""

    def __init__(self, log_dir: Path):
        from tensorboardX import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = SummaryWriter(logdir=str(log_dir))

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class CsvWriter:
    """DeepSpeed's CSV layout: ``<log_dir>/<tag with / and spaces as _>.csv``, a ``step,<last
    part of the tag>`` header and one row per event. ``fresh``: the first event of a tag starts
    its file anew (a run from step 0); else rows are appended (a resumed run)."""

    def __init__(self, log_dir: Path, *, fresh: bool):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._fresh = fresh
        self._seen: set[str] = set()

    def path(self, name: str) -> Path:
        """The file of tag ``name``."""
        return self.log_dir / (name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, step in events:
            path = self.path(name)
            first = name not in self._seen
            self._seen.add(name)
            mode = "w" if first and self._fresh else "a"
            with path.open(mode, newline="") as f:
                if mode == "w" or f.tell() == 0:
                    csv.writer(f).writerow(["step", name.rsplit("/", 1)[-1]])
                csv.writer(f).writerow([step, value])

    def close(self) -> None:
        pass


class WandbWriter:
    """A wandb run (``wandb.init(project, group, entity=team)``, as DeepSpeed starts it), its
    history keyed by the event's step; ``WANDB_*`` variables (``WANDB_MODE=offline``) apply."""

    def __init__(
        self,
        *,
        project: str,
        group: str | None,
        team: str | None,
        directory: Path | None,
        config: Mapping[str, Any],
    ):
        import wandb

        kwargs: dict[str, Any] = {}
        if directory is not None and not os.environ.get("WANDB_DIR"):
            directory.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(directory)
        self._run = wandb.init(
            project=project, group=group, entity=team, config=dict(config), **kwargs
        )

    def write_events(self, events: Sequence[Event]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(int(step), {})[name] = value
        for step, values in sorted(by_step.items()):
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
