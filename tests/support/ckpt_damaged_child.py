"""Child process of tests/checkpoint/test_checkpoint.py: restores a damaged checkpoint that has no
file
record, so the read itself fails inside Orbax.

Usage: ckpt_damaged_child.py DIR, with XLA_FLAGS giving 8 devices. Prints the
CheckpointError's message as one JSON line.

It runs apart from the test process because when one shard read fails, TensorStore may finish
the restore's other reads in its own threads after Orbax's event loop has closed, and reports
each of those late ("Event loop is closed") whenever it happens; here that lands on this
short-lived process only.
"""

import json
import sys

import jax
import optax
import toy

import jzero
from jzero.checkpoint import Checkpointer, CheckpointError
from jzero.plan import PlanOptions
from jzero.step import init_train_state, restore_target


def main(directory: str) -> None:
    params = toy.make_params()
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    plan = jzero.make_plan(
        params, tx, jzero.make_mesh(-1), 3, PlanOptions().replace(persistence_threshold=0)
    )
    abstract = jax.eval_shape(lambda: init_train_state(plan, params, tx))
    target = restore_target(plan, abstract)  # logical shapes: checkpoints hold no padding
    try:
        Checkpointer(directory).restore(target)
        message = None
    except CheckpointError as e:
        message = str(e)
    print(json.dumps({"error": message}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
