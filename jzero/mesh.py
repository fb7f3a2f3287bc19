"""Device meshes: always ``AxisType.Auto`` axes, the data-parallel axis named ``data``.

Decisions:

* ``jax.make_mesh`` defaults to Explicit axes in current JAX, under which sharding-unaware loss
  functions fail; jzero always asks for Auto axes.
* ``data: -1`` takes every device. Asking for more devices than exist is an error that says
  how to get more virtual devices on CPU.
* Extra axes (e.g. ``model: 2``) may be listed beside ``data`` for a user's own partition
  specs (``nnx.with_partitioning``, ``nn.with_partitioning``, ``param_specs=``). The axes keep
  the order given; the config puts ``data`` first, so one model-parallel group is made of
  neighbouring devices. One axis may be ``-1``: the devices the others leave.
* The product of the sizes must equal the number of devices: a mesh that silently left
  devices idle would hide a typo. To train on fewer devices, pass them as ``devices``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

__all__ = ["DATA_AXIS", "make_mesh"]

DATA_AXIS = "data"
"""The name of the data-parallel mesh axis, the one ZeRO shards over."""


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
    names = tuple(sizes)
    return jax.make_mesh(
        tuple(sizes.values()),
        names,
        axis_types=(AxisType.Auto,) * len(names),
        devices=devices,
    )
