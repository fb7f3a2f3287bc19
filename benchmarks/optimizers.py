"""Optimizer state at the frontier: AdamW with fp32, bf16 and 8-bit state, and Muon (with AdamW
for the leaves that are no matrix), at ZeRO stages 1 and 3 on the built-in GPT: per-device
optimizer-state bytes, collective bytes per step, step time, and the eval loss after the same
steps from the same start.

Run: ``python benchmarks/optimizers.py`` (8 virtual CPU devices are set up when no accelerator
is present; ``--smoke`` for a tiny GPT, stage 1, a few steps). The model, data, schedule and
AdamW settings are the demo's (``configs/zero2.yaml``: the standard library's bytes, 4 layers,
d_model 128, WarmupCosineLR), every run in bf16 mixed precision from the same initial
parameters and the same batches.

Each row is one (optimizer, stage):

* opt-state / master MiB: per-device bytes of the optimizer state and of the fp32 master
  weights, from the shards the engine holds;
* collectives MiB: the full-buffer bytes of every collective of one compiled step
  (``jzero.hlo.collectives``); all-to-all MiB: the part that is Muon's exchange (its matrices
  dealt out whole and their updates dealt back; zero for AdamW);
* ms/step: the median of the timed steps after ``--warmup`` untimed ones;
* eval loss: the mean loss on ``--eval-batches`` held-out batches after ``--steps`` steps.

The last lines put Muon's extra traffic (its step's collective bytes less AdamW's at the same
stage) against the ZeRO formula: stages 1-2 move 2 Psi of 16-bit parameter bytes a step (a
reduce-scatter and an all-gather), stage 3 3 Psi; Muon's own exchange is at most a gather in and
a scatter out of its matrices' float32 bytes (2 x 4/2 = 4 Psi_matrices in 16-bit units), none
where a device holds its matrices whole (a stack of layers the devices divide), and a group of
B equal matrices dealt over n devices moves ceil(B/n) x n of them.

On one CPU host the devices share its cores: step times show the arithmetic's cost (Newton-
Schulz's matmuls, the 8-bit code's quantisation), not a network's.
"""

from __future__ import annotations

import argparse
import os
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jzero  # noqa: E402
from jzero.demo import data, gpt  # noqa: E402
from jzero.hlo import collectives  # noqa: E402

MB = 1 << 20
ADAMW = {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1}
OPTIMIZERS = {
    "AdamW fp32 state": ({"type": "AdamW", "params": ADAMW}, {}),
    "AdamW bf16 state": ({"type": "AdamW", "params": ADAMW}, {"bf16_optimizer_states": True}),
    "AdamW 8-bit state": ({"type": "AdamW", "params": {**ADAMW, "state_bits": 8}}, {}),
    "Muon + AdamW": (
        {
            "type": "Muon",
            "params": {"lr": 0.02, "adam_lr": 3.0e-3, "momentum": 0.95, "weight_decay": 0.1},
        },
        {},
    ),
}


# Found, not fixed: this row's step aborts on XLA:CPU (a collective's rendezvous times out
# after 40 s, devices waiting in different collectives) for the default GPT; the tests' smaller
# models run it at stage 3.
def _shard_bytes(tree) -> int:
    return sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "sharding")
    )


def run(cfg, name: str, stage: int, tokens, args) -> dict:
    optimizer, bf16 = OPTIMIZERS[name]
    config = {
        "train_batch_size": args.batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True, **bf16},
        "optimizer": optimizer,
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": args.steps,
                "warmup_num_steps": max(1, args.steps // 5),
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        },
    }
    params = gpt.init_params(jax.random.key(0), cfg)
    engine = jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, cfg), config=config)
    train = data.BatchIterator(tokens, args.batch, cfg.seq_len, seed=0)
    held_out = data.BatchIterator(tokens, args.batch, cfg.seq_len, seed=1)
    evals = [held_out.next() for _ in range(args.eval_batches)]
    first = train.next()
    stats = collectives(engine.lower(first).compile())
    out = {
        "optimizer": name,
        "stage": stage,
        "opt": _shard_bytes(engine.state.opt_state),
        "master": _shard_bytes(engine.state.master),
        "coll": sum(s.bytes for s in stats.values()),
        "a2a": stats["all-to-all"].bytes,
    }
    times = []
    for step in range(args.steps):
        batch = first if step == 0 else train.next()
        t = time.perf_counter()
        jax.block_until_ready(engine.train_step(batch)["loss"])
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    out["seconds"] = float(np.median(times)) if times else float("nan")
    out["eval"] = float(np.mean([float(engine.evaluate(b)) for b in evals]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    ap.add_argument("--stages", default="1,3", help="comma-separated ZeRO stages")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated rows")
    ap.add_argument("--steps", type=int, default=60, help="training steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny GPT, stage 1, a few steps")
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.d_model, args.heads, args.d_ff, args.seq_len = 2, 32, 2, 64, 16
        args.batch, args.stages, args.steps, args.warmup, args.eval_batches = 8, "1", 3, 1, 1
    names = [n.strip() for n in args.optimizers.split(",")]
    cfg = gpt.GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        d_ff=args.d_ff,
    )
    tokens = data.load_tokens("stdlib", max_bytes=2 * 1024 * 1024)
    params = jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg))
    n = jax.device_count()
    print(
        f"GPT: {args.layers} layers, d_model {args.d_model}, d_ff {args.d_ff}, "
        f"{sum(x.size for x in jax.tree.leaves(params)):,} parameters; {n} "
        f"{jax.devices()[0].platform} devices, bf16, global batch {args.batch} x {args.seq_len} "
        f"tokens, {args.steps} steps on the stdlib corpus, eval on {args.eval_batches} "
        "held-out batches"
    )
    print()
    head = (
        "| optimizer | stage | opt-state MiB | master MiB | collectives MiB | all-to-all MiB "
        "| ms/step | eval loss |"
    )
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        for name in names:
            r = run(cfg, name, stage, tokens, args)
            rows.append(r)
            print(
                f"| {name} | {stage} | {r['opt'] / MB:.3f} | {r['master'] / MB:.3f} | "
                f"{r['coll'] / MB:.3f} | {r['a2a'] / MB:.3f} | {r['seconds'] * 1e3:.1f} | "
                f"{r['eval']:.4f} |",
                flush=True,
            )
    from jzero.optim.muon_optimizer import default_dimension_numbers

    matrices = sum(
        x.size
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if default_dimension_numbers(jax.tree_util.keystr(p), tuple(x.shape)) is not None
    )
    psi = sum(x.size for x in jax.tree.leaves(params)) * 2  # 16-bit parameter bytes
    print()
    print(
        f"Psi = {psi / MB:.3f} MiB of bf16 parameters; Muon's matrices hold "
        f"{matrices:,} of them ({4 * matrices / MB:.3f} MiB in float32)."
    )
    adamw = {r["stage"]: r for r in rows if r["optimizer"] == "AdamW fp32 state"}
    for r in rows:
        if r["optimizer"].startswith("Muon") and r["stage"] in adamw:
            extra = r["coll"] - adamw[r["stage"]]["coll"]
            print(
                f"stage {r['stage']}: Muon adds {extra / MB:.3f} MiB of collectives a step to "
                f"AdamW's {adamw[r['stage']]['coll'] / MB:.3f} (all-to-all {r['a2a'] / MB:.3f}): "
                f"{extra / (4 * matrices):.2f} x its matrices' fp32 bytes (a gather in and a "
                f"scatter out: 2), {extra / psi:.2f} Psi beside ZeRO's "
                f"{2 if r['stage'] < 3 else 3} Psi."
            )


if __name__ == "__main__":
    main()
