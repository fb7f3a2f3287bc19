"""A DeepSpeed ds_config.json, unchanged, driving a JAX model.

Run: python examples/from_deepspeed.py [--steps N]
"""

import argparse
import json
import os
import tempfile

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # 8 CPU "devices"

import jax
import jax.numpy as jnp
import numpy as np

import jzero
from jzero.plan import host_state_bytes

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=30)
args = ap.parse_args()

# The kind of file a DeepSpeed user already has: overlap_comm and the bucket size act (one
# reduce-scatter per bucket); keys with no meaning under XLA (contiguous_gradients) are accepted
# and listed once in a warning.
DS_CONFIG = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 5, "total_num_steps": args.steps, "warmup_max_lr": 3e-3},
    },
    "bf16": {"enabled": True},  # bf16 compute, fp32 master weights in the optimizer shards
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},  # host memory
        "overlap_comm": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
    },
}
path = os.path.join(tempfile.mkdtemp(), "ds_config.json")
with open(path, "w") as f:
    json.dump(DS_CONFIG, f)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (16, 128)) / 4, "w2": jax.random.normal(k2, (128, 1)) / 8}


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


# optimizer=None: the optimizer and scheduler come from the DeepSpeed config.
engine = jzero.initialize(init, loss_fn, None, path)
print(
    f"train_batch_size {engine.train_batch_size} = micro {engine.micro_batch_size} x "
    f"accumulation {engine.accumulation_steps} x data-parallel {engine.plan.num_shards}"
)
host = sum(host_state_bytes(engine.plan).values())
print(f"optimizer state and master weights in host memory: {host:,} bytes per device")
rng = np.random.default_rng(0)
for step in range(1, args.steps + 1):
    x = rng.normal(size=(engine.train_batch_size, 16)).astype(np.float32)
    m = engine.train_step({"x": x, "y": np.cos(x[:, :1])})
    if step % 10 == 0 or step == 1:
        print(f"step {step}: loss {float(m['loss']):.4f}, lr {float(m['lr']):.2e}")
