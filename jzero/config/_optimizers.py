"""Optimizer and LR-schedule sections: DeepSpeed's names, parameters and defaults.

Decisions:

* The tables ``OPTIMIZER_PARAMS`` and ``SCHEDULER_PARAMS`` list every supported name with each
  parameter's kind and DeepSpeed's (or PyTorch's) default; :mod:`jzero.optim` maps them onto
  optax. Optimizer names are case-insensitive, as in DeepSpeed.
* ``resolve_optimizer`` / ``resolve_scheduler`` validate a section and return every parameter
  with its value or default, so the optax side never guesses a default.
* DeepSpeed's 1-bit optimizers (``OneBitLamb``, ``OneBitAdam``, ``ZeroOneAdam``) are
  refused with the optimizer they compress the communication of (``Lamb``, ``Adam``): the
  compression is a CUDA/NCCL feature, and it changes the update after ``freeze_step``.
* PyTorch implementation switches (``fused``, ``foreach`` ...) are accepted and listed in the
  no-effect warning; ``amsgrad`` and a ``last_batch_iteration`` other than -1 are refused.
* ``state_bits`` (Adam/AdamW, jzero's own key) is 32 (float32 moments) or 8 (int8/uint8
  blockwise codes, :mod:`jzero.optim.quantized`); 16-bit moments are
  ``bf16.bf16_optimizer_states``, which the message for 16 names.
* ``"auto"`` (Hugging Face's templates) means "from the optax optimizer passed to
  ``jzero.initialize``": loading accepts it (``auto_ok``), and ``jzero.config.resolve_auto``
  either drops the section (an optimizer was passed) or refuses it, naming each such key.
* Values are range-checked as ``torch.optim`` does: ``lr``, ``eps``, ``weight_decay``,
  ``momentum`` (and Adagrad's ``lr_decay``, ``initial_accumulator_value``) >= 0, each beta in
  [0, 1); every learning rate (and lr ratio) of a schedule >= 0. Numbers must be finite.
"""

from __future__ import annotations

import math
from typing import Any

from jzero.config._common import ConfigError, is_number, show, suggest
from jzero.config._schema import OptimizerConfig, SchedulerConfig

__all__ = [
    "OPTIMIZER_PARAMS",
    "SCHEDULER_PARAMS",
    "auto_keys",
    "resolve_optimizer",
    "resolve_scheduler",
]

_REQUIRED = object()
_ADAM = {
    "lr": ("float", 1e-3),
    "betas": ("betas", (0.9, 0.999)),
    "eps": ("float", 1e-8),
    "weight_decay": ("float", 0.0),
    "bias_correction": ("bool", True),
    "adam_w_mode": ("bool", True),
    "torch_adam": ("bool", False),
    "amsgrad": ("bool", False),
    "state_bits": ("int", 32),  # jzero's: 8 keeps the moments as 8-bit codes (optim.quantized)
}
OPTIMIZER_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "adam": _ADAM,  # DeepSpeed FusedAdam: AdamW unless adam_w_mode is false
    "adamw": _ADAM,
    "lamb": {  # DeepSpeed FusedLamb
        "lr": ("float", 1e-3),
        "betas": ("betas", (0.9, 0.999)),
        "eps": ("float", 1e-8),
        "weight_decay": ("float", 0.0),
        "bias_correction": ("bool", True),
        "eps_inside_sqrt": ("bool", False),
        "max_coeff": ("float", 10.0),
        "min_coeff": ("float", 0.01),
        "amsgrad": ("bool", False),
    },
    "sgd": {  # torch.optim.SGD
        "lr": ("float", 1e-3),
        "momentum": ("float", 0.0),
        "dampening": ("float", 0.0),
        "weight_decay": ("float", 0.0),
        "nesterov": ("bool", False),
    },
    "adagrad": {  # torch.optim.Adagrad
        "lr": ("float", 1e-2),
        "lr_decay": ("float", 0.0),
        "weight_decay": ("float", 0.0),
        "initial_accumulator_value": ("float", 0.0),
        "eps": ("float", 1e-10),
    },
    "lion": {  # DeepSpeed FusedLion
        "lr": ("float", 1e-3),
        "betas": ("betas", (0.9, 0.999)),
        "weight_decay": ("float", 0.0),
    },
    "muon": {  # DeepSpeed's Muon (its MuonWithAuxAdam), optax.contrib.muon's update
        "lr": ("float", 0.02),  # the matrices' rate (DeepSpeed's muon_lr)
        "momentum": ("float", 0.95),
        "weight_decay": ("float", 0.0),  # both groups, as DeepSpeed's param groups share it
        "adam_lr": ("float?", None),  # None: lr
        "betas": ("betas", (0.9, 0.999)),  # AdamW's, for the leaves Muon leaves out
        "eps": ("float", 1e-8),
        "ns_steps": ("int", 5),
        "nesterov": ("bool", True),
    },
}
"""Supported optimizers (lower-case names): parameter -> (kind, DeepSpeed/PyTorch default)."""

_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "sgd": "SGD"}
_OPTIMIZER_NAMES |= {"adagrad": "Adagrad", "lion": "Lion", "muon": "Muon"}
# DeepSpeed's 1-bit optimizers (compressed communication, CUDA/NCCL) -> the optimizer they are.
_ONE_BIT = {"onebitlamb": "Lamb", "onebitadam": "Adam", "zerooneadam": "Adam"}
_OPTIMIZER_NO_EFFECT = ("set_grad_none", "foreach", "fused", "capturable", "differentiable")

_WARMUP = {
    "warmup_min_lr": ("float", 0.0),
    "warmup_max_lr": ("float?", None),  # None: the optimizer's lr (DeepSpeed's WarmupLR)
    "warmup_num_steps": ("int", 1000),
    "warmup_type": ("warmup_type", "log"),
    "last_batch_iteration": ("int", -1),
}
SCHEDULER_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {
        "total_num_steps": ("int", _REQUIRED),
        **_WARMUP,
        "warmup_max_lr": ("float", 0.001),
    },
    "WarmupCosineLR": {
        "total_num_steps": ("int", _REQUIRED),
        "warmup_min_ratio": ("float", 0.0),
        "warmup_num_steps": ("int", 1000),
        "cos_min_ratio": ("float", 0.0001),
        "warmup_type": ("warmup_type", "log"),
        "last_batch_iteration": ("int", -1),
    },
    "OneCycle": {
        "cycle_min_lr": ("float", _REQUIRED),
        "cycle_max_lr": ("float", _REQUIRED),
        "decay_lr_rate": ("float", 0.0),
        "cycle_first_step_size": ("int", 2000),
        "cycle_second_step_size": ("int?", None),
        "cycle_first_stair_count": ("int", 0),
        "cycle_second_stair_count": ("int?", None),
        "decay_step_size": ("int", 0),
        "cycle_momentum": ("bool", True),
        "cycle_min_mom": ("float", 0.8),
        "cycle_max_mom": ("float", 0.9),
        "decay_mom_rate": ("float", 0.0),
        "last_batch_iteration": ("int", -1),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": ("float", 1e-3),
        "lr_range_test_step_size": ("int", 2000),
        "lr_range_test_step_rate": ("float", 1.0),
        "lr_range_test_staircase": ("bool", False),
        "last_batch_iteration": ("int", -1),
    },
}
"""Supported LR schedules (DeepSpeed's names): parameter -> (kind, DeepSpeed default)."""

# Parameters that torch.optim (or DeepSpeed's schedules) refuse below 0.
_OPTIMIZER_NONNEGATIVE = (
    "lr",
    "adam_lr",
    "eps",
    "weight_decay",
    "momentum",
    "lr_decay",
    "initial_accumulator_value",
)
_SCHEDULER_NONNEGATIVE = (
    "warmup_min_lr",
    "warmup_max_lr",
    "cycle_min_lr",
    "cycle_max_lr",
    "lr_range_test_min_lr",
    "warmup_min_ratio",
    "cos_min_ratio",
)


def _check_nonnegative(value: float, path: str, what: str) -> None:
    if value < 0:
        raise ConfigError(
            f"{path} is {show(value)}; it must be >= 0 ({what}). Set it to 0 or a positive value."
        )


def _check_betas(value: tuple[float, float], path: str) -> None:
    for i, beta in enumerate(value):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(
                f"{path} is {show(value)}; each beta must be in [0, 1) (as in "
                f"torch.optim), but betas[{i}] is {show(beta)}. Set it to a value in [0, 1), "
                "e.g. betas: [0.9, 0.999]."
            )


def _check_param(kind: str, value: Any, path: str) -> Any:
    """Validates one optimizer/scheduler parameter of the given kind; returns it normalised."""
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if kind == "float" and is_number(value):
        return float(value)
    numbers = value if kind == "betas" and isinstance(value, list | tuple) else [value]
    if kind in ("float", "betas") and any(
        isinstance(v, float) and not math.isfinite(v) for v in numbers
    ):
        raise ConfigError(
            f"{path}: {show(value)} is not allowed; it must be finite (not inf or NaN). Set a "
            "finite value."
        )
    if kind == "int" and is_number(value) and float(value).is_integer():
        return int(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "warmup_type" and value in ("log", "linear"):
        return value
    if (
        kind == "betas"
        and isinstance(value, list | tuple)
        and len(value) == 2
        and all(is_number(v) for v in value)
    ):
        return (float(value[0]), float(value[1]))
    allowed = {
        "float": "a number",
        "int": "an integer",
        "bool": "true or false",
        "warmup_type": "one of 'log', 'linear'",
        "betas": "a list of two numbers, e.g. [0.9, 0.999]",
    }[kind]
    raise ConfigError(f"{path}: {show(value)} is not allowed; it must be {allowed}.")


def _check_state_bits(value: Any, path: str) -> int:
    """Adam's ``state_bits``: 32 (float32 moments) or 8 (int8/uint8 codes, optim.quantized)."""
    if is_number(value) and float(value) in (8.0, 32.0):
        return int(value)
    if is_number(value) and float(value) == 16.0:
        fix = (
            "For 16-bit moments remove state_bits and set bf16: {enabled: true, "
            "bf16_optimizer_states: true}."
        )
    else:
        fix = "Set state_bits: 8 or 32, or remove it."
    raise ConfigError(
        f"{path}: {show(value)} is not allowed; it must be 32 (float32 moments, the default) "
        f"or 8 (8-bit blockwise codes, about a quarter of the bytes). {fix}"
    )


def auto_keys(section: OptimizerConfig | SchedulerConfig | None, path: str) -> list[str]:
    """The dotted paths of the section's parameters written as ``"auto"``."""
    if section is None:
        return []
    return [f"{path}.params.{k}" for k, v in section.params.items() if v == "auto"]


def _refuse_auto(sub: str) -> ConfigError:
    return ConfigError(
        f'{sub}: "auto" takes the value from the optax optimizer passed to jzero.initialize, '
        "and none was passed; pass optimizer=optax.adamw(...) (the config's optimizer and "
        "scheduler sections are then not used) or write the value in the config."
    )


def resolve_optimizer(
    opt: OptimizerConfig,
    path: str = "optimizer",
    *,
    no_effect: list | None = None,
    auto_ok: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Validates an optimizer section and fills in DeepSpeed's defaults.

    Args:
      opt: the ``optimizer`` section.
      path: its dotted path, for messages.
      no_effect: if given, (path, reason) pairs of accepted no-effect params are appended.
      auto_ok: accept ``"auto"`` values (they are returned as the defaults); otherwise an
        ``"auto"`` is an error.

    Returns:
      The lower-case optimizer name and every parameter with its value or default.

    Raises:
      ConfigError: for an unknown name, an unknown parameter or a wrong value.
    """
    name = opt.type.lower() if isinstance(opt.type, str) else opt.type
    if name in _ONE_BIT:
        base = _ONE_BIT[name]
        extra = [key for key in opt.params if key not in OPTIMIZER_PARAMS[base.lower()]]
        drop = f" and remove {', '.join(extra)} from its params" if extra else ""
        raise ConfigError(
            f"{path}.type: {show(opt.type)} is {base} with its communication compressed to 1 "
            "bit, a CUDA/NCCL feature jzero does not have (XLA runs the collectives). For the "
            f"optimizer itself, uncompressed (as {show(opt.type)} runs until its freeze_step), "
            f"set type: {base}{drop}."
        )
    if name not in OPTIMIZER_PARAMS:
        names = ", ".join(_OPTIMIZER_NAMES.values())
        raise ConfigError(
            f"{path}.type: {show(opt.type)} is not a supported optimizer; it must be one of "
            f"{names} (case-insensitive)."
        )
    spec = OPTIMIZER_PARAMS[name]
    params: dict[str, Any] = {}
    for key, value in opt.params.items():
        sub = f"{path}.params.{key}"
        if key == "max_grad_norm":
            raise ConfigError(
                f"{sub} is not an optimizer parameter (in DeepSpeed neither); set the top-level "
                "gradient_clipping instead."
            )
        if key in _OPTIMIZER_NO_EFFECT:
            if no_effect is not None:
                no_effect.append((sub, "a PyTorch implementation switch; XLA fuses the update"))
            continue
        if key not in spec:
            raise ConfigError(
                f"{sub} is not a parameter of {_OPTIMIZER_NAMES[name]}{suggest(key, spec)}; "
                f"the allowed parameters are {', '.join(spec)}."
            )
        if value == "auto":
            if not auto_ok:
                raise _refuse_auto(sub)
            continue
        if key == "state_bits":
            params[key] = _check_state_bits(value, sub)
            continue
        params[key] = _check_param(spec[key][0], value, sub)
        if key in _OPTIMIZER_NONNEGATIVE and value is not None:
            _check_nonnegative(value, sub, "torch.optim refuses a negative value too")
        elif key == "betas":
            _check_betas(params[key], sub)
    if params.get("amsgrad"):
        raise ConfigError(
            f"{path}.params.amsgrad: true is not supported (DeepSpeed's fused optimizers refuse "
            "it too); set it to false or remove it."
        )
    resolved = {k: params.get(k, default) for k, (_, default) in spec.items()}
    if name == "muon" and not (resolved["momentum"] < 1 and resolved["ns_steps"] >= 1):
        bad = "momentum" if resolved["momentum"] >= 1 else "ns_steps"
        raise ConfigError(
            f"{path}.params.{bad}: {show(resolved[bad])} is not allowed; Muon needs momentum "
            "in [0, 1) and ns_steps >= 1 (e.g. momentum: 0.95, ns_steps: 5)."
        )
    if (
        name == "sgd"
        and resolved["nesterov"]
        and (resolved["momentum"] <= 0 or resolved["dampening"] != 0)
    ):
        raise ConfigError(
            f"{path}.params.nesterov: true needs momentum > 0 and dampening 0 (as in "
            "torch.optim.SGD); set momentum and remove dampening, or set nesterov: false."
        )
    # torch.optim.AdamW defaults weight_decay to 0.01; DeepSpeed's FusedAdam to 0.
    adamw = name == "adamw" or resolved.get("adam_w_mode")
    if (
        name in ("adam", "adamw")
        and resolved["torch_adam"]
        and adamw
        and "weight_decay" not in params
    ):
        resolved["weight_decay"] = 0.01
    return name, resolved


def resolve_scheduler(
    sched: SchedulerConfig, path: str = "scheduler", *, auto_ok: bool = False
) -> tuple[str, dict[str, Any]]:
    """Validates a scheduler section and fills in DeepSpeed's defaults.

    Args:
      sched: the ``scheduler`` section.
      path: its dotted path, for messages.
      auto_ok: accept ``"auto"`` values (they count as set, and are returned as the defaults,
        None for a required one); otherwise an ``"auto"`` is an error.

    Returns:
      The canonical schedule name and every parameter with its value or default.

    Raises:
      ConfigError: for an unknown name or parameter, a missing required one or a wrong value.
    """
    canon = {n.lower(): n for n in SCHEDULER_PARAMS}
    name = canon.get(sched.type.lower()) if isinstance(sched.type, str) else None
    if name is None:
        raise ConfigError(
            f"{path}.type: {show(sched.type)} is not a supported LR schedule; it must be one of "
            f"{', '.join(SCHEDULER_PARAMS)}."
        )
    spec = SCHEDULER_PARAMS[name]
    params = {}
    for key, value in sched.params.items():
        sub = f"{path}.params.{key}"
        if key not in spec:
            raise ConfigError(
                f"{sub} is not a parameter of {name}{suggest(key, spec)}; the allowed "
                f"parameters are {', '.join(spec)}."
            )
        if value == "auto":
            if not auto_ok:
                raise _refuse_auto(sub)
            default = spec[key][1]
            params[key] = None if default is _REQUIRED else default
            continue
        params[key] = _check_param(spec[key][0], value, sub)
        if key in _SCHEDULER_NONNEGATIVE and value is not None:
            _check_nonnegative(value, sub, "a learning rate or lr ratio cannot be negative")
    for key, (_, default) in spec.items():
        if default is _REQUIRED and key not in params:
            raise ConfigError(f"{path}.params.{key} is required by {name}; set it.")
    resolved = {k: params.get(k, default) for k, (_, default) in spec.items()}
    if resolved["last_batch_iteration"] != -1:
        raise ConfigError(
            f"{path}.params.last_batch_iteration: {resolved['last_batch_iteration']} is not "
            "allowed; jzero resumes the schedule from the checkpoint's step, so remove it."
        )
    for key in ("warmup_num_steps", "cycle_first_step_size", "lr_range_test_step_size"):
        if key in resolved and resolved[key] <= 0:
            raise ConfigError(
                f"{path}.params.{key}: {resolved[key]} is not allowed; it must be a positive "
                "integer."
            )
    for key in ("total_num_steps", "cycle_second_step_size", "decay_step_size"):
        if resolved.get(key) is not None and resolved[key] < 0:
            raise ConfigError(
                f"{path}.params.{key}: {resolved[key]} is not allowed; it must be >= 0."
            )
    return name, resolved
