"""GPU check of lighter and hidden communication: ``overlap_comm`` and ZeRO++ qwZ / qgZ at stage 3.

Issue: "Lighter and hidden communication". Run on one accelerator machine through
``benchmarks/gpu_check.sh`` (section ``comm``), or directly: ``python benchmarks/gpu_comm.py``
(the built-in GPT at about 300 M parameters in bf16, ZeRO stage 3 on every device) or
``--smoke`` (a tiny GPT, 2 steps, seconds on 8 virtual CPU devices; the test suite runs it so
that the script cannot rot).

Per variant (``exact``: overlap_comm false, no quantization; ``overlap``: overlap_comm true;
``qwZ``; ``qgZ``; ``all``: the three together) it prints and writes to ``$OUT/gpu_comm.json``:

* ms/step (median of ``--steps`` after ``--warmup``, each step waited for in full), the ratio to
  ``exact``, tokens/s and MFU: model FLOPs per second (``6 N + 12 L d T`` a token, PaLM's
  estimate, as ``gpu_step_time.py``) over the devices' peak dense bf16 FLOP/s;
* compile seconds, the compiled step's temporaries (``memory_analysis``);
* collective bytes per step by kind (``jzero.hlo.collectives`` of the compiled step: a GPU
  keeps 16-bit and 8-bit collectives as they are);
* the asynchronous collectives XLA scheduled (``jzero.hlo.async_collectives``): how many, and
  how many of them have compute between their start and done (the communication hidden);
* the first and last loss (the data is learnable, so quantization that hurt would show).

Decisions:

* One process runs the variants in order, ``exact`` first (its step time is the reference):
  JAX starts once, which the 2-minute budget of this section needs. A variant that fails is
  reported and the next one runs; ``--time-budget`` (seconds, default 100) skips the variants
  not started in time, with a note. Peak device memory is therefore not per variant: the
  compiled temporaries are.
* On one device there is nothing to communicate (every gather and reduce-scatter spans one
  device and is dropped), so the variants can differ only by their overhead; the script says
  so. The speed-up of overlap and the bytes saved by quantization need two devices or more.
* ``--smoke`` lowers the CPU code generator's optimisation level and runs ``exact`` and
  ``all`` only: it checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# benchmarks/ is sys.path[0] when run as a script: the GPT's sizes, flags and FLOP model are
# the other GPU checks', so every check trains the same model.
from gpu_check import SMOKE_XLA_FLAGS, add_size_args, fill_sizes  # noqa: E402
from gpu_step_time import flops_per_token, peak_flops  # noqa: E402

MIB = 1 << 20
VARIANTS: dict[str, dict[str, Any]] = {
    "exact": {},
    "overlap": {"overlap_comm": True},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "all": {
        "overlap_comm": True,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
    },
}
SMOKE_VARIANTS = ("exact", "all")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_args(ap)
    ap.add_argument("--steps", type=int, help="timed steps (default 10, smoke 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 2, smoke 1)")
    ap.add_argument("--variants", help=f"comma-separated among {', '.join(VARIANTS)}")
    ap.add_argument(
        "--time-budget", type=float, default=100.0, help="seconds for all variants (default 100)"
    )
    ap.add_argument("--peak-flops", type=float, help="peak bf16 FLOP/s of one device")
    args = ap.parse_args(argv)
    fill_sizes(args)
    args.steps = args.steps or (2 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 2)
    names = args.variants.split(",") if args.variants else None
    names = names or list(SMOKE_VARIANTS if args.smoke else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose among {', '.join(VARIANTS)}")
    args.variants = names
    return args


def batches(num: int, rows: int, seq_len: int) -> list[dict[str, Any]]:
    """Learnable sequences (``next = 5 x + 3 mod 256`` from a random start)."""
    import numpy as np

    out = []
    for i in range(num):
        tokens = [np.random.default_rng(i).integers(0, 256, (rows, 1))]
        for _ in range(seq_len):
            tokens.append((tokens[-1] * 5 + 3) % 256)
        out.append({"tokens": np.concatenate(tokens, 1).astype(np.int32)})
    return out


def run_variant(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Compiles, times and reads one variant."""
    import math

    import jax
    import optax

    import jzero
    from jzero import hlo
    from jzero.demo import gpt

    n = jax.device_count()
    cfg = gpt.GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        num_layers=args.layers,
        num_heads=args.heads,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dtype="bfloat16",
    )
    config = {
        "train_batch_size": args.micro_batch * n,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            **VARIANTS[name],
        },
    }
    engine = jzero.initialize(
        lambda key: gpt.init_params(key, cfg),
        loss_fn=lambda p, b: gpt.loss_fn(p, b, cfg),
        optimizer=optax.adamw(1e-4),
        config=config,
    )
    data = [
        jax.device_put(b, engine.plan.batch)
        for b in batches(args.warmup + args.steps, args.micro_batch * n, args.seq_len)
    ]
    start = time.perf_counter()
    compiled = engine.lower(data[0]).compile()
    compile_seconds = time.perf_counter() - start
    coll = hlo.collectives(compiled)
    asynchronous = hlo.async_collectives(compiled)
    temp = compiled.memory_analysis().temp_size_in_bytes
    del compiled
    losses, times = [], []
    for i, batch in enumerate(data):
        start = time.perf_counter()
        metrics = engine.train_step(batch)
        jax.block_until_ready((metrics, engine.state))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    params = sum(math.prod(leaf.shape) for leaf in engine.plan.leaves)
    return {
        "variant": name,
        "status": "ok",
        "zero": VARIANTS[name],
        "params": params,
        "devices": n,
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "compile_seconds": compile_seconds,
        "step_seconds": times,
        "step_seconds_median": statistics.median(times),
        "tokens_per_step": args.micro_batch * n * args.seq_len,
        "collectives": {k: {"count": s.count, "bytes": s.bytes} for k, s in coll.items()},
        "async_collectives": len(asynchronous),
        "async_with_compute": sum(1 for a in asynchronous if a.compute > 0),
        "temp_bytes": temp,
        "losses": losses,
    }


def _row(r: dict[str, Any], base: dict[str, Any] | None) -> tuple[str, ...]:
    if r["status"] != "ok":
        return (r["variant"], r["status"], *("-" for _ in range(10)))
    t = r["step_seconds_median"]
    c = r["collectives"]
    mib = lambda kind: f"{c[kind]['bytes'] / MIB:.1f}"  # noqa: E731
    return (
        r["variant"],
        f"{t * 1e3:.1f}",
        f"{t / base['step_seconds_median']:.2f}" if base else "n/a",
        f"{r['tokens_per_second']:,.0f}",
        "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}",
        f"{r['compile_seconds']:.1f}",
        mib("all-gather"),
        mib("reduce-scatter"),
        mib("all-to-all"),
        f"{r['async_with_compute']}/{r['async_collectives']}",
        f"{r['temp_bytes'] / MIB:.1f}",
        f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}",
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    import jax

    start = time.monotonic()
    n = jax.device_count()
    print(
        f"jzero comm check: GPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"seq {args.seq_len}, micro-batch {args.micro_batch} a device, bf16, ZeRO stage 3 on "
        f"{n} x {jax.devices()[0].device_kind}; variants {', '.join(args.variants)}; time "
        f"budget {args.time_budget:.0f} s",
        flush=True,
    )
    if n == 1:
        print(
            "note: one device: every gather and reduce-scatter spans one device and is dropped, "
            "so the variants differ only by their overhead (overlap and quantization need two "
            "devices or more to save anything)",
            flush=True,
        )
    results: list[dict[str, Any]] = []
    for name in args.variants:
        if time.monotonic() - start > args.time_budget:
            results.append({"variant": name, "status": "skipped", "note": "time budget spent"})
            continue
        try:
            r = run_variant(args, name)
        except Exception as e:  # a variant that fails is reported; the next one runs
            r = {"variant": name, "status": "failed", "note": f"{type(e).__name__}: {e}"[:500]}
        results.append(r)
        print(
            f"{name}: {r['step_seconds_median'] * 1e3:.1f} ms/step, compile "
            f"{r['compile_seconds']:.1f} s, losses {r['losses']}"
            if r["status"] == "ok"
            else f"{name}: {r['status']}: {r['note']}",
            flush=True,
        )
    ok = [r for r in results if r["status"] == "ok"]
    peak = args.peak_flops or (peak_flops(ok[0]["device_kind"]) if ok else None)
    for r in ok:
        r["flops_per_token"] = flops_per_token(r["params"], args.layers, args.d_model, args.seq_len)
        r["tokens_per_second"] = r["tokens_per_step"] / r["step_seconds_median"]
        flops = r["tokens_per_second"] * r["flops_per_token"]
        r["mfu"] = None if peak is None else flops / (peak * r["devices"])
    base = next((r for r in ok if r["variant"] == "exact"), None)
    cols = ("variant", "ms/step", "vs exact", "tokens/s", "MFU", "compile s", "AG MiB",
            "RS MiB", "A2A MiB", "async", "temp MiB", "loss")  # fmt: skip
    rows = [cols] + [_row(r, base) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    if ok:
        print(
            f"\n{ok[0]['params']:,} parameters; {ok[0]['flops_per_token'] / 1e9:.3g} GFLOP a "
            f"token; peak bf16 FLOP/s a device: "
            + ("unknown (MFU n/a)" if peak is None else f"{peak:.3g}")
        )
    print(
        "ms/step: median; AG/RS/A2A MiB: all-gather, reduce-scatter, all-to-all bytes a step "
        "(compiled step); async: asynchronous collectives with compute between start and done "
        "/ all asynchronous ones (0/0 on CPU, where collectives are synchronous)"
    )
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out:
        summary = {"args": vars(args), "peak_flops_per_device": peak, "variants": results}
        (Path(out) / "gpu_comm.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {Path(out) / 'gpu_comm.json'}")
    return 0 if ok and all(r["status"] != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
