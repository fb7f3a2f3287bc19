"""Expert parallelism (``expert_parallel.autoep_size: E_p``) on the built-in MoE GPT: memory
and communication per device, step time, and the loss after training, for E_p in 1, 2, 4, 8 at
ZeRO stages 1 and 3, against the dense GPT with the same active parameters.

Run: ``python benchmarks/moe.py`` (8 virtual CPU devices are set up when no accelerator is
present; ``--smoke`` for a tiny GPT, E_p in 1 and 2, stage 1, unless ``--ep`` or ``--stages``
say otherwise, a few steps). E_p = 1 is plain
ZeRO on ``{data: N}`` with every expert on every device; E_p > 1 builds ``{data: N/E_p,
expert: E_p}``: each device holds ``E / E_p`` experts of every MoE layer, ZeRO shards them over
``data`` only and every dense leaf over ``data`` x ``expert``, and tokens reach their experts'
devices by one all-to-all and come back by another.

Each row of the table is one (E_p, stage), the same global batch and data for all:

* expert / dense MiB: per-device bytes of the model state (params, gradients, optimizer state,
  master weights) of the expert leaves and of the others, from the shards the engine holds
  (gradients from the plan's gradient layout);
* all-to-all MiB: full-buffer bytes a step of the all-to-alls within the expert groups, read
  from the compiled program (``jzero.hlo.collectives_by_axes``); ZeRO MiB: every collective
  over ``data`` or ``data`` x ``expert``;
* ms/step: the median of ``--steps`` timed steps after ``--warmup`` untimed ones;
* loss: the loss after ``--train`` steps on the standard library's bytes (``jzero.demo.data``),
  with the aux loss and the dropped fraction of the last step. Every E_p and stage computes the
  same model: their losses agree to float32 rounding.

The last line trains the dense GPT whose MLP width is ``experts_per_token x d_ff``: each token
then uses as many MLP parameters as in the MoE model, which holds ``E / k`` times as many.

The second table scales the tokens each device routes (the global batch times 1, 4, 16, at
``--scale-ep``, stage 1) with a capacity (``capacity_factor`` 1.25) and dropless
(``model.drop_tokens: false``): the compiled step's temporaries
(``memory_analysis().temp_size_in_bytes``), the all-to-all bytes, the dropped fraction of
choices (the last of the cell's steps) and the step time. Dispatch by sorting keeps the
temporaries linear in the tokens (dense one-hot masks grew with their square).

The third table is why the experts run on padded rows rather than ``jax.lax.ragged_dot``: the
experts' GELU MLP, forward and backward (``jax.grad``), on one device's tokens at each scale:
``[E, N, d]`` padded buffers through einsums (``N`` the capacity, or ``T`` dropless) against
``ragged_dot`` on the ``k T`` sorted rows (compiled temporaries, median time).

On one CPU host the devices share its cores, so the all-to-alls add work without adding
compute: the step time is not expected to improve there. The tables' point is bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402
from jzero import moe  # noqa: E402
from jzero.demo import data, gpt  # noqa: E402
from jzero.hlo import collectives_by_axes  # noqa: E402

MB = 1 << 20


def _bytes(x, sharding=None) -> int:
    sharding = x.sharding if sharding is None else sharding
    return int(np.prod(sharding.shard_shape(tuple(x.shape)))) * np.dtype(x.dtype).itemsize


def state_bytes(engine) -> tuple[int, int]:
    """Per-device model-state bytes of the expert leaves and of the dense ones."""
    totals = [0, 0]
    state = engine.state
    for tree in (state.params, state.opt_state, state.master):
        leaves = jax.tree.leaves(tree)
        for x, is_expert in zip(leaves, moe.expert_leaves(tree), strict=True):
            if hasattr(x, "sharding"):
                totals[0 if is_expert else 1] += _bytes(x)
    grads = jax.tree.leaves(engine.plan.grads)
    named = moe.expert_leaves(engine.plan.abstract_params)  # at E_p = 1 too
    for x, sh, e in zip(engine.plan.leaves, grads, named, strict=True):
        dtype = engine.plan.options.precision.compute_dtype or x.dtype
        size = int(np.prod(sh.shard_shape(tuple(x.stored_shape())))) * np.dtype(dtype).itemsize
        totals[0 if e else 1] += size
    return totals[0], totals[1]


def train(
    cfg, ep: int, stage: int, tokens, args, timed: bool, batch: int = 0, steps: int = 0
) -> dict:
    """One (E_p, stage): bytes, collectives, temporaries, step time, and the loss after
    ``steps`` (default ``--train``) steps of ``batch`` rows (default ``--batch``)."""
    batch, steps = batch or args.batch, steps or args.train
    config = {
        "train_batch_size": batch,
        "zero_optimization": {"stage": stage},
        "model": {"num_experts": cfg.num_experts},
    }
    if ep > 1:
        config["expert_parallel"] = {"autoep_size": ep}
    params = gpt.init_params(jax.random.key(0), cfg)
    engine = jzero.initialize(
        params, lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(3e-3), config
    )
    it = data.BatchIterator(tokens, batch, cfg.seq_len, seed=0)
    out = {"E_p": ep, "stage": stage, "mesh": dict(engine.mesh.shape)}
    if timed:
        compiled = engine.lower(it.next()).compile()
        out["temp"] = compiled.memory_analysis().temp_size_in_bytes
        by_axes = collectives_by_axes(compiled, engine.mesh)
        out["a2a"] = sum(s["all-to-all"].bytes for a, s in by_axes.items() if a == ("expert",))
        zero = {("data",), ("data", "expert"), ("expert", "data")}
        out["zero"] = sum(sum(k.bytes for k in s.values()) for a, s in by_axes.items() if a in zero)
        out["expert"], out["dense"] = state_bytes(engine)
        it = data.BatchIterator(tokens, batch, cfg.seq_len, seed=0)
    times, metrics = [], {}
    for step in range(steps):
        t = time.perf_counter()
        metrics = engine.train_step(it.next())
        jax.block_until_ready(metrics["loss"])
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
    out["seconds"] = float(np.median(times)) if times else float("nan")
    out["loss"] = float(metrics["loss"])
    out["aux"] = float(metrics.get("moe_aux_loss", float("nan")))
    out["dropped"] = float(metrics.get("moe_dropped_fraction", float("nan")))
    return out


def scaling(cfg, tokens, args) -> None:
    """The second table: tokens per device x {capacity, dropless}."""
    n = jax.device_count()
    print()
    print(
        f"Tokens per device (E_p {args.scale_ep}, stage 1, capacity factor "
        f"{cfg.capacity_factor}; {args.scale_steps} steps a cell, the first "
        f"{args.warmup} untimed)"
    )
    print()
    head = "| tokens/device | mode | temp MiB | x 1x | all-to-all MiB | dropped | ms/step |"
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for mode, drop in (("capacity", True), ("dropless", False)):
        first = None
        for scale in args.scales:
            rows = args.batch * scale
            c = dataclasses.replace(cfg, drop_tokens=drop)
            r = train(c, args.scale_ep, 1, tokens, args, True, rows, args.scale_steps)
            first = first or r["temp"]
            print(
                f"| {rows * cfg.seq_len // n} | {mode} | {r['temp'] / MB:.2f} | "
                f"{r['temp'] / first:.2f} | {r['a2a'] / MB:.3f} | {r['dropped']:.3f} | "
                f"{r['seconds'] * 1e3:.1f} |",
                flush=True,
            )


def grouped(args) -> None:
    """The third table: the experts' MLP on padded rows (einsums) against ragged_dot."""
    e, k, d, f = args.experts, args.top_k, args.d_model, args.d_ff
    base = args.batch * args.seq_len // jax.device_count()
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.normal(size=(e, d, f)) * d**-0.5, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(e, f, d)) * f**-0.5, jnp.float32)

    def padded(w1, w2, x):  # [E, N, d]
        return jnp.einsum("enf,efd->end", jax.nn.gelu(jnp.einsum("end,edf->enf", x, w1)), w2)

    def ragged(w1, w2, x, sizes):  # [k T, d], sorted by expert
        return jax.lax.ragged_dot(jax.nn.gelu(jax.lax.ragged_dot(x, w1, sizes)), w2, sizes)

    def measure(fn, *args_):
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))
        compiled = grad.lower(*args_).compile()
        jax.block_until_ready(compiled(*args_))
        times = []
        for _ in range(args.scale_steps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args_))
            times.append(time.perf_counter() - t)
        return compiled.memory_analysis().temp_size_in_bytes, float(np.median(times))

    print()
    print(
        f"Experts' MLP, forward and backward, one device's tokens ({e} experts, top-{k}, "
        f"d {d}, d_ff {f}, float32): padded rows against jax.lax.ragged_dot"
    )
    print()
    head = "| tokens | form | rows | temp MiB | ms |"
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for scale in args.scales:
        t = base * scale
        sizes = jnp.full((e,), k * t // e, jnp.int32).at[0].add(k * t % e)
        cells = [
            ("padded, capacity 1.25", padded, e * moe.expert_rows(t, e, k, 1.25), ()),
            ("padded, dropless", padded, e * t, ()),
            ("ragged_dot", ragged, k * t, (sizes,)),
        ]
        for name, fn, rows, extra in cells:
            shape = (rows, d) if fn is ragged else (e, rows // e, d)
            temp, sec = measure(fn, w1, w2, jnp.ones(shape, jnp.float32), *extra)
            print(f"| {t} | {name} | {rows} | {temp / MB:.2f} | {sec * 1e3:.1f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=256, help="each expert's MLP width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    ap.add_argument("--ep", help="comma-separated autoep_size values (default 1,2,4,8, smoke 1,2)")
    ap.add_argument("--stages", help="comma-separated ZeRO stages (default 1,3, smoke 1)")
    ap.add_argument("--train", type=int, default=30, help="training steps per cell")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    ap.add_argument("--scales", help="tokens-per-device multiples (default 1,4,16, smoke 1,4)")
    ap.add_argument("--scale-ep", type=int, default=2, help="E_p of the tokens-per-device table")
    ap.add_argument("--scale-steps", type=int, default=6, help="steps per tokens-per-device cell")
    ap.add_argument("--tables", default="ep,tokens,grouped", help="which tables to print")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT, E_p in 1,2, stage 1")
    args = ap.parse_args(argv)
    if args.smoke:  # the sizes; --ep and --stages where given win
        args.layers, args.d_model, args.heads, args.d_ff, args.experts = 2, 32, 2, 32, 4
        args.seq_len, args.batch = 16, 8
        args.train, args.warmup, args.scale_steps = 3, 1, 2
    args.ep = args.ep or ("1,2" if args.smoke else "1,2,4,8")
    args.stages = args.stages or ("1" if args.smoke else "1,3")
    args.scales = [int(x) for x in (args.scales or ("1,4" if args.smoke else "1,4,16")).split(",")]
    tables = set(args.tables.split(","))
    eps = [int(e) for e in args.ep.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    shape = dict(
        vocab_size=256,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
    )
    cfg = gpt.GPTConfig(
        **shape, d_ff=args.d_ff, num_experts=args.experts, experts_per_token=args.top_k
    )
    dense = gpt.GPTConfig(**shape, d_ff=args.top_k * args.d_ff)
    tokens = data.load_tokens("stdlib", max_bytes=2 * 1024 * 1024)
    count = lambda c: sum(x.size for x in jax.tree.leaves(jax.eval_shape(  # noqa: E731
        lambda: gpt.init_params(jax.random.key(0), c))))  # fmt: skip
    n = jax.device_count()
    print(
        f"MoE GPT: {args.layers} layers, d_model {args.d_model}, {args.experts} experts of d_ff "
        f"{args.d_ff}, top-{args.top_k}, {count(cfg):,} parameters; dense twin d_ff "
        f"{args.top_k * args.d_ff}, {count(dense):,} parameters; {n} "
        f"{jax.devices()[0].platform} devices, global batch {args.batch} x {args.seq_len} "
        f"tokens, AdamW 3e-3, {args.train} steps on the stdlib corpus"
    )
    if "ep" in tables:
        by_ep(cfg, dense, tokens, eps, stages, args)
    if "tokens" in tables:
        scaling(cfg, tokens, args)
    if "grouped" in tables:
        grouped(args)


def by_ep(cfg, dense, tokens, eps, stages, args) -> None:
    """The first table: per E_p and stage, and the dense twin."""
    print()
    head = (
        "| E_p | stage | mesh | expert MiB | dense MiB | all-to-all MiB | ZeRO MiB | ms/step "
        "| loss | aux | dropped |"
    )
    print(head)
    print("|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|")
    for stage in stages:
        for ep in eps:
            r = train(cfg, ep, stage, tokens, args, timed=True)
            mesh = "{" + ", ".join(f"{k}: {v}" for k, v in r["mesh"].items()) + "}"
            print(
                f"| {ep} | {stage} | {mesh} | {r['expert'] / MB:.3f} | {r['dense'] / MB:.3f} | "
                f"{r['a2a'] / MB:.3f} | {r['zero'] / MB:.3f} | {r['seconds'] * 1e3:.1f} | "
                f"{r['loss']:.4f} | {r['aux']:.4f} | {r['dropped']:.3f} |",
                flush=True,
            )
    d = train(dense, 1, stages[0], tokens, args, timed=False)
    print()
    print(
        f"dense twin (d_ff {args.top_k * args.d_ff}, stage {stages[0]}): loss {d['loss']:.4f} "
        f"after {args.train} steps, {d['seconds'] * 1e3:.1f} ms/step"
    )


if __name__ == "__main__":
    main()
