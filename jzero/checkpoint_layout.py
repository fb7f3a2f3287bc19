"""What a jzero checkpoint step holds on disk, how its files are checked, and restore targets.

This module imports no Orbax: :mod:`jzero.checkpoint` (the only module that does) writes and
reads the steps, and imports the names below.

Decisions:

* A step directory holds three Orbax items: ``state`` (any pytree of arrays, one
  ``StandardSave``: every process writes only its own shards), ``meta`` (the caller's
  JSON-serialisable dict) and ``jzero`` (format version, process and device count).
* Before the rename that finalizes a step, process 0 records the size of every file of the step
  in ``jzero_files.json`` (:func:`_seal`, run from Orbax's post-finalization hook). Restore,
  inspect and export compare the files on disk with that record (:func:`_damage`), so a
  truncated or deleted shard file is named instead of being read as zeros (a deleted OCDBT
  manifest silently reads as zeros otherwise). Steps written without the record get a
  structural check.
* Restore always goes into a target of ``jax.ShapeDtypeStruct`` that carries shardings (from
  the new plan), so Orbax reshards: any stage, any device count the shapes allow. Shardings may
  carry ``memory_kind="pinned_host"``. Leaf paths and shapes are checked against the saved
  metadata first (:func:`_match`).
* Every failure a user can cause is a :class:`CheckpointError` (a ``ValueError``) that names
  the directory, the step and the fix, never a raw Orbax or TensorStore traceback.
* Leaves are named by dotted paths (``params.blocks.w``), as inspect shows them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = ["CheckpointError", "abstract_target"]

PyTree = Any
STATE, META, JZERO = "state", "meta", "jzero"
RECORD = "jzero_files.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, or does not fit what it is restored into."""


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _path_parts(path: tuple[Any, ...]) -> tuple[str | int, ...]:
    out: list[str | int] = []
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        else:
            out.append(_path_str((k,)))
    return tuple(out)


# -- the file record and damage ------------------------------------------------------------
def _require_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise CheckpointError(
            f"The checkpoint directory {str(directory)!r} does not exist. Check the path (a "
            "training run creates it on its first save)."
        )


def _seal(step_dir: Path) -> None:
    """Records the size of every file of the step's items (run before the final rename)."""
    sizes = {}
    for item in (STATE, META, JZERO):
        for root, _, files in os.walk(step_dir / item):
            for name in files:
                p = Path(root) / name
                sizes[p.relative_to(step_dir).as_posix()] = p.stat().st_size
    tmp = step_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT_VERSION, "files": sizes}, sort_keys=True))
    os.replace(tmp, step_dir / RECORD)


def _damage(step_dir: Path) -> str | None:
    """What is wrong with a finalized step's files, or ``None`` when they are intact."""
    record = step_dir / RECORD
    if record.is_file():
        try:
            sizes = json.loads(record.read_text())["files"]
        except (ValueError, KeyError):
            return f"its file record {RECORD} is unreadable"
        for rel, size in sorted(sizes.items()):
            p = step_dir / rel
            if not p.is_file():
                return f"the file {rel} is missing"
            if p.stat().st_size != size:
                return f"the file {rel} has {p.stat().st_size} bytes but {size} were written"
        return None
    state = step_dir / STATE
    if not (state / "_METADATA").is_file():
        return f"{STATE}/_METADATA is missing"
    for proc in sorted(state.glob("ocdbt.process_*")):
        if not (proc / "manifest.ocdbt").is_file():
            return f"{proc.relative_to(step_dir).as_posix()}/manifest.ocdbt is missing"
    return None


def _damaged(step: int, directory: Path, e: BaseException) -> CheckpointError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return CheckpointError(
        f"Reading checkpoint step {step} in {str(directory)!r} failed ({first}). The step is "
        "damaged or was not written by jzero; restore another step."
    )


def _flat(tree: PyTree) -> dict[str, tuple[tuple[Any, ...], Any]]:
    return {_path_str(p): (p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


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


def _as_target(target: PyTree) -> PyTree:
    def leaf(path: tuple[Any, ...], x: Any) -> jax.ShapeDtypeStruct:
        sharding = getattr(x, "sharding", None)
        if sharding is None or not hasattr(x, "shape"):
            raise CheckpointError(
                f"Target leaf {_path_str(path)!r} ({x!r}) carries no sharding. Restore into "
                "jax.ShapeDtypeStruct leaves built from the new plan's shardings, e.g. "
                "jzero.checkpoint.abstract_target(abstract_state, state_shardings(plan))."
            )
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, target)


def _match(saved: PyTree, target: PyTree, step: int, directory: Path) -> None:
    s, t = _flat(saved), _flat(target)
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
