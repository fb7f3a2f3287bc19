"""Exports read back: a safetensors file (jzero's or any other writer's), a jzero ``.npz``,
or Hugging Face's sharded layout, as the nested parameters; and the format's names and dtype
tables, which :mod:`jzero.weights.export` writes with.

Decisions:

* **A weight file is untrusted input** (a download, a folder from elsewhere), checked before any
  of it is used, and every refusal is one ``ValueError`` naming the file and the field: a file
  under 8 bytes; a header length past the end of the file or over the format's 100 MB limit
  (checked before the header is read); a header that is not UTF-8 JSON, not an object, or that
  names a tensor twice; a ``__metadata__`` that is not an object of strings, or whose
  ``jzero.paths`` is not a map of names to paths; a tensor entry that is not an object, a
  ``dtype`` outside the table (naming the readable ones), a ``shape`` that is not a list of
  non-negative integers, ``data_offsets`` that are not two integers ``0 <= begin <= end``, a
  byte span that is not what the shape and dtype need, or one that ends past the end of the
  file. Sizes are exact Python integers, checked against the file before a buffer is
  allocated.
* **An index may name only files inside its own folder** (:func:`read_index`): a
  ``weight_map`` that is not an object of strings, or that names a file by an absolute path,
  through ``..``, or through a symlink leading out of the folder, is refused before any file
  is opened; otherwise an index could make jzero read any file the user can read into the
  weights (and from there into an export).
* A whole file is read through the ``safetensors`` package (``safe_open``, its numpy
  framework; this is the one module that imports it), tensor by tensor, after the checks
  above: a file they let through that the package refuses (tensors not packed end to end) is
  one more ``ValueError`` naming the file. The package swaps the little-endian bytes on a
  big-endian host.
* The nesting comes from the exact paths jzero stores (``jzero.paths`` in the header's
  ``__metadata__``, or in a sharded index's ``metadata``); a key without one (another writer's
  file) is split on its dots. A level whose keys are exactly ``0 .. n-1`` becomes a list.
* A ``.npz`` records each tensor's dtype by name beside the paths (numpy's format has no
  bfloat16); a member stored in another dtype is viewed as the recorded one.
* This module writes nothing and imports no JAX. Its public names are :mod:`jzero.weights`'s
  (``jzero.weights.load_exported``, ``jzero.weights.read_index``).
* One check of a header entry against the file (:func:`tensor_layout`: dtype, shape, offsets)
  serves this reader and the sharded one (:mod:`jzero.weights.sharded`).
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

__all__ = [
    "tensor_layout",
    "index_file",
    "INDEX_NAME",
    "PATHS_KEY",
    "PathEntry",
    "load_exported",
    "read_index",
    "read_safetensors_header",
]


PATHS_KEY = "jzero.paths"
INDEX_NAME = "model.safetensors.index.json"
NPZ_TABLE = "__jzero__"

# safetensors dtype names <-> numpy dtypes.
TO_ST = {
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
_FROM_ST = {v: k for k, v in TO_ST.items()}
_BY_NAME = {d.name: d for d in TO_ST}

PathEntry = str | int

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on the JSON header
_FIX = "Download or export it again; jzero reads safetensors files as their format defines them."


def _invalid(path: str | os.PathLike, problem: str) -> ValueError:
    """The error for a weight file that is not what it claims: the file, the field, the fix."""
    return ValueError(f"{str(path)!r} is not a valid safetensors file: {problem}. {_FIX}")


class _Duplicate(ValueError):
    """A JSON object that gives one name twice."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _parse_json(text: str | bytes, what: str) -> Any:
    """``text`` parsed as JSON, a name given twice in one object refused.

    Raises:
      ValueError: saying what is wrong with ``what`` (the caller names the file).
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise ValueError(f"{what} names {e.args[0]!r} twice") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not JSON ({e.msg} at character {e.pos})") from None


def _json(text: str | bytes, path: str | os.PathLike, what: str) -> Any:
    """:func:`_parse_json` for a part of the safetensors file ``path``."""
    try:
        return _parse_json(text, what)
    except ValueError as e:
        raise _invalid(path, str(e)) from None


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts.

    The header's structure is checked (an object; a ``__metadata__`` of strings); each
    tensor's entry is checked against the file by :func:`tensor_layout`.

    Raises:
      ValueError: naming the file and what is wrong with it.
    """
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
        if n > MAX_HEADER_BYTES:
            raise _invalid(path, f"its header claims {n:,} bytes, over the format's limit")
        header = _json(f.read(n), path, "its header")
    if not isinstance(header, dict):
        raise _invalid(
            path, f"its header is a JSON {type(header).__name__}, not an object of tensors"
        )
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _invalid(path, "'__metadata__' is not an object of strings")
    return header, 8 + n


def _known_paths(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """The exact leaf paths jzero stored in a header's or an index's metadata (``jzero.paths``):
    tensor name -> path entries (``str`` or ``int``); ``{}`` when there are none.

    Raises:
      ValueError: saying what is wrong with the record (``where`` names its place); the caller
        names the file.
    """
    text = meta.get(PATHS_KEY)
    if text is None:
        return {}
    field = f"{where}{PATHS_KEY!r}"
    known = _parse_json(text, field) if isinstance(text, str) else text
    ok = isinstance(known, dict) and all(
        isinstance(v, list)
        and v
        and all(isinstance(e, str) or (isinstance(e, int) and not isinstance(e, bool)) for e in v)
        for v in known.values()
    )
    if not ok:
        raise ValueError(f"{field} is not a map of tensor names to lists of path entries")
    return known


def _nest(flat: dict[tuple[PathEntry, ...], np.ndarray]) -> Any:
    """Builds nested dicts (and lists where every key of a level is an index) from paths.

    Raises:
      ValueError: when one tensor's path is a prefix of another's (they can't both be leaves).
    """
    root: dict[Any, Any] = {}
    for path, x in flat.items():
        node = root
        for i, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"tensors nest into the tensor at {list(path[: i + 1])}")
        last = path[-1] if path else ""
        if last in node:
            raise ValueError(f"two tensors have the path {list(path)}")
        node[last] = x

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


def _is_count(x: Any) -> bool:
    """A non-negative JSON integer (``true`` is not one)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def tensor_layout(
    key: str, info: Any, path: Path, start: int, size: int
) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """A safetensors header entry checked against the file: its dtype, shape and data offsets
    (``begin``, ``end`` after ``start``), or a ``ValueError`` naming the tensor, the field and
    the file. Nothing is allocated before the sizes check out."""
    where = f"tensor {key!r}"
    if not isinstance(info, dict):
        raise _invalid(
            path,
            f"{where} is a JSON {type(info).__name__}, not an object with 'dtype', 'shape' and "
            "'data_offsets'",
        )
    name = info.get("dtype")
    dtype = _FROM_ST.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ValueError(
            f"Tensor {key!r} in {str(path)!r} has dtype {name}, which jzero can't read; "
            f"readable dtypes are {sorted(_FROM_ST)}."
        )
    shape = info.get("shape")
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise _invalid(path, f"{where}: 'shape' is {shape!r}, not a list of integers >= 0")
    offsets = info.get("data_offsets")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(n) for n in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise _invalid(
            path,
            f"{where}: 'data_offsets' is {offsets!r}, not two integers [begin, end] with "
            "0 <= begin <= end",
        )
    begin, end = offsets
    if math.prod(n for n in shape if n) * dtype.itemsize > size:
        raise _invalid(path, f"{where}: 'shape' {shape} is larger than the whole file")
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise _invalid(
            path,
            f"{where}: 'data_offsets' {offsets} span {end - begin} bytes, but 'shape' {shape} "
            f"of {name} needs {nbytes}",
        )
    if start + end > size:
        raise ValueError(
            f"Tensor {key!r} in {str(path)!r} has data offsets {offsets} that end past the end "
            f"of the file (its data holds {size - start} bytes); the file is truncated or damaged."
        )
    return dtype, tuple(shape), begin, end


def _read_safetensors(p: Path, known: dict[str, Any] | None = None) -> dict:
    header, start = read_safetensors_header(p)
    meta = header.pop("__metadata__", None) or {}
    size = os.path.getsize(p)
    layouts = {key: tensor_layout(key, info, p, start, size) for key, info in header.items()}
    if not known:  # a sharded index's record, else the file's own
        try:
            known = _known_paths(meta, "'__metadata__' ")
        except ValueError as e:
            raise _invalid(p, str(e)) from None
    paths = _paths(list(header), known)
    flat = {}
    try:
        with safe_open(p, framework="np") as f:
            for key, (dtype, shape, _, _) in layouts.items():
                arr = np.array(f.get_tensor(key), copy=True)  # writable, little-endian read
                flat[paths[key]] = arr.reshape(shape).view(dtype)
    except SafetensorError as e:  # what this module's checks let through and the format does not
        raise _invalid(p, f"the safetensors reader refuses it ({e})") from None
    return flat


def index_file(root: Path, name: str, index: Path) -> Path:
    """The file ``name`` an index in ``root`` names, once it is there (a regular file).

    Raises:
      FileNotFoundError: naming the index and the missing file.
    """
    f = root / name
    if not f.is_file():
        raise FileNotFoundError(
            f"The index {str(index)!r} names the file {name!r}, which is not there. Copy the "
            "whole export."
        )
    return f


def _inside(root: Path, name: str) -> bool:
    """Whether ``name`` (as an index writes it) is a file inside ``root``: relative, no ``..``
    and, once symlinks are resolved, still under ``root``."""
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts:
        return False
    return (root / name).resolve().is_relative_to(root.resolve())


def read_index(path: str | os.PathLike) -> tuple[Path, dict[str, str], dict[str, Any]]:
    """A sharded export's index: its directory, ``weight_map`` and ``metadata``.

    The index is untrusted: ``weight_map`` must map tensor names to the names of files inside
    the index's own folder (see the module's decisions).

    Args:
      path: the directory holding ``model.safetensors.index.json``, or the index file.

    Raises:
      FileNotFoundError: no index there.
      ValueError: naming the index and the entry that is wrong.
    """
    p = Path(path)
    index = p / INDEX_NAME if p.is_dir() else p
    if not index.is_file():
        raise FileNotFoundError(
            f"{str(p)!r} holds no {INDEX_NAME}; pass a safetensors file or a directory written "
            "by a sharded export (Hugging Face's layout)."
        )
    fix = "Use the export as it was written, or fix the index."
    try:
        data = _parse_json(index.read_bytes(), "its text")
    except ValueError as e:
        raise ValueError(f"{str(index)!r} is not a safetensors index: {e}. {fix}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{str(index)!r} is not a safetensors index: it needs a 'weight_map' object. {fix}"
        )
    meta = data.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"{str(index)!r}: 'metadata' is not an object. {fix}")
    root = index.parent
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise ValueError(
                f"{str(index)!r}: 'weight_map' gives tensor {key!r} the file {name!r}, which is "
                f"not a file name. {fix}"
            )
        if not _inside(root, name):
            raise ValueError(
                f"{str(index)!r}: 'weight_map' places tensor {key!r} in {name!r}, which is not "
                f"inside the index's folder {str(root)!r}; an index may name only files in its "
                f"own folder (no absolute path, no '..', no symlink leading out). {fix}"
            )
    return root, dict(weight_map), dict(meta or {})


def _read_npz(p: Path) -> dict:
    """A jzero ``.npz`` export's tensors by path (no pickles); errors name the file."""
    try:
        with np.load(p, allow_pickle=False) as z:
            table = _parse_json(str(z[NPZ_TABLE]), NPZ_TABLE) if NPZ_TABLE in z.files else {}
            paths_field = table.get("paths", {}) if isinstance(table, dict) else None
            if not (isinstance(paths_field, dict) and isinstance(table.get("dtypes", {}), dict)):
                raise ValueError(f"{NPZ_TABLE!r} is not an object of 'paths' and 'dtypes'")
            keys = [k for k in z.files if k != NPZ_TABLE]
            known = _known_paths({PATHS_KEY: paths_field}, f"{NPZ_TABLE!r} ")
            paths = _paths(keys, known)
            flat = {}
            for k in keys:
                x = z[k]
                want = _BY_NAME.get(table.get("dtypes", {}).get(k), x.dtype)
                flat[paths[k]] = x.view(want) if x.dtype != want else x
            return flat
    except (ValueError, KeyError, TypeError, OSError, EOFError, zipfile.BadZipFile) as e:
        if str(p) in str(e):  # already names the file
            raise
        raise ValueError(
            f"{str(p)!r} is not a valid jzero .npz export: {e}. Export it again."
        ) from None


def load_exported(path: str | os.PathLike) -> Any:
    """Reads an exported file back as the nested dict (lists where the params had lists).

    Args:
      path: a ``.safetensors`` file (from jzero or any other writer), a jzero ``.npz``, or a
        sharded export (its directory or its ``model.safetensors.index.json``).

    Returns:
      The parameters as numpy arrays (``bfloat16`` as ``ml_dtypes.bfloat16``), nested like
      the exported tree, ready for ``jzero.initialize(params=...)``.

    Raises:
      ValueError: a malformed file or index, naming it and the field (see the decisions).
    """
    p = Path(path)
    if p.is_dir() or p.name.endswith(".index.json"):
        root, weight_map, meta = read_index(p)
        index = root / INDEX_NAME if p.is_dir() else p
        try:
            known = _known_paths(meta, "'metadata' ")
        except ValueError as e:
            raise ValueError(f"{str(index)!r} is not a valid safetensors index: {e}.") from None
        flat = {}
        for name in dict.fromkeys(weight_map.values()):
            flat.update(_read_safetensors(index_file(root, name, index), known))
        where = index
    elif not p.is_file():
        raise FileNotFoundError(f"The export file {str(p)!r} does not exist.")
    else:
        flat = _read_npz(p) if p.suffix == ".npz" else _read_safetensors(p)
        where = p
    try:
        return _nest(flat)
    except ValueError as e:
        raise ValueError(f"The tensors of {str(where)!r} do not form one tree: {e}.") from None
