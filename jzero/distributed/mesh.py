"""Device meshes: always ``AxisType.Auto`` axes, the data-parallel axis named ``data``.

Decisions:

* ``jax.make_mesh`` defaults to Explicit axes in current JAX, under which sharding-unaware loss
  functions fail; jzero always asks for Auto axes.
* ``data: -1`` takes every device. Asking for more devices than exist is an error that says
  how to get more virtual devices on CPU.
* Extra axes (e.g. ``model: 2``) may be listed beside ``data`` for a user's own partition
  specs (``nnx.with_partitioning``, ``nn.with_partitioning``, ``InitOptions.param_specs``).
  The axes keep the order given; the config puts ``data`` first, so one model-parallel group
  is made of neighbouring devices. One axis may be ``-1``: the devices the others leave.
* The product of the sizes must equal the number of devices: a mesh that silently left
  devices idle would hide a typo. To train on fewer devices, pass them as ``devices``.
* ``replica`` (hybrid sharding: FSDP's HSDP, DeepSpeed's MiCS) is always the outermost axis,
  ``pipe`` (pipeline stages) the next, then ``data``, then ``context`` (ring attention) and
  ``seq`` (Ulysses) where there are, so each ``data`` group is made of neighbouring devices:
  within one host. ``seq`` is the minor one: its all-to-alls move the most bytes a layer, and
  a ring's neighbours are then ``seq``-groups apart.
  With several processes the devices are laid out by ``create_hybrid_device_mesh`` with the
  processes as the slow (cross-host) dimension, so that ``replica`` runs across processes and
  ``data`` within them wherever the sizes allow.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

__all__ = [
    "CONTEXT_AXIS",
    "DATA_AXIS",
    "EXPERT_AXIS",
    "PIPE_AXIS",
    "REPLICA_AXIS",
    "SEQ_AXIS",
    "make_mesh",
]

logger = logging.getLogger("jzero")

DATA_AXIS = "data"
"""The name of the data-parallel mesh axis, the one ZeRO shards over."""

SEQ_AXIS = "seq"
"""The name of the sequence-parallel axis (DeepSpeed-Ulysses, :mod:`jzero.parallel.sequence`):
its devices share the batch's rows and split their tokens; ZeRO shards over it beside
``data``."""

CONTEXT_AXIS = "context"
"""The name of the context-parallel axis (ring attention, :mod:`jzero.parallel.sequence`): its
devices share the batch's rows and each holds two zig-zag chunks of their tokens, keys and
values passing around it; ZeRO shards over it beside ``data``. Beside ``seq`` (two-dimensional
sequence parallelism) it is the major of the two."""

EXPERT_AXIS = "expert"
"""The name of the expert-parallel axis (:mod:`jzero.parallel.expert`): the batch is split
over it as over ``data``, each expert leaf rests split over it (each device holds ``E / E_p``
experts, and tokens reach them by all-to-all), and ZeRO shards every other leaf over ``data``
x ``expert``. It is the minor axis beside ``data``, so one expert group is neighbouring
devices, as DeepSpeed's expert-parallel groups are consecutive ranks."""

PIPE_AXIS = "pipe"
"""The name of the pipeline-parallel axis (:mod:`jzero.parallel.pipeline`): its devices hold
consecutive stages of the model's stacked layers; ZeRO shards within each stage's ``data``."""

REPLICA_AXIS = "replica"
"""The name of the replica axis (hybrid sharding): the batch is split over it too, but ZeRO's
shards are replicated across it (the gradient shards are all-reduced over it), so that with
``replica`` across hosts and ``data`` within one, only ``1/data`` of the gradient bytes cross
hosts. Under ZeRO++'s hierarchical partition (hpZ) the optimizer state is sharded over both."""


def make_mesh(
    axes: int | Mapping[str, int] = -1,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """Builds the training mesh.

    Args:
      axes: the data-parallel size (``-1`` for every device), or a mapping of axis name to size
        that contains ``data``, e.g. ``{"data": 4, "model": 2}`` (one axis may be ``-1``: the
        devices left over). The product of the sizes must be the number of devices.
      devices: the devices to use; all of ``jax.devices()`` by default.

    Returns:
      A ``Mesh`` whose axes are all ``AxisType.Auto``, in the order given.

    Raises:
      ValueError: for a size that is not a positive integer or -1, more than one -1, or sizes
        whose product is not the number of devices.

    Example:
      >>> mesh = make_mesh({"data": -1, "model": 2})  # on 8 devices
      >>> dict(mesh.shape)
      {'data': 4, 'model': 2}
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = dict(axes) if isinstance(axes, Mapping) else {DATA_AXIS: axes}
    if DATA_AXIS not in sizes:
        raise ValueError(
            f"The mesh {sizes} has no {DATA_AXIS!r} axis. Add `mesh: {{data: -1}}` to the config."
        )
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(
                f"mesh.{name}: {size!r} is not a valid axis size; it must be a positive integer "
                "or -1 (all the devices left). Set it to -1 to use every device."
            )
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(
            f"mesh: only one axis may be -1, but {', '.join(free)} are. Give the others sizes."
        )
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if len(devices) % fixed:
            raise ValueError(
                f"mesh: {len(devices)} devices can't be split into axes {sizes}: {len(devices)} is "
                f"not divisible by {fixed}. Choose axis sizes whose product divides {len(devices)}."
            )
        sizes[free[0]] = len(devices) // fixed
    total = math.prod(sizes.values())
    if total < len(devices):
        raise ValueError(
            f"mesh {sizes} uses {total} devices but {len(devices)} are available; the product "
            f"of the axis sizes must be {len(devices)}. Set one axis to -1 to take the devices "
            "left, or pass devices=jax.devices()[:N] to jzero.make_mesh (mesh=... to "
            "jzero.initialize) to train on fewer."
        )
    if total > len(devices):
        platform = devices[0].platform if devices else "cpu"
        hint = (
            f" On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={total} before JAX "
            "is imported to get that many virtual devices."
            if platform == "cpu"
            else ""
        )
        raise ValueError(
            f"mesh {sizes} asks for {total} devices but only {len(devices)} {platform} "
            f"device(s) are available. Lower mesh.data (or set it to -1 for all devices).{hint}"
        )
    # replica outermost, then pipe, data, context, seq: data groups (and each data x seq ZeRO
    # group) are neighbours, and each seq group's devices too; a pipeline stage's data group too.
    order = (REPLICA_AXIS, PIPE_AXIS, DATA_AXIS, EXPERT_AXIS, CONTEXT_AXIS, SEQ_AXIS)
    lead = [a for a in order if a in sizes]
    sizes = {**{a: sizes[a] for a in lead}, **{k: v for k, v in sizes.items() if k not in lead}}
    names = tuple(sizes)
    shape = tuple(sizes.values())
    processes = len({getattr(d, "process_index", 0) for d in devices})
    if REPLICA_AXIS in sizes and processes > 1:
        grid = _across_processes(shape, devices, processes)
        if grid is not None:
            return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def _across_processes(
    shape: tuple[int, ...], devices: list[Any], processes: int
) -> np.ndarray | None:
    """The device grid of a hybrid mesh (``replica`` first, ``data`` second) whose replica axis
    runs across processes: ``gcd(replica, processes)`` process groups along ``replica``, the
    rest of the processes along ``data``. ``None`` (with a log line) where the processes'
    devices cannot be laid out that way."""
    replicas, data, rest = shape[0], shape[1], shape[2:]
    outer_r = math.gcd(replicas, processes)
    outer_d = processes // outer_r
    if data % outer_d or len(devices) % processes:
        logger.warning(
            "jzero: mesh replica=%d x data=%d can't keep each data group within a process on "
            "%d processes; the devices are laid out in order.",
            replicas,
            data,
            processes,
        )
        return None
    return mesh_utils.create_hybrid_device_mesh(
        (replicas // outer_r, data // outer_d, *rest),
        (outer_r, outer_d, *(1 for _ in rest)),
        devices,
        process_is_granule=True,
    )
