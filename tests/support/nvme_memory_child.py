"""Child process of tests/nvme/test_offload_tiers.py: the resident memory of training with the
optimizer state in memory or on NVMe, as JSON (bytes). Run alone so that no other test's memory
moves the marks.

Usage: nvme_memory_child.py NVME_DIR MODE..., each MODE one of memory, nvme, nvme+params, with
1 device in XLA_FLAGS and MALLOC_MMAP_THRESHOLD_=65536 (freed buffers leave the resident set).
Each mode runs in a process of its own, one after the other, forked from this one once JAX,
jzero and optax are imported and before JAX starts a backend or a thread: each starts as a
fresh process would, without paying for the imports again, and prints one JSON line.

One device: with 8 virtual devices the step's gathers and gradients run on 8 threads at once,
and how many of them are alive together (hundreds of MiB) depended on the machine's load; on
one the marks repeat to within a MiB. The files, groups and versions are the same at any
device count.
``nvme+params`` puts the parameters on NVMe too.

The model is 16 leaves of 2**20 float32 (64 MiB of parameters) trained with Adam (128 MiB of
state) at stage 3, two leaves to a group. Three marks:

* init: the high-water RSS during ``jzero.initialize`` less the RSS before it (the parameters'
  shards and, where it lives in memory, the optimizer state);

* held: the RSS after 3 steps less the RSS before ``jzero.initialize`` (what the run keeps:
  parameters, compiled programs, and the optimizer state where it lives in memory);
* growth: the high-water RSS over step 3 less the RSS after step 2 (what a step adds while
  it runs, compiled programs and the first write of the state already done; every later step
  runs the same programs on the same sizes).
"""

import ctypes
import gc
import json
import os
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jzero

LIBC = ctypes.CDLL("libc.so.6")
LEAVES, SIZE = 16, 1 << 20


def rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


def trimmed_rss() -> int:
    gc.collect()
    LIBC.malloc_trim(0)
    return rss("VmRSS")


def loss_fn(params, batch):
    scale = jnp.mean(batch["x"][:, 0])  # any number of rows a device
    return sum(jnp.mean((w.reshape(-1, 512) * scale) ** 2) for w in params.values())


def main(mode: str, nvme_dir: str) -> None:
    rng = np.random.default_rng(0)
    params = {f"w{i:02d}": rng.normal(size=(SIZE,)).astype(np.float32) for i in range(LEAVES)}
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32)}
    zero = {"stage": 3, "sub_group_size": SIZE, "stage3_param_persistence_threshold": 0}
    if mode.startswith("nvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    if mode == "nvme+params":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    cfg = {"train_batch_size": 8, "zero_optimization": zero}
    start = trimmed_rss()
    Path("/proc/self/clear_refs").write_text("5")
    engine = jzero.initialize(params, loss_fn, optax.adam(1e-3), cfg)
    jax.block_until_ready(engine.state)  # dispatch is asynchronous
    init = rss("VmHWM") - start
    for _ in range(2):
        jax.block_until_ready(engine.train_step(batch))
    after2 = trimmed_rss()
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := current RSS
    jax.block_until_ready(engine.train_step(batch))
    peak = rss("VmHWM")
    held = trimmed_rss() - start
    record = {
        "mode": mode,
        "init": init,
        "held": held,
        "growth": peak - after2,
        "state": 2 * LEAVES * SIZE * 4,  # Adam's two moments
        "params": LEAVES * SIZE * 4,
    }
    print(json.dumps(record), flush=True)
    engine.close()


def run_apart(mode: str, nvme_dir: str) -> None:
    """``main`` in a forked process of its own; raises if it fails."""
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # the child: nothing of JAX's runtime exists yet, as in a fresh process
        code = 1
        try:
            main(mode, nvme_dir)
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"mode {mode} failed: wait status {status}")


if __name__ == "__main__":
    # Forking is safe while this process runs one thread (JAX starts its own with a backend).
    assert threading.active_count() == 1, threading.enumerate()
    for name in sys.argv[2:]:
        run_apart(name, sys.argv[1])
