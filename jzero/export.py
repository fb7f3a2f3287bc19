"""Exported parameters: one safetensors (or ``.npz``) file, written leaf by leaf, read back nested.

Decisions:

* The safetensors format is written here directly (an 8-byte little-endian header length, a
  JSON header with ``dtype``, ``shape`` and ``data_offsets`` per tensor, then the raw
  little-endian bytes), so exporting needs no extra dependency. The header is padded with
  spaces to a multiple of 8 bytes, as other writers do.
* Every offset is computed from shapes and dtypes before any data is read; the data is then
  fetched and written one leaf at a time, so host memory stays near the largest leaf.
* Keys are the dotted leaf paths (``blocks.w``). The exact path of every key (which parts are
  list indices, and dict keys that contain dots) is stored in the header's ``__metadata__``
  (``jzero.paths``), so :func:`load_exported` gives back the same nesting as the parameters.
* A file is written under a temporary name and renamed when complete: a crash never leaves a
  half-written export under the requested name.
* This module knows nothing about checkpoints (no Orbax): :mod:`jzero.checkpoint.info` reads
  the leaves (through :mod:`jzero.checkpoint.orbax_io`) and calls :func:`write_leaves`.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["ExportEntry", "load_exported", "read_safetensors_header", "write_leaves"]

PATHS_KEY = "jzero.paths"
_NPZ_TABLE = "__jzero__"

# safetensors dtype names <-> numpy dtypes.
_TO_ST = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
_FROM_ST = {v: k for k, v in _TO_ST.items()}
_BY_NAME = {d.name: d for d in _TO_ST}

PathEntry = str | int


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
        if np.dtype(e.dtype) not in _TO_ST:
            raise ValueError(
                f"Leaf {e.key!r} has dtype {np.dtype(e.dtype).name}, which safetensors can't "
                f"store; the supported dtypes are {sorted(d.name for d in _TO_ST)}. "
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
            "dtype": _TO_ST[np.dtype(e.dtype)],
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
        with zf.open(_NPZ_TABLE + ".npy", mode="w") as member:
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
    # A fresh file created exclusively beside ``out``: never a pre-existing name (a symlink
    # there is never written through), renamed onto ``out`` only once it is complete.
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    tmp = Path(name)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the permissions a plain open() would give
        with os.fdopen(fd, "wb") as f:
            if out.suffix == ".npz":
                _write_npz(f, entries, fetch)
            else:
                _write_safetensors(f, entries, fetch)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{str(path)!r} is not a safetensors file: it has under 8 bytes.")
        (n,) = struct.unpack("<Q", head)
        size = os.path.getsize(path)
        if n > size - 8:
            raise ValueError(
                f"{str(path)!r} is not a valid safetensors file: its header claims {n} bytes but "
                f"the file has {size}. The file is truncated or of another format."
            )
        header = json.loads(f.read(n).decode("utf-8"))
    return header, 8 + n


def _nest(flat: dict[tuple[PathEntry, ...], np.ndarray]) -> Any:
    """Builds nested dicts (and lists where every key of a level is an index) from paths."""
    root: dict[Any, Any] = {}
    for path, x in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1] if path else ""] = x

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: listify(v) for k, v in node.items()}
        if items and all(isinstance(k, int) for k in items):
            if sorted(items) == list(range(len(items))):
                return [items[i] for i in range(len(items))]
        return items

    return listify(root)


def _paths(keys: Sequence[str], known: dict[str, Any]) -> dict[str, tuple[PathEntry, ...]]:
    return {k: tuple(known[k]) if k in known else tuple(k.split(".")) for k in keys}


def load_exported(path: str | os.PathLike) -> Any:
    """Reads an exported file back as the nested dict (lists where the params had lists).

    Args:
      path: a ``.safetensors`` file (from jzero or any other writer) or a jzero ``.npz``.

    Returns:
      The parameters as numpy arrays (``bfloat16`` as ``ml_dtypes.bfloat16``), nested like
      the exported tree, ready for ``jzero.initialize(params=...)``.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"The export file {str(p)!r} does not exist.")
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            table = json.loads(str(z[_NPZ_TABLE])) if _NPZ_TABLE in z.files else {}
            keys = [k for k in z.files if k != _NPZ_TABLE]
            paths = _paths(keys, table.get("paths", {}))
            dtypes = table.get("dtypes", {})
            flat = {}
            for k in keys:
                x = z[k]
                if k in dtypes and x.dtype != _BY_NAME.get(dtypes[k], x.dtype):
                    x = x.view(_BY_NAME[dtypes[k]])
                flat[paths[k]] = x
            return _nest(flat)
    header, start = read_safetensors_header(p)
    meta = header.pop("__metadata__", None) or {}
    paths = _paths(list(header), json.loads(meta.get(PATHS_KEY, "{}")))
    flat = {}
    with open(p, "rb") as f:
        for key, info in header.items():
            if info["dtype"] not in _FROM_ST:
                raise ValueError(
                    f"Tensor {key!r} in {str(p)!r} has dtype {info['dtype']}, which jzero can't "
                    f"read; readable dtypes are {sorted(_FROM_ST)}."
                )
            dtype = _FROM_ST[info["dtype"]]
            begin, end = info["data_offsets"]
            f.seek(start + begin)
            buf = f.read(end - begin)
            if len(buf) != end - begin:
                raise ValueError(
                    f"Tensor {key!r} in {str(p)!r} ends past the end of the file; the file is "
                    "truncated. Export it again."
                )
            arr = np.frombuffer(buf, dtype=dtype).reshape(info["shape"]).copy()
            if sys.byteorder == "big" and dtype.itemsize > 1:
                arr = arr.byteswap()
            flat[paths[key]] = arr
    return _nest(flat)
