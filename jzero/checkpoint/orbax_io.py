"""Orbax, as jzero uses it: write a step, read its state, its JSON items, its metadata, one leaf.

Only this package imports Orbax, and within it only this module: the checkpointer, inspect and
export reach Orbax through the functions here, so an Orbax upgrade touches one file.

Decisions:

* A step is written by Orbax's ``CheckpointManager`` (:class:`StepWriter`) with every option
  that deletes or renames left to jzero (``max_to_keep=None``; see
  :mod:`jzero.checkpoint.dirs`), asynchronously, with a hook that runs after every process has
  written and before Orbax's final rename (the checkpointer seals the step there). The state is
  written by Orbax's PyTree handler (what ``StandardSave`` runs) with jzero's own type-handler
  registry, in which an array several devices hold whole is written whole by one of them when
  splitting it among them would give slices under 1 MiB (:data:`MIN_REPLICA_SLICE_BYTES`): each
  slice shape was a program compiled during the save. The files are Orbax's usual ones.
* Every read goes through :func:`read_or_fail`: an Orbax or TensorStore failure becomes one
  :class:`~jzero.checkpoint.format.CheckpointError` naming the step, never a raw traceback.
* A single leaf is read as a host numpy array (:func:`leaf_reader`), the others left as
  placeholders, so export holds one leaf at a time.
* **A failed write is reported once, by jzero.** Orbax logs every failure of its background
  save as an error with a traceback, from several threads (the array writer, the commit, the
  finalize thread, ``wait_until_finished``), and jzero reports the same failure as one line
  (:class:`~jzero.checkpoint.Checkpointer`). So Orbax's error records (those logged from
  Orbax's own files at level ERROR) go to this module's logger at DEBUG level, traceback and
  all: ``jzero train --verbose`` shows them. And when one shard's write fails, Orbax's event
  loop closes while TensorStore still finishes the others; each then reports
  ``RuntimeError: Event loop is closed`` as an unraisable exception, a traceback on stderr per
  shard, and asyncio reports each shard that failed too ("Task exception was never
  retrieved") when the garbage collector drops it. Those (and only those: a ``RuntimeError``
  of that text with no object; asyncio's reports naming Orbax's code or an unfinished step)
  go to DEBUG too. All are installed once, when the first :class:`StepWriter` opens.
* After a failed write the writer is closed (:meth:`StepWriter.close`, which joins Orbax's
  threads; the failure they re-raise is already reported) and a fresh one writes the next
  step, so no state of the failed save is carried over.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import array_metadata_store  # not exported; see _state_handler

from jzero.checkpoint.format import JZERO, META, STATE, CheckpointError, PyTree

__all__ = ["StepWriter", "leaf_reader", "read_json", "read_or_fail", "read_state", "tree_metadata"]

logger = logging.getLogger(__name__)

_ORBAX_DIR = os.path.dirname(ocp.__file__)


class _OrbaxErrorsToDebug(logging.Filter):
    """Orbax's own error records (its reports of a failed write, which jzero reports itself)
    re-logged on this module's logger at DEBUG, traceback and all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.pathname.startswith(_ORBAX_DIR):
            logger.debug("Orbax: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


class _AbandonedWritesToDebug(logging.Filter):
    """asyncio's reports of the writes a failed save abandoned ("Task exception was never
    retrieved", "Future exception was never retrieved": each a shard's own failure, given when
    the garbage collector drops it) re-logged on this module's logger at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        ours = _ORBAX_DIR in text or ocp.path.step.TMP_DIR_SUFFIX in text
        if record.levelno >= logging.ERROR and "exception was never retrieved" in text and ours:
            logger.debug("an abandoned write: %s", text, exc_info=record.exc_info)
            return False
        return True


def _abandoned_write(args: Any) -> bool:
    """Whether an unraisable exception is TensorStore finishing a write whose event loop Orbax
    closed after another write failed."""
    e = args.exc_value
    return args.object is None and isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _quiet_failed_writes() -> None:
    """Installs, once, what the module's decisions say about Orbax's reports of a failure."""
    for name, kind in (("absl", _OrbaxErrorsToDebug), ("asyncio", _AbandonedWritesToDebug)):
        log = logging.getLogger(name)  # Orbax logs through absl's logger
        if not any(isinstance(f, kind) for f in log.filters):
            log.addFilter(kind())
    previous = sys.unraisablehook
    if getattr(previous, "_jzero", False):
        return

    def hook(args: Any) -> None:
        if _abandoned_write(args):
            info = (args.exc_type, args.exc_value, args.exc_traceback)
            logger.debug("a write finished after its event loop closed", exc_info=info)
        else:
            previous(args)

    hook._jzero = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


# Orbax splits an array that several devices hold whole among them to write it (replica-parallel
# saving), each device a slice: every slice of a new shape is a small program compiled on the spot,
# 48 on a first stage-3 save of a tiny GPT on 8 devices (1.46 CPU-s against 0.44 without). The
# leaves ZeRO leaves whole are the small ones (biases, norms, counters), where a slice saves no
# time: arrays whose slices would be under 1 MiB are written whole by one device.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _state_handler() -> Any:
    """Orbax's PyTree handler (the one its ``StandardSave`` uses) with its default type
    handlers, but jax.Array's writing whole the arrays whose replica slices would be under
    :data:`MIN_REPLICA_SLICE_BYTES`; jzero's own registry, so a user's Orbax saves are unchanged."""
    th = ocp.type_handlers
    pairs = [(ty, th.get_type_handler(ty)) for ty in th.supported_types()]
    array = th.ArrayHandler(
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
        array_metadata_store=array_metadata_store.Store(),  # as Orbax's default handler's
    )
    registry = th.create_type_handler_registry(
        *[(ty, array if ty is jax.Array else h) for ty, h in pairs]
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class StepWriter:
    """Orbax's ``CheckpointManager`` on one directory, as the checkpointer writes steps.

    Args:
      directory: the checkpoint directory (it exists; the caller holds its lock).
      on_written: called on process 0 after every process has written a step, before the
        rename that commits it.
    """

    def __init__(self, directory: Path, on_written: Callable[[], None]):
        _quiet_failed_writes()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotation is jzero's: it deletes only steps jzero wrote
            save_interval_steps=1,
            create=True,
            cleanup_tmp_directories=False,  # jzero removes unfinished saves, saying so
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=on_written),
        )
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
        handlers.add(STATE, ocp.args.PyTreeSave, _state_handler())
        for item in (META, JZERO):
            handlers.add(item, ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        self._manager = ocp.CheckpointManager(
            epath.Path(directory), options=options, handler_registry=handlers
        )

    def reload(self) -> None:
        """Re-reads the directory (jzero deletes and renames steps behind Orbax's back)."""
        self._manager.reload()

    def save(self, step: int, state: PyTree, meta: dict[str, Any], info: dict[str, Any]) -> None:
        """Starts writing ``state`` and the JSON items ``meta`` and ``jzero`` as ``step``."""
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.PyTreeSave(state),
                META: ocp.args.JsonSave(meta),
                JZERO: ocp.args.JsonSave(info),
            }
        )
        self._manager.save(step, args=args, force=True)

    def wait_until_finished(self) -> None:
        """Blocks until the write in flight is committed; re-raises its failure."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for Orbax's threads and releases them. After a failed write (already raised
        by :meth:`wait_until_finished`) Orbax may raise it again here: that is logged at DEBUG
        level, and the abandoned writes' leftovers are collected quietly (see
        :func:`read_or_fail`)."""
        try:
            self._manager.close()
        except Exception as e:  # the failure the caller has handled, raised once more
            logger.debug("closing Orbax's writer after a failed write: %s", e)
        _collect_quietly()


def _read_error(step: int, directory: Path, e: BaseException) -> CheckpointError:
    """The error for a step Orbax failed to read: its first line, and what to do."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return CheckpointError(
        f"Reading checkpoint step {step} in {str(directory)!r} failed ({first}). The step is "
        "damaged or was not written by jzero; restore another step."
    )


def read_or_fail(read: Callable[[], Any], step: int, directory: Path) -> Any:
    """Runs one Orbax read; a failure becomes one :class:`CheckpointError`.

    Orbax gathers one coroutine per shard; when one read of a damaged step fails, the others
    are left unfinished, held by the failure's traceback, and each raises again ("Encountered
    error while reading array index") whenever the garbage collector later closes it, far
    from the restore. So the original exception is dropped (its first line is in the message)
    and those abandoned reads are collected here, silently, before the error is raised.
    """
    try:
        return read()
    except Exception as e:  # TensorStore and Orbax raise bare Exceptions for bad data
        error = _read_error(step, directory, e)
    _collect_quietly()
    raise error


def _collect_quietly() -> None:
    """Collects the coroutines a failed read or write left unfinished, silently (each would
    raise again when the garbage collector closes it)."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def read_state(step_dir: Path, target: PyTree) -> PyTree:
    """A step's state, laid out as ``target``'s ``jax.ShapeDtypeStruct`` leaves say (Orbax
    reshards); call it inside :func:`read_or_fail`."""
    return ocp.StandardCheckpointHandler().restore(
        epath.Path(step_dir / STATE), args=ocp.args.StandardRestore(target)
    )


def tree_metadata(directory: Path, step: int, step_dir: Path) -> PyTree:
    """The step's state as Orbax's metadata (shape, dtype, saved sharding per leaf), no array."""
    try:
        return ocp.PyTreeCheckpointHandler().metadata(epath.Path(step_dir / STATE)).tree
    except Exception as e:  # Orbax raises several types for unreadable metadata
        raise _read_error(step, directory, e) from e


def read_json(step_dir: Path, item: str) -> dict[str, Any]:
    """A step's JSON item (``meta`` or ``jzero``); ``{}`` when the step has none."""
    if not (step_dir / item).is_dir():
        return {}
    return dict(ocp.JsonCheckpointHandler().restore(epath.Path(step_dir / item)) or {})


def leaf_reader(
    directory: Path, step: int, step_dir: Path, saved: PyTree
) -> Callable[[tuple[Any, ...]], np.ndarray]:
    """Reads one leaf of a step's state at a time, as a host numpy array.

    Args:
      directory: the checkpoint directory, for error messages.
      step: the step, for error messages.
      step_dir: the step's verified directory.
      saved: the step's state metadata (:func:`tree_metadata`).

    Returns:
      A function from a leaf's key path in ``saved`` to its array; only that leaf is read.
    """
    handler = ocp.PyTreeCheckpointHandler()

    def read(want: tuple[Any, ...]) -> np.ndarray:
        def pick(value: Callable[[], Any]) -> Callable[..., Any]:
            return lambda p, _: value() if p == want else ocp.PLACEHOLDER

        item = jax.tree_util.tree_map_with_path(pick(lambda: 0), saved)
        args = jax.tree_util.tree_map_with_path(
            pick(lambda: ocp.RestoreArgs(restore_type=np.ndarray)), saved
        )
        out = read_or_fail(
            lambda: handler.restore(
                epath.Path(step_dir / STATE), args=ocp.args.PyTreeRestore(item, restore_args=args)
            ),
            step,
            directory,
        )
        for k in want:
            out = out[k.idx if isinstance(k, jax.tree_util.SequenceKey) else k.key]
        return out

    return read
