"""What stage 3 holds at once: the same layers written as a scan and as Python loops.

Run: ``python benchmarks/stage3_layers.py`` (8 virtual CPU devices when no accelerator is
present). For ``--layers`` layers of ``--width`` x ``--width`` (tanh MLP, fp32 Adam, stage 3,
``stage3_param_persistence_threshold: 0``) it compiles the step of each way of writing the model
and prints ``compiled.memory_analysis()`` per device: the temporaries (activations, gathered
weights, gradients in flight) and the arguments (the state's shards), beside the size of the
full fp32 parameters. A model whose gathered layers all stayed alive would need about the full
parameters more temporaries than the scan.

Two more tables on the Python-loop pytree and the scan:

* activation checkpointing: residual MLP layers with a wide hidden activation and a batch
  where activations dominate (``--ac-width``, ``--ac-batch``), as a scan and as a Python loop:
  the temporaries at stages 0 and 3 without the section and with ``policy: full`` (each layer
  of the loop, or the scan body, keeps only its input);
* stage 3's gather settings: all-gather bytes and temporaries by default, with
  ``stage3_prefetch_bucket_size`` of four layers, ``stage3_max_reuse_distance: 1e9`` and
  ``reshard_after_forward: false``.

``--smoke`` (the test's run) fills the first table, the checkpointing table at stage 0 and the
gather table's defaults row only.
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
from jzero.hlo import collectives  # noqa: E402

MB = 1 << 20


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ac-batch", type=int, default=2048)
    ap.add_argument("--ac-width", type=int, default=64)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the checkpointing table at stage 0 only, the gather table's defaults only",
    )
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
        "scan (stacked layers)": jzero.initialize(
            {"w": w}, scan_loss, optax.adam(1e-3), config, abstract=True
        ),
        "Python loop, pytree": jzero.initialize(
            {f"w{i}": w[i] for i in range(n_layers)},
            loop_loss,
            optax.adam(1e-3),
            config,
            abstract=True,
        ),
        "Python loop, Linen": jzero.initialize(
            linen_params,
            lambda p, b: jnp.mean(linen_module.apply({"params": p}, b["x"]) ** 2),
            optax.adam(1e-3),
            config,
            abstract=True,
        ),
        "nnx.List of layers": jzero.initialize(
            model=lambda: NNXLoop(nnx.Rngs(0)),
            loss_fn=lambda m, b: jnp.mean(m(b["x"]) ** 2),
            optimizer=optax.adam(1e-3),
            config=config,
            abstract=True,
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

    # Activation checkpointing: residual MLP layers with a wide hidden activation, so that
    # activations dominate; the layers as a scan and as a Python loop, at stages 0 and 3.
    f, width = 4 * args.ac_width, args.ac_width
    w1 = (rng.normal(size=(n_layers, width, f)) / np.sqrt(width)).astype(np.float32)
    w2 = (rng.normal(size=(n_layers, f, width)) / np.sqrt(f)).astype(np.float32)
    ac_batch = {"x": rng.normal(size=(args.ac_batch, width)).astype(np.float32)}

    def mlp_scan(p, b):
        def layer(x, w):
            return x + jnp.tanh(x @ w["w1"]) @ w["w2"], None

        return jnp.mean(jax.lax.scan(layer, b["x"], p)[0] ** 2)

    def mlp_loop(p, b):
        x = b["x"]
        for i in range(n_layers):
            x = x + jnp.tanh(x @ p[f"layers_{i}"]["w1"]) @ p[f"layers_{i}"]["w2"]
        return jnp.mean(x**2)

    print(
        f"\nactivation checkpointing: {n_layers} residual MLP layers {width} -> {f} -> {width}, "
        f"batch {args.ac_batch}: temporaries MiB per device"
    )
    hdr = f"{'model':<22}  stage  no section  policy full  full / none"
    print(hdr)
    print("-" * len(hdr))
    for name, params, loss in (
        ("scan (stacked layers)", {"w1": w1, "w2": w2}, mlp_scan),
        (
            "Python loop, pytree",
            {f"layers_{i}": {"w1": w1[i], "w2": w2[i]} for i in range(n_layers)},
            mlp_loop,
        ),
    ):
        for stage in (0,) if args.smoke else (0, 3):
            temps = []
            for section in (None, {"policy": "full"}):
                cfg = {
                    "train_batch_size": args.ac_batch,
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                }
                if section:
                    cfg["activation_checkpointing"] = section
                engine = jzero.initialize(params, loss, optax.adam(1e-3), cfg, abstract=True)
                mem = engine.lower(ac_batch).compile().memory_analysis()
                temps.append(mem.temp_size_in_bytes / MB)
            print(
                f"{name:<22}  {stage:5d}  {temps[0]:10.2f}  {temps[1]:11.2f}  "
                f"{temps[1] / temps[0]:11.2f}"
            )

    # What jzero's per-layer checkpointing of a loop replaces: the model's own jax.checkpoint
    # around each layer, which XLA's CSE undoes on CPU (the recomputation merges back into
    # the forward pass).
    def mlp_loop_checkpointed(p, b):
        x = b["x"]
        for i in range(n_layers):
            x = jax.checkpoint(
                lambda x, w: x + jnp.tanh(x @ w["w1"]) @ w["w2"],
                policy=jax.checkpoint_policies.nothing_saveable,
            )(x, p[f"layers_{i}"])
        return jnp.mean(x**2)

    cfg = {"train_batch_size": args.ac_batch, "zero_optimization": {"stage": 0}}
    engine = jzero.initialize(
        {f"layers_{i}": {"w1": w1[i], "w2": w2[i]} for i in range(n_layers)},
        mlp_loop_checkpointed,
        optax.adam(1e-3),
        cfg,
        abstract=True,
    )
    mem = engine.lower(ac_batch).compile().memory_analysis()
    print(
        f"{'loop + jax.checkpoint':<22}  {0:5d}  {mem.temp_size_in_bytes / MB:10.2f}  "
        f"{'-':>11}  {'-':>11}   (jax.checkpoint per layer in the model, no section)"
    )

    # Stage 3's gather settings on the Python loop.
    print(f"\nstage 3 gather settings, Python loop, batch {args.batch}")
    hdr = f"{'zero_optimization':<38}  all-gather MiB  temp MiB"
    print(hdr)
    print("-" * len(hdr))
    settings = (
        ("(defaults)", {}),
        (f"stage3_prefetch_bucket_size: {4 * d * d}", {"stage3_prefetch_bucket_size": 4 * d * d}),
        ("stage3_max_reuse_distance: 1e9", {"stage3_max_reuse_distance": 10**9}),
        ("reshard_after_forward: false", {"reshard_after_forward": False}),
    )
    for name, keys in settings[:1] if args.smoke else settings:
        cfg = {**config, "zero_optimization": {**config["zero_optimization"], **keys}}
        loop_params = {f"w{i}": w[i] for i in range(n_layers)}
        engine = jzero.initialize(loop_params, loop_loss, optax.adam(1e-3), cfg, abstract=True)
        compiled = engine.lower(batch).compile()
        gathered = collectives(compiled)["all-gather"].bytes / MB
        temp = compiled.memory_analysis().temp_size_in_bytes / MB
        print(f"{name:<38}  {gathered:14.2f}  {temp:8.2f}")


if __name__ == "__main__":
    main()
