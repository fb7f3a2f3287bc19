"""Train a small MLP with ZeRO stage 3 from your own loop, in plain JAX pytrees.

Run: python examples/quickstart.py [--steps N] [--stage S]
"""

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 CPU "devices"

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jzero

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--stage", type=int, default=3)
args = ap.parse_args()


# 1. Your model: any pytree of parameters and a loss of full parameters.
def init(key):
    k1, k2 = jax.random.split(key)
    return {
        "hidden": {"w": jax.random.normal(k1, (4, 64, 64)) / 8, "b": jnp.zeros((4, 64))},
        "out": jax.random.normal(k2, (64, 1)) / 8,
    }


def loss_fn(params, batch):
    def layer(h, p):  # stacked layers under scan: stage 3 gathers one layer at a time
        return jnp.tanh(h @ p["w"] + p["b"]), None

    h, _ = jax.lax.scan(layer, batch["x"], params["hidden"])
    return jnp.mean((h @ params["out"] - batch["y"]) ** 2)


# 2. One call: the config uses DeepSpeed's keys.
config = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
}
engine = jzero.initialize(init, loss_fn, optax.adamw(3e-3), config)
print(engine.describe())

# 3. Your loop: a global batch of train_batch_size rows per step.
rng = np.random.default_rng(0)
x = rng.normal(size=(engine.train_batch_size, 64)).astype(np.float32)
y = np.sin(x[:, :1] * 2).astype(np.float32)
for step in range(1, args.steps + 1):
    metrics = engine.train_step({"x": x, "y": y})
    if step % 10 == 0 or step == 1:
        print(f"step {step}: loss {float(metrics['loss']):.4f}")
