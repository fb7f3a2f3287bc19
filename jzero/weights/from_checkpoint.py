"""Export from a checkpoint: one tree of a step as weight files, one leaf at a time.

Decisions:

* Orbax's metadata is read and no whole tree is ever loaded: one leaf at a time is restored as
  a host numpy array, so host memory stays near the largest leaf (see :mod:`jzero.weights.export`
  for the file formats).
* A step's files are checked against its file record first (every file's checksum, as restore
  does): a damaged step is refused with a :class:`~jzero.checkpoint.CheckpointError`.
* The export writes through :func:`jzero.weights.export.write_leaves`, which writes a file it
  creates exclusively (a fresh name) beside the output and renames it onto the output when
  complete: no predictable name such as ``<out>.tmp`` is ever opened, so a pre-existing file or
  symlink there is never written through or removed; a failed export removes only its own file.
* :func:`parameter_leaves` serves ``jzero.InitOptions(init_from=<checkpoint dir>)``
  (:mod:`jzero.weights.sharded`): the master weights of a mixed-precision run (float32, exact),
  else the params, one leaf at a time.
* The checkpoint is read through :mod:`jzero.checkpoint`'s public modules (Orbax only behind
  :mod:`jzero.checkpoint.orbax_io`); the checkpoint package never imports this one back.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from jzero._util import path_parts
from jzero.checkpoint import dirs, orbax_io
from jzero.checkpoint.format import CheckpointError, flat
from jzero.weights import export as export_lib

__all__ = ["export_checkpoint", "parameter_leaves"]

logger = logging.getLogger(__name__)

# -- export --------------------------------------------------------------------------------
_DTYPES = {
    "float32": np.float32,
    "fp32": np.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
}


def _leaves(
    directory: str | os.PathLike, step: int | None, tree: str, out_dtype: np.dtype | None
) -> tuple[int, list[export_lib.ExportEntry], Any]:
    """A step's leaves under ``tree``: the step, the entries (floating leaves as ``out_dtype``
    unless ``None``) and ``fetch(i)``, which reads one leaf on the host."""
    d = Path(directory).absolute()
    step = dirs.resolve_step(d, step)
    step_dir = dirs.verified_step_dir(d, step)
    saved = orbax_io.tree_metadata(d, step, step_dir)
    prefix = tuple(tree.split(".")) if tree else ()
    selected = [
        (p, md)
        for p, md in flat(saved).values()
        if tuple(str(x) for x in path_parts(p)[: len(prefix)]) == prefix
    ]
    if not selected:
        tops = sorted({k.split(".")[0] for k in flat(saved)})
        raise CheckpointError(
            f"Step {step} of {str(d)!r} has no tree {tree!r}; its trees are {tops}. "
            "Pass one of them as tree."
        )
    entries = []
    for p, md in selected:
        rel = path_parts(p)[len(prefix) :] or (path_parts(p)[-1],)
        keep = out_dtype is None or not jnp.issubdtype(md.dtype, jnp.floating)
        entries.append(
            export_lib.ExportEntry(
                ".".join(map(str, rel)),
                rel,
                tuple(int(n) for n in md.shape),
                np.dtype(md.dtype) if keep else out_dtype,
            )
        )
    read = orbax_io.leaf_reader(d, step, step_dir, saved)

    def fetch(i: int) -> np.ndarray:
        return read(selected[i][0])

    return step, entries, fetch


def parameter_leaves(
    directory: str | os.PathLike, step: int | None = None
) -> tuple[int, list[export_lib.ExportEntry], Any]:
    """A step's parameters, one leaf at a time: the float32 master weights where the run was
    mixed precision (its ``master`` tree), else ``params``.

    Returns:
      ``(step, entries, fetch)``: the step read, one entry per leaf (saved dtypes) and
      ``fetch(i)``, which reads ``entries[i]`` alone as a host array.
    """
    d = Path(directory).absolute()
    step = dirs.resolve_step(d, step)
    saved = orbax_io.tree_metadata(d, step, dirs.verified_step_dir(d, step))
    has_master = any(k.split(".")[0] == "master" for k in flat(saved))
    return _leaves(d, step, "master" if has_master else "params", None)


def export_checkpoint(
    directory: str | os.PathLike,
    step: int | None,
    out_path: str | os.PathLike,
    dtype: Literal["float32", "bfloat16", "fp32", "bf16"] = "float32",
    tree: str = "params",
    max_shard_size: int | str | None = None,
) -> Path:
    """Writes one tree of a step (the full parameters) as one file or as sharded safetensors.

    Leaves are read from the checkpoint one at a time, so host memory stays near the largest
    leaf. Floating leaves are cast to ``dtype``; others keep theirs. Read it back with
    :func:`jzero.weights.export.load_exported`, or load it with
    ``jzero.InitOptions(init_from=...)``.

    Args:
      directory: the checkpoint directory.
      step: the step to export; ``None`` for the latest.
      out_path: the file (``.npz`` writes numpy's format, anything else safetensors), or with
        ``max_shard_size`` the directory of Hugging Face's sharded layout.
      dtype: ``float32`` or ``bfloat16`` (``fp32``/``bf16``).
      tree: the saved tree (a dotted path into the state), ``params`` by default.
      max_shard_size: write ``model-00001-of-0000N.safetensors`` files of at most this size
        (``5GB``, ``500MiB``, bytes) and ``model.safetensors.index.json`` into ``out_path``.

    Returns:
      The written file, or the index of a sharded export.
    """
    if dtype not in _DTYPES:
        raise CheckpointError(
            f"Export dtype {dtype!r} is not supported; choose one of {sorted(_DTYPES)}."
        )
    step, entries, fetch = _leaves(directory, step, tree, np.dtype(_DTYPES[dtype]))
    if max_shard_size is not None:
        written = export_lib.write_sharded(Path(out_path), entries, fetch, max_shard_size)
    else:
        written = export_lib.write_leaves(Path(out_path), entries, fetch)
    logger.info("jzero: exported %d leaves of step %d to %s", len(entries), step, written)
    return written
