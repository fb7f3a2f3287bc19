"""Side by side: what each communication option does to a ZeRO step's collectives, and to training.

For every stage and variant (exact; ``overlap_comm`` with buckets; ZeRO++ qwZ and qgZ) the
built-in GPT is trained ``--steps`` steps on 8 devices (virtual CPU devices, or a GPU
machine's), and two tables are printed:

* collective bytes per step, per kind and element type (``f32``, ``bf16``, ``s8`` for the
  quantized payload with its scales), with the number of collectives, read from the step's
  program after SPMD partitioning (:func:`jzero.hlo.program_text`, where 16-bit collectives
  still show as 16-bit on CPU);
* the loss after the last step, beside the stage's exact run.

Run: ``python benchmarks/comm.py`` (4 layers of d_model 128, 50 steps, float32; ``--bf16`` for
bf16 compute; ``--stages 2,3``), or ``--smoke`` (stage 2 exact and qgZ, stage 3 exact and qwZ,
3 steps, a tiny GPT: the test suite runs it so that the script cannot rot). Results go to
``$OUT/comm.json`` when ``OUT`` is set.

Decisions:

* The data is learnable (each sequence follows ``next = 5 x + 3 mod 256`` from a random
  start), so the loss falls far within 50 steps and a quantization error that hurt training
  would show in the loss table; random tokens would leave every variant at ``ln 256``.
* The buckets variant sets ``reduce_bucket_size`` and ``allgather_bucket_size`` to a quarter
  of the parameter count: about four reductions and gathers a step instead of one per leaf.
* ``--smoke`` reads the compiled step's own program instead of a second compile (the same
  element types in float32, where the CPU compiler widens nothing) and lowers the CPU code
  generator's optimisation level: it checks that the script runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# benchmarks/ is sys.path[0] when run as a script: --smoke compiles as the GPU checks' do.
from gpu_check import SMOKE_XLA_FLAGS  # noqa: E402

MIB = 1 << 20
KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
# Per stage, the variants and their zero_optimization keys ("quarter": a quarter of the params).
VARIANTS: dict[int, dict[str, dict[str, Any]]] = {
    1: {
        "exact": {},
        "buckets": {"overlap_comm": True, "reduce_bucket_size": "quarter",
                    "allgather_bucket_size": "quarter"},
        "qgZ": {"zero_quantized_gradients": True},
    },
    2: {
        "exact": {},
        "buckets": {"overlap_comm": True, "reduce_bucket_size": "quarter",
                    "allgather_bucket_size": "quarter"},
        "qgZ": {"zero_quantized_gradients": True},
        "qgZ-int4": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4},
    },
    3: {
        "exact": {},
        "overlap": {"overlap_comm": True},
        "qwZ": {"zero_quantized_weights": True},
        "qgZ": {"zero_quantized_gradients": True},
        "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    },
}  # fmt: skip
SMOKE_VARIANTS = {2: ("exact", "qgZ"), 3: ("exact", "qwZ")}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2 stages, 3 steps, a tiny GPT")
    ap.add_argument("--stages", default=None, help="comma-separated stages (default 1,2,3)")
    ap.add_argument("--steps", type=int, help="training steps (default 50, smoke 3)")
    ap.add_argument("--layers", type=int, help="GPT layers (default 4, smoke 2)")
    ap.add_argument("--d-model", type=int, help="GPT width (default 128, smoke 32)")
    ap.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 master weights)")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.smoke else 50)
    args.layers = args.layers or (2 if args.smoke else 4)
    args.d_model = args.d_model or (32 if args.smoke else 128)
    args.stages = [int(s) for s in (args.stages or ("2,3" if args.smoke else "1,2,3")).split(",")]
    return args


def batches(num: int, batch: int, seq_len: int) -> list[dict[str, Any]]:
    """Learnable sequences: ``next = 5 x + 3 mod 256`` from a random start."""
    import numpy as np

    out = []
    for i in range(num):
        tokens = [np.random.default_rng(i).integers(0, 256, (batch, 1))]
        for _ in range(seq_len):
            tokens.append((tokens[-1] * 5 + 3) % 256)
        out.append({"tokens": np.concatenate(tokens, 1).astype(np.int32)})
    return out


def run_variant(args: argparse.Namespace, stage: int, zero: dict[str, Any]) -> dict[str, Any]:
    """Trains one variant; returns its losses and per-kind, per-dtype collective bytes."""
    import jax
    import optax

    import jzero
    from jzero import hlo
    from jzero.config import JzeroConfigWarning
    from jzero.demo import gpt

    cfg = gpt.GPTConfig(
        seq_len=16,
        num_layers=args.layers,
        num_heads=2,
        d_model=args.d_model,
        d_ff=4 * args.d_model,
        dtype="bfloat16" if args.bf16 else "float32",
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    numel = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    zero = {k: (numel // 4 if v == "quarter" else v) for k, v in zero.items()}
    config = {
        "train_batch_size": args.batch,
        "bf16": {"enabled": args.bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JzeroConfigWarning)
        engine = jzero.initialize(
            params, functools.partial(gpt.loss_fn, cfg=cfg), optax.adam(3e-3), config
        )
    data = batches(args.steps, args.batch, cfg.seq_len)
    start = time.perf_counter()
    losses = [float(engine.train_step(b)["loss"]) for b in data]
    seconds = time.perf_counter() - start
    lowered = engine.lower(data[0])
    text = lowered.compile().as_text() if args.smoke else hlo.program_text(lowered)
    by_dtype = hlo.collectives_by_dtype(text)
    return {
        "stage": stage,
        "params": numel,
        "zero": zero,
        "losses": losses,
        "seconds": seconds,
        "bytes": {kind: {d: s.bytes for d, s in per.items()} for kind, per in by_dtype.items()},
        "counts": {kind: {d: s.count for d, s in per.items()} for kind, per in by_dtype.items()},
    }


def _cell(r: dict[str, Any], kind: str) -> str:
    per = r["bytes"].get(kind, {})
    if not per:
        return "-"
    return " + ".join(f"{d} {b / MIB:.3f} x{r['counts'][kind][d]}" for d, b in sorted(per.items()))


def _total(r: dict[str, Any]) -> int:
    return sum(b for kind in KINDS for b in r["bytes"].get(kind, {}).values())


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.smoke:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SMOKE_XLA_FLAGS}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ["JAX_PLATFORMS"] == "cpu" and "device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    import jax

    results: dict[tuple[int, str], dict[str, Any]] = {}
    for stage in args.stages:
        names = SMOKE_VARIANTS.get(stage, ()) if args.smoke else VARIANTS[stage]
        for name in names:
            results[(stage, name)] = run_variant(args, stage, VARIANTS[stage][name])
            r = results[(stage, name)]
            print(
                f"stage {stage} {name}: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, "
                f"{r['seconds']:.1f} s",
                flush=True,
            )
    first = next(iter(results.values()))
    print(
        f"\nbuilt-in GPT: {args.layers} layers, d_model {args.d_model}, {first['params']:,} "
        f"parameters, {'bf16' if args.bf16 else 'float32'}; {jax.device_count()} x "
        f"{jax.devices()[0].platform}; batch {args.batch} x 16 tokens"
    )
    print(
        "\ncollective bytes per step (MiB, per kind and element type, x the number of "
        "collectives; the program after SPMD partitioning"
        + (", here the compiled step" if args.smoke else "")
        + ")"
    )
    rows = [("stage", "variant", *KINDS, "total MiB", "vs exact")]
    for (stage, name), r in results.items():
        exact = results.get((stage, "exact"))
        ratio = _total(r) / _total(exact) if exact and _total(exact) else math.nan
        rows.append(
            (str(stage), name, *(_cell(r, k) for k in KINDS), f"{_total(r) / MIB:.3f}",
             f"{ratio:.3f}")
        )  # fmt: skip
    _print_table(rows)
    print(f"\nloss after {args.steps} steps (first step's loss, and the last beside exact)")
    rows = [("stage", "variant", "first", "last", "vs exact")]
    for (stage, name), r in results.items():
        exact = results.get((stage, "exact"))
        rel = r["losses"][-1] / exact["losses"][-1] - 1 if exact else math.nan
        rows.append(
            (str(stage), name, f"{r['losses'][0]:.4f}", f"{r['losses'][-1]:.4f}", f"{rel:+.2%}")
        )
    _print_table(rows)
    out = os.environ.get("OUT")
    if out:
        summary = {
            "args": vars(args),
            "bytes": [
                {"stage": s, "variant": n, **r["bytes"], "counts": r["counts"]}
                for (s, n), r in results.items()
            ],
            "losses": [
                {"stage": s, "variant": n, "losses": r["losses"]} for (s, n), r in results.items()
            ],
        }
        (Path(out) / "comm.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {Path(out) / 'comm.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
