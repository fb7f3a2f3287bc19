"""Exports read back: a safetensors file (jzero's or any other writer's), a jzero ``.npz``,
or Hugging Face's sharded layout, as the nested parameters; and the format's names and dtype
tables, which :mod:`jzero.weights.export` writes with.

Decisions:

* A header is checked before it is trusted: a file under 8 bytes, or a header length past the
  end of the file, is refused as not safetensors; a tensor whose bytes end past the end of the
  file is refused as truncated; a dtype outside the table is refused, naming the readable ones.
* Each tensor is read with its own ``seek`` and ``read`` and copied out of the buffer, one at a
  time; on a big-endian host the little-endian bytes are swapped.
* The nesting comes from the exact paths jzero stores (``jzero.paths`` in the header's
  ``__metadata__``, or in a sharded index's ``metadata``); a key without one (another writer's
  file) is split on its dots. A level whose keys are exactly ``0 .. n-1`` becomes a list.
* A ``.npz`` records each tensor's dtype by name beside the paths (numpy's format has no
  bfloat16); a member stored in another dtype is viewed as the recorded one.
* This module writes nothing and imports no JAX. Its public names are :mod:`jzero.weights`'s
  (``jzero.export.load_exported`` and ``read_index`` keep working through the alias module).
* One check of a header entry against the file (:func:`tensor_layout`: dtype, shape, offsets)
  serves this reader and the sharded one (:mod:`jzero.weights.sharded`).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "tensor_layout",
    "INDEX_NAME",
    "PATHS_KEY",
    "PathEntry",
    "load_exported",
    "read_index",
    "read_safetensors_header",
]


PATHS_KEY = "jzero.paths"
INDEX_NAME = "model.safetensors.index.json"
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


def tensor_layout(
    key: str, info: dict[str, Any], path: Path, start: int, size: int
) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """A safetensors header entry checked against the file: its dtype, shape and data offsets
    (``begin``, ``end`` after ``start``), or a ``ValueError`` naming the tensor and the file."""
    dtype = _FROM_ST.get(info.get("dtype"))
    if dtype is None:
        raise ValueError(
            f"Tensor {key!r} in {str(path)!r} has dtype {info.get('dtype')}, which jzero "
            f"can't read; readable dtypes are {sorted(_FROM_ST)}."
        )
    shape = tuple(int(n) for n in info["shape"])
    begin, end = (int(n) for n in info["data_offsets"])
    if start + end > size or end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(
            f"Tensor {key!r} in {str(path)!r} has data offsets {info['data_offsets']} that "
            "do not fit its shape or the file; the file is truncated or damaged."
        )
    return dtype, shape, begin, end


def _read_safetensors(p: Path, known: dict[str, Any] | None = None) -> dict:
    header, start = read_safetensors_header(p)
    meta = header.pop("__metadata__", None) or {}
    paths = _paths(list(header), known or json.loads(meta.get(PATHS_KEY, "{}")))
    size = os.path.getsize(p)
    flat = {}
    with open(p, "rb") as f:
        for key, info in header.items():
            dtype, shape, begin, end = tensor_layout(key, info, p, start, size)
            f.seek(start + begin)
            arr = np.frombuffer(f.read(end - begin), dtype=dtype).reshape(shape).copy()
            if sys.byteorder == "big" and dtype.itemsize > 1:
                arr = arr.byteswap()
            flat[paths[key]] = arr
    return flat


def read_index(path: str | os.PathLike) -> tuple[Path, dict[str, str], dict[str, Any]]:
    """A sharded export's index: its directory, ``weight_map`` and ``metadata``.

    Args:
      path: the directory holding ``model.safetensors.index.json``, or the index file.
    """
    p = Path(path)
    index = p / INDEX_NAME if p.is_dir() else p
    if not index.is_file():
        raise FileNotFoundError(
            f"{str(p)!r} holds no {INDEX_NAME}; pass a safetensors file or a directory written "
            "by a sharded export (Hugging Face's layout)."
        )
    try:
        data = json.loads(index.read_text())
        weight_map = dict(data["weight_map"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{str(index)!r} is not a safetensors index: it needs a 'weight_map' object."
        ) from e
    return index.parent, weight_map, dict(data.get("metadata") or {})


def load_exported(path: str | os.PathLike) -> Any:
    """Reads an exported file back as the nested dict (lists where the params had lists).

    Args:
      path: a ``.safetensors`` file (from jzero or any other writer), a jzero ``.npz``, or a
        sharded export (its directory or its ``model.safetensors.index.json``).

    Returns:
      The parameters as numpy arrays (``bfloat16`` as ``ml_dtypes.bfloat16``), nested like
      the exported tree, ready for ``jzero.initialize(params=...)``.
    """
    p = Path(path)
    if p.is_dir() or p.name.endswith(".index.json"):
        root, weight_map, meta = read_index(p)
        known = json.loads(meta.get(PATHS_KEY, "{}"))
        flat = {}
        for name in dict.fromkeys(weight_map.values()):
            flat.update(_read_safetensors(root / name, known))
        return _nest(flat)
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
    return _nest(_read_safetensors(p))
