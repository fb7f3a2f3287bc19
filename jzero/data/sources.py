"""Document sources: each reads a corpus from files into documents with random access.

Kinds (``SOURCES``): ``text``, ``jsonl``, ``parquet``, ``arrayrecord``, ``tokens``, ``stdlib``.
Each takes a path, several paths or globs (expanded, sorted, each match read once in order).

Decisions:

* Text-like sources (:class:`TextDocs`) yield one string or byte string per document with its
  place (``file:line``, ``file record i``, ``file row i``), so a later error names it. Text files
  are read as bytes (a non-UTF-8 file still works with the ``bytes`` tokenizer).
* ``text``: one document per file, or the file split on ``separator`` (empty pieces dropped).
* ``tokens`` (:class:`TokenDocs`): ``.npy`` (1-D integers, memory-mapped) or ``.bin`` (raw
  ``dtype``, default ``uint16``); documents end after each ``eos_id`` when one is given, else the
  file is one document. Nothing is copied: documents are offsets into the mapped file.
* ``stdlib``: the Python standard library's ``.py`` files (tests and ``site-packages``
  skipped), sorted by relative path, one document each, at most ``max_bytes`` (8 MiB) in all:
  the same bytes on every machine with the same Python, without a download.
* pyarrow and array_record are imported only here, and only when their kind is read; a
  missing one is a :class:`DataError` naming ``pip install jzero[data]``.
* Every record is read when the source is built, so a bad one is found before training:
  an error naming it, or (``skip_bad_records``) skipped and counted in ``skipped``.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jzero.data.errors import DataError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "SOURCES",
    "SourceSpec",
    "TextDocs",
    "TokenDocs",
    "expand_paths",
    "read_source",
    "stdlib_files",
]

SOURCES = ("text", "jsonl", "parquet", "arrayrecord", "tokens", "stdlib")
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


@dataclass(frozen=True)
class SourceSpec:
    """One source: its ``kind``, ``paths`` (globs allowed), and the kind's options."""

    kind: str = "stdlib"
    paths: tuple[str, ...] = ()
    field: str = "text"
    separator: str | None = None
    dtype: str = "uint16"
    eos_id: int | None = None
    max_bytes: int | None = None

    def describe(self) -> str:
        """``kind(paths)``, as logs name the source."""
        return f"{self.kind}({', '.join(self.paths)})" if self.paths else self.kind


@dataclass
class TextDocs:
    """Documents to tokenize: ``texts[i]`` read at ``where[i]``."""

    texts: list[str | bytes]
    where: list[str]
    skipped: int = 0


@dataclass
class TokenDocs:
    """Pre-tokenized documents: file ``f`` is ``arrays[f]``, its documents start at
    ``starts[f]`` (each ends where the next starts, the last at the array's end)."""

    arrays: list[np.ndarray]
    starts: list[np.ndarray]
    files: list[str]
    skipped: int = field(default=0)


def expand_paths(kind: str, paths: Sequence[str]) -> list[Path]:
    """The files ``paths`` name, globs expanded (sorted) in order, each once.

    Raises:
        DataError: for no path, a missing path, or a glob matching nothing.
    """
    if not paths:
        raise DataError(
            f"Data source {kind!r} reads files but no path was given: set data.path (a file or "
            "glob) or data.paths (a list), or use source: stdlib, which needs no file."
        )
    found: list[Path] = []
    for pattern in paths:
        pattern = os.path.expanduser(str(pattern))
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
            matches = [p for p in matches if p.is_file()]
            if not matches:
                raise DataError(
                    f"Data source {kind!r}: the glob {pattern!r} matches no file. Fix the "
                    "pattern in data.path/data.paths."
                )
        elif Path(pattern).is_dir():
            matches = sorted(p for p in Path(pattern).rglob("*") if p.is_file())
            if not matches:
                raise DataError(f"Data source {kind!r}: the directory {pattern!r} is empty.")
        elif not Path(pattern).is_file():
            raise DataError(
                f"Data source {kind!r}: the file {pattern!r} does not exist. Fix the path in "
                "data.path/data.paths, or use source: stdlib, which needs no file."
            )
        else:
            matches = [Path(pattern)]
        found += [p for p in matches if p not in found]
    return found


def read_source(spec: SourceSpec, *, skip_bad_records: bool = False) -> TextDocs | TokenDocs:
    """Reads every document of ``spec``.

    Raises:
        DataError: for an unknown kind, a bad path, an unreadable file, a bad record (unless
            ``skip_bad_records``), or a source without a document.
    """
    if spec.kind not in SOURCES:
        raise DataError(f"Unknown data source {spec.kind!r}. It must be one of {SOURCES}.")
    if spec.separator == "":
        raise DataError("data.separator must not be empty; null reads one document per file.")
    if spec.max_bytes is not None and spec.max_bytes < 1:
        raise DataError(f"data.max_bytes must be positive or null, got {spec.max_bytes}.")
    if spec.kind == "stdlib":
        docs: TextDocs | TokenDocs = _stdlib(spec.max_bytes)
    else:
        files = expand_paths(spec.kind, spec.paths)
        reader = {
            "text": _text,
            "jsonl": _jsonl,
            "parquet": _parquet,
            "arrayrecord": _arrayrecord,
            "tokens": _tokens,
        }[spec.kind]
        docs = reader(files, spec, skip_bad_records)
    count = len(docs.texts) if isinstance(docs, TextDocs) else sum(map(len, docs.starts))
    if count == 0:
        raise DataError(
            f"Data source {spec.describe()} holds no document"
            + (f" ({docs.skipped} bad record(s) skipped)" if docs.skipped else "")
            + ". Point it at files with data, or fix the records."
        )
    return docs


def stdlib_files() -> list[Path]:
    """The Python standard library's ``.py`` files, in sorted order of their path relative to
    its root, test folders and ``site-packages`` left out: the same list on every machine with
    this Python version (the built-in corpus, here and in :mod:`jzero.demo.data`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _stdlib(max_bytes: int | None) -> TextDocs:
    budget = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    docs = TextDocs([], [])
    for path in stdlib_files():
        if budget <= 0:
            break
        data = path.read_bytes()[:budget]
        budget -= len(data)
        if data:
            docs.texts.append(data)
            docs.where.append(str(path))
    return docs


def _capped(data: bytes, spent: int, max_bytes: int | None) -> bytes:
    return data if max_bytes is None else data[: max(0, max_bytes - spent)]


def _text(files: list[Path], spec: SourceSpec, skip: bool) -> TextDocs:
    docs, spent = TextDocs([], []), 0
    for path in files:
        data = _capped(path.read_bytes(), spent, spec.max_bytes)
        spent += len(data)
        if spec.separator is None:
            pieces = [(data, 1)]
        else:
            pieces, sep, pos, counted, line = [], spec.separator.encode(), 0, 0, 1
            for piece in data.split(sep):
                if piece.strip():
                    start = pos + len(piece) - len(piece.lstrip())
                    line += data.count(b"\n", counted, start)
                    counted = start
                    pieces.append((piece, line))
                pos += len(piece) + len(sep)
        for piece, line in pieces:
            if piece:
                docs.texts.append(piece)
                docs.where.append(f"{path}:{line}")
    return docs


def _bad(docs: TextDocs | TokenDocs, skip: bool, message: str) -> None:
    if not skip:
        raise DataError(message + " Fix the record, or set data.skip_bad_records: true.")
    docs.skipped += 1


def _jsonl(files: list[Path], spec: SourceSpec, skip: bool) -> TextDocs:
    docs, spent = TextDocs([], []), 0
    for path in files:
        with path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if spec.max_bytes is not None and spent >= spec.max_bytes:
                    return docs
                if not line.strip():
                    continue
                spent += len(line)
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    _bad(docs, skip, f"{where}: the line is not JSON ({err}).")
                    continue
                text = record.get(spec.field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    _bad(docs, skip, _no_field(where, spec.field, record))
                    continue
                docs.texts.append(text)
                docs.where.append(where)
    return docs


def _no_field(where: str, name: str, record: object) -> str:
    if not isinstance(record, dict):
        return f"{where}: the record is a {type(record).__name__}, not an object with {name!r}."
    if name not in record:
        return (
            f"{where}: the record has no field {name!r} (its fields: {sorted(record)}). Set "
            "data.field to the field holding the text."
        )
    return f"{where}: field {name!r} holds a {type(record[name]).__name__}, not a string."


def _import(module: str, kind: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise DataError(
            f"Data source {kind!r} needs {module.split('.')[0]}, which is not installed "
            f"({err}). Install the data extra: pip install jzero[data]."
        ) from err


def _parquet(files: list[Path], spec: SourceSpec, skip: bool) -> TextDocs:
    pq = _import("pyarrow.parquet", "parquet")
    docs = TextDocs([], [])
    for path in files:
        try:
            table = pq.read_table(path)
        except Exception as err:
            raise DataError(
                f"{path}: not a readable Parquet file, truncated or corrupt ({err}). Rewrite it, "
                "or remove it from data.path."
            ) from err
        if spec.field not in table.column_names:
            raise DataError(
                f"{path}: no column {spec.field!r} (its columns: {table.column_names}). Set "
                "data.field to the column holding the text."
            )
        for row, text in enumerate(table.column(spec.field).to_pylist()):
            if not isinstance(text, str | bytes):
                _bad(docs, skip, f"{path} row {row}: column {spec.field!r} holds {text!r}.")
                continue
            docs.texts.append(text)
            docs.where.append(f"{path} row {row}")
    return docs


def _arrayrecord(files: list[Path], spec: SourceSpec, skip: bool) -> TextDocs:
    module = _import("array_record.python.array_record_module", "arrayrecord")
    docs = TextDocs([], [])
    for path in files:
        try:
            reader = module.ArrayRecordReader(str(path))
            records = reader.read_all()
            reader.close()
        except Exception as err:
            raise DataError(
                f"{path}: not a readable ArrayRecord file, truncated or corrupt ({err}). Rewrite "
                "it, or remove it from data.path."
            ) from err
        for number, record in enumerate(records):
            where = f"{path} record {number}"
            try:
                text = record.decode("utf-8")
            except UnicodeDecodeError as err:
                _bad(docs, skip, f"{where}: not UTF-8 text ({err}).")
                continue
            if text.lstrip().startswith("{"):
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError as err:
                    _bad(docs, skip, f"{where}: starts with '{{' but is not JSON ({err}).")
                    continue
                text = parsed.get(spec.field) if isinstance(parsed, dict) else None
                if not isinstance(text, str):
                    _bad(docs, skip, _no_field(where, spec.field, parsed))
                    continue
            docs.texts.append(text)
            docs.where.append(where)
    return docs


def _tokens(files: list[Path], spec: SourceSpec, skip: bool) -> TokenDocs:
    docs = TokenDocs([], [], [])
    spent = 0
    for path in files:
        if path.suffix == ".npy":
            try:
                array = np.load(path, mmap_mode="r")
            except Exception as err:
                raise DataError(f"{path}: not a readable .npy file ({err}).") from err
            if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
                raise DataError(
                    f"{path} holds a {array.ndim}-D {array.dtype} array; a 1-D array of "
                    "integer token ids is needed. Save one with np.save."
                )
        elif path.suffix == ".bin":
            dtype = np.dtype(spec.dtype)
            size = path.stat().st_size
            if not np.issubdtype(dtype, np.integer) or size % dtype.itemsize:
                raise DataError(
                    f"{path}: {size} bytes is not a whole number of {dtype} tokens. Set "
                    "data.dtype to the dtype the file was written with (default uint16)."
                )
            array = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        else:
            raise DataError(
                f"{path}: a token file must end in .npy or .bin, not {path.suffix!r}. Use "
                "source: text (or jsonl, parquet, arrayrecord) for text."
            )
        if spec.max_bytes is not None:
            array = array[: max(0, spec.max_bytes - spent)]
        spent += len(array)
        if len(array) and np.issubdtype(array.dtype, np.signedinteger) and array.min() < 0:
            at = int(np.argmax(np.asarray(array) < 0))
            raise DataError(f"{path}: token {at} is negative ({int(array[at])}).")
        if spec.eos_id is None or not len(array):
            starts = np.zeros(1 if len(array) else 0, np.int64)
        else:
            ends = np.flatnonzero(np.asarray(array) == spec.eos_id) + 1
            starts = np.concatenate([[0], ends[ends < len(array)]]).astype(np.int64)
        docs.arrays.append(array)
        docs.starts.append(starts)
        docs.files.append(str(path))
    return docs
