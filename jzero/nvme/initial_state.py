"""The NVMe tier's first version: the state made straight into its files, group by group.

Decisions:

* One compiled program per group of :class:`jzero.nvme.state.NvmeState` creates that group's
  masters, optimizer state (and parameters on NVMe) straight into their shards, and the store
  writes them before the next group is made; one more program makes what stays in memory (the
  step, shared optimizer state, extra state, loss scale, and the parameters unless they are on
  NVMe). The full optimizer state never exists in memory.
* The values come from the parameters given (each program receives only its group's leaves,
  each device its own shard; the others are zeros no output reads, which XLA removes) or from
  ``init_fn`` inside each program (only the outputs the group needs survive XLA's dead-code
  elimination, so a group's program computes that group's parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jzero._util import is_creator
from jzero.plan import LossScaleState, cast_floating
from jzero.step import TrainState, state_shardings

__all__ = ["first_version"]

PyTree = Any


def first_version(
    disk: Any,
    values: PyTree | Callable[[], PyTree],
    extra: PyTree = (),
) -> TrainState:
    """The state before the first step, its disk leaves written straight to the files.

    Args:
      disk: the :class:`jzero.nvme.state.NvmeState` whose files to write (version 0).
      values: the initial parameters (full precision, arrays) or a function of no arguments
        that creates them (``init_fn``), as for :func:`jzero.step.init_train_state`.
      extra: non-trainable model state, if any.

    Returns:
      The light state (placeholders where the files hold the values).
    """
    prec, tx = disk.plan.options.precision, disk.optimizer
    make = values if is_creator(values) else None
    given = None if make is not None else jax.tree.leaves(values)
    abstract = disk.plan.abstract_params
    abstract_leaves = jax.tree.leaves(abstract)
    treedef = jax.tree.structure(abstract)

    def full_master(group_values: Sequence[Any], group: Sequence[int]) -> PyTree:
        if make is not None:
            params = make()
        else:  # the group's values; the others are zeros no output reads (removed by XLA)
            leaves = [jnp.zeros(a.shape, a.dtype) for a in abstract_leaves]
            for i, v in zip(group, group_values, strict=True):
                leaves[i] = v
            params = treedef.unflatten(leaves)
        return jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), params, abstract)

    def inputs(group: Sequence[int]) -> tuple[list, list]:
        """The given values of ``group``'s leaves and their shardings (each device
        receives its own shard only)."""
        if given is None:
            return [], []
        return [given[i] for i in group], [disk.master_shardings[i] for i in group]

    # In memory: the step, shared state, extra, loss scale, and the params unless on NVMe.
    in_memory = [] if disk.params_on_disk else list(range(len(abstract_leaves)))

    def rest(group_values: Sequence[Any], extra: PyTree) -> TrainState:
        master = full_master(group_values, in_memory)
        params = cast_floating(master, prec.compute_dtype) if prec.mixed else master
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=jax.tree.map(jnp.copy, params),
            opt_state=tx.init(master),
            extra=jax.tree.map(jnp.copy, extra),
            master=master if prec.mixed else (),
            loss_scale=jax.tree.map(jnp.asarray, LossScaleState.initial(prec)),
        )
        return disk.light(state)

    args, arg_sh = inputs(in_memory)
    state = jax.jit(rest, in_shardings=(arg_sh, None), out_shardings=state_shardings(disk.plan))(
        args, extra
    )

    version = disk.next_version()

    def write_groups() -> None:
        for g, group in enumerate(disk.groups):
            names = disk.disk_leaves(group)
            if disk.params_on_disk:
                names = names + [("param", i) for i in group]

            def make_group(group_values: Sequence[Any], group=group, names=names) -> list:
                master = full_master(group_values, group)
                s_leaves = jax.tree.leaves(tx.init(master))
                m_leaves = jax.tree.leaves(master)
                out = []
                for kind, i in names:
                    if kind == "state":
                        out.append(s_leaves[i])
                    elif kind == "master" or not prec.mixed:
                        out.append(m_leaves[i])
                    else:
                        out.append(cast_floating(m_leaves[i], prec.compute_dtype))
                return out

            out_sh = [disk.like_of(*n)[1] for n in names]
            args, arg_sh = inputs(group)
            made = jax.jit(make_group, in_shardings=(arg_sh,), out_shardings=out_sh)(args)
            disk.write(version, g, dict(zip(names, made, strict=True)))
            del made

    disk.write_version(version, write_groups)
    disk.switch(version)
    return state
