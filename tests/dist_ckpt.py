"""Child of tests/test_distributed_checkpoint.py: one process of a ``jzero launch`` run that
either trains steps 1-5 and saves a checkpoint, or restores one and trains steps 6-10.

Usage: ``dist_ckpt.py save|resume DIRECTORY``; process 0 prints the losses as one JSON line.
"""

import json
import os
import sys

import jax
import optax

sys.path.insert(0, os.path.dirname(__file__))
import dist_train  # noqa: E402
import toy  # noqa: E402

import jzero  # noqa: E402
from jzero import distributed  # noqa: E402

STAGE = 2
SAVED_AT = 5


def make_engine(directory: str) -> jzero.Engine:
    cfg = dict(dist_train.config(STAGE), checkpoint={"directory": directory, "async": True})
    return jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2), cfg)


def train(engine: jzero.Engine, batches: list) -> list[float]:
    rows = distributed.local_batch_size(dist_train.GLOBAL_BATCH)
    lo = jax.process_index() * rows
    return [
        float(engine.train_step({k: v[lo : lo + rows] for k, v in b.items()})["loss"])
        for b in batches
    ]


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    distributed.init_distributed()
    batches = toy.make_batches(dist_train.STEPS, dist_train.GLOBAL_BATCH)
    with make_engine(directory) as engine:
        if mode == "save":
            losses = train(engine, batches[:SAVED_AT])
            engine.save()
        else:
            engine.restore()
            losses = train(engine, batches[SAVED_AT:])
    if distributed.is_main_process():
        print(json.dumps({"losses": losses, "processes": jax.process_count()}), flush=True)


if __name__ == "__main__":
    main()
