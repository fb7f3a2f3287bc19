"""Child process of tests/checkpoint/test_checkpoint_safety.py: is killed with SIGKILL while
re-saving a step.

Usage: ckpt_resave_child.py DIR. Restores the latest step of DIR (the parent saved steps 1 and 2),
then saves step 2 again with other values (a re-run that saves over its newest step). The hook
that runs just before Orbax's final rename blocks, so the kill always lands after the old copy
was set aside and before the new copy is committed: the moment a re-save is most exposed.
"""

import sys
import time

import jax
import numpy as np

from jzero import checkpoint
from jzero.checkpoint import checkpointer


def main(directory: str) -> None:
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    ckpt = checkpoint.Checkpointer(directory)
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=single)}
    state, meta = ckpt.restore(target)
    assert meta == {"step": 2}, meta

    def blocking_seal(step_dir):
        time.sleep(3600)

    checkpointer.seal = blocking_seal
    ckpt.save(2, {"w": np.full((64, 64), -1.0, np.float32)}, meta={"step": 2}, overwrite=True)
    print("saving", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
