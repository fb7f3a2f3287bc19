"""Child process of tests/weights/test_weights_io.py: loads a sharded export at ZeRO stage 1 on the
device count XLA_FLAGS gives, and reports whether every leaf is bit-identical to the file and
sits in the plan's sharding, as JSON.

Usage: weights_load_child.py EXPORT_DIR
"""

import json
import sys

import jax
import numpy as np
import optax
import toy

import jzero
from jzero.weights import load_exported


def main(directory: str) -> None:
    cfg = {"train_batch_size": 32, "zero_optimization": {"stage": 1}}
    engine = jzero.initialize(
        toy.make_params(seed=7),
        toy.loss_fn,
        optax.sgd(0.1),
        cfg,
        options=jzero.InitOptions(init_from=directory),
    )
    want = load_exported(directory)
    same = all(
        np.array_equal(np.asarray(a), b)
        for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(want), strict=True)
    )
    placed = all(
        x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(
            jax.tree.leaves(engine.params), jax.tree.leaves(engine.plan.params), strict=True
        )
    )
    print(
        json.dumps(
            {
                "devices": jax.device_count(),
                "stage": engine.plan.stage.stage,
                "identical": same,
                "placed": placed,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
