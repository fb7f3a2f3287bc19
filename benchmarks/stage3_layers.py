"""What stage 3 holds at once: the same layers written as a scan and as Python loops.

Run: ``python benchmarks/stage3_layers.py`` (8 virtual CPU devices when no accelerator is
present). For ``--layers`` layers of ``--width`` x ``--width`` (tanh MLP, fp32 Adam, stage 3,
``stage3_param_persistence_threshold: 0``) it compiles the step of each way of writing the model
and prints ``compiled.memory_analysis()`` per device: the temporaries (activations, gathered
weights, gradients in flight) and the arguments (the state's shards), beside the size of the
full fp32 parameters. A model whose gathered layers all stayed alive would need about the full
parameters more temporaries than the scan.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen, nnx  # noqa: E402

import jzero  # noqa: E402

MB = 1 << 20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    n_layers, d = args.layers, args.width
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(n_layers, d, d)) / np.sqrt(d)).astype(np.float32)
    batch = {"x": rng.normal(size=(args.batch, d)).astype(np.float32)}
    config = {
        "train_batch_size": args.batch,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }

    def scan_loss(p, b):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["w"])
        return jnp.mean(h**2)

    def loop_loss(p, b):
        h = b["x"]
        for i in range(n_layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(h**2)

    class LinenLoop(linen.Module):
        @linen.compact
        def __call__(self, x):
            for _ in range(n_layers):
                x = jnp.tanh(linen.Dense(d, use_bias=False)(x))
            return x

    class NNXLoop(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(n_layers)]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    linen_module = LinenLoop()
    linen_params = linen_module.init(jax.random.key(0), jnp.zeros((2, d)))["params"]
    engines = {
        "scan (stacked layers)": jzero.initialize({"w": w}, scan_loss, optax.adam(1e-3), config),
        "Python loop, pytree": jzero.initialize(
            {f"w{i}": w[i] for i in range(n_layers)}, loop_loss, optax.adam(1e-3), config
        ),
        "Python loop, Linen": jzero.initialize(
            linen_params,
            lambda p, b: jnp.mean(linen_module.apply({"params": p}, b["x"]) ** 2),
            optax.adam(1e-3),
            config,
        ),
        "nnx.List of layers": jzero.initialize(
            model=lambda: NNXLoop(nnx.Rngs(0)),
            loss_fn=lambda m, b: jnp.mean(m(b["x"]) ** 2),
            optimizer=optax.adam(1e-3),
            config=config,
        ),
    }
    full = n_layers * d * d * 4 / MB
    print(
        f"{n_layers} layers of {d}x{d}, fp32 Adam, ZeRO stage 3 on {jax.device_count()} "
        f"{jax.devices()[0].platform} devices, batch {args.batch}; full fp32 params {full:.2f} MiB"
    )
    hdr = f"{'model':<22}  temp MiB  args MiB  temp / scan"
    print(hdr)
    print("-" * len(hdr))
    base = None
    for name, engine in engines.items():
        mem = engine.lower(batch).compile().memory_analysis()
        temp = mem.temp_size_in_bytes / MB
        base = temp if base is None else base
        print(
            f"{name:<22}  {temp:8.2f}  {mem.argument_size_in_bytes / MB:8.2f}  {temp / base:11.2f}"
        )


if __name__ == "__main__":
    main()
