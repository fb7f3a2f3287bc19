"""The NVMe task of tests/support/dist_session.py: one process of a two-process ``jzero launch``
run with the optimizer state and the parameters on NVMe (stage 3, bf16, x64 off), each process
writing its own shards.

Trains the toy model 4 steps on this process's rows. The record: the losses, and how many files
each process's store holds under the shared ``nvme_path`` (after every process finished its
steps).
"""

import os
import sys

import jax
import optax
from jax.experimental import multihost_utils

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402
from dist_train import train_local  # noqa: E402

import jzero  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 4


def config(nvme_dir: str | None) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if nvme_dir:
        zero["sub_group_size"] = 3000
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
        zero["offload_param"] = {"device": "nvme"}
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }


def train(nvme_dir: str) -> tuple[list[float], dict[str, int]]:
    """This process's rows of every batch, 4 steps; the losses."""
    engine = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2), config(nvme_dir))
    losses = train_local(engine, STEPS, GLOBAL_BATCH)
    multihost_utils.sync_global_devices("jzero-test: steps done")
    stores = sorted(d for d in os.listdir(nvme_dir) if d.startswith("jzero-nvme-"))
    files = {d: len(os.listdir(os.path.join(nvme_dir, d))) for d in stores}
    multihost_utils.sync_global_devices("jzero-test: files counted")
    engine.close()
    return losses, files


def run(nvme_dir: str) -> dict:
    os.makedirs(nvme_dir, exist_ok=True)
    with jax.enable_x64(False):
        losses, files = train(nvme_dir)
    return {"losses": losses, "files": files}
