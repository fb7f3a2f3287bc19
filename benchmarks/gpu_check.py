"""GPU check of offload: ZeRO stage 2 in bf16 without offload, with ``offload_optimizer`` to host
memory (whole, streamed over sub-groups through the device, and updated on the host) and to NVMe
files.

Run on one accelerator through ``benchmarks/gpu_check.sh`` (it builds a fresh venv), or directly:
``python benchmarks/gpu_check.py`` (a GPT of about 300 M parameters) or ``--smoke`` (a tiny
GPT, seconds on CPU; the test suite runs it so that the script cannot rot).

Decisions:

* Each variant (``none``: everything in device memory; ``optimizer``: optimizer state and fp32
  master weights in ``pinned_host``; ``subgroups``: the same with ``sub_group_size`` at a quarter
  of the parameters, the update streamed one group at a time; ``host``: the same groups updated
  in host memory where they rest, ``compute: host``, which is how the default of
  ``offload_optimizer.compute`` gets chosen per backend; ``nvme``: the state in files under
  a temporary ``nvme_path``, read ahead and written behind) runs in its own Python process,
  because a device's ``peak_bytes_in_use`` only ever grows within a process: one process per
  variant gives each its own peak. The parent gathers their JSON, prints one table and writes it to
  ``$OUT/gpu_check.json`` when ``OUT`` is set. ``--variants`` runs some of them (``none``, the
  base of the ratios, among them).
* Device memory is read three ways: the live allocator (``memory_stats()``: ``bytes_in_use``
  after the timed steps and ``peak_bytes_in_use``), the compiled step's ``memory_analysis()``
  (device and host argument, output and temp bytes) and jzero's plan (``model_state_bytes`` /
  ``host_state_bytes``). A CPU backend has no allocator statistics (shown as ``n/a``) and does
  not split host from device bytes in ``memory_analysis`` (its ``host_*`` fields are 0).
* Step time is the median over ``--steps`` steps after ``--warmup`` steps, each step waited for
  in full (the new state too, so the copies back to host memory are inside the time).
* The losses of the two variants are reported side by side: on CPU they are bit-identical; on a
  GPU, XLA may pick non-deterministic reductions, so the script reports the largest difference
  instead of failing on it.
* ``--smoke`` also lowers the CPU code generator's optimisation level in the child processes:
  it checks that the script runs, and compile time dominates a tiny model on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
VARIANTS = ("none", "optimizer", "subgroups", "host", "nvme")
FULL = {"layers": 24, "d_model": 1024, "heads": 16, "seq_len": 512, "micro_batch": 8}
SMOKE = {"layers": 2, "d_model": 64, "heads": 2, "seq_len": 16, "micro_batch": 1}
# --smoke's CPU code generation, the cheapest there is: LLVM at its lowest level, and the fused
# loops emitted by XLA's elemental emitter rather than its MLIR fusion emitters (which take about
# twice as long to compile a tiny model's step on CPU, for the same program), in one LLVM module
# rather than parts compiled on threads (15% less CPU for a tiny step).
SMOKE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)


def add_size_args(ap: argparse.ArgumentParser) -> None:
    """``--smoke`` and the GPT's size flags, shared by every GPU check (defaults: FULL)."""
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT and 2 steps (for CPU)")
    ap.add_argument("--layers", type=int, help=f"transformer blocks (default {FULL['layers']})")
    ap.add_argument("--d-model", type=int, help=f"model width (default {FULL['d_model']})")
    ap.add_argument("--heads", type=int, help=f"attention heads (default {FULL['heads']})")
    ap.add_argument("--seq-len", type=int, help=f"tokens a sequence (default {FULL['seq_len']})")
    ap.add_argument(
        "--micro-batch", type=int, help=f"sequences per device (default {FULL['micro_batch']})"
    )


def fill_sizes(args: argparse.Namespace) -> None:
    """The size flags not given take the SMOKE (with ``--smoke``) or FULL sizes."""
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--steps", type=int, help="timed steps (default 5, smoke 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument(
        "--variant-timeout", type=float, default=170.0, help="seconds per variant process"
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated among {', '.join(VARIANTS)}, none among them (default all)",
    )
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process
    ap.add_argument("--result", help=argparse.SUPPRESS)  # child process: where its JSON goes
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if "none" not in names or not set(names) <= set(VARIANTS):
        ap.error(f"--variants: comma-separated among {', '.join(VARIANTS)}, none among them")
    args.variants = [v for v in VARIANTS if v in names]
    fill_sizes(args)
    if args.steps is None:
        args.steps = 2 if args.smoke else 5
    if args.smoke:
        args.warmup = min(args.warmup, 1)
    return args


def _stats(device: Any) -> dict[str, int | None]:
    stats = device.memory_stats() or {}
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Trains one variant and returns its measurements (runs in a child process)."""
    import jax
    import numpy as np
    import optax

    import jzero
    from jzero.demo import gpt
    from jzero.plan import host_state_bytes, model_state_bytes

    device = jax.devices()[0]
    cfg = gpt.GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dtype="bfloat16",
    )
    n = jax.device_count()
    zero: dict[str, Any] = {"stage": 2}
    psi = sum(
        math.prod(x.shape)
        for x in jax.tree.leaves(jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg)))
    )
    if args.variant in ("optimizer", "subgroups", "host"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if args.variant == "host":
        zero["offload_optimizer"]["compute"] = "host"
    if args.variant in ("subgroups", "host", "nvme"):
        zero["sub_group_size"] = max(1, psi // 4)
    nvme_dir = None
    if args.variant == "nvme":
        nvme_dir = tempfile.mkdtemp(prefix="jzero-gpu-nvme-")
        zero["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": nvme_dir,
            "pipeline_read": True,
            "pipeline_write": True,
        }
    config = {
        "train_batch_size": args.micro_batch * n,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }
    engine = jzero.initialize(
        lambda key: gpt.init_params(key, cfg),
        loss_fn=lambda p, b: gpt.loss_fn(p, b, cfg),
        optimizer=optax.adamw(1e-4),
        config=config,
    )
    rng = np.random.default_rng(0)
    batches = [
        {"tokens": rng.integers(0, 256, (args.micro_batch * n, args.seq_len + 1), dtype=np.int32)}
        for _ in range(2)
    ]
    compiled = engine.lower(batches[0]).compile()
    mem = compiled.memory_analysis()
    analysis = {
        k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "temp", "host_argument", "host_output", "host_temp")
    }
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        metrics = engine.train_step(batches[i % 2])
        jax.block_until_ready((metrics, engine.state))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(engine.state.opt_state)})
    if nvme_dir is not None:
        kinds = ["nvme"]
        engine.close()
        os.rmdir(nvme_dir)
    return {
        "variant": args.variant,
        "params": sum(math.prod(leaf.shape) for leaf in engine.plan.leaves),
        "devices": n,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "jax": jax.__version__,
        "opt_state_memory_kinds": kinds,
        "memory_stats": _stats(device),
        "memory_analysis": analysis,
        "plan_device_bytes": sum(model_state_bytes(engine.plan).values()),
        "plan_host_bytes": sum(host_state_bytes(engine.plan).values()),
        "step_seconds_median": statistics.median(times),
        "losses": losses,
    }


def child_argv(script: str, args: argparse.Namespace, variant: str, result: Path) -> list[str]:
    """``script`` run as one variant's child process, with the parent's sizes and step counts."""
    argv = [sys.executable, str(Path(script).resolve())]
    for key in ("layers", "d_model", "heads", "seq_len", "micro_batch", "steps", "warmup"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv + ["--variant", variant, "--result", str(result)]


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """The one table: a row per variant, MiB per device and the step-time ratio."""
    cols = (
        "variant",
        "opt state in",
        "in use",
        "peak",
        "args",
        "out",
        "temp",
        "host args",
        "host out",
        "host temp",
        "plan dev",
        "plan host",
        "ms/step",
        "vs none",
    )
    base = results["none"]["step_seconds_median"]
    rows = [cols]
    for name, r in results.items():
        a, s = r["memory_analysis"], r["memory_stats"]
        rows.append(
            (
                name,
                ",".join(r["opt_state_memory_kinds"]),
                _mib(s["bytes_in_use"]),
                _mib(s["peak_bytes_in_use"]),
                *(_mib(a[k]) for k in ("argument", "output", "temp")),
                *(_mib(a[k]) for k in ("host_argument", "host_output", "host_temp")),
                _mib(r["plan_device_bytes"]),
                _mib(r["plan_host_bytes"]),
                f"{r['step_seconds_median'] * 1e3:.1f}",
                f"{r['step_seconds_median'] / base:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.variant:
        Path(args.result).write_text(json.dumps(run_variant(args)))
        return 0
    env = dict(os.environ)
    if args.smoke:  # a crash check: cheaper CPU code generation (compile time rules there)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            result = Path(tmp) / f"{variant}.json"
            proc = subprocess.run(
                child_argv(__file__, args, variant, result),
                timeout=args.variant_timeout,
                env=env,
            )
            if proc.returncode != 0 or not result.exists():
                print(f"variant {variant!r} failed with exit status {proc.returncode}")
                return 1
            results[variant] = json.loads(result.read_text())
    first = results["none"]
    print(
        f"jzero host-offload check: GPT {args.layers} layers, d_model {args.d_model}, "
        f"{first['params']:,} parameters, bf16 with fp32 masters, ZeRO stage 2, AdamW, "
        f"{first['devices']} x {first['device_kind']} ({first['platform']}), jax {first['jax']}"
    )
    print(
        f"global batch {args.micro_batch * first['devices']} x {args.seq_len} tokens; "
        f"ms/step is the median of {args.steps} steps after {args.warmup}; memory in MiB per device"
    )
    print(table(results))
    a = results["none"]["losses"]
    diff = 0.0
    for name, r in results.items():
        if name != "none":
            diff = max([diff] + [abs(x - y) for x, y in zip(a, r["losses"], strict=True)])
    print(f"losses without offload {a}")
    for name, r in results.items():
        if name != "none":
            print(f"losses {name:<10} {r['losses']}")
    print(f"largest difference from none {diff:g}")
    if not any(r["memory_analysis"]["host_argument"] for r in results.values()):
        print(
            "memory_analysis() reports no host bytes on this backend: its device/host split "
            "is not measured here; 'plan dev' / 'plan host' give it."
        )
    out = os.environ.get("OUT")
    if out:
        summary = {"args": vars(args), "variants": results, "largest_loss_difference": diff}
        (Path(out) / "gpu_check.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {Path(out) / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
