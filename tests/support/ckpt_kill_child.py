"""Child process of tests/checkpoint/test_checkpoint_safety.py: is killed with SIGKILL in the
middle of two saves, one in each of two checkpoint directories (one process, so that the two
cases pay for one start of JAX and jzero).

Usage: ckpt_kill_child.py MIDWRITE_DIR RESAVE_DIR.

* MIDWRITE_DIR (empty): saves the toy state as step 1 and waits for it, then starts the
  asynchronous save of a large step 2.
* RESAVE_DIR (the parent saved steps 1 and 2 there): restores its latest step, then saves
  step 2 again with other values (a re-run that saves over its newest step).

Prints ``saving`` once step 2's unfinished folder exists in MIDWRITE_DIR (Orbax makes it in the
background) and RESAVE_DIR's re-save has set the old copy aside, and sleeps until it is killed.
The hook that runs just before Orbax's final rename blocks for step 2, so the kill never comes
after either step 2 is committed: in MIDWRITE_DIR it lands while the shards are being written
or at that hook, in RESAVE_DIR after the old copy was set aside and before the new copy is
committed (the moment a re-save is most exposed).
"""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import toy

from jzero import checkpoint
from jzero.checkpoint import checkpointer

BIG = 16 * 1024 * 1024  # float32 elements: 64 MiB


def main(midwrite: str, resave: str) -> None:
    ckpt = checkpoint.Checkpointer(midwrite)
    ckpt.save(1, {"step": np.int32(1), "params": toy.make_params()}, meta={"step": 1})
    ckpt.wait_until_finished()
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    again = checkpoint.Checkpointer(resave)
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=single)}
    _, meta = again.restore(target)
    assert meta == {"step": 2}, meta

    seal = checkpointer.seal

    def blocking_seal(step_dir):
        if step_dir.name.startswith("2"):
            time.sleep(3600)
        seal(step_dir)

    checkpointer.seal = blocking_seal
    big = {"step": np.int32(2), "params": toy.make_params(), "big": jnp.ones((BIG,), jnp.float32)}
    ckpt.save(2, big, meta={"step": 2})
    again.save(2, {"w": np.full((64, 64), -1.0, np.float32)}, meta={"step": 2}, overwrite=True)
    unfinished = Path(midwrite) / f"2{checkpoint.TMP_SUFFIX}"
    while not unfinished.is_dir():  # Orbax makes it in the background: kill only once it is
        time.sleep(0.01)
    print("saving", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
