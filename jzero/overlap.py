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
* Stage 3's one-layer-ahead gather lives in the replay (:func:`jzero.gather.gathered`,
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
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
    and the mesh's devices are GPUs.

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
    if not plan.overlap_comm or platform not in _GPU_PLATFORMS:
        return {}
    opts = dict(GPU_ASYNC_OPTIONS)
    prec = plan.precision
    comm = prec.comm_dtype if prec.comm_dtype is not None else prec.compute_dtype
    itemsize = jnp.dtype(comm).itemsize
    if plan.reduce_bucket_size is not None:
        limit = int(plan.reduce_bucket_size) * itemsize
        opts["xla_gpu_all_reduce_combine_threshold_bytes"] = limit
        opts["xla_gpu_reduce_scatter_combine_threshold_bytes"] = limit
    if plan.allgather_bucket_size is not None:
        opts["xla_gpu_all_gather_combine_threshold_bytes"] = (
            int(plan.allgather_bucket_size) * itemsize
        )
    return opts


# -- stage 3: the scan that gathers one layer ahead ----------------------------------------------


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return bool(jnp.issubdtype(dtype if dtype is not None else jnp.result_type(x), jnp.inexact))


def _vjp_parts(
    f: Callable[..., Any], args: tuple, weights: list[Any], consts: list[Any]
) -> tuple[Any, list[Any], tuple[Any, tuple]]:
    """``f(*args)`` and its VJP split into what must be kept per layer and what need not.

    The VJP function is a pytree whose leaves are its residuals. Leaves that *are* one of
    ``weights`` (the gathered weights the layer ran with) or ``consts`` (the same in every
    layer) are left out and recorded by position, to be supplied again by :func:`_rebuild`:
    the weights gathered anew, the consts as they are. The rest (the layer's input, what the
    checkpoint policy saves) is returned to be stacked over the layers.
    """
    out, vjp_fn = jax.vjp(f, *args)
    leaves, tree = jax.tree.flatten(vjp_fn)
    by_id = {id(x): ("w", i) for i, x in enumerate(weights)}
    by_id.update({id(x): ("c", i) for i, x in enumerate(consts) if id(x) not in by_id})
    where = tuple(by_id.get(id(leaf), ("r", 0)) for leaf in leaves)
    kept = [leaf for leaf, (kind, _) in zip(leaves, where, strict=True) if kind == "r"]
    return out, kept, (tree, where)


def _rebuild(static: tuple[Any, tuple], kept: list[Any], weights: list[Any], consts: list[Any]):
    """The VJP function of :func:`_vjp_parts` from its kept residuals and fresh weights."""
    tree, where = static
    it = iter(kept)
    leaves = [
        next(it) if kind == "r" else weights[i] if kind == "w" else consts[i] for kind, i in where
    ]
    return jax.tree.unflatten(tree, leaves)


def _at(xs: Sequence[Any], i: Any) -> list[Any]:
    return [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs]


def _put(bufs: Sequence[Any], i: Any, vals: Sequence[Any]) -> list[Any]:
    return [
        jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0)
        for b, v in zip(bufs, vals, strict=True)
    ]


def _zeros(xs: Sequence[Any], length: int) -> list[Any]:
    return [jnp.zeros((length, *jnp.shape(x)), jnp.result_type(x)) for x in xs]


def _first(tree: Any) -> Any:
    leaves = [x for x in jax.tree.leaves(tree) if _floating(x) and jnp.size(x)]
    return leaves[0].reshape(-1)[0] if leaves else None


def _tied(shard: Any, anchor: Any) -> Any:
    """``shard`` made to wait for ``anchor`` (its value unchanged), see :func:`jzero.trace.tied`."""
    if anchor is None or not _floating(shard):
        return shard
    return shard + (anchor != anchor).astype(shard.dtype) * 0


def can_overlap(carry: Sequence[Any], out_avals: Sequence[Any], length: int) -> bool:
    """Whether :func:`overlapped_scan` takes a scan: two layers or more, and a floating carry
    and floating per-layer outputs (their cotangents flow through the backward loop)."""
    avals = [*carry, *out_avals]
    return length >= 2 and all(_floating(x) for x in avals)


def overlapped_scan(
    layer: Callable[[list[Any], list[Any], list[Any]], tuple[list[Any], list[Any]]],
    gathers: Sequence[Callable[[Any], Any] | None],
    consts: Sequence[Any],
    init: Sequence[Any],
    xs: Sequence[Any],
    length: int,
    policy: Any,
) -> tuple[list[Any], list[Any]]:
    """A layer scan whose gathered weights are fetched one layer ahead (stage 3's
    ``overlap_comm``), forward and backward, with the gradients of ``jax.lax.scan`` of the
    same body.

    Forward: layer 0 is gathered before the loop; iteration ``i`` gathers layer ``i + 1`` (data
    independent of layer ``i``'s compute, so the two can run together) and computes layer ``i``
    with the weights the previous iteration gathered, which the loop carries. Backward (a custom
    VJP, in reverse): iteration ``i`` gathers layer ``i - 1`` ahead, reduce-scatters layer
    ``i + 1``'s weight gradient (computed by the previous iteration and carried) and computes
    layer ``i``'s backward pass; nothing of one depends on the others. The backward pass
    re-gathers each layer instead of keeping the forward's gathered weights: per layer only the
    layer's input and what ``policy`` saves are kept (no gathered weight), so the weights live
    at any time are a constant few layers (the layer in use, the one being fetched, the
    gradient being reduced), whatever the number of layers. The first and last layers run
    outside the loops (the loops have nothing to fetch or reduce there).

    Args:
      layer: ``layer(carry, x, consts) -> (carry, y)``, one layer; ``x`` holds the gathered
        weights at the positions ``gathers`` names.
      gathers: per scanned operand, ``None``, or the gather of one layer's shard (its
        transpose is the gradient's reduce-scatter).
      consts: the values every layer reads (not scanned).
      init: the initial carry (floating).
      xs: the scanned operands, stacked on dimension 0: shards where ``gathers`` has a
        gather, layer inputs otherwise.
      length: the number of layers (>= 2).
      policy: the ``jax.checkpoint`` policy of one layer: what it keeps for its backward pass.

    Returns:
      ``(carry, ys)`` as ``jax.lax.scan`` returns them.
    """
    pend = [g is not None for g in gathers]
    fetch = [g for g in gathers if g is not None]

    def merged(plain: Sequence[Any], weights: Sequence[Any]) -> list[Any]:
        a, b = iter(plain), iter(weights)
        return [next(b) if p else next(a) for p in pend]

    def body(carry: Any, plain: Any, weights: Any, consts: Any) -> Any:
        return layer(list(carry), merged(plain, weights), list(consts))

    f = jax.checkpoint(body, policy=policy) if policy is not None else body

    def gather_all(shards: Sequence[Any], anchor: Any = None) -> list[Any]:
        return [g(_tied(s, anchor)) for g, s in zip(fetch, shards, strict=True)]

    static: dict[str, Any] = {}
    last = length - 1

    def fwd(consts: list[Any], init: list[Any], xs: list[Any]) -> Any:
        plain = [x for x, p in zip(xs, pend, strict=True) if not p]
        shards = [x for x, p in zip(xs, pend, strict=True) if p]
        y_avals = jax.eval_shape(
            lambda c, x, w: body(c, x, w, consts)[1],
            init,
            _at(plain, 0),
            gather_all(_at(shards, 0)),
        )

        def step(state: Any, i: Any) -> Any:
            carry, weights, ys = state
            ahead = gather_all(_at(shards, i + 1))  # layer i + 1, beside layer i's compute
            (carry, y), kept, st = _vjp_parts(
                f, (carry, _at(plain, i), weights, consts), weights, consts
            )
            static["loop"] = st
            return (list(carry), ahead, _put(ys, i, y)), kept

        ys = [jnp.zeros((length, *a.shape), a.dtype) for a in y_avals]
        first = (list(init), gather_all(_at(shards, 0)), ys)
        (carry, weights, ys), kept = jax.lax.scan(step, first, jnp.arange(last))
        (carry, y), kept_last, static["last"] = _vjp_parts(
            f, (carry, _at(plain, last), weights, consts), weights, consts
        )
        return (list(carry), _put(ys, last, y)), (consts, plain, shards, kept, kept_last)

    def bwd(res: Any, cts: Any) -> Any:
        consts, plain, shards, kept, kept_last = res
        ct_carry, ct_ys = cts
        fc = [i for i, c in enumerate(consts) if _floating(c)]
        fx = [i for i, x in enumerate(plain) if _floating(x)]

        def reduce(ct_weights: list[Any], shards_i: list[Any]) -> list[Any]:
            """The transpose of a layer's gathers: its gradients' reduce-scatter."""
            return jax.vjp(gather_all, shards_i)[1](ct_weights)[0]

        def add(acc: list[Any], ct: Any) -> list[Any]:
            return [a + ct[i] for a, i in zip(acc, fc, strict=True)]

        def floats(ct: Any) -> list[Any]:
            return [ct[i] for i in fx]

        # The last layer; layer last - 1 is fetched beside it. Both wait for the cotangent.
        anchor = _first(cts)
        vjp = _rebuild(static["last"], kept_last, gather_all(_at(shards, last), anchor), consts)
        ahead = gather_all(_at(shards, last - 1), anchor)
        ct_carry, ct_x, ct_w, ct_k = vjp((ct_carry, _at(ct_ys, last)))
        acc = [ct_k[i] for i in fc]
        ct_shards = _zeros(_at(shards, 0), length)
        ct_plain = _put(_zeros(floats(_at(plain, 0)), length), last, floats(ct_x))

        def step(state: Any, i: Any) -> Any:
            ct_carry, weights, ct_above, acc, ct_shards, ct_plain = state
            below = gather_all(_at(shards, i - 1))  # layer i - 1, ahead
            ct_shards = _put(ct_shards, i + 1, reduce(ct_above, _at(shards, i + 1)))
            vjp = _rebuild(static["loop"], _at(kept, i), weights, consts)
            ct_carry, ct_x, ct_w, ct_k = vjp((ct_carry, _at(ct_ys, i)))
            state = (list(ct_carry), below, ct_w, add(acc, ct_k), ct_shards)
            return (*state, _put(ct_plain, i, floats(ct_x))), None

        first = (list(ct_carry), ahead, ct_w, acc, ct_shards, ct_plain)
        state, _ = jax.lax.scan(step, first, jnp.arange(1, last), reverse=True)
        ct_carry, weights, ct_above, acc, ct_shards, ct_plain = state
        # Layer 0, beside layer 1's reduce-scatter; then layer 0's own.
        vjp = _rebuild(static["loop"], _at(kept, 0), weights, consts)
        ct_shards = _put(ct_shards, 1, reduce(ct_above, _at(shards, 1)))
        ct_init, ct_x, ct_w, ct_k = vjp((ct_carry, _at(ct_ys, 0)))
        acc = add(acc, ct_k)
        ct_plain = _put(ct_plain, 0, floats(ct_x))
        ct_shards = _put(ct_shards, 0, reduce(ct_w, _at(shards, 0)))
        ct_consts: list[Any] = [None] * len(consts)  # None: no gradient (integer inputs)
        for a, i in zip(acc, fc, strict=True):
            ct_consts[i] = a
        ct_xs: list[Any] = [None] * len(plain)
        for a, i in zip(ct_plain, fx, strict=True):
            ct_xs[i] = a
        return ct_consts, list(ct_init), merged(ct_xs, ct_shards)

    @jax.custom_vjp
    def run(consts: list[Any], init: list[Any], xs: list[Any]) -> Any:
        return fwd(consts, init, xs)[0]

    run.defvjp(fwd, bwd)
    return run(list(consts), list(init), list(xs))
