"""The checkpoint tasks of tests/support/dist_session.py: one process of a two-process ``jzero
launch`` run that either trains steps 1-2 and saves a checkpoint (``save``), or restores one and
trains steps 3-4 (``resume``); the record: the losses and grad norms. In float64 (see
dist_train.py): the resumed run must compute what one process computes.
"""

import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import dist_train  # noqa: E402
import toy  # noqa: E402

import jzero  # noqa: E402
from jzero import distributed  # noqa: E402

STAGE = 2
SAVED_AT = 2


def make_engine(directory: str) -> jzero.Engine:
    """The float64 engine (call it with x64 enabled)."""
    cfg = dict(dist_train.config(STAGE), checkpoint={"directory": directory, "async": True})
    params = toy.make_params(dtype=np.float64)
    return jzero.initialize(params, toy.loss_fn, optax.adamw(1e-2), cfg)


def batches() -> list:
    return toy.make_batches(dist_train.STEPS, dist_train.GLOBAL_BATCH, dtype=np.float64)


def train(engine: jzero.Engine, batches: list) -> tuple[list[float], list[float]]:
    """The steps on this process's rows of ``batches``: (losses, grad norms)."""
    rows = distributed.local_batch_size(dist_train.GLOBAL_BATCH)
    lo = jax.process_index() * rows
    metrics = [engine.train_step({k: v[lo : lo + rows] for k, v in b.items()}) for b in batches]
    return [float(m["loss"]) for m in metrics], [float(m["grad_norm"]) for m in metrics]


def run(mode: str, directory: str) -> dict:
    with make_engine(directory) as engine:
        if mode == "save":
            losses, norms = train(engine, batches()[:SAVED_AT])
            engine.save()
        else:
            engine.restore()
            losses, norms = train(engine, batches()[SAVED_AT:])
    return {"losses": losses, "norms": norms, "processes": jax.process_count()}
