"""Optimizer state kept at rest in a narrower float (DeepSpeed's ``bf16.bf16_optimizer_states``).

Decisions:

* **Why.** With fp32 master weights, Adam holds 16 bytes per parameter: the 4-byte master, a
  4-byte gradient shard and two 4-byte moments. The moments are 8 of the 16; in bfloat16 they
  are 4, so each device's optimizer state halves at every ZeRO stage.
* **Stored narrow, computed wide.** The state rests in ``dtype`` between steps; each update
  upcasts it to float32, runs the inner update there (from the float32 gradients and master
  weights the engine hands it) and rounds the new state back to nearest (``astype``). The
  updates themselves come out in float32: only the stored moments lose precision.
* **What is cast.** Every floating leaf of the inner state with at least one dimension. Integer
  leaves (step counts) are left alone, and so are floating scalars, such as the learning rate
  ``optax.inject_hyperparams`` keeps: they cost nothing, and a rounded learning rate would change
  every step and what ``current_lr`` reports.
* **The state's structure is the inner one's**, only its dtypes differ, so everything that reads
  the state (the plan's shardings from ``jax.eval_shape(tx.init, params)``, ``current_lr``,
  checkpoints) sees the narrow arrays as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["low_precision_state"]


def _narrowed(x: Any) -> bool:
    return (
        hasattr(x, "dtype")
        and jnp.issubdtype(x.dtype, jnp.floating)
        and len(getattr(x, "shape", ())) > 0
    )


def low_precision_state(
    tx: optax.GradientTransformation, dtype: Any = jnp.bfloat16
) -> optax.GradientTransformation:
    """``tx`` with its state stored in ``dtype`` (bfloat16 by default) and updated in float32.

    Adam's two moments are 8 of the 16 bytes a parameter costs under mixed precision (with the
    fp32 master and gradient); in bfloat16 they are 4. ``init`` casts every floating leaf of
    ``tx``'s state with at least one dimension to ``dtype`` (integer leaves such as step counts,
    and floating scalars such as an injected learning rate, are untouched); ``update`` upcasts
    those leaves to float32, runs ``tx.update`` and rounds the new state to nearest ``dtype``.

    Args:
      tx: the optimizer whose state is narrowed.
      dtype: the floating dtype the state rests in.

    Returns:
      The transformation, whose state has ``tx``'s structure.
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"low_precision_state needs a floating dtype, got {dtype}.")

    def narrow(state: Any) -> Any:
        return jax.tree.map(lambda x: x.astype(dtype) if _narrowed(x) else x, state)

    def widen(state: Any) -> Any:
        return jax.tree.map(
            lambda x: x.astype(jnp.float32) if _narrowed(x) and x.dtype == dtype else x, state
        )

    def init(params: Any) -> Any:
        return narrow(tx.init(params))

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        updates, new_state = tx.update(updates, widen(state), params, **extra)
        return updates, narrow(new_state)

    return optax.GradientTransformationExtraArgs(init, update)
