"""Child process of tests/checkpoint/test_checkpoint.py: is killed with SIGKILL in the middle of a
save.

Usage: ckpt_kill_child.py DIR. Saves the toy state as step 1 and waits for it, then starts
the asynchronous save of a large step 2, prints ``saving`` once its unfinished folder exists
(Orbax makes it in the background) and sleeps until it is killed. So
that the kill can never come after step 2 is complete, the hook that runs just before Orbax's
final rename is made to block for step 2: whether the kill lands while the shards are being
written or at that hook, step 2 is never finalized.
"""

import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import toy

from jzero import checkpoint
from jzero.checkpoint import checkpointer

BIG = 16 * 1024 * 1024  # float32 elements: 64 MiB


def main(directory: str) -> None:
    ckpt = checkpoint.Checkpointer(directory)
    ckpt.save(1, {"step": np.int32(1), "params": toy.make_params()}, meta={"step": 1})
    ckpt.wait_until_finished()
    seal = checkpointer.seal

    def blocking_seal(step_dir):
        if step_dir.name.startswith("2"):
            time.sleep(3600)
        seal(step_dir)

    checkpointer.seal = blocking_seal
    big = {"step": np.int32(2), "params": toy.make_params(), "big": jnp.ones((BIG,), jnp.float32)}
    ckpt.save(2, big, meta={"step": 2})
    unfinished = Path(directory) / f"2{checkpoint.TMP_SUFFIX}"
    while not unfinished.is_dir():  # Orbax makes it in the background: kill only once it is
        time.sleep(0.01)
    print("saving", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
