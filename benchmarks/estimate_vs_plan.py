"""One model, three memory figures: jzero's closed form, jzero's plan, DeepSpeed's estimator.

Run: ``python benchmarks/estimate_vs_plan.py [--presets llama-2-7b,llama-3-70b]
[--devices 8,64] [--device-memory 80GB] [--seq-len 4096]`` (8 virtual CPU devices are set up
when no accelerator is present). For each Llama-shaped model and device count, every ZeRO
stage without offload side by side, in GiB (2^30 bytes) a device:

* ``estimate``: :func:`jzero.memory.estimate` of the preset's shape (``jzero estimate
  --preset``): the model state (16-bit params, grads, fp32 masters and moments, the largest
  layer gathered at stage 3) and the total with the activations of one micro-batch of
  ``--seq-len`` tokens (blockwise attention, no dropout, no activation checkpointing);
* ``plan``: :func:`jzero.demo.plan.architecture_report` (``jzero plan --preset``) of the
  Llama-shaped model: its model state from the plan of the device count (on an abstract mesh
  when the machine has fewer devices), and the compiled step's peak, measured on the local
  devices (so on more devices than the machine has, the compiled part is the local count's and
  labelled so);
* ``DeepSpeed``: its ``estimate_zero2_model_states_mem_needs`` (stages 1-2) and
  ``estimate_zero3_model_states_mem_needs`` (stage 3, ``zero_init``) figures, which DeepSpeed
  prints divided by 2^30 and labels GB.

Each block ends with the stage each one recommends for ``--device-memory``.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from jzero import costs, memory  # noqa: E402
from jzero.demo import plan  # noqa: E402

GIB = 2**30
TINY = costs.Architecture(256, 2, 4, 512, 4096, kv_heads=2)  # --tiny: the smoke run's


def _config(seq_len: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        # A 70B model's embedding is one leaf of 1.05e9 elements, gathered whole at stage 3.
        "zero_optimization": {"stage3_max_live_parameters": 2_000_000_000},
        "model": {"seq_len": seq_len},
    }


def _block(name: str, arch: costs.Architecture, n: int, args: argparse.Namespace) -> str:
    stages = tuple(int(s) for s in args.stages.split(","))
    layout = costs.ParallelDims(n, micro_batch=1)
    est = memory.estimate(arch.model_shape(args.seq_len), layout, args.device_memory, "none")
    rows = memory.StageRows(stages, offload=False)  # activation checkpointing where it can matter
    measured = plan.architecture_report(
        _config(args.seq_len), arch, n, args.device_memory, rows=rows
    )
    head = f"{'stage':>5}  {'estimate state':>14}  {'estimate total':>14}  {'plan state':>10}"
    head += f"  {'plan peak':>9}  {'DeepSpeed GB':>12}"
    lines = [
        f"{name}: {arch.params():,} parameters, {n} devices, {args.seq_len} tokens x 1 a "
        f"device; GiB a device (DeepSpeed: its figure / 2^30, which it labels GB)",
        head,
        "-" * len(head),
    ]
    for stage in stages:
        ours, row = est.row(stage), measured.row(stage)
        state = sum(row.device.values()) + row.gathered_layer
        peak = f"{row.peak / GIB:9.2f}" if row.measured else f"{'-':>9}"
        ds = ours.deepspeed
        lines.append(
            f"{stage:>5}  {ours.device_bytes / GIB:14.2f}  {ours.total_bytes() / GIB:14.2f}  "
            f"{state / GIB:10.2f}  {peak}  {(f'{ds[0] / GIB:.2f}' if ds else '-'):>12}"
        )
    local = measured.measured_devices
    where = f"plan state: the plan on {n} devices" + (
        ""
        if local is None or local == n
        else f"; plan peak: the step compiled on the local {local} devices, whose shards "
        f"are {n // local} times those of {n}"
    )
    lines.append(f"({where})")
    e_rec, p_rec = est.recommendation, measured.recommendation
    if e_rec is not None and p_rec is not None:
        lines.append(
            f"recommended for {args.device_memory}: estimate {_advice(e_rec)}, plan "
            f"{_advice(p_rec)}"
        )
        if (e_rec.stage, e_rec.fits) != (p_rec.stage, p_rec.fits):
            lines.append(
                "  they differ: the plan's peak adds the compiled step's temporaries, which the "
                "closed form does not count (at stages 0-1 the whole gradient, in 16 bits and "
                "in float32 before its reduction, at stage 2 one layer's; the update's; the "
                "SwiGLU MLP's and the float32 logits' activations beyond the formula's)"
            )
    return "\n".join(lines)


def _advice(rec: memory.Recommendation) -> str:
    if not rec.fits:
        return f"none fits (stage {rec.stage} is the smallest)"
    ac = " with activation checkpointing" if rec.checkpointing == "full" else ""
    return f"stage {rec.stage}{ac}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="llama-2-7b,llama-3-70b")
    ap.add_argument("--devices", default="8,64")
    ap.add_argument("--device-memory", default="80GB")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama-shaped model (smoke run)")
    args = ap.parse_args(argv)
    models = (
        [("tiny", TINY)]
        if args.tiny
        else [(name, costs.PRESETS[name]) for name in args.presets.split(",")]
    )
    for name, arch in models:
        for n in (int(d) for d in args.devices.split(",")):
            print(_block(name, arch, n, args))
            print()


if __name__ == "__main__":
    main()
