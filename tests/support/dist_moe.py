"""The MoE task of tests/support/dist_session.py: one process of a two-process ``jzero launch`` run
of the MoE toy (:mod:`moe_toy`) at ``expert_parallel.autoep_size: 4``, stage 3, with a router
that sends every token to the first device's experts of each expert group (the other devices'
experts get none). Each process passes its own rows; the record: the losses and dropped
fractions of 3 steps, the mesh, and which process holds each device. In float64 (the child
enables it), so that the losses match the one-device reference far below any real error."""

import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import moe_toy  # noqa: E402

import jzero  # noqa: E402
from jzero import distributed  # noqa: E402

STEPS = 3
SEED = 3


def train() -> dict:
    params = moe_toy.make_params(bias=moe_toy.bias_first_device_only())
    loss = moe_toy.make_loss(1.0, 2)
    engine = jzero.initialize(params, loss, optax.sgd(moe_toy.LR), moe_toy.config(3, 4))
    rows = distributed.local_batch_size(moe_toy.ROWS)
    lo = jax.process_index() * rows
    losses, dropped = [], []
    for batch in moe_toy.batches(STEPS, seed=SEED):
        metrics = engine.train_step({k: np.asarray(v[lo : lo + rows]) for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
        dropped.append(float(metrics["moe_dropped_fraction"]))
    return {
        "losses": losses,
        "dropped": dropped,
        "mesh": dict(engine.mesh.shape),
        "processes": [[d.process_index for d in row] for row in engine.mesh.devices.tolist()],
        "process_count": jax.process_count(),
    }
