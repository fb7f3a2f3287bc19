"""Inspect and export: what a checkpoint directory holds, and its parameters as files.

Decisions:

* Both read Orbax's metadata and never load a whole tree: inspect loads no array; export
  restores one leaf at a time as a host numpy array, so host memory stays near the largest leaf
  (see :mod:`jzero.export` for the file formats).
* Both check a step's files against its file record first; inspect reports a damaged step
  (``DAMAGED: ...``) instead of failing, export refuses it with a :class:`CheckpointError`.
  Export reads every file's checksum (as restore does); inspect compares sizes only, unless
  ``verify`` asks it to read every file: then it checks every complete step when no step is
  named (the question is "which steps can I resume from?"), else the named one, and lists all
  that is wrong with each (:class:`StepCheck`), saying when a step's record predates checksums.
* Export writes through :func:`jzero.export.write_leaves`, which writes a file it creates
  exclusively (a fresh name) beside the output and renames it onto the output when complete:
  no predictable name such as ``<out>.tmp`` is ever opened, so a pre-existing file or symlink
  there is never written through or removed; a failed export removes only its own file.
* :func:`parameter_leaves` serves ``jzero.initialize(init_from=<checkpoint dir>)``
  (:mod:`jzero.weights`): the master weights of a mixed-precision run (float32, exact), else
  the params, one leaf at a time.
* Orbax is reached only through :mod:`jzero.checkpoint.orbax_io`, the one module that imports
  it; which step to read, and whether its files are intact, through
  :mod:`jzero.checkpoint.dirs`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from jzero import export as export_lib
from jzero.checkpoint import dirs, orbax_io
from jzero.checkpoint.layout import (
    JZERO,
    META,
    CheckpointError,
    StepCheck,
    first_problem,
    flat,
    verify_step,
)
from jzero.export import path_parts

__all__ = [
    "CheckpointInfo",
    "LeafInfo",
    "StepCheck",
    "export",
    "format_info",
    "inspect",
    "parameter_leaves",
    "read_info",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeafInfo:
    """One saved leaf: dotted path, shape, dtype, bytes and the saved partition spec."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    spec: str


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory holds, read from metadata only.

    Attributes:
      directory: the directory.
      steps: complete steps; ``partial_steps``: unfinished saves (ignored).
      step: the step described below (the latest unless asked otherwise).
      trees: per top-level tree of the state, its leaves.
      meta: the saved meta dict; ``jzero``: the format record (device count, ...).
      problem: why the step is damaged, or ``None``.
      verified: with ``verify``, what reading every file of the checked steps found.
    """

    directory: str
    steps: list[int]
    partial_steps: list[int]
    step: int
    trees: dict[str, list[LeafInfo]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    jzero: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    verified: tuple[StepCheck, ...] = ()

    @property
    def damaged(self) -> bool:
        """Whether the described step or a verified one is damaged."""
        return self.problem is not None or any(not c.ok for c in self.verified)


def read_info(
    directory: str | os.PathLike, step: int | None = None, *, verify: bool = False
) -> CheckpointInfo:
    """Reads a checkpoint directory's steps and one step's leaves and meta (no arrays).

    Args:
      directory: the checkpoint directory.
      step: the step to describe; ``None`` for the latest.
      verify: also read every file and compare it with the step's file record (sizes and
        checksums): every complete step when ``step`` is ``None``, else that step only. Without
        it only file sizes are compared (metadata only, fast).
    """
    d = Path(directory).absolute()
    every_step = step is None
    step = dirs.resolve_step(d, step)
    step_dir = d / str(step)
    steps = dirs.list_steps(d)
    verified: tuple[StepCheck, ...] = ()
    if verify:
        verified = tuple(verify_step(s, d / str(s)) for s in (steps if every_step else [step]))
    problem = first_problem(step_dir, contents=False)  # sizes: verified covers the contents
    for check in verified:
        if check.step == step and check.problems:
            problem = check.problems[0]
    trees: dict[str, list[LeafInfo]] = {}
    meta: dict[str, Any] = {}
    info: dict[str, Any] = {}
    try:
        for key, (_, md) in flat(orbax_io.tree_metadata(d, step, step_dir)).items():
            shape = tuple(int(n) for n in md.shape)
            dtype = np.dtype(md.dtype)
            spec = getattr(getattr(md, "sharding", None), "partition_spec", None)
            trees.setdefault(key.split(".")[0], []).append(
                LeafInfo(
                    key,
                    shape,
                    dtype.name,
                    int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                    str(tuple(spec)) if spec is not None else "()",
                )
            )
        meta, info = orbax_io.read_json(step_dir, META), orbax_io.read_json(step_dir, JZERO)
    except (CheckpointError, ValueError, OSError) as e:
        problem = problem or str(e)
    return CheckpointInfo(
        str(d), steps, dirs.partial_steps(d), step, trees, meta, info, problem, verified
    )


def format_info(info: CheckpointInfo) -> str:
    """The report :func:`inspect` prints."""
    lines = [f"checkpoint directory {info.directory}", f"complete steps: {info.steps}"]
    if info.partial_steps:
        lines.append(f"unfinished saves (ignored): {info.partial_steps}")
    saved_on = info.jzero.get("device_count")
    lines.append(
        f"step {info.step}" + (f" (saved on {saved_on} devices)" if saved_on else "") + ":"
    )
    if info.problem:
        lines.append(f"  DAMAGED: {info.problem}")
    for name, leaves in info.trees.items():
        total = sum(leaf.nbytes for leaf in leaves)
        lines.append(f"  tree {name}: {len(leaves)} leaves, {total:,} bytes")
        rows = [("leaf", "shape", "dtype", "bytes", "saved spec")]
        rows += [
            (x.path, "x".join(map(str, x.shape)) or "()", x.dtype, f"{x.nbytes:,}", x.spec)
            for x in leaves
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            cells = (c.ljust(w) for c, w in zip(r, widths, strict=True))
            lines.append(("    " + "  ".join(cells)).rstrip())
    lines.append("  meta:")
    text = json.dumps(info.meta, indent=2, sort_keys=True) if info.meta else "{}"
    lines += ["    " + line for line in text.splitlines()]
    if info.verified:
        lines.append("verified (every file read and compared with the step's file record):")
        lines += [_format_check(c) for c in info.verified]
    return "\n".join(lines)


_SHOWN_PROBLEMS = 20


def _format_check(check: StepCheck) -> str:
    if len(check.problems) == 1:
        return f"  step {check.step}: DAMAGED: {check.problems[0]}"
    if check.problems:
        shown = [f"    {p}" for p in check.problems[:_SHOWN_PROBLEMS]]
        if len(check.problems) > _SHOWN_PROBLEMS:
            shown.append(f"    ... and {len(check.problems) - _SHOWN_PROBLEMS} more")
        return "\n".join(
            [f"  step {check.step}: DAMAGED ({len(check.problems)} problems):", *shown]
        )
    what = {
        "checksums": f"{check.files} files, {check.nbytes:,} bytes: sizes and checksums match",
        "sizes": (
            f"{check.files} files, {check.nbytes:,} bytes: sizes match; saved before jzero "
            "recorded checksums, so the contents can't be verified"
        ),
        "structure": "no file record: its structure is intact; the contents can't be verified",
    }[check.checked]
    return f"  step {check.step}: OK ({what})"


def inspect(directory: str | os.PathLike, step: int | None = None, *, verify: bool = False) -> str:
    """A report of a checkpoint directory: steps, every leaf of one step, and its meta.

    With ``verify``, every file of every complete step (of ``step`` alone when given) is read
    and checked against its file record, and a line per step says what was found (see
    :func:`read_info`).
    """
    return format_info(read_info(directory, step, verify=verify))


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


def export(
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
    :func:`jzero.export.load_exported`, or load it with ``jzero.initialize(init_from=...)``.

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
