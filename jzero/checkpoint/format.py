"""What a jzero checkpoint step holds on disk, how its files are checked, and restore targets.

This module imports no Orbax (:mod:`jzero.checkpoint.orbax_io` is the only one that does) and
nothing else of the package: every other module of :mod:`jzero.checkpoint` imports it.

Decisions:

* A step directory holds three Orbax items: ``state`` (any pytree of arrays, one
  ``StandardSave``: every process writes only its own shards), ``meta`` (the caller's
  JSON-serialisable dict) and ``jzero`` (format version, process and device count).
* Before the rename that finalizes a step, process 0 records the size and the CRC-32 of every
  file of the step in ``jzero_files.json`` (:func:`seal`, run from Orbax's post-finalization
  hook; format 2: ``{"format": 2, "files": {path: {"size": n, "crc32": "8 hex digits"}}}``).
  Restore and export compare the files on disk with that record (:func:`first_problem`) before Orbax
  reads them, so a truncated or deleted shard file is named instead of being read as zeros (a
  deleted OCDBT manifest silently reads as zeros otherwise), and so are flipped bytes (bit rot,
  a bad disk or copy), which Orbax would read as different numbers without any error.
* The check first compares every file's size (one ``stat`` each), then streams every file once
  through ``zlib.crc32`` (stdlib; 1 MiB at a time, so memory stays flat). That is one extra
  read of the step per restore, sealed save and export, usually served by the page cache on
  restore; CRC-32 is chosen for speed: it catches accidental damage, not tampering. Inspect
  compares sizes only unless asked to verify (:func:`verify_step`), so it stays metadata-only.
* Records written before checksums (format 1, ``{path: size}``) are still read and checked
  for sizes; steps written without any record get a structural check. Neither can detect
  changed contents, and ``inspect --verify`` says so instead of calling them verified.
* Restore always goes into a target of ``jax.ShapeDtypeStruct`` that carries shardings (from
  the new plan), so Orbax reshards: any stage, any device count the shapes allow. Shardings may
  carry ``memory_kind="pinned_host"``. Leaf paths and shapes are checked against the saved
  metadata first (:func:`check_target`).
* Every failure a user can cause is a :class:`CheckpointError` (a ``ValueError``) that names
  the directory, the step and the fix, never a raw Orbax or TensorStore traceback.
* Leaves are named by dotted paths (``params.blocks.w``), as inspect shows them.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np

from jzero._util import dotted, write_atomic

__all__ = ["CheckpointError", "StepCheck", "abstract_target"]

PyTree = Any
STATE, META, JZERO = "state", "meta", "jzero"
RECORD = "jzero_files.json"
FORMAT_VERSION = 1  # of the ``jzero`` item
RECORD_FORMAT = 2  # of the file record: 1 held sizes only, 2 adds a CRC-32 per file
_CHUNK = 1 << 20  # bytes read at a time when checksumming


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit what it is restored into."""


def path_str(path: tuple[Any, ...]) -> str:
    return dotted(path)


# -- the file record and damage ------------------------------------------------------------
def _step_files(step_dir: Path) -> list[Path]:
    return sorted(
        Path(root) / name
        for item in (STATE, META, JZERO)
        for root, _, files in os.walk(step_dir / item)
        for name in files
    )


def _crc32(path: Path) -> tuple[int, int]:
    """The CRC-32 of a file's contents and the number of bytes read, streamed 1 MiB at a time."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return crc, size


def seal(step_dir: Path) -> None:
    """Records the size and CRC-32 of every file of the step's items (run before the rename)."""
    files = {}
    for p in _step_files(step_dir):
        crc, size = _crc32(p)
        files[p.relative_to(step_dir).as_posix()] = {"size": size, "crc32": f"{crc:08x}"}
    record = json.dumps({"format": RECORD_FORMAT, "files": files}, sort_keys=True)
    write_atomic(step_dir / RECORD, lambda f: f.write(record), text=True)


class _BadRecord(Exception):
    pass


def _read_record(step_dir: Path) -> dict[str, tuple[int, int | None]]:
    """The record's files: path -> (size, CRC-32, or ``None`` in a format-1 record)."""
    try:
        data = json.loads((step_dir / RECORD).read_text())
        fmt, entries = data.get("format", 1), data["files"]
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
        raise _BadRecord(f"its file record {RECORD} is unreadable") from e
    if not isinstance(fmt, int) or fmt > RECORD_FORMAT:
        raise _BadRecord(
            f"its file record {RECORD} has format {fmt!r}, newer than this jzero reads "
            f"({RECORD_FORMAT}); upgrade jzero to read it"
        )
    files: dict[str, tuple[int, int | None]] = {}
    try:
        for rel, entry in entries.items():
            if isinstance(entry, dict):
                files[rel] = (int(entry["size"]), int(entry["crc32"], 16))
            elif isinstance(entry, int) and not isinstance(entry, bool):
                files[rel] = (entry, None)  # format 1: the size only
            else:
                raise TypeError(entry)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _BadRecord(f"its file record {RECORD} is unreadable") from e
    return files


def _structure_problems(step_dir: Path) -> Iterator[str]:
    state = step_dir / STATE
    if not (state / "_METADATA").is_file():
        yield f"{STATE}/_METADATA is missing"
        return
    for proc in sorted(state.glob("ocdbt.process_*")):
        if not (proc / "manifest.ocdbt").is_file():
            yield f"{proc.relative_to(step_dir).as_posix()}/manifest.ocdbt is missing"


def _file_problems(step_dir: Path, contents: bool = True) -> Iterator[str]:
    """What is wrong with a finalized step's files, first found first (lazily).

    Every size is compared before any file is read; then, with ``contents``, every file with a
    recorded checksum is read once and its CRC-32 compared.
    """
    if not (step_dir / RECORD).is_file():
        yield from _structure_problems(step_dir)
        return
    try:
        files = _read_record(step_dir)
    except _BadRecord as e:
        yield str(e)
        return
    intact = []
    for rel, (size, crc) in sorted(files.items()):
        p = step_dir / rel
        if not p.is_file():
            yield f"the file {rel} is missing"
        elif (on_disk := p.stat().st_size) != size:
            yield f"the file {rel} has {on_disk} bytes but {size} were written"
        elif crc is not None:
            intact.append((rel, p, crc))
    if not contents:
        return
    for rel, p, crc in intact:
        try:
            now, _ = _crc32(p)
        except OSError as e:
            yield f"the file {rel} cannot be read ({e.strerror or e})"
            continue
        if now != crc:
            yield (
                f"the file {rel} has checksum {now:08x} but {crc:08x} was written (its "
                "contents changed after the save)"
            )


def first_problem(step_dir: Path, contents: bool = True) -> str | None:
    """What is wrong with a finalized step's files, or ``None`` when they are intact.

    Args:
      step_dir: the step's directory.
      contents: also read every file and compare its checksum (one streamed pass over the
        step); ``False`` compares sizes only (cheap: metadata).
    """
    return next(_file_problems(step_dir, contents), None)


@dataclass(frozen=True)
class StepCheck:
    """What verifying one step found (``jzero checkpoint inspect --verify``).

    Attributes:
      step: the step.
      problems: every problem found, empty when the step is intact.
      checked: ``"checksums"`` (every file's contents), ``"sizes"`` (a record written before
        jzero recorded checksums: contents can't be checked) or ``"structure"`` (no record).
      files: the files the record lists; ``nbytes``: their recorded bytes.
    """

    step: int
    problems: tuple[str, ...]
    checked: Literal["checksums", "sizes", "structure"]
    files: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(step: int, step_dir: Path) -> StepCheck:
    """Reads every file of a step and checks it against the record: all problems, not the
    first."""
    problems = tuple(_file_problems(step_dir, contents=True))
    if not (step_dir / RECORD).is_file():
        return StepCheck(step, problems, "structure")
    try:
        files = _read_record(step_dir)
    except _BadRecord:
        return StepCheck(step, problems, "structure")
    checked = "checksums" if all(c is not None for _, c in files.values()) else "sizes"
    return StepCheck(step, problems, checked, len(files), sum(size for size, _ in files.values()))


def flat(tree: PyTree) -> dict[str, tuple[tuple[Any, ...], Any]]:
    return {path_str(p): (p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# -- restore targets -------------------------------------------------------------------------
def abstract_target(tree: PyTree, shardings: PyTree) -> PyTree:
    """A restore target: ``jax.ShapeDtypeStruct`` per leaf of ``tree`` with its sharding.

    Args:
      tree: arrays or ``jax.ShapeDtypeStruct`` (e.g. ``engine.state`` or
        ``plan.abstract_params``).
      shardings: a sharding per leaf, or a prefix of ``tree`` whose shardings apply to whole
        subtrees (e.g. ``jzero.step.state_shardings(plan)``); may carry a memory kind such as
        ``pinned_host``.

    Example::

      target = abstract_target(engine.state, state_shardings(new_plan))
      state, meta = Checkpointer(directory).restore(target)
    """

    def subtree(sharding: Any, sub: PyTree) -> PyTree:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), x.dtype, sharding=sharding), sub
        )

    return jax.tree.map(subtree, shardings, tree)


def as_target(target: PyTree) -> PyTree:
    def leaf(path: tuple[Any, ...], x: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(x, "sharding", None)
        if sharding is None or not hasattr(x, "shape"):
            raise CheckpointError(
                f"Target leaf {path_str(path)!r} ({x!r}) carries no sharding. Restore into "
                "jax.ShapeDtypeStruct leaves built from the new plan's shardings, e.g. "
                "jzero.checkpoint.abstract_target(abstract_state, state_shardings(plan))."
            )
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, target)


def check_target(saved: PyTree, target: PyTree, step: int, directory: Path) -> None:
    s, t = flat(saved), flat(target)
    where = f"step {step} of {str(directory)!r}"
    fix = (
        "Restore with the model and optimizer the checkpoint was saved with (the ZeRO stage and "
        "device count may differ)."
    )
    if missing := sorted(set(t) - set(s)):
        raise CheckpointError(f"The target has leaves {missing[:5]} that {where} lacks. {fix}")
    if extra := sorted(set(s) - set(t)):
        raise CheckpointError(f"{where} has leaves {extra[:5]} that the target lacks. {fix}")
    for key, (_, x) in t.items():
        shape = tuple(s[key][1].shape)
        if shape != tuple(x.shape):
            raise CheckpointError(
                f"Leaf {key!r} has shape {shape} in {where} but {tuple(x.shape)} in the target. "
                f"{fix}"
            )
