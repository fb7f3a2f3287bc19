"""Update rules that optax does not have in DeepSpeed's / PyTorch's form.

Decisions:

* ``scale_by_fused_adam`` is DeepSpeed's ``FusedAdam`` direction, ``scale_by_fused_lamb`` its
  ``FusedLamb`` step (trust ratio clamped to [min_coeff, max_coeff], bias correction folded into
  the step size), ``scale_by_fused_lion`` its ``FusedLion`` direction (with sign(0) = 0, where
  the CUDA kernel moves by +lr); ``scale_by_torch_sgd`` and ``scale_by_torch_adagrad`` follow
  ``torch.optim`` (first momentum step undamped; eps outside the square root).
* Each is the direction only: weight decay and the learning rate are separate optax transforms
  (:mod:`jzero.optim.builder` chains them), except Lamb, whose trust ratio includes the decay.
* Lamb's trust ratio uses per-tensor norms: apply it to whole (logical) arrays, as ``jit`` with
  shardings does, not to local shards inside ``shard_map``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "TorchAdagradState",
    "TorchSgdState",
    "scale_by_fused_adam",
    "scale_by_fused_lamb",
    "scale_by_fused_lion",
    "scale_by_torch_adagrad",
    "scale_by_torch_sgd",
]


def _bias_corrections(b1: Any, b2: Any, count: jax.Array, enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return 1.0, 1.0
    t = count.astype(jnp.float32)
    return 1.0 - b1**t, 1.0 - b2**t


def _moments(updates: Any, state: optax.ScaleByAdamState, b1: Any, b2: Any) -> tuple[Any, Any]:
    mu = jax.tree.map(lambda m, g: (b1 * m + (1 - b1) * g).astype(m.dtype), state.mu, updates)
    nu = jax.tree.map(lambda v, g: (b2 * v + (1 - b2) * g * g).astype(v.dtype), state.nu, updates)
    return mu, nu


def _adam_init(params: Any) -> optax.ScaleByAdamState:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)


def scale_by_fused_adam(
    b1: Any, b2: Any, eps: float, bias_correction: bool = True
) -> optax.GradientTransformation:
    """DeepSpeed FusedAdam's direction: ``(m / bc1) / (sqrt(v / bc2) + eps)``.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator, outside the square root.
      bias_correction: divide the moments by ``1 - beta**t``.

    Returns:
      The transformation (weight decay and the learning rate are separate transforms).
    """

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        mu, nu = _moments(updates, state, b1, b2)
        count = optax.safe_increment(state.count)
        bc1, bc2 = _bias_corrections(b1, b2, count, bias_correction)
        out = jax.tree.map(lambda m, v: (m / bc1) / (jnp.sqrt(v / bc2) + eps), mu, nu)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(_adam_init, update)


def scale_by_fused_lamb(
    b1: Any,
    b2: Any,
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> optax.GradientTransformation:
    """DeepSpeed FusedLamb's step, without the learning rate.

    Per tensor: ``u = m / (sqrt(v) + eps) + weight_decay * p`` (raw moments), trust ratio
    ``clip(||p|| / ||u||, min_coeff, max_coeff)`` (1 when either norm is 0), and the step
    ``sqrt(bc2) / bc1 * ratio * u``.

    Args:
      b1: decay of the first moment.
      b2: decay of the second moment.
      eps: added to the denominator (inside the square root if ``eps_inside_sqrt``).
      weight_decay: decoupled weight decay, included in the trust ratio.
      bias_correction: fold ``sqrt(1 - b2**t) / (1 - b1**t)`` into the step.
      eps_inside_sqrt: use ``sqrt(v + eps)``.
      max_coeff: upper bound of the trust ratio.
      min_coeff: lower bound of the trust ratio.

    Returns:
      The transformation; its ``update`` needs ``params``.
    """

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("Lamb needs the parameters: call update(grads, state, params).")
        mu, nu = _moments(updates, state, b1, b2)
        count = optax.safe_increment(state.count)
        bc1, bc2 = _bias_corrections(b1, b2, count, bias_correction)
        step_scale = jnp.sqrt(bc2) / bc1

        def one(m: jax.Array, v: jax.Array, p: jax.Array) -> jax.Array:
            denom = jnp.sqrt(v + eps) if eps_inside_sqrt else jnp.sqrt(v) + eps
            u = m / denom + weight_decay * p
            w_norm, u_norm = jnp.linalg.norm(p.ravel()), jnp.linalg.norm(u.ravel())
            ratio = jnp.clip(w_norm / jnp.where(u_norm > 0, u_norm, 1.0), min_coeff, max_coeff)
            ratio = jnp.where((w_norm > 0) & (u_norm > 0), ratio, 1.0)
            return step_scale * ratio * u

        out = jax.tree.map(one, mu, nu, params)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(_adam_init, update)


def scale_by_fused_lion(b1: Any, b2: Any) -> optax.GradientTransformation:
    """DeepSpeed FusedLion's direction ``sign(b1 * m + (1 - b1) * g)``; ``m`` then tracks ``b2``.

    Args:
      b1: interpolation of the direction.
      b2: decay of the momentum.

    Returns:
      The transformation (weight decay and the learning rate are separate transforms).
    """

    def init(params: Any) -> optax.ScaleByLionState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByLionState(count=jnp.zeros([], jnp.int32), mu=zeros)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        out = jax.tree.map(
            lambda m, g: jnp.sign(b1 * m + (1 - b1) * g).astype(g.dtype), state.mu, updates
        )
        mu = jax.tree.map(lambda m, g: (b2 * m + (1 - b2) * g).astype(m.dtype), state.mu, updates)
        return out, optax.ScaleByLionState(count=optax.safe_increment(state.count), mu=mu)

    return optax.GradientTransformation(init, update)


class TorchSgdState(NamedTuple):
    """State of ``scale_by_torch_sgd``: the update count and the momentum buffer."""

    count: jax.Array
    trace: Any


def scale_by_torch_sgd(
    momentum: float, dampening: float = 0.0, nesterov: bool = False
) -> optax.GradientTransformation:
    """``torch.optim.SGD``'s momentum: the first step's buffer is the undamped gradient.

    Args:
      momentum: the momentum factor (0: no buffer, the gradient passes through).
      dampening: the buffer takes ``(1 - dampening) * g`` after the first step.
      nesterov: return ``g + momentum * buffer``.

    Returns:
      The transformation.
    """
    if momentum == 0:
        return optax.identity()

    def init(params: Any) -> TorchSgdState:
        return TorchSgdState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(updates: Any, state: TorchSgdState, params: Any = None) -> tuple[Any, Any]:
        del params
        first = state.count == 0
        trace = jax.tree.map(
            lambda b, g: jnp.where(first, g, momentum * b + (1 - dampening) * g).astype(b.dtype),
            state.trace,
            updates,
        )
        out = jax.tree.map(lambda g, b: g + momentum * b, updates, trace) if nesterov else trace
        return out, TorchSgdState(optax.safe_increment(state.count), trace)

    return optax.GradientTransformation(init, update)


class TorchAdagradState(NamedTuple):
    """State of ``scale_by_torch_adagrad``: the update count and the sum of squares."""

    count: jax.Array
    sum_of_squares: Any


def scale_by_torch_adagrad(
    lr_decay: float = 0.0, initial_accumulator_value: float = 0.0, eps: float = 1e-10
) -> optax.GradientTransformation:
    """``torch.optim.Adagrad``'s direction ``g / (sqrt(sum g^2) + eps) / (1 + (t-1) lr_decay)``.

    Args:
      lr_decay: the learning-rate decay per step.
      initial_accumulator_value: the starting sum of squares.
      eps: added outside the square root.

    Returns:
      The transformation.
    """

    def init(params: Any) -> TorchAdagradState:
        acc = jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value), params)
        return TorchAdagradState(jnp.zeros([], jnp.int32), acc)

    def update(updates: Any, state: TorchAdagradState, params: Any = None) -> tuple[Any, Any]:
        del params
        acc = jax.tree.map(lambda s, g: (s + g * g).astype(s.dtype), state.sum_of_squares, updates)
        decay = 1.0 / (1.0 + state.count.astype(jnp.float32) * lr_decay)
        out = jax.tree.map(lambda g, s: decay * g / (jnp.sqrt(s) + eps), updates, acc)
        return out, TorchAdagradState(optax.safe_increment(state.count), acc)

    return optax.GradientTransformation(init, update)
