"""Child process of tests/weights/test_weights_io.py: peak resident memory added by a sharded export
from a checkpoint, by writing sharded arrays (``save_weights``) and by loading a sharded export
into stage-3 shardings (``load_weights``), as JSON (KiB). Run alone so that no other test's
memory moves the mark.

Usage: weights_memory_child.py CKPT_DIR OUT_DIR, with 8 devices in XLA_FLAGS (and
MALLOC_MMAP_THRESHOLD_=65536, so that freed leaves leave the resident set: see the test).
"""

import ctypes
import gc
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jzero.weights import export_checkpoint, load_weights, read_index, save_weights

LIBC = ctypes.CDLL("libc.so.6")


def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def least_of_3(run):
    """The least peak of 3 runs over the RSS before each (one run's mark is noisy: the
    allocator's arenas and TensorStore's threads). Memory freed by the run before is handed
    back to the system first (``malloc_trim``), so a run cannot hide its peak in it."""
    peaks = []
    for _ in range(3):
        gc.collect()
        LIBC.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # high-water mark := current RSS
        before = rss_kib("VmRSS")
        kept = run()
        peaks.append(rss_kib("VmHWM") - before)
        del kept
    return min(peaks)


def main(directory: str, out: str) -> None:
    out = Path(out)
    export_checkpoint(directory, 1, out / "warm", max_shard_size="20MB")  # first-use allocations
    peaks = {}
    for dtype in ("float32", "bfloat16"):

        def run(dtype=dtype):
            shutil.rmtree(out / dtype, ignore_errors=True)
            export_checkpoint(directory, 1, out / dtype, dtype=dtype, max_shard_size="20MB")

        peaks[f"export_{dtype}"] = least_of_3(run)
    _, weight_map, _ = read_index(out / "float32")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    shapes = {name: (512, 4096) for name in weight_map}
    abstract = {
        n.split(".")[0]: {"w": jax.ShapeDtypeStruct(s, np.float32)} for n, s in shapes.items()
    }
    shardings = jax.tree.map(lambda _: sharded, abstract)
    load_weights(out / "float32", abstract, shardings)  # warm up
    loaded_kib = sum(int(np.prod(s)) * 4 for s in shapes.values()) // 1024

    def load():
        params = load_weights(out / "float32", abstract, shardings)
        jax.block_until_ready(params)
        return params

    peaks["import_above_params"] = least_of_3(load) - loaded_kib
    params = load()

    def save():
        shutil.rmtree(out / "saved", ignore_errors=True)
        save_weights(out / "saved", params, max_shard_size="20MB")

    peaks["save_weights"] = least_of_3(save)
    print(json.dumps(peaks), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
