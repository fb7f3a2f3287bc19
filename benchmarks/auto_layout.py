"""Parallel sizes "auto": the layout the engine keeps, its measured step time, and the measured
times of the next two candidates in its rank order, over budgets and batch shapes.

Run: ``python benchmarks/auto_layout.py [--smoke]`` (8 virtual CPU devices are set up when
``XLA_FLAGS`` does not name a device count). For each case the built-in GPT (float32, AdamW,
``tensor_parallel.autotp_size``, ``sequence_parallel_size`` and ``zero_optimization.stage``
"auto") is built by ``jzero.initialize``; its first step chooses the layout (the candidates
compiled in the cost model's order, the first that fits ``device_memory`` kept). Then the kept
layout and the next two candidates that fit (in rank order) are each built with their sizes
written out and timed over ``--steps`` steps after one warm-up: a ranking is good where the
kept layout is at least as fast as the next ones. The budgets are fractions of the rank-first
candidate's own need, so that a tight one moves the choice.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402
from jzero._util import format_bytes  # noqa: E402
from jzero.demo import gpt  # noqa: E402
from jzero.engine import auto_layout  # noqa: E402


def _settings(rows: int, budget: Any, model: dict) -> dict:
    return {
        "train_batch_size": rows,
        "device_memory": budget,
        "zero_optimization": {"stage": "auto"},
        "tensor_parallel": {"autotp_size": "auto"},
        "sequence_parallel_size": "auto",
        "model": model,
    }


def _engine(cfg: gpt.GPTConfig, settings: dict) -> jzero.Engine:
    params = gpt.init_params(jax.random.key(0), cfg)
    return jzero.initialize(
        params, lambda p, b: gpt.loss_fn(p, b, cfg), optax.adamw(1e-3), settings
    )


def _batch(rows: int, cfg: gpt.GPTConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1), dtype=np.int32)}


def _timed(cfg: gpt.GPTConfig, row: auto_layout.Row, base: dict, steps: int) -> float:
    """Seconds a step of ``row``'s layout and stage, written out (no search), median."""
    settings = {k: v for k, v in base.items() if k != "device_memory"}
    lay = row.layout
    settings.update(
        zero_optimization={"stage": row.stage.stage},
        tensor_parallel={"autotp_size": lay.model},
        sequence_parallel_size=lay.seq,
        gradient_accumulation_steps=lay.micro_batches,
    )
    if row.stage.offload:
        settings["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if row.stage.checkpointing:
        settings["activation_checkpointing"] = {"policy": "full"}
    e = _engine(cfg, settings)
    batch = _batch(base["train_batch_size"], cfg)
    jax.block_until_ready(e.train_step(batch)["loss"])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(e.train_step(batch)["loss"])
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run_case(cfg: gpt.GPTConfig, rows: int, fraction: float, steps: int, after: int = 2) -> str:
    """One table line: the batch, budget, layout kept and the measured times of it and of the
    ``after`` candidates that fit after it."""
    model = {"seq_len": cfg.seq_len, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads}
    probe = _engine(cfg, _settings(rows, "1TB", model))
    auto, batch = probe.auto_layout, _batch(rows, cfg)
    ranked = auto_layout.ranked_table(auto, probe.setup, batch, measure=False)
    first = auto_layout.measure_row(auto, probe.setup, batch, ranked[0])
    budget = int(first.need * fraction)
    fits = []
    for row in [first, *ranked[1:]]:  # in rank order, until the kept one and two more fit
        row = (
            row if row.need is not None else auto_layout.measure_row(auto, probe.setup, batch, row)
        )
        if row.need is not None and row.need <= budget:
            fits.append(row)
        if len(fits) == 1 + after:
            break
    head = f"{rows:>5} x {cfg.seq_len:<5} {format_bytes(budget):>10}  "
    if not fits:
        return head + "nothing fits"
    e = _engine(cfg, _settings(rows, budget, model))
    e.train_step(batch)
    kept = fits[0]
    same = all(e.mesh.shape.get(a, 1) == getattr(kept.layout, a) for a in ("data", "model", "seq"))
    assert same and e.plan.stage.stage == kept.stage.stage, (dict(e.mesh.shape), kept.name)
    base = _settings(rows, budget, model)
    line = head + f"{kept.name:<46} {_timed(cfg, kept, base, steps) * 1e3:>8.1f}"
    for r in fits[1:]:
        line += f"  | {r.name} {_timed(cfg, r, base, steps) * 1e3:.1f}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="one tiny case, one timed step, one next candidate"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (default 5)")
    args, _ = ap.parse_known_args()  # gpu_check.sh passes every section its shared flags
    if args.smoke:
        cfg = gpt.GPTConfig(vocab_size=32, seq_len=16, num_layers=1, num_heads=4, d_model=16,
                            d_ff=32)  # fmt: skip
        cases, steps, after = [(8, 1.0)], 1, 1
    else:
        cfg = gpt.GPTConfig(vocab_size=256, seq_len=256, num_layers=2, num_heads=8, d_model=256,
                            d_ff=1024)  # fmt: skip
        cases, steps, after = [(16, 1.0), (16, 0.8), (4, 1.0), (2, 1.0), (2, 0.7)], args.steps, 2
    print(f"Auto layout on {jax.device_count()} {jax.devices()[0].platform} devices, GPT "
          f"{cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads")  # fmt: skip
    print("budget = a fraction of the rank-first candidate's compiled need; ms: median step")
    print(f"{'rows x seq':<13} {'budget':>10}  {'kept (layout, stage)':<46} {'ms':>8}  | next two")
    for rows, fraction in cases:
        print(run_case(cfg, rows, fraction, steps, after), flush=True)


if __name__ == "__main__":
    main()
