"""The engine's checks: a plan against ``stage3_max_live_parameters`` and the mesh, a state
before a save.

Decisions:

* ``stage3_max_live_parameters`` is checked when the plan is fitted to the loss's scans
  (:func:`jzero.engine.resolve.fit_layers`): stage 3 gathers one unit at a time (a layer of a
  scanned stack, or a whole leaf used outside a scan). A limit below the largest unit is a
  warning, and that unit is gathered whole anyway: DeepSpeed's limit bounds what it keeps and
  prefetches, and it too fetches a module whatever its size, so such a config trains as it does
  there. 0 (Axolotl's configs) keeps nothing beyond the unit in use and says nothing.
* A stage above 0 over a data axis of one device splits nothing: :class:`JzeroMeshWarning`
  says so at ``initialize`` (on a lone CPU device, with the ``XLA_FLAGS`` line that gives
  more), since a Python user without that flag otherwise "shards" over one device silently.
* A save first checks that the parameters are finite: each process reads its own shards
  (replica 0) on the host, so nothing compiles and offloaded leaves work too, and every process
  takes the same decision (:func:`jzero.distributed.any_process`), or the save's barriers hang.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jzero import distributed
from jzero.parallel.zero import largest_gathered
from jzero.plan import Plan

PyTree = Any


def check_live_parameters(plan: Plan, limit: int) -> None:
    """Stage 3 gathers one unit at a time: a ``stage3_max_live_parameters`` below the largest
    one is a warning (the unit is gathered whole all the same, as DeepSpeed fetches it)."""
    from jzero.config import JzeroConfigWarning

    largest, path = largest_gathered(plan)
    if limit and largest > limit:  # 0 (Axolotl's configs): keep nothing beyond the unit used
        warnings.warn(
            f"zero_optimization.stage3_max_live_parameters is {limit:,}, but stage 3 gathers "
            f"{largest:,} elements at once for {path!r} (one layer of a scanned stack, or a "
            "whole leaf used outside a scan); it is gathered whole all the same, as DeepSpeed "
            f"fetches it. Raise stage3_max_live_parameters to at least {largest:,}, or split "
            "that parameter, to keep the limit.",
            JzeroConfigWarning,
            stacklevel=3,
        )


def check_mesh_splits(plan: Plan, mesh: jax.sharding.Mesh) -> None:
    """A ZeRO stage above 0 whose state is split into one shard: a warning naming the mesh
    and the fix (on one CPU device, the ``XLA_FLAGS`` line for virtual devices)."""
    from jzero.config import JzeroMeshWarning

    if not plan.stage.shard_opt_state or plan.state_shards > 1:  # stage 0 splits nothing
        return
    if mesh.devices.size == 1 and jax.default_backend() == "cpu":
        fix = (
            "JAX sees one CPU device: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "before jax is imported (in the shell, or os.environ at the top of the script) for "
            "8 virtual devices"
        )
    elif mesh.devices.size == 1:
        fix = f"JAX sees one device ({mesh.devices.flat[0]}); check jax.devices()"
    else:
        fix = (
            "the other axes take every device; give the data axis more (mesh: {data: -1} takes "
            "what they leave) or use stage 0"
        )
    warnings.warn(
        f"ZeRO stage {plan.stage.stage} splits the training state over the data axis, but the "
        f"mesh {dict(mesh.shape)} gives it one device: nothing is split, and every device holds "
        f"the whole state. {fix[0].upper()}{fix[1:]}.",
        JzeroMeshWarning,
        stacklevel=3,
    )


def finite(*trees: PyTree) -> bool:
    """Whether every floating value of ``trees`` is finite, on all processes.

    Reads each process's own shards on the host (a save copies them there anyway), so it
    compiles nothing and works on offloaded leaves too.
    """
    ok = True
    for x in jax.tree.leaves(trees):
        if not (isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact)):
            continue
        shards = [s for s in x.addressable_shards if s.replica_id == 0]
        ok = ok and all(np.isfinite(np.asarray(s.data)).all() for s in shards)
        if not ok:
            break
    return not distributed.any_process(not ok)  # all decide alike, or the save's barriers hang
