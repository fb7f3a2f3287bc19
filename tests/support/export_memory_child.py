"""Child process of tests/checkpoint/test_checkpoint.py: exports a checkpoint and prints the peak
resident
memory each export added, as JSON. Run alone so that no other test's memory moves the mark.

Usage: export_memory_child.py CKPT_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

from jzero.weights import export_checkpoint


def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def main(directory: str, out: str) -> None:
    export_checkpoint(
        directory, 1, Path(out) / "warm_up.npz"
    )  # first-use allocations of the libraries
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
    print(json.dumps(peaks), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
