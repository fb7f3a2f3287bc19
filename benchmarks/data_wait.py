"""How long ``jzero train`` waits for its data, and how long a resumed run takes to its first step.

Run: ``python benchmarks/data_wait.py`` (the demo model of ``configs/zero2.yaml``, the built-in
GPT on the standard library's source, 20 steps on 8 virtual CPU devices, then resumed for 3
steps on 8 and on 4), or ``--smoke`` (a 1-layer GPT, 2 steps, the least with a step after the
compiling one, then 1 more: it checks that the script runs). Prints one table:

* **data wait**: the time the training loop spent in :meth:`jzero.data.DataIterator.next` over
  the loop's wall time, for all its steps and for the steps after the first (whose time holds
  the step's compilation). Grain reads ahead in threads, so a step waits only when the reading
  falls behind.
* **start to first step**: for each resumed run, the seconds from starting the process to the
  end of its first trained step (imports, config, model, the checkpoint's restore, the data at
  its saved position, compilation or the compilation cache), with the run's compilations and
  cache hits. On 4 devices the run keeps the checkpoint's global batch (more accumulation
  steps).

Decisions:

* Each run is a child process (``XLA_FLAGS=--xla_force_host_platform_device_count=N``) calling
  :func:`jzero.train.run`, what ``jzero train`` runs; the child wraps ``DataIterator.next`` and
  ``Engine.train_step`` to time them, as ``tests/support/data_runs.py`` records its samples.
* The runs share a compilation cache in the script's temporary folder (``train.compile_cache``),
  so the resumed run on 8 devices loads the first run's programs, as a restarted job does; the
  run on 4 devices compiles its own.
* Each resumed run reads its own copy of the first run's checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL = {"steps": 20, "more": 3, "model": None, "max_bytes": None}
SMOKE = {
    "steps": 2,
    "more": 1,
    "model": "{vocab_size: 256, seq_len: 16, num_layers: 1, num_heads: 2, d_model: 32, d_ff: 64}",
    "max_bytes": 20000,
}


def _overrides(folder: Path, name: str, size: dict) -> list[str]:
    data = "{source: stdlib, eval_fraction: 0" + (
        f", max_bytes: {size['max_bytes']}}}" if size["max_bytes"] else "}"
    )
    extra = [f"model={size['model']}"] if size["model"] else []
    return [
        *extra,
        f"data={data}",
        "train.eval_interval=0",
        "checkpoint.async=false",
        f"checkpoint.directory={folder / name / 'ckpt'}",
        f"checkpoint.save_interval_steps={size['steps']}",
        f"train.log_dir={folder / name / 'log'}",
        f"train.compile_cache={folder / 'compile_cache'}",
    ]


def child(spec: dict) -> None:
    """One run (in the child process): trains to ``spec['steps']``, writes the timings."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    import jax

    from jzero import data, train
    from jzero.engine import Engine

    waits: list[float] = []
    first_step: list[float] = []
    original_next, original_step = data.DataIterator.next, Engine.train_step

    def timed_next(self):
        t = time.perf_counter()
        batch = original_next(self)
        waits.append(time.perf_counter() - t)
        return batch

    def timed_step(self, batch):
        out = original_step(self, batch)
        if not first_step:
            jax.block_until_ready(out)
            first_step.append(time.time() - spec["launched"])
        return out

    data.DataIterator.next, Engine.train_step = timed_next, timed_step
    summary = train.run(
        "configs/zero2.yaml", overrides=spec["overrides"], steps=spec["steps"], progress=False
    )
    metrics = [
        json.loads(line)
        for line in (Path(spec["log_dir"]) / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    times = [m["time"] for m in metrics if "step" in m and "time" in m and "loss" in m]
    out = {
        "devices": jax.device_count(),
        "waits": waits,
        "loop_s": times[-1] if times else None,
        "after_first_s": times[-1] - times[0] if len(times) > 1 else None,
        "first_step_s": first_step[0] if first_step else None,
        "steps": summary["steps"],
        "resumed_from": summary["resumed_from"],
        "compiles": summary.get("compiles"),
        "cache_hits": summary.get("cache_hits"),
    }
    Path(spec["out"]).write_text(json.dumps(out))


def _run(folder: Path, name: str, devices: int, steps: int, size: dict) -> dict:
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    spec = {
        "overrides": _overrides(folder, name, size),
        "steps": steps,
        "log_dir": str(folder / name / "log"),
        "out": str(folder / f"{name}.json"),
        "launched": time.time(),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"the run {name} on {devices} devices failed:\n{proc.stderr[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a 1-layer GPT, 2 steps")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    size = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        first = _run(folder, "first", 8, size["steps"], size)
        resumed = {}
        for devices in (8, 4):
            name = f"resume{devices}"
            shutil.copytree(folder / "first", folder / name)
            resumed[devices] = _run(folder, name, devices, size["steps"] + size["more"], size)
    waits = first["waits"]
    loop_waits = sum(waits[1:])  # the first is the probe, before the loop's clock starts
    later = sum(waits[2:])  # the batches of steps 2 on
    print(f"jzero train, configs/zero2.yaml's model, {size['steps']} steps on 8 devices")
    print(f"{'data wait':<34}{'seconds':>9}{'loop s':>9}{'share':>8}")
    print(
        f"{'all steps':<34}{loop_waits:>9.3f}{first['loop_s']:>9.2f}"
        f"{100 * loop_waits / first['loop_s']:>7.2f}%"
    )
    print(
        f"{'steps after the first':<34}{later:>9.3f}{first['after_first_s']:>9.2f}"
        f"{100 * later / first['after_first_s']:>7.2f}%"
    )
    print(f"{'first batch (before the loop)':<34}{waits[0]:>9.3f}")
    print()
    print(f"resumed from step {size['steps']}, trained {size['more']} more")
    print(f"{'devices':>8}{'start to first step s':>23}{'compiles':>10}{'cache hits':>12}")
    for devices, r in resumed.items():
        assert r["resumed_from"] == size["steps"], r
        print(
            f"{devices:>8}{r['first_step_s']:>23.2f}{r['compiles'] or 0:>10}"
            f"{r['cache_hits'] or 0:>12}"
        )


if __name__ == "__main__":
    main()
