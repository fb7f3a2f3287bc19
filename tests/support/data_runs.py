"""``jzero train --model user_model.py:make`` runs that record which samples each step read:
tests/train/test_resume_anywhere.py runs them in its own process (8 devices), in a child with 4
devices, and as 2 processes x 2 devices under ``jzero launch``.

``python data_runs.py CKPT LOG OUT STEPS``: trains (resuming from CKPT's latest checkpoint) to
step STEPS in float64 and writes ``OUT.<process>.json``: per step trained, the packed rows
this process read, and the run's summary. With ``DATA_RUNS_SLOW_PROCESS=P`` process P takes
0.25 s longer to read each batch (a straggler, named after 2 steps).
"""

import json
import logging
import os
import sys
import time

import jax

from jzero import data, train

USER_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_model.py") + ":make"
GLOBAL_BATCH = 32  # configs/zero2.yaml's 4 rows per device on 8 devices


def overrides(ckpt: str, log_dir: str) -> list[str]:
    """The run: the user's model on the stdlib corpus packed into rows of 9 tokens, the
    config's batch sizes (4 rows per device; no batch key here, so a resume on fewer devices
    keeps the checkpoint's global batch), checkpoints every 3 steps."""
    return [
        "model={vocab_size: 256, seq_len: 8, d_model: 8}",
        "data={source: stdlib, max_bytes: 20000, eval_fraction: 0.1}",
        "zero_optimization={stage: 2}",
        "optimizer={type: AdamW, params: {lr: 0.01}}",
        "scheduler=null",
        "train.eval_interval=3",  # evaluated at the start, at 3 (the checkpoint) and at 6
        "train.eval_batches=1",
        "checkpoint.save_interval_steps=3",
        "checkpoint.async=false",
        f"checkpoint.directory={ckpt}",
        f"train.log_dir={log_dir}",
    ]


def run(ckpt: str, log_dir: str, steps: int, extra: list[str] = ()) -> tuple[list, dict]:
    """Trains to ``steps`` (resuming where CKPT has a checkpoint): (per step, the sample ids
    this process read; the summary)."""
    read = []
    original = data.DataIterator.next

    slow = os.environ.get("DATA_RUNS_SLOW_PROCESS")  # this process reads its data slowly

    def next_batch(self):
        if slow is not None and jax.process_index() == int(slow):
            time.sleep(0.25)
        batch = original(self)
        read.append(self.last_row_ids.tolist())
        return batch

    data.DataIterator.next = next_batch
    try:
        with jax.enable_x64(True):
            summary = train.run(
                "configs/zero2.yaml",
                overrides=[
                    *overrides(ckpt, log_dir),
                    *(["distributed.straggler_steps=2"] if slow is not None else []),
                    *extra,
                ],
                steps=steps,
                progress=False,
                model=USER_MODEL,
            )
    finally:
        data.DataIterator.next = original
    return read, summary


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, force=True
    )  # the run's lines on stderr, as jzero train shows them
    ckpt_dir, log, out, last = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ids, summary = run(ckpt_dir, log, last)
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump({"ids": ids, "summary": summary, "devices": jax.device_count()}, f)
