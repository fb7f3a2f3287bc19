"""The top-level ``Config`` and jzero's own sections (``mesh``, ``train``, ``checkpoint``).

Decisions:

* Plain frozen dataclasses, one docstring per field; ``jzero.config._validate`` walks the
  fields and their type hints, and field metadata carries the extra rules.
* DeepSpeed's top-level keys keep their names and defaults; DeepSpeed 0.19.3 made
  ``gradient_clipping`` 1.0 by default, and jzero follows it.
* ``mesh`` names the device mesh: the data-parallel axis ``data`` plus any other named axes a
  user's own partition specs use (``mesh: {data: 4, model: 2}``). The data axis is the
  outermost (slowest-varying over the device list), the others follow in the order written,
  so the devices of one model-parallel group are neighbours.
* ``Config.to_dict`` writes the YAML key names and leaves out no-effect keys at their default,
  so ``load_config(cfg.to_dict()) == cfg``; a key recorded in ``Config.auto`` is written back
  as ``"auto"``.
* DeepSpeed's sections for features jzero does not have are accepted and listed in the
  no-effect warning, except where ignoring them would train something else than what was
  asked: ``expert_parallel`` with ``autoep_size`` > 1, an enabled ``compression_training``
  technique, ``quantize_training`` (MoQ) or ``progressive_layer_drop``,
  ``gradient_allreduce_op: sum`` and ``managed_gradient_accumulation: false`` are errors
  (``jzero.config._validate``). A top-level key that is none of these fields is ignored with
  a warning, as DeepSpeed ignores it, unless it is a near miss of one (an error); so is an
  unknown key of a section with ``loose`` metadata (the sections DeepSpeed reads key by key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jzero.choices.pipeline import virtual_stages
from jzero.config._common import ConfigError, FrozenMap, checked_field, thaw
from jzero.config._sections import (
    CKPT,
    MONITOR,
    NOT_IMPLEMENTED,
    NVME_ONLY,
    TORCH_ONLY,
    XLA_COLLECTIVES,
    ActivationCheckpointingConfig,
    AutoLayoutConfig,
    BF16Config,
    CsvMonitorConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    TensorBoardConfig,
    WandbConfig,
    ZeroConfig,
)

# fp16's keys: a bf16 section copied from an fp16 one carries them (ignored there, and a
# near miss of one is refused).
_FP16_KEYS = tuple(f.name for f in dataclasses.fields(FP16Config))

__all__ = [
    "CheckpointConfig",
    "Config",
    "MeshConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainConfig",
]


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer``: a DeepSpeed optimizer name and its parameters (see ``OPTIMIZER_PARAMS``)."""

    type: str
    """Optimizer name, case-insensitive: Adam, AdamW, Lamb, SGD, Adagrad, Lion."""
    params: Mapping[str, Any] = checked_field(factory=FrozenMap)
    """Constructor parameters with DeepSpeed / PyTorch names (lr, betas, eps, weight_decay ...);
    "auto" takes the value from the optax optimizer passed to ``jzero.initialize``."""
    legacy_fusion: bool = checked_field(False, no_effect="XLA fuses the update itself")
    """DeepSpeed: the old fused Adam/Lamb kernels. No effect."""


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler``: a DeepSpeed LR schedule name and its parameters (see ``SCHEDULER_PARAMS``)."""

    type: str
    """Schedule name: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest."""
    params: Mapping[str, Any] = checked_field(factory=FrozenMap)
    """Schedule parameters with DeepSpeed's names."""


@dataclass(frozen=True)
class MeshConfig:
    """``mesh``: jzero's device mesh, e.g. ``{data: 4, model: 2}``.

    Any key besides ``data`` names another mesh axis for a user's own partition specs; one
    axis (``data`` by default) may be -1: the devices left over. The product of the sizes must
    be the number of devices.
    """

    data: int = checked_field(-1, min=-1, nonzero=True)
    """Size of the data-parallel axis; -1 uses all devices left by the other axes."""
    axes: Mapping[str, int] = checked_field(factory=FrozenMap, rest=True)
    """The other axes, name -> size (-1: the devices left), written beside ``data`` in YAML."""

    def sizes(self) -> dict[str, int]:
        """Every axis, name -> size, ``data`` first, as :func:`jzero.make_mesh` takes them."""
        return {"data": self.data, **self.axes}


@dataclass(frozen=True)
class TrainConfig:
    """``train``: jzero's training-loop settings (``jzero train``)."""

    steps: int = checked_field(200, min=1)
    """Optimizer steps to run."""
    eval_interval: int = checked_field(50, min=0)
    """Evaluate every this many steps; 0 disables evaluation."""
    eval_batches: int = checked_field(4, min=1)
    """Batches per evaluation."""
    log_dir: str = checked_field("runs/default", path=True)
    """Directory for logs and metrics (a leading ``~`` is expanded)."""
    learning_rate: float = checked_field(3e-4, min=0.0)
    """jzero's own: the learning rate ``jzero train`` writes where the ``optimizer`` or
    ``scheduler`` section says ``"auto"`` (``lr``, ``warmup_max_lr``), as Hugging Face's
    Trainer fills them from its ``learning_rate``."""
    warmup_steps: int = checked_field(0, min=0)
    """jzero's own: the scheduler's ``warmup_num_steps`` where it is ``"auto"`` in ``jzero
    train``."""
    weight_decay: float = checked_field(0.0, min=0.0)
    """jzero's own: the optimizer's ``weight_decay`` where it is ``"auto"`` in ``jzero
    train``."""
    micro_batch_size: int = checked_field(8, min=1)
    """jzero's own: the batch per device ``jzero train`` uses when the config leaves the batch
    sizes to the first batch (``"auto"`` or missing), as the Trainer's
    ``per_device_train_batch_size``."""
    max_consecutive_nonfinite: int = checked_field(32, min=0)
    """jzero's own: stop with an error after this many steps in a row with inf/NaN gradients
    (each one skipped or not, see ``skip_nonfinite``); 0 never stops."""
    compile_cache: str | None = checked_field("auto", path=True)
    """jzero's own: the directory of JAX's persistent compilation cache, so a restarted or
    resumed run loads its compiled programs instead of compiling them again. ``auto``: a cache
    folder, ``$JAX_COMPILATION_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/jzero/compile_cache``
    or ``~/.cache/jzero/compile_cache`` (never beside the checkpoints, whose space it would
    take); null compiles at every start (``jzero train --no-compile-cache``). A cache that
    can't be written is one warning, never an error. See
    :mod:`jzero.distributed.compile_cache`."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: jzero's Orbax checkpointing, plus DeepSpeed's own checkpoint keys."""

    directory: str | None = checked_field(None, path=True)
    """Checkpoint directory (a leading ``~`` is expanded); None disables checkpointing."""
    save_interval_steps: int = checked_field(0, min=0)
    """Save every this many steps; 0 saves only at the end (when a directory is set)."""
    max_to_keep: int | None = checked_field(3, min=1)
    """Checkpoints kept on disk; None keeps all."""
    async_: bool = checked_field(True, key="async")
    """Save in the background while training continues (YAML key ``async``)."""
    max_consecutive_failures: int = checked_field(3, min=0)
    """jzero's own (DeepSpeed has no such key): a periodic save that fails (a full disk, a
    quota, an I/O error) is one error line and training goes on, the next interval trying again;
    this many failed saves in a row stop the run with an error. 0 never stops. A final save that
    fails is always an error."""
    overwrite: bool = False
    """jzero's own: a run started without resuming may replace the checkpoints an earlier run
    left in ``directory``; false refuses to start such a run."""
    init_from: str | None = checked_field(None, path=True)
    """jzero's own: start from these weights instead of a fresh initialisation: a
    ``.safetensors`` file, a sharded export (a directory with ``model.safetensors.index.json``)
    or a jzero checkpoint directory, loaded straight into the plan's shardings (see
    ``jzero.InitOptions(init_from=...)``, which takes precedence). A resumed run restores its
    own checkpoint over it."""
    tag_validation: str = checked_field("Warn", no_effect=CKPT)
    """DeepSpeed: check that ranks agree on the checkpoint tag. No effect."""
    load_universal: bool = checked_field(False, no_effect=CKPT)
    """DeepSpeed: load a universal checkpoint. No effect (every checkpoint reshards)."""
    use_node_local_storage: bool = checked_field(False, no_effect=CKPT)
    """DeepSpeed: write checkpoints to node-local storage. No effect."""
    parallel_write: Mapping[str, Any] | None = checked_field(None, no_effect=CKPT)
    """DeepSpeed: parallel checkpoint writing. No effect."""
    checkpoint_serialization: bool = checked_field(True, no_effect=CKPT)
    """DeepSpeed: torch.save's serialization format. No effect."""
    writer: Mapping[str, Any] | None = checked_field(None, no_effect=CKPT)
    """DeepSpeed: the checkpoint writer (fast, decoupled ...). No effect."""


_AUTO = {"auto": None}  # "auto" loads as None: derived from the other two and the mesh
_PARALLEL = "jzero parallelises over the data axis (and your own mesh axes) only"


@dataclass(frozen=True)
class Config:
    """A whole jzero training config: DeepSpeed's ``ds_config`` keys plus jzero's sections."""

    train_batch_size: int | None = checked_field(None, min=1, **_AUTO)
    """Global batch per optimizer step = micro x accumulation x data-parallel size; "auto" ok."""
    train_micro_batch_size_per_gpu: int | None = checked_field(None, min=1, **_AUTO)
    """Batch per device per forward/backward pass; "auto" ok."""
    gradient_accumulation_steps: int | None = checked_field(None, min=1, **_AUTO)
    """Micro-batches accumulated per optimizer step; "auto" ok."""
    gradient_clipping: float = checked_field(1.0, min=0.0, auto=1.0)
    """Clip the global gradient norm to this value; 0 disables (DeepSpeed >= 0.19.3: 1.0, which
    "auto" gives too)."""
    device_memory: int | None = checked_field(None, size=True)
    """jzero's own: the memory of one device for ``zero_optimization.stage: auto``, bytes or
    with units (``12GB``, ``80GiB``), as ``jzero plan --device-memory`` takes it. Without it
    ``stage: auto`` uses the accelerator's ``bytes_limit`` less 10% (on CPU it is required).
    Loads as bytes."""
    steps_per_print: int | None = checked_field(10, min=1)
    """Log every this many steps; None never."""
    seed: int = 0
    """Seed for parameter initialisation and data order."""
    zero_optimization: ZeroConfig = checked_field(factory=ZeroConfig)
    """ZeRO stage and offload."""
    optimizer: OptimizerConfig | None = None
    """The optimizer; None: the engine needs one passed in code."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; None: constant ``optimizer.params.lr``."""
    bf16: BF16Config = checked_field(factory=BF16Config, loose=_FP16_KEYS)
    """bfloat16 mixed precision. An unknown key is ignored with a warning (fp16's loss-scaling
    keys copied into it among them), a near miss of one of its keys or of fp16's is refused."""
    fp16: FP16Config = checked_field(factory=FP16Config, loose=())
    """float16 mixed precision. An unknown key (Apex's ``opt_level``) is ignored with a
    warning, a near miss of one of its keys is refused."""
    skip_nonfinite: bool | None = None
    """jzero's own: skip the optimizer update of a step whose gradients are inf/NaN, at any
    precision. None: the precision's default (fp16 always skips, with loss scaling; bf16
    follows ``bf16.check_grad_overflow`` or ``bf16.skip_nonfinite``; float32 does not skip).
    false is refused with fp16, whose loss scaling must skip an overflowing step."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """Dtype of gradient reductions; None: the gradient dtype."""
    data_types: DataTypesConfig = checked_field(factory=DataTypesConfig, loose=())
    """Accumulation dtypes."""
    activation_checkpointing: ActivationCheckpointingConfig = checked_field(
        factory=ActivationCheckpointingConfig, loose=()
    )
    """Activation checkpointing of each stacked layer (every scan body), at any stage."""
    mesh: MeshConfig = checked_field(factory=MeshConfig)
    """Device mesh."""
    auto_layout: AutoLayoutConfig = checked_field(factory=AutoLayoutConfig)
    """jzero's own: the bandwidths, FLOP rate and collective latency that rank the candidate
    layouts when a parallel size is ``"auto"`` (:mod:`jzero.engine.auto_layout`)."""
    model: Mapping[str, Any] = checked_field(factory=FrozenMap)
    """Built-in GPT settings (vocab_size, seq_len, num_layers, num_heads, d_model, d_ff ...)."""
    data: Mapping[str, Any] = checked_field(factory=FrozenMap)
    """Data settings for ``jzero train`` (source, path ...)."""
    train: TrainConfig = checked_field(factory=TrainConfig)
    """Training-loop settings."""
    checkpoint: CheckpointConfig = checked_field(factory=CheckpointConfig)
    """Checkpointing."""
    distributed: Mapping[str, Any] = checked_field(factory=FrozenMap)
    """Several processes (see :mod:`jzero.distributed`): coordinator_address, num_processes,
    process_id, ...; empty: the ``JZERO_*`` variables or JAX's cluster detection."""
    # DeepSpeed's top-level keys that have no effect in jzero.
    wall_clock_breakdown: bool = checked_field(False, no_effect="profile with jax.profiler instead")
    """DeepSpeed: time forward/backward/step. No effect."""
    memory_breakdown: bool = checked_field(
        False, no_effect="use `jzero plan` for the memory report"
    )
    """DeepSpeed: print memory use. No effect."""
    dump_state: bool = checked_field(False, no_effect=TORCH_ONLY)
    """DeepSpeed: print the engine state. No effect."""
    prescale_gradients: bool = checked_field(False, no_effect="it only changes fp16 rounding")
    """DeepSpeed: scale gradients before the mean reduction. No effect."""
    gradient_predivide_factor: float = checked_field(1.0, no_effect="it only changes fp16 rounding")
    """DeepSpeed: divide gradients before the mean reduction. No effect."""
    sparse_gradients: bool = checked_field(False, no_effect="JAX gradients are dense")
    """DeepSpeed: sparse embedding gradients. No effect."""
    disable_allgather: bool = checked_field(False, no_effect=XLA_COLLECTIVES)
    """DeepSpeed: broadcast instead of all-gather. No effect."""
    zero_allow_untested_optimizer: bool = checked_field(
        False, no_effect="every optax optimizer works with ZeRO"
    )
    """DeepSpeed: allow optimizers untested with ZeRO. No effect."""
    zero_force_ds_cpu_optimizer: bool = checked_field(True, no_effect=TORCH_ONLY)
    """DeepSpeed: force DeepSpeed's CPU optimizer with offload. No effect."""
    dataloader_drop_last: bool = checked_field(
        False, no_effect="jzero's data loader always drops the last batch"
    )
    """DeepSpeed: drop the last incomplete batch. No effect."""
    amp: Mapping[str, Any] | None = checked_field(
        None, no_effect="Apex AMP is PyTorch-only; use bf16 or fp16"
    )
    """DeepSpeed: Apex AMP. No effect."""
    torch_autocast: Mapping[str, Any] | None = checked_field(None, no_effect="use bf16 or fp16")
    """DeepSpeed: torch.autocast. No effect."""
    compile: Mapping[str, Any] | None = checked_field(
        None, no_effect="jzero always compiles with XLA"
    )
    """DeepSpeed: torch.compile settings. No effect."""
    elasticity: Mapping[str, Any] | None = checked_field(
        None, no_effect=NOT_IMPLEMENTED + " (elastic batch)"
    )
    """DeepSpeed: elastic training. No effect."""
    aio: Mapping[str, Any] | None = checked_field(None, no_effect=NVME_ONLY)
    """DeepSpeed: asynchronous NVMe I/O. No effect."""
    flops_profiler: FlopsProfilerConfig = checked_field(factory=FlopsProfilerConfig, loose=())
    """DeepSpeed's FLOPs profiler: the compiled step's FLOPs, bytes, time and MFU at one step,
    and the model's FLOPs per module (:mod:`jzero.profiler`)."""
    comms_logger: Mapping[str, Any] | None = checked_field(
        None, no_effect="collectives are read from HLO"
    )
    """DeepSpeed: communication logger. No effect."""
    autotuning: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: autotuner. No effect."""
    tensorboard: TensorBoardConfig = checked_field(factory=TensorBoardConfig)
    """DeepSpeed's TensorBoard monitor: the step's metrics as event files (:mod:`jzero.monitor`)."""
    wandb: WandbConfig = checked_field(factory=WandbConfig)
    """DeepSpeed's Weights & Biases monitor (the ``jzero[wandb]`` extra)."""
    csv_monitor: CsvMonitorConfig = checked_field(factory=CsvMonitorConfig)
    """DeepSpeed's CSV monitor: one CSV file per metric."""
    comet: Mapping[str, Any] | None = checked_field(None, no_effect=MONITOR)
    """DeepSpeed's Comet monitor. No effect."""
    timers: Mapping[str, Any] | None = checked_field(
        None, no_effect="the monitors and metrics.jsonl carry samples/s and tokens/s every step"
    )
    """DeepSpeed: throughput timers. No effect."""
    log_level: str = checked_field("info", no_effect="jzero logs through Python's logging module")
    """DeepSpeed: its logger's level. No effect (set the level of the ``jzero`` logger)."""
    hybrid_engine: Mapping[str, Any] | None = checked_field(
        None, no_effect=NOT_IMPLEMENTED + " (DeepSpeed-Chat's RLHF generation engine)"
    )
    """DeepSpeed-Chat: switch between training and inference kernels. No effect."""
    compression_training: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed Compression. Accepted only with every technique disabled: an enabled one
    would change the model that is trained, so it is an error."""
    data_efficiency: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: data sampling and routing. No effect (the batches are the ones you pass)."""
    curriculum_learning: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: legacy curriculum learning. No effect."""
    progressive_layer_drop: Mapping[str, Any] | None = checked_field(
        None, no_effect=NOT_IMPLEMENTED
    )
    """DeepSpeed: progressive layer dropping. Accepted only with ``enabled: false`` (or no
    ``enabled``): dropping layers changes what is trained, so enabled is an error."""
    eigenvalue: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: Hessian eigenvalue estimation. No effect."""
    quantize_training: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: MoQ quantize-aware training. Accepted only with ``enabled: false`` (or no
    ``enabled``): quantizing the weights changes what is trained, so enabled is an error."""
    sparse_attention: Mapping[str, Any] | None = checked_field(
        None, no_effect="attention is the model's code in JAX"
    )
    """DeepSpeed: sparse attention kernels. No effect."""
    nebula: Mapping[str, Any] | None = checked_field(None, no_effect=CKPT)
    """DeepSpeed: Azure Nebula checkpointing. No effect."""
    graph_harvesting: bool = checked_field(False, no_effect="jzero always compiles with XLA")
    """DeepSpeed: CUDA graph harvesting. No effect."""
    use_data_before_expert_parallelism: bool = checked_field(False, no_effect=_PARALLEL)
    """DeepSpeed: process-group order for MoE. No effect."""
    seq_parallel_communication_data_type: str = checked_field("fp32", no_effect=_PARALLEL)
    """DeepSpeed: dtype of sequence-parallel collectives. No effect."""
    pipeline: Mapping[str, Any] | None = None
    """DeepSpeed: pipeline parallelism. ``stages: P`` (> 1) builds the mesh
    ``{pipe: P, data: N/P}`` and splits the model's layer scan into ``P`` stages of
    consecutive layers (:mod:`jzero.parallel.pipeline`), ZeRO sharding within each stage's
    ``data`` group; the micro-batches are ``gradient_accumulation_steps`` (at least ``P``).
    ``schedule`` (jzero's key): ``1f1b`` (default; at most ``P`` micro-batches of activations
    kept per stage) or ``gpipe`` (all ``M``). DeepSpeed's ``partition``, ``seed_layers``,
    ``activation_checkpoint_interval``, ``pipe_partitioned``, ``grad_partitioned`` are
    accepted and have no effect (jzero splits the layers evenly; activation checkpointing is
    the ``activation_checkpointing`` section); the first three warn when set to ask for
    something (a ``partition`` other than ``uniform``, ``seed_layers`` true, an interval)."""
    tensor_parallel: Mapping[str, Any] | None = None
    """DeepSpeed AutoTP: ``autotp_size: T`` (> 1) builds the mesh ``{data: N/T, model: T}``
    and gives every parameter a Megatron-style spec over ``model`` from its name
    (:mod:`jzero.parallel.tensor`); ``tp_plan`` maps dotted-path globs to ``colwise``,
    ``rowwise``, ``vocab``, ``replicate`` or a spec list for anything else; ``num_heads``
    (jzero's key; the built-in GPT's ``model.num_heads`` otherwise) is checked to divide by
    T. ``tp_size`` is read as ``autotp_size``. ``tp: {tp_size: ...}``, DeepSpeed's inference
    key, is ignored without ``autotp_size`` (as DeepSpeed does) and must equal it with one. A
    user's own annotations win over the rules."""
    expert_parallel: Mapping[str, Any] | None = None
    """DeepSpeed AutoEP: ``autoep_size: E_p`` (> 1) builds the mesh ``{data: N/E_p, expert:
    E_p}``; each expert parameter rests split over ``expert`` on its experts dimension (each
    device holds ``E / E_p`` experts; tokens reach them by one all-to-all and come back by
    another, :mod:`jzero.parallel.expert`), ZeRO shards it further over ``data``, and every
    other parameter over ``data`` x ``expert``, as DeepSpeed's expert data-parallel groups do.
    Expert parameters are found by name (a path component ``experts``, or containing
    ``expert``), or listed by jzero's ``expert_params`` (dotted-path globs); ``num_experts``
    (jzero's key; ``model.num_experts`` otherwise) finds their experts dimension. ``enabled:
    false`` turns it off."""
    sequence_parallel_size: int = checked_field(1, min=1, auto=1)
    """DeepSpeed-Ulysses: ``S`` > 1 adds a ``seq`` mesh axis of S devices beside ``data``
    (``{data: N/(S*T), seq: S}``). Its devices share the batch's rows and each computes the
    loss of its own ``T/S`` tokens; around attention two all-to-alls swap the sequence split
    for a head split (:mod:`jzero.parallel.sequence`; built into the built-in GPT, and
    ``jzero.sequence_parallel_attention`` for your own model). ZeRO shards over ``data`` x
    ``seq``, as DeepSpeed does. S must divide the heads and the sequence length."""
    context_parallel_size: int = checked_field(1, min=1, auto=1)
    """jzero's key, context parallelism by ring attention: ``C`` > 1 adds a ``context`` mesh
    axis of C devices beside ``data`` (``{data: N/(C*S*T), context: C, seq: S}``). Its
    devices share the batch's rows; each holds two zig-zag chunks (``c`` and ``2C-1-c`` of
    ``2C``) of every row, so causal attention costs each the same, and passes its keys and
    values around the ring (:mod:`jzero.parallel.sequence.ring`; built into the built-in GPT,
    and ``jzero.context_parallel_attention`` for your own model). Nothing splits the heads, so
    C is not bounded by them; beside ``sequence_parallel_size`` Ulysses runs within each ring
    member. ZeRO shards over ``data`` x ``context`` x ``seq``. 2C (and C x S) must divide the
    sequence length; not beside ``pipeline.stages`` yet. ``"auto"``: chosen by the auto layout
    (:mod:`jzero.engine.auto_layout`)."""
    gradient_allreduce_op: str = "mean"
    """DeepSpeed: how gradients are combined over the data axis. jzero averages them, so
    only "mean" (DeepSpeed's default) is accepted."""
    managed_gradient_accumulation: bool = True
    """DeepSpeed: the engine decides the accumulation boundary (true, the default). jzero's
    ``train_step`` is always a whole optimizer step, so false is an error."""
    auto: tuple[str, ...] = checked_field((), internal=True)
    """Not a key: the dotted keys written as "auto", in the order read. ``resolve_auto``
    (called by ``jzero.initialize``) resolves them and empties this."""

    def parallel_sizes(self) -> tuple[tuple[str, str, int], ...]:
        """``(config key, mesh axis, size)`` of each parallelism beside ZeRO's data axis."""
        return (
            ("tensor_parallel.autotp_size", "model", self.autotp_size()),
            ("sequence_parallel_size", "seq", self.sequence_parallel_size),
            ("context_parallel_size", "context", self.context_parallel_size),
            ("pipeline.stages", "pipe", self.pipeline_stages()),
            ("expert_parallel.autoep_size", "expert", self.autoep_size()),
        )

    def mesh_sizes(self) -> dict[str, int]:
        """The mesh to build, as :func:`jzero.make_mesh` takes it: the ``mesh`` section, with a
        shard group from ``zero_optimization.mics_shard_size`` or ``zero_hpz_partition_size``
        as ``data`` and a ``replica`` axis taking the devices left (hybrid sharding).

        Raises:
          ConfigError: when the shard group contradicts the ``mesh`` section.
        """
        sizes = self.mesh.sizes()
        for key, axis, size in self.parallel_sizes():
            if size <= 1:
                continue
            if sizes.get(axis, -1) not in (-1, size):
                raise ConfigError(
                    f"{key}: {size} is the size of the {axis} axis, but mesh.{axis} is "
                    f"{sizes[axis]}; remove mesh.{axis} or set it to {size}."
                )
            sizes[axis] = size
        zero = self.zero_optimization
        key, group = None, None
        if zero.mics_shard_size > 0:
            key, group = "mics_shard_size", zero.mics_shard_size
        elif zero.zero_hpz_partition_size > 1:
            key, group = "zero_hpz_partition_size", zero.zero_hpz_partition_size
        if group is None:
            return sizes
        if sizes["data"] not in (-1, group):
            raise ConfigError(
                f"zero_optimization.{key}: {group} is the size of one shard group (mesh axis "
                f"data), but mesh.data is {sizes['data']}; remove mesh.data or set it to {group}."
            )
        sizes["data"] = group
        if "replica" not in sizes:
            others = [name for name, size in sizes.items() if size == -1 and name != "data"]
            if others:
                raise ConfigError(
                    f"zero_optimization.{key} makes a replica axis of the devices left over, "
                    f"but mesh.{others[0]} is -1 already; give mesh.{others[0]} a size."
                )
            sizes["replica"] = -1
        return sizes

    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` (or its ``tp_size`` spelling); 1 when unset or 0."""
        tp = self.tensor_parallel or {}
        size = tp.get("autotp_size", tp.get("tp_size"))
        return int(size) if size and size != "auto" else 1

    def pipeline_stages(self) -> int:
        """``pipeline.stages``; 1 when unset or "auto" (chosen at the first batch then)."""
        stages = (self.pipeline or {}).get("stages", 1)
        return 1 if stages in (None, "auto") else int(stages)

    def pipeline_schedule(self) -> str:
        """``pipeline.schedule``: ``"1f1b"`` unless set."""
        return str((self.pipeline or {}).get("schedule", "1f1b"))

    def pipeline_virtual_stages(self) -> int:
        """``pipeline.virtual_stages``: the chunks of layers each stage holds; 2 under
        ``interleaved_1f1b`` unless set, else 1."""
        return virtual_stages(self.pipeline_schedule(), (self.pipeline or {}).get("virtual_stages"))

    def autoep_size(self) -> int:
        """``expert_parallel.autoep_size``; 1 when unset, 0 or ``enabled: false``."""
        ep = self.expert_parallel or {}
        if ep.get("enabled", True) is False:
            return 1
        size = ep.get("autoep_size")
        return int(size) if size and size != "auto" else 1

    def expert_params(self) -> tuple[str, ...]:
        """``expert_parallel.expert_params``: dotted-path globs of the expert leaves, or ()."""
        names = (self.expert_parallel or {}).get("expert_params") or ()
        return (names,) if isinstance(names, str) else tuple(names)

    def num_experts(self) -> int | None:
        """``expert_parallel.num_experts``, else ``model.num_experts``; ``None`` when unset."""
        n = (self.expert_parallel or {}).get("num_experts", self.model.get("num_experts"))
        return int(n) if n else None

    def tp_plan(self) -> dict[str, Any]:
        """``tensor_parallel.tp_plan``: dotted-path globs to layouts, in the order written."""
        return dict((self.tensor_parallel or {}).get("tp_plan") or {})

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as plain dicts and lists with the YAML key names.

        No-effect DeepSpeed keys appear only when they differ from their default, so
        ``load_config(cfg.to_dict()) == cfg``.
        """
        return _to_dict(self, "", frozenset(self.auto))


def _to_dict(obj: Any, path: str = "", auto: frozenset[str] = frozenset()) -> Any:
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = f.metadata.get("key", f.name)
            sub = f"{path}.{key}" if path else key
            if sub in auto:
                out[key] = "auto"
                continue
            if f.metadata.get("internal") or (
                f.metadata.get("no_effect") and value == _default_of(f)
            ):
                continue
            if f.metadata.get("rest"):  # its keys sit beside the section's own keys
                out.update(_to_dict(value))
                continue
            out[key] = _to_dict(value, sub, auto)
        return out
    return thaw(obj)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING
