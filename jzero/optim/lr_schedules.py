"""DeepSpeed's learning-rate schedules as jittable functions of the update count.

Decisions:

* **DeepSpeed's step semantics.** DeepSpeed sets the rate once when the scheduler is built and
  calls ``scheduler.step()`` after each optimizer step, so update ``k`` (0-based) uses the
  schedule at ``last_batch_iteration = k - 1``, and update 0 the construction-time rate
  (``warmup_min_lr``, ``cycle_min_lr``, or 0 for ``WarmupCosineLR``). ``build_lr_schedule(cfg)(k)``
  is exactly the rate DeepSpeed uses for update ``k``.
* Schedules: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` (its momentum
  cycle too, which :mod:`jzero.optim.builder` injects as beta1) and ``LRRangeTest``; without a
  ``scheduler`` section the rate is the constant ``optimizer.params.lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jzero.config import Config, ConfigError, resolve_optimizer, resolve_scheduler

__all__ = ["build_lr_schedule", "current_lr"]


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


def one_cycle_momentum(p: dict[str, Any]) -> optax.Schedule:
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


def optimizer_lr(cfg: Config) -> float:
    if cfg.optimizer is None:
        raise ConfigError(
            "The config has no optimizer section, so there is no learning rate; add e.g. "
            "optimizer: {type: AdamW, params: {lr: 3.0e-4}}."
        )
    return resolve_optimizer(cfg.optimizer)[1]["lr"]


def build_lr_schedule(cfg: Config) -> optax.Schedule:
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
      >>> float(build_lr_schedule(cfg)(5))
      0.25
    """
    if cfg.scheduler is None:
        lr = optimizer_lr(cfg)
        return lambda count: jnp.full(jnp.shape(count), lr, jnp.float32)
    name, p = resolve_scheduler(cfg.scheduler)
    if name == "WarmupLR":
        max_lr = p["warmup_max_lr"] if p["warmup_max_lr"] is not None else optimizer_lr(cfg)
        return _warmup_lr(p, max_lr, decay=False)
    if name == "WarmupDecayLR":
        return _warmup_lr(p, p["warmup_max_lr"], decay=True)
    if name == "WarmupCosineLR":
        return _warmup_cosine_lr(p, optimizer_lr(cfg))
    if name == "OneCycle":
        return _one_cycle_lr(p)
    return _lr_range_test(p)


def current_lr(cfg_or_schedule: Config | Callable[[Any], Any], step: int | jax.Array) -> jax.Array:
    """The learning rate of update ``step`` (0-based).

    Args:
      cfg_or_schedule: a ``Config`` or a schedule from ``build_lr_schedule``.
      step: the number of updates already applied.

    Returns:
      The rate as a float32 scalar array.
    """
    schedule = cfg_or_schedule
    if isinstance(cfg_or_schedule, Config):
        schedule = build_lr_schedule(cfg_or_schedule)
    return jnp.asarray(schedule(jnp.asarray(step)), jnp.float32)
