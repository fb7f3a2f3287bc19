"""Child of tests/test_distributed.py: one process of a ``jzero launch`` run (or the 1-process
reference when started alone).

Trains the toy model 10 steps at each stage 1, 2, 3, passing only this process's rows of every
global batch, and prints one JSON line per stage from process 0: the losses, the process and
device counts, the rows each process passes, and the error a whole global batch gives.
"""

import json
import os
import sys

import jax
import optax

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

import jzero  # noqa: E402
from jzero import distributed  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 10
STAGES = (1, 2, 3)


def config(stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def train_local(engine, steps: int, global_batch: int) -> list[float]:
    """``steps`` steps of the toy batches, each process passing only its rows; the losses."""
    rows = distributed.local_batch_size(global_batch)
    lo = jax.process_index() * rows
    losses = []
    for batch in toy.make_batches(steps, global_batch):
        local = {k: v[lo : lo + rows] for k, v in batch.items()}
        losses.append(float(engine.train_step(local)["loss"]))
    return losses


def train(stage: int) -> dict:
    """Trains one stage on this process's rows; returns the record process 0 prints."""
    engine = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2), config(stage))
    losses = train_local(engine, STEPS, GLOBAL_BATCH)
    rows = distributed.local_batch_size(GLOBAL_BATCH)
    batch = toy.make_batches(STEPS, GLOBAL_BATCH)[-1]  # a whole global batch
    try:  # every process checks its batch before any collective, so all raise together
        engine.train_step(batch if rows != GLOBAL_BATCH else {k: v[:1] for k, v in batch.items()})
        error = None
    except ValueError as e:
        error = str(e)
    return {
        "stage": stage,
        "losses": losses,
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_rows": rows,
        "error": error,
    }


def main() -> None:
    distributed.init_distributed()  # the runtime first, as a user script does
    for stage in STAGES:
        record = train(stage)
        if distributed.is_main_process():
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
