"""Weights in and out: safetensors files and jzero checkpoints read straight into the plan's
shards; the engine's sharded arrays written as Hugging Face's sharded safetensors.

``jzero.initialize(..., options=jzero.InitOptions(init_from=path))`` calls :func:`load_weights`;
``engine.save_16bit_model(dir)`` calls :func:`save_weights`; ``engine.save()`` with
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` calls
:func:`save_step_weights`. The file formats are :mod:`jzero.weights.export`'s.

Decisions:

* Three sources, told apart by what ``path`` is: a ``.safetensors`` file; a directory holding
  ``model.safetensors.index.json`` (Hugging Face's sharded layout, as :mod:`jzero.weights.export`
  writes it) or that index file; a jzero checkpoint directory (its latest step: the float32
  master weights of a mixed-precision run, else its params).
* Every leaf is built with ``jax.make_array_from_callback`` in the sharding it is given: each
  process asks only for its own devices' shards, and a shard of a safetensors tensor is read
  with ``os.preadv`` from its byte ranges only: one range when the leaf is sharded on its
  leading dimension (as jzero's plans shard), one per index of the dimensions before the
  sharded one otherwise (a stacked-layer leaf sharded beside its layer dimension: one per
  layer); a replicated leaf is read whole by each device. Never the whole file. A checkpoint leaf is
  read whole once (one leaf on the host at a time) and sliced per shard. Leaves load one after
  the other, so host memory above the loaded arrays stays near one leaf.
* Values are cast to the leaf's dtype in the callback. Under mixed precision the caller passes
  the float32 master layout; the 16-bit params are then made from them as init makes them.
* Names are the dotted pytree paths (``blocks.w``, ``layers.0.w``), as export writes them.
  ``name_map`` maps a parameter's path to the tensor's name in the file: a dict (paths not in
  it keep their name) or a callable; :func:`save_weights`'s ``names`` is the same map, out
  (Hugging Face's names in the files, the nesting kept in their metadata). Before anything is
  read, every parameter is matched: the missing tensors, the tensors no parameter takes, and
  the shape mismatches are listed in one ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero.distributed import barrier
from jzero.weights import export as export_lib
from jzero.weights.format import (
    INDEX_NAME,
    index_file,
    read_index,
    read_safetensors_header,
    tensor_layout,
)

__all__ = [
    "MARKER",
    "Tensor",
    "check_step_weights_dir",
    "load_weights",
    "open_weights",
    "save_step_weights",
    "save_weights",
]

PyTree = Any
NameMap = Mapping[str, str] | Callable[[str], str] | None
_SHOWN = 20


@dataclass(frozen=True)
class Tensor:
    """One stored tensor: its shape, its dtype, and ``read(index)``, which returns the part
    of it a tuple of slices selects (a shard), as a host numpy array."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[tuple[slice, ...]], np.ndarray]


def _blocks(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int, int, tuple]:
    """What to read of a C-ordered tensor for the shard ``index``.

    Returns ``(k, lo, hi, rest)``: dimensions before ``k`` are read whole, dimension ``k`` from
    ``lo`` to ``hi``, the later ones whole, so the bytes read are ``prod(shape[:k])``
    contiguous blocks (one when ``k`` is 0, jzero's leading-dimension shards); ``rest`` is
    the index still to apply to what was read.
    """
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    for k, (sl, n) in enumerate(zip(index, shape, strict=True)):
        start, stop, step = sl.indices(n)
        if (start, stop, step) == (0, n, 1):
            continue
        if step != 1:
            return 0, 0, shape[0], index  # strided: read it all
        rest = (slice(None),) * (k + 1) + index[k + 1 :]
        return k, start, max(start, stop), rest
    return 0, 0, shape[0] if shape else 1, index


def _pread(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"{str(path)!r} ended early while reading a tensor.")
        done += got


def _file_tensors(
    path: Path, known: Mapping[str, str] | None = None, name: str | None = None
) -> dict[str, Tensor]:
    """The tensors of one safetensors file, each reading its shards with ``os.pread``; with an
    index's ``known`` map, only those it places in this file (``name``, as the index names
    it). Every entry of the header is checked against the file first."""
    header, start = read_safetensors_header(path)
    header.pop("__metadata__", None)
    size = os.path.getsize(path)
    layouts = {key: tensor_layout(key, info, path, start, size) for key, info in header.items()}
    out: dict[str, Tensor] = {}
    for key, (dtype, shape, begin, _) in layouts.items():
        if known is not None and known.get(key) not in (None, name):
            continue  # the index places this name in another file

        def read(index, path=path, offset=start + begin, shape=shape, dtype=dtype):
            if not shape:
                k, lo, hi, rest, lead, part = 0, 0, 1, (), (), ()
            else:
                k, lo, hi, rest = _blocks(tuple(index), shape)
                lead, part = shape[:k], (hi - lo, *shape[k + 1 :])
            inner = int(np.prod(shape[k + 1 :], dtype=np.int64)) * dtype.itemsize
            block = (hi - lo) * inner
            buf = np.empty(int(np.prod(lead, dtype=np.int64)) * block, np.uint8)
            fd = os.open(path, os.O_RDONLY)
            try:
                for j in range(int(np.prod(lead, dtype=np.int64))):
                    at = offset + (j * (shape[k] if shape else 1) + lo) * inner
                    _pread(fd, memoryview(buf)[j * block : (j + 1) * block], at, path)
            finally:
                os.close(fd)
            x = buf.view(dtype).reshape((*lead, *part))
            if sys.byteorder == "big" and dtype.itemsize > 1:
                x = x.byteswap()
            return x[rest] if shape else x

        out[key] = Tensor(shape, dtype, read)
    return out


def _checkpoint_tensors(directory: Path) -> dict[str, Tensor]:
    from jzero.weights.from_checkpoint import parameter_leaves  # Orbax only for checkpoints

    _, entries, fetch = parameter_leaves(directory)
    cache: dict[int, np.ndarray] = {}

    def reader(i: int) -> Callable[[tuple[slice, ...]], np.ndarray]:
        def read(index: tuple[slice, ...]) -> np.ndarray:
            if i not in cache:
                cache.clear()  # one leaf on the host at a time
                cache[i] = np.asarray(fetch(i))
            return cache[i][index]

        return read

    return {e.key: Tensor(e.shape, np.dtype(e.dtype), reader(i)) for i, e in enumerate(entries)}


def open_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The tensors stored at ``path`` (see the module's decisions for what it may be), by name.

    Nothing but headers (or checkpoint metadata) is read until a tensor's ``read`` is called.
    """
    p = Path(path).expanduser()
    if (p.is_file() and p.name.endswith(".index.json")) or (p / INDEX_NAME).is_file():
        root, weight_map, _ = read_index(p)
        index = p if p.is_file() else p / INDEX_NAME
        out: dict[str, Tensor] = {}
        for name in dict.fromkeys(weight_map.values()):
            out.update(_file_tensors(index_file(root, name, index), weight_map, name))
        return out
    if p.is_file():
        return _file_tensors(p)
    if p.is_dir():
        return _checkpoint_tensors(p)
    raise FileNotFoundError(
        f"init_from={str(path)!r} does not exist. Pass a .safetensors file, a directory with "
        f"{INDEX_NAME}, or a jzero checkpoint directory."
    )


def _file_name(path: str, name_map: NameMap) -> str:
    if name_map is None:
        return path
    if callable(name_map):
        return str(name_map(path))
    return str(name_map.get(path, path))


def _listed(what: str, items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN]) + (
        f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    )
    return f"{len(items)} {what}: {shown}"


def check_weights(
    path: str | os.PathLike, abstract_params: PyTree, *, name_map: NameMap = None
) -> None:
    """Checks that the weights at ``path`` fit ``abstract_params`` (every parameter has its
    tensor, of its shape, and every tensor a parameter) from the files' headers alone: the
    ``ValueError`` :func:`load_weights` raises, before anything is read."""
    _matched(path, abstract_params, name_map)


def _matched(
    path: str | os.PathLike, abstract_params: PyTree, name_map: NameMap
) -> tuple[dict[str, Tensor], list[str]]:
    """The tensors at ``path`` and each parameter leaf's tensor name, or the ``ValueError``
    listing every mismatch."""
    tensors = open_weights(path)
    entries = export_lib.leaf_entries(abstract_params)
    names = [_file_name(e.key, name_map) for e in entries]
    missing = [
        f"{n!r}" + (f" (for {e.key!r})" if n != e.key else "")
        for e, n in zip(entries, names, strict=True)
        if n not in tensors
    ]
    taken = set(names)
    extra = [f"{n!r}" for n in tensors if n not in taken]
    shapes = [
        f"{e.key!r}: the parameter is {e.shape}, {n!r} in the file is {tensors[n].shape}"
        for e, n in zip(entries, names, strict=True)
        if n in tensors and tensors[n].shape != e.shape
    ]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(_listed("parameter(s) have no tensor", missing))
        if extra:
            parts.append(_listed("tensor(s) match no parameter", extra))
        if shapes:
            parts.append(_listed("shape(s) differ", shapes))
        raise ValueError(
            f"The weights in {str(path)!r} do not fit the parameters ({len(entries)} leaves, "
            f"{len(tensors)} tensors): " + "; ".join(parts) + ". Names are the parameters' "
            "dotted paths (e.g. 'blocks.w'); pass a name_map (a dict or a function from a "
            "parameter's path to the tensor's name: jzero.InitOptions(init_from=..., "
            "name_map=...) for jzero.initialize) when the file names them otherwise, and "
            "load weights of the same shapes."
        )
    return tensors, names


def load_weights(
    path: str | os.PathLike,
    abstract_params: PyTree,
    shardings: PyTree,
    *,
    name_map: NameMap = None,
) -> PyTree:
    """Reads stored weights straight into sharded arrays.

    Args:
      path: a ``.safetensors`` file, a sharded export (directory or index), or a jzero
        checkpoint directory.
      abstract_params: the parameters' shapes and dtypes (``jax.ShapeDtypeStruct``); values are
        cast to these dtypes.
      shardings: one ``jax.sharding.Sharding`` per leaf (device memory).
      name_map: a parameter's dotted path -> the tensor's name at ``path``: a dict (paths not in
        it keep their own name) or a callable.

    Returns:
      The parameters as ``jax.Array`` in ``shardings``.

    Raises:
      ValueError: listing every missing tensor, every tensor no parameter takes and every shape
        mismatch, when there is any.
    """
    tensors, names = _matched(path, abstract_params, name_map)
    leaves = jax.tree.leaves(abstract_params)
    flat_sh = jax.tree.structure(abstract_params).flatten_up_to(shardings)
    out = []
    for x, sh, n in zip(leaves, flat_sh, names, strict=True):
        t, dtype = tensors[n], np.dtype(x.dtype)

        def shard(index: tuple[slice, ...], t: Tensor = t, dtype: np.dtype = dtype) -> np.ndarray:
            return np.ascontiguousarray(t.read(tuple(index)).astype(dtype, copy=False))

        out.append(jax.make_array_from_callback(tuple(x.shape), sh, shard))
    return jax.tree.unflatten(jax.tree.structure(abstract_params), out)


# -- weights out: the engine's arrays as Hugging Face's sharded safetensors ---------------------
MARKER = "jzero_16bit.json"


def _host_leaf(x: jax.Array) -> np.ndarray:
    """One array on the host: this process's shards placed into one buffer (each replica read
    once), or, for an array spread over several processes, a collective gather."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    out = np.empty(x.shape, x.dtype)
    for s in x.addressable_shards:
        if s.replica_id == 0:
            out[s.index] = np.asarray(s.data)
    return out


def save_weights(
    directory: str | os.PathLike,
    params: PyTree,
    *,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    names: NameMap = None,
) -> Path:
    """Writes sharded arrays as Hugging Face's sharded safetensors, one leaf at a time.

    Args:
      directory: the output directory (created if missing); see
        :func:`jzero.weights.export.write_sharded`.
      params: the arrays (any shardings, host-offloaded ones too).
      dtype: the dtype floating leaves are written as; ``None`` keeps each leaf's own.
      max_shard_size: the most bytes per file.
      names: a leaf's dotted path -> its tensor's name in the files (e.g. Hugging Face's
        ``model.layers.0.self_attn.q_proj.weight``): a dict (paths not in it keep their own
        name) or a callable; ``None``: the dotted paths. The nesting is kept in the files'
        metadata, so :func:`jzero.weights.load_exported` still gives back the parameters'
        tree; ``init_from`` reads them back with the same map as ``name_map``.

    Returns:
      The index file's path.

    Raises:
      ValueError: when ``names`` gives a leaf a name that is not a non-empty string, or two
        leaves the same name.
    """
    leaves = jax.tree.leaves(params)
    entries = export_lib.leaf_entries(params, dtype)
    if names is not None:
        entries = [dataclasses.replace(e, key=_export_name(e.key, names)) for e in entries]

    def fetch(i: int) -> np.ndarray:
        return _host_leaf(leaves[i])

    def skip(i: int) -> None:
        if not leaves[i].is_fully_addressable:
            _host_leaf(leaves[i])  # a collective: every process takes part

    return export_lib.write_sharded(directory, entries, fetch, max_shard_size, skip=skip)


def _export_name(path: str, names: NameMap) -> str:
    """The name ``names`` gives the leaf at ``path``, checked."""
    name = names(path) if callable(names) else names.get(path, path)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"names gave the leaf {path!r} the name {name!r}; it must give every leaf a "
            "non-empty string (the tensor's name in the files)."
        )
    return name


def _ours(p: Path) -> bool:
    return p.is_dir() and (p / INDEX_NAME).is_file()


def save_step_weights(
    checkpoint_dir: str | os.PathLike,
    step: int,
    params: PyTree,
    keep_steps: Any = None,
    *,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Writes a checkpoint step's params (their own dtype) to ``<checkpoint_dir>_16bit/<step>/``.

    The folder beside the checkpoint directory is jzero's once it holds :data:`MARKER`; one
    that holds anything else without it is refused (see :func:`check_step_weights_dir`). A
    step is written into ``.<step>.partial`` and renamed into place when complete; a step
    written again replaces the earlier copy only after the new one is complete. With
    ``keep_steps``, step folders of steps not in it (rotated checkpoints) are deleted: only
    folders named by a number that hold an index.
    """
    import shutil

    root = check_step_weights_dir(checkpoint_dir)
    final, partial = root / str(step), root / f".{step}.partial"
    main = jax.process_index() == 0
    if main:
        root.mkdir(parents=True, exist_ok=True)
        if not (root / MARKER).is_file():
            (root / MARKER).write_text(
                json.dumps(
                    {
                        "about": "jzero's 16-bit models of the checkpoints in "
                        f"{Path(checkpoint_dir).name}: one folder per step, Hugging Face's "
                        "sharded safetensors layout. jzero replaces and deletes only those "
                        "numbered folders."
                    }
                )
                + "\n"
            )
        if partial.is_dir():
            shutil.rmtree(partial)  # a write cut short
    save_weights(partial, params, max_shard_size=max_shard_size)
    if main:
        aside = root / f".{step}.replaced"
        if _ours(final):
            os.replace(final, aside)
        os.replace(partial, final)
        if aside.is_dir():
            shutil.rmtree(aside)
        if keep_steps is not None:
            keep = {int(s) for s in keep_steps} | {int(step)}
            for p in root.iterdir():
                if p.name.isdigit() and int(p.name) not in keep and _ours(p):
                    shutil.rmtree(p)
    barrier("jzero_16bit_done")
    return final


def check_step_weights_dir(checkpoint_dir: str | os.PathLike) -> Path:
    """The folder :func:`save_step_weights` writes into, once it is known to be jzero's or new.

    Raises:
      ValueError: the folder holds files without jzero's marker.
    """
    root = Path(f"{Path(checkpoint_dir).expanduser().absolute()}_16bit")
    if root.exists() and not (root / MARKER).is_file():
        if not root.is_dir() or any(root.iterdir()):
            raise ValueError(
                f"zero_optimization.stage3_gather_16bit_weights_on_model_save writes the 16-bit "
                f"model beside the checkpoints, into {str(root)!r}, but that path holds files "
                f"that are not jzero's (no {MARKER}); jzero never writes into or deletes from "
                "it. Move them, or set checkpoint.directory elsewhere."
            )
    return root
