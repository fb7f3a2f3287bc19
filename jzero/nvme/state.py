"""The NVMe tier's state on disk: which leaves live in which files, and moving them in and out.

With ``offload_optimizer: {device: nvme}`` the optimizer state and, under mixed precision, the
float32 master weights rest in files between steps; with ``offload_param: {device: nvme}`` too
(stage 3) the parameter shards do as well. :class:`NvmeState` knows the layout and does the
moves; :mod:`jzero.nvme.step` runs the step around it.

Decisions:

* Files follow the groups of parameter leaves (:func:`jzero.subgroups.leaf_groups` of
  ``sub_group_size`` elements, every group two leaves or more): per version ``v`` and group
  ``g``, the file ``(v, g)`` holds this process's distinct shards of the group's masters and
  the optimizer state the group owns, and with parameters on NVMe the file ``("p", v, g)``
  holds its parameter shards (in the parameters' own store, which may be another drive).
  Shared state (step counts, injected hyperparameters) is small and stays in memory.
* The engine's :class:`~jzero.step.TrainState` keeps zero-size placeholders
  (:func:`jzero.subgroups.placeholder`) where the disk has the values. :meth:`NvmeState.materialize`
  reads them back into a full state, so checkpoints are ordinary jzero checkpoints, restored
  with or without NVMe on any device count; :meth:`NvmeState.spill` writes a full state out
  (after a restore).
* Versions: a new version is written beside the current one and made current only when every
  file is written (:meth:`NvmeState.switch`), which then deletes the old files; the disk holds
  two versions for that moment, so the path is checked for room for two.
* :func:`jzero.nvme.initial_state.first_version` makes the first version group by group, so the full
  optimizer state never exists in memory, in training or before it.
* A change of the plan's layout at the first step (stage 3's stacked-layer dimensions,
  ``engine.resolve``) re-lays the files group by group (:meth:`NvmeState.relayout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero import subgroups
from jzero.nvme.shards import from_host, host_shards, shard_count
from jzero.nvme.store import NvmeStore
from jzero.plan import PINNED_HOST, Plan, available_memory_kinds, on_device
from jzero.step import TrainState

__all__ = ["NvmeState", "state_bytes"]

PyTree = Any
Kind = str  # "master", "state" (in the group's file) or "param" (in the parameters' file)


def _nbytes(tree: PyTree) -> int:
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
        if hasattr(x, "shape")
    )


def params_at_rest_like(plan: Plan) -> list[jax.ShapeDtypeStruct]:
    """The parameter leaves at rest: their shapes, floating ones in the compute dtype under
    mixed precision."""
    compute = plan.options.precision.compute_dtype
    if not plan.options.precision.mixed:
        return list(jax.tree.leaves(plan.abstract_params))
    return [
        jax.ShapeDtypeStruct(a.shape, compute if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype)
        for a in jax.tree.leaves(plan.abstract_params)
    ]


def state_bytes(plan: Plan, *, params_on_disk: bool = False) -> dict[str, int]:
    """Bytes one version keeps on disk, whole arrays (every process's shards together): under
    ``"optimizer"`` the optimizer state and, under mixed precision, the float32 masters; under
    ``"params"`` the parameters at rest when they are on NVMe too (else 0)."""
    mixed = plan.options.precision.mixed
    optimizer = _nbytes(plan.abstract_opt_state) + (_nbytes(plan.abstract_params) if mixed else 0)
    params = _nbytes(params_at_rest_like(plan)) if params_on_disk else 0
    return {"optimizer": optimizer, "params": params}


def read_ahead(store: NvmeStore, keys: Sequence[Any], on: bool) -> Iterator[Any]:
    """``keys`` in order; with ``on`` (``pipeline_read``), each key's file is read in the
    background up to ``buffer_count - 1`` keys before it is reached."""
    ahead = max(1, store.buffer_count - 1) if on else 0
    for key in keys[:ahead]:
        store.prefetch(key)
    for j, key in enumerate(keys):
        if ahead and j + ahead < len(keys):
            store.prefetch(keys[j + ahead])
        yield key


class NvmeState:
    """Where the NVMe tier keeps a :class:`~jzero.step.TrainState`'s leaves, and the moves.

    Args:
      plan: the sharding plan (its optimizer-state shardings in device memory).
      optimizer: the optax transformation the plan was made for (leafwise: its update is run
        group by group).
      store: the files of the optimizer state and masters.
      sub_group_size: elements per group of parameter leaves.
      param_store: with the parameters on NVMe (``offload_param: {device: nvme}``), the store
        of their files (may be ``store`` itself); ``None`` keeps them in device memory.
      prefetch_params: read the next groups' parameter files while one is being placed
        (``offload_param.pipeline_read``).
    """

    def __init__(
        self,
        plan: Plan,
        optimizer: optax.GradientTransformation,
        store: NvmeStore,
        *,
        sub_group_size: int,
        param_store: NvmeStore | None = None,
        prefetch_params: bool = False,
    ) -> None:
        self.optimizer, self.store, self.param_store = optimizer, store, param_store
        self.prefetch_params = prefetch_params
        kinds = available_memory_kinds(list(plan.mesh.devices.flat))
        self.host_kind = PINNED_HOST if PINNED_HOST in kinds else None
        self.params_on_disk = param_store is not None
        self.version: int | None = None  # the version on disk; None before the first write
        self.mixed = plan.options.precision.mixed
        self.owner = subgroups.param_leaf_owner(
            optimizer, plan.abstract_params, plan.abstract_opt_state
        )
        sizes = [math.prod(leaf.shape) for leaf in plan.leaves]
        self.groups = subgroups.merge_single_leaf_groups(
            subgroups.leaf_groups(sizes, sub_group_size)
        )
        if len(self.groups) > 1:
            subgroups.check_leafwise(optimizer, plan.abstract_params, max_elements=0)
        self.shared = subgroups.shared_state(self.owner)
        self._abstract_state = jax.tree.leaves(plan.abstract_opt_state)
        self._abstract_params = jax.tree.leaves(plan.abstract_params)
        self._param_def = jax.tree.structure(plan.abstract_params)
        self.use_plan(plan)

    def use_plan(self, plan: Plan) -> None:
        """Reads and writes with ``plan``'s shardings from now on (same leaves and groups)."""
        self.plan = plan
        self.state_shardings = jax.tree.leaves(on_device(plan.opt_state))
        self.master_shardings = jax.tree.leaves(
            on_device(plan.master if self.mixed else plan.update_layout)
        )
        self.param_shardings = jax.tree.leaves(on_device(plan.params))
        self._param_like = params_at_rest_like(plan)

    # -- what lives where ---------------------------------------------------------------------
    def disk_leaves(self, group: Sequence[int]) -> list[tuple[Kind, int]]:
        """The leaves of ``group`` in its optimizer file: ("master", param index) under mixed
        precision, then ("state", state index) for the state the group owns."""
        out = [("master", i) for i in group] if self.mixed else []
        return out + [("state", k) for k in subgroups.owned_state(self.owner, group)]

    def like_of(self, kind: Kind, i: int) -> tuple[Any, Any]:
        """Leaf ``i`` of ``kind`` as it is read back: its shape and dtype, and its sharding."""
        if kind == "master":
            return self._abstract_params[i], self.master_shardings[i]
        if kind == "param":
            return self._param_like[i], self.param_shardings[i]
        return self._abstract_state[i], self.state_shardings[i]

    def _key(self, version: int, g: int, params: bool = False) -> tuple:
        return ("p", version, g) if params else (version, g)

    def is_spilled(self, state: TrainState) -> bool:
        """Whether ``state`` holds placeholders where the disk has the values."""
        if self.version is None:
            return False
        pairs = [
            (x, self._abstract_state[k])
            for k, x in enumerate(jax.tree.leaves(state.opt_state))
            if self.owner[k] is not None
        ]
        if self.mixed:
            pairs += zip(jax.tree.leaves(state.master), self._abstract_params, strict=True)
        if self.params_on_disk:
            pairs += zip(jax.tree.leaves(state.params), self._abstract_params, strict=True)
        return any(math.prod(a.shape) > 0 and 0 in x.shape for x, a in pairs)

    def light(self, state: TrainState, shared: Sequence[Any] | None = None) -> TrainState:
        """``state`` with placeholders where the disk has the values (and ``shared`` as its
        shared optimizer state, when given)."""
        s_leaves, s_def = jax.tree.flatten(state.opt_state)
        out = [
            subgroups.placeholder(x) if self.owner[k] is not None else x
            for k, x in enumerate(s_leaves)
        ]
        for k, v in zip(self.shared, shared or (), strict=False):
            out[k] = v
        master = state.master
        if self.mixed:
            master = jax.tree.map(subgroups.placeholder, state.master)
        params = state.params
        if self.params_on_disk:
            params = jax.tree.map(subgroups.placeholder, state.params)
        return state._replace(opt_state=s_def.unflatten(out), master=master, params=params)

    def restore_shardings(self, shardings: TrainState) -> TrainState:
        """``state_shardings(plan)`` with the optimizer state and masters in host memory (where
        the devices address it): a restore reads them there, and :meth:`spill` writes them to
        the files, so the device never holds all of them."""
        if not self.host_kind:
            return shardings
        host = lambda s: s.with_memory_kind(self.host_kind)  # noqa: E731
        s_leaves, s_def = jax.tree.flatten(shardings.opt_state)
        s_leaves = [host(s) if self.owner[k] is not None else s for k, s in enumerate(s_leaves)]
        master = jax.tree.map(host, shardings.master) if self.mixed else shardings.master
        return shardings._replace(opt_state=s_def.unflatten(s_leaves), master=master)

    def abstract_full(self, state: TrainState) -> TrainState:
        """``state`` with ``jax.ShapeDtypeStruct`` where it holds placeholders: the full
        state's shapes, read from nothing (a restore target)."""
        if not self.is_spilled(state):
            return state
        s_leaves, s_def = jax.tree.flatten(state.opt_state)
        full = [
            self._abstract_state[k] if self.owner[k] is not None else x
            for k, x in enumerate(s_leaves)
        ]
        master = self.plan.abstract_params if self.mixed else state.master
        params = (
            self._param_def.unflatten(self._param_like) if self.params_on_disk else state.params
        )
        return state._replace(opt_state=s_def.unflatten(full), master=master, params=params)

    # -- reading -------------------------------------------------------------------------------
    def _arrays(
        self, names: Sequence[tuple[Kind, int]], shards: Sequence[np.ndarray], host: bool = False
    ) -> dict:
        out, at = {}, 0
        for kind, i in names:
            like, sharding = self.like_of(kind, i)
            if host and self.host_kind:
                sharding = sharding.with_memory_kind(self.host_kind)
            n = shard_count(like, sharding)
            out[(kind, i)] = from_host(shards[at : at + n], like, sharding)
            at += n
        return out

    def read(
        self, g: int, version: int | None = None, host: bool = False
    ) -> dict[tuple[Kind, int], jax.Array]:
        """Group ``g``'s masters and owned state from ``version`` (default: the current one),
        in device memory (``host``: in host memory where the devices address it), keyed
        ``(kind, index)``."""
        version = self.version if version is None else version
        names = self.disk_leaves(self.groups[g])
        return self._arrays(names, self.store.read(self._key(version, g)), host)

    def read_param_group(self, g: int, version: int | None = None) -> dict[tuple[Kind, int], Any]:
        """Group ``g``'s parameter leaves from ``version`` (default: the current one), in device
        memory in the plan's at-rest layout, keyed ``("param", index)``."""
        version = self.version if version is None else version
        shards = self.param_store.read(self._key(version, g, True))
        return self._arrays([("param", i) for i in self.groups[g]], shards)

    def read_params(self, version: int | None = None, prefetch: bool = False) -> list[jax.Array]:
        """Every parameter leaf from the parameters' files of ``version`` (default: current),
        in device memory in the plan's at-rest layout; ``prefetch`` reads the next groups'
        files while one is being placed."""
        version = self.version if version is None else version
        leaves: list[Any] = [None] * len(self._abstract_params)
        keys = [self._key(version, g, True) for g in range(len(self.groups))]
        for g, _ in enumerate(read_ahead(self.param_store, keys, prefetch)):
            for (_, i), x in self.read_param_group(g, version).items():
                leaves[i] = x
        return leaves

    def params(self, state: TrainState) -> PyTree:
        """``state``'s parameters, read from their files when they are on NVMe."""
        if self.params_on_disk and self.is_spilled(state):
            return self._param_def.unflatten(self.read_params(prefetch=self.prefetch_params))
        return state.params

    def materialize(self, state: TrainState) -> TrainState:
        """The full state: ``state`` with everything on disk read back (for checkpoints and
        ``engine.opt_state``): the optimizer state and masters into host memory
        (``pinned_host`` where the devices address it, so that a state the device cannot hold
        can still be saved), the parameters into device memory."""
        if not self.is_spilled(state):
            return state
        s_leaves, s_def = jax.tree.flatten(state.opt_state)
        s_leaves = list(s_leaves)
        m_leaves = list(jax.tree.leaves(state.master)) if self.mixed else []
        for g in range(len(self.groups)):
            for (kind, i), x in self.read(g, host=True).items():
                (m_leaves if kind == "master" else s_leaves)[i] = x
        master = state.master
        if self.mixed:
            master = jax.tree.structure(state.master).unflatten(m_leaves)
        return state._replace(
            opt_state=s_def.unflatten(s_leaves), master=master, params=self.params(state)
        )

    # -- writing -------------------------------------------------------------------------------
    def write(
        self, version: int, g: int, values: dict[tuple[Kind, int], Any], pipelined: bool = False
    ) -> None:
        """Writes group ``g``'s values (``(kind, index) -> array``, as :meth:`read` returns
        them, plus ``("param", i)`` entries with the parameters on NVMe) as ``version``."""
        group = self.groups[g]
        shards: list[np.ndarray] = []
        for name in self.disk_leaves(group):
            shards += host_shards(values[name])
        write = self.store.write_async if pipelined else self.store.write
        write(self._key(version, g), shards)
        if self.params_on_disk:
            shards = []
            for i in group:
                shards += host_shards(values[("param", i)])
            write = self.param_store.write_async if pipelined else self.param_store.write
            write(self._key(version, g, True), shards)

    def flush(self) -> None:
        """Waits for the pipelined writes (the first error raises)."""
        self.store.flush()
        if self.param_store is not None and self.param_store is not self.store:
            self.param_store.flush()

    def remove(self, version: int) -> None:
        """Deletes ``version``'s files (missing ones are fine)."""
        for g in range(len(self.groups)):
            self.store.remove(self._key(version, g))
            if self.params_on_disk:
                self.param_store.remove(self._key(version, g, True))

    def switch(self, version: int) -> None:
        """Makes ``version`` the state on disk and deletes the files of the one before."""
        old, self.version = self.version, version
        if old is not None and old != version:
            self.remove(old)

    def close(self) -> None:
        """Closes the stores, which removes their files and directories."""
        self.store.close()
        if self.param_store is not None and self.param_store is not self.store:
            self.param_store.close()

    def next_version(self) -> int:
        return 0 if self.version is None else self.version + 1

    def _values(self, state: TrainState, group: Sequence[int]) -> dict[tuple[Kind, int], Any]:
        s_leaves = jax.tree.leaves(state.opt_state)
        m_leaves = jax.tree.leaves(state.master) if self.mixed else []
        p_leaves = jax.tree.leaves(state.params)
        values = {
            (kind, i): m_leaves[i] if kind == "master" else s_leaves[i]
            for kind, i in self.disk_leaves(group)
        }
        if self.params_on_disk:
            values.update({("param", i): p_leaves[i] for i in group})
        return values

    def spill(self, state: TrainState) -> TrainState:
        """Writes a full ``state``'s disk leaves as a new version and returns the state with
        placeholders in their place."""
        version = self.next_version()

        def write_all() -> None:
            for g, group in enumerate(self.groups):
                self.write(version, g, self._values(state, group))

        self.write_version(version, write_all)
        self.switch(version)
        return self.light(state)

    def write_version(self, version: int, run: Callable[[], Any]) -> None:
        """Runs ``run`` (writes of ``version``); on any failure removes ``version``'s files
        (the current version stays whole) and re-raises."""
        try:
            run()
            self.flush()
        except BaseException:
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the first error is already being raised
                pass
            try:
                self.remove(version)
            except OSError:
                pass
            raise

    def relayout(self, state: TrainState, plan: Plan) -> TrainState:
        """``state`` (placeholders and all) moved to ``plan``'s layout, the files re-laid group
        by group as a new version."""
        from jzero.step import state_shardings

        if not self.is_spilled(state):
            self.use_plan(plan)
            return jax.device_put(state, state_shardings(plan))
        old_plan, version = self.plan, self.next_version()
        new_sh = state_shardings(plan)
        light = jax.tree.map(  # the shardings are a prefix of the state (extra: one for all)
            lambda s, x: x if 0 in getattr(x, "shape", (1,)) else jax.device_put(x, s),
            new_sh,
            state,
        )

        def move() -> None:
            for g in range(len(self.groups)):
                self.use_plan(old_plan)
                values = self.read(g)
                if self.params_on_disk:
                    values.update(self.read_param_group(g))
                self.use_plan(plan)
                self.write(
                    version,
                    g,
                    {n: jax.device_put(x, self.like_of(*n)[1]) for n, x in values.items()},
                )

        try:
            self.write_version(version, move)
        except BaseException:
            self.use_plan(old_plan)
            raise
        self.switch(version)
        return light
