"""Grouped and hidden communication: gradient buckets, and XLA's asynchronous-collective options.

DeepSpeed's ``overlap_comm`` reduces gradients on a second CUDA stream while the backward pass
goes on, bucket by bucket (``reduce_bucket_size`` elements each). Under XLA user code has no
streams: what may overlap is decided by data dependences, and what does by the compiler's
scheduler. jzero gives the scheduler that structure and, on a GPU, turns the scheduler on:

* **Buckets** (stages 0-2, ``overlap_comm: true``): the gradient reduction is one collective
  per bucket of consecutive leaves instead of one per leaf (:func:`reduce_buckets`), and the
  all-gather of the updated parameters likewise per ``allgather_bucket_size``
  (:func:`gather_buckets`). A bucket depends only on its own leaves' gradients, so the
  collective of a bucket whose gradients are ready can run while the backward pass computes
  the rest.
* **Compile options** (:func:`compiler_options`): on a GPU the step is compiled with XLA's
  latency-hiding scheduler and collective pipelining on, and the combine thresholds set to the
  bucket sizes, so that XLA does not merge the buckets back into one collective at the end.
* Stage 3's one-layer-ahead gather lives in the replay (:func:`jzero.rewrite.gather.gather_at_use`,
  ``overlap``); the asynchronous collectives a compiled GPU program runs, and what compute
  sits between their start and done, are read by :func:`jzero.hlo.async_collectives`.

Decisions:

* **Sizes are elements**, as DeepSpeed's. Leaves are grouped greedily in ``jax.tree.leaves``
  order while the bucket's elements stay within the size; a leaf larger than the bucket is a
  bucket of its own. Leaves that are reduced differently (a reduce-scatter and an all-reduce)
  or in different dtypes never share a bucket.
* **A bucket is one buffer of rows.** Each leaf of a reduce-scatter bucket is viewed as ``n``
  rows, row ``i`` holding the part device ``i`` keeps (:func:`to_rows`: a reshape when the leaf's
  shard is one contiguous block, a transpose when it is sharded after a dimension of size > 1,
  the copy XLA would otherwise make around a minor-dimension collective), the rows of every
  leaf are concatenated, reduced once on dimension 0 and split again. An all-reduce bucket is
  the flattened leaves end to end. A bucket of one leaf is reduced as the leaf itself, so
  ``overlap_comm: false`` and a bucket per leaf give the same program.
* **Compile options only on a GPU.** The CPU backend runs collectives synchronously and has no
  such scheduler: there the options are left out (the same program compiles), and the
  structural facts (how many collectives, what depends on what) are what CPU tests assert.
* **One CPU exception: bf16 collectives in a partly manual step.** XLA:CPU widens each bf16
  all-reduce and reduce-scatter to float32 (it has no 16-bit reductions) in its
  ``all-reduce-promotion`` pass, which aborts the process when the collective sits in a
  ``shard_map`` that leaves an axis to the partitioner (AutoTP's ``model``): the partitioner
  ends the reduction's combiner in a copy, and the pass rebuilds the combiner as a binary op
  of the root's opcode. There the step is compiled with that pass off; the CPU's
  ``float-normalization-bf16`` pass widens the same collectives instead (reduce in float32,
  round the result to bf16: the same arithmetic), so the program jzero emits, with its bf16
  communication, is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CPU_PARTLY_MANUAL_BF16_OPTIONS",
    "GPU_ASYNC_OPTIONS",
    "bucket_groups",
    "compiler_options",
    "from_rows",
    "gather_buckets",
    "reduce_buckets",
    "to_rows",
]

# XLA GPU options that let collectives run asynchronously beside compute.
GPU_ASYNC_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")

# XLA:CPU options for a step whose bf16 collectives sit in a partly manual ``shard_map``: its
# ``all-reduce-promotion`` pass aborts on them; ``float-normalization-bf16`` widens them instead.
CPU_PARTLY_MANUAL_BF16_OPTIONS: dict[str, Any] = {
    "xla_disable_hlo_passes": "all-reduce-promotion",
}


def bucket_groups(
    sizes: Sequence[int], keys: Sequence[Hashable], limit: int | None
) -> list[list[int]]:
    """Indices of consecutive items grouped into buckets of at most ``limit`` elements.

    Args:
      sizes: elements of each item.
      keys: per item, what must agree within a bucket (e.g. the reduction and the dtype);
        items of different keys are bucketed separately, each key in order.
      limit: the bucket size; ``None``: every item alone.

    Returns:
      The buckets, each a list of indices, ordered by their first index.
    """
    if limit is None:
        return [[i] for i in range(len(sizes))]
    groups: list[list[int]] = []
    open_: dict[Hashable, tuple[list[int], int]] = {}
    for i, (size, key) in enumerate(zip(sizes, keys, strict=True)):
        current = open_.get(key)
        if current is not None and current[1] + size <= limit:
            current[0].append(i)
            open_[key] = (current[0], current[1] + size)
        else:
            group = [i]
            groups.append(group)
            open_[key] = (group, size)
    return groups


def to_rows(x: jax.Array, dim: int, n: int) -> jax.Array:
    """``x`` as ``(n, -1)``: row ``i`` is the ``i``-th of ``n`` tiles along ``dim``, flattened."""
    lead = math.prod(x.shape[:dim])
    return jnp.moveaxis(x.reshape(lead, n, -1), 1, 0).reshape(n, -1)


def from_rows(rows: jax.Array, shape: Sequence[int], dim: int) -> jax.Array:
    """The inverse of :func:`to_rows`: ``n`` rows back into the array of ``shape``."""
    n, lead = rows.shape[0], math.prod(shape[:dim])
    return jnp.moveaxis(rows.reshape(n, lead, -1), 0, 1).reshape(tuple(shape))


def _shard_shape(shape: Sequence[int], dim: int, n: int) -> tuple[int, ...]:
    return (*shape[:dim], shape[dim] // n, *shape[dim + 1 :])


def _split(buf: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
    cuts = np.cumsum(widths)[:-1].tolist()
    return jnp.split(buf, cuts, axis=-1) if cuts else [buf]


def reduce_buckets(
    leaves: Sequence[jax.Array],
    dims: Sequence[int | None],
    n: int,
    limit: int | None,
    scatter: Callable[[jax.Array, int], jax.Array],
    total: Callable[[jax.Array], jax.Array],
) -> list[jax.Array]:
    """Reduces ``leaves`` in buckets: one collective per bucket instead of one per leaf.

    Must run inside ``shard_map``. A leaf with a ``dim`` is reduce-scattered on it (each device
    keeps its ``1/n`` tile), one without is all-reduced.

    Args:
      leaves: the local gradients, each to reduce.
      dims: per leaf, the dimension to scatter on, or ``None`` to all-reduce it.
      n: the size of the axis the reduce-scatter runs over.
      limit: the bucket size in elements; ``None``: one collective per leaf.
      scatter: ``scatter(x, dim)``, the tiled reduce-scatter of one array.
      total: ``total(x)``, the all-reduce of one array.

    Returns:
      The reduced leaves in order: ``1/n`` tiles for the scattered ones, whole for the rest.
    """
    keys = [(d is None, jnp.dtype(x.dtype)) for x, d in zip(leaves, dims, strict=True)]
    out: list[Any] = [None] * len(leaves)
    for group in bucket_groups([int(x.size) for x in leaves], keys, limit):
        xs, ds = [leaves[i] for i in group], [dims[i] for i in group]
        if len(group) == 1:
            x, d = xs[0], ds[0]
            out[group[0]] = total(x) if d is None else scatter(x, d)
            continue
        if ds[0] is None:
            summed = total(jnp.concatenate([x.reshape(-1) for x in xs]))
            pieces = _split(summed, [x.size for x in xs])
            for i, x, piece in zip(group, xs, pieces, strict=True):
                out[i] = piece.reshape(x.shape)
            continue
        rows = [to_rows(x, d, n) for x, d in zip(xs, ds, strict=True)]
        mine = scatter(jnp.concatenate(rows, axis=1), 0)  # (1, total / n)
        pieces = _split(mine, [r.shape[1] for r in rows])
        for i, x, d, piece in zip(group, xs, ds, pieces, strict=True):
            out[i] = piece.reshape(_shard_shape(x.shape, d, n))
    return out


def gather_buckets(
    shards: Sequence[jax.Array],
    dims: Sequence[int | None],
    n: int,
    limit: int | None,
    gather: Callable[[jax.Array, int], jax.Array],
    keys: Sequence[Hashable] | None = None,
) -> list[jax.Array]:
    """All-gathers ``shards`` in buckets: the inverse layout of :func:`reduce_buckets`.

    Must run inside ``shard_map``. A shard with ``dim`` ``None`` is passed through.

    Args:
      shards: the local tiles.
      dims: per shard, the dimension its tiles are concatenated on, or ``None``.
      n: the size of the gathered axis.
      limit: the bucket size in elements of the gathered arrays; ``None``: one per leaf.
      gather: ``gather(x, dim)``, the tiled all-gather of one array.
      keys: per shard, what must agree within a bucket besides the dtype (e.g. the axes).

    Returns:
      The gathered arrays in order.
    """
    keys = keys if keys is not None else [None] * len(shards)
    full = [int(x.size) * n for x in shards]
    bucket_keys = [
        (d is None, k, jnp.dtype(x.dtype)) for x, d, k in zip(shards, dims, keys, strict=True)
    ]
    out: list[Any] = [None] * len(shards)
    for group in bucket_groups(full, bucket_keys, limit):
        xs, ds = [shards[i] for i in group], [dims[i] for i in group]
        if ds[0] is None or len(group) == 1:
            for i, x, d in zip(group, xs, ds, strict=True):
                out[i] = x if d is None else gather(x, d)
            continue
        rows = gather(jnp.concatenate([x.reshape(1, -1) for x in xs], axis=1), 0)  # (n, ...)
        pieces = _split(rows, [x.size for x in xs])
        for i, x, d, piece in zip(group, xs, ds, pieces, strict=True):
            shape = (*x.shape[:d], x.shape[d] * n, *x.shape[d + 1 :])
            out[i] = from_rows(piece, shape, d)
    return out


def compiler_options(plan: Any, platform: str | None = None) -> dict[str, Any]:
    """The XLA options a step of ``plan`` is compiled with: empty unless ``overlap_comm`` is on
    and the mesh's devices are GPUs, or the step's bf16 collectives sit in a partly manual
    ``shard_map`` on the CPU (:data:`CPU_PARTLY_MANUAL_BF16_OPTIONS`).

    On a GPU: :data:`GPU_ASYNC_OPTIONS` (latency-hiding scheduler, pipelined all-gather,
    reduce-scatter and all-reduce), plus, where the plan has buckets, the all-reduce and
    reduce-scatter combine thresholds at ``reduce_bucket_size`` and the all-gather one at
    ``allgather_bucket_size`` elements of the communication dtype.

    Args:
      plan: a :class:`jzero.plan.Plan`.
      platform: the backend to compile for; default: the platform of the plan's devices.

    Returns:
      A dict for ``jax.jit(..., compiler_options=...)``.
    """
    if platform is None:
        platform = plan.mesh.devices.flat[0].platform
    prec = plan.options.precision
    comm = prec.comm_dtype if prec.comm_dtype is not None else prec.compute_dtype
    if platform == "cpu" and jnp.dtype(comm) == jnp.bfloat16 and plan.auto_axes:
        return dict(CPU_PARTLY_MANUAL_BF16_OPTIONS)
    collectives = plan.options.comm
    if not collectives.overlap_comm or platform not in _GPU_PLATFORMS:
        return {}
    opts = dict(GPU_ASYNC_OPTIONS)
    itemsize = jnp.dtype(comm).itemsize
    if collectives.reduce_bucket_size is not None:
        limit = int(collectives.reduce_bucket_size) * itemsize
        opts["xla_gpu_all_reduce_combine_threshold_bytes"] = limit
        opts["xla_gpu_reduce_scatter_combine_threshold_bytes"] = limit
    if collectives.allgather_bucket_size is not None:
        opts["xla_gpu_all_gather_combine_threshold_bytes"] = (
            int(collectives.allgather_bucket_size) * itemsize
        )
    return opts
