"""Orbax, as jzero uses it: write a step, read its state, its JSON items, its metadata, one leaf.

Only this package imports Orbax, and within it only this module: the checkpointer, inspect and
export reach Orbax through the functions here, so an Orbax upgrade touches one file.

Decisions:

* A step is written by Orbax's ``CheckpointManager`` (:class:`StepWriter`) with every option
  that deletes or renames left to jzero (``max_to_keep=None``; see
  :mod:`jzero.checkpoint.dirs`), asynchronously, with a hook that runs after every process has
  written and before Orbax's final rename (the checkpointer seals the step there).
* Every read goes through :func:`read_or_fail`: an Orbax or TensorStore failure becomes one
  :class:`~jzero.checkpoint.layout.CheckpointError` naming the step, never a raw traceback.
* A single leaf is read as a host numpy array (:func:`leaf_reader`), the others left as
  placeholders, so export holds one leaf at a time.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jzero.checkpoint.layout import JZERO, META, STATE, CheckpointError, PyTree

__all__ = ["StepWriter", "leaf_reader", "read_json", "read_or_fail", "read_state", "tree_metadata"]


class StepWriter:
    """Orbax's ``CheckpointManager`` on one directory, as the checkpointer writes steps.

    Args:
      directory: the checkpoint directory (it exists; the caller holds its lock).
      on_written: called on process 0 after every process has written a step, before the
        rename that commits it.
    """

    def __init__(self, directory: Path, on_written: Callable[[], None]):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # rotation is jzero's: it deletes only steps jzero wrote
            save_interval_steps=1,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=on_written),
        )
        self._manager = ocp.CheckpointManager(epath.Path(directory), options=options)

    def reload(self) -> None:
        """Re-reads the directory (jzero deletes and renames steps behind Orbax's back)."""
        self._manager.reload()

    def save(self, step: int, state: PyTree, meta: dict[str, Any], info: dict[str, Any]) -> None:
        """Starts writing ``state`` and the JSON items ``meta`` and ``jzero`` as ``step``."""
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                META: ocp.args.JsonSave(meta),
                JZERO: ocp.args.JsonSave(info),
            }
        )
        self._manager.save(step, args=args, force=True)

    def wait_until_finished(self) -> None:
        """Blocks until the write in flight is committed; re-raises its failure."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Releases Orbax's threads."""
        self._manager.close()


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
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook
    raise error


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
