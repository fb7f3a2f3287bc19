"""The hybrid tasks of tests/support/dist_session.py (one process of a two-process ``jzero
launch`` run, a ``replica`` per process) and their one-process reference in
tests/distributed/test_hybrid.py.

Trains the toy model 3 steps at stage 1 on ``mesh: {replica: 2, data: 4}`` and at stage 3 with
ZeRO++ hpZ (``zero_hpz_partition_size: 4``), passing only this process's rows of every global
batch: the losses and grad norms, the final parameters' checksum, and which process holds each
device of the mesh. Across the processes, stage 1 all-reduces the gradient shards (stages 2 and
3 on this mesh cross them with the same all-reduce) and hpZ reduce-scatters and all-gathers. In
float64: the point is that the processes compute what one process computes, which float32
would blur by the reduction order of the cross-process all-reduce.
"""

import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

import jzero  # noqa: E402
from jzero import distributed  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 3
RUNS = {
    "stage1": {"stage": 1},
    "hpz": {"stage": 3, "zero_hpz_partition_size": 4},
}


def config(name: str) -> dict:
    zero = {**RUNS[name], "stage3_param_persistence_threshold": 0}
    mesh = {} if "zero_hpz_partition_size" in zero else {"mesh": {"replica": 2, "data": 4}}
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": zero,
        **mesh,
    }


def first_grad_norm() -> float:
    """What every run's first grad_norm must be (:func:`toy.first_grad_norm`)."""
    return toy.first_grad_norm(GLOBAL_BATCH)


def train(name: str) -> dict:
    """Trains one run on this process's rows in float64; returns the record process 0
    prints."""
    with jax.enable_x64(True):
        params = toy.make_params(dtype=np.float64)
        engine = jzero.initialize(params, toy.loss_fn, optax.adamw(1e-2), config(name))
        rows = distributed.local_batch_size(GLOBAL_BATCH)
        lo = jax.process_index() * rows
        losses, norms = [], []
        for batch in toy.make_batches(STEPS, GLOBAL_BATCH, dtype=np.float64):
            metrics = engine.train_step({k: v[lo : lo + rows] for k, v in batch.items()})
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
        params = jax.tree.map(
            lambda x: np.asarray(jax.jit(lambda a: a, out_shardings=engine.plan.replicated)(x)),
            engine.params,
        )
    return {
        "run": name,
        "losses": losses,
        "norms": norms,
        "dtype": str(params["embed"].dtype),
        "checksum": float(sum(np.abs(x).sum() for x in jax.tree.leaves(params))),
        "mesh": dict(engine.mesh.shape),
        "processes": [[d.process_index for d in row] for row in engine.mesh.devices.tolist()],
        "process_count": jax.process_count(),
    }
