"""This process's shards of an array on the host, and the array placed back from them.

The NVMe tier (:mod:`jzero.nvme.state`) writes each array as the list of this process's
distinct shards and reads it back into the same sharding.

Decisions:

* A shard is named by its index (``(start, stop)`` per dimension); replicas of one shard on
  several local devices are written once, and the shards are listed in the order of their
  index, so a reader with the same sharding finds them by position alone.
* Placing back puts each device's shard on that device alone
  (``jax.make_array_from_single_device_arrays``): no device receives more than its own shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["host_shards"]


def _index_key(index: tuple, shape: Sequence[int]) -> tuple:
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop)
        for s, dim in zip(index, shape, strict=False)
    )


def host_shards(x: jax.Array) -> list[np.ndarray]:
    """This process's distinct shards of ``x``, in the order of their index."""
    seen: dict[tuple, np.ndarray] = {}
    for shard in x.addressable_shards:
        key = _index_key(shard.index, x.shape)
        if key not in seen:
            seen[key] = np.asarray(shard.data)
    return [seen[k] for k in sorted(seen)]


def shard_count(like: Any, sharding: Any) -> int:
    where = sharding.addressable_devices_indices_map(tuple(like.shape))
    return len({_index_key(index, like.shape) for index in where.values()})


def from_host(shards: Sequence[np.ndarray], like: Any, sharding: Any) -> jax.Array:
    """The array ``like`` (shape, dtype) laid out by ``sharding`` from this process's distinct
    shards (as :func:`host_shards` lists them)."""
    shape = tuple(like.shape)
    where = sharding.addressable_devices_indices_map(shape)
    keys = sorted({_index_key(index, shape) for index in where.values()})
    by_key = dict(zip(keys, shards, strict=True))
    kind = getattr(sharding, "memory_kind", None)  # each shard into the memory it names
    arrays = [
        jax.device_put(
            by_key[_index_key(index, shape)], jax.sharding.SingleDeviceSharding(d, memory_kind=kind)
        )
        for d, index in where.items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
