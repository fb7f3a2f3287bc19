"""Your own Flax NNX model and loop, trained with ZeRO stage 3.

Run: python examples/train_nnx.py [--steps N]
"""

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 CPU "devices"

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jzero

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
args = ap.parse_args()


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 256, rngs=rngs)
        self.norm = nnx.BatchNorm(256, rngs=rngs)  # its statistics are carried, not sharded
        self.out = nnx.Linear(256, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


engine = jzero.initialize(
    model=lambda: MLP(nnx.Rngs(0)),  # a constructor: built directly in its shards
    loss_fn=loss_fn,
    optimizer=optax.adamw(1e-3),
    config={
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    },
)
rng = np.random.default_rng(0)
for step in range(1, args.steps + 1):
    x = rng.normal(size=(engine.train_batch_size, 16)).astype(np.float32)
    metrics = engine.train_step({"x": x, "y": np.sin(x.sum(1, keepdims=True))})
    if step % 10 == 0 or step == 1:
        print(f"step {step}: loss {float(metrics['loss']):.4f}")
model = engine.model  # the trained nnx.Module
print("running mean of the BatchNorm, first 3:", np.asarray(model.norm.mean[...][:3]))
