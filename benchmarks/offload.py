"""Offload tiers at ZeRO stages 1-3: device, host and disk bytes, and the step-time cost.

Run: ``python benchmarks/offload.py`` (8 virtual CPU devices are set up when no accelerator is
present; a few minutes on 2 CPU cores). For every stage it trains the built-in GPT without
offload, with ``offload_optimizer: {device: cpu}`` (optimizer state, and the fp32 master
weights under ``--bf16``, in ``pinned_host``), the same with ``sub_group_size`` at a quarter of
the parameters (the update streamed one group at a time), the same with ``compute: host`` (each
group updated where it rests in host memory, ``optimizer+host``), and with ``device: nvme`` (the
state in files under a temporary ``nvme_path``); at stage 3 also with ``offload_param`` on top,
in host memory (``optimizer+param``) and on NVMe (``nvme+param``); ``--stages`` and
``--offload`` (``none`` among them) pick some. Figures per device:

* plan device / plan host: :func:`jzero.plan.model_state_bytes` and
  :func:`~jzero.plan.host_state_bytes` (params, grads, masters, optimizer state);
* args / out / temp and host args / host out / host temp: the compiled step's
  ``memory_analysis()``;
* params in / opt in: the memory kinds the live arrays rest in after the steps;
* ms/step: the median of ``--steps`` steps after ``--warmup``, each waited for with its new
  state (so the copies back to host memory are inside the time), and its ratio to the same
  stage without offload;
* RSS: the process's resident memory at its highest during the timed steps (sampled every
  5 ms from ``/proc/self/status``), less the resident memory just before them: what a step
  adds in host memory while it runs (on CPU the devices' memory is this process's too);
* disk: bytes of the NVMe tier's files after the steps (one version of the state).

On CPU, host and device memory are the same RAM: the compiler counts offloaded arguments among
the device arguments and reports 0 for every ``host_*`` field. The script detects that and says
so; the device/host split then comes from the plan alone, and only an accelerator
(``benchmarks/gpu_check.sh``) measures the saving in device memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import threading
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402
from jzero.demo import gpt  # noqa: E402
from jzero.plan import host_state_bytes, model_state_bytes  # noqa: E402

MIB = 1 << 20
HOST = {"device": "cpu", "pin_memory": True}
VARIANTS = tuple(
    (stage, variant)
    for stage in (1, 2, 3)
    for variant in ("none", "optimizer", "optimizer+subgroups", "optimizer+host", "nvme")
) + ((3, "optimizer+param"), (3, "nvme+param"))


def rss_bytes() -> int:
    """The process's resident memory now (Linux), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRss:
    """Samples the resident memory every 5 ms while open; ``peak`` is the highest seen."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


FIELDS = ("argument", "output", "temp", "host_argument", "host_output", "host_temp")


def _kinds(tree) -> str:
    return ",".join(sorted({x.sharding.memory_kind for x in jax.tree.leaves(tree)}))


def measure(stage: int, variant: str, params, loss, batch, args, nvme_dir: str) -> dict:
    """Builds, compiles and times one (stage, offload) configuration."""
    psi = sum(x.size for x in jax.tree.leaves(params))
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if "optimizer" in variant:
        zero["offload_optimizer"] = HOST
    if "param" in variant:
        zero["offload_param"] = HOST
    if variant == "optimizer+host":
        zero["offload_optimizer"] = dict(HOST, compute="host")
    on_nvme = variant.startswith("nvme")
    if "subgroups" in variant or variant == "optimizer+host" or on_nvme:
        zero["sub_group_size"] = max(1, psi // 4)
    if on_nvme:
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme_dir,
            "pipeline_read": True,
            "pipeline_write": True,
        }
    if variant == "nvme+param":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pipeline_read": True}
    config = {
        "train_batch_size": batch["tokens"].shape[0],
        "bf16": {"enabled": args.bf16},
        "zero_optimization": zero,
    }
    engine = jzero.initialize(params, loss, optax.adamw(1e-3), config)
    mem = engine.lower(batch).compile().memory_analysis()
    times = []
    for _ in range(args.warmup):
        jax.block_until_ready((engine.train_step(batch), engine.state))
    before = rss_bytes()
    with PeakRss() as rss:
        for _ in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready((engine.train_step(batch), engine.state))
            times.append(time.perf_counter() - start)
    disk = 0
    if on_nvme:  # the tier's files (the parameters' store may be the same one)
        stores = {id(s): s for s in (engine._disk.store, engine._disk.param_store) if s}
        disk = sum(s.disk_bytes() for s in stores.values())
    on_disk = {"opt_state", "master_params"} if on_nvme else set()
    if variant == "nvme+param":
        on_disk.add("params")
    params_in = "nvme" if "params" in on_disk else _kinds(engine.state.params)
    opt_in = "nvme" if on_nvme else _kinds(engine.state.opt_state)
    engine.close()
    return {
        "stage": stage,
        "variant": variant,
        "params_in": params_in,
        "opt_in": opt_in,
        "plan_device": sum(
            v for k, v in model_state_bytes(engine.plan).items() if k not in on_disk
        ),
        "plan_host": sum(host_state_bytes(engine.plan).values()),
        **{f: int(getattr(mem, f"{f}_size_in_bytes", 0) or 0) for f in FIELDS},
        "seconds": statistics.median(times),
        "rss": max(0, rss.peak - before),
        "disk": disk,
    }


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    ap.add_argument("--d-model", type=int, default=128, help="model width (default 128)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens a sequence (default 64)")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per device (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 masters offloaded too")
    ap.add_argument("--stages", default="1,2,3", help="stages to measure (default 1,2,3)")
    ap.add_argument(
        "--offload",
        default=",".join(dict.fromkeys(v for _, v in VARIANTS)),
        help="offload variants to measure, comma-separated (default all)",
    )
    args = ap.parse_args(argv)
    if "none" not in args.offload.split(","):
        ap.error("--offload needs none: the step-time ratios are against it")

    cfg = gpt.GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=4,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dtype="bfloat16" if args.bf16 else "float32",
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    loss = lambda p, b: gpt.loss_fn(p, b, cfg)
    n = jax.device_count()
    platform = jax.devices()[0].platform
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (args.micro_batch * n, args.seq_len + 1), dtype=np.int32)
    batch = {"tokens": tokens}
    psi = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {psi:,} parameters, "
        f"{'bf16 compute with fp32 masters' if args.bf16 else 'fp32'}, AdamW, {n} {platform} "
        f"devices, global batch {args.micro_batch * n} x {args.seq_len} tokens"
    )
    with tempfile.TemporaryDirectory(prefix="jzero-bench-nvme-") as nvme_dir:
        rows = [
            measure(stage, variant, params, loss, batch, args, nvme_dir)
            for stage, variant in VARIANTS
            if str(stage) in args.stages.split(",") and variant in args.offload.split(",")
        ]

    print("\nPer-device memory (MiB): the plan's split, then the compiled step's memory_analysis()")
    header = ("stage", "offload", "params in", "opt in", "plan device", "plan host")
    header += ("args", "out", "temp", "host args", "host out", "host temp")
    print(
        _table(
            header,
            [
                (
                    str(r["stage"]),
                    r["variant"],
                    r["params_in"],
                    r["opt_in"],
                    *(f"{r[k] / MIB:.2f}" for k in ("plan_device", "plan_host", *FIELDS)),
                )
                for r in rows
            ],
        )
    )
    base = {r["stage"]: r for r in rows if r["variant"] == "none"}
    if not any(r[f] for r in rows for f in FIELDS if f.startswith("host_")):
        same = all(r["argument"] == base[r["stage"]]["argument"] for r in rows)
        note = (
            f"Note: on {platform} the compiler reports 0 for every host_* field, offloaded or "
            "not; offloaded state is counted in 'args' like device state"
            + (" (args are equal with and without offload at every stage)" if same else "")
            + ". This run therefore measures no device-memory saving: the device/host split "
            "above is the plan's. Run benchmarks/gpu_check.sh on an accelerator to measure it."
        )
        print("\n" + textwrap.fill(note, 100))

    print(
        f"\nStep time (median of {args.steps} steps after {args.warmup}), host memory a step "
        "adds while it runs (RSS MiB) and disk bytes (MiB)"
    )
    print(
        _table(
            ("stage", "offload", "ms/step", "vs no offload", "RSS", "disk"),
            [
                (
                    str(r["stage"]),
                    r["variant"],
                    f"{r['seconds'] * 1e3:.1f}",
                    f"{r['seconds'] / base[r['stage']]['seconds']:.2f}",
                    f"{r['rss'] / MIB:.1f}",
                    f"{r['disk'] / MIB:.2f}",
                )
                for r in rows
            ],
        )
    )
    if platform == "cpu":
        print(
            "On cpu a copy between memory kinds is a copy within the same RAM: these ratios "
            "say nothing about an accelerator's host link."
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
