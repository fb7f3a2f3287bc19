"""The flat-mesh task of tests/support/dist_session.py (one process of a two-process ``jzero
launch`` run) and its one-process reference in tests/distributed/test_distributed.py.

Trains the toy model 4 steps (2 micro-batches each) at stages 2 and 3 in float64, passing only
this process's rows of every global batch: the losses and grad norms, the process and device
counts, the rows each process passes, and the error a whole global batch gives. Stage 2
reduce-scatters every micro-batch across the processes, stage 3 gathers the parameters across
them too (stage 1's reduction is stage 2's collective once per step). In float64 because the
point is that the processes compute what one process computes: float32 would differ by the
reduction order of gloo against one all-reduce.
"""

import functools
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
STEPS = 4
STAGES = (2, 3)


def config(stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def train_local_metrics(
    engine, steps: int, global_batch: int, dtype=np.float32
) -> tuple[list[float], list[float]]:
    """``steps`` steps of the toy batches, each process passing only its rows: (losses, grad
    norms)."""
    rows = distributed.local_batch_size(global_batch)
    lo = jax.process_index() * rows
    losses, norms = [], []
    for batch in toy.make_batches(steps, global_batch, dtype=dtype):
        local = {k: v[lo : lo + rows] for k, v in batch.items()}
        metrics = engine.train_step(local)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms


def train_local(engine, steps: int, global_batch: int, dtype=np.float32) -> list[float]:
    """``steps`` steps of the toy batches, each process passing only its rows; the losses."""
    return train_local_metrics(engine, steps, global_batch, dtype)[0]


def first_grad_norm() -> float:
    """What every run's first grad_norm must be (:func:`toy.first_grad_norm`)."""
    return toy.first_grad_norm(GLOBAL_BATCH)


def train(stage: int) -> dict:
    """Trains one stage on this process's rows in float64; returns the record process 0
    prints."""
    with jax.enable_x64(True):
        params = toy.make_params(dtype=np.float64)
        engine = jzero.initialize(params, toy.loss_fn, optax.adamw(1e-2), config(stage))
        losses, norms = train_local_metrics(engine, STEPS, GLOBAL_BATCH, np.float64)
        rows = distributed.local_batch_size(GLOBAL_BATCH)
        batch = toy.make_batches(STEPS, GLOBAL_BATCH, dtype=np.float64)[-1]  # a whole batch
        try:  # every process checks its batch before any collective, so all raise together
            whole = {k: v[:1] for k, v in batch.items()}
            engine.train_step(batch if rows != GLOBAL_BATCH else whole)
            error = None
        except ValueError as e:
            error = str(e)
        dtype = str(engine.params["embed"].dtype)
    return {
        "stage": stage,
        "losses": losses,
        "norms": norms,
        "dtype": dtype,
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_rows": rows,
        "error": error,
    }


@functools.cache
def reference(stage: int) -> dict:
    """:func:`train` in this one process (the reference the two processes must equal)."""
    return train(stage)
