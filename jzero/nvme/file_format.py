"""The NVMe store's file format: one key's arrays in one CRC-checked file.

:class:`jzero.nvme.NvmeStore` keeps each key's arrays in one file; this module lays out,
writes, reads and checks such a file. It knows nothing of keys, threads or buffers.

Decisions:

* A file is a fixed prefix (magic, header length, header CRC-32), a JSON header naming each
  array's dtype, shape, offset, byte count and CRC-32, and the raw bytes, each array starting
  at a 4 KiB boundary. Every read checks the magic, the header's CRC, the file's size against
  the header and each array's CRC, so a missing, truncated, resized or corrupted file raises
  :class:`NvmeIOError` naming the file, what was expected and what was found; never stale or
  wrong bits.
* Writes go to a temporary name in the same directory and are moved over the old file with
  ``os.replace``, so a failed or interrupted write leaves the previous content whole.
  ``fsync`` is off by default: the store is scratch space for one run (the durable copy is
  the checkpoint), so it needs atomic replacement, not durability after power loss.
* Buffered I/O through the page cache, not DeepSpeed's ``O_DIRECT`` with libaio (numpy
  buffers are not block-aligned). ``page_cache=False`` asks the kernel to drop a file's pages
  after each read and write (``fdatasync`` and ``posix_fadvise(DONTNEED)``), so that host RAM,
  which NVMe offload is meant to spare, does not fill with cached state.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, for np.dtype(name))
import numpy as np

_MAGIC = b"JZNVME\x00\x01"
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
_ALIGN = 4096
SUFFIX = ".jznv"
TMP = ".jznv.tmp-"


class NvmeIOError(OSError):
    """A store file that is missing, truncated, corrupted or of another layout than expected,
    or a write that failed; the message names the file."""


def host_arrays(arrays: Sequence[Any]) -> list[np.ndarray]:
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, Sequence):
        raise ValueError(
            f"Pass the arrays of one key as a list, got {type(arrays).__name__}; e.g. "
            "store.write(key, [mu, nu])."
        )
    out = []
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would make 0-d arrays 1-d)
            a = np.array(a, order="C")
        if a.dtype.hasobject:
            raise ValueError(
                f"Array {i} has dtype {a.dtype}, which holds Python objects; the NVMe store "
                "keeps numeric arrays only (host copies of jax arrays)."
            )
        out.append(a)
    return out


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (works for bfloat16 and 0-d arrays)."""
    return a.reshape(-1).view(np.uint8)


def _layout(arrays: list[np.ndarray]) -> tuple[bytes, list[int]]:
    """The file prefix + header, and each array's offset."""
    entries: list[dict[str, Any]] = [
        {"dtype": a.dtype.name, "shape": list(a.shape), "nbytes": int(a.nbytes)} for a in arrays
    ]
    for e, a in zip(entries, arrays, strict=True):
        e["crc32"] = zlib.crc32(_bytes_of(a))
    # Offsets depend on the header's length, which depends on the offsets' digits: iterate.
    offsets = [0] * len(arrays)
    while True:
        for e, off in zip(entries, offsets, strict=True):
            e["offset"] = off
        header = json.dumps({"version": 1, "arrays": entries}, separators=(",", ":")).encode()
        start = _round_up(_PREFIX.size + len(header))
        new, pos = [], start
        for a in arrays:
            new.append(pos)
            pos = _round_up(pos + a.nbytes)
        if new == offsets:
            prefix = _PREFIX.pack(_MAGIC, len(header), zlib.crc32(header))
            return prefix + header, offsets
        offsets = new


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def write_file(
    directory: str, name: str, arrays: list[np.ndarray], fsync: bool, page_cache: bool
) -> int:
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f"{name[: -len(SUFFIX)]}{TMP}{uuid.uuid4().hex[:8]}")
    try:
        head, offsets = _layout(arrays)
        with open(tmp, "wb") as f:
            f.write(head)
            for a, off in zip(arrays, offsets, strict=True):
                f.seek(off)
                f.write(_bytes_of(a))
            size = max([len(head)] + [o + a.nbytes for a, o in zip(arrays, offsets, strict=True)])
            f.truncate(size)  # a trailing empty array ends past the last byte written
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            elif not page_cache:
                os.fdatasync(f.fileno())  # written pages must be clean before they can drop
            if not page_cache:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, final)
        if fsync:
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return size
    except OSError as e:
        unlink_quietly(tmp)
        raise NvmeIOError(
            f"Writing {final} failed: {e.strerror or e}. The previous content of that file, if "
            "any, is kept. Check the drive's free space and permissions (nvme_path)."
        ) from e
    except BaseException:
        unlink_quietly(tmp)
        raise


def _read_exactly(f: Any, buf: memoryview | np.ndarray, path: str, what: str) -> None:
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise NvmeIOError(
                f"{path} is truncated: {what} needs {len(view):,} bytes but only {got:,} could be "
                "read. The file was cut short (a crash while writing, or a full drive)."
            )
        got += n


def read_file(path: str, page_cache: bool) -> list[np.ndarray]:
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115
    except FileNotFoundError as e:
        raise NvmeIOError(
            f"{path} is missing: the store expected this file (was the key written, or was the "
            "file removed?)."
        ) from e
    except OSError as e:
        raise NvmeIOError(f"Opening {path} failed: {e.strerror or e}.") from e
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            prefix = bytearray(_PREFIX.size)
            _read_exactly(f, memoryview(prefix), path, "the file prefix")
            magic, hlen, hcrc = _PREFIX.unpack(bytes(prefix))
            if magic != _MAGIC:
                raise NvmeIOError(
                    f"{path} is not an NVMe store file: expected the magic bytes {_MAGIC!r}, found "
                    f"{magic!r}. It was overwritten or corrupted."
                )
            if _PREFIX.size + hlen > size:
                raise NvmeIOError(
                    f"{path} is truncated or corrupted: its header is said to be {hlen:,} bytes, "
                    f"but the file has {size:,}."
                )
            header = bytearray(hlen)
            _read_exactly(f, memoryview(header), path, "the header")
            if zlib.crc32(header) != hcrc:
                raise NvmeIOError(
                    f"{path} is corrupted: its header's CRC-32 is {zlib.crc32(header):#010x}, "
                    f"expected {hcrc:#010x}."
                )
            entries = json.loads(bytes(header))["arrays"]
            expected = max((e["offset"] + e["nbytes"] for e in entries), default=0)
            expected = max(expected, _PREFIX.size + hlen)
            if size != expected:
                kind = "truncated" if size < expected else "longer than its header says"
                raise NvmeIOError(f"{path} is {kind}: expected {expected:,} bytes, found {size:,}.")
            out = []
            for i, e in enumerate(entries):
                a = np.empty(tuple(e["shape"]), np.dtype(e["dtype"]))
                if a.nbytes != e["nbytes"]:
                    raise NvmeIOError(
                        f"{path}: array {i} is {e['dtype']}{tuple(e['shape'])}, which is "
                        f"{a.nbytes:,} bytes, but the header says {e['nbytes']:,}."
                    )
                f.seek(e["offset"])
                _read_exactly(f, _bytes_of(a), path, f"array {i}")
                crc = zlib.crc32(_bytes_of(a))
                if crc != e["crc32"]:
                    raise NvmeIOError(
                        f"{path} is corrupted: array {i} ({e['dtype']}{tuple(e['shape'])}) has "
                        f"CRC-32 {crc:#010x}, expected {e['crc32']:#010x}. The drive or "
                        "something else changed the file after it was written."
                    )
                out.append(a)
            if not page_cache:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return out
    except (ValueError, KeyError, TypeError) as e:  # a header that is not ours
        raise NvmeIOError(f"{path} has an unreadable header ({e}); it is corrupted.") from e
    except NvmeIOError:
        raise
    except OSError as e:
        raise NvmeIOError(f"Reading {path} failed: {e.strerror or e}.") from e


def check_like(path: str, arrays: list[np.ndarray], like: Sequence[Any]) -> None:
    want = [(tuple(x.shape), np.dtype(x.dtype)) for x in like]
    got = [(a.shape, a.dtype) for a in arrays]
    if want != got:
        show = lambda xs: ", ".join(f"{d.name}{s}" for s, d in xs) or "nothing"  # noqa: E731
        raise NvmeIOError(
            f"{path} holds [{show(got)}], but [{show(want)}] was expected. The file belongs to "
            "another layout (a different model, sub_group_size or mesh)."
        )


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
