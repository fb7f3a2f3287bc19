"""Inspect: what a checkpoint directory holds, read from metadata only.

Decisions:

* Orbax's metadata is read and no array is loaded.
* A step's files are checked against its file record first; a damaged step is reported
  (``DAMAGED: ...``) instead of failing. Only sizes are compared, unless ``verify`` asks to read
  every file: then every complete step is checked when no step is named (the question is "which
  steps can I resume from?"), else the named one, and all that is wrong with each is listed
  (:class:`StepCheck`), saying when a step's record predates checksums.
* Exporting a checkpoint's parameters as weight files is :mod:`jzero.weights.from_checkpoint`'s:
  this package is Orbax only, and imports nothing of :mod:`jzero.weights`.
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
from typing import Any

import numpy as np

from jzero.checkpoint import dirs, orbax_io
from jzero.checkpoint.format import (
    JZERO,
    META,
    CheckpointError,
    StepCheck,
    first_problem,
    flat,
    verify_step,
)

__all__ = [
    "CheckpointInfo",
    "LeafInfo",
    "StepCheck",
    "format_info",
    "inspect",
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
    position = format_data_position(info.meta)
    if position:
        lines.append(f"  data position: {position}")
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


def format_data_position(meta: dict[str, Any]) -> str | None:
    """The data position a checkpoint's meta holds, in a few words (``None``: none saved):
    ``sample 96 (epoch 0)`` for :mod:`jzero.data`'s iterator, else the protocol and a short
    form of the state (:mod:`jzero.engine.data_position`)."""
    state, grain = meta.get("data"), meta.get("data_grain")
    if isinstance(state, dict) and "sample" in state:
        epoch = f" (epoch {state['epoch']})" if "epoch" in state else ""
        return f"sample {state['sample']}{epoch}"
    if state is not None:
        return f"state()/restore(): {_short(json.dumps(state, sort_keys=True))}"
    if isinstance(grain, dict):
        kind, value = next(iter(grain.items()), ("value", None))
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return f"Grain get_state()/set_state() ({kind}): {_short(text)}"
    return None


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
