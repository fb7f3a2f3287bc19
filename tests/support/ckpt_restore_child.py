"""Child process of tests/checkpoint/test_checkpoint.py: restores a checkpoint at other ZeRO
stages on other device counts and trains on.

Usage: ckpt_restore_child.py DIR NUM_STEPS OUT_PREFIX STAGE:DEVICES [STAGE:DEVICES ...], with
XLA_FLAGS giving the process's device count (the largest DEVICES). Per STAGE:DEVICES, restores
the latest step of DIR into the plan of STAGE on the first DEVICES devices, trains up to
NUM_STEPS on the toy batches and writes the losses, the grad norms, the restored step, the meta,
the plan's device count and the final params (gathered) to OUT_PREFIX_stage{STAGE}_{DEVICES}.npz.
In float64, as the checkpoint it restores. One process does every restore: each one starts a
process's worth of JAX and jzero otherwise.
"""

import json
import sys

import jax
import numpy as np
import optax
import toy

import jzero
from jzero.checkpoint import Checkpointer
from jzero.plan import PlanOptions
from jzero.step import StepOptions, from_logical, init_train_state, logical_view, restore_target

GLOBAL_BATCH = 32
CLIP = 0.5


def restore_and_train(directory: str, stage: int, devices: int, num_steps: int, out: str) -> None:
    """One restore at ``stage`` on the first ``devices`` devices, trained up to ``num_steps``."""
    params = toy.make_params(dtype=np.float64)
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    mesh = jzero.make_mesh(devices, devices=jax.devices()[:devices])
    plan = jzero.make_plan(params, tx, mesh, stage, PlanOptions().replace(persistence_threshold=0))
    abstract = jax.eval_shape(lambda: init_train_state(plan, params, tx))
    target = restore_target(plan, abstract)  # logical shapes: checkpoints hold no padding
    with Checkpointer(directory) as ckpt:
        state, meta = ckpt.restore(target)
    state = from_logical(plan, state)  # padded into this plan's resting shapes
    start = int(state.step)
    step_fn = jzero.make_train_step(plan, toy.loss_fn, tx, StepOptions(gradient_clipping=CLIP))
    batches = toy.make_batches(num_steps, GLOBAL_BATCH, dtype=np.float64)
    losses, norms = [], []
    for batch in batches[start:]:
        state, metrics = step_fn(state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    flat = {
        jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(logical_view(plan, state).params)[0]
    }
    np.savez(
        out,
        losses=np.asarray(losses, np.float64),
        norms=np.asarray(norms, np.float64),
        start=start,
        devices=mesh.size,
        process_devices=jax.device_count(),
        meta=json.dumps(meta),
        **{"param:" + k: v for k, v in flat.items()},
    )


def main(directory: str, num_steps: int, prefix: str, runs: list[str]) -> None:
    jax.config.update("jax_enable_x64", True)
    for run in runs:
        stage, devices = map(int, run.split(":"))
        restore_and_train(
            directory, stage, devices, num_steps, f"{prefix}_stage{stage}_{devices}.npz"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
