"""Exported parameters: one safetensors (or ``.npz``) file, or Hugging Face's sharded layout
(``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``), written leaf
by leaf; :mod:`jzero.weights.format` reads them back nested.

Decisions:

* The safetensors format is written here directly (an 8-byte little-endian header length, a
  JSON header with ``dtype``, ``shape`` and ``data_offsets`` per tensor, then the raw
  little-endian bytes), because the ``safetensors`` package's writers (``save_file``,
  ``serialize_file``) take every tensor of a file at once and this writer takes one leaf at a
  time; files are read back through the package (:mod:`jzero.weights.format`). The header is
  padded with spaces to a multiple of 8 bytes, as other writers do.
* Every offset is computed from shapes and dtypes before any data is read; the data is then
  fetched and written one leaf at a time, so host memory stays near the largest leaf.
* Keys are the dotted leaf paths (``blocks.w``). The exact path of every key (which parts are
  list indices, and dict keys that contain dots) is stored in the header's ``__metadata__``
  (``jzero.paths``), so :func:`load_exported` gives back the same nesting as the parameters.
* A file is written under a temporary name and renamed when complete: a crash never leaves a
  half-written export under the requested name.
* The sharded layout is Hugging Face's: tensors are packed in file order into files of at most
  ``max_shard_size`` bytes (a tensor larger than that gets a file of its own), and the index
  ``{"metadata": {"total_size": ...}, "weight_map": {name: file}}`` names each tensor's file.
  The index is written always, even for one file (``model-00001-of-00001.safetensors``), so a
  reader has one layout to handle; it is written last, so a directory with an index holds a
  complete export. Sizes take Hugging Face's units: ``5GB`` is 5e9 bytes, ``5GiB`` 5 * 2**30.
* With several processes, file ``i`` is written by process ``i % process_count`` only, and
  process 0 writes the index once every process has finished (a barrier). A file named by an
  earlier export that this one does not rewrite is left alone (the index no longer names it);
  a warning lists such files, nothing is deleted.
* This module knows nothing about checkpoints (no Orbax): :mod:`jzero.weights.from_checkpoint`
  reads the leaves (through :mod:`jzero.checkpoint.orbax_io`) and calls :func:`write_leaves`.
* A file is written through :func:`jzero._util.write_atomic` (a fresh file beside the target,
  renamed onto it when complete); sizes are read by :func:`jzero._util.read_size`.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jzero._util import path_parts, read_size, write_atomic
from jzero.weights.format import INDEX_NAME, NPZ_TABLE, PATHS_KEY, TO_ST, PathEntry

__all__ = [
    "ExportEntry",
    "leaf_entries",
    "parse_size",
    "path_parts",
    "shard_groups",
    "write_leaves",
    "write_sharded",
]

_SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportEntry:
    """One tensor of an export.

    Attributes:
      key: the dotted leaf path, the tensor's name in the file.
      path: the path as entries: ``str`` for a dict key, ``int`` for a list index.
      shape: the tensor's shape.
      dtype: the dtype written to the file.
    """

    key: str
    path: tuple[PathEntry, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the file."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _check_entries(entries: Sequence[ExportEntry]) -> None:
    seen: set[str] = set()
    for e in entries:
        if e.key in seen:
            raise ValueError(
                f"Two leaves export under the same key {e.key!r}. Rename one of the dict keys "
                "so that the dotted leaf paths differ."
            )
        seen.add(e.key)
        if np.dtype(e.dtype) not in TO_ST:
            raise ValueError(
                f"Leaf {e.key!r} has dtype {np.dtype(e.dtype).name}, which safetensors can't "
                f"store; the supported dtypes are {sorted(d.name for d in TO_ST)}. "
                "Export it as float32 or bfloat16."
            )


def _fetched(
    fetch: Callable[[int], np.ndarray], i: int, entry: ExportEntry, little_endian: bool
) -> np.ndarray:
    x = np.asarray(fetch(i)).astype(entry.dtype, copy=False)
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if little_endian and sys.byteorder == "big" and x.dtype.itemsize > 1:
        x = x.byteswap()
    if tuple(x.shape) != entry.shape:
        raise ValueError(
            f"Leaf {entry.key!r} was read with shape {tuple(x.shape)} but its metadata says "
            f"{entry.shape}; the checkpoint is inconsistent. Export another step."
        )
    return x


def _write_safetensors(f: Any, entries: Sequence[ExportEntry], fetch: Callable) -> None:
    header: dict[str, Any] = {
        "__metadata__": {
            "format": "pt",
            PATHS_KEY: json.dumps({e.key: list(e.path) for e in entries}),
        }
    }
    offset = 0
    for e in entries:
        header[e.key] = {
            "dtype": TO_ST[np.dtype(e.dtype)],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for i, e in enumerate(entries):
        x = _fetched(fetch, i, e, little_endian=True)
        f.write(memoryview(x.reshape(-1).view(np.uint8)))
        del x


def _write_npz(f: Any, entries: Sequence[ExportEntry], fetch: Callable) -> None:
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for i, e in enumerate(entries):
            x = _fetched(fetch, i, e, little_endian=False)
            with zf.open(e.key + ".npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, x, allow_pickle=False)
            del x
        # numpy's format has no bfloat16: record every dtype by name beside the paths.
        table = {
            "paths": {e.key: list(e.path) for e in entries},
            "dtypes": {e.key: np.dtype(e.dtype).name for e in entries},
        }
        with zf.open(NPZ_TABLE + ".npy", mode="w") as member:
            np.lib.format.write_array(member, np.asarray(json.dumps(table)), allow_pickle=False)


def write_leaves(
    out_path: str | os.PathLike,
    entries: Sequence[ExportEntry],
    fetch: Callable[[int], np.ndarray],
) -> Path:
    """Writes tensors one at a time: safetensors, or ``.npz`` when the path ends in ``.npz``.

    Args:
      out_path: the file to write; its parent directory must exist.
      entries: the tensors, in file order (see :class:`ExportEntry`).
      fetch: ``fetch(i) -> array`` for ``entries[i]``, called once per entry in order; the
        array is cast to the entry's dtype, written and dropped before the next call.

    Returns:
      The written path.
    """
    out = Path(out_path)
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"The output directory {str(out.parent)!r} does not exist. Create it first."
        )
    _check_entries(entries)

    def write(f: Any) -> None:
        if out.suffix == ".npz":
            _write_npz(f, entries, fetch)
        else:
            _write_safetensors(f, entries, fetch)

    write_atomic(out, write)
    return out


def leaf_entries(tree: Any, dtype: Any = None) -> list[ExportEntry]:
    """One :class:`ExportEntry` per leaf of a pytree of arrays (or ``ShapeDtypeStruct``).

    Args:
      tree: the parameters.
      dtype: the dtype floating leaves are written as; ``None`` keeps each leaf's own.

    Returns:
      The entries in ``jax.tree.leaves`` order, keyed by their dotted paths.
    """
    import jax  # only here: the rest of this module needs no JAX

    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = list(path_parts(path))
        own = np.dtype(x.dtype)
        floating = np.issubdtype(own, np.floating) or own == np.dtype(ml_dtypes.bfloat16)
        out.append(
            ExportEntry(
                ".".join(map(str, parts)),
                tuple(parts),
                tuple(int(n) for n in x.shape),
                np.dtype(dtype) if dtype is not None and floating else own,
            )
        )
    return out


_UNIT_NAMES = ("B", "KB", "MB", "GB", "TB", "KIB", "MIB", "GIB", "TIB")


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (5e9), ``500MiB`` (500 * 2**20) or an int, as Hugging Face reads them."""
    n = read_size(size)
    if n is None or n != n or n in (float("inf"), float("-inf")):
        raise ValueError(
            f"Can't read the size {size!r}: write a number of bytes or a number with a unit "
            f"({', '.join(_UNIT_NAMES)}), e.g. 5GB or 500MiB."
        )
    if int(n) <= 0:
        raise ValueError(f"A shard size must be positive, not {size!r}.")
    return int(n)


def shard_groups(entries: Sequence[ExportEntry], max_shard_size: int | str) -> list[list[int]]:
    """Entries packed in order into files of at most ``max_shard_size`` bytes (Hugging Face's
    rule: a tensor that does not fit starts a new file; one larger than the limit is alone)."""
    limit = parse_size(max_shard_size)
    groups: list[list[int]] = [[]]
    size = 0
    for i, e in enumerate(entries):
        if groups[-1] and size + e.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += e.nbytes
    return groups


def write_sharded(
    out_dir: str | os.PathLike,
    entries: Sequence[ExportEntry],
    fetch: Callable[[int], np.ndarray],
    max_shard_size: int | str = "5GB",
    *,
    skip: Callable[[int], None] | None = None,
) -> Path:
    """Writes Hugging Face's sharded safetensors layout, leaf by leaf (see the decisions).

    Args:
      out_dir: the directory; created (with its parents) if missing.
      entries: the tensors, in file order.
      fetch: ``fetch(i) -> array`` for ``entries[i]``; called on the process that writes the
        entry's file only, in order, and dropped before the next call.
      max_shard_size: the most bytes per file (``5GB``, ``500MiB`` or an int).
      skip: ``skip(i)``, called in order for each entry another process writes (for fetches
        that are collective, every process must take part in each).

    Returns:
      The index file's path.
    """
    import jax  # only here: the rest of this module needs no JAX

    from jzero.distributed import barrier

    out = Path(out_dir)
    _check_entries(entries)
    groups = shard_groups(entries, max_shard_size)
    names = [_SHARD_NAME.format(k + 1, len(groups)) for k in range(len(groups))]
    pid, count = jax.process_index(), jax.process_count()
    if pid == 0:
        out.mkdir(parents=True, exist_ok=True)
    barrier("jzero_export_mkdir")
    for k, group in enumerate(groups):
        if k % count != pid:
            for i in group:
                if skip is not None:
                    skip(i)
            continue
        part = [entries[i] for i in group]
        write_leaves(out / names[k], part, lambda j, group=group: fetch(group[j]))
    barrier("jzero_export_files")
    index = out / INDEX_NAME
    if pid == 0:
        weight_map = {entries[i].key: names[k] for k, g in enumerate(groups) for i in g}
        text = json.dumps(
            {
                "metadata": {
                    "total_size": sum(e.nbytes for e in entries),
                    PATHS_KEY: json.dumps({e.key: list(e.path) for e in entries}),
                },
                "weight_map": weight_map,
            },
            indent=2,
        )
        write_atomic(index, lambda f: f.write(text + "\n"), text=True)
        stale = sorted(
            p.name for p in out.glob("model-*-of-*.safetensors") if p.name not in set(names)
        )
        if stale:
            logger.warning(
                "jzero: %s also holds %s from an earlier export; the new index does not name "
                "them. Delete them if they are not needed.",
                out,
                ", ".join(stale[:5]) + (" ..." if len(stale) > 5 else ""),
            )
    barrier("jzero_export_index")
    return index
