"""A small model for the core tests: a scanned stack of layers plus leaves of awkward shapes.

Leaves: ``embed`` (12, d); ``blocks.w`` (L, d, d) and ``blocks.b`` (L, d) are stacked layers run
under ``lax.scan``; ``head.w`` (d, 5); ``head.b`` (5,) and ``odd`` (5, 3) have no dimension that
8 divides, so they (and ``embed``'s 12 rows) rest padded on 8 devices.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

IN, OUT = 12, 5


def make_params(seed: int = 0, num_layers: int = 4, d: int = 64, dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, dtype)

    return {
        "embed": normal(IN, d, scale=0.3),
        "blocks": {
            "w": normal(num_layers, d, d, scale=1 / np.sqrt(d)),
            "b": normal(num_layers, d, scale=0.1),
        },
        "head": {"w": normal(d, OUT, scale=1 / np.sqrt(d)), "b": normal(OUT, scale=0.1)},
        "odd": normal(OUT, 3, scale=0.3),
    }


def apply(params: dict, x: jax.Array) -> jax.Array:
    h = x @ params["embed"]

    def layer(h, block):
        return jnp.tanh(h @ block["w"] + block["b"]), None

    h, _ = jax.lax.scan(layer, h, params["blocks"])
    out = h @ params["head"]["w"] + params["head"]["b"]
    return out + 0.1 * (out @ params["odd"]) @ params["odd"].T


def loss_fn(params: dict, batch: dict) -> jax.Array:
    return jnp.mean((apply(params, batch["x"]) - batch["y"]) ** 2)


def loss_with_aux(params: dict, batch: dict):
    err = apply(params, batch["x"]) - batch["y"]
    loss = jnp.mean(err**2)
    return loss, {"mae": jnp.mean(jnp.abs(err))}


def make_batches(num: int, batch_size: int, seed: int = 1, dtype=np.float32) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch_size, IN)).astype(dtype),
            "y": rng.normal(size=(batch_size, OUT)).astype(dtype),
        }
        for _ in range(num)
    ]


@functools.cache
def first_grad_norm(global_batch: int) -> float:
    """The float64 global norm of the gradient on the first of ``make_batches(n, global_batch)``,
    on one device and without jzero: every run's first grad_norm (clipping and Adam hide a
    gradient's scale from the losses)."""
    from optax import global_norm

    with jax.enable_x64(True):
        batch = make_batches(1, global_batch, dtype=np.float64)[0]
        grads = jax.jit(jax.grad(loss_fn))(make_params(dtype=jnp.float64), batch)
        return float(global_norm(grads))


def reference_float64(tx_fn, global_batch: int, steps: int = 10, clip: float = 0.5):
    """The plain single-device optax loop with DeepSpeed's clipping rule (none where ``clip``
    is 0), in float64: ``(params, batches, losses, gradient global norms, final params)``."""
    from optax import apply_updates, global_norm

    with jax.enable_x64(True):
        params = make_params(dtype=jnp.float64)
        batches = make_batches(steps, global_batch, dtype=np.float64)
        tx = tx_fn()

        @jax.jit
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            norm = global_norm(grads)
            if clip:
                coef = jnp.minimum(1.0, clip / (norm + 1e-6))
                grads = jax.tree.map(lambda g: g * coef, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return apply_updates(params, updates), opt_state, loss, norm

        state, opt_state, losses, norms = params, tx.init(params), [], []
        for b in batches:
            state, opt_state, loss, norm = step(state, opt_state, b)
            losses.append(float(loss))
            norms.append(float(norm))
        return params, batches, losses, norms, jax.device_get(state)


def reference_run(params, batches, tx, clip: float):
    """A plain single-device optax loop with DeepSpeed's clipping rule."""
    from optax import apply_updates, global_norm

    opt_state = tx.init(params)
    losses = []

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        norm = global_norm(grads)
        coef = jnp.minimum(1.0, clip / (norm + 1e-6)) if clip else 1.0
        grads = jax.tree.map(lambda g: g * coef, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, loss

    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(float(loss))
    return losses, params
