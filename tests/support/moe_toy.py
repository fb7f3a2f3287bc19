"""The MoE toy of tests/distributed/test_moe.py and its two-process child
tests/support/dist_moe.py: a pytree
with an embedding, one MoE layer of 8 two-layer experts (top-2) on the residual stream, and a
linear head; its loss through :func:`jzero.moe.moe_layer` and the same loss on one device
through :func:`jzero.moe.dense_reference` (every expert on every token, masked by the router,
routed per device's rows); plain-SGD reference runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jzero import moe

E, D, F, IN, OUT, K = 8, 16, 24, 12, 5, 2
ROWS = 32
DEVICES = 8
LR = 0.1


def make_params(seed=0, bias=None):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float64)

    return {
        "embed": normal(IN, D, scale=0.3),
        "router": {
            "w": normal(D, E, scale=0.5),
            "b": jnp.zeros(E, jnp.float64) if bias is None else jnp.asarray(bias, jnp.float64),
        },
        "experts": {"w1": normal(E, D, F, scale=D**-0.5), "w2": normal(E, F, D, scale=F**-0.5)},
        "head": normal(D, OUT, scale=D**-0.5),
    }


def experts_fn(p):
    """Expert i's two-layer MLP on slot row i: ``[E_local, N, D] -> [E_local, N, D]``."""

    def run(h):
        hidden = jnp.tanh(jnp.einsum("end,edf->enf", h, p["w1"]))
        return jnp.einsum("enf,efd->end", hidden, p["w2"])

    return run


def make_loss(capacity_factor=4.0, min_capacity=4, layer=moe.moe_layer, aux_coef=0.01, **extra):
    """The toy's loss: embedding, one MoE layer on the residual stream, a linear head, plus
    ``aux_coef`` times the load-balancing loss."""
    route = dict(experts_per_token=K, capacity_factor=capacity_factor, min_capacity=min_capacity)

    def loss(p, batch):
        h = batch["x"] @ p["embed"]
        logits = h @ p["router"]["w"] + p["router"]["b"]
        y, stats = layer(logits, experts_fn(p["experts"]), h, **route, **extra)
        err = (h + y) @ p["head"] - batch["y"]
        total = jnp.mean(err**2) + aux_coef * stats.aux_loss
        return total, {
            "moe_aux_loss": stats.aux_loss,
            "moe_dropped_fraction": stats.dropped_fraction,
        }

    return loss


def reference(capacity_factor=4.0, min_capacity=4):
    """The same loss on one device, every expert dense, routed per device's rows (8 groups)."""
    return make_loss(capacity_factor, min_capacity, moe.dense_reference, groups=DEVICES)


def batches(num, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(ROWS, IN)), "y": rng.normal(size=(ROWS, OUT))} for _ in range(num)
    ]


def config(stage, ep, **more):
    cfg = {
        "train_batch_size": ROWS,
        "gradient_clipping": 0,
        # every leaf sharded at stage 3, however small (the toy's are below the default 1e5)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **more,
    }
    if ep > 1:
        cfg["expert_parallel"] = {"autoep_size": ep}
    return cfg


def reference_run(params, loss, steps, clip=0.0):
    """Losses, metrics (the grad norm too) and final params of plain SGD on one device, the
    gradients clipped as DeepSpeed does (``clip / (norm + 1e-6)`` when the norm is above)."""
    tx = optax.sgd(LR)
    opt = tx.init(params)
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    out = []
    for batch in steps:
        (value, aux), g = grad(params, batch)
        norm = float(optax.global_norm(g))
        out.append((float(value), {**{k: float(v) for k, v in aux.items()}, "grad_norm": norm}))
        if clip and norm > clip:
            scale = clip / (norm + 1e-6)
            g = jax.tree.map(lambda x, s=scale: x * s, g)
        updates, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
    return out, params


def bias_all_to_expert_0():
    return [50.0] + [0.0] * (E - 1)


def bias_first_device_only():
    # experts 0 and 1 (the first device's of each expert group at E_p=4) take every choice:
    # the other 3 devices' experts receive no token at all.
    return [50.0, 50.0] + [-50.0] * (E - 2)
