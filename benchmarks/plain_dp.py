"""The floor every ZeRO stage is measured against: a hand-written JAX data-parallel step.

Replicated parameters and optimizer state, the batch sharded over the mesh's ``data`` axis, one
``value_and_grad``, DeepSpeed's global-norm clipping and the same optax update, all under one
``jit`` (GSPMD inserts the gradient all-reduce). This is what a JAX user writes without jzero;
``benchmarks/stages.py`` and ``benchmarks/gpu_step_time.py`` time jzero's stages against it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class PlainDP:
    """One hand-written data-parallel training run: call it to run a step, in place.

    Attributes:
      step: the jitted step ``step(params, opt_state, batch) -> (params, opt_state, loss)``,
        donating the state (``step.lower(*state, batch).compile()`` gives its program).
      state: ``[params, opt_state]``, replaced by every call.
      batch: the global batch, sharded over ``data`` once.
    """

    def __init__(self, step: Any, state: list[Any], batch: Any):
        self.step, self.state, self.batch = step, state, batch

    def __call__(self) -> jax.Array:
        self.state[0], self.state[1], value = self.step(*self.state, self.batch)
        return value

    def lower(self) -> Any:
        """The step lowered for the current state and batch."""
        return self.step.lower(*self.state, self.batch)


def plain_dp_step(
    params: Any,
    tx: optax.GradientTransformation,
    loss: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    batch: Any,
    clip: float = 0.0,
    remat: bool = False,
) -> PlainDP:
    """A :class:`PlainDP` run: call it for one data-parallel step, which returns its loss.

    Args:
      params: the initial parameters (copied, replicated over ``mesh``).
      tx: the optax update.
      loss: ``loss(params, batch) -> scalar``.
      mesh: a mesh with a ``data`` axis.
      batch: one global batch, sharded over ``data`` once and reused.
      clip: DeepSpeed's gradient clipping (0 disables).
      remat: wrap the loss in ``jax.checkpoint`` (to compare with a rematerialised stage 3).
    """
    rep = NamedSharding(mesh, P())
    params = jax.device_put(jax.tree.map(np.asarray, params), rep)  # own buffers: donated
    opt_state = jax.device_put(tx.init(params), rep)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    loss_fn = jax.checkpoint(loss) if remat else loss

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss_fn)(params, batch)
        if clip:
            norm = optax.global_norm(grads)
            coef = jnp.minimum(1.0, clip / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * coef, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    # The state is donated: updated in place, as jzero's step updates its state.
    return PlainDP(jax.jit(step, donate_argnums=(0, 1)), [params, opt_state], batch)
