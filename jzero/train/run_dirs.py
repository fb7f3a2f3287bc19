"""A run's folders before it trains: the checkpoint directory is jzero's, the log folder is
apart from it, and an earlier run's checkpoints or metrics are replaced only when asked.

Decisions:

* **The log folder is treated as the checkpoint directory is.** A run that resumes appends to
  ``metrics.jsonl`` (first dropping the lines of steps after its checkpoint, which it trains
  again); a run that starts at step 1 into a folder holding an earlier run's ``metrics.jsonl``
  is refused unless ``checkpoint.overwrite`` (``--overwrite``) says to replace it.
* The checkpoint directory may be a folder inside the log folder (``runs/zero2/ckpt``); the
  other way round is refused at the start: the first save would refuse the log files in a
  directory that holds only jzero's checkpoints, after the whole run had trained.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from jzero.config import Config
from jzero.train.summary import METRICS, SUMMARY

__all__ = [
    "check_apart",
    "check_checkpoint_directory",
    "check_log_dir",
    "keep_metrics_until",
    "last_checkpoint",
]

logger = logging.getLogger(__name__)


def last_checkpoint(cfg: Config) -> int | None:
    """The last committed step in ``checkpoint.directory`` (``None``: none, or no directory)."""
    if not cfg.checkpoint.directory:
        return None
    from jzero.checkpoint import latest_step

    return latest_step(cfg.checkpoint.directory)


def check_checkpoint_directory(cfg: Config, *, fresh: bool) -> None:
    """Before training: the checkpoint directory is jzero's, and a fresh start into an earlier
    run's steps was asked for explicitly (``--overwrite``)."""
    from jzero.checkpoint import dirs  # Orbax is needed only for checkpoints

    directory = Path(cfg.checkpoint.directory)
    dirs.check_ownership(directory)
    existing = dirs.write_order(directory)
    if fresh and existing and not cfg.checkpoint.overwrite:
        raise ValueError(
            f"--no-resume, but the checkpoint directory {str(directory)!r} holds the checkpoints "
            f"of an earlier run (steps {existing}, the latest {existing[-1]}). Pass --overwrite "
            "to replace them with this run's, set another checkpoint.directory, or drop "
            "--no-resume to continue that run."
        )


def check_apart(cfg: Config) -> None:
    """Before training: the log folder is not the checkpoint directory, nor inside it."""
    log_dir, ckpt = Path(cfg.train.log_dir), Path(cfg.checkpoint.directory)
    if log_dir.resolve() == ckpt.resolve() or ckpt.resolve() in log_dir.resolve().parents:
        raise ValueError(
            f"train.log_dir ({str(log_dir)!r}) is the checkpoint directory or inside it "
            f"({str(ckpt)!r}), which holds jzero's checkpoints only: the first save would "
            "refuse the log files there. Give the checkpoints a folder of their own, e.g. "
            f"--set checkpoint.directory={log_dir / 'ckpt'}."
        )


def check_log_dir(cfg: Config, *, fresh: bool) -> None:
    """Before training: a run that starts fresh (no checkpoint to resume from) writes into a
    log folder without an earlier run's ``metrics.jsonl``, unless ``--overwrite`` says to
    replace it."""
    log_dir = Path(cfg.train.log_dir)
    metrics = log_dir / METRICS
    if not metrics.is_file() or cfg.checkpoint.overwrite:
        return
    checkpoint = last_checkpoint(cfg)
    if not fresh and checkpoint is not None:  # the same run goes on: its lines are appended
        return
    last = _last_logged_step(metrics)
    earlier = f" (its last line is step {last})" if last is not None else ""
    # (--no-resume beside a checkpoint was refused before, by the checkpoint directory's check)
    why = (
        f"there is no checkpoint to resume from in {str(cfg.checkpoint.directory)!r}"
        if cfg.checkpoint.directory
        else "the config sets no checkpoint.directory to resume from"
    )
    raise ValueError(
        f"The log folder {str(log_dir)!r} (train.log_dir) holds the {METRICS} of an earlier "
        f"run{earlier}, and this run starts from step 1 ({why}): it would replace that run's "
        f"{METRICS} and {SUMMARY}. Pass --overwrite to replace them, or give this run a "
        f"folder of its own, e.g. --set train.log_dir={log_dir}-2."
    )


def _last_logged_step(metrics: Path) -> int | None:
    """The step of the last line of a ``metrics.jsonl`` (``None`` if unreadable)."""
    try:
        lines = metrics.read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_metrics_until(metrics: Path, step: int) -> None:
    """A resumed run's ``metrics.jsonl`` without the lines of steps after its checkpoint:
    they ran after the checkpoint was saved, and the resumed run trains them again."""
    if not metrics.is_file():
        return
    kept, dropped = [], []
    for line in metrics.read_text().splitlines():
        try:
            logged = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            logged = None
        (dropped if logged is not None and logged > step else kept).append((line, logged))
    if dropped:
        metrics.write_text("".join(line + "\n" for line, _ in kept))
        steps = [logged for _, logged in dropped]
        logger.info(
            "%s: dropped the lines of steps %d-%d, which ran after checkpoint %d (this run "
            "trains them again)",
            metrics,
            min(steps),
            max(steps),
            step,
        )
