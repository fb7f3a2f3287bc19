"""Your own Equinox model and loop, trained with ZeRO stage 3.

Run: python examples/train_equinox.py [--steps N]   (needs: pip install jzero[equinox])
"""

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 CPU "devices"

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jzero

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
args = ap.parse_args()


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(64)
        self.mlp = eqx.nn.MLP(64, 64, 256, depth=1, activation=jax.nn.gelu, key=key)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class Model(eqx.Module):
    inp: eqx.nn.Linear
    blocks: list  # a Python list of blocks: stage 3 gathers one at a time
    out: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 6)
        self.inp = eqx.nn.Linear(16, 64, key=keys[0])
        self.blocks = [Block(k) for k in keys[2:]]
        self.out = eqx.nn.Linear(64, 1, key=keys[1])

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def loss_fn(model, batch):
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


engine = jzero.initialize(
    model=lambda: Model(jax.random.key(0)),  # a constructor: built directly in its shards
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
model = engine.model  # the trained eqx.Module
print("first block's MLP output weights, shape:", model.blocks[0].mlp.layers[-1].weight.shape)
