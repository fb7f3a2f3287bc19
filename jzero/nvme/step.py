"""The NVMe tier's step (ZeRO-Infinity): optimizer state and fp32 masters in files, updated group
by group.

With ``offload_optimizer: {device: nvme, nvme_path: DIR}`` the optimizer state (and, under mixed
precision, the float32 master weights) rest in files under ``DIR`` between steps, and host memory
holds only the groups in flight; with ``offload_param: {device: nvme}`` as well (stage 3), so do
the parameter shards. :mod:`jzero.nvme.state` keeps the layout of the files and moves leaves in
and out; this module runs the step.

Decisions:

* A step is two compiled programs and a loop between them. The gradient program is the train
  step without its update (:func:`jzero.step.make_gradient_step`: gradients reduced, unscaled and
  clipped, the finiteness flag, the metrics, the next loss scale). Then, for each group of
  parameter leaves, the group's shards are read from the store, one compiled update program per
  group runs :func:`jzero.subgroups.update_group_leaves` on them, and the results go back to the
  store. A last program gathers the parameters at rest from the groups' 16-bit copies;
  ``engine.train_step`` hides all of it.
* With the parameters on NVMe, the step first reads them (group by group, reading ahead with
  ``pipeline_read``) into device memory in their at-rest layout, runs the gradient program on
  them, and writes the new ones back with the group's other files. Between steps neither the
  device nor the host holds them; during the step their shards are in device memory, as with
  ``offload_param: {device: cpu}``.
* ``buffer_count`` groups are in host memory at once; ``pipeline_read`` reads the next groups
  while one updates, ``pipeline_write`` writes a group's results while the next updates (both
  false, DeepSpeed's defaults: one group at a time).
* Versions: a step writes its results as the next version and switches to it only after every
  write is flushed, so a failed read or write stops the step with the file named and leaves the
  previous state whole, in the files and in the engine.
* A skipped step (non-finite gradients under :attr:`jzero.plan.precision.Precision.skips`) reads and
  writes nothing (with the parameters on NVMe, it reads them to compute the gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jzero import subgroups
from jzero.nvme.state import NvmeState, read_ahead
from jzero.plan import on_device
from jzero.step import TrainState, make_gradient_step, params_at_rest

__all__ = ["NvmeStep"]

PyTree = Any


class NvmeStep:
    """``(state, batch) -> (state, metrics)`` with the optimizer state (and maybe the
    parameters) in files.

    Args:
      disk: the files' layout and moves (:class:`jzero.nvme.state.NvmeState`); its plan and
        optimizer are the step's.
      loss_fn, step_kwargs: as for :func:`jzero.step.make_train_step`.
      pipeline_read / pipeline_write: read ahead, write behind (see the module docstring).
    """

    def __init__(
        self,
        disk: NvmeState,
        loss_fn: Callable[..., Any],
        *,
        pipeline_read: bool = False,
        pipeline_write: bool = False,
        **step_kwargs: Any,
    ) -> None:
        self.disk, self.plan, self.optimizer = disk, disk.plan, disk.optimizer
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self._gradients = make_gradient_step(self.plan, loss_fn, **step_kwargs)
        self._updates = [self._compile_group(g) for g in disk.groups]
        self._at_rest = jax.jit(
            lambda tree: params_at_rest(self.plan, tree),
            out_shardings=on_device(self.plan.params),
        )

    def _compile_group(self, group: list[int]) -> Callable[..., Any]:
        """The jitted update of one group: (grads, masters or params, owned state, shared
        state) of the group -> (new masters, new owned state, new shared, 16-bit copies)."""
        plan, optimizer, disk = self.plan, self.optimizer, self.disk
        owned = subgroups.owned_state(disk.owner, group)
        compute = plan.options.precision.compute_dtype
        mixed = disk.mixed
        update_sh = jax.tree.leaves(on_device(plan.update_layout))

        def update(grads_g, master_g, state_g, shared_old):
            if not mixed:  # the params themselves, cut to the update layout
                master_g = [
                    jax.lax.with_sharding_constraint(m, update_sh[i])
                    for m, i in zip(master_g, group, strict=True)
                ]
            result = subgroups.update_group_leaves(
                optimizer,
                plan.abstract_params,
                plan.abstract_opt_state,
                group,
                disk.owner,
                subgroups.GroupLeaves(grads_g, master_g, state_g, shared_old),
            )
            copies = [
                x.astype(compute) if mixed and jnp.issubdtype(x.dtype, jnp.floating) else x
                for x in result.params
            ]
            return result.params, result.opt_state, result.shared, copies

        out_sh = (
            [disk.master_shardings[i] for i in group],
            [disk.state_shardings[k] for k in owned],
            [disk.state_shardings[k] for k in disk.shared],
            [update_sh[i] for i in group],
        )
        return jax.jit(update, out_shardings=out_sh)

    def lower(self, state: TrainState, batch: PyTree) -> Any:
        """The gradient program lowered (what ``engine.lower`` reports under the NVMe tier:
        the update programs hold one group each)."""
        state = self.disk.light(state)
        if self.disk.params_on_disk:
            params = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                self.disk.abstract_full(state).params,
                on_device(self.plan.params),
            )
            state = state._replace(params=params)
        return self._gradients.lower(state, batch)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        disk = self.disk
        if not disk.is_spilled(state):
            state = disk.spill(state)
        params = disk.params(state)
        grads, applied, new_extra, new_loss_scale, metrics = self._gradients(
            state._replace(params=params), batch
        )
        if not int(applied):  # a skipped step: nothing is written
            return state._replace(extra=new_extra, loss_scale=new_loss_scale), metrics
        g_leaves = jax.tree.leaves(grads)
        p_leaves = jax.tree.leaves(params)
        s_leaves = jax.tree.leaves(state.opt_state)
        shared_old = [s_leaves[k] for k in disk.shared]
        version = disk.next_version()
        copies: list[Any] = [None] * len(p_leaves)
        new_shared = None
        store, groups = disk.store, disk.groups

        def update_all() -> None:
            nonlocal new_shared
            keys = [(disk.version, g) for g in range(len(groups))]
            for g, _ in enumerate(read_ahead(store, keys, self.pipeline_read)):
                group = groups[g]
                values = disk.read(g)
                owned = subgroups.owned_state(disk.owner, group)
                masters = (
                    [values[("master", i)] for i in group]
                    if disk.mixed
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
                out = {("master", i): m for i, m in zip(group, new_m, strict=True)}
                out.update({("state", k): x for k, x in zip(owned, new_s, strict=True)})
                if disk.params_on_disk:  # the at-rest params of this group, straight to disk
                    rest = jax.device_put(group_copies, [disk.param_shardings[i] for i in group])
                    out.update({("param", i): x for i, x in zip(group, rest, strict=True)})
                else:
                    for i, c in zip(group, group_copies, strict=True):
                        copies[i] = c
                disk.write(version, g, out, pipelined=self.pipeline_write)
                del values, masters, new_m, new_s, group_copies, out  # one group at a time

        disk.write_version(version, update_all)
        new_params = state.params
        if not disk.params_on_disk:
            new_params = self._at_rest(jax.tree.structure(state.params).unflatten(copies))
        disk.switch(version)
        new_state = disk.light(
            state._replace(
                step=state.step + 1,
                params=new_params,
                extra=new_extra,
                loss_scale=new_loss_scale,
            ),
            new_shared,
        )
        return new_state, metrics
