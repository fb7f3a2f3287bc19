"""The jzero config schema: DeepSpeed's ``ds_config`` keys, read from YAML, JSON or a dict.

Decisions:

* **DeepSpeed's names, meanings and defaults.** Every key DeepSpeed documents keeps its name, its
  meaning and its default (checked against DeepSpeed 0.19.x), so an existing ``ds_config.json``
  loads unchanged. Two defaults changed in DeepSpeed 0.19.3 and jzero follows the new ones:
  ``gradient_clipping`` is 1.0 and ``offload_*.pin_memory`` is true. jzero's own sections
  (``mesh``, ``model``, ``data``, ``train``, ``checkpoint.directory`` ...) sit beside them.
* **Four kinds of key.** A key is *used*; or it has *no effect* under XLA (bucket sizes, overlap,
  prefetch limits, PyTorch switches): accepted, and ``load_config`` warns once, listing each
  such key present and why; or it is *not yet supported* by the engine (see
  ``NOT_YET_SUPPORTED`` and ``check_supported``); or it is *refused* (NVMe offload, deprecated
  aliases) with an error naming what is supported. Anything else is an unknown key: an error
  that names its dotted path and suggests the closest known key.
* **Plain frozen dataclasses, validated once.** A small validator walks the dataclass fields and
  their type hints; field metadata carries the extra rules (``min``, ``no_effect``, ``refuse``,
  the YAML ``key`` when it differs from the field name). Mappings are frozen, so a ``Config``
  is hashable and can be a static argument of ``jax.jit``.
* **One wall.** PyYAML is imported here and nowhere else. YAML floats such as ``3e-4`` (which
  PyYAML would read as strings) are read as floats; ``.json`` files are read with ``json``.
* Every user-input error raises ``ConfigError`` with a full sentence that ends with the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import types
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

__all__ = [
    "NOT_YET_SUPPORTED",
    "OPTIMIZER_PARAMS",
    "SCHEDULER_PARAMS",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "JzeroConfigWarning",
    "MeshConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
    "ZeroConfig",
    "check_supported",
    "load_config",
    "resolve_batch_sizes",
    "resolve_optimizer",
    "resolve_scheduler",
    "unsupported_features",
]


class ConfigError(ValueError):
    """A config value, key or combination that jzero cannot run; the message says the fix."""


class JzeroConfigWarning(UserWarning):
    """DeepSpeed settings that were accepted but have no effect in jzero."""


class FrozenMap(Mapping):
    """An immutable, hashable mapping (nested dicts and lists become FrozenMaps and tuples)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = {k: _freeze(v) for k, v in (data or {}).items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value if isinstance(value, FrozenMap) else FrozenMap(value)
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_thaw(v) for v in value]
    return value


def _f(default: Any = dataclasses.MISSING, *, factory: Any = None, **meta: Any) -> Any:
    """A dataclass field whose metadata carries the validation rules."""
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# Reasons shared by several no-effect keys.
_XLA_COLLECTIVES = "XLA schedules, buckets and fuses collectives itself"
_XLA_OVERLAP = "XLA's scheduler overlaps communication with compute itself"
_XLA_GATHER = (
    "stage 3 gathers each parameter where the compiled step uses it; XLA sizes the buffers"
)
_TORCH_ONLY = "it configures a PyTorch-specific mechanism with no JAX counterpart"
_NVME_ONLY = "it configures NVMe offload, which jzero does not have"
_NOT_IMPLEMENTED = "the DeepSpeed feature it configures is not implemented in jzero"
_MONITOR = "jzero logs metrics to train.log_dir instead of DeepSpeed's monitors"
_CKPT = "jzero checkpoints with Orbax, which restores onto any mesh"


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: host-memory offload."""

    device: Literal["none", "cpu", "nvme"] = _f(
        "none",
        refuse={"nvme": "NVMe offload (ZeRO-Infinity) has no XLA equivalent"},
    )
    """Where the state lives: "none" (device memory) or "cpu" (host memory). "nvme" is refused."""
    pin_memory: bool = True
    """Page-locked host memory (``pinned_host``); false uses ``unpinned_host``. DeepSpeed: true."""
    ratio: float = _f(1.0, min=0.0, max=1.0)
    """Fraction of the optimizer state to offload (DeepSpeed's partial offload, stage 3)."""
    nvme_path: str | None = _f(None, no_effect=_NVME_ONLY)
    """DeepSpeed: NVMe directory. No effect."""
    buffer_count: int = _f(5, min=0, no_effect=_NVME_ONLY)
    """DeepSpeed: NVMe buffer pool size (5 for params, 4 for optimizer state). No effect."""
    buffer_size: int = _f(100_000_000, min=0, no_effect=_NVME_ONLY)
    """DeepSpeed: NVMe buffer size in elements. No effect."""
    max_in_cpu: int = _f(1_000_000_000, min=0, no_effect=_NVME_ONLY)
    """DeepSpeed: parameter elements kept in CPU memory with NVMe offload. No effect."""
    pipeline_read: bool = _f(False, no_effect=_NVME_ONLY)
    """DeepSpeed: overlap NVMe reads with the optimizer step. No effect."""
    pipeline_write: bool = _f(False, no_effect=_NVME_ONLY)
    """DeepSpeed: overlap NVMe writes with the optimizer step. No effect."""
    fast_init: bool = _f(False, no_effect=_NVME_ONLY)
    """DeepSpeed: fast optimizer initialisation with NVMe offload. No effect."""
    super_offload: bool = _f(False, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed: SuperOffload for Superchips. No effect."""
    cpuadam_cores_perc: float = _f(0.8, min=0.0, max=1.0, no_effect=_TORCH_ONLY)
    """DeepSpeed: share of CPU cores for CPU Adam. No effect."""


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: what is sharded over the data axis, and where it lives."""

    stage: Literal[0, 1, 2, 3] = 0
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters."""
    stage3_param_persistence_threshold: int = _f(100_000, min=0)
    """Stage 3: parameters with fewer elements than this stay replicated (DeepSpeed: 1e5)."""
    offload_optimizer: OffloadConfig = _f(factory=OffloadConfig)
    """Optimizer-state offload to host memory (stages 1-3)."""
    offload_param: OffloadConfig = _f(factory=OffloadConfig)
    """Parameter offload to host memory (stage 3 only)."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Stage 3: gather the full weights when the model is saved for export."""
    allgather_partitions: bool = _f(True, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: all-gather vs. broadcasts after the step. No effect."""
    allgather_bucket_size: int = _f(500_000_000, min=0, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: elements per all-gather bucket. No effect."""
    reduce_scatter: bool = _f(
        True, no_effect=_XLA_COLLECTIVES + "; the stage decides the reduction"
    )
    """DeepSpeed: reduce-scatter vs. all-reduce for gradients. No effect (the stage decides)."""
    reduce_bucket_size: int = _f(500_000_000, min=0, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: elements per reduction bucket. No effect."""
    use_multi_rank_bucket_allreduce: bool = _f(True, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: merge reduce buckets of ranks into one all-reduce. No effect."""
    overlap_comm: bool | None = _f(None, no_effect=_XLA_OVERLAP)
    """DeepSpeed: overlap gradient reduction with backward (default: true at stage 3). No effect."""
    contiguous_gradients: bool = _f(True, no_effect="XLA allocates gradient buffers itself")
    """DeepSpeed: copy gradients into one contiguous buffer. No effect."""
    round_robin_gradients: bool = _f(False, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: parallel gradient copies for CPU offload. No effect."""
    sub_group_size: int = _f(
        1_000_000_000, min=0, no_effect="the optimizer step is one compiled op"
    )
    """DeepSpeed: tile size of the offloaded optimizer step. No effect."""
    stage3_prefetch_bucket_size: int = _f(50_000_000, min=0, no_effect=_XLA_GATHER)
    """DeepSpeed: elements fetched ahead of use at stage 3. No effect."""
    stage3_max_live_parameters: int = _f(1_000_000_000, min=0, no_effect=_XLA_GATHER)
    """DeepSpeed: gathered elements kept live at stage 3. No effect."""
    stage3_max_reuse_distance: int = _f(1_000_000_000, min=0, no_effect=_XLA_GATHER)
    """DeepSpeed: keep a gathered parameter if reused within this distance. No effect."""
    stage3_model_persistence_threshold: int = _f(
        2**63 - 1, min=0, no_effect="jzero bounds persistence per parameter only"
    )
    """DeepSpeed: cap on the total persisted (unsharded) elements at stage 3. No effect."""
    stage3_module_granularity_threshold: int = _f(0, min=0, no_effect=_XLA_GATHER)
    """DeepSpeed: fetch fine-grained modules as one unit. No effect."""
    stage3_use_all_reduce_for_fetch_params: bool = _f(False, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: fetch parameters with all-reduce. No effect."""
    stage3_allgather_sequential: bool = _f(False, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: gather parameters one at a time without buckets. No effect."""
    load_from_fp32_weights: bool = _f(True, no_effect=_CKPT + " and always keeps fp32 state")
    """DeepSpeed: initialise fp32 master weights from fp32 checkpoint copies. No effect."""
    elastic_checkpoint: bool = _f(False, no_effect=_CKPT)
    """DeepSpeed: legacy elastic checkpoints. No effect."""
    ignore_unused_parameters: bool = _f(True, no_effect="unused parameters get zero gradients")
    """DeepSpeed: tolerate parameters without gradients. No effect."""
    legacy_stage1: bool = _f(False, no_effect=_TORCH_ONLY)
    """DeepSpeed: old stage-1 implementation. No effect."""
    grad_hooks: bool = _f(True, no_effect=_TORCH_ONLY)
    """DeepSpeed: gradient hooks for reduction. No effect."""
    zero_hpz_partition_size: int = _f(1, min=0, no_effect=_NOT_IMPLEMENTED + " (ZeRO++ hpZ)")
    """DeepSpeed ZeRO++: secondary partition size. No effect."""
    zero_quantized_weights: bool = _f(False, no_effect=_NOT_IMPLEMENTED + " (ZeRO++ qwZ)")
    """DeepSpeed ZeRO++: quantized weight all-gather. No effect."""
    zero_quantized_nontrainable_weights: bool = _f(False, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed ZeRO++: store frozen weights quantized. No effect."""
    zero_quantized_gradients: bool = _f(False, no_effect=_NOT_IMPLEMENTED + " (ZeRO++ qgZ)")
    """DeepSpeed ZeRO++: quantized gradient reduction. No effect."""
    zeropp_loco_param: Mapping[str, Any] | None = _f(None, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed ZeRO++: LoCo error feedback. No effect."""
    mics_shard_size: int = _f(-1, no_effect=_NOT_IMPLEMENTED + " (MiCS)")
    """DeepSpeed MiCS: shard group size. No effect."""
    mics_hierarchical_params_gather: bool = _f(False, no_effect=_NOT_IMPLEMENTED + " (MiCS)")
    """DeepSpeed MiCS: hierarchical gather. No effect."""
    memory_efficient_linear: bool = _f(True, no_effect=_TORCH_ONLY)
    """DeepSpeed: memory-efficient linear layer at stage 3. No effect."""
    pipeline_loading_checkpoint: bool = _f(False, no_effect=_CKPT)
    """DeepSpeed: load checkpoints in pipeline mode. No effect."""
    override_module_apply: bool = _f(True, no_effect=_TORCH_ONLY)
    """DeepSpeed: override ``nn.Module.apply`` at stage 3. No effect."""
    log_trace_cache_warnings: bool = _f(False, no_effect=_TORCH_ONLY)
    """DeepSpeed: log stage-3 trace-cache warnings. No effect."""
    enable_sanity_checks: bool = _f(False, no_effect=_TORCH_ONLY)
    """DeepSpeed: internal sanity checks. No effect."""
    save_muon_momentum_buffer_in_memory: bool = _f(False, no_effect=_NVME_ONLY)
    """DeepSpeed: keep the Muon momentum off NVMe. No effect."""
    zenflow: Mapping[str, Any] | None = _f(None, no_effect=_NOT_IMPLEMENTED + " (ZenFlow)")
    """DeepSpeed ZenFlow settings. No effect."""
    leaf_module: Mapping[str, Any] | None = _f(None, no_effect=_TORCH_ONLY)
    """DeepSpeed: modules treated as stage-3 leaves. No effect."""


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: a DeepSpeed optimizer name and its parameters (see ``OPTIMIZER_PARAMS``)."""

    type: str
    """Optimizer name, case-insensitive: Adam, AdamW, Lamb, SGD, Adagrad, Lion."""
    params: Mapping[str, Any] = _f(factory=FrozenMap)
    """Constructor parameters with DeepSpeed / PyTorch names (lr, betas, eps, weight_decay ...)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: a DeepSpeed LR schedule name and its parameters (see ``SCHEDULER_PARAMS``)."""

    type: str
    """Schedule name: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest."""
    params: Mapping[str, Any] = _f(factory=FrozenMap)
    """Schedule parameters with DeepSpeed's names."""


@dataclass(frozen=True)
class BF16Config:
    """``bf16``: bfloat16 mixed precision (no loss scaling)."""

    enabled: bool = False
    """Compute in bfloat16 with fp32 master weights."""
    skip_nonfinite: bool = False
    """jzero's own: skip the update when a gradient is inf/NaN (DeepSpeed's bf16 never skips)."""
    immediate_grad_update: bool = _f(True, no_effect=_TORCH_ONLY)
    """DeepSpeed: apply gradients as they arrive. No effect."""
    check_grad_overflow: bool = _f(False, no_effect="use skip_nonfinite instead")
    """DeepSpeed: check bf16 gradients for overflow. No effect; see skip_nonfinite."""
    bf16_master_weights_and_grads: bool = _f(False, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed: keep master weights in bf16. No effect."""
    bf16_optimizer_states: bool = _f(False, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed: keep optimizer states in bf16. No effect."""


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: float16 mixed precision with (dynamic) loss scaling, DeepSpeed's defaults."""

    enabled: bool = False
    """Compute in float16 with fp32 master weights and loss scaling."""
    loss_scale: float = _f(0.0, min=0.0)
    """0 means dynamic loss scaling; any other value is a fixed loss scale."""
    initial_scale_power: int = _f(16, min=0)
    """The dynamic loss scale starts at 2**initial_scale_power."""
    loss_scale_window: int = _f(1000, min=1)
    """Steps without overflow before the dynamic loss scale is doubled."""
    hysteresis: int = _f(2, min=1)
    """Overflows tolerated before the dynamic loss scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: float = _f(1.0, min=0.0)
    """Lower bound of the dynamic loss scale."""
    auto_cast: bool = _f(False, no_effect="the model's dtype decides what its inputs are cast to")
    """DeepSpeed: cast inputs to fp16. No effect."""
    fp16_master_weights_and_grads: bool = _f(False, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed: keep master weights in fp16. No effect."""


@dataclass(frozen=True)
class DataTypesConfig:
    """``data_types``."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    """Dtype of the gradient accumulator; None: the parameter dtype."""


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: DeepSpeed's keys; in JAX the model chooses its remat."""

    partition_activations: bool = _f(
        False, no_effect="activations are not split over model parallelism"
    )
    """DeepSpeed: partition checkpointed activations over model-parallel ranks. No effect."""
    cpu_checkpointing: bool = _f(False, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed: keep checkpointed activations in CPU memory. No effect."""
    contiguous_memory_optimization: bool = _f(False, no_effect="XLA allocates activations itself")
    """DeepSpeed: copy checkpoints into one buffer. No effect."""
    number_checkpoints: int | None = _f(None, min=0, no_effect="the model's jax.checkpoint decides")
    """DeepSpeed: number of checkpoints for the contiguous buffer. No effect."""
    synchronize_checkpoint_boundary: bool = _f(False, no_effect=_TORCH_ONLY)
    """DeepSpeed: synchronise at checkpoint boundaries. No effect."""
    profile: bool = _f(False, no_effect=_TORCH_ONLY)
    """DeepSpeed: time the checkpoint functions. No effect."""


@dataclass(frozen=True)
class MeshConfig:
    """``mesh``: jzero's device mesh."""

    data: int = _f(-1, min=-1, nonzero=True)
    """Size of the data-parallel axis; -1 uses all devices."""


@dataclass(frozen=True)
class TrainConfig:
    """``train``: jzero's training-loop settings (``jzero train``)."""

    steps: int = _f(200, min=1)
    """Optimizer steps to run."""
    eval_interval: int = _f(50, min=0)
    """Evaluate every this many steps; 0 disables evaluation."""
    eval_batches: int = _f(4, min=1)
    """Batches per evaluation."""
    log_dir: str = "runs/default"
    """Directory for logs and metrics."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: jzero's Orbax checkpointing, plus DeepSpeed's own checkpoint keys."""

    directory: str | None = None
    """Checkpoint directory; None disables checkpointing."""
    save_interval_steps: int = _f(0, min=0)
    """Save every this many steps; 0 saves only at the end (when a directory is set)."""
    max_to_keep: int | None = _f(3, min=1)
    """Checkpoints kept on disk; None keeps all."""
    async_: bool = _f(True, key="async")
    """Save in the background while training continues (YAML key ``async``)."""
    tag_validation: str = _f("Warn", no_effect=_CKPT)
    """DeepSpeed: check that ranks agree on the checkpoint tag. No effect."""
    load_universal: bool = _f(False, no_effect=_CKPT)
    """DeepSpeed: load a universal checkpoint. No effect (every checkpoint reshards)."""
    use_node_local_storage: bool = _f(False, no_effect=_CKPT)
    """DeepSpeed: write checkpoints to node-local storage. No effect."""
    parallel_write: Mapping[str, Any] | None = _f(None, no_effect=_CKPT)
    """DeepSpeed: parallel checkpoint writing. No effect."""


_AUTO = {"auto": True}


@dataclass(frozen=True)
class Config:
    """A whole jzero training config: DeepSpeed's ``ds_config`` keys plus jzero's sections."""

    train_batch_size: int | None = _f(None, min=1, **_AUTO)
    """Global batch per optimizer step = micro x accumulation x data-parallel size; "auto" ok."""
    train_micro_batch_size_per_gpu: int | None = _f(None, min=1, **_AUTO)
    """Batch per device per forward/backward pass; "auto" ok."""
    gradient_accumulation_steps: int | None = _f(None, min=1, **_AUTO)
    """Micro-batches accumulated per optimizer step; "auto" ok."""
    gradient_clipping: float = _f(1.0, min=0.0)
    """Clip the global gradient norm to this value; 0 disables (DeepSpeed >= 0.19.3: 1.0)."""
    steps_per_print: int | None = _f(10, min=1)
    """Log every this many steps; None never."""
    seed: int = 0
    """Seed for parameter initialisation and data order."""
    zero_optimization: ZeroConfig = _f(factory=ZeroConfig)
    """ZeRO stage and offload."""
    optimizer: OptimizerConfig | None = None
    """The optimizer; None: the engine needs one passed in code."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; None: constant ``optimizer.params.lr``."""
    bf16: BF16Config = _f(factory=BF16Config)
    """bfloat16 mixed precision."""
    fp16: FP16Config = _f(factory=FP16Config)
    """float16 mixed precision."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """Dtype of gradient reductions; None: the gradient dtype."""
    data_types: DataTypesConfig = _f(factory=DataTypesConfig)
    """Accumulation dtypes."""
    activation_checkpointing: ActivationCheckpointingConfig = _f(
        factory=ActivationCheckpointingConfig
    )
    """DeepSpeed's activation-checkpointing keys (no effect: the model chooses its remat)."""
    mesh: MeshConfig = _f(factory=MeshConfig)
    """Device mesh."""
    model: Mapping[str, Any] = _f(factory=FrozenMap)
    """Built-in GPT settings (vocab_size, seq_len, num_layers, num_heads, d_model, d_ff ...)."""
    data: Mapping[str, Any] = _f(factory=FrozenMap)
    """Data settings for ``jzero train`` (source, path ...)."""
    train: TrainConfig = _f(factory=TrainConfig)
    """Training-loop settings."""
    checkpoint: CheckpointConfig = _f(factory=CheckpointConfig)
    """Checkpointing."""
    # DeepSpeed's top-level keys that have no effect in jzero.
    wall_clock_breakdown: bool = _f(False, no_effect="profile with jax.profiler instead")
    """DeepSpeed: time forward/backward/step. No effect."""
    memory_breakdown: bool = _f(False, no_effect="use `jzero plan` for the memory report")
    """DeepSpeed: print memory use. No effect."""
    dump_state: bool = _f(False, no_effect=_TORCH_ONLY)
    """DeepSpeed: print the engine state. No effect."""
    prescale_gradients: bool = _f(False, no_effect="it only changes fp16 rounding")
    """DeepSpeed: scale gradients before the mean reduction. No effect."""
    gradient_predivide_factor: float = _f(1.0, no_effect="it only changes fp16 rounding")
    """DeepSpeed: divide gradients before the mean reduction. No effect."""
    sparse_gradients: bool = _f(False, no_effect="JAX gradients are dense")
    """DeepSpeed: sparse embedding gradients. No effect."""
    disable_allgather: bool = _f(False, no_effect=_XLA_COLLECTIVES)
    """DeepSpeed: broadcast instead of all-gather. No effect."""
    zero_allow_untested_optimizer: bool = _f(
        False, no_effect="every optax optimizer works with ZeRO"
    )
    """DeepSpeed: allow optimizers untested with ZeRO. No effect."""
    zero_force_ds_cpu_optimizer: bool = _f(True, no_effect=_TORCH_ONLY)
    """DeepSpeed: force DeepSpeed's CPU optimizer with offload. No effect."""
    dataloader_drop_last: bool = _f(
        False, no_effect="jzero's data loader always drops the last batch"
    )
    """DeepSpeed: drop the last incomplete batch. No effect."""
    amp: Mapping[str, Any] | None = _f(None, no_effect="Apex AMP is PyTorch-only; use bf16 or fp16")
    """DeepSpeed: Apex AMP. No effect."""
    torch_autocast: Mapping[str, Any] | None = _f(None, no_effect="use bf16 or fp16")
    """DeepSpeed: torch.autocast. No effect."""
    compile: Mapping[str, Any] | None = _f(None, no_effect="jzero always compiles with XLA")
    """DeepSpeed: torch.compile settings. No effect."""
    elasticity: Mapping[str, Any] | None = _f(None, no_effect=_NOT_IMPLEMENTED + " (elastic batch)")
    """DeepSpeed: elastic training. No effect."""
    aio: Mapping[str, Any] | None = _f(None, no_effect=_NVME_ONLY)
    """DeepSpeed: asynchronous NVMe I/O. No effect."""
    flops_profiler: Mapping[str, Any] | None = _f(None, no_effect="profile with jax.profiler")
    """DeepSpeed: FLOPs profiler. No effect."""
    comms_logger: Mapping[str, Any] | None = _f(None, no_effect="collectives are read from HLO")
    """DeepSpeed: communication logger. No effect."""
    autotuning: Mapping[str, Any] | None = _f(None, no_effect=_NOT_IMPLEMENTED)
    """DeepSpeed: autotuner. No effect."""
    tensorboard: Mapping[str, Any] | None = _f(None, no_effect=_MONITOR)
    """DeepSpeed monitor. No effect."""
    wandb: Mapping[str, Any] | None = _f(None, no_effect=_MONITOR)
    """DeepSpeed monitor. No effect."""
    csv_monitor: Mapping[str, Any] | None = _f(None, no_effect=_MONITOR)
    """DeepSpeed monitor. No effect."""
    comet: Mapping[str, Any] | None = _f(None, no_effect=_MONITOR)
    """DeepSpeed monitor. No effect."""

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as plain dicts and lists with the YAML key names.

        No-effect DeepSpeed keys appear only when they differ from their default, so
        ``load_config(cfg.to_dict()) == cfg``.
        """
        return _to_dict(self)


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.metadata.get("no_effect") and value == _default_of(f):
                continue
            out[f.metadata.get("key", f.name)] = _to_dict(value)
        return out
    return _thaw(obj)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# --------------------------------------------------------------------------------------------
# Optimizers and schedulers: names, parameters and DeepSpeed's defaults (optim.py maps them)
# --------------------------------------------------------------------------------------------

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
}
"""Supported optimizers (lower-case names): parameter -> (kind, DeepSpeed/PyTorch default)."""

_OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "sgd": "SGD"}
_OPTIMIZER_NAMES |= {"adagrad": "Adagrad", "lion": "Lion"}
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


def _check_param(kind: str, value: Any, path: str) -> Any:
    """Validates one optimizer/scheduler parameter of the given kind; returns it normalised."""
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    if kind == "float" and _is_number(value):
        return float(value)
    if kind == "int" and _is_number(value) and float(value).is_integer():
        return int(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "warmup_type" and value in ("log", "linear"):
        return value
    if (
        kind == "betas"
        and isinstance(value, list | tuple)
        and len(value) == 2
        and all(_is_number(v) for v in value)
    ):
        return (float(value[0]), float(value[1]))
    allowed = {
        "float": "a number",
        "int": "an integer",
        "bool": "true or false",
        "warmup_type": "one of 'log', 'linear'",
        "betas": "a list of two numbers, e.g. [0.9, 0.999]",
    }[kind]
    raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be {allowed}.")


def resolve_optimizer(
    opt: OptimizerConfig, path: str = "optimizer", *, no_effect: list | None = None
) -> tuple[str, dict[str, Any]]:
    """Validates an optimizer section and fills in DeepSpeed's defaults.

    Args:
      opt: the ``optimizer`` section.
      path: its dotted path, for messages.
      no_effect: if given, (path, reason) pairs of accepted no-effect params are appended.

    Returns:
      The lower-case optimizer name and every parameter with its value or default.

    Raises:
      ConfigError: for an unknown name, an unknown parameter or a wrong value.
    """
    name = opt.type.lower() if isinstance(opt.type, str) else opt.type
    if name not in OPTIMIZER_PARAMS:
        names = ", ".join(_OPTIMIZER_NAMES.values())
        raise ConfigError(
            f"{path}.type: {_show(opt.type)} is not a supported optimizer; it must be one of "
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
                f"{sub} is not a parameter of {_OPTIMIZER_NAMES[name]}{_suggest(key, spec)}; "
                f"the allowed parameters are {', '.join(spec)}."
            )
        params[key] = _check_param(spec[key][0], value, sub)
    if params.get("amsgrad"):
        raise ConfigError(
            f"{path}.params.amsgrad: true is not supported (DeepSpeed's fused optimizers refuse "
            "it too); set it to false or remove it."
        )
    resolved = {k: params.get(k, default) for k, (_, default) in spec.items()}
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
    sched: SchedulerConfig, path: str = "scheduler"
) -> tuple[str, dict[str, Any]]:
    """Validates a scheduler section and fills in DeepSpeed's defaults.

    Args:
      sched: the ``scheduler`` section.
      path: its dotted path, for messages.

    Returns:
      The canonical schedule name and every parameter with its value or default.

    Raises:
      ConfigError: for an unknown name or parameter, a missing required one or a wrong value.
    """
    canon = {n.lower(): n for n in SCHEDULER_PARAMS}
    name = canon.get(sched.type.lower()) if isinstance(sched.type, str) else None
    if name is None:
        raise ConfigError(
            f"{path}.type: {_show(sched.type)} is not a supported LR schedule; it must be one of "
            f"{', '.join(SCHEDULER_PARAMS)}."
        )
    spec = SCHEDULER_PARAMS[name]
    params = {}
    for key, value in sched.params.items():
        sub = f"{path}.params.{key}"
        if key not in spec:
            raise ConfigError(
                f"{sub} is not a parameter of {name}{_suggest(key, spec)}; the allowed "
                f"parameters are {', '.join(spec)}."
            )
        params[key] = _check_param(spec[key][0], value, sub)
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


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: Any) -> str:
    """Renders a value as the user wrote it in YAML/JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    return repr(value)


def _suggest(key: str, known: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_number_range(value: int | float, meta: Mapping[str, Any], path: str) -> None:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo or hi is not None and value > hi:
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be {bounds}.")
    if meta.get("nonzero") and value == 0:
        raise ConfigError(f"{path}: 0 is not allowed; it must be -1 (all devices) or >= 1.")


def _coerce(value: Any, tp: Any, path: str, meta: Mapping[str, Any], noted: list) -> Any:
    """Checks ``value`` against the type hint ``tp``; returns the normalised value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], path, meta, noted)
    if origin is Literal:
        allowed = typing.get_args(tp)
        norm = value.lower() if isinstance(value, str) else value
        if _is_number(norm) and float(norm).is_integer():
            norm = int(norm)
        if isinstance(value, bool) or norm not in allowed:
            options = ", ".join(_show(a) for a in allowed if a not in meta.get("refuse", {}))
            raise ConfigError(
                f"{path}: {_show(value)} is not allowed; it must be one of {options}."
            )
        if norm in meta.get("refuse", {}):
            raise ConfigError(
                f"{path}: {_show(norm)} is not supported: {meta['refuse'][norm]}; jzero supports "
                f"{' or '.join(_show(a) for a in allowed if a not in meta['refuse'])}, so set one "
                "of those."
            )
        return norm
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, noted)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be true or false.")
        return value
    if tp is int:
        if not (_is_number(value) and float(value).is_integer()):
            raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be an integer.")
        _check_number_range(int(value), meta, path)
        return int(value)
    if tp is float:
        if not _is_number(value):
            raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be a number.")
        _check_number_range(float(value), meta, path)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be a string.")
        return value
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: {_show(value)} is not allowed; it must be a mapping.")
        return FrozenMap(value)
    raise TypeError(f"jzero.config has no rule for the type {tp!r} of {path}.")  # our bug


_DEPRECATED = {
    "zero_optimization.cpu_offload": "offload_optimizer: {device: cpu}",
    "zero_optimization.cpu_offload_param": "offload_param: {device: cpu}",
    "zero_optimization.cpu_offload_use_pin_memory": "pin_memory under offload_optimizer/param",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "stage3_gather_16bit_weights_on_model_save"
    ),
}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else str(key)


def _build(cls: type, raw: Any, path: str, noted: list) -> Any:
    """Builds dataclass ``cls`` from the mapping ``raw``; no-effect keys go to ``noted``."""
    if not isinstance(raw, Mapping):
        where = path or "The config"
        raise ConfigError(f"{where}: {_show(raw)} is not allowed; it must be a mapping of keys.")
    hints = typing.get_type_hints(cls)
    by_key = {f.metadata.get("key", f.name): f for f in dataclasses.fields(cls)}
    errors = []
    for key in raw:
        sub = _join(path, key)
        if sub in _DEPRECATED:
            errors.append(f"{sub} is a deprecated DeepSpeed key; write {_DEPRECATED[sub]} instead.")
        elif key not in by_key:
            errors.append(
                f"{sub} is not a known key{_suggest(str(key), by_key)}; remove it or fix its name."
            )
    if errors:
        raise ConfigError("\n".join(errors))
    kwargs = {}
    for key, f in by_key.items():
        if key not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{_join(path, key)} is required; set it.")
            continue
        value = raw[key]
        sub = _join(path, key)
        if f.metadata.get("auto") and value == "auto":
            value = None
        kwargs[f.name] = _coerce(value, hints[f.name], sub, f.metadata, noted)
        reason = f.metadata.get("no_effect")
        disabled = isinstance(value, Mapping) and value.get("enabled") is False
        if reason and not disabled:
            noted.append((sub, reason))
    return cls(**kwargs)


_MODEL_INTS = ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model", "d_ff")


def _check_config(cfg: Config, noted: list) -> None:
    """Cross-field rules, and the optimizer/scheduler/model sections."""
    zero = cfg.zero_optimization
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true, but only one precision can be used; "
            "set one of them to false."
        )
    if zero.offload_param.device != "none" and zero.stage != 3:
        raise ConfigError(
            f"zero_optimization.offload_param.device: {_show(zero.offload_param.device)} needs "
            f"stage 3, but zero_optimization.stage is {zero.stage}; set stage: 3 or device: none."
        )
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError(
            "zero_optimization.offload_optimizer.device: "
            f"{_show(zero.offload_optimizer.device)} needs stage 1, 2 or 3, but "
            "zero_optimization.stage is 0; set stage to 1, 2 or 3, or device: none."
        )
    if zero.offload_optimizer.ratio < 1.0 and zero.stage != 3:
        raise ConfigError(
            f"zero_optimization.offload_optimizer.ratio: {zero.offload_optimizer.ratio} (partial "
            "offload) needs stage 3, as in DeepSpeed; set stage: 3 or ratio: 1.0."
        )
    if cfg.optimizer is not None:
        resolve_optimizer(cfg.optimizer, no_effect=noted)
    if cfg.scheduler is not None:
        resolve_scheduler(cfg.scheduler)
    for key in _MODEL_INTS:
        value = cfg.model.get(key)
        if value is not None and not (_is_number(value) and value == int(value) and value >= 1):
            raise ConfigError(
                f"model.{key}: {_show(value)} is not allowed; it must be a positive integer."
            )
    heads, width = cfg.model.get("num_heads"), cfg.model.get("d_model")
    if heads and width and width % heads:
        raise ConfigError(
            f"model.d_model: {width} is not divisible by model.num_heads ({heads}); choose a "
            "d_model that is a multiple of num_heads."
        )


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``3e-4`` and ``1E5`` as floats (YAML 1.2), not as strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _read_file(path: str | os.PathLike) -> Any:
    text_path = os.fspath(path)
    if not os.path.isfile(text_path):
        raise ConfigError(
            f"The config file {text_path!r} does not exist; pass the path of a YAML or JSON "
            "config, e.g. configs/zero2.yaml."
        )
    with open(text_path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        if text_path.endswith(".json"):
            return json.loads(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(
            f"The config file {text_path!r} is not valid YAML/JSON: {err}. Fix the syntax there."
        ) from None


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


def _apply_override(raw: dict, override: str) -> None:
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"The override {override!r} is not of the form dotted.key=value; write it like "
            "zero_optimization.stage=3."
        )
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(
                f"The override {override!r} goes into {where}, which is {_show(child)}, not a "
                "mapping; override that key itself instead."
            )
        node = child
    node[parts[-1]] = _parse_scalar(text.strip())


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Loads, validates and freezes a config.

    Args:
      source: a YAML or JSON file, a mapping with DeepSpeed's keys, a ``Config``, or None
        (all defaults).
      overrides: ``"dotted.key=value"`` strings applied on top, the value read as a YAML
        scalar (as ``jzero train CONFIG --set key=value`` passes them).

    Returns:
      The validated ``Config``.

    Raises:
      ConfigError: for an unknown key, a wrong value or an impossible combination.

    Warns:
      JzeroConfigWarning: once, listing every DeepSpeed key present that has no effect in jzero.

    Example:
      >>> cfg = load_config({"train_micro_batch_size_per_gpu": 4}, ["zero_optimization.stage=2"])
      >>> cfg.zero_optimization.stage
      2
    """
    if isinstance(source, Config) and not overrides:
        return source
    if isinstance(source, Config):
        raw: Any = source.to_dict()
    elif source is None:
        raw = {}
    elif isinstance(source, Mapping):
        raw = _thaw(source)
    elif isinstance(source, str | os.PathLike):
        raw = _read_file(source)
        raw = {} if raw is None else raw
    else:
        raise ConfigError(
            f"load_config got a {type(source).__name__}; pass a file path, a mapping or a Config."
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"The config must be a mapping of keys at the top level, not {_show(raw)}; write "
            "it as `key: value` lines (YAML) or a JSON object."
        )
    if "bfloat16" in raw:  # DeepSpeed's old name for bf16
        if "bf16" in raw:
            raise ConfigError("Both bf16 and bfloat16 (its old name) are set; keep only bf16.")
        raw["bf16"] = raw.pop("bfloat16")
    for override in overrides:
        _apply_override(raw, override)
    noted: list[tuple[str, str]] = []
    cfg = _build(Config, raw, "", noted)
    _check_config(cfg, noted)
    if noted:
        lines = "\n".join(f"  - {path}: {reason}." for path, reason in noted)
        warnings.warn(
            "These DeepSpeed settings have no effect in jzero and are ignored:\n"
            f"{lines}\nRemove them to silence this warning.",
            JzeroConfigWarning,
            stacklevel=2,
        )
    return cfg


# --------------------------------------------------------------------------------------------
# Batch sizes
# --------------------------------------------------------------------------------------------


def _nearest_multiple(value: int, base: int) -> int:
    return max(base, round(value / base) * base)


def resolve_batch_sizes(cfg: Config, data_parallel_size: int) -> tuple[int, int, int]:
    """Resolves DeepSpeed's batch rule: train_batch_size = micro x accumulation x dp.

    Any two of the three determine the third. With only one: accumulation defaults to 1, and
    only ``train_batch_size`` gives micro = train_batch_size / dp (DeepSpeed's behaviour).

    Args:
      cfg: the config.
      data_parallel_size: the size of the data axis (devices holding distinct batches).

    Returns:
      (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps).

    Raises:
      ConfigError: when nothing is set, or the values do not fit together.
    """
    tbs, micro, accum = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    dp = data_parallel_size
    if tbs is None and micro is None:
        raise ConfigError(
            "No batch size is set; set train_micro_batch_size_per_gpu (the batch per device) "
            "or train_batch_size (the global batch), optionally with gradient_accumulation_steps."
        )

    def show(value: int | None) -> str:
        return "auto" if value is None else str(value)

    def mismatch(detail: str, fix: str) -> ConfigError:
        return ConfigError(
            f"The batch sizes do not fit together: train_batch_size={show(tbs)}, "
            f"train_micro_batch_size_per_gpu={show(micro)}, "
            f"gradient_accumulation_steps={show(accum)}, with a data-parallel size of {dp}. "
            "DeepSpeed's rule is train_batch_size = train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x data-parallel size, {detail}. {fix}"
        )

    if tbs is None:
        steps = 1 if accum is None else accum  # DeepSpeed's default
        return micro * steps * dp, micro, steps
    if micro is None:
        steps = 1 if accum is None else accum  # DeepSpeed's default
        if tbs % (steps * dp):
            raise mismatch(
                f"but {tbs} is not divisible by {steps} x {dp} = {steps * dp}",
                f"Fix: set train_batch_size to a multiple of {steps * dp} (e.g. "
                f"{_nearest_multiple(tbs, steps * dp)}), or change gradient_accumulation_steps.",
            )
        return tbs, tbs // (steps * dp), steps
    if accum is None:
        if tbs % (micro * dp):
            raise mismatch(
                f"but {tbs} is not divisible by {micro} x {dp} = {micro * dp}",
                f"Fix: set train_batch_size to a multiple of {micro * dp} (e.g. "
                f"{_nearest_multiple(tbs, micro * dp)}), or change train_micro_batch_size_per_gpu.",
            )
        return tbs, micro, tbs // (micro * dp)
    if tbs != micro * accum * dp:
        raise mismatch(
            f"but {micro} x {accum} x {dp} = {micro * accum * dp}",
            f"Fix: set train_batch_size to {micro * accum * dp}, or set one of the three to "
            '"auto" (or remove it) and jzero derives it.',
        )
    return tbs, micro, accum


# --------------------------------------------------------------------------------------------
# What the engine cannot honour yet
# --------------------------------------------------------------------------------------------


def _offload_check(which: str, what: str) -> Any:
    def check(cfg: Config) -> str | None:
        device = getattr(cfg.zero_optimization, which).device
        if device == "none":
            return None
        return f"{device!r} ({what} offload to host memory) is not implemented yet; set none"

    return check


def _precision_check(which: str) -> Any:
    def check(cfg: Config) -> str | None:
        if not getattr(cfg, which).enabled:
            return None
        return f"true ({which} mixed precision) is not implemented yet; set it to false"

    return check


_FEATURE_CHECKS: dict[str, tuple[str, Any]] = {
    "zero_optimization.offload_optimizer": (
        "zero_optimization.offload_optimizer.device",
        _offload_check("offload_optimizer", "optimizer-state"),
    ),
    "zero_optimization.offload_param": (
        "zero_optimization.offload_param.device",
        _offload_check("offload_param", "parameter"),
    ),
    "fp16": ("fp16.enabled", _precision_check("fp16")),
    "bf16": ("bf16.enabled", _precision_check("bf16")),
    "communication_data_type": (
        "communication_data_type",
        lambda cfg: (
            None
            if cfg.communication_data_type in (None, "fp32")
            else f"{cfg.communication_data_type!r} is not implemented yet; set fp32 or remove it"
        ),
    ),
    "data_types.grad_accum_dtype": (
        "data_types.grad_accum_dtype",
        lambda cfg: (
            None
            if cfg.data_types.grad_accum_dtype is None
            else f"{cfg.data_types.grad_accum_dtype!r} is not implemented yet; remove it"
        ),
    ),
}

NOT_YET_SUPPORTED: set[str] = set(_FEATURE_CHECKS)
"""Config features the engine cannot honour yet; remove a name here when its feature lands."""


def unsupported_features(cfg: Config) -> list[str]:
    """Lists the settings in ``cfg`` that the engine cannot honour yet.

    Args:
      cfg: the config.

    Returns:
      One ``"path: reason"`` line per setting, in a fixed order; empty when all is supported.
    """
    out = []
    for name, (path, check) in _FEATURE_CHECKS.items():
        if name in NOT_YET_SUPPORTED and (reason := check(cfg)) is not None:
            out.append(f"{path}: {reason}")
    return out


def check_supported(cfg: Config) -> None:
    """Raises ``ConfigError`` listing every setting the engine cannot honour yet.

    Args:
      cfg: the config.

    Raises:
      ConfigError: when ``unsupported_features(cfg)`` is not empty.
    """
    problems = unsupported_features(cfg)
    if problems:
        lines = "\n".join(f"  - {p}." for p in problems)
        raise ConfigError(
            f"This config uses settings jzero does not support yet:\n{lines}\n"
            "Change or remove them to train."
        )
