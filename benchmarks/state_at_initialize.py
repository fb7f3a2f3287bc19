"""The state each device holds after ``jzero.initialize`` and after the first step, for the layouts
whose decisions wait for a batch's shapes: a pipeline (``pipeline.stages: 2``), ``stage: auto``,
``tensor_parallel.autotp_size: auto`` and plain ZeRO-3 (whose stacked layers are laid out for
their scan).

Run: ``python benchmarks/state_at_initialize.py`` (8 virtual CPU devices are set up when no
accelerator is present; ``--smoke`` for a smaller GPT). The built-in GPT (default 4 layers,
d_model 64, float32) on 8 devices; per layout, the bytes of state device 0 holds:

* early: the state read right after ``initialize`` with no batch given, before any batch's
  shapes are known: made in the provisional layout, which the first batch then moves;
* batch=: after ``initialize(..., batch=shapes)``, every decision taken first;
* after step 1: after the first train step (of the ``batch=`` engine);
* moved: whether the first step moved the ``batch=`` engine's state (it must not).
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jzero  # noqa: E402
from jzero.demo import gpt  # noqa: E402

ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
LAYOUTS = {
    "ZeRO-3": {"zero_optimization": ZERO3},
    "pipeline.stages 2 (ZeRO-3)": {
        "zero_optimization": ZERO3,
        "pipeline": {"stages": 2},
        "gradient_accumulation_steps": 2,
    },
    "stage auto": {"zero_optimization": {"stage": "auto"}, "device_memory": "1GB"},
    "autotp_size auto (ZeRO-3)": {
        "zero_optimization": ZERO3,
        "tensor_parallel": {"autotp_size": "auto"},
        "device_memory": "1GB",
    },
}


def device0_bytes(state) -> int:
    device = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(state)
        for s in x.addressable_shards
        if s.device == device
    )


def measure(cfg: gpt.GPTConfig, layout: dict, rows: int) -> tuple[int, int, int, bool]:
    config = {"train_batch_size": rows, **layout}
    if "tensor_parallel" in layout:
        config["tensor_parallel"] = {**layout["tensor_parallel"], "num_heads": cfg.num_heads}
        config["model"] = {"seq_len": cfg.seq_len, "num_layers": cfg.num_layers}
    params = gpt.init_params(jax.random.key(0), cfg)
    loss = lambda p, b: gpt.loss_fn(p, b, cfg)  # noqa: E731
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, cfg.seq_len + 1))
    batch = {"tokens": tokens.astype(np.int32)}
    early = jzero.initialize(params, loss, optax.adamw(1e-3), config)
    before = device0_bytes(early.state)
    early.close()
    e = jzero.initialize(params, loss, optax.adamw(1e-3), config, batch=batch)
    made = device0_bytes(e.state)
    plan = e.plan
    e.train_step(batch)
    after = device0_bytes(e.state)
    moved = e.plan is not plan  # a re-plan at the first step is what moves a made state
    e.close()
    return before, made, after, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a smaller GPT")
    args = parser.parse_args()
    if args.smoke:
        cfg = gpt.GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, d_model=16)
    else:
        cfg = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=4, num_heads=4, d_model=64)
    rows = 16
    print(f"GPT {cfg.num_layers} layers, d_model {cfg.d_model}; {jax.device_count()} devices")
    print(f"{'layout':<28} {'early (B)':>12} {'batch= (B)':>12} {'after step 1':>13} {'moved':>6}")
    for name, layout in LAYOUTS.items():
        before, made, after, moved = measure(cfg, layout, rows)
        print(f"{name:<28} {before:>12,} {made:>12,} {after:>13,} {'yes' if moved else 'no':>6}")


if __name__ == "__main__":
    main()
