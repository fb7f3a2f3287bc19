"""Whose a checkpoint directory is, which steps in it are jzero's, their order, and its writer.

This module imports no Orbax: the checkpointer (:mod:`jzero.checkpoint.checkpointer`) writes and
reads the steps through :mod:`jzero.checkpoint.orbax_io` and asks this module what it may touch;
inspect and export (:mod:`jzero.checkpoint.info`) ask it which step to read.

Decisions:

* **A directory is jzero's only when jzero says so.** The first save writes a marker file,
  ``jzero_checkpoints.json``. A directory without it is written into only when it is empty, or
  when every entry in it is a jzero step (a directory saved by jzero before the marker
  existed); any other content is refused with the path and what was found, and nothing in it is
  touched. Inside a marked directory, jzero lists, replaces and deletes only folders that hold a
  jzero step (a ``<N>/jzero`` item); a user's ``3`` or ``2024`` folder is never a step.
* **Write order, not step number, says which step is the latest.** Every step records a write
  sequence number (``seq`` in its ``jzero`` item). The latest step is the one written last, so a
  run that restored step 1 and saved step 2 is resumed from 2 even while a step 3 of the
  abandoned branch is still on disk; rotation (``max_to_keep``) deletes the steps written
  earliest. Steps saved before ``seq`` existed sort by step number, before any newer step.
* **Re-saving a step never leaves a moment without it.** The committed copy is renamed to
  ``<N>.jzero-replaced`` (one atomic rename) before the new copy is written, and deleted only
  after the new copy is committed. A writer killed in between leaves the old copy there; it is
  listed and restorable as step N, and the next writer renames it back (or deletes it when the
  new copy did commit).
* **One writer per directory.** The writer holds an advisory ``flock`` on ``jzero.lock``, whose
  text names the holder's host and pid. A second writer gets an error naming them. The kernel
  drops the lock when its process dies, so a stale lock (text left by a process that was killed)
  is taken over, with a message naming the dead holder. Across hosts this relies on the file
  system's ``flock``; NFS without lock support cannot detect a second writer.
* **Nothing unfinished stays.** A save that never completed leaves Orbax's
  ``<step>.orbax-checkpoint-tmp`` folder; :func:`remove_unfinished` deletes such folders (by
  that name only, never a committed step) when a writer opens the directory, when a failed
  save is handled, and when ``jzero train`` starts (:func:`clean_unfinished`, only while no
  other writer holds the lock: its save in flight is such a folder), each with a log line.
* **A step is read only when it is complete and intact.** :func:`resolve_step` names the
  step to read (the latest by default) among the committed ones, saying which saves never
  completed (and, for a path that is no checkpoint directory, what it is: a file, exported
  weights, a log folder with the run's checkpoint directory inside); :func:`verified_step_dir`
  checks its files against their record first.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import shutil
import socket
import time
import weakref
from pathlib import Path
from typing import IO, Any

from jzero._util import write_atomic
from jzero.checkpoint.format import JZERO, CheckpointError, first_problem

__all__ = [
    "CheckpointWriteError",
    "DirectoryLock",
    "MARKER",
    "clean_unfinished",
    "latest_step",
    "list_steps",
    "remove_unfinished",
]

logger = logging.getLogger(__name__)

MARKER = "jzero_checkpoints.json"
LOCK = "jzero.lock"
ASIDE = ".jzero-replaced"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax names a step being written <step><this>


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions, I/O): the run's state is intact in
    memory and the steps committed before are intact on disk."""


# -- which entries are jzero's ------------------------------------------------------------------
def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is a committed jzero step: ``<N>/`` holding a ``jzero`` item."""
    return path.name.isdigit() and (path / JZERO).is_dir()


def step_dirs(directory: Path) -> dict[int, Path]:
    """Every committed jzero step in ``directory``: step -> its folder.

    A step whose re-save was cut short is found at its ``<N>.jzero-replaced`` copy.
    """
    if not directory.is_dir():
        return {}
    found: dict[int, Path] = {}
    asides: dict[int, Path] = {}
    for p in directory.iterdir():
        if is_step_dir(p):
            found[int(p.name)] = p
        elif p.name.endswith(ASIDE) and p.name[: -len(ASIDE)].isdigit() and (p / JZERO).is_dir():
            asides[int(p.name[: -len(ASIDE)])] = p
    for step, p in asides.items():
        found.setdefault(step, p)
    return found


def step_info(step_dir: Path) -> dict[str, Any]:
    """A step's ``jzero`` item (format, step, seq, process and device count); ``{}`` if
    unreadable."""
    try:
        return dict(json.loads((step_dir / JZERO / "metadata").read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def write_order(directory: Path) -> list[int]:
    """The committed steps, the one written first first (see the module's decisions)."""
    dirs = step_dirs(directory)

    def key(step: int) -> tuple[int, int]:
        seq = step_info(dirs[step]).get("seq")
        return (int(seq) if isinstance(seq, int) else -1, step)

    return sorted(dirs, key=key)


def next_seq(directory: Path) -> int:
    """The write sequence number of the next step saved into ``directory``."""
    seqs = [step_info(p).get("seq") for p in step_dirs(directory).values()]
    return 1 + max((s for s in seqs if isinstance(s, int)), default=0)


def _is_ours(p: Path) -> bool:
    name = p.name
    if name in (MARKER, LOCK) or is_step_dir(p):
        return True
    base = (
        name.split(TMP_SUFFIX)[0]
        if TMP_SUFFIX in name
        else name[: -len(ASIDE)]
        if name.endswith(ASIDE)
        else ""
    )
    return base.isdigit() and p.is_dir()


def check_ownership(directory: Path) -> None:
    """Refuses a directory that holds anything but jzero checkpoints, unless it is marked.

    Raises:
      CheckpointError: naming the directory and the entries that are not jzero's.
    """
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CheckpointError(
            f"The checkpoint directory {str(directory)!r} is a file, not a directory. Set "
            "checkpoint.directory to a new or empty directory."
        )
    if (directory / MARKER).is_file():
        return
    foreign = sorted(p.name for p in directory.iterdir() if not _is_ours(p))
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(
            f"The checkpoint directory {str(directory)!r} holds files that are not jzero "
            f"checkpoints ({shown}; no {MARKER} marker), and jzero never writes into or "
            "deletes from a directory it does not own. Set checkpoint.directory to a new or "
            "empty directory."
        )


def write_marker(directory: Path) -> None:
    """Marks ``directory`` as jzero's (once; an existing marker is kept)."""
    marker = directory / MARKER
    if marker.is_file():
        return
    text = json.dumps(
        {
            "format": 1,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "about": "jzero checkpoints: jzero lists, replaces and deletes only the step folders "
            "it wrote here (those holding a 'jzero' item).",
        },
        indent=2,
    )
    write_atomic(marker, lambda f: f.write(text + "\n"), text=True)


def remove_unfinished(
    directory: Path, *, log: bool = False, quiet: float = 0.0, limit: float = 30.0
) -> list[str]:
    """Deletes the folders of saves that never completed (Orbax's ``<step>`` + ``TMP_SUFFIX``)
    in ``directory``; returns their names. The caller holds the writer's lock.

    Args:
      directory: the checkpoint directory.
      log: a line for each folder removed (a failed save's is reported by its failure).
      quiet: after a failed save, the writes it abandoned still land for a moment (TensorStore
        finishes the other shards in its own threads, making their folders again): delete
        until none has come back for this many seconds ...
      limit: ... or this many have passed.
    """
    removed: list[str] = []
    start = last = time.monotonic()
    while True:
        found = []
        if directory.is_dir():
            for p in sorted(directory.iterdir()):
                stem = p.name[: -len(TMP_SUFFIX)] if p.name.endswith(TMP_SUFFIX) else ""
                if stem.isdigit() and p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)  # a late write may refill it: again
                    found.append(p.name)
        removed += [n for n in found if n not in removed]
        now = time.monotonic()
        last = now if found else last
        if now - last >= quiet or now - start >= limit:
            break
        time.sleep(0.01)
    for name in removed if log else ():
        logger.info(
            "jzero: removed %s from %s: a checkpoint save that never completed (the committed "
            "steps are untouched)",
            name,
            directory,
        )
    return removed


def clean_unfinished(directory: str | os.PathLike) -> list[str]:
    """At a run's start: deletes the folders of saves that never completed, with a log line
    each, unless another writer holds the directory (its save in flight looks the same; the
    run meets that writer's lock at its first save). Returns the names removed."""
    path = Path(directory).expanduser().absolute()
    if not (path / MARKER).is_file() and not step_dirs(path):
        return []  # not a directory of jzero's checkpoints (yet): nothing of ours to remove
    import fcntl  # POSIX only, as the lock

    # The writer's lock, taken for a moment without touching its text (a dead writer's record
    # is reported by the writer that takes it over).
    with open(path / LOCK, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # another writer is at work
        try:
            return remove_unfinished(path, log=True)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def remove_step(directory: Path, step: int, why: str) -> None:
    """Deletes one committed jzero step (its folder and any aside copy), saying why."""
    for p in (directory / str(step), directory / f"{step}{ASIDE}"):
        if p.is_dir() and (p / JZERO).is_dir():
            shutil.rmtree(p)
            logger.info("jzero: deleted checkpoint step %d in %s (%s)", step, directory, why)


def recover_asides(directory: Path) -> None:
    """Finishes re-saves that were cut short: a committed new copy wins, else the old copy is
    put back under its step number."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        stem = p.name[: -len(ASIDE)] if p.name.endswith(ASIDE) else ""
        if not (stem.isdigit() and p.is_dir()):
            continue
        if is_step_dir(directory / stem):
            shutil.rmtree(p)
        else:
            os.replace(p, directory / stem)
            logger.warning(
                "jzero: a re-save of checkpoint step %s in %s was cut short; its previous copy "
                "is back in place",
                stem,
                directory,
            )


# -- which step to read ------------------------------------------------------------------------
def list_steps(directory: str | os.PathLike) -> list[int]:
    """The committed jzero steps in ``directory``, ascending; ``[]`` if it does not exist.

    Only folders holding a jzero step count: a user's numbered folders are never listed.
    """
    return sorted(step_dirs(Path(directory).expanduser()))


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step written last into ``directory`` (not the highest number), or ``None``."""
    order = write_order(Path(directory).expanduser())
    return order[-1] if order else None


def partial_steps(directory: Path) -> list[int]:
    """Steps whose save never completed (Orbax's temporary directories), ascending."""
    if not directory.is_dir():
        return []
    names = [p.name.split(TMP_SUFFIX)[0] for p in directory.iterdir() if TMP_SUFFIX in p.name]
    return sorted(int(n) for n in names if n.isdigit())


def _weights_hint(path: Path) -> str:
    """What reads ``path`` when it is exported weights (a safetensors or .npz file, or a
    sharded export's folder or index), else ``""``."""
    names = [p.name for p in path.iterdir()] if path.is_dir() else [path.name]
    if not any(n.endswith((".safetensors", ".npz", ".safetensors.index.json")) for n in names):
        return ""
    if path.is_dir():
        return (
            " Its files are exported weights (as jzero checkpoint export writes them), not a "
            "checkpoint: read them with jzero.weights.load_exported(path), or train from them "
            "with --set checkpoint.init_from=PATH (jzero.InitOptions(init_from=path) in code)."
        )
    return (
        " A weights file (as jzero checkpoint export writes) is not a checkpoint: read it with "
        "jzero.weights.load_exported(path), or train from it with --set "
        "checkpoint.init_from=PATH (jzero.InitOptions(init_from=path) in code)."
    )


def _inner_hint(path: Path) -> str:
    """The folders inside ``path`` that hold checkpoints (a log folder holding its run's
    checkpoint directory, ``runs/zero2/ckpt``), named; else ``""``."""
    inner = [p for p in sorted(path.iterdir()) if p.is_dir() and step_dirs(p)]
    if not inner:
        return ""
    return (
        " Inside it, "
        + "; ".join(f"{str(p)!r} holds the steps {sorted(step_dirs(p))}" for p in inner)
        + "."
    )


def resolve_step(directory: Path, step: int | None) -> int:
    """The committed step to read: ``step``, or the latest when ``None``.

    Raises:
      CheckpointError: no such directory, no complete step, or ``step`` is not one of them.
    """
    if directory.is_file():
        raise CheckpointError(
            f"{str(directory)!r} is a file, not a checkpoint directory. A jzero checkpoint is "
            "the folder a training run saves into (its checkpoint.directory, one folder per "
            f"step in it): pass that folder.{_weights_hint(directory)}"
        )
    if not directory.is_dir():
        raise CheckpointError(
            f"The checkpoint directory {str(directory)!r} does not exist. Check the path (a "
            "training run creates it on its first save)."
        )
    steps = list_steps(directory)
    partial = partial_steps(directory)
    note = f" (step(s) {partial} were never completed and are ignored)" if partial else ""
    if not steps:
        raise CheckpointError(
            f"The checkpoint directory {str(directory)!r} holds no complete checkpoint{note}. "
            f"Pass a directory a training run has saved into.{_inner_hint(directory)}"
            f"{_weights_hint(directory)}"
        )
    if step is None:
        return int(latest_step(directory))
    if int(step) not in steps:
        raise CheckpointError(
            f"Step {step} is not a complete checkpoint in {str(directory)!r}; the steps there "
            f"are {steps}{note}. Pass one of them."
        )
    return int(step)


def verified_step_dir(directory: Path, step: int) -> Path:
    """A committed step's folder, once its files match their record (sizes and checksums).

    Raises:
      CheckpointError: naming what is damaged and the steps that could be restored instead.
    """
    step_dir = step_dirs(directory).get(step, directory / str(step))
    problem = first_problem(step_dir)
    if problem:
        others = [s for s in list_steps(directory) if s != step]
        hint = f"Restore another step ({others}) or delete it." if others else "Delete it."
        raise CheckpointError(
            f"Checkpoint step {step} in {str(directory)!r} is damaged: {problem}. {hint}"
        )
    return step_dir


# -- the writer's lock ------------------------------------------------------------------------
class DirectoryLock:
    """An advisory lock on a checkpoint directory held by its one writer (see the decisions)."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises :class:`CheckpointError` naming the holder."""
        import fcntl  # POSIX only; imported here so the module loads everywhere

        fh = open(self.path, "a+")  # noqa: SIM115 - held open while the lock is held
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise CheckpointError(
                f"Another writer is saving into the checkpoint directory "
                f"{str(self.path.parent)!r} ({holder}); two writers in one directory corrupt "
                "each other's steps. Stop that run first, or save into another directory."
            ) from None
        fh.seek(0)
        previous = fh.read().strip()
        if previous:
            logger.warning(
                "jzero: taking over the checkpoint directory %s from a writer that is gone (%s)",
                self.path.parent,
                previous,
            )
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        fh.flush()
        self._fh = fh
        self._finalizer = weakref.finalize(self, fh.close)  # a writer never closed still lets go

    def release(self) -> None:
        """Releases the lock (a clean release leaves the lock file empty); idempotent."""
        if self._fh is None:
            return
        import fcntl

        # ValueError: the file was closed already (its finalizer ran at interpreter exit).
        with contextlib.suppress(OSError, ValueError):
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.flush()
            fcntl.flock(self._fh, fcntl.LOCK_UN)
        self._fh.close()
        self._fh = None
        self._finalizer.detach()
