"""What the first step costs: ``initialize`` plus the first ``train_step``, against plain ``jit``.

Run: ``python benchmarks/compile_time.py`` (8 virtual CPU devices when no accelerator is
present; ``--smoke`` for tiny sizes). The model is ``--layers`` layers of a ``--width`` x
``--width`` matmul, a bias and a scale (tanh between), written as a Python loop over layer dicts
and as a ``jax.lax.scan`` over stacked layers, trained with Adam on a batch of ``--batch`` rows.

Each cell runs in a fresh process (no in-memory compilation cache): from the parameters as
host arrays to the first step's loss on the host. ``--smoke`` runs its cells in this process
instead, JAX's in-memory caches cleared before each: it checks that the cells run (the
programs compiled are the same), without a JAX import per cell.

"plain jit" is the single-device optax step under ``jax.jit`` (the state put on the device,
``jit(optimizer.init)``, the jitted step);
"plain DP" the hand-written data-parallel step on every device (``benchmarks/plain_dp.py``:
replicated params, the batch sharded, gradient clipping 1.0 as jzero's default), the baseline
a user would otherwise write;
"stage N" is ``jzero.initialize`` plus ``engine.train_step`` at that stage on every device,
with jzero's defaults (gradient clipping 1.0, the grad-norm and non-finite metrics). Each cell
prints the seconds, the programs compiled, and for jzero the ratios to plain DP and plain jit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(kind: str, form: str, layers: int, width: int, batch: int) -> dict:
    """One cell, in this (fresh) process."""
    sys.path.insert(0, str(ROOT))  # this checkout's jzero
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jzero
    from jzero.distributed import CompileCounter

    rng = np.random.default_rng(0)
    if form == "loop":
        params = {
            f"layer_{i}": {
                "w": (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
                "b": np.zeros(width, np.float32),
                "s": np.ones(width, np.float32),
            }
            for i in range(layers)
        }
    else:
        params = {
            "w": (rng.normal(size=(layers, width, width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros((layers, width), np.float32),
            "s": np.ones((layers, width), np.float32),
        }

    def loss_fn(p, b):
        h = b["x"]
        if form == "loop":
            for i in range(layers):
                layer = p[f"layer_{i}"]
                h = jnp.tanh(h @ layer["w"] + layer["b"]) * layer["s"]
        else:

            def body(h, layer):
                w, bias, scale = layer
                return jnp.tanh(h @ w + bias) * scale, None

            h, _ = jax.lax.scan(body, h, (p["w"], p["b"], p["s"]))
        return jnp.mean((h - b["y"]) ** 2)

    data = {
        "x": rng.normal(size=(batch, width)).astype(np.float32),
        "y": rng.normal(size=(batch, width)).astype(np.float32),
    }
    tx = optax.adam(1e-3)
    with CompileCounter() as counts:
        start = time.perf_counter()
        if kind == "plain":
            state = jax.device_put(params)
            opt_state = jax.jit(tx.init)(state)

            @jax.jit
            def step(params, opt_state, batch):
                loss, grads = jax.value_and_grad(loss_fn)(params, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            loss = float(step(state, opt_state, data)[2])
        elif kind == "dp":  # the hand-written data-parallel step on every device
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from plain_dp import plain_dp_step

            mesh = jzero.make_mesh(-1)
            loss = float(plain_dp_step(params, tx, loss_fn, mesh, data, clip=1.0)())
        else:
            config = {"train_batch_size": batch, "zero_optimization": {"stage": int(kind)}}
            engine = jzero.initialize(params, loss_fn, tx, config=config)
            loss = float(engine.train_step(data)["loss"])
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "compiles": counts.compiles, "loss": loss}


def _cell(kind: str, form: str, layers: int, width: int, batch: int, fresh: bool = True) -> dict:
    if not fresh:
        import jax

        jax.clear_caches()
        return _child(kind, form, layers, width, batch)
    env = dict(os.environ)
    if "--xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    args = ["--child", kind, form, str(layers), "--width", str(width), "--batch", str(batch)]
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {form} {layers}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="8,32,64,128,256", help="comma-separated layer counts")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--forms", default="loop,scan", help="loop, scan or both")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (2 layers of 16)")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "FORM", "LAYERS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, form, layers = args.child
        print(json.dumps(_child(kind, form, int(layers), args.width, args.batch)))
        return
    if args.smoke:
        args.layers, args.width, args.batch = "2", 16, 8
    layer_counts = [int(n) for n in args.layers.split(",")]
    print(
        f"initialize + first train_step: seconds (programs compiled), {args.width}x{args.width} "
        f"layers, batch {args.batch}, Adam; plain jit on one device, plain DP and jzero on all; "
        "ratios to plain DP, then to plain jit"
    )
    head = (
        f"{'model':<6}{'layers':>7}  {'plain jit':>10}  {'plain DP':>10}  "
        f"{'stage 0':>24}  {'stage 3':>24}"
    )
    print(head)
    print("-" * len(head))
    kinds = ("plain", "dp", "0", "3")
    for form in args.forms.split(","):
        for layers in layer_counts:
            cells = {
                k: _cell(k, form, layers, args.width, args.batch, fresh=not args.smoke)
                for k in kinds
            }
            one, dp = cells["plain"]["seconds"], cells["dp"]["seconds"]
            shown = [f"{cells[k]['seconds']:6.2f} ({cells[k]['compiles']})" for k in kinds[:2]]
            for k in ("0", "3"):
                c = cells[k]
                t = c["seconds"]
                shown.append(f"{t:6.2f} ({c['compiles']}) {t / dp:5.2f}x {t / one:5.2f}x")
            print(
                f"{form:<6}{layers:>7}  {shown[0]:>10}  {shown[1]:>10}  {shown[2]:>24}  "
                f"{shown[3]:>24}"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
