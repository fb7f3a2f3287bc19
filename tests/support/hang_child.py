"""One of two processes of tests/distributed/test_watchdog.py: the user's model through
``jzero train`` on 2 devices, process 1 misbehaving as ``MODE`` says.

``python hang_child.py MODE CKPT LOG``: ``sleep`` (process 1 stops in Python at step 3, before
its step starts), ``kill`` (process 1 is killed at step 3), ``config`` (process 1 runs another
``gradient_clipping``), ``loop`` (a user's own loop calling ``engine.train_step``, process 1
stopping in Python before its step 4). The run's ``distributed.hang_timeout`` is 5 s.
"""

import logging
import os
import signal
import sys
import time

import data_runs

from jzero.engine import Engine

mode, ckpt, log_dir = sys.argv[1], sys.argv[2], sys.argv[3]
index = int(os.environ["JZERO_PROCESS_ID"])
step, calls = Engine.train_step, []


def train_step(self, batch):
    calls.append(1)
    if index == 1 and len(calls) == 3:
        if mode == "sleep":
            time.sleep(3600)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    return step(self, batch)


if mode == "loop":
    import numpy as np
    import user_model

    import jzero

    jzero.init_distributed()
    config = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "distributed": {"hang_timeout": 5},
    }
    engine = jzero.initialize(config=config, **user_model.make(256, 8, 8))
    for k in range(1, 8):
        if index == 1 and k == 4:
            time.sleep(3600)
        tokens = np.random.default_rng(k).integers(0, 256, (8, 9)).astype(np.int32)
        rows = slice(4 * index, 4 * index + 4)  # this process's rows of the global batch
        batch = {"tokens": tokens[rows], "segment_ids": np.ones((4, 9), np.int32)}
        print(f"step {k}: loss {float(engine.train_step(batch)['loss']):.4f}", flush=True)
    sys.exit(0)

Engine.train_step = train_step
logging.basicConfig(level=logging.WARNING, force=True)
extra = ["distributed.hang_timeout=5"]
if mode == "config" and index == 1:
    extra.append("gradient_clipping=0.5")
data_runs.run(ckpt, log_dir, 6, extra)
print(f"process {index} finished", flush=True)
