"""The checkpointer: sharded, asynchronous, atomic saves of training state; restore anywhere.

Orbax is reached through :mod:`jzero.checkpoint.orbax_io`; what a step holds on disk, its file
record and restore targets are in :mod:`jzero.checkpoint.layout`; whose the directory is and
which steps in it are jzero's, in :mod:`jzero.checkpoint.dirs`.

Decisions:

* Saves are asynchronous: ``save`` returns once the arrays are copied off the devices, and the
  write finishes in the background. ``async_save=False`` waits for it.
* Atomicity is Orbax's: a step is written under ``<step>.orbax-checkpoint-tmp`` and renamed to
  ``<step>`` only after every process has finished. :meth:`Checkpointer.all_steps` and
  :func:`~jzero.checkpoint.dirs.list_steps` read the directory and list renamed (finalized)
  steps only, so a save that is still running, or one killed mid-write, is never listed or
  restored. A writer removes left-over temporary directories when it first saves.
* Before the rename, process 0 writes the step's file record (``seal``, looked up in this
  module when the hook runs); restore checks the files against it before reading.
* Restore goes into a target whose leaves carry the new plan's shardings; Orbax reshards and
  places each restored shard in the sharding's memory kind (``pinned_host`` too) directly.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.checkpoint import dirs, orbax_io
from jzero.checkpoint.dirs import TMP_SUFFIX, CheckpointWriteError, latest_step, list_steps
from jzero.checkpoint.layout import (
    FORMAT_VERSION,
    META,
    CheckpointError,
    PyTree,
    as_target,
    check_target,
    path_str,
    seal,
)
from jzero.distributed import barrier

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores training state in one directory, one sub-directory per step.

    The directory is jzero's own (:mod:`jzero.checkpoint.dirs`): a directory holding anything
    else is refused, and only step folders jzero wrote are ever replaced or deleted.

    Args:
      directory: where the steps live; created on the first save (``~`` is expanded).
      max_to_keep: committed checkpoints kept on disk (the ones written earliest are deleted
        once a newer one is committed); ``None`` keeps all.
      save_interval_steps: ``save`` writes only steps divisible by this (unless ``force``);
        0 writes every step it is called with (the caller decides when).
      async_save: write in the background while training continues; ``False`` makes ``save``
        wait until the step is on disk.
      overwrite: this run may replace the checkpoints an earlier run left in ``directory``
        (they are deleted once this run's first step is committed). Without it, a checkpointer
        that has not restored from the directory refuses to save into one that holds steps:
        restore first to continue that run.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 0,
        async_save: bool = True,
        overwrite: bool = False,
    ):
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or max_to_keep < 1):
            raise CheckpointError(
                f"max_to_keep={max_to_keep!r} is invalid; it must be a positive integer or None "
                "(keep every checkpoint)."
            )
        if isinstance(save_interval_steps, bool) or int(save_interval_steps) < 0:
            raise CheckpointError(
                f"save_interval_steps={save_interval_steps!r} is invalid; it must be 0 (save "
                "whenever save is called) or a positive number of steps."
            )
        self.directory = Path(directory).expanduser().absolute()
        dirs.check_ownership(self.directory)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = int(save_interval_steps)
        self.async_save = bool(async_save)
        self.overwrite = bool(overwrite)
        self._manager: orbax_io.StepWriter | None = None
        self._lock: dirs.DirectoryLock | None = None
        self._inflight: int | None = None
        self._aside: int | None = None  # the step whose previous copy waits as <N>.jzero-replaced
        self._superseded: list[int] = []  # an earlier run's steps, deleted after our first commit
        self._continues = False  # restored from this directory: its steps are this run's
        self._seq: int | None = None
        self._saved: set[int] = set()
        self._closed = False

    @property
    def _main(self) -> bool:
        return jax.process_index() == 0

    def _writer(self) -> orbax_io.StepWriter:
        """Opens the directory for writing: ownership, the lock, the marker, cut-short re-saves."""
        if self._manager is None:
            dirs.check_ownership(self.directory)  # every process: all refuse alike
            if self._main:
                self.directory.mkdir(parents=True, exist_ok=True)
                lock = dirs.DirectoryLock(self.directory)
                lock.acquire()
                self._lock = lock
                dirs.write_marker(self.directory)
                dirs.recover_asides(self.directory)
            barrier("jzero-checkpoint-open")
            self._manager = orbax_io.StepWriter(self.directory, self._on_written)
            self._seq = dirs.next_seq(self.directory)
        return self._manager

    def _on_written(self) -> None:
        """Orbax's hook after every process has written, before the rename (process 0 only)."""
        step = self._inflight
        tmp = self.directory / f"{step}{TMP_SUFFIX}"
        seal(tmp if tmp.is_dir() else self.directory / str(step))

    def _write_failed(self, step: int | None, e: BaseException) -> CheckpointWriteError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if self._aside is not None and self._main:  # the old copy goes back under its name
            dirs.recover_asides(self.directory)
        self._aside = self._inflight = None
        kept = list_steps(self.directory)
        return CheckpointWriteError(
            f"Writing checkpoint step {step} to {str(self.directory)!r} failed: "
            f"{type(e).__name__}: {first}. The steps committed before are intact "
            f"({kept or 'none'}). Check the free space and permissions there, then save again."
        )

    def _settle(self) -> None:
        """Waits for the save in flight; once it is committed, drops the copy it replaced, an
        earlier run's steps (first commit of an overwriting run) and steps past max_to_keep."""
        if self._manager is None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # Orbax re-raises the background write's error as it was
            raise self._write_failed(self._inflight, e) from e
        step, self._inflight = self._inflight, None
        if step is None:
            return
        if self._main:
            if self._aside == step:
                dirs.recover_asides(self.directory)  # the new copy is committed: drop the old
            for old in self._superseded:
                if old != step:
                    dirs.remove_step(self.directory, old, "an earlier run's, replaced (overwrite)")
            order = dirs.write_order(self.directory)
            if self.max_to_keep is not None:
                for old in order[: max(0, len(order) - self.max_to_keep)]:
                    dirs.remove_step(self.directory, old, f"max_to_keep={self.max_to_keep}")
        self._aside, self._superseded = None, []
        barrier(f"jzero-checkpoint-settled-{step}")

    def _claim_lineage(self) -> None:
        """The first save decides whose run the directory holds (see ``overwrite``)."""
        if self._continues:
            return
        existing = dirs.write_order(self.directory)
        if existing and not self.overwrite:
            raise CheckpointError(
                f"The checkpoint directory {str(self.directory)!r} holds the checkpoints of an "
                f"earlier run (steps {existing}, the latest {existing[-1]}), and this run did not "
                "restore from it. To continue that run, restore first (engine.restore(), or "
                "jzero train without --no-resume); to replace it, set checkpoint.overwrite: true "
                "(jzero train --overwrite); or save into another checkpoint.directory."
            )
        if existing:
            logger.warning(
                "jzero: this run replaces the checkpoints of an earlier run in %s (steps %s); "
                "they are deleted once this run's first checkpoint is committed",
                self.directory,
                existing,
            )
        self._superseded = existing
        self._continues = True

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` without ``force`` would write."""
        interval = self.save_interval_steps
        return (interval == 0 or int(step) % interval == 0) and int(step) not in self._saved

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        meta: dict[str, Any] | None = None,
        force: bool = False,
        overwrite: bool = False,
    ) -> bool:
        """Starts saving ``state`` (any pytree of arrays) and ``meta`` as checkpoint ``step``.

        Args:
          step: the step number, the name of the checkpoint.
          state: e.g. ``{"step", "params", "opt_state", "extra"}`` or a ``TrainState``.
          meta: a JSON-serialisable dict (resolved config, data position, seed, ...), given
            back by :meth:`restore`.
          force: save even when ``step`` is off the save interval.
          overwrite: replace a committed step of that number (a run resumed from an older
            step saves over the steps that followed it). The committed copy stays on disk
            until the new one is committed. Otherwise an existing step is an error.

        Returns:
          Whether a save was started (``False`` off the interval, or when this checkpointer
          already saved ``step``).

        Raises:
          CheckpointError: bad arguments, a directory that is not jzero's, another writer, or
            an earlier run's steps (see the class's ``overwrite``).
          CheckpointWriteError: the previous asynchronous save failed (disk full, ...).
        """
        if self._closed:
            raise CheckpointError(
                f"The checkpointer for {str(self.directory)!r} is closed. Create a new one."
            )
        if isinstance(step, bool) or int(step) < 0:
            raise CheckpointError(f"step={step!r} is invalid; a step is an integer >= 0.")
        step = int(step)
        if step in self._saved or not (force or self.should_save(step)):
            return False
        meta = {} if meta is None else meta
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"meta is not JSON-serialisable ({e}). Pass plain str/int/float/bool/list/dict "
                "values, e.g. the config as a dict."
            ) from e
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
            if not isinstance(x, jax.Array | np.ndarray | np.generic | int | float):
                raise CheckpointError(
                    f"State leaf {path_str(path)!r} is a {type(x).__name__}; a checkpoint "
                    "holds arrays and numbers only. Put other values into meta."
                )
        manager = self._writer()
        self._settle()  # one save in flight: the hook knows which step it seals
        self._claim_lineage()
        target = self.directory / str(step)
        if target.exists() and not dirs.is_step_dir(target):
            raise CheckpointError(
                f"{str(target)!r} exists and is not a jzero checkpoint; jzero never writes over "
                "what it did not write. Move it away, or save into another directory."
            )
        if target.exists():
            if not overwrite:
                raise CheckpointError(
                    f"Checkpoint step {step} already exists in {str(self.directory)!r}. Pass "
                    "overwrite=True to replace it, or save into another directory."
                )
            logger.warning("jzero: replacing checkpoint step %d of an earlier branch", step)
            if self._main:  # write aside, then swap: the committed copy stays until then
                os.replace(target, self.directory / f"{step}{dirs.ASIDE}")
            self._aside = step
            barrier(f"jzero-aside-{step}")
        manager.reload()
        self._inflight = step
        info = {
            "format": FORMAT_VERSION,
            "step": step,
            "seq": self._seq,
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "jax": jax.__version__,
        }
        try:
            manager.save(step, state, meta, info)
        except Exception as e:  # a synchronous part of the write failed
            raise self._write_failed(step, e) from e
        self._seq = int(self._seq or 0) + 1
        self._saved.add(step)
        if not self.async_save:
            self.wait_until_finished()
        logger.info("jzero: checkpoint step %d %s", step, "started" if self.async_save else "saved")
        return True

    def restore(self, target: PyTree, step: int | None = None) -> tuple[PyTree, dict[str, Any]]:
        """Restores a step into ``target``'s shardings (any stage, any device count).

        Restoring makes the directory's steps this run's own: later saves continue them.

        Args:
          target: the state's structure with ``jax.ShapeDtypeStruct`` leaves carrying the new
            plan's shardings (see :func:`abstract_target`); concrete arrays work too.
          step: the step to restore; by default the latest, the one written last.

        Returns:
          ``(state, meta)``: the state laid out as ``target`` says, and the saved meta dict.
        """
        self._settle()
        step = dirs.resolve_step(self.directory, step)
        step_dir = dirs.verified_step_dir(self.directory, step)
        target = as_target(target)
        saved = orbax_io.tree_metadata(self.directory, step, step_dir)
        check_target(saved, target, step, self.directory)
        state, meta = orbax_io.read_or_fail(
            lambda: (orbax_io.read_state(step_dir, target), orbax_io.read_json(step_dir, META)),
            step,
            self.directory,
        )
        self._continues = True
        logger.info("jzero: restored checkpoint step %d from %s", step, self.directory)
        return state, meta

    def latest_step(self) -> int | None:
        """The committed step written last, or ``None``; a save in flight is not counted."""
        return latest_step(self.directory)

    def all_steps(self) -> list[int]:
        """Every committed step on disk, ascending; saves in flight or killed are not listed."""
        return list_steps(self.directory)

    def partial_steps(self) -> list[int]:
        """Steps whose save never completed (temporary directories), which are ignored."""
        return dirs.partial_steps(self.directory)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is committed.

        Raises:
          CheckpointWriteError: the save failed (disk full, ...); earlier steps are intact.
        """
        self._settle()

    def close(self) -> None:
        """Waits for the save in flight, releases the directory and Orbax's threads; safe to
        call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle()
        finally:
            if self._manager is not None:
                self._manager.close()
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
