"""A Flax Linen model with BatchNorm, trained with ZeRO stage 2.

Run: python examples/train_linen.py [--steps N]
"""

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 CPU "devices"

import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jzero

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
args = ap.parse_args()


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(256)(x)))
        return nn.Dense(1)(x)


model = MLP()


# With collections besides "params", the loss takes and returns them (Flax's mutable pattern).
def loss_fn(params, state, batch):
    out, updates = model.apply({"params": params, **state}, batch["x"], mutable=list(state))
    return jnp.mean((out - batch["y"]) ** 2), updates


example = np.zeros((2, 16), np.float32)
engine = jzero.initialize(
    model=model,
    loss_fn=loss_fn,
    optimizer=optax.adamw(1e-3),
    config={"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}},
    options=jzero.InitOptions(init_args=(example,)),
)
rng = np.random.default_rng(0)
for step in range(1, args.steps + 1):
    x = rng.normal(size=(engine.train_batch_size, 16)).astype(np.float32)
    metrics = engine.train_step({"x": x, "y": np.sin(x.sum(1, keepdims=True))})
    if step % 10 == 0 or step == 1:
        print(f"step {step}: loss {float(metrics['loss']):.4f}")
variables = engine.model  # {"params": ..., "batch_stats": ...}
print("collections:", sorted(variables))
