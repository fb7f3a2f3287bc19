"""Child process of tests/checkpoint/test_checkpoint.py: the reads that must run apart from the
test process, in one process (each would otherwise pay for its own start of JAX and jzero).

Usage: ckpt_read_child.py BIG_DIR OUT_DIR DAMAGED_DIR, with XLA_FLAGS giving 1 device. Prints
one JSON line: ``{"peaks": {dtype: KiB}, "error": message}``.

1. Exports step 1 of BIG_DIR to OUT_DIR as ``big_<dtype>.safetensors`` and records the peak
   resident memory each export added: apart from the tests, so that memory freed or allocated
   by other tests cannot move the mark; first, so that nothing this process does later can.
2. Restores step 5 of DAMAGED_DIR (the stage-3 toy run saved on 8 devices, a shard cut short
   and no jzero file record) into a stage-3 plan on this process's device, so the read itself
   fails inside Orbax, and records the CheckpointError's message.
   When one shard read fails, TensorStore may finish the restore's other reads in its own
   threads after Orbax's event loop has closed, and reports each of those late ("Event loop is
   closed") whenever it happens; here that lands on this short-lived process only.
"""

import json
import sys
from pathlib import Path

import jax
import optax
import toy

import jzero
from jzero.checkpoint import Checkpointer, CheckpointError
from jzero.plan import PlanOptions
from jzero.step import init_train_state, restore_target
from jzero.weights import export_checkpoint


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def export_peaks(directory: str, out: str) -> dict[str, int]:
    """Per dtype, the least of 3 exports' added resident-memory peaks, in KiB."""
    export_checkpoint(directory, 1, Path(out) / "warm_up.npz")  # the libraries' first use
    peaks = {}
    for dtype in ("float32", "bfloat16"):
        runs = []
        for _ in range(3):
            Path("/proc/self/clear_refs").write_text("5")  # high-water mark := current RSS
            before = rss_kib("VmRSS")
            export_checkpoint(directory, 1, Path(out) / f"big_{dtype}.safetensors", dtype=dtype)
            runs.append(rss_kib("VmHWM") - before)
        # The allocator's arenas and TensorStore's threads make one run's mark noisy (measured
        # 1-7 leaves); an export that held the whole tree would cost 16 leaves every run.
        peaks[dtype] = min(runs)
    return peaks


def damaged_error(directory: str) -> str | None:
    """The CheckpointError's message of restoring DAMAGED_DIR; None if it restored."""
    params = toy.make_params()
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    plan = jzero.make_plan(
        params, tx, jzero.make_mesh(-1), 3, PlanOptions().replace(persistence_threshold=0)
    )
    abstract = jax.eval_shape(lambda: init_train_state(plan, params, tx))
    target = restore_target(plan, abstract)  # logical shapes: checkpoints hold no padding
    try:
        Checkpointer(directory).restore(target)
    except CheckpointError as e:
        return str(e)
    return None


def main(big: str, out: str, damaged: str) -> None:
    peaks = export_peaks(big, out)
    print(json.dumps({"peaks": peaks, "error": damaged_error(damaged)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
