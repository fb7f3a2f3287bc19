"""The NVMe tier (ZeRO-Infinity): optimizer state and fp32 masters in files, updated group by group.

With ``offload_optimizer: {device: nvme, nvme_path: DIR}`` the optimizer state (and, under mixed
precision, the float32 master weights) rest in files under ``DIR`` between steps, and host memory
holds only the groups in flight.

Decisions:

* A step is two compiled programs and a loop between them. The gradient program is the train
  step without its update (:func:`jzero.step.make_gradient_step`: gradients reduced, unscaled and
  clipped, the finiteness flag, the metrics, the next loss scale). Then, for each group of
  parameter leaves (:func:`jzero.groups.leaf_groups` of ``sub_group_size`` elements, every group
  two leaves or more), the group's shards are read from the store, one compiled update program
  per group runs :func:`jzero.groups.update_group` on them, and the results go back to the
  store. A last program gathers the parameters at rest from the groups' 16-bit copies;
  ``engine.train_step`` hides all of it.
* Files: each process writes the shards its devices hold (each distinct index once) of each
  group's leaves into one file per group (:class:`jzero.nvme.NvmeStore`: CRC-checked, written to
  a temporary name and renamed). ``buffer_count`` groups are in host memory at once;
  ``pipeline_read`` reads the next groups while one updates, ``pipeline_write`` writes a group's
  results while the next updates (both false, DeepSpeed's defaults: one group at a time).
* Versions: a step writes its results under the next version's keys and switches to them only
  after every write is flushed, so a failed read or write stops the step with the file named and
  leaves the previous state whole, in the files and in the engine (the disk holds two versions).
* The engine's :class:`~jzero.step.TrainState` keeps zero-size placeholders where the state lives
  on disk (:meth:`NvmeStep.spill` writes a full state out, at the first step and after a
  restore); :meth:`NvmeStep.materialize` reads it back into a full state, so checkpoints are
  ordinary jzero checkpoints (restored with or without NVMe, on any device count).
* A skipped step (non-finite gradients under :attr:`jzero.precision.Precision.skips`) reads and
  writes nothing.
* Initialisation creates the state in device memory once and writes it out at the first step:
  the tier bounds memory during training, not while the state is first made.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero import groups as groups_lib
from jzero.nvme import NvmeStore
from jzero.plan import Plan, on_device
from jzero.step import TrainState, make_gradient_step, params_at_rest

__all__ = ["NvmeStep", "state_bytes"]

logger = logging.getLogger("jzero")
PyTree = Any


def _index_key(index: tuple, shape: Sequence[int]) -> tuple:
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop)
        for s, dim in zip(index, shape, strict=False)
    )


def _host_shards(x: jax.Array) -> list[np.ndarray]:
    """This process's distinct shards of ``x``, in the order of their index."""
    seen: dict[tuple, np.ndarray] = {}
    for shard in x.addressable_shards:
        key = _index_key(shard.index, x.shape)
        if key not in seen:
            seen[key] = np.asarray(shard.data)
    return [seen[k] for k in sorted(seen)]


def _from_host(shards: list[np.ndarray], like: Any, sharding: Any) -> jax.Array:
    """The array ``like`` (shape, dtype) laid out by ``sharding`` from this process's distinct
    shards (as :func:`_host_shards` lists them)."""
    shape = tuple(like.shape)
    where = sharding.addressable_devices_indices_map(shape)
    keys = sorted({_index_key(index, shape) for index in where.values()})
    by_key = dict(zip(keys, shards, strict=True))
    arrays = [jax.device_put(by_key[_index_key(index, shape)], d) for d, index in where.items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def state_bytes(plan: Plan) -> int:
    """Bytes the tier keeps on disk for one version: the optimizer state and, under mixed
    precision, the float32 masters (whole arrays, every process's shards together)."""
    trees = [plan.abstract_opt_state] + ([plan.abstract_params] if plan.precision.mixed else [])
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for t in trees
        for x in jax.tree.leaves(t)
        if hasattr(x, "shape")
    )


class NvmeStep:
    """``(state, batch) -> (state, metrics)`` with the optimizer state in files.

    Args:
      plan: the sharding plan (its optimizer-state shardings in device memory).
      loss_fn, optimizer, step_kwargs: as for :func:`jzero.step.make_train_step`.
      store: where the groups' files live.
      sub_group_size: elements per group of parameter leaves.
      pipeline_read / pipeline_write: read ahead, write behind (see the module docstring).
    """

    def __init__(
        self,
        plan: Plan,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        store: NvmeStore,
        *,
        sub_group_size: int,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
        **step_kwargs: Any,
    ) -> None:
        self.plan, self.optimizer, self.store = plan, optimizer, store
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self.version: int | None = None  # the version on disk; None before the first spill
        self._gradients = make_gradient_step(plan, loss_fn, **step_kwargs)
        self.mixed = plan.precision.mixed
        self.owner = groups_lib.param_leaf_owner(
            optimizer, plan.abstract_params, plan.abstract_opt_state
        )
        sizes = [math.prod(leaf.shape) for leaf in plan.leaves]
        self.groups = groups_lib.merge_single_leaf_groups(
            groups_lib.leaf_groups(sizes, sub_group_size)
        )
        self.shared = groups_lib.shared_state(self.owner)
        self._abstract_state = jax.tree.leaves(plan.abstract_opt_state)
        self._state_sh = jax.tree.leaves(on_device(plan.opt_state))
        self._master_sh = jax.tree.leaves(
            on_device(plan.master if self.mixed else plan.update_layout)
        )
        self._abstract_params = jax.tree.leaves(plan.abstract_params)
        self._updates = [self._compile_group(g) for g in self.groups]
        self._at_rest = jax.jit(
            lambda tree: params_at_rest(plan, tree),
            out_shardings=on_device(plan.params),
        )

    # -- what lives where ---------------------------------------------------------------------
    def _disk_leaves(self, group: Sequence[int]) -> list[tuple[str, int]]:
        """The leaves of ``group`` kept on disk: ("master", param index) under mixed precision,
        then ("state", state index) for the state the group owns."""
        out = [("master", i) for i in group] if self.mixed else []
        return out + [("state", k) for k in groups_lib.owned_state(self.owner, group)]

    def is_spilled(self, state: TrainState) -> bool:
        """Whether ``state`` holds placeholders where the disk has the values."""
        return self.version is not None and any(
            0 in x.shape
            for k, x in enumerate(jax.tree.leaves(state.opt_state))
            if self.owner[k] is not None and math.prod(self._abstract_state[k].shape) > 0
        )

    def _light(self, state: TrainState, shared: Sequence[Any] | None = None) -> TrainState:
        s_leaves, s_def = jax.tree.flatten(state.opt_state)
        out = [
            groups_lib.placeholder(x) if self.owner[k] is not None else x
            for k, x in enumerate(s_leaves)
        ]
        for k, v in zip(self.shared, shared or (), strict=False):
            out[k] = v
        master = state.master
        if self.mixed:
            master = jax.tree.map(groups_lib.placeholder, state.master)
        return state._replace(opt_state=s_def.unflatten(out), master=master)

    def spill(self, state: TrainState) -> TrainState:
        """Writes a full ``state``'s optimizer state (and masters) to the store as a new version
        and returns the state with placeholders in their place."""
        version = 0 if self.version is None else self.version + 1
        s_leaves = jax.tree.leaves(state.opt_state)
        m_leaves = jax.tree.leaves(state.master) if self.mixed else []
        for g, group in enumerate(self.groups):
            arrays = []
            for kind, i in self._disk_leaves(group):
                arrays += _host_shards(m_leaves[i] if kind == "master" else s_leaves[i])
            self.store.write((version, g), arrays)
        self._switch(version)
        return self._light(state)

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
        master = state.master
        if self.mixed:
            master = self.plan.abstract_params
        return state._replace(opt_state=s_def.unflatten(full), master=master)

    def materialize(self, state: TrainState) -> TrainState:
        """The full state: ``state`` with the optimizer state (and masters) read back from the
        store, in device memory (for checkpoints and ``engine.opt_state``)."""
        if not self.is_spilled(state):
            return state
        s_leaves, s_def = jax.tree.flatten(state.opt_state)
        s_leaves = list(s_leaves)
        m_leaves = list(jax.tree.leaves(state.master)) if self.mixed else []
        for g, group in enumerate(self.groups):
            values = self._read(g, group)
            for (kind, i), x in values.items():
                (m_leaves if kind == "master" else s_leaves)[i] = x
        master = state.master
        if self.mixed:
            master = jax.tree.structure(state.master).unflatten(m_leaves)
        return state._replace(opt_state=s_def.unflatten(s_leaves), master=master)

    def _read(self, g: int, group: Sequence[int]) -> dict[tuple[str, int], jax.Array]:
        """Group ``g``'s leaves from the current version, in device memory."""
        arrays = self.store.read((self.version, g))
        out, at = {}, 0
        for kind, i in self._disk_leaves(group):
            like = self._abstract_params[i] if kind == "master" else self._abstract_state[i]
            sharding = self._master_sh[i] if kind == "master" else self._state_sh[i]
            where = sharding.addressable_devices_indices_map(tuple(like.shape))
            n = len({_index_key(index, like.shape) for index in where.values()})
            out[(kind, i)] = _from_host(arrays[at : at + n], like, sharding)
            at += n
        return out

    def _switch(self, version: int) -> None:
        """Makes ``version`` the state on disk and deletes the files of the one before."""
        old, self.version = self.version, version
        if old is not None and old != version:
            for g in range(len(self.groups)):
                self.store.remove((old, g))

    # -- the step ----------------------------------------------------------------------------
    def _compile_group(self, group: list[int]) -> Callable[..., Any]:
        """The jitted update of one group: (grads, masters or params, owned state, shared
        state) of the group -> (new masters, new owned state, new shared, 16-bit copies)."""
        plan, optimizer, owner = self.plan, self.optimizer, self.owner
        owned = groups_lib.owned_state(owner, group)
        abstract_p = plan.abstract_params
        abstract_s = plan.abstract_opt_state
        compute = plan.precision.compute_dtype
        mixed = self.mixed
        update_sh = jax.tree.leaves(on_device(plan.update_layout))

        def update(grads_g, master_g, state_g, shared_old):
            if not mixed:  # the params themselves, cut to the update layout
                master_g = [
                    jax.lax.with_sharding_constraint(m, update_sh[i])
                    for m, i in zip(master_g, group, strict=True)
                ]
            result = groups_lib.update_group_leaves(
                optimizer,
                abstract_p,
                abstract_s,
                group,
                owner,
                grads_g,
                master_g,
                state_g,
                shared_old,
            )
            copies = [
                x.astype(compute) if mixed and jnp.issubdtype(x.dtype, jnp.floating) else x
                for x in result.params
            ]
            return result.params, result.opt_state, result.shared, copies

        out_sh = (
            [self._master_sh[i] for i in group],
            [self._state_sh[k] for k in owned],
            [self._state_sh[k] for k in self.shared],
            [update_sh[i] for i in group],
        )
        return jax.jit(update, out_shardings=out_sh)

    def lower(self, state: TrainState, batch: PyTree) -> Any:
        """The gradient program lowered (what ``engine.lower`` reports under the NVMe tier:
        the update programs hold one group each)."""
        if self.is_spilled(state) or self.version is None:
            state = self._light(state)
        return self._gradients.lower(state, batch)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        if not self.is_spilled(state):
            state = self.spill(state)
        grads, applied, new_extra, new_loss_scale, metrics = self._gradients(state, batch)
        if not int(applied):  # a skipped step: nothing is read or written
            return state._replace(extra=new_extra, loss_scale=new_loss_scale), metrics
        g_leaves = jax.tree.leaves(grads)
        p_leaves = jax.tree.leaves(state.params)
        s_leaves = jax.tree.leaves(state.opt_state)
        shared_old = [s_leaves[k] for k in self.shared]
        new_version = self.version + 1
        copies: list[Any] = [None] * len(p_leaves)
        new_shared = None
        ahead = max(1, self.store.buffer_count - 1) if self.pipeline_read else 0
        try:
            for g in range(min(ahead, len(self.groups))):
                self.store.prefetch((self.version, g))
            for g, group in enumerate(self.groups):
                if ahead and g + ahead < len(self.groups):
                    self.store.prefetch((self.version, g + ahead))
                values = self._read(g, group)
                owned = groups_lib.owned_state(self.owner, group)
                masters = (
                    [values[("master", i)] for i in group]
                    if self.mixed
                    else [p_leaves[i] for i in group]
                )
                new_m, new_s, shared, group_copies = self._updates[g](
                    [g_leaves[i] for i in group],
                    masters,
                    [values[("state", k)] for k in owned],
                    shared_old,
                )
                if new_shared is None:
                    new_shared = shared
                for i, c in zip(group, group_copies, strict=True):
                    copies[i] = c
                arrays = []
                for kind, i in self._disk_leaves(group):
                    x = new_m[group.index(i)] if kind == "master" else new_s[owned.index(i)]
                    arrays += _host_shards(x)
                if self.pipeline_write:
                    self.store.write_async((new_version, g), arrays)
                else:
                    self.store.write((new_version, g), arrays)
            self.store.flush()
        except BaseException:
            _drain(self.store)
            for g in range(len(self.groups)):  # the unfinished version's files; the old stay
                with contextlib.suppress(OSError):
                    self.store.remove((new_version, g))
            raise
        params = self._at_rest(jax.tree.structure(state.params).unflatten(copies))
        self._switch(new_version)
        new_state = self._light(
            state._replace(
                step=state.step + 1,
                params=params,
                extra=new_extra,
                loss_scale=new_loss_scale,
            ),
            new_shared,
        )
        return new_state, metrics


def _drain(store: NvmeStore) -> None:
    """Waits for the store's pending writes after a failure (their errors are the failure's
    consequence, not news)."""
    try:
        store.flush()
    except Exception:  # noqa: BLE001 - the first error is already being raised
        pass
