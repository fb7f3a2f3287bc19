"""Sharded, asynchronous, atomic checkpoints over Orbax; restore anywhere; inspect; export.

Only this package imports Orbax, and within it only :mod:`~jzero.checkpoint.orbax_io`. The
modules, each importing only those listed before it:

* ``format``: what a step holds on disk, its file record (sizes and CRC-32s), restore targets,
  :class:`CheckpointError`.
* ``dirs``: whose a directory is, which steps in it are jzero's and which is the latest, the
  writer's lock, :class:`CheckpointWriteError`.
* ``orbax_io``: every Orbax call (write a step; read its state, JSON items, metadata, a leaf).
* ``checkpointer``: :class:`Checkpointer`, which saves and restores training state.
* ``info``: :func:`inspect` and :func:`read_info`, which read a directory without an engine.

Only Orbax checkpoints live here: exporting a checkpoint's weights is
:func:`jzero.weights.export_checkpoint`, which reads through this package (never the reverse).

The names below are the package's public surface; the modules' other names serve the package.
What a step holds on disk is its ``format``: "layout" elsewhere is where leaves rest on devices.
The names load on first use (:func:`jzero._util.lazy_exports`): importing the package (or
``jzero``) loads no Orbax until a name that needs it is read.
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero.checkpoint.checkpointer import Checkpointer as Checkpointer
    from jzero.checkpoint.dirs import TMP_SUFFIX as TMP_SUFFIX
    from jzero.checkpoint.dirs import CheckpointWriteError as CheckpointWriteError
    from jzero.checkpoint.dirs import latest_step as latest_step
    from jzero.checkpoint.dirs import list_steps as list_steps
    from jzero.checkpoint.format import FORMAT_VERSION as FORMAT_VERSION
    from jzero.checkpoint.format import JZERO as JZERO
    from jzero.checkpoint.format import META as META
    from jzero.checkpoint.format import STATE as STATE
    from jzero.checkpoint.format import CheckpointError as CheckpointError
    from jzero.checkpoint.format import PyTree as PyTree
    from jzero.checkpoint.format import StepCheck as StepCheck
    from jzero.checkpoint.format import abstract_target as abstract_target
    from jzero.checkpoint.info import CheckpointInfo as CheckpointInfo
    from jzero.checkpoint.info import LeafInfo as LeafInfo
    from jzero.checkpoint.info import format_info as format_info
    from jzero.checkpoint.info import inspect as inspect
    from jzero.checkpoint.info import read_info as read_info

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CheckpointInfo",
    "Checkpointer",
    "LeafInfo",
    "StepCheck",
    "abstract_target",
    "format_info",
    "inspect",
    "latest_step",
    "list_steps",
    "read_info",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Checkpointer": "jzero.checkpoint.checkpointer.Checkpointer",
        "TMP_SUFFIX": "jzero.checkpoint.dirs.TMP_SUFFIX",
        "CheckpointWriteError": "jzero.checkpoint.dirs.CheckpointWriteError",
        "latest_step": "jzero.checkpoint.dirs.latest_step",
        "list_steps": "jzero.checkpoint.dirs.list_steps",
        "FORMAT_VERSION": "jzero.checkpoint.format.FORMAT_VERSION",
        "JZERO": "jzero.checkpoint.format.JZERO",
        "META": "jzero.checkpoint.format.META",
        "STATE": "jzero.checkpoint.format.STATE",
        "CheckpointError": "jzero.checkpoint.format.CheckpointError",
        "PyTree": "jzero.checkpoint.format.PyTree",
        "StepCheck": "jzero.checkpoint.format.StepCheck",
        "abstract_target": "jzero.checkpoint.format.abstract_target",
        "CheckpointInfo": "jzero.checkpoint.info.CheckpointInfo",
        "LeafInfo": "jzero.checkpoint.info.LeafInfo",
        "format_info": "jzero.checkpoint.info.format_info",
        "inspect": "jzero.checkpoint.info.inspect",
        "read_info": "jzero.checkpoint.info.read_info",
    },
)
