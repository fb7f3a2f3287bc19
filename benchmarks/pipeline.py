"""Pipeline parallelism (``pipeline.stages: P``) on the built-in GPT: for P in 1, 2, 4 and the
GPipe, 1F1B, interleaved 1F1B and zero-bubble schedules, step time, the bubble, per-device
model state and temporaries, and the bytes moved between stages.

Run: ``python benchmarks/pipeline.py`` (8 virtual CPU devices are set up when no accelerator is
present; ``--smoke`` for a tiny GPT, P in 1 and 2 unless ``--pipeline`` says otherwise, one
timed step). P = 1 is plain ZeRO on
``{data: N}``; P > 1 builds ``{pipe: P, data: N/P}``, splits the GPT's layer scan into P stages
of consecutive layers, and ZeRO shards each stage's state over its ``data`` group.

The global batch and the micro-batches are the same for every P (``--batch`` rows of
``--seq-len`` tokens in ``--micro`` micro-batches, ``gradient_accumulation_steps``), so each
row trains the same model on the same tokens. Each row of the table is one (P, schedule):

* bubble: the fraction of a stage's slots it idles, read from the schedule's table
  (``jzero.distributed.make_schedule``); GPipe's and 1F1B's is ``(P-1)/(M+P-1)``,
  interleaving's ``(P-1)/(MV+P-1)`` (a slot is a chunk's pass, ``1/V`` of a stage's);
* lockstep: the step's time from the table in forward passes of a whole stage, the slots run
  in lockstep as the compiled step runs them (each slot as long as its longest pass: a
  forward 1, a backward 2, zero-bubble's input- and weight-gradient passes 1 each), and the
  fraction of it a stage idles (``Schedule.step_time``, ``time_bubble``);
* model state: the sum of ``model_state_bytes(engine.plan)`` per device;
* temp: the compiled step's temporaries per device (``memory_analysis()``), where 1F1B keeps
  ``P`` micro-batches of saved activations and GPipe all ``M``;
* in flight: the micro-batches a stage holds saved activations of at once (``P`` under 1F1B
  and zero-bubble, ``M`` under GPipe, under interleaving the most chunks in flight over
  ``V``), read from the schedule's table;
* pipe: the full-buffer bytes a step of the collective-permutes between neighbouring stages
  (``jzero.hlo.collectives_by_axes``, loops counted by trip count, the schedule table's
  permute by how often the table runs each branch), and ZeRO: those of the collectives
  within the ``data`` groups;
* other pipe: the rest over ``pipe``: the loss's and the whole leaves' gradients summed over
  the stages, and under interleaving the all-to-all that moves each stage's chunks into place
  and their gradients back;
* sent/need: the most bytes one device sends by permute in a step
  (``jzero.hlo.permute_sends``) over what the schedule needs from it: each micro-batch's
  activations forward once and its gradient back once per stage boundary it has (one
  micro-batch's carry, ``2 M`` of them from an interior stage). 1.00 is the minimum;
* ms/step: the median of ``--steps`` timed steps after ``--warmup`` untimed ones.

On one CPU host the devices share its cores, so the stages cannot run at the same time: the
step time there measures the pipeline's overhead (every slot of the schedule runs on every
device, idle ones included), not its speed-up. ``--json PATH`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tensor_parallel import compiled_and_timed  # noqa: E402  (this folder's script)

import jzero  # noqa: E402
from jzero.demo import gpt  # noqa: E402
from jzero.hlo import permute_sends  # noqa: E402
from jzero.parallel import make_schedule  # noqa: E402
from jzero.plan import model_state_bytes  # noqa: E402

MB = 1 << 20


def axis_bytes(by_axes: dict, axes: tuple[str, ...], kind: str | None = None) -> int:
    """Full-buffer bytes a step of the collectives whose groups span exactly ``axes``."""
    stats = by_axes.get(axes, {})
    return sum(s.bytes for k, s in stats.items() if kind is None or k == kind)


def measure(params, loss, batch, stages, schedule, stage, micro, steps, warmup, bf16,
            virtual) -> dict:  # fmt: skip
    """One (P, schedule) cell."""
    virtual = virtual if schedule == "interleaved_1f1b" else 1
    config = {
        "train_batch_size": batch["tokens"].shape[0],
        "gradient_accumulation_steps": micro,
        "zero_optimization": {"stage": stage},
        "pipeline": {"stages": stages, "schedule": schedule}
        | ({"virtual_stages": virtual} if virtual > 1 else {}),
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    engine = jzero.initialize(params, loss, optax.adamw(1e-3), config)
    compiled, by_axes, seconds = compiled_and_timed(engine, batch, steps, warmup)
    table = make_schedule(schedule, stages, micro, virtual) if stages > 1 else None
    sent, need = 0.0, 0.0
    if table is not None:
        rows = batch["tokens"].shape[0] // micro // (jax.device_count() // stages)
        tokens = batch["tokens"].shape[1] - 1
        table_leaf = params["embed"]["tokens"]  # [V, D]: the carry is rows x tokens x D
        carry = rows * tokens * table_leaf.shape[1] * table_leaf.dtype.itemsize
        sends = permute_sends(compiled)
        sent = max(sends.values(), default=0)
        need = int(table.transfers.max()) * carry
    return {
        "P": stages,
        "schedule": schedule if stages > 1 else "-",
        "stage": stage,
        "mesh": dict(engine.mesh.shape),
        "bubble": table.bubble if table else 0.0,
        "lockstep": table.step_time if table else 3.0 * micro,
        "time_bubble": table.time_bubble if table else 0.0,
        "in_flight": table.slots / table.virtual if table else 1,
        "sent_over_need": sent / need if need else 0.0,
        "state": sum(model_state_bytes(engine.plan).values()),
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "pipe": axis_bytes(by_axes, ("pipe",), "collective-permute"),
        "moved": axis_bytes(by_axes, ("pipe",))
        - axis_bytes(by_axes, ("pipe",), "collective-permute"),
        "zero": axis_bytes(by_axes, ("data",)),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, help="layers (default 8; smoke: the largest P, >= 2)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="global batch (rows), the same for all P")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches M a step")
    ap.add_argument(
        "--micro-batch",
        type=int,
        help="rows per device per micro-batch at P = 1: sets --batch to this x devices x M",
    )
    ap.add_argument(
        "--pipeline", help="comma-separated pipeline.stages values (default 1,2,4, smoke 1,2)"
    )
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zero_bubble")
    ap.add_argument("--virtual", type=int, default=2, help="V, chunks per stage (interleaved)")
    ap.add_argument("--stage", type=int, default=1, help="the ZeRO stage")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 compute, fp32 master weights")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per cell")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per cell")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT, P in 1,2, 1 step")
    args = ap.parse_args(argv)
    if args.smoke:  # the sizes; --pipeline where given wins
        args.d_model, args.heads = 32, 4
        args.seq_len, args.vocab, args.batch, args.micro = 16, 64, 32, 4
        args.micro_batch = None
        args.steps, args.warmup = 1, 0
    if args.pipeline is None:
        args.pipeline = "1,2" if args.smoke else "1,2,4"
    if args.micro_batch is not None:
        args.batch = args.micro_batch * jax.device_count() * args.micro
    sizes = [int(p) for p in args.pipeline.split(",")]
    if args.layers is None:
        args.layers = max(2, *sizes) * args.virtual if args.smoke else 8
    schedules = args.schedules.split(",")
    cfg = gpt.GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dtype="bfloat16" if args.bf16 else "float32",
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    loss = lambda p, b: gpt.loss_fn(p, b, cfg)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, args.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)}
    psi = sum(x.size for x in jax.tree.leaves(params))
    n = jax.device_count()
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {psi:,} "
        f"parameters, {n} {jax.devices()[0].platform} devices, global batch {args.batch} x "
        f"{args.seq_len} tokens in M = {args.micro} micro-batches, ZeRO stage {args.stage}, "
        f"AdamW, {'bf16 compute' if args.bf16 else 'fp32'}"
    )
    print()
    head = (
        "| P | schedule | mesh | bubble | lockstep | lockstep bubble | in flight "
        "| model state MiB | temp MiB | pipe MiB | sent/need | other pipe MiB | ZeRO MiB "
        "| ms/step |"
    )
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    rows = []
    for p in sizes:
        for schedule in schedules if p > 1 else schedules[:1]:
            r = measure(params, loss, batch, p, schedule, args.stage, args.micro, args.steps,
                        args.warmup, args.bf16, args.virtual)  # fmt: skip
            rows.append(r)
            mesh = "{" + ", ".join(f"{k}: {v}" for k, v in r["mesh"].items()) + "}"
            print(
                f"| {p} | {r['schedule']} | {mesh} | {r['bubble']:.3f} | {r['lockstep']:g} | "
                f"{r['time_bubble']:.3f} | {r['in_flight']:g} | "
                f"{r['state'] / MB:.2f} | {r['temp'] / MB:.2f} | {r['pipe'] / MB:.2f} | "
                f"{r['sent_over_need']:.2f} | {r['moved'] / MB:.2f} | {r['zero'] / MB:.2f} | "
                f"{r['seconds'] * 1e3:.1f} |",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"model": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
