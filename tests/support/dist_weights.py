"""The weights tasks of tests/support/dist_session.py: one process of a two-process ``jzero
launch`` run that writes the toy model's parameters as sharded safetensors (``export DIR``) or
starts from such an export (``import DIR``), at stage 3 (parameters sharded at rest, spread over
both processes), in float32 (x64 off).

The record: the process count, and for ``import`` whether every parameter equals the toy
model's (gathered across the processes) and is laid out in the plan's shardings.
"""

import os
import sys

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

import jzero  # noqa: E402

CONFIG = {
    "train_batch_size": 16,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
SHARD_SIZE = 40_000  # bytes: the toy model's ~70k float32 parameters span several files


def export_here(directory) -> None:
    """The export one process writes (the ``import`` task reads it)."""
    engine = jzero.initialize(toy.make_params(seed=7), toy.loss_fn, optax.sgd(0.1), CONFIG)
    engine.save_16bit_model(directory, max_shard_size=SHARD_SIZE)


def run(mode: str, directory: str) -> dict:
    with jax.enable_x64(False):
        return _run(mode, directory)


def _run(mode: str, directory: str) -> dict:
    params = toy.make_params(seed=7)
    if mode == "export":
        engine = jzero.initialize(params, toy.loss_fn, optax.sgd(0.1), CONFIG)
        engine.save_16bit_model(directory, max_shard_size=SHARD_SIZE)
        return {"processes": jax.process_count()}
    engine = jzero.initialize(
        toy.make_params(seed=0),
        toy.loss_fn,
        optax.sgd(0.1),
        CONFIG,
        options=jzero.InitOptions(init_from=directory),
    )
    got = multihost_utils.process_allgather(engine.params, tiled=True)
    want = jax.tree.map(np.asarray, params)
    equal = all(
        np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    laid_out = all(
        x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(
            jax.tree.leaves(engine.state.params),  # as they rest, padded where needed
            jax.tree.leaves(engine.plan.params),
            strict=True,
        )
    )
    return {"processes": jax.process_count(), "equal": equal, "laid_out": laid_out}
