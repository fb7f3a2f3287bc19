"""Host offload as JAX memory kinds: DeepSpeed's ``offload_optimizer`` and ``offload_param``,
which kind a leaf rests in, and which leaves go to host.

Decisions:

* Offload is not a stage: it is a memory kind on the plan's shardings. The optimizer state and,
  under mixed precision, the float32 master weights rest in host memory at stages 1-3
  (``offload_optimizer``); the parameter shards rest there at stage 3 (``offload_param``). The
  step brings them into device memory inside ``jit`` and its ``out_shardings`` send the results
  back, so XLA schedules the copies; numerics are those of the same run without offload.
* ``pin_memory: true`` (DeepSpeed's default) is ``pinned_host``, page-locked memory the device
  copies from directly; ``false`` is ``unpinned_host``. A backend whose devices do not address
  the kind gets an error listing the kinds they do have. NVMe (``device: nvme``) is not a memory
  kind: the state rests in files between steps (:mod:`jzero.nvme.step`).
* ``ratio < 1`` offloads that fraction of the optimizer-state bytes: the plan puts the largest
  parameters' state (and masters) in host memory first (:func:`jzero.plan.make_plan`).
* ``sub_group_size``: the step brings the offloaded state into device memory one group of
  leaves at a time and sends each group's results back before the next comes in
  (:mod:`jzero.subgroups`), so the device holds one group of it, not all.
* Offload moves state off the device between steps; during the step the offloaded shards are in
  device memory one step at a time, as in DeepSpeed's ZeRO-Offload.

* Offload is a memory kind on a ``NamedSharding`` (``pinned_host`` or ``unpinned_host``), not a
  separate placement: :func:`is_host` reads it, :func:`on_device` gives the device-memory
  shardings the step computes on.
* ``offload_optimizer.ratio < 1`` offloads whole parameter leaves' optimizer state and masters,
  the largest first, each taken when it brings the offloaded elements closer to the fraction
  (:func:`offloaded_leaves`); a leaf is never split, and every leaf goes at ratio 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from jzero.choices.stages import HOST_MEMORY_KINDS, PINNED_HOST, UNPINNED_HOST
from jzero.parallel.zero.leaf_rule import LeafPlan

__all__ = [
    "HOST_MEMORY_KINDS",
    "PINNED_HOST",
    "UNPINNED_HOST",
    "available_memory_kinds",
    "check_memory_kind",
    "is_host",
    "on_device",
]

PyTree = Any


def is_host(sharding: Any) -> bool:
    """Whether a sharding places its array in host memory (offload)."""
    return getattr(sharding, "memory_kind", None) in HOST_MEMORY_KINDS


def on_device(shardings: PyTree) -> PyTree:
    """The same shardings in device memory (how the step computes on offloaded state)."""
    return jax.tree.map(
        lambda s: s.with_memory_kind("device") if is_host(s) else s,
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding),
    )


def offloaded_leaves(leaves: Sequence[LeafPlan], ratio: float) -> frozenset[int]:
    """The parameter leaves whose optimizer state and masters are offloaded for ``ratio``:
    largest first, each taken when it brings the offloaded elements closer to ``ratio`` of all
    (a leaf is never split); every leaf at ``ratio`` 1."""
    if ratio >= 1.0:
        return frozenset(range(len(leaves)))
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    target, taken, chosen = ratio * sum(sizes), 0, set()
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if abs(taken + sizes[i] - target) < abs(taken - target):
            chosen.add(i)
            taken += sizes[i]
    return frozenset(chosen)


def with_kind(shardings: PyTree, memory_kind: str | None) -> PyTree:
    if memory_kind is None:
        return shardings
    return jax.tree.map(
        lambda s: s.with_memory_kind(memory_kind),
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding),
    )


def available_memory_kinds(devices: Sequence[Any] | None = None) -> list[str]:
    """The memory kinds every one of ``devices`` (default: all local devices) addresses."""
    devices = list(devices) if devices is not None else jax.local_devices()
    kinds: set[str] | None = None
    for d in devices:
        mine = {m.kind for m in d.addressable_memories()}
        kinds = mine if kinds is None else kinds & mine
    return sorted(kinds or ())


def check_memory_kind(kind: str, what: str, devices: Sequence[Any] | None = None) -> str:
    """Returns ``kind`` if the devices address it, else raises an error listing what they have.

    Args:
      kind: a memory kind, e.g. ``"pinned_host"``.
      what: the config key that asked for it, for the message.
      devices: the devices to check (default: all local devices).

    Raises:
      ValueError: naming the kind, the backend, and the kinds its devices have.
    """
    devices = list(devices) if devices is not None else jax.local_devices()  # may be an iterator
    have = available_memory_kinds(devices)
    if kind in have:
        return kind
    platform = devices[0].platform if devices else "(no)"
    hint = (
        "set pin_memory: true to use pinned_host"
        if kind == UNPINNED_HOST and PINNED_HOST in have
        else "set device: none to keep the state in device memory"
    )
    raise ValueError(
        f"{what} asks for host memory of kind {kind!r}, but the {platform} devices address only "
        f"{have}. In the config, {hint}."
    )
