"""The checkpointer: sharded, asynchronous, atomic saves of training state; restore anywhere.

Orbax is reached through :mod:`jzero.checkpoint.orbax_io`; what a step holds on disk, its file
record and restore targets are in :mod:`jzero.checkpoint.format`; whose the directory is and
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
* **A failed save is an event, not a crash.** Before writing, the free space of the directory
  is compared with the step's size (its arrays' bytes, as the plan gives them, plus its meta):
  too little is a failure without a byte written. (Orbax's files add metadata and file-system
  blocks, a few percent of a large model's step, so a save can still run out of space: that is
  a failed write.) A write that fails (no space, a quota, an I/O error; Orbax re-raises its
  background thread's error at the next wait) is handled where it surfaces: the step's
  unfinished folder is removed, Orbax's writer is closed (its threads joined) and a fresh one
  takes the next save, and the failure is one line naming the cause, the directory, its free
  space and the last committed step. A *periodic* save (``save(..., periodic=True)``: the
  engine's save every ``save_interval_steps``) logs that line and training goes on: the next
  save tries again, and only ``max_consecutive_failures`` failures in a row raise it as a
  :class:`CheckpointWriteError`. Any other save raises it; so do :meth:`wait_until_finished`
  and :meth:`close` for the save in flight (nothing comes after it to try again). Processes
  agree on every failure (one of them failing is a failure of all), so their barriers match.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero._util import format_bytes, free_bytes
from jzero.checkpoint import dirs, orbax_io
from jzero.checkpoint.dirs import TMP_SUFFIX, CheckpointWriteError, latest_step, list_steps
from jzero.checkpoint.format import (
    FORMAT_VERSION,
    META,
    CheckpointError,
    PyTree,
    as_target,
    check_target,
    path_str,
    seal,
)
from jzero.distributed import any_process, barrier

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)

# After a failed write, how long no abandoned write may have landed before its unfinished
# folder counts as gone (they land within a tenth of a second on a local disk).
_ABANDONED_WRITES_S = 0.3


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
      max_consecutive_failures: periodic saves (``save(..., periodic=True)``) that may fail in
        a row, each logged, before the next failure raises; 0 never raises for them (see the
        module's decisions).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 0,
        async_save: bool = True,
        overwrite: bool = False,
        max_consecutive_failures: int = 3,
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
        if isinstance(max_consecutive_failures, bool) or int(max_consecutive_failures) < 0:
            raise CheckpointError(
                f"max_consecutive_failures={max_consecutive_failures!r} is invalid; it must be "
                "0 (never stop) or a positive number of failed saves in a row."
            )
        self.directory = Path(directory).expanduser().absolute()
        dirs.check_ownership(self.directory)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = int(save_interval_steps)
        self.async_save = bool(async_save)
        self.overwrite = bool(overwrite)
        self.max_consecutive_failures = int(max_consecutive_failures)
        self.consecutive_failures = 0  # failed saves since the last committed one
        self._manager: orbax_io.StepWriter | None = None
        self._opened = False
        self._periodic = False  # whether the save in flight is a periodic one
        self._needed = 0  # the bytes the save in flight needs
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
        """Opens the directory for writing (once: ownership, the lock, the marker, cut-short
        re-saves, unfinished saves), and Orbax's writer (again after a failed save)."""
        if not self._opened:
            dirs.check_ownership(self.directory)  # every process: all refuse alike
            # ... all on the directory as it was: process 0's marker, written next through a
            # temporary file, would otherwise be a foreign file to a process still checking.
            barrier("jzero-checkpoint-checked")
            if self._main:
                self.directory.mkdir(parents=True, exist_ok=True)
                lock = dirs.DirectoryLock(self.directory)
                lock.acquire()
                self._lock = lock
                dirs.write_marker(self.directory)
                dirs.recover_asides(self.directory)
                dirs.remove_unfinished(self.directory, log=True)
            barrier("jzero-checkpoint-open")
            self._seq = dirs.next_seq(self.directory)
            self._opened = True
        if self._manager is None:
            self._manager = orbax_io.StepWriter(self.directory, self._on_written)
        return self._manager

    def _on_written(self) -> None:
        """Orbax's hook after every process has written, before the rename (process 0 only)."""
        step = self._inflight
        tmp = self.directory / f"{step}{TMP_SUFFIX}"
        seal(tmp if tmp.is_dir() else self.directory / str(step))

    def _failure(self, step: int, cause: str, needed: int) -> str:
        """The one line that reports a failed save: cause, directory, free space, last step."""
        try:
            free = f"{format_bytes(free_bytes(self.directory))} free there"
        except OSError as e:
            free = f"its free space unknown ({e.strerror or e})"
        need = f", the step's arrays hold {format_bytes(needed)}" if needed else ""
        kept = list_steps(self.directory)
        last = latest_step(self.directory)
        committed = (
            f"the committed steps are intact ({kept}, the latest {last})"
            if kept
            else "no step is committed there"
        )
        return (
            f"Checkpoint step {step} was not saved in {str(self.directory)!r}: {cause}; "
            f"{free}{need}; {committed}."
        )

    def _failed(self, step: int, cause: str, *, needed: int, periodic: bool, wrote: bool) -> None:
        """Handles a save that did not commit (see the module's decisions): cleans up what it
        ``wrote``, then logs the failure (a periodic save under the limit) or raises it."""
        if self._aside is not None and self._main:  # the old copy goes back under its name
            dirs.recover_asides(self.directory)
        self._aside = self._inflight = None
        self._saved.discard(step)  # a later save of this step number is a new try
        if wrote and self._manager is not None:  # threads joined; a fresh writer for the next
            self._manager.close()
            self._manager = None
        if wrote and self._main:  # once the writes it abandoned have stopped landing
            dirs.remove_unfinished(self.directory, quiet=_ABANDONED_WRITES_S)
        barrier(f"jzero-checkpoint-failed-{step}")
        self.consecutive_failures += 1
        line = self._failure(step, cause, needed)
        limit, n = self.max_consecutive_failures, self.consecutive_failures
        if not periodic:
            raise CheckpointWriteError(
                f"{line} Free space there (or set another checkpoint directory), then save again."
            )
        if limit and n >= limit:
            raise CheckpointWriteError(
                f"{line} {n} save{'s' if n > 1 else ''} in a row failed "
                f"(checkpoint.max_consecutive_failures: {limit}), so the run stops. Free space "
                "there (or set another checkpoint directory), then resume."
            )
        logger.error(
            "jzero: %s Training goes on; the next save tries again (%d failed in a row%s).",
            line,
            n,
            f"; the run stops at {limit}, checkpoint.max_consecutive_failures" if limit else "",
        )

    def _settle(self, *, final: bool = False) -> None:
        """Waits for the save in flight; once it is committed, drops the copy it replaced, an
        earlier run's steps (first commit of an overwriting run) and steps past max_to_keep.
        Its failure is handled by :meth:`_failed`: a periodic save's is logged unless
        ``final`` (nothing comes after it to try again) or the limit is reached."""
        if self._manager is None:
            return
        error: BaseException | None = None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # Orbax re-raises the background write's error as it was
            error = e
        step = self._inflight
        if step is None:
            if error is not None:  # not a save of ours; report it as one anyway
                raise CheckpointWriteError(
                    f"Writing into {str(self.directory)!r} failed: {_cause(error)}."
                ) from error
            return
        if any_process(error is not None):  # every process takes the same branch
            cause = _cause(error) if error is not None else "another process's write failed"
            periodic = self._periodic and not final
            self._failed(step, cause, needed=self._needed, periodic=periodic, wrote=True)
            return
        self._inflight = None
        self.consecutive_failures = 0
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
        periodic: bool = False,
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
          periodic: a save of a running loop (the engine's every ``save_interval_steps``):
            its failure, and the previous periodic save's, is logged and the next save tries
            again, up to ``max_consecutive_failures`` in a row (see the module's decisions).

        Returns:
          Whether a save was started (``False`` off the interval, when this checkpointer
          already saved ``step``, or when a periodic save failed before writing: too little
          free space).

        Raises:
          CheckpointError: bad arguments, a directory that is not jzero's, another writer, or
            an earlier run's steps (see the class's ``overwrite``).
          CheckpointWriteError: this save failed before it started writing (too little free
            space, ...), or the previous asynchronous save failed (disk full, ...), unless
            periodic under the limit.
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
        self._writer()
        self._settle()  # one save in flight: the hook knows which step it seals
        self._claim_lineage()
        target = self.directory / str(step)
        if target.exists() and not dirs.is_step_dir(target):
            raise CheckpointError(
                f"{str(target)!r} exists and is not a jzero checkpoint; jzero never writes over "
                "what it did not write. Move it away, or save into another directory."
            )
        if target.exists() and not overwrite:
            raise CheckpointError(
                f"Checkpoint step {step} already exists in {str(self.directory)!r}. Pass "
                "overwrite=True to replace it, or save into another directory."
            )
        needed = _nbytes(state) + len(json.dumps(meta))
        free = free_bytes(self.directory)
        if any_process(needed > free):  # nothing written, nothing moved
            cause = "too little free space for it (nothing was written)"
            self._failed(step, cause, needed=needed, periodic=periodic, wrote=False)
            return False
        manager = self._writer()  # again after a failure
        if target.exists():
            logger.warning("jzero: replacing checkpoint step %d of an earlier branch", step)
            if self._main:  # write aside, then swap: the committed copy stays until then
                os.replace(target, self.directory / f"{step}{dirs.ASIDE}")
            self._aside = step
            barrier(f"jzero-aside-{step}")
        manager.reload()
        self._inflight, self._periodic, self._needed = step, bool(periodic), needed
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
            self._failed(step, _cause(e), needed=needed, periodic=periodic, wrote=True)
            return False
        self._seq = int(self._seq or 0) + 1
        self._saved.add(step)
        if not self.async_save:
            self._settle(final=not periodic)
            if step not in self._saved:  # it failed (logged: a periodic save)
                return False
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
        self._settle()  # a periodic save in flight that failed is logged (under the limit)
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

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The meta saved with ``step`` (by default the latest), read without the state."""
        step = dirs.resolve_step(self.directory, step)
        step_dir = dirs.verified_step_dir(self.directory, step)
        return orbax_io.read_or_fail(
            lambda: orbax_io.read_json(step_dir, META), step, self.directory
        )

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
          CheckpointWriteError: the save failed (disk full, ...), periodic or not; earlier
            steps are intact and its unfinished folder is gone.
        """
        self._settle(final=True)

    def close(self) -> None:
        """Waits for the save in flight, releases the directory and Orbax's threads; safe to
        call twice.

        Raises:
          CheckpointWriteError: the save in flight failed (see :meth:`wait_until_finished`);
            the checkpointer is closed all the same.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._settle(final=True)
        finally:
            if self._manager is not None:
                self._manager.close()
                self._manager = None
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(state: PyTree) -> int:
    """The bytes of a state's arrays (global shapes; every process computes the same)."""
    total = 0
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            total += int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        else:
            total += 8
    return total


def _cause(error: BaseException) -> str:
    """What made a write fail, in a few words: the OS error behind it (Orbax and TensorStore
    wrap it: ``[Errno 28]``, ``os_error_code='28'``), else the error's first line."""
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.errno:
            return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
        e = e.__cause__ or e.__context__
    text = str(error)
    found = re.search(r"os_error_code='?(\d+)|\[Errno (\d+)\]", text)
    if found:
        code = int(found.group(1) or found.group(2))
        return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    first = (text.strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
