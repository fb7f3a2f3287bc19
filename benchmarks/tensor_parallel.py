"""AutoTP (``tensor_parallel.autotp_size: T``) and Ulysses (``sequence_parallel_size: S``) on
the built-in GPT: memory and communication per device, and step time, for T in 1, 2, 4 and S in
1, 2, 4 at ZeRO stages 1 and 3.

Run: ``python benchmarks/tensor_parallel.py`` (8 virtual CPU devices are set up when no
accelerator is present; ``--smoke`` for a tiny GPT, T in 1 and 2 and S = 2, stage 1, one timed
step, unless ``--tp``, ``--sp`` or ``--stages`` say otherwise).
T = 1 is plain ZeRO on ``{data: N}``; T > 1 builds the mesh ``{data: N/T, model: T}`` and splits
every parameter over ``model`` Megatron-style (column-parallel q/k/v and MLP-in, row-parallel
attention-out and MLP-out, the embedding by vocabulary rows), ZeRO sharding over ``data``.
S > 1 (at T = 1) builds ``{data: N/S, seq: S}``: each ``seq`` group shares its rows and splits
their tokens, ZeRO sharding over ``data`` x ``seq``.

The global batch is the same for every T (``--batch`` rows of ``--seq-len`` tokens), as
DeepSpeed and Megatron-LM keep it: at T = 2 half as many data-parallel groups each take twice
the rows. Each row of the table is one (T, stage):

* model state: per-device bytes of params, gradients and optimizer state,
  the sum of ``model_state_bytes(engine.plan)``, and its ratio to T = 1 at the same stage;
* temp: the compiled step's temporaries per device,
  ``engine.lower(batch).compile().memory_analysis().temp_size_in_bytes``;
* ZeRO / model / seq / other: full-buffer bytes a step of the collectives whose device groups
  span ZeRO's axes (``data``, or ``data`` x ``seq``), the ``model`` axis only, the ``seq`` axis
  only (Ulysses's all-to-alls), and any other combination (``data`` x ``model``: scalars),
  read from the compiled program (``jzero.hlo.collectives_by_axes``; loops counted by trip
  count);
* ms/step: the median of ``--steps`` timed steps after ``--warmup`` untimed ones.

With every parameter split over ``model``, ZeRO's gradient and parameter collectives over
``data`` need only each device's model shard (1/T of the model's bytes); the data column shows
what the compiled step moves. ``--bf16`` runs the GPT in bfloat16 with fp32 master weights
(``bf16: {enabled: true}``), as the GPU checks do; ``--json PATH`` also writes the rows there
(``benchmarks/gpu_check.sh`` runs T = 1 against T = 2 on a machine with several GPUs).

On one CPU host the devices share its cores, so tensor parallelism adds collectives without
adding compute: its step time is not expected to improve there. The table's point is bytes.
"""

from __future__ import annotations

import argparse
import json
import os
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
from jzero.hlo import collectives_by_axes  # noqa: E402
from jzero.plan import model_state_bytes  # noqa: E402

MB = 1 << 20
KB = 1 << 10


def axis_bytes(by_axes: dict, axes: tuple[str, ...]) -> int:
    """Full-buffer bytes a step of every collective kind whose groups span exactly ``axes``."""
    return sum(s.bytes for s in by_axes.get(axes, {}).values())


def compiled_and_timed(engine, batch, steps: int, warmup: int) -> tuple:
    """The engine's compiled step, its collectives by mesh axes, and the median seconds of
    ``steps`` timed steps after ``warmup`` untimed ones."""
    compiled = engine.lower(batch).compile()
    by_axes = collectives_by_axes(compiled, engine.mesh)
    for _ in range(warmup):
        jax.block_until_ready(engine.train_step(batch)["loss"])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(engine.train_step(batch)["loss"])
        times.append(time.perf_counter() - t)
    return compiled, by_axes, float(np.median(times))


def measure(
    params,
    loss,
    batch,
    tp: int,
    stage: int,
    steps: int,
    warmup: int,
    bf16: bool = False,
    sp: int = 1,
) -> dict:
    """One (T, S, stage) cell: model-state and temp bytes per device, collective bytes by mesh
    axes, median step seconds."""
    config = {
        "train_batch_size": batch["tokens"].shape[0],
        "zero_optimization": {"stage": stage},
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if sp > 1:
        config["sequence_parallel_size"] = sp
    engine = jzero.initialize(params, loss, optax.adamw(1e-3), config)
    compiled, by_axes, seconds = compiled_and_timed(engine, batch, steps, warmup)
    zero = engine.plan.zero_axes
    named = {zero, ("model",), ("seq",)}
    return {
        "T": tp,
        "S": sp,
        "stage": stage,
        "mesh": dict(engine.mesh.shape),
        "state": sum(model_state_bytes(engine.plan).values()),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "zero": axis_bytes(by_axes, zero),
        "model": axis_bytes(by_axes, ("model",)),
        "seq": axis_bytes(by_axes, ("seq",)),
        "other": sum(axis_bytes(by_axes, a) for a in by_axes if a not in named),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, help="MLP width (default 4 x d_model)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows), the same for all T")
    ap.add_argument(
        "--micro-batch", type=int, help="rows per device at T = 1: sets --batch to this x devices"
    )
    ap.add_argument("--bf16", action="store_true", help="bfloat16 compute, fp32 master weights")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--tp", help="comma-separated autotp_size values (default 1,2,4, smoke 1,2)")
    ap.add_argument(
        "--sp",
        help="comma-separated sequence_parallel_size values run at T = 1 (default 2,4, smoke 2)",
    )
    ap.add_argument("--stages", help="comma-separated ZeRO stages (default 1,3, smoke 1)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per cell")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT, T in 1,2, stage 1, 1 step")
    args = ap.parse_args(argv)
    if args.smoke:  # the sizes; --tp, --sp and --stages where given win
        args.layers, args.d_model, args.heads, args.d_ff = 2, 32, 4, 64
        args.seq_len, args.vocab, args.batch, args.micro_batch = 16, 64, 8, None
        args.steps, args.warmup = 1, 1
    defaults = ("1,2", "2", "1") if args.smoke else ("1,2,4", "2,4", "1,3")
    for key, default in zip(("tp", "sp", "stages"), defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.d_ff is None:
        args.d_ff = 4 * args.d_model
    n = jax.device_count()
    if args.micro_batch is not None:
        args.batch = args.micro_batch * n
    tps = [int(t) for t in args.tp.split(",")]
    sps = [int(s) for s in args.sp.split(",") if s and int(s) > 1]
    stages = [int(s) for s in args.stages.split(",")]

    cfg = gpt.GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        d_ff=args.d_ff,
        dtype="bfloat16" if args.bf16 else "float32",
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    loss = lambda p, b: gpt.loss_fn(p, b, cfg)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, args.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)}
    psi = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, d_ff {args.d_ff}, "
        f"{psi:,} parameters, {n} {jax.devices()[0].platform} devices, global batch "
        f"{args.batch} x {args.seq_len} tokens (the same for every T), AdamW, "
        f"{'bf16 compute' if args.bf16 else 'fp32'}"
    )
    print()
    head = (
        "| T | S | stage | mesh | model state MiB | vs T=S=1 | temp MiB | ZeRO MiB | model MiB "
        "| seq MiB | other KiB | ms/step |"
    )
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    base, rows = {}, []
    for stage in stages:
        for tp, sp in [(t, 1) for t in tps] + [(1, s) for s in sps]:
            r = measure(params, loss, batch, tp, stage, args.steps, args.warmup, args.bf16, sp)
            rows.append(r)
            base.setdefault(stage, r["state"] if tp == sp == 1 else None)
            ratio = f"{r['state'] / base[stage]:.2f}" if base[stage] else "-"
            mesh = "{" + ", ".join(f"{k}: {v}" for k, v in r["mesh"].items()) + "}"
            print(
                f"| {tp} | {sp} | {stage} | {mesh} | {r['state'] / MB:.2f} | {ratio} | "
                f"{r['temp'] / MB:.2f} | {r['zero'] / MB:.2f} | {r['model'] / MB:.2f} | "
                f"{r['seq'] / MB:.2f} | {r['other'] / KB:.2f} | {r['seconds'] * 1e3:.1f} |",
                flush=True,
            )
            if args.json:  # rewritten after each row, so a run cut short keeps its rows
                with open(args.json, "w") as f:
                    json.dump({"model": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
