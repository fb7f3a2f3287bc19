"""The demo's loss and MFU curves, drawn from what jzero's CSV monitor wrote.

Run: ``python benchmarks/training_curves.py`` trains the demo (``configs/zero2.yaml``, 150
steps on 8 virtual CPU devices when no accelerator is present) with ``csv_monitor`` and
``tensorboard`` on, then reads the monitor's files back and draws ``--plot`` (default
``docs/demo_curves.png``): the train and eval loss, and MFU, against the samples trained (the
monitors' x-axis, as DeepSpeed's). ``--from DIR`` draws an earlier run's monitor directory
(``<output_path>/<job_name>``, e.g. ``runs/zero2/DeepSpeedJobName``) without training.
``--smoke``: a tiny GPT for a few steps, the CPU's matmul rate measured on smaller matrices (the
test's run).

MFU needs the device's peak FLOP/s. An accelerator's comes from jzero's table; a CPU has none,
so this script measures one: the rate of a float32 batched matmul with every device computing
its own share at once (the devices of one host share its cores), per device. The MFU plotted on
CPU is then the step's model FLOPs against that measured matmul rate, and says so.

The table printed is the plotted series at a few points, from the same files.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jzero import (
    profiler,  # noqa: E402
    train,  # noqa: E402
)

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "model": {
        "vocab_size": 256,
        "seq_len": 32,
        "num_layers": 2,
        "num_heads": 2,
        "d_model": 32,
        "d_ff": 64,
    },  # fmt: skip
    "data": {"source": "stdlib", "max_bytes": 200_000},
    "train_micro_batch_size_per_gpu": 2,
}


def measured_peak(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s per device of a float32 matmul, every device multiplying its own pair at once."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    a = jax.device_put(jnp.ones((len(devices), size, size), jnp.float32), shard)
    matmul = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def read_series(job: Path, name: str) -> list[tuple[int, float]]:
    """The ``(samples, value)`` rows of the CSV monitor's ``Train/Samples/<name>`` file."""
    path = job / f"Train_Samples_{name}.csv"
    if not path.exists():
        return []
    with path.open(newline="") as f:
        rows = list(csv.reader(f))[1:]
    return [(int(s), float(v)) for s, v in rows]


def plot(job: Path, out: Path, peak_note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss, evals, mfu = (read_series(job, n) for n in ("train_loss", "eval_loss", "mfu"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(*zip(*loss, strict=True), label="train loss", lw=1)
    if evals:
        left.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    left.set_xlabel("samples")
    left.set_ylabel("loss (nats/byte)")
    left.legend()
    left.grid(alpha=0.3)
    if mfu:
        steps, values = zip(*mfu[1:], strict=True)  # the first step holds its compilation
        right.plot(steps, [100 * v for v in values], lw=1)
    right.set_xlabel("samples")
    right.set_ylabel("MFU (%)")
    right.set_title(peak_note, fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(f"jzero: the CSV monitor's series ({job.name})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def print_table(job: Path) -> None:
    loss, evals, mfu = (read_series(job, n) for n in ("train_loss", "eval_loss", "mfu"))
    by_samples = {s: {"loss": v} for s, v in loss}
    for name, series in (("eval", evals), ("mfu", mfu)):
        for s, v in series:
            by_samples.setdefault(s, {})[name] = v
    shown = sorted(by_samples)
    picks = sorted({shown[0], *shown[:: max(1, len(shown) // 6)], shown[-1]}) if shown else []
    picks = sorted(set(picks) | {s for s, _ in evals})
    print("| samples | train loss | eval loss | MFU % |")
    print("|---|---|---|---|")
    for s in picks:
        row = by_samples[s]
        cells = [f"{row[k]:.4f}" if k in row else "" for k in ("loss", "eval")]
        cells.append(f"{100 * row['mfu']:.2f}" if "mfu" in row else "")
        print(f"| {s} | " + " | ".join(cells) + " |")
    if len(mfu) > 1:
        print(f"mean MFU after the first step: {100 * np.mean([v for _, v in mfu[1:]]):.2f}%")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "zero2.yaml"))
    p.add_argument("--steps", type=int, default=None, help="default: the config's train.steps")
    p.add_argument("--plot", default=str(ROOT / "docs" / "demo_curves.png"))
    p.add_argument("--from", dest="source", default=None, help="a monitor directory to draw")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    device = jax.devices()[0]
    peak = profiler.peak_flops(device)
    if peak is not None:
        note = f"MFU against {device.device_kind}'s dense bf16 peak, {peak / 1e12:.0f} TFLOP/s"
    if args.source is not None:
        job = Path(args.source)
        note = "MFU as the run logged it"
    else:
        if peak is None:
            peak = measured_peak(256 if args.smoke else 1024)
            note = (
                f"MFU against this CPU's measured f32 matmul rate, {peak / 1e9:.1f} GFLOP/s/device"
            )
        out_dir = Path(tempfile.mkdtemp(prefix="jzero-curves-"))
        monitors = {"enabled": True, "output_path": str(out_dir), "job_name": "demo"}
        overrides = [
            f"csv_monitor={monitors}",
            f"tensorboard={monitors}",
            f"flops_profiler.peak_flops={peak}",
            f"train.log_dir={out_dir / 'run'}",  # the rest of the config's train section stays
            "checkpoint.directory=null",  # curves only: the demo's own checkpoints stay untouched
        ]
        if args.smoke:
            overrides += [f"{k}={v}" for k, v in TINY.items()]
            overrides += ["train.eval_interval=3", "train.eval_batches=1"]
        steps = 6 if args.smoke and args.steps is None else args.steps
        summary = train.run(args.config, overrides=overrides, steps=steps, progress=False)
        job = out_dir / "demo"
        print(f"trained {summary['steps']} steps in {summary['seconds']} s; monitors in {job}")
    print(note)
    print_table(job)
    plot(job, Path(args.plot), note)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
