"""A config's ``optimizer`` and ``scheduler`` sections to one optax transformation.

Decisions:

* **No gradient clipping here.** The engine clips from the gradient shards before the update.
* **The learning rate is an injected hyperparameter** (``optax.inject_hyperparams``), so the
  optimizer state carries the rate of the last update under ``hyperparams["learning_rate"]``.
  Hyperparameters stay float32 whatever the parameter dtype.
* **OneCycle cycles momentum** (``cycle_momentum``, true by default in DeepSpeed) for the
  optimizers with betas (Adam, AdamW, Lamb, Lion): beta1 moves between ``cycle_max_mom`` and
  ``cycle_min_mom`` and beta2 is set to 0.99, as DeepSpeed does. SGD and Adagrad have no betas,
  so DeepSpeed (and jzero) leave their momentum alone.
* ``state_bits: 8`` (Adam/AdamW) wraps the Adam direction alone in
  :func:`jzero.optim.quantized.quantized_adam_state`, so only its two moments are 8-bit codes;
  with ``bf16.bf16_optimizer_states`` it is refused (two narrowings of the same moments).
* ``Adam`` with ``adam_w_mode: false`` adds L2 decay to the gradient before the direction, like
  ``torch.optim.Adam``; every other optimizer decays decoupled, as DeepSpeed's fused kernels do.
* ``Muon`` is :func:`jzero.optim.muon_optimizer.muon` (AdamW for the leaves that are no matrix):
  ``lr`` is the matrices' rate and ``adam_lr`` AdamW's, both following the schedule (AdamW's
  scaled by ``adam_lr / lr``); ``momentum`` is Muon's beta, ``betas`` AdamW's, ``weight_decay``
  decays both groups, as DeepSpeed's param groups share it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax

from jzero.config import (
    Config,
    ConfigError,
    JzeroConfigWarning,
    resolve_optimizer,
    resolve_scheduler,
)
from jzero.optim.lr_schedules import build_lr_schedule, one_cycle_momentum, optimizer_lr
from jzero.optim.muon_optimizer import MuonOptions
from jzero.optim.muon_optimizer import muon as muon_tx
from jzero.optim.quantized import quantized_adam_state
from jzero.optim.transforms import (
    scale_by_fused_adam,
    scale_by_fused_lamb,
    scale_by_fused_lion,
    scale_by_torch_adagrad,
    scale_by_torch_sgd,
)

__all__ = ["build_optimizer"]

_WITH_BETAS = ("adam", "adamw", "lamb", "lion")


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
            if p["state_bits"] == 8:  # the moments rest as 8-bit codes (optim.quantized)
                core = quantized_adam_state(core)
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
    if name == "muon":

        def muon(learning_rate: Any) -> optax.GradientTransformation:
            # AdamW's rate follows the same schedule, scaled by adam_lr / lr.
            ratio = 1.0 if p["adam_lr"] is None or not p["lr"] else p["adam_lr"] / p["lr"]
            return muon_tx(
                learning_rate,
                beta=p["momentum"],
                weight_decay=wd,
                adam_learning_rate=learning_rate * ratio,
                adam_weight_decay=wd,
                options=MuonOptions(
                    ns_steps=p["ns_steps"],
                    eps=p["eps"],
                    nesterov=p["nesterov"],
                    adam_b1=p["betas"][0],
                    adam_b2=p["betas"][1],
                ),
            )

        return muon
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
        optimizer_lr(cfg)  # raises the "no optimizer section" error
    name, p = resolve_optimizer(cfg.optimizer)
    if p.get("state_bits") == 8 and cfg.bf16.bf16_optimizer_states:
        raise ConfigError(
            "optimizer.params.state_bits: 8 and bf16.bf16_optimizer_states: true both narrow "
            "Adam's moments; choose one: remove bf16_optimizer_states (8-bit codes are the "
            "smaller state) or remove state_bits (bfloat16 moments)."
        )
    hyper: dict[str, Any] = {"learning_rate": build_lr_schedule(cfg)}
    if name in _WITH_BETAS:
        hyper["b1"], hyper["b2"] = p["betas"]
    if cfg.scheduler is not None:
        sched_name, sp = resolve_scheduler(cfg.scheduler)
        if sched_name == "OneCycle" and sp["cycle_momentum"]:
            if name in _WITH_BETAS:
                hyper["b1"], hyper["b2"] = one_cycle_momentum(sp), 0.99
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
