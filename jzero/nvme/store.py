"""ZeRO-Infinity's NVMe tier: optimizer state and fp32 master weights in files.

DeepSpeed's ``offload_optimizer: {device: nvme, nvme_path: ...}`` keeps each process's shard of
the optimizer state (and the fp32 masters) in files on a local NVMe drive and streams it
through host memory one sub-group at a time (:mod:`jzero.subgroups`), prefetching the next
sub-group while the current one is updated and writing the previous one back behind it. This
module is the file side of that: :func:`check_nvme_path` and :class:`NvmeStore`.

Decisions:

* Plain files, one per key (a sub-group's shard: ``(group, shard)``), read and written by a
  ``ThreadPoolExecutor`` of ``buffer_count`` threads. File I/O and ``zlib.crc32`` release the
  GIL, so the threads overlap with each other and with the device. TensorStore (installed
  with Orbax) was the alternative; its array drivers add chunk layouts and JSON specs that a
  host copy of a few arrays does not need, and atomic replacement and checksums would still
  be ours to write. Plain files make both one line each and add no dependency.
* The file format (a CRC-checked header and arrays), atomic replacement by ``os.replace``,
  ``fsync`` and the page cache are :mod:`jzero.nvme.file_format`'s; see its docstring. A read of a
  key whose last write failed raises that write's error rather than returning the older
  content.
* At most ``buffer_count`` groups are in flight: writes not yet finished plus prefetched
  groups not yet read, each holding host memory. ``write_async`` and ``prefetch`` wait for the
  oldest write when the buffers are full; prefetching more groups than buffers without reading
  them is refused (waiting would never end).
* The store lives in its own new directory under ``nvme_path``
  (``jzero-nvme-<pid>-<random>``, or ``jzero-nvme-<run_id>``) and ``close`` (or interpreter
  exit) removes only the files it wrote there and then that directory; nothing else in
  ``nvme_path`` is ever touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from jzero._util import format_bytes, free_bytes
from jzero.nvme.file_format import (
    SUFFIX,
    TMP,
    NvmeIOError,
    check_like,
    host_arrays,
    read_file,
    unlink_quietly,
    write_file,
)

__all__ = ["NvmeIOError", "NvmeStore", "check_nvme_path"]

NVME_PATH_KEY = "zero_optimization.offload_optimizer.nvme_path"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")

Key = str | int | tuple[int | str, ...]


def check_nvme_path(
    path: str | os.PathLike, needed_bytes: int = 0, what: str = NVME_PATH_KEY
) -> str:
    """Checks that ``path`` is a writable directory with room for ``needed_bytes``.

    Args:
      path: the directory (DeepSpeed's ``nvme_path``).
      needed_bytes: the bytes the store will write there (0: no space check).
      what: the config key that named the path, for the messages.

    Returns:
      The absolute path.

    Raises:
      ValueError: naming the path and the fix when it does not exist, is not a directory, is
        not writable (checked with ``os.access`` and by creating and removing a probe file),
        or has fewer free bytes than ``needed_bytes`` (both counts in the message).
    """
    given = os.fspath(path)
    where = os.path.abspath(os.path.expanduser(given))
    if not os.path.exists(where):
        raise ValueError(
            f"{what} is {given!r}, which does not exist. Create the directory (mkdir -p "
            f"{where}) on a local NVMe drive, or set {what} to an existing one."
        )
    if not os.path.isdir(where):
        raise ValueError(
            f"{what} is {given!r}, which is a file, not a directory. Set {what} to a directory "
            "on a local NVMe drive; the store creates its own subdirectory there."
        )
    fix = f"Make it writable (chmod u+w {where}) or set {what} to a directory you can write."
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {where!r} is not writable by this process. {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jzero-nvme-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"{what} {where!r}: creating a file there failed ({e.strerror or e}). {fix}"
        ) from e
    free = free_bytes(where)
    if needed_bytes > free:
        raise ValueError(
            f"{what} {where!r} has {format_bytes(free)} free ({free:,} bytes), but the offloaded "
            f"state needs {format_bytes(needed_bytes)} ({int(needed_bytes):,} bytes). Free space "
            "there, set "
            f"{what} to a larger drive, or offload to host memory (offload_optimizer.device: "
            "cpu)."
        )
    return where


class NvmeStore:
    """Host arrays in files under ``path``: this process's shards of groups of leaves.

    Example:
      >>> store = NvmeStore("/local_nvme", buffer_count=4)
      >>> store.write_async((0, 0), [mu, nu, master])    # group 0, shard 0
      >>> store.prefetch((1, 0))                         # start reading group 1
      >>> mu, nu, master = store.read((1, 0))           # the prefetched result
      >>> store.flush()                                  # all writes done, or the first error
      >>> store.close()                                  # removes the store's directory

    Args:
      path: the directory (DeepSpeed's ``nvme_path``); checked by :func:`check_nvme_path`.
      run_id: names the store's subdirectory ``jzero-nvme-<run_id>`` (it must not exist yet);
        default ``jzero-nvme-<pid>-<random>``.
      buffer_count: the most groups in flight at once (DeepSpeed's
        ``offload_optimizer.buffer_count``), and the number of I/O threads.
      fsync: ``fsync`` each file (and the directory) before it replaces the old one.
      page_cache: ``False`` drops each file's pages from the page cache after every read and
        write, so cached state does not take the host memory offload is meant to free.
      needed_bytes: bytes the store will hold, for the free-space check.
      what: the config key that named ``path``, for messages.

    Raises:
      ValueError: from :func:`check_nvme_path`, for ``buffer_count < 1``, or for a ``run_id``
        whose directory exists.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        run_id: str | None = None,
        buffer_count: int = 4,
        *,
        fsync: bool = False,
        page_cache: bool = True,
        needed_bytes: int = 0,
        what: str = NVME_PATH_KEY,
    ) -> None:
        if int(buffer_count) < 1:
            raise ValueError(
                f"buffer_count is {buffer_count}, but at least 1 buffer is needed. Set "
                "offload_optimizer.buffer_count to 1 or more (DeepSpeed's default is 4)."
            )
        root = check_nvme_path(path, needed_bytes, what)
        if run_id is None:
            name = f"jzero-nvme-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        else:
            if not _NAME.match(str(run_id)):
                raise ValueError(
                    f"run_id {run_id!r} may hold only letters, digits, '_', '.' and '-'; "
                    "pass such a name or None for a random one."
                )
            name = f"jzero-nvme-{run_id}"
        self._dir = os.path.join(root, name)
        try:
            os.mkdir(self._dir, 0o700)
        except FileExistsError as e:
            raise ValueError(
                f"{self._dir!r} exists already: another store (or an earlier run) uses run_id "
                f"{run_id!r}. Pass another run_id, or None for a fresh directory, or remove "
                "that directory if no run uses it."
            ) from e
        self.buffer_count = int(buffer_count)
        self.fsync = bool(fsync)
        self.page_cache = bool(page_cache)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.buffer_count, thread_name_prefix="jzero-nvme")
        # Per file, its latest write until it is known to have succeeded (a failed one stays).
        self._writes: dict[str, Future] = {}
        self._pending: list[Future] = []  # writes in submission order, until flushed
        self._prefetched: dict[str, Future] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _remove_store, self._dir, self._pool)

    @property
    def directory(self) -> str:
        """The store's own directory (removed by :meth:`close`)."""
        return self._dir

    def path_of(self, key: Key) -> str:
        """The file that holds ``key``."""
        return os.path.join(self._dir, _file_name(key))

    # --- writing ------------------------------------------------------------------------------

    def write(self, key: Key, arrays: Sequence[np.ndarray]) -> int:
        """Writes ``arrays`` as ``key``'s file now, replacing any earlier content atomically.

        Returns:
          The file's size in bytes.

        Raises:
          NvmeIOError: if the write failed (the earlier file, if any, is kept whole).
          ValueError: for a key or array that cannot be stored.
        """
        self._check_open()
        name, arrays = _file_name(key), host_arrays(arrays)
        with self._lock:
            before = self._writes.get(name)
            self._prefetched.pop(name, None)  # would be stale
        if before is not None:
            _quiet_wait(before)
        try:
            size = write_file(self._dir, name, arrays, self.fsync, self.page_cache)
        except BaseException as e:
            failed: Future = Future()
            failed.set_exception(e)
            with self._lock:
                self._writes[name] = failed  # a later read must not return the older content
            raise
        with self._lock:
            if self._writes.get(name) is before:
                self._writes.pop(name, None)
        return size

    def write_async(self, key: Key, arrays: Sequence[np.ndarray]) -> None:
        """Starts writing ``arrays`` as ``key``'s file; :meth:`flush` waits for it.

        The arrays must not be modified until the write is done (after :meth:`flush`): they
        are written from the caller's memory, not copied. A later write, read or prefetch of
        the same key is ordered after this one.

        Errors of the write surface in :meth:`flush` and in a read of the key.

        Raises:
          RuntimeError: when all buffers hold prefetched groups not yet read.
          ValueError: for a key or array that cannot be stored.
        """
        self._check_open()
        name, arrays = _file_name(key), host_arrays(arrays)
        self._make_room()
        with self._lock:
            before = self._writes.get(name)
            self._prefetched.pop(name, None)  # would be stale
            future = self._pool.submit(self._chained_write, before, name, arrays)
            self._writes[name] = future
            self._pending.append(future)

    def _chained_write(self, before: Future | None, name: str, arrays: list[np.ndarray]) -> int:
        if before is not None:
            _quiet_wait(before)
        return write_file(self._dir, name, arrays, self.fsync, self.page_cache)

    def flush(self) -> None:
        """Waits for every pending write; re-raises the first error any of them had (once)."""
        while True:
            with self._lock:
                if not self._pending:
                    break
                future = self._pending.pop(0)
            self._settle(future)
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    # --- reading ------------------------------------------------------------------------------

    def prefetch(self, key: Key) -> None:
        """Starts reading ``key``'s file in the background; :meth:`read` returns the result.

        Raises:
          RuntimeError: when all buffers hold prefetched groups not yet read.
        """
        self._check_open()
        name = _file_name(key)
        with self._lock:
            if name in self._prefetched:
                return
        self._make_room()
        with self._lock:
            before = self._writes.get(name)
            self._prefetched[name] = self._pool.submit(self._chained_read, before, name)

    def _chained_read(self, before: Future | None, name: str) -> list[np.ndarray]:
        if before is not None:
            _raise_if_write_failed(before, os.path.join(self._dir, name))
        return read_file(os.path.join(self._dir, name), self.page_cache)

    def read(self, key: Key, like: Sequence[Any] | None = None) -> list[np.ndarray]:
        """The arrays of ``key``'s file: the prefetched result if :meth:`prefetch` started one,
        else read now (after any pending write of the key).

        Args:
          key: the key written.
          like: optionally, what the caller expects (arrays or ``jax.ShapeDtypeStruct``, one
            per array): their number, shapes and dtypes are checked.

        Raises:
          NvmeIOError: if the file is missing, truncated, corrupted or not like ``like``, or
            the key's last write failed; the message names the file.
        """
        self._check_open()
        name = _file_name(key)
        with self._lock:
            future = self._prefetched.pop(name, None)
            before = self._writes.get(name)
        if future is not None:
            arrays = future.result()
        else:
            arrays = self._chained_read(before, name)
        if like is not None:
            check_like(os.path.join(self._dir, name), arrays, like)
        return arrays

    # --- bookkeeping --------------------------------------------------------------------------

    def remove(self, key: Key) -> None:
        """Deletes ``key``'s file (after any pending write of it); a missing file is fine."""
        self._check_open()
        name = _file_name(key)
        with self._lock:
            before = self._writes.pop(name, None)
            self._prefetched.pop(name, None)
        if before is not None:
            _quiet_wait(before)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self._dir, name))

    def keys(self) -> list[str]:
        """The file stems written so far (finished writes)."""
        return sorted(
            e.name[: -len(SUFFIX)] for e in os.scandir(self._dir) if e.name.endswith(SUFFIX)
        )

    def disk_bytes(self) -> int:
        """Total bytes of the store's files now on disk (temporary files of writes in
        progress included)."""
        if self._closed:
            return 0
        total = 0
        for entry in os.scandir(self._dir):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # a temporary file renamed meanwhile
                continue
        return total

    def close(self) -> None:
        """Waits for the I/O in flight, then removes the store's files and its directory.

        Errors of writes that were never flushed are dropped with the data they were writing.
        Files that someone else put into the store's directory are left, and so is the
        directory then; nothing outside it is touched. Closing twice is harmless.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.buffer_count} buffers"
        return f"NvmeStore({self._dir!r}, {state})"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"The NVMe store {self._dir!r} is closed; create a new NvmeStore.")

    def _settle(self, future: Future) -> None:
        """Waits for a write; records its error as the first one if it is. A write that
        succeeded is forgotten; a failed one stays the key's last write, so that reads of the
        key raise its error until a new write of the key."""
        future.exception()
        with self._lock:
            self._settle_locked(future)

    def _settle_locked(self, future: Future) -> None:
        error = future.exception()
        if error is not None:
            if self._error is None:
                self._error = error
            return
        for name, f in list(self._writes.items()):
            if f is future:
                del self._writes[name]

    def _make_room(self) -> None:
        """Waits until fewer than ``buffer_count`` groups are in flight."""
        while True:
            with self._lock:
                for f in [f for f in self._pending if f.done()]:
                    self._pending.remove(f)
                    self._settle_locked(f)
                if len(self._pending) + len(self._prefetched) < self.buffer_count:
                    return
                if not self._pending:
                    raise RuntimeError(
                        f"All {self.buffer_count} buffers of the NVMe store hold prefetched "
                        f"groups that were not read ({sorted(self._prefetched)}). read() one "
                        "before prefetching or writing another, or raise "
                        "offload_optimizer.buffer_count."
                    )
                oldest = self._pending[0]
            oldest.exception()  # wait outside the lock; the next pass settles it


# --- files --------------------------------------------------------------------------------------


def _file_name(key: Key) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    text = []
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int | str | np.integer):
            raise ValueError(
                f"NVMe store key {key!r}: each part must be an int or a str, not "
                f"{type(part).__name__}. Use e.g. (group, shard)."
            )
        text.append(str(int(part)) if not isinstance(part, str) else part)
    stem = "-".join(text)
    if not parts or not _NAME.match(stem):
        raise ValueError(
            f"NVMe store key {key!r} gives the file name {stem!r}; keys may use only letters, "
            "digits, '_', '.' and '-'. Use e.g. (group, shard)."
        )
    return stem + SUFFIX


def _raise_if_write_failed(future: Future, path: str) -> None:
    error = future.exception()
    if error is not None:
        raise NvmeIOError(
            f"The last write of {path} failed ({error}), so its content is stale; not reading it."
        ) from error


def _quiet_wait(future: Future) -> None:
    """Waits for a write whose error is reported elsewhere (flush, or a read of its key)."""
    future.exception()


def _remove_store(directory: str, pool: ThreadPoolExecutor) -> None:
    """Waits for the I/O threads, removes the store's own files, then its directory if empty."""
    pool.shutdown(wait=True, cancel_futures=True)
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_file(follow_symlinks=False) and (
            entry.name.endswith(SUFFIX) or TMP in entry.name
        ):
            unlink_quietly(entry.path)
    try:
        os.rmdir(directory)
    except OSError:  # someone put other files there: leave them, and the directory
        pass
