"""Validation: a config mapping checked against the schema, key by key and across keys.

Decisions:

* A small validator walks the dataclass fields and their type hints; field metadata carries
  the extra rules. Every error names the dotted path, the value as written, what is allowed,
  and the fix; an unknown key is refused, with the known key it is a near miss of ("did you
  mean", ``_common.close_match``: equal but for case, separators or British spelling, or
  an edit or two away, or an abbreviation word by word), if any.
* **The top level is read as DeepSpeed reads it**: an unknown key there is ignored and named
  in one warning line (``_comment``, ``comms_config``), unless it is a near miss of a known
  key (``zero_optimisation`` must not train at stage 0; ``gradient_clip``, an abbreviation of
  ``gradient_clipping``, must not train unclipped): that is refused. So are the sections
  DeepSpeed reads key by key with defaults (Config fields with ``loose`` metadata: ``fp16``
  and ``bf16``, as DeepSpeed read them up to 0.17.0, before they became pydantic models
  that refuse unknown keys, and ``activation_checkpointing``, ``flops_profiler``,
  ``data_types``, as it reads them today): ``fp16.opt_level`` (Apex's) or a ``bf16`` section
  copied from an ``fp16`` one (``bf16.loss_scale``) load with the same warning line, while
  ``bf16.loss_scael`` is refused with the suggestion. Every other section refuses an
  unknown key. A GPT-NeoX arguments file (``pipe_parallel_size``, ``train_iters`` ...) is
  refused with one message saying so, not a line per key.
* Three kinds of key: *used*; *no effect* under XLA (accepted, collected here and listed by
  ``load_config`` in one ``JzeroConfigWarning``); *refused* (DeepSpeed features whose absence
  would train something else, settings that contradict each other) with an error naming what
  is supported. A key
  that acts only in some settings (``overlap_comm``'s bucket sizes below stage 3, ZeRO++'s
  quantization at the stages that have the collective it quantizes) carries
  ``no_effect_when``, a function of its built section that gives the reason it does nothing
  there, or ``None``: it is listed only where that reason is given.
* Other spellings DeepSpeed 0.19 accepts in ``zero_optimization`` (its pydantic field names
  such as ``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``, and the deprecated
  ``cpu_offload``, ``cpu_offload_param``, ``cpu_offload_use_pin_memory``,
  ``stage3_gather_fp16_weights_on_model_save``) are rewritten to jzero's key before the walk;
  ``load_config`` names the new spelling of each in one ``JzeroConfigDeprecationWarning``.
  Both spellings at once are an error.
* ``"auto"`` on a field with ``auto`` metadata loads as that value and is recorded in
  ``Config.auto`` (see ``jzero.config._auto``); an ``internal`` field is not a key.
* A field with ``rest`` metadata (``mesh.axes``) takes every key of its section that is not a
  field: the other mesh axes. Their names are checked against ``data`` (a near miss such as
  ``dta`` is an error, not a new axis) and their sizes like ``mesh.data``.
* Cross-field rules (precision, offload needs a stage, model shape, at most one ``-1`` mesh
  axis) run after the sections are built; those within ``zero_optimization`` (offload, the
  NVMe tier, ``sub_group_size``, hybrid sharding) live in ``_zero_checks``.
* ``activation_checkpointing`` present without a ``policy`` key means ``policy: full`` (a
  DeepSpeed user who adds the section expects checkpointing); without the section, or with
  ``policy: null`` (what ``to_dict`` writes for it), the policy stays ``None``: jzero's
  default. Only the raw mapping tells the two apart, so ``build_config`` resolves it.
* A string field with ``path`` metadata (``checkpoint.directory``, ``train.log_dir``) and
  ``data.path`` have a leading ``~`` expanded, so the resolved config (and the copy saved in
  a checkpoint) holds the absolute path.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from jzero._util import divisors, read_size
from jzero.choices import SCHEDULES, parse_policy_text, stages
from jzero.config._common import (
    ConfigError,
    FrozenMap,
    close_match,
    is_number,
    join,
    show,
    suggest,
)
from jzero.config._optimizers import resolve_optimizer, resolve_scheduler
from jzero.config._schema import Config
from jzero.config._zero_checks import check_zero, resolve_zero

__all__ = ["build_config"]


def _check_number_range(value: int | float, meta: Mapping[str, Any], path: str) -> None:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{path}: {show(value)} is not allowed; it must be {bounds}.")
    if meta.get("nonzero") and value == 0:
        raise ConfigError(f"{path}: 0 is not allowed; it must be -1 (all devices) or >= 1.")


def _coerce(
    value: Any, tp: Any, path: str, meta: Mapping[str, Any], noted: list, autos: list, ignored: list
) -> Any:
    """Checks ``value`` against the type hint ``tp``; returns the normalised value. A section
    with ``loose`` metadata is read as DeepSpeed reads it (``_unknown_keys``)."""
    if meta.get("size") and value is not None:  # bytes, or a string with a unit: 12GB
        size = None if isinstance(value, bool) else read_size(value)
        if size is None or not math.isfinite(size) or size < 1:
            raise ConfigError(
                f"{path}: {show(value)} is not a memory size; write a positive number of bytes "
                "with an optional unit (B, KB, MB, GB, TB or KiB, MiB, GiB, TiB), e.g. 12GB."
            )
        return int(size)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], path, meta, noted, autos, ignored)
    if origin is Literal:
        allowed = typing.get_args(tp)
        norm = value.lower() if isinstance(value, str) else value
        if is_number(norm) and float(norm).is_integer():
            norm = int(norm)
        if isinstance(value, bool) or norm not in allowed:
            options = ", ".join(show(a) for a in allowed if a not in meta.get("refuse", {}))
            raise ConfigError(f"{path}: {show(value)} is not allowed; it must be one of {options}.")
        if norm in meta.get("refuse", {}):
            raise ConfigError(
                f"{path}: {show(norm)} is not supported: {meta['refuse'][norm]}; jzero supports "
                f"{' or '.join(show(a) for a in allowed if a not in meta['refuse'])}, so set one "
                "of those."
            )
        return norm
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, (noted, autos, ignored), meta.get("loose"))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {show(value)} is not allowed; it must be true or false.")
        return value
    if tp is int:
        if not (is_number(value) and float(value).is_integer()):
            raise ConfigError(f"{path}: {show(value)} is not allowed; it must be an integer.")
        _check_number_range(int(value), meta, path)
        return int(value)
    if tp is float:
        if not is_number(value):
            raise ConfigError(f"{path}: {show(value)} is not allowed; it must be a number.")
        _check_number_range(float(value), meta, path)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {show(value)} is not allowed; it must be a string.")
        return os.path.expanduser(value) if meta.get("path") else value
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: {show(value)} is not allowed; it must be a mapping.")
        return FrozenMap(value)
    raise TypeError(f"jzero.config has no rule for the type {tp!r} of {path}.")  # our bug


# zero_optimization: another spelling DeepSpeed 0.19 accepts -> jzero's key.
_ZERO_ALIASES = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    **{
        name: f"stage3_{name}"  # DeepSpeedZeroConfig's field names (its aliases are ours)
        for name in (
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "allgather_sequential",
        )
    },
}
# Deprecated booleans: true -> that offload section with device cpu.
_OFFLOAD_ALIASES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
_PIN_ALIAS = "cpu_offload_use_pin_memory"


def _apply_aliases(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[tuple[str, str]]]:
    """Rewrites DeepSpeed's other ``zero_optimization`` spellings to jzero's keys.

    Returns:
      The raw config (a copy where something changed) and ``(old path, new spelling)`` pairs.
    """
    zero = raw.get("zero_optimization")
    if not isinstance(zero, Mapping):
        return raw, []
    zero, renamed = dict(zero), []

    def take(old: str, new: str, value: Any, shown: str) -> None:
        if new in zero:
            raise ConfigError(
                f"zero_optimization.{old} and zero_optimization.{new} are both set, but {old} "
                f"is another spelling of {new}; keep only {new}."
            )
        zero[new] = value
        renamed.append((f"zero_optimization.{old}", shown))

    for old, new in _ZERO_ALIASES.items():
        if old in zero:
            take(old, new, zero.pop(old), new)
    for old, new in _OFFLOAD_ALIASES.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if not isinstance(value, bool):
            raise ConfigError(
                f"zero_optimization.{old}: {show(value)} is not allowed; it must be true or false."
            )
        if value:
            take(old, new, {"device": "cpu"}, f"{new}: {{device: cpu}}")
        elif new in zero:  # false adds nothing to the section written beside it
            renamed.append((f"zero_optimization.{old}", f"{new} (false: remove it)"))
        else:
            take(old, new, {"device": "none"}, f"{new}: {{device: none}}")
    if _PIN_ALIAS in zero:
        value = zero.pop(_PIN_ALIAS)
        for new in ("offload_optimizer", "offload_param"):
            section = zero.get(new)
            if isinstance(section, Mapping) and "pin_memory" not in section:
                zero[new] = {**section, "pin_memory": value}
        renamed.append(
            (f"zero_optimization.{_PIN_ALIAS}", "pin_memory under offload_optimizer/offload_param")
        )
    return {**raw, "zero_optimization": zero}, renamed


def _unknown_keys(
    raw: Mapping[str, Any], known: Mapping[str, Any], path: str, loose: tuple[str, ...] | None
) -> tuple[list[str], list[str]]:
    """The unknown keys of a section: the ones refused (a message each) and the ones ignored.

    A strict section (``loose`` None) refuses every unknown key. A loose one is read as
    DeepSpeed reads it, key by key with defaults: an unknown key is ignored, unless it is a near
    miss of a known key or of one of ``loose`` (keys that are ignored but whose typo shows what
    was meant, such as fp16's loss-scaling keys written in a ``bf16`` section).
    """
    refused, ignored = [], []
    for key in raw:
        if key in known:
            continue
        sub = join(path, key)
        close = close_match(str(key), [*known, *loose]) if loose is not None else None
        if loose is not None and (key in loose or close is None):
            ignored.append(sub)
        else:
            refused.append(
                f"{sub} is not a known key{suggest(str(key), [*known, *(loose or ())])}; "
                "remove it or fix its name."
            )
    return refused, ignored


def _build(
    cls: type, raw: Any, path: str, out: tuple[list, list, list], loose: tuple[str, ...] | None
) -> Any:
    """Builds dataclass ``cls`` from the mapping ``raw``; ``out`` collects the no-effect keys,
    the ``"auto"`` ones and the ignored ones (of a ``loose`` section: ``_unknown_keys``)."""
    noted, autos, ignored = out
    if not isinstance(raw, Mapping):
        where = path or "The config"
        raise ConfigError(f"{where}: {show(raw)} is not allowed; it must be a mapping of keys.")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    rest = next((f for f in fields if f.metadata.get("rest")), None)
    by_key = {
        f.metadata.get("key", f.name): f
        for f in fields
        if f is not rest and not f.metadata.get("internal")
    }
    if rest is not None:
        others = {k: v for k, v in raw.items() if k not in by_key}
        raw = {k: v for k, v in raw.items() if k in by_key}
        raw[rest.name] = _mesh_axes(others, by_key, path)
        by_key[rest.name] = rest
    errors, dropped = _unknown_keys(raw, by_key, path, loose)
    if errors:
        raise ConfigError("\n".join(errors))
    ignored += dropped
    kwargs = {}
    deferred = []  # keys whose effect depends on the rest of their section
    for key, f in by_key.items():
        if key not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{join(path, key)} is required; set it.")
            continue
        value = raw[key]
        sub = join(path, key)
        if "auto" in f.metadata and value == "auto":
            value = f.metadata["auto"]
            autos.append(sub)
        kwargs[f.name] = _coerce(value, hints[f.name], sub, f.metadata, noted, autos, ignored)
        reason = f.metadata.get("no_effect")
        disabled = isinstance(value, Mapping) and value.get("enabled") is False
        if "no_effect_when" in f.metadata:
            deferred.append((sub, f.metadata["no_effect_when"]))
        elif reason and not disabled:
            noted.append((sub, reason))
    built = cls(**kwargs)
    for sub, when in deferred:
        reason = when(built)
        if reason:
            noted.append((sub, reason))
    return built


def _mesh_axes(others: Mapping[str, Any], known: Mapping[str, Any], path: str) -> FrozenMap:
    """The other axes of the ``mesh`` section, name -> size, each checked like ``mesh.data``."""
    axes = {}
    for name, size in others.items():
        sub = join(path, name)
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(
                f"{sub}: {show(name)} is not a valid mesh axis name; name an axis with letters, "
                "digits and underscores, e.g. model."
            )
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        if close:
            raise ConfigError(
                f"{sub} looks like a misspelling of {path}.{close[0]} (did you mean "
                f"'{close[0]}'?); fix its name, or name the new mesh axis differently."
            )
        if isinstance(size, bool) or not (is_number(size) and float(size).is_integer()):
            raise ConfigError(
                f"{sub}: {show(size)} is not allowed; a mesh axis size must be an integer, "
                "-1 (the devices left) or >= 1."
            )
        axes[name] = int(size)
        _check_number_range(int(size), {"min": -1, "nonzero": True}, sub)
    return FrozenMap(axes)


_MODEL_INTS = (
    "vocab_size",
    "seq_len",
    "num_layers",
    "num_heads",
    "d_model",
    "d_ff",
    "attention_block",
)
_MODEL_CHUNKS = ("loss_chunk", "mlp_chunk")  # tokens per chunk, 0 for none


def _check_config(cfg: Config, noted: list) -> None:
    """Cross-field rules, and the optimizer/scheduler/model sections."""
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true, but only one precision can be used; "
            "set one of them to false."
        )
    if cfg.fp16.enabled and cfg.skip_nonfinite is False:
        raise ConfigError(
            "skip_nonfinite: false cannot be used with fp16.enabled: true: fp16 loss scaling "
            "always skips a step whose gradients overflow (and lowers the loss scale). Remove "
            "skip_nonfinite, or use bf16 or float32 to apply such steps."
        )
    if cfg.bf16.enabled and cfg.bf16.skip_nonfinite and cfg.skip_nonfinite is False:
        raise ConfigError(
            "bf16.skip_nonfinite: true and skip_nonfinite: false contradict each other; remove "
            "one of them (skip_nonfinite: false with bf16.check_grad_overflow: false applies "
            "steps with inf/NaN gradients)."
        )
    check_bf16(cfg)
    check_zero(cfg, noted)
    free = [name for name, size in cfg.mesh.sizes().items() if size == -1]
    if len(free) > 1:
        raise ConfigError(
            f"mesh: {', '.join(f'{n}: -1' for n in free)} are all -1, but only one axis can take "
            "the devices left over; give every other axis a size."
        )
    if cfg.optimizer is not None:
        resolve_optimizer(cfg.optimizer, no_effect=noted, auto_ok=True)
    if cfg.scheduler is not None:
        resolve_scheduler(cfg.scheduler, auto_ok=True)
    _check_unsupported_parallelism(cfg, noted)
    for key in _MODEL_INTS:
        value = cfg.model.get(key)
        if value is not None and not (is_number(value) and value == int(value) and value >= 1):
            raise ConfigError(
                f"model.{key}: {show(value)} is not allowed; it must be a positive integer."
            )
    for key in _MODEL_CHUNKS:
        value = cfg.model.get(key)
        if value is not None and not (is_number(value) and value == int(value) and value >= 0):
            raise ConfigError(
                f"model.{key}: {show(value)} is not allowed; it must be an integer >= 0 (tokens "
                "per chunk; 0 computes the whole sequence at once)."
            )
    _check_activation_checkpointing(cfg, noted)
    heads, width = cfg.model.get("num_heads"), cfg.model.get("d_model")
    if heads and width and width % heads:
        raise ConfigError(
            f"model.d_model: {width} is not divisible by model.num_heads ({heads}); choose a "
            "d_model that is a multiple of num_heads."
        )
    _check_model_positions(cfg.model)


_MODEL_POSITIONS = ("learned", "rotary")


def _check_model_positions(model: Mapping[str, Any]) -> None:
    """``model.positions`` and ``model.rope_theta``."""
    positions = model.get("positions")
    if positions is not None and positions not in _MODEL_POSITIONS:
        raise ConfigError(
            f"model.positions: {show(positions)} is not allowed; it must be one of "
            f"{list(_MODEL_POSITIONS)}: 'learned' (a position table, the default) or 'rotary' "
            "(rotary position embeddings of queries and keys, no table). Set one of them."
        )
    theta = model.get("rope_theta")
    if theta is not None and not (is_number(theta) and theta > 0):
        raise ConfigError(
            f"model.rope_theta: {show(theta)} is not allowed; it must be a number > 0 (the "
            "base of the rotary frequencies; 10000 is the usual)."
        )


def _size(section: Mapping[str, Any] | None, *keys: str) -> Any:
    """The value at ``keys`` under ``section``, or None."""
    for key in keys:
        if not isinstance(section, Mapping):
            return None
        section = section.get(key)
    return section


def _enabled_techniques(node: Any, path: str) -> list[str]:
    """Dotted paths of every ``enabled: true`` under a ``compression_training`` section."""
    if not isinstance(node, Mapping):
        return []
    found = [path] if node.get("enabled") is True else []
    for key, value in node.items():
        found += _enabled_techniques(value, f"{path}.{key}")
    return found


# Top-level DeepSpeed sections that change what is trained when enabled, beside
# compression_training: key -> what it does.
_CHANGES_THE_MODEL = {
    "quantize_training": "DeepSpeed's MoQ (quantize-aware training: the weights are "
    "quantized to fewer bits as training goes)",
    "progressive_layer_drop": "DeepSpeed's Progressive Layer Dropping (the model skips "
    "layers with a probability that grows over the steps)",
}

_PIPE_KEYS = ("stages", "schedule", "virtual_stages", "partition", "seed_layers",
              "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned",
              "use_reentrant")  # fmt: skip


# DeepSpeed keys of a section that jzero accepts and does not act on, with the values that ask
# for nothing (no warning for those) and why any other value has no effect.
_PIPE_NO_EFFECT = {
    "partition": (("uniform",), "jzero cuts the layer scan into stages of equally many layers"),
    "seed_layers": (
        (False, None),
        "the layers take the values the params (or the function that creates them) give",
    ),
    "activation_checkpoint_interval": (
        (0, None),
        "activation checkpointing is the activation_checkpointing section (every layer)",
    ),
}
_TP_NO_EFFECT = {
    "keep_module_on_host": (
        (False, None),
        "params=<a function of a key> creates them in their shards on the devices, never "
        "whole on the host",
    ),
    "partition_config": ((None,), "AutoTP's layouts come from names and tensor_parallel.tp_plan"),
    "injection_policy_tuple": ((None,), "it selects DeepSpeed's inference kernels"),
    "preset_model": ((None,), "AutoTP's rules match the names of every model family"),
}


def _note_no_effect(section: str, raw: Mapping, keys: Mapping, noted: list) -> None:
    """Each key of ``keys`` set in ``raw`` to a value that asks for something: to ``noted``."""
    for key, (inert, why) in keys.items():
        if key not in raw:
            continue
        value = raw[key]
        if not any(value is v or value == v for v in inert):
            noted.append((f"{section}.{key}", why))


_SECTION_AUTOS = (
    ("tensor_parallel", "autotp_size"),
    ("pipeline", "stages"),
    ("expert_parallel", "autoep_size"),
)


def _section_autos(cfg: Config) -> list[str]:
    """The parallel sizes inside a section written ``"auto"`` (chosen from the compiled step
    at the first batch, :mod:`jzero.engine.auto_layout`): their dotted keys, for
    ``Config.auto``. The section keeps the string; its accessor reads it as 1 until then."""
    out = []
    for section, key in _SECTION_AUTOS:
        raw = getattr(cfg, section)
        if isinstance(raw, Mapping) and raw.get(key) == "auto":
            out.append(f"{section}.{key}")
    return out


def _pipeline_errors(cfg: Config, noted: list) -> list[str]:
    """The ``pipeline`` section: ``stages`` a whole number (1: off; DeepSpeed's "auto" is 1),
    ``schedule`` one jzero has, enough micro-batches, and no other parallelism beside it yet;
    DeepSpeed's keys it does not act on go to ``noted``."""
    pipe = cfg.pipeline
    if pipe is None:
        return []
    if not isinstance(pipe, Mapping):
        return [f"pipeline: {show(pipe)} must be a section, e.g. {{stages: 2}}."]
    errors = []
    unknown = sorted(set(pipe) - set(_PIPE_KEYS))
    if unknown:
        errors.append(f"pipeline: unknown key(s) {unknown}; the keys are {sorted(_PIPE_KEYS)}.")
    _note_no_effect("pipeline", pipe, _PIPE_NO_EFFECT, noted)
    stages = pipe.get("stages", 1)
    if stages == "auto":
        stages = 1
    if isinstance(stages, bool) or not is_number(stages) or stages != int(stages) or stages < 1:
        errors.append(
            f"pipeline.stages: {show(stages)} is not allowed; it must be a whole number of "
            "stages (1: no pipeline parallelism)."
        )
        return errors
    schedule = pipe.get("schedule", "1f1b")
    if schedule not in SCHEDULES:
        errors.append(
            f"pipeline.schedule: {show(schedule)} is not a schedule jzero has; use one of "
            f"{', '.join(SCHEDULES)} (1f1b keeps at most `stages` micro-batches of activations)."
        )
    virtual = pipe.get("virtual_stages", None)
    if virtual is not None and (
        isinstance(virtual, bool) or not is_number(virtual) or virtual != int(virtual)
        or virtual < 1
    ):  # fmt: skip
        errors.append(
            f"pipeline.virtual_stages: {show(virtual)} is not allowed; it must be a whole "
            "number of chunks of layers per stage (2 or more with schedule interleaved_1f1b)."
        )
        return errors
    interleaved = schedule == "interleaved_1f1b"
    if virtual is not None and int(virtual) > 1 and not interleaved:
        errors.append(
            f"pipeline.virtual_stages: {virtual} chunks of layers per stage need "
            f"pipeline.schedule: interleaved_1f1b, but the schedule is {show(schedule)}; set "
            "the schedule, or remove virtual_stages."
        )
    if interleaved and virtual is not None and int(virtual) < 2:
        errors.append(
            "pipeline.virtual_stages: 1 chunk per stage does not interleave; set 2 or more "
            "(each stage then holds that many non-adjacent chunks of layers), or use "
            "pipeline.schedule: 1f1b."
        )
    stages = int(stages)
    if stages <= 1:
        return errors
    accum = cfg.gradient_accumulation_steps
    if is_number(accum) and accum < stages:
        errors.append(
            f"pipeline.stages: {stages} needs at least {stages} micro-batches "
            f"(gradient_accumulation_steps) to fill the pipeline, but gradient_accumulation_steps "
            f"is {accum}; set it to {stages} or more ({2 * stages} keeps the bubble smaller)."
        )
    elif interleaved and is_number(accum) and accum % stages:
        errors.append(
            f"pipeline.schedule: interleaved_1f1b runs the micro-batches in groups of "
            f"pipeline.stages ({stages}), but gradient_accumulation_steps is {accum}; set it to "
            f"a multiple of {stages} (e.g. {stages * (int(accum) // stages + 1)})."
        )
    others = {
        "offload_optimizer.device: nvme": cfg.zero_optimization.offload_optimizer.device == "nvme",
        "zero_hpz_partition_size > 1 (ZeRO++ hpZ)": cfg.zero_optimization.zero_hpz_partition_size
        > 1,
    }
    for what, on in others.items():
        if on:
            errors.append(
                f"pipeline.stages: {stages} does not compose with {what} yet; set "
                "pipeline.stages: 1, or turn that off."
            )
    return errors


_TP_KEYS = ("autotp_size", "tp_size", "tp_plan", "num_heads", "tp_grain_size", "enabled",
            "tp", "partition_config", "keep_module_on_host", "injection_policy_tuple",
            "preset_model")  # fmt: skip


def _tensor_parallel_errors(cfg: Config, noted: list) -> list[str]:
    """The ``tensor_parallel`` section: sizes that are positive integers (0 or 1: off), one
    size however spelled, a ``tp_plan`` mapping, and a model axis that divides the heads."""
    tp = cfg.tensor_parallel
    if tp is None:
        return []
    if not isinstance(tp, Mapping):
        return [f"tensor_parallel: {show(tp)} must be a section, e.g. {{autotp_size: 2}}."]
    errors = []
    unknown = sorted(set(tp) - set(_TP_KEYS))
    if unknown:
        errors.append(
            f"tensor_parallel: unknown key(s) {unknown}; the keys are {sorted(_TP_KEYS)}."
        )
    _note_no_effect("tensor_parallel", tp, _TP_NO_EFFECT, noted)
    sizes = {}
    for key in ("autotp_size", "tp_size"):
        value = tp.get(key)
        if value is None or (key == "autotp_size" and value == "auto"):
            continue
        if isinstance(value, bool) or not is_number(value) or value != int(value) or value < 0:
            errors.append(
                f"tensor_parallel.{key}: {show(value)} is not allowed; it must be a whole "
                "number of devices (0 or 1: no tensor parallelism)."
            )
        else:
            sizes[key] = int(value)
    if len(set(sizes.values())) > 1:
        errors.append(
            f"tensor_parallel: autotp_size {sizes['autotp_size']} and tp_size "
            f"{sizes['tp_size']} disagree; keep one of them."
        )
    inner, outer = _size(tp, "tp", "tp_size"), max(sizes.values(), default=0)
    if is_number(inner) and inner > 1 and outer > 1 and inner != outer:
        errors.append(
            f"tensor_parallel.tp.tp_size: {show(inner)} does not match the {outer} devices of "
            "tensor_parallel.autotp_size (DeepSpeed refuses it too); remove tp.tp_size, "
            "DeepSpeed's inference key, or set it to the same size."
        )
    elif is_number(inner) and inner > 1 and outer <= 1:
        noted.append(
            (
                "tensor_parallel.tp.tp_size",
                "it is DeepSpeed's inference key, and training splits the model over "
                "tensor_parallel.autotp_size devices, which is not set (DeepSpeed ignores it "
                "there too)",
            )
        )
    plan = tp.get("tp_plan")
    if plan is not None and not isinstance(plan, Mapping):
        errors.append(
            f"tensor_parallel.tp_plan: {show(plan)} must map dotted-path patterns to layouts, "
            "e.g. {'*.fc_in.*': colwise}."
        )
    size = max(sizes.values(), default=1)
    heads = tp.get("num_heads", cfg.model.get("num_heads"))
    if size > 1 and is_number(heads) and heads % size:
        errors.append(
            f"tensor_parallel.autotp_size: {size} does not divide the {heads} attention heads, "
            "so the heads can't be split evenly over the model axis; choose an autotp_size "
            f"among the divisors of {heads} "
            f"({', '.join(map(str, divisors(int(heads))))})."
        )
    return errors


_EP_KEYS = ("enabled", "autoep_size", "expert_params", "num_experts")


def _expert_errors(cfg: Config) -> list[str]:
    """The ``expert_parallel`` section: ``autoep_size`` a whole number that divides the
    experts, the experts the model routes to, and no parallelism beside it jzero has not
    composed with it yet."""
    ep = cfg.expert_parallel
    if ep is None:
        return []
    if not isinstance(ep, Mapping):
        return [f"expert_parallel: {show(ep)} must be a section, e.g. {{autoep_size: 4}}."]
    errors = []
    unknown = sorted(set(ep) - set(_EP_KEYS))
    if unknown:
        errors.append(
            f"expert_parallel: unknown key(s) {unknown}; the keys are {sorted(_EP_KEYS)}."
        )
    size = ep.get("autoep_size", 1)
    if size is None or size == 0 or size == "auto":
        size = 1
    if isinstance(size, bool) or not is_number(size) or size != int(size) or size < 1:
        errors.append(
            f"expert_parallel.autoep_size: {show(size)} is not allowed; it must be a whole "
            "number of devices to split the experts over (1: no expert parallelism)."
        )
        return errors
    names = ep.get("expert_params")
    if names is not None and not (isinstance(names, str) or all(isinstance(n, str) for n in names)):
        errors.append(
            f"expert_parallel.expert_params: {show(names)} must be a list of dotted-path "
            "globs, e.g. ['blocks.experts.*']."
        )
    experts = ep.get("num_experts", cfg.model.get("num_experts"))
    k = cfg.model.get("experts_per_token")
    if is_number(experts) and is_number(k) and experts and k > experts:
        errors.append(
            f"model.experts_per_token: {k} is more than the {experts} experts "
            "(model.num_experts); each token goes to at most every expert. Set "
            f"experts_per_token to at most {experts}."
        )
    size = int(size)
    if size <= 1 or cfg.autoep_size() <= 1:
        return errors
    if is_number(experts) and experts and experts % size:
        errors.append(
            f"expert_parallel.autoep_size: {size} does not divide the {experts} experts "
            "(model.num_experts); each device of the expert axis holds an equal share. Use an "
            f"autoep_size among the divisors of {experts} "
            f"({', '.join(map(str, divisors(int(experts))))})."
        )
    zero = cfg.zero_optimization
    others = {
        "offload_optimizer.device: nvme": zero.offload_optimizer.device == "nvme",
        "zero_hpz_partition_size > 1 (ZeRO++ hpZ)": zero.zero_hpz_partition_size > 1,
        "zero_quantized_weights / zero_quantized_gradients (ZeRO++)": bool(
            zero.zero_quantized_weights or zero.zero_quantized_gradients
        ),
    }
    for what, on in others.items():
        if on:
            errors.append(
                f"expert_parallel.autoep_size: {size} does not compose with {what} yet; set "
                "autoep_size: 1, or turn that off."
            )
    return errors


def _context_errors(cfg: Config) -> list[str]:
    """``context_parallel_size`` C: each ring member holds two equal zig-zag chunks of a
    sequence, which Ulysses (``sequence_parallel_size`` S) splits again, so 2C and C x S must
    divide ``model.seq_len``."""
    cp, sp = cfg.context_parallel_size, cfg.sequence_parallel_size
    seq_len = cfg.model.get("seq_len")
    if cp <= 1 or not is_number(seq_len):
        return []
    need = math.lcm(2 * cp, cp * sp)
    if seq_len % need == 0:
        return []
    ok = [str(c) for c in divisors(int(seq_len)) if seq_len % math.lcm(2 * c, c * sp) == 0]
    return [
        f"context_parallel_size: {cp} cuts each sequence into {2 * cp} zig-zag chunks"
        + (f", each ring member's split again over the {sp} seq devices" if sp > 1 else "")
        + f", which needs the tokens of a sequence (model.seq_len) to be a multiple of {need},"
        f" but they are {seq_len}; choose a context_parallel_size among {', '.join(ok) or '1'}"
        f", or a seq_len that is a multiple of {need}."
    ]


def _check_unsupported_parallelism(cfg: Config, noted: list) -> None:
    """DeepSpeed features whose absence would train something else than what was asked;
    ``tensor_parallel.tp.tp_size`` without AutoTP goes to ``noted``."""
    errors = []
    errors += _pipeline_errors(cfg, noted)
    errors += _tensor_parallel_errors(cfg, noted)
    errors += _expert_errors(cfg)
    sp = cfg.sequence_parallel_size
    heads, seq_len = cfg.model.get("num_heads"), cfg.model.get("seq_len")
    for what, n in (("attention heads (model.num_heads)", heads),
                    ("tokens of a sequence (model.seq_len)", seq_len)):  # fmt: skip
        if sp > 1 and is_number(n) and n % sp:
            errors.append(
                f"sequence_parallel_size: {sp} does not divide the {n} {what}, so they can't "
                "be split evenly over the seq axis; choose a sequence_parallel_size among the "
                f"divisors of {n} ({', '.join(map(str, divisors(int(n))))})."
            )
    errors += _context_errors(cfg)
    enabled = _enabled_techniques(cfg.compression_training, "compression_training")
    if enabled:
        errors.append(
            f"{', '.join(enabled)}: DeepSpeed Compression would change the model that is "
            "trained (quantization, pruning, layer reduction), and jzero does not implement it; "
            "set enabled: false there or remove the compression_training section."
        )
    for key, what in _CHANGES_THE_MODEL.items():
        section = getattr(cfg, key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            errors.append(
                f"{key}.enabled: {what} would change what is trained, and jzero does not "
                f"implement it; set enabled: false there or remove the {key} section."
            )
    if cfg.gradient_allreduce_op.lower() != "mean":
        errors.append(
            f"gradient_allreduce_op: {show(cfg.gradient_allreduce_op)} is not supported: jzero "
            "averages gradients over the data axis (DeepSpeed's default, mean); remove it or "
            "set it to mean, and scale the loss yourself to get a sum."
        )
    if not cfg.managed_gradient_accumulation:
        errors.append(
            "managed_gradient_accumulation: false is not supported: every engine.train_step is "
            "a whole optimizer step over gradient_accumulation_steps micro-batches; remove it "
            "and set gradient_accumulation_steps: 1 to update after every batch."
        )
    if errors:
        raise ConfigError("\n".join(errors))


def _check_activation_checkpointing(cfg: Config, noted: list) -> None:
    ac = cfg.activation_checkpointing
    try:
        policy = parse_policy_text(ac.policy)  # (kind, names), or None
    except ValueError as e:
        raise ConfigError(f"activation_checkpointing.policy: {e}") from None
    active = policy is not None and policy[0] != "none"
    model_axes = [a for a, n in cfg.mesh.sizes().items() if a != "data" and n not in (0, 1)]
    if ac.partition_activations and (not model_axes or not active):
        why = "no policy checkpoints the layers" if model_axes else "the mesh has no axis "
        why += "" if model_axes else "besides data to split the saved activations over"
        noted.append(("activation_checkpointing.partition_activations", why))
    stage = cfg.zero_optimization.stage
    # ``none`` still checkpoints the layers whose weights a stage gathers (see jzero.rewrite.remat).
    gathers = stages.stage_spec(stage).shard_params
    if ac.cpu_checkpointing and (policy is None or (not active and not gathers)):
        why = (
            "policy is null"
            if policy is None
            else f"policy {show(ac.policy)} checkpoints nothing at stage {stage}"
        )
        raise ConfigError(
            "activation_checkpointing.cpu_checkpointing: true keeps the activations a policy "
            f"saves in host memory, but {why}; set a policy (e.g. policy: full, DeepSpeed's "
            "checkpointing) or cpu_checkpointing: false."
        )


def _resolve_activation_checkpointing(cfg: Config, raw: Mapping[str, Any]) -> Config:
    """The section written without a ``policy`` key means ``full`` (see the decisions)."""
    section = raw.get("activation_checkpointing")
    if not isinstance(section, Mapping) or "policy" in section:
        return cfg
    ac = dataclasses.replace(cfg.activation_checkpointing, policy="full")
    return dataclasses.replace(cfg, activation_checkpointing=ac)


# Arguments of GPT-NeoX's YAML files that no DeepSpeed or jzero config has (with ``_`` for
# ``-``); the first two are in every such file.
_NEOX_PARALLEL = ("pipe_parallel_size", "model_parallel_size")
_NEOX_ARGS = frozenset({
    *_NEOX_PARALLEL, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
    "max_position_embeddings", "pos_emb", "norm", "train_iters", "lr_decay_iters",
    "lr_decay_style", "warmup", "min_lr", "data_path", "data_impl", "vocab_file", "merge_file",
    "tokenizer_type", "save", "load", "checkpoint_factor", "eval_iters", "log_interval",
    "split", "checkpoint_activations", "checkpoint_num_layers", "synchronize_each_layer",
    "scaled_upper_triang_masked_softmax_fusion", "bias_gelu_fusion", "no_weight_tying",
    "gpt_j_residual", "output_layer_parallelism", "attention_config", "init_method",
    "output_layer_init_method", "hidden_dropout", "attention_dropout", "distributed_backend",
})  # fmt: skip


def _top_level_keys() -> list[str]:
    return [
        f.metadata.get("key", f.name)
        for f in dataclasses.fields(Config)
        if not f.metadata.get("internal") and not f.metadata.get("rest")
    ]


def _drop_unknown_keys(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str]]:
    """The top level read as DeepSpeed reads it: a key it does not know is ignored, unless it
    is a near miss of a known key (left in, for ``_build`` to refuse with the suggestion).

    Returns:
      The config without the ignored keys, and their names.

    Raises:
      ConfigError: when the file looks like a GPT-NeoX arguments file (its arguments are
        what would be trained, and jzero reads none of them).
    """
    known = _top_level_keys()
    unknown = [key for key in raw if key not in known]
    neox = [str(key) for key in unknown if str(key).replace("-", "_") in _NEOX_ARGS]
    if len(neox) >= 3 and any(key.replace("-", "_") in _NEOX_PARALLEL for key in neox):
        ours = ", ".join(str(key) for key in raw if key in known)
        raise ConfigError(
            "This looks like a GPT-NeoX arguments file, not a DeepSpeed config: "
            f"{len(unknown)} of its top-level keys are GPT-NeoX's own arguments "
            f"({', '.join(neox[:3])}, ...: the model, data and schedule GPT-NeoX would build), "
            "which neither DeepSpeed nor jzero reads. Pass a DeepSpeed config instead: "
            f"{f'its DeepSpeed keys ({ours}) ' if ours else 'DeepSpeed keys '}in a file of "
            "their own, with jzero's model and data sections for the rest (see "
            "configs/zero2.yaml)."
        )
    ignored = [key for key in unknown if close_match(str(key), known) is None]
    if not ignored:
        return raw, []
    return {k: v for k, v in raw.items() if k not in ignored}, [str(k) for k in ignored]


def build_config(
    raw: Mapping[str, Any],
) -> tuple[Config, list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """Validates a raw config mapping.

    Args:
      raw: the config as plain dicts and lists, with DeepSpeed's key names.

    Returns:
      The ``Config``, the ``(dotted path, reason)`` of every no-effect key present, the
      ``(dotted path, new spelling)`` of every other spelling rewritten to jzero's key, and
      the unknown keys that were ignored (top-level ones, and dotted ones of the sections
      DeepSpeed reads key by key).

    Raises:
      ConfigError: for an unknown key (a near miss of a known one at the top level and in the
        sections DeepSpeed reads key by key), a wrong value or an impossible combination.
    """
    noted: list[tuple[str, str]] = []
    autos: list[str] = []
    raw, ignored = _drop_unknown_keys(raw)
    raw, renamed = _apply_aliases(raw)
    cfg = _build(Config, raw, "", (noted, autos, ignored), None)
    autos += _section_autos(cfg)
    cfg = dataclasses.replace(cfg, auto=tuple(autos))
    data_path = cfg.data.get("path")
    if isinstance(data_path, str) and data_path.startswith("~"):
        data = FrozenMap({**cfg.data, "path": os.path.expanduser(data_path)})
        cfg = dataclasses.replace(cfg, data=data)
    cfg = _resolve_activation_checkpointing(cfg, raw)
    cfg = resolve_zero(cfg, noted)
    _check_config(cfg, noted)
    return cfg, noted, renamed, ignored


def check_bf16(cfg: Any, *, auto_resolved: bool = False) -> None:
    """The ``bf16`` section's rule, in one place: ``bf16_optimizer_states`` and
    ``bf16_master_weights_and_grads`` need ``bf16.enabled: true``; ``stochastic_rounding``
    needs ``bf16_master_weights_and_grads``, which composes with neither fp16 nor the NVMe tier.

    When the config is loaded, a ``bf16.enabled: "auto"`` is not known yet and what depends on
    it waits: :func:`jzero.config.resolve_auto` calls this again with ``auto_resolved`` once
    the params decided it (the message then says "auto" resolved to false).
    """
    bf16 = cfg.bf16
    was_auto = "bf16.enabled" in cfg.auto
    needs_enabled = not bf16.enabled and (auto_resolved or not was_auto)

    def disabled(key: str, reason: str) -> ConfigError:
        why = (
            ', but bf16.enabled: "auto" resolved to false (the params are not all bfloat16);'
            if was_auto
            else f" ({reason});"
        )
        return ConfigError(
            f"bf16.{key} needs bf16.enabled: true{why} set bf16.enabled: true, or remove {key}."
        )

    if bf16.bf16_optimizer_states and needs_enabled:
        reason = "it keeps the optimizer state of bf16 mixed precision in bfloat16"
        raise disabled("bf16_optimizer_states", reason)
    if bf16.stochastic_rounding and not bf16.bf16_master_weights_and_grads:
        raise ConfigError(
            "bf16.stochastic_rounding rounds the bfloat16 master weights of "
            "bf16.bf16_master_weights_and_grads, which is off; set "
            "bf16_master_weights_and_grads: true, or remove stochastic_rounding."
        )
    if not bf16.bf16_master_weights_and_grads:
        return
    if cfg.fp16.enabled:
        raise ConfigError(
            "bf16.bf16_master_weights_and_grads with fp16.enabled: true is not supported: fp16 "
            "runs keep fp32 master weights (fp16 masters would need the loss scale inside the "
            "update). Use bf16: {enabled: true, bf16_master_weights_and_grads: true} without "
            "fp16, or remove bf16_master_weights_and_grads."
        )
    if needs_enabled:
        reason = "the bfloat16 params are then the master weights"
        raise disabled("bf16_master_weights_and_grads", reason)
    if cfg.zero_optimization.offload_optimizer.device == "nvme":
        raise ConfigError(
            "bf16.bf16_master_weights_and_grads does not compose with "
            "zero_optimization.offload_optimizer.device: nvme yet (its files hold fp32 "
            "masters); offload to cpu, or remove bf16_master_weights_and_grads."
        )
