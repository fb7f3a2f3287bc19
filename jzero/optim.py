"""DeepSpeed optimizer and LR-schedule names, mapped onto optax.

Decisions:

* **DeepSpeed's update rules, not optax's look-alikes.** ``Adam``/``AdamW`` follow DeepSpeed's
  ``FusedAdam`` (AdamW unless ``adam_w_mode: false``, which adds L2 decay to the gradient like
  ``torch.optim.Adam``), ``Lamb`` follows ``FusedLamb`` (trust ratio clamped to
  [min_coeff, max_coeff], bias correction folded into the step size), ``SGD`` and ``Adagrad``
  follow ``torch.optim`` (first momentum step undamped; eps outside the square root), ``Lion``
  follows ``FusedLion`` (with sign(0) = 0, where the CUDA kernel moves by +lr). Where optax has
  the same rule (weight decay, the learning-rate scale) its transform is reused.
* **No gradient clipping here.** The engine clips from the gradient shards before the update.
* **The learning rate is an injected hyperparameter** (``optax.inject_hyperparams``), so the
  optimizer state carries the rate of the last update under ``hyperparams["learning_rate"]``;
  ``current_lr`` evaluates the schedule for any step.
* **DeepSpeed's step semantics.** DeepSpeed sets the rate once when the scheduler is built and
  calls ``scheduler.step()`` after each optimizer step, so update ``k`` (0-based) uses the
  schedule at ``last_batch_iteration = k - 1``, and update 0 the construction-time rate
  (``warmup_min_lr``, ``cycle_min_lr``, or 0 for ``WarmupCosineLR``). ``build_schedule(cfg)(k)``
  is exactly the rate DeepSpeed uses for update ``k``.
* **OneCycle cycles momentum** (``cycle_momentum``, true by default in DeepSpeed) for the
  optimizers with betas (Adam, AdamW, Lamb, Lion): beta1 moves between ``cycle_max_mom`` and
  ``cycle_min_mom`` and beta2 is set to 0.99, as DeepSpeed does. SGD and Adagrad have no betas,
  so DeepSpeed (and jzero) leave their momentum alone.
* Lamb's trust ratio uses per-tensor norms: apply the optimizer to whole (logical) arrays, as
  ``jit`` with shardings does, not to local shards inside ``shard_map``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jzero.config import (
    Config,
    ConfigError,
    JzeroConfigWarning,
    resolve_optimizer,
    resolve_scheduler,
)

__all__ = ["build_optimizer", "build_schedule", "current_lr"]

_WITH_BETAS = ("adam", "adamw", "lamb", "lion")


# --------------------------------------------------------------------------------------------
# Schedules (jittable functions of the update count)
# --------------------------------------------------------------------------------------------


def _warmup_gamma(it: jax.Array, warmup_steps: int, warmup_type: str) -> jax.Array:
    """DeepSpeed's warm-up fraction at iteration ``it`` (0 <= it < warmup_steps)."""
    if warmup_type == "log":
        return jnp.log(jnp.maximum(it, 0.0) + 1.0) / math.log(warmup_steps)
    return it / warmup_steps


def _warmup_lr(p: dict[str, Any], max_lr: float, decay: bool) -> optax.Schedule:
    lo, hi = p["warmup_min_lr"], max_lr
    warm = max(2, p["warmup_num_steps"])  # DeepSpeed: max(2, warmup_num_steps)
    total = p.get("total_num_steps")

    def schedule(count: jax.Array) -> jax.Array:
        it = jnp.asarray(count, jnp.float32) - 1.0  # DeepSpeed's last_batch_iteration
        gamma = jnp.where(it < warm, _warmup_gamma(it, warm, p["warmup_type"]), 1.0)
        if decay:
            after = jnp.maximum(0.0, (total - it) / max(1.0, total - warm))
            gamma = jnp.where(it < warm, gamma, after)
        return jnp.where(it < 0, lo, lo + (hi - lo) * gamma)

    return schedule


def _warmup_cosine_lr(p: dict[str, Any], base_lr: float) -> optax.Schedule:
    warm = max(2, p["warmup_num_steps"])
    wmin, cmin = p["warmup_min_ratio"], p["cos_min_ratio"]
    total = max(1, p["total_num_steps"] - warm)

    def schedule(count: jax.Array) -> jax.Array:
        it = jnp.asarray(count, jnp.float32) - 1.0
        warm_ratio = wmin + _warmup_gamma(it, warm, p["warmup_type"]) * (1.0 - wmin)
        progress = jnp.minimum(1.0, (it - warm + 1.0) / total)
        cos_ratio = jnp.maximum(0.0, cmin + (1.0 - cmin) * (1.0 + jnp.cos(jnp.pi * progress)) / 2)
        ratio = jnp.where(it < warm, warm_ratio, cos_ratio)
        return jnp.where(it < 0, 0.0, base_lr * ratio)

    return schedule


def _one_cycle_scale(p: dict[str, Any], batch: jax.Array) -> jax.Array:
    """DeepSpeed OneCycle's scale factor in [0, 1] at ``batch = last_batch_iteration + 1``."""
    first = float(p["cycle_first_step_size"])
    second = first if p["cycle_second_step_size"] is None else float(p["cycle_second_step_size"])
    total = first + second
    ratio = first / total
    up_stairs = p["cycle_first_stair_count"]
    down_stairs = (
        up_stairs if p["cycle_second_stair_count"] is None else p["cycle_second_stair_count"]
    )
    cycle = jnp.floor(1.0 + batch / total)
    x = 1.0 + batch / total - cycle
    up = x / ratio
    down = (x - 1.0) / (ratio - 1.0) if ratio < 1.0 else jnp.zeros_like(x)
    cycle_it = jnp.mod(batch, total)
    if up_stairs > 0:
        up = _stairs(cycle_it, first, second, total, up_stairs)
    if down_stairs > 0:
        down = _stairs(cycle_it, first, second, total, down_stairs)
    return jnp.where(x <= ratio, up, down)


def _stairs(cycle_it: jax.Array, first: float, second: float, total: float, n: int) -> jax.Array:
    rising = cycle_it * n / first
    falling = (total - cycle_it) * n / max(second, 1e-30)
    return jnp.floor(jnp.where(cycle_it <= first, rising, falling)) / n


def _one_cycle_total(p: dict[str, Any]) -> float:
    first = float(p["cycle_first_step_size"])
    second = p["cycle_second_step_size"]
    return first + (first if second is None else float(second))


def _one_cycle_lr(p: dict[str, Any]) -> optax.Schedule:
    lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
    total = _one_cycle_total(p)
    skip_decay = p["decay_step_size"] == 0 or p["decay_lr_rate"] == 0

    def schedule(count: jax.Array) -> jax.Array:
        batch = jnp.asarray(count, jnp.float32)  # last_batch_iteration + 1
        cycle_lr = lo + (hi - lo) * _one_cycle_scale(p, batch)
        if skip_decay:
            decay_lr = jnp.full_like(batch, lo)
        else:
            interval = (batch - total) / p["decay_step_size"]
            decay_lr = lo / (1.0 + p["decay_lr_rate"] * interval)
        return jnp.where(batch - 1.0 < total, cycle_lr, decay_lr)

    return schedule


def _one_cycle_momentum(p: dict[str, Any]) -> optax.Schedule:
    lo, hi = p["cycle_min_mom"], p["cycle_max_mom"]
    total = _one_cycle_total(p)
    skip_decay = p["decay_step_size"] == 0 or p["decay_mom_rate"] == 0

    def schedule(count: jax.Array) -> jax.Array:
        batch = jnp.asarray(count, jnp.float32)
        cycle_mom = hi - (hi - lo) * _one_cycle_scale(p, batch)
        if skip_decay:
            decay_mom = jnp.full_like(batch, hi)
        else:
            interval = (batch - total) / p["decay_step_size"]
            decay_mom = hi * (1.0 + p["decay_mom_rate"] * interval)
        mom = jnp.where(batch - 1.0 < total, cycle_mom, decay_mom)
        return jnp.where(batch == 0, lo, mom)  # DeepSpeed starts at cycle_min_mom

    return schedule


def _lr_range_test(p: dict[str, Any]) -> optax.Schedule:
    lo, size, rate = (
        p["lr_range_test_min_lr"],
        p["lr_range_test_step_size"],
        p["lr_range_test_step_rate"],
    )

    def schedule(count: jax.Array) -> jax.Array:
        interval = jnp.asarray(count, jnp.float32) / size  # (last_batch_iteration + 1) / size
        if p["lr_range_test_staircase"]:
            interval = jnp.floor(interval)
        return lo * (1.0 + rate * interval)

    return schedule


def _optimizer_lr(cfg: Config) -> float:
    if cfg.optimizer is None:
        raise ConfigError(
            "The config has no optimizer section, so there is no learning rate; add e.g. "
            "optimizer: {type: AdamW, params: {lr: 3.0e-4}}."
        )
    return resolve_optimizer(cfg.optimizer)[1]["lr"]


def build_schedule(cfg: Config) -> optax.Schedule:
    """Builds the learning-rate schedule of ``cfg`` as a jittable function of the update count.

    Args:
      cfg: the config; ``scheduler`` (DeepSpeed's name and params) or, without one, the
        constant ``optimizer.params.lr``.

    Returns:
      ``schedule(count) -> lr``: the rate DeepSpeed uses for update ``count`` (0-based).

    Raises:
      ConfigError: when neither an optimizer nor a scheduler gives a rate, or a param is wrong.

    Example:
      >>> from jzero.config import load_config
      >>> cfg = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.25}}})
      >>> float(build_schedule(cfg)(5))
      0.25
    """
    if cfg.scheduler is None:
        lr = _optimizer_lr(cfg)
        return lambda count: jnp.full(jnp.shape(count), lr, jnp.float32)
    name, p = resolve_scheduler(cfg.scheduler)
    if name == "WarmupLR":
        max_lr = p["warmup_max_lr"] if p["warmup_max_lr"] is not None else _optimizer_lr(cfg)
        return _warmup_lr(p, max_lr, decay=False)
    if name == "WarmupDecayLR":
        return _warmup_lr(p, p["warmup_max_lr"], decay=True)
    if name == "WarmupCosineLR":
        return _warmup_cosine_lr(p, _optimizer_lr(cfg))
    if name == "OneCycle":
        return _one_cycle_lr(p)
    return _lr_range_test(p)


def current_lr(cfg_or_schedule: Config | Callable[[Any], Any], step: int | jax.Array) -> jax.Array:
    """The learning rate of update ``step`` (0-based).

    Args:
      cfg_or_schedule: a ``Config`` or a schedule from ``build_schedule``.
      step: the number of updates already applied.

    Returns:
      The rate as a float32 scalar array.
    """
    schedule = (
        build_schedule(cfg_or_schedule) if isinstance(cfg_or_schedule, Config) else cfg_or_schedule
    )
    return jnp.asarray(schedule(jnp.asarray(step)), jnp.float32)


# --------------------------------------------------------------------------------------------
# Update rules that optax does not have in DeepSpeed's / PyTorch's form
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# build_optimizer
# --------------------------------------------------------------------------------------------


def _decay(weight_decay: float) -> list[optax.GradientTransformation]:
    return [optax.add_decayed_weights(weight_decay)] if weight_decay else []


def _factory(name: str, p: dict[str, Any]) -> Callable[..., optax.GradientTransformation]:
    """The optax factory for ``name``; its numeric arguments are what ``inject_hyperparams``
    exposes (``learning_rate``, and ``b1``/``b2`` for the optimizers with betas)."""
    wd = p["weight_decay"]
    if name in ("adam", "adamw"):
        decoupled = name == "adamw" or p["adam_w_mode"]

        def adam(learning_rate: Any, b1: Any, b2: Any) -> optax.GradientTransformation:
            core = scale_by_fused_adam(b1, b2, p["eps"], p["bias_correction"])
            parts = [core, *_decay(wd)] if decoupled else [*_decay(wd), core]
            return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))

        return adam
    if name == "lamb":

        def lamb(learning_rate: Any, b1: Any, b2: Any) -> optax.GradientTransformation:
            core = scale_by_fused_lamb(
                b1, b2, p["eps"], wd, p["bias_correction"], p["eps_inside_sqrt"],
                p["max_coeff"], p["min_coeff"],
            )  # fmt: skip
            return optax.chain(core, optax.scale_by_learning_rate(learning_rate))

        return lamb
    if name == "lion":

        def lion(learning_rate: Any, b1: Any, b2: Any) -> optax.GradientTransformation:
            core = scale_by_fused_lion(b1, b2)
            return optax.chain(core, *_decay(wd), optax.scale_by_learning_rate(learning_rate))

        return lion
    if name == "sgd":

        def sgd(learning_rate: Any) -> optax.GradientTransformation:
            core = scale_by_torch_sgd(p["momentum"], p["dampening"], p["nesterov"])
            return optax.chain(*_decay(wd), core, optax.scale_by_learning_rate(learning_rate))

        return sgd

    def adagrad(learning_rate: Any) -> optax.GradientTransformation:
        core = scale_by_torch_adagrad(p["lr_decay"], p["initial_accumulator_value"], p["eps"])
        return optax.chain(*_decay(wd), core, optax.scale_by_learning_rate(learning_rate))

    return adagrad


def build_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Builds the optax optimizer of ``cfg.optimizer``, driven by ``cfg``'s LR schedule.

    Gradient clipping is not included (the engine clips). The learning rate (and, for the
    optimizers with betas, ``b1``/``b2``) are injected hyperparameters: after each update,
    ``state.hyperparams["learning_rate"]`` holds the rate that update used.

    Args:
      cfg: the config.

    Returns:
      The gradient transformation; pass ``params`` to ``update``.

    Raises:
      ConfigError: for a missing optimizer section, an unknown optimizer or parameter, or a
        combination PyTorch/DeepSpeed would refuse.

    Example:
      >>> from jzero.config import load_config
      >>> cfg = load_config({"optimizer": {"type": "SGD", "params": {"lr": 0.5}}})
      >>> tx = build_optimizer(cfg)
      >>> params = {"w": jnp.ones(2)}
      >>> updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
      >>> updates["w"].tolist()
      [-0.5, -0.5]
    """
    if cfg.optimizer is None:
        _optimizer_lr(cfg)  # raises the "no optimizer section" error
    name, p = resolve_optimizer(cfg.optimizer)
    hyper: dict[str, Any] = {"learning_rate": build_schedule(cfg)}
    if name in _WITH_BETAS:
        hyper["b1"], hyper["b2"] = p["betas"]
    if cfg.scheduler is not None:
        sched_name, sp = resolve_scheduler(cfg.scheduler)
        if sched_name == "OneCycle" and sp["cycle_momentum"]:
            if name in _WITH_BETAS:
                hyper["b1"], hyper["b2"] = _one_cycle_momentum(sp), 0.99
            elif "cycle_momentum" in cfg.scheduler.params:
                warnings.warn(
                    "scheduler.params.cycle_momentum: true has no effect with "
                    f"{cfg.optimizer.type}, which has no betas (DeepSpeed disables it too); "
                    "set it to false.",
                    JzeroConfigWarning,
                    stacklevel=2,
                )
    # Hyperparameters stay float32 whatever the parameter dtype (a bf16 lr would lose digits).
    return optax.inject_hyperparams(_factory(name, p), hyperparam_dtype=jnp.float32)(**hyper)
