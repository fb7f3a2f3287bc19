"""DeepSpeed's nested sections: ``zero_optimization`` (with offload), ``bf16``, ``fp16``,
``data_types`` and ``activation_checkpointing``.

Decisions:

* **DeepSpeed's names, meanings and defaults** (checked against DeepSpeed 0.19.x), so an
  existing ``ds_config.json`` loads unchanged. DeepSpeed 0.19.3 made ``offload_*.pin_memory``
  true by default, and jzero follows it.
* A key that has no meaning under XLA carries its reason in ``no_effect`` metadata: it is
  accepted and listed in one warning. NVMe offload is refused (``refuse``) with the reason.
* A key that acts only in some settings carries ``no_effect_when`` too: a function of the built
  section giving the reason it does nothing there (listed in the warning), or ``None`` where
  it acts. Its ``no_effect`` text then only keeps it out of ``Config.to_dict`` at its default.
  These are ``overlap_comm`` and its bucket sizes (buckets at stages 0-2, the one-layer-ahead
  gather at stage 3) and ZeRO++'s quantization (qwZ at stage 3, qgZ at stages 1-3):
  :func:`jzero.engine.settings.comm_options` turns them into the plan's options.
* ``overlap_comm`` left out (``null``) is off at every stage. DeepSpeed turns it on at stage 3;
  jzero does not, because there it holds two layers' gathered weights instead of one (the
  next layer's gather runs during this layer's compute), a memory cost a user should choose.
* Every field has a docstring; they are the reference for the YAML keys.
* A field with ``auto`` metadata accepts ``"auto"`` (what Hugging Face's and Accelerate's
  DeepSpeed templates write): the config holds the metadata's value and records the key in
  ``Config.auto``; ``jzero.config.resolve_auto`` (called by ``jzero.initialize``) resolves the
  keys that depend on the code (``bf16.enabled``, ``fp16.enabled``) and logs them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jzero.choices.stages import STAGES, stage_spec
from jzero.config._common import checked_field

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "DataTypesConfig",
    "FlopsProfilerConfig",
    "FP16Config",
    "CsvMonitorConfig",
    "OffloadConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
]

StageNumber = Literal[tuple(STAGES)]  # the ZeRO stages, from the one table

# Reasons shared by several no-effect keys.
XLA_COLLECTIVES = "XLA schedules, buckets and fuses collectives itself"
_XLA_GATHER = (
    "stage 3 gathers each parameter where the compiled step uses it; XLA sizes the buffers"
)
TORCH_ONLY = "it configures a PyTorch-specific mechanism with no JAX counterpart"
NVME_ONLY = "it tunes DeepSpeed's NVMe engine; jzero's NVMe tier sizes its own I/O"
NOT_IMPLEMENTED = "the DeepSpeed feature it configures is not implemented in jzero"
MONITOR = "jzero's monitors are tensorboard, csv_monitor and wandb"
CKPT = "jzero checkpoints with Orbax, which restores onto any mesh"
_COMM = "jzero applies it at some stages only"  # to_dict's marker; the warning says why


def _bucket_no_effect(kind: str) -> Any:
    """The reason a bucket size does nothing in a ``zero_optimization`` section, or None."""

    def reason(zero: ZeroConfig) -> str | None:
        spec = stage_spec(zero.stage)
        if spec.shard_params:
            return (
                f"stage {zero.stage} gathers and reduce-scatters each parameter where it is "
                "used (one layer at a time), not in buckets"
            )
        if kind == "gather" and not spec.shard_opt_state:
            return f"stage {zero.stage} keeps the updated parameters whole: it gathers nothing"
        if not zero.overlap_comm:
            return "buckets group the step's collectives only with overlap_comm: true"
        return None

    return reason


def _qwz_no_effect(zero: ZeroConfig) -> str | None:
    if zero.zero_quantized_weights and not stage_spec(zero.stage).shard_params:
        return (
            f"stage {zero.stage} keeps parameters whole, so there is no parameter all-gather "
            "to quantize (ZeRO++ qwZ acts at stage 3)"
        )
    return None


def _frozen_no_effect(zero: ZeroConfig) -> str | None:
    if zero.zero_quantized_nontrainable_weights:
        return (
            "jzero keeps non-trainable state (TrainState.extra) whole on every device, so it "
            "is never gathered and there is nothing to quantize; zero_quantized_weights "
            "quantizes the parameters' gathers"
        )
    return None


def _qgz_no_effect(zero: ZeroConfig) -> str | None:
    if zero.zero_quantized_gradients and not stage_spec(zero.stage).reduce_scatter:
        return (
            f"stage {zero.stage} all-reduces its gradients, and ZeRO++ qgZ replaces a "
            "reduce-scatter (stages 1-3)"
        )
    return None


def _qgz_bits_no_effect(zero: ZeroConfig) -> str | None:
    if not zero.zero_quantized_gradients or _qgz_no_effect(zero):
        return "it sets the bits of zero_quantized_gradients, which does not act here"
    return None


@dataclass(frozen=True)
class OffloadConfig:
    """``zero_optimization.offload_optimizer`` / ``offload_param``: host-memory offload."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """Where the state lives: "none" (device memory), "cpu" (host memory) or "nvme" (files under
    ``nvme_path``, ZeRO-Infinity; ``offload_param`` there needs ``offload_optimizer`` there
    too)."""
    pin_memory: bool = True
    """Page-locked host memory (``pinned_host``); false uses ``unpinned_host``. DeepSpeed: true."""
    ratio: float = checked_field(1.0, min=0.0, max=1.0)
    """Fraction of the optimizer state to offload (DeepSpeed's partial offload): the leaves are
    split between host and device memory by the plan, the largest first, until this fraction
    of the optimizer-state bytes is in host memory."""
    nvme_path: str | None = checked_field(None, path=True)
    """With ``device: nvme``: the directory that holds the state's files (a fast local disk);
    it must exist, be writable and have room for twice the state (the step writes the new
    version beside the old one). ``offload_param`` without one uses ``offload_optimizer``'s."""
    buffer_count: int = checked_field(4, min=1)
    """With ``device: nvme``: groups of the state held in host memory at once (read ahead and
    being written); DeepSpeed: 4 for the optimizer state."""
    buffer_size: int = checked_field(100_000_000, min=0, no_effect=NVME_ONLY)
    """DeepSpeed: NVMe buffer size in elements. No effect."""
    max_in_cpu: int = checked_field(1_000_000_000, min=0, no_effect=NVME_ONLY)
    """DeepSpeed: parameter elements kept in CPU memory with NVMe offload. No effect."""
    compute: Literal["device", "host"] = "device"
    """jzero's key, ``offload_optimizer`` with ``device: cpu``: where the offloaded update runs.
    "device" brings each group's state into device memory for the update (streamed by
    ``sub_group_size``); "host" updates it in host memory where it rests (``compute_on``, as
    DeepSpeed's CPU Adam). ``benchmarks/gpu_check.py`` times both."""
    pipeline_read: bool = False
    """With ``device: nvme``: read the next groups while the current one updates."""
    pipeline_write: bool = False
    """With ``device: nvme``: write a group's results while the next one updates."""
    fast_init: bool = checked_field(False, no_effect=NVME_ONLY)
    """DeepSpeed: fast optimizer initialisation with NVMe offload. No effect."""
    super_offload: bool = checked_field(False, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: SuperOffload for Superchips. No effect."""
    cpuadam_cores_perc: float = checked_field(0.8, min=0.0, max=1.0, no_effect=TORCH_ONLY)
    """DeepSpeed: share of CPU cores for CPU Adam. No effect."""


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: what is sharded over the data axis, and where it lives."""

    stage: StageNumber = checked_field(0, auto=3)
    """0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters (the
    allowed values are the rows of :data:`jzero.choices.stages.STAGES`). ``"auto"``: at the first
    batch, the cheapest that fits the device memory (the top-level ``device_memory``, or the
    accelerator's own less 10%), measured from each candidate's compiled step: stages 0-3, then
    with activation checkpointing (under ``activation_checkpointing: {policy: auto}``), then
    with the optimizer state in host memory (:mod:`jzero.engine.auto_stage`). The state is made
    after the choice, in the chosen layout (:mod:`jzero.engine.resolve`)."""
    stage3_param_persistence_threshold: int = checked_field(100_000, min=0, auto=100_000)
    """Stage 3: parameters with fewer elements than this stay replicated (DeepSpeed: 1e5).
    "auto" is the default, 1e5 (Hugging Face would write 10 x hidden size)."""
    offload_optimizer: OffloadConfig = checked_field(factory=OffloadConfig)
    """Optimizer-state offload to host memory (stages 1-3)."""
    offload_param: OffloadConfig = checked_field(factory=OffloadConfig)
    """Parameter offload to host memory (stage 3 only). Below stage 3 it is ignored (listed in
    the warning and loaded as off), as DeepSpeed ignores it there."""
    stage3_gather_16bit_weights_on_model_save: bool = checked_field(False, auto=False)
    """Stage 3: gather the full weights when the model is saved for export; "auto": false."""
    allgather_partitions: bool = checked_field(True, no_effect=XLA_COLLECTIVES)
    """DeepSpeed: all-gather vs. broadcasts after the step. No effect."""
    allgather_bucket_size: int = checked_field(
        500_000_000,
        min=0,
        auto=500_000_000,
        no_effect=_COMM,
        no_effect_when=_bucket_no_effect("gather"),
    )
    """DeepSpeed: elements per all-gather bucket. Here: with ``overlap_comm: true`` at stages 1-2,
    the all-gather of the updated parameters is one collective per bucket of consecutive leaves
    of at most this many elements (0: one per leaf). No effect at stages 0 and 3."""
    reduce_scatter: bool = checked_field(
        True, no_effect=XLA_COLLECTIVES + "; the stage decides the reduction"
    )
    """DeepSpeed: reduce-scatter vs. all-reduce for gradients. No effect (the stage decides)."""
    reduce_bucket_size: int = checked_field(
        500_000_000,
        min=0,
        auto=500_000_000,
        no_effect=_COMM,
        no_effect_when=_bucket_no_effect("reduce"),
    )
    """DeepSpeed: elements per reduction bucket. Here: with ``overlap_comm: true`` at stages 0-2,
    the gradient reduction is one collective per bucket of consecutive leaves of at most this
    many elements (0: one per leaf), so a bucket whose gradients are ready can be reduced while
    the backward pass computes the rest. No effect at stage 3, whose reduce-scatters are per
    layer ("auto": the default)."""
    use_multi_rank_bucket_allreduce: bool = checked_field(True, no_effect=XLA_COLLECTIVES)
    """DeepSpeed: merge reduce buckets of ranks into one all-reduce. No effect."""
    overlap_comm: bool | None = checked_field(None, no_effect=_COMM, no_effect_when=lambda _: None)
    """DeepSpeed: overlap communication with compute. Here, when true: stage 3 gathers each
    scanned layer's weights one iteration ahead (the gather of layer i+1 runs while layer i
    computes; two layers gathered at a time), stages 0-2 reduce gradients in buckets of
    ``reduce_bucket_size`` (and stages 1-2 gather the updated parameters in buckets of
    ``allgather_bucket_size``), and on a GPU the step is compiled with XLA's latency-hiding
    scheduler and pipelined collectives. Left out: off at every stage (DeepSpeed turns it on at
    stage 3; see the module's decisions). False: the plain program."""
    contiguous_gradients: bool = checked_field(
        True, no_effect="XLA allocates gradient buffers itself"
    )
    """DeepSpeed: copy gradients into one contiguous buffer. No effect."""
    round_robin_gradients: bool = checked_field(False, no_effect=XLA_COLLECTIVES)
    """DeepSpeed: parallel gradient copies for CPU offload. No effect."""
    sub_group_size: int = checked_field(1_000_000_000, min=0)
    """With offload: the optimizer step runs over groups of parameter leaves of at most this
    many elements, one group's optimizer state and master weights in device memory at a time
    (a leaf never splits; a group has two leaves or more). DeepSpeed: 1e9. 0, DeepSpeed's "each
    parameter a sub-group of its own", loads as 1, which groups the leaves the same way."""
    stage3_prefetch_bucket_size: int | None = checked_field(None, min=0, auto=None)
    """DeepSpeed: elements fetched ahead of use at stage 3. Here: a parameter used outside a
    scan may start its forward all-gather at an earlier use, as long as what is gathered from
    there to its own use is at most this many elements (the tie that orders the gathers moves
    earlier; XLA decides within that). Not set: 0, each gather waits for its own use, so about
    one layer is gathered at a time (DeepSpeed's default, 5e7, would gather all of a model under
    50M elements at the start). Scanned layers and the backward pass are not prefetched: a
    scan body gathers its own layer, and a backward gather waits for its use's gradient.
    "auto" is "not set" (Hugging Face would write 0.9 x hidden size squared)."""
    stage3_max_live_parameters: int = checked_field(1_000_000_000, min=0, auto=1_000_000_000)
    """DeepSpeed: gathered elements kept live at stage 3. jzero gathers one unit at a time (one
    layer's slice of a scanned stack, or a whole leaf used outside a scan), so the largest unit
    must fit: a smaller value is an error at the first step that names both numbers. It also
    caps what ``stage3_max_reuse_distance`` keeps. 0 (as some published configs write) keeps
    nothing gathered beyond the unit in use, as DeepSpeed does with it: no error."""
    reshard_after_forward: bool = True
    """jzero's own (FSDP2's name): at stage 3, drop each gathered weight after its forward use
    and gather it again in the backward pass (3 Psi of traffic, about one layer of weights live
    at a time). ``false`` keeps the gathered weights from the forward to the backward pass: 2 Psi
    of traffic, but every gathered weight is alive at the peak, about the whole model."""
    pad_shards: bool = True
    """jzero's own: a leaf whose leading dimension the shard count does not divide is sharded
    anyway, padded with zeros to a multiple of it (or, for state only, with its leading
    dimensions merged), at any device count; ``false`` never pads: such a leaf is split on a
    later dimension that divides, else it stays whole on every device. The NVMe tier
    (``offload_optimizer.device: nvme``) always works as ``false``."""
    stage3_max_reuse_distance: int | None = checked_field(None, min=0, auto=None)
    """DeepSpeed: keep a gathered parameter if it is reused within this many elements of other
    gathered parameters. Here: from the traced order of the gathers outside scans, a leaf
    whose every next use (a later forward use, e.g. a tied embedding; then its backward use,
    twice what is gathered after it) is within this distance is gathered once and kept until
    its backward use, while the kept elements plus the largest gathered unit stay within
    ``stage3_max_live_parameters``. Not set: every use gathers (DeepSpeed's default, 1e9,
    would keep nearly every parameter of a model under 500M elements gathered from its
    forward to its backward use). "auto" is "not set"."""
    stage3_model_persistence_threshold: int = checked_field(
        2**63 - 1, min=0, no_effect="jzero bounds persistence per parameter only"
    )
    """DeepSpeed: cap on the total persisted (unsharded) elements at stage 3. No effect."""
    stage3_module_granularity_threshold: int = checked_field(0, min=0, no_effect=_XLA_GATHER)
    """DeepSpeed: fetch fine-grained modules as one unit. No effect."""
    stage3_use_all_reduce_for_fetch_params: bool = checked_field(False, no_effect=XLA_COLLECTIVES)
    """DeepSpeed: fetch parameters with all-reduce. No effect."""
    stage3_allgather_sequential: bool = checked_field(False, no_effect=XLA_COLLECTIVES)
    """DeepSpeed: gather parameters one at a time without buckets. No effect."""
    load_from_fp32_weights: bool = checked_field(
        True, no_effect=CKPT + " and always keeps fp32 state"
    )
    """DeepSpeed: initialise fp32 master weights from fp32 checkpoint copies. No effect."""
    elastic_checkpoint: bool = checked_field(False, no_effect=CKPT)
    """DeepSpeed: legacy elastic checkpoints. No effect."""
    ignore_unused_parameters: bool = checked_field(
        True, no_effect="unused parameters get zero gradients"
    )
    """DeepSpeed: tolerate parameters without gradients. No effect."""
    legacy_stage1: bool = checked_field(False, no_effect=TORCH_ONLY)
    """DeepSpeed: old stage-1 implementation. No effect."""
    grad_hooks: bool = checked_field(True, no_effect=TORCH_ONLY)
    """DeepSpeed: gradient hooks for reduction. No effect."""
    zero_hpz_partition_size: int = checked_field(1, min=0)
    """DeepSpeed ZeRO++ hpZ, stage 3: the devices of one host (the secondary partition). Above
    1, gradients and optimizer state stay sharded over every device while the 16-bit
    parameters rest sharded within groups of this many devices (the mesh becomes
    ``{replica: N/k, data: k}``), so the forward and backward gathers stay inside a host and
    only the updated shards cross hosts, once per step. Costs ``k``-way instead of ``N``-way
    sharded parameter bytes per device. 0 or 1: off. Below stage 3 it is ignored (listed in the
    warning and loaded as 1), as DeepSpeed ignores it there."""
    zero_quantized_weights: bool = checked_field(
        False, no_effect=_COMM, no_effect_when=_qwz_no_effect
    )
    """DeepSpeed ZeRO++ qwZ, stage 3: every parameter all-gather (forward, and the backward's
    re-gather) sends int8 values with one float32 scale per block of 256 (about a quarter of
    the float32 bytes, half of bf16) and dequantizes after it; the gradient's reduce-scatter
    stays exact. No effect below stage 3 (listed in the warning)."""
    zero_quantized_nontrainable_weights: bool = checked_field(
        False, no_effect=_COMM, no_effect_when=_frozen_no_effect
    )
    """DeepSpeed ZeRO++: quantize frozen weights. No effect: jzero never shards non-trainable
    state, so it has no gather to quantize."""
    zero_quantized_gradients: bool = checked_field(
        False, no_effect=_COMM, no_effect_when=_qgz_no_effect
    )
    """DeepSpeed ZeRO++ qgZ, stages 1-3: every gradient reduce-scatter over the data axis is an
    all-to-all of int8 chunks (``zero_quantized_gradients_bits``) that each device dequantizes
    and sums in float32, about a quarter of the float32 bytes. All-reduces (stage 0, leaves
    the data axis does not divide) and the replica-axis reduction stay exact. No effect at
    stage 0 (listed in the warning)."""
    zero_quantized_gradients_bits: Literal[8, 4] = checked_field(
        8, no_effect=_COMM, no_effect_when=_qgz_bits_no_effect
    )
    """jzero's own: the bits a value of ``zero_quantized_gradients``' exchange: 8 (int8) or 4
    (two values a byte, about an eighth of the float32 bytes, with more error)."""
    zeropp_loco_param: Mapping[str, Any] | None = checked_field(None, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed ZeRO++: LoCo error feedback. No effect."""
    mics_shard_size: int = checked_field(-1, min=-1, nonzero=True)
    """DeepSpeed MiCS: shard over groups of this many devices (one host) and replicate across
    the groups: the mesh becomes ``{replica: N/size, data: size}`` (hybrid sharding, FSDP's
    HSDP), so gathers and reduce-scatters stay inside a group and only the gradient shards
    (``1/size`` of the gradient bytes) are all-reduced across groups. -1: off."""
    mics_hierarchical_params_gather: bool = checked_field(
        False, no_effect="jzero's gathers already stay within one shard group (mesh axis data)"
    )
    """DeepSpeed MiCS: gather within nodes first, then across. No effect: the gathers of a
    MiCS group never cross it."""
    memory_efficient_linear: bool = checked_field(True, no_effect=TORCH_ONLY)
    """DeepSpeed: memory-efficient linear layer at stage 3. No effect."""
    pipeline_loading_checkpoint: bool = checked_field(False, no_effect=CKPT)
    """DeepSpeed: load checkpoints in pipeline mode. No effect."""
    override_module_apply: bool = checked_field(True, no_effect=TORCH_ONLY)
    """DeepSpeed: override ``nn.Module.apply`` at stage 3. No effect."""
    log_trace_cache_warnings: bool = checked_field(False, no_effect=TORCH_ONLY)
    """DeepSpeed: log stage-3 trace-cache warnings. No effect."""
    enable_sanity_checks: bool = checked_field(False, no_effect=TORCH_ONLY)
    """DeepSpeed: internal sanity checks. No effect."""
    save_muon_momentum_buffer_in_memory: bool = checked_field(False, no_effect=NVME_ONLY)
    """DeepSpeed: keep the Muon momentum off NVMe. No effect."""
    zenflow: Mapping[str, Any] | None = checked_field(
        None, no_effect=NOT_IMPLEMENTED + " (ZenFlow)"
    )
    """DeepSpeed ZenFlow settings. No effect."""
    leaf_module: Mapping[str, Any] | None = checked_field(None, no_effect=TORCH_ONLY)
    """DeepSpeed: modules treated as stage-3 leaves. No effect."""


@dataclass(frozen=True)
class BF16Config:
    """``bf16``: bfloat16 mixed precision (no loss scaling).

    A bf16 step whose gradients hold an inf or NaN is skipped (params, optimizer state and the
    schedule's step stay as they were) when ``check_grad_overflow`` or ``skip_nonfinite`` is
    true, unless the top-level ``skip_nonfinite`` is set: then that decides.
    """

    enabled: bool = checked_field(False, auto=False)
    """Compute in bfloat16 with fp32 master weights. "auto": true when every floating-point
    parameter passed to ``jzero.initialize`` is bfloat16 (and fp16 is not enabled), else false."""
    check_grad_overflow: bool = True
    """Skip a step whose gradients are inf/NaN (DeepSpeed >= 0.19: true); false applies it."""
    skip_nonfinite: bool = False
    """jzero's own key: true also skips steps with inf/NaN gradients (see above)."""
    immediate_grad_update: bool = checked_field(True, no_effect=TORCH_ONLY)
    """DeepSpeed: apply gradients as they arrive. No effect."""
    bf16_master_weights_and_grads: bool = False
    """No float32 master copy: the bfloat16 params are the master weights and their gradients
    are bfloat16 (reduced in bfloat16, in their shards), as in DeepSpeed 0.19. Each update runs
    in float32 (:func:`jzero.optim.float32_update`: gradients and masters upcast, the
    optimizer's moments float32 unless ``bf16_optimizer_states``) and the new master is rounded
    to bfloat16 in its shard (``stochastic_rounding`` picks how). Saves the 4 bytes a parameter
    of the copy: with ``bf16_optimizer_states`` a parameter rests in 2 + 4 bytes instead of
    2 + 4 + 8. Micro-batch gradients are still summed in float32 unless
    ``data_types.grad_accum_dtype: bf16``. Needs ``enabled: true``; any ZeRO stage (DeepSpeed
    asks for 1-3), not the NVMe tier."""
    bf16_optimizer_states: bool = False
    """Keep the optimizer state (Adam's moments) in bfloat16 between steps, updated in float32
    (:func:`jzero.optim.low_precision_state`), for the config's optimizer or one passed in code:
    it halves the optimizer state per device. Needs ``enabled: true``. DeepSpeed also requires
    ``bf16_master_weights_and_grads`` and ZeRO stage 1-3; jzero allows either alone (fp32
    master weights without it) and any stage."""
    stochastic_rounding: bool = False
    """jzero: with ``bf16_master_weights_and_grads``, round each new bfloat16 master up or down
    at random with probability proportional to its distance (unbiased, so updates below half a
    bfloat16 ulp are kept on average), instead of to nearest (the default, DeepSpeed's). The
    random bits come from the step count and the leaf's index: a run, and a restored run, are
    reproducible. Not with a streamed offloaded update (``sub_group_size``, ``compute:
    host``)."""


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: float16 mixed precision with (dynamic) loss scaling, DeepSpeed's defaults."""

    enabled: bool = checked_field(False, auto=False)
    """Compute in float16 with fp32 master weights and loss scaling. "auto": true when every
    floating-point parameter passed to ``jzero.initialize`` is float16 (and bf16 is not
    enabled), else false."""
    loss_scale: float = checked_field(0.0, min=0.0)
    """0 means dynamic loss scaling; any other value is a fixed loss scale."""
    initial_scale_power: int = checked_field(16, min=0)
    """The dynamic loss scale starts at 2**initial_scale_power."""
    loss_scale_window: int = checked_field(1000, min=1)
    """Steps without overflow before the dynamic loss scale is doubled."""
    hysteresis: int = checked_field(2, min=1)
    """Overflows tolerated before the dynamic loss scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: float = checked_field(1.0, min=0.0)
    """Lower bound of the dynamic loss scale."""
    auto_cast: bool = checked_field(
        False, no_effect="the model's dtype decides what its inputs are cast to"
    )
    """DeepSpeed: cast inputs to fp16. No effect."""
    fp16_master_weights_and_grads: bool = checked_field(False, no_effect=NOT_IMPLEMENTED)
    """DeepSpeed: keep master weights in fp16. No effect."""


@dataclass(frozen=True)
class DataTypesConfig:
    """``data_types``."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    """Dtype of the gradient accumulator; None: the parameter dtype."""


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: rematerialise each stacked layer, with no model change.

    jzero checkpoints the body of every ``jax.lax.scan`` in the loss (stacked layers: the scan
    is the layer boundary jzero can see), at every ZeRO stage; see :mod:`jzero.rewrite.remat`.

    * No section: no checkpointing at stages 0-2; stage 3 checkpoints the layers it gathers
      with ``dots_no_batch``, so each layer's weights are gathered again in the backward pass.
    * The section without ``policy``: ``full``, as DeepSpeed (each layer keeps its input only).

    Each layer is checkpointed: every scan body, and each layer of a Python loop over layers,
    found from the parameters' paths (``layers_3``, ``blocks/3``; see :mod:`jzero.rewrite.remat`).
    """

    policy: str | None = checked_field(None, auto=None)
    """jzero's own: what each layer keeps for the backward pass. ``auto`` (with
    ``zero_optimization.stage: auto``): none, unless no stage fits without ``full``. ``none``
    (everything, no remat), ``full`` (only the layer's input; the rest is recomputed:
    ``jax.checkpoint_policies.nothing_saveable``), ``dots`` (matmul outputs:
    ``dots_saveable``), ``dots_no_batch`` (matmul outputs without batch dims:
    ``dots_with_no_batch_dims_saveable``, stage 3's default), ``names:a,b`` (the values the
    model tagged with ``jax.ad_checkpoint.checkpoint_name(x, "a")``: ``save_only_these_names``).
    Left out of a present section: ``full``; null (or no section): jzero's default above. At
    stage 3 no policy saves a gathered weight: there ``none`` keeps every activation and
    re-gathers the weights in the backward pass."""
    cpu_checkpointing: bool = False
    """DeepSpeed: keep checkpointed activations in CPU memory. Here: the values the policy saves
    (and each layer's input) live in ``pinned_host`` memory between the forward and the backward
    pass (a ``jax.checkpoint`` offload policy). Needs a policy that checkpoints something (not
    ``none`` at stages 0-2). On CPU devices it changes nothing measurable: host and device
    memory are the same there."""
    partition_activations: bool = False
    """DeepSpeed: partition checkpointed activations over model-parallel ranks. Here: each
    checkpointed layer's saved input is split over the mesh's axes besides ``data`` that have
    more than one device (e.g. ``mesh: {data: 4, model: 2}``), and gathered back before the
    layer is recomputed. Without such an axis, or without a policy that checkpoints, it has no
    effect and is listed in the warning."""
    contiguous_memory_optimization: bool = checked_field(
        False, no_effect="XLA allocates activations itself"
    )
    """DeepSpeed: copy checkpoints into one buffer. No effect."""
    number_checkpoints: int | None = checked_field(
        None,
        min=0,
        no_effect="there is one checkpoint per layer, in buffers XLA allocates",
    )
    """DeepSpeed: number of checkpoints, to size the contiguous buffer. No effect: every
    iteration of a scan is one checkpoint."""
    synchronize_checkpoint_boundary: bool = checked_field(False, no_effect=TORCH_ONLY)
    """DeepSpeed: synchronise at checkpoint boundaries. No effect."""
    profile: bool = checked_field(False, no_effect=TORCH_ONLY)
    """DeepSpeed: time the checkpoint functions. No effect."""


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """``flops_profiler``: at ``profile_step``, the compiled step's FLOPs and bytes (XLA's
    ``cost_analysis``), its time, achieved FLOP/s and MFU, and the model's FLOPs per module
    (:mod:`jzero.profiler`), printed (or written to ``output_file``) as DeepSpeed's profiler
    does; ``jzero train`` also reports MFU on every progress line where the peak is known."""

    enabled: bool = False
    """Profile one step."""
    profile_step: int = checked_field(1, min=1)
    """The step (1-based) to profile. Its program is compiled before the step is timed (the
    step then runs that executable), so even step 1's time is the step's, not the
    compilation's."""
    module_depth: int = -1
    """Group the per-module table by this many leading parameter-path components (``-1``: the
    whole path, one row per parameter leaf)."""
    top_modules: int = 1
    """Rows of the per-module table, most FLOPs first (``-1``: all)."""
    detailed: bool = True
    """Print the per-module table."""
    output_file: str | None = None
    """Write the profile to this file instead of the log."""
    recompute_fwd_factor: float = checked_field(0.0, min=0.0, max=1.0)
    """Forward passes activation checkpointing repeats, as a fraction of one (0 to 1): the
    model FLOPs are (3 + factor) x the forward matmuls."""
    peak_flops: float | None = checked_field(None, min=0.0)
    """jzero's own: the device's peak FLOP/s for MFU, where the built-in table
    (:data:`jzero.profiler.PEAK_FLOPS`, dense bf16) does not know the device or you compute in
    another precision. Also read by ``jzero train`` for its MFU column."""


@dataclass(frozen=True)
class TensorBoardConfig:
    """``tensorboard``: DeepSpeed's TensorBoard monitor. Event files (written with
    ``tensorboardX``; TensorFlow is not needed) in ``<output_path>/<job_name>``, one scalar
    series per tag (:mod:`jzero.monitor`), by process 0 only."""

    enabled: bool = False
    """Write event files."""
    output_path: str = checked_field("", path=True)
    """Where the job's directory is made. Empty (DeepSpeed's default): ``jzero train``'s
    ``train.log_dir``, or the working directory for an engine in your own loop."""
    job_name: str = "DeepSpeedJobName"
    """The directory made inside ``output_path`` for this job."""


@dataclass(frozen=True)
class CsvMonitorConfig:
    """``csv_monitor``: DeepSpeed's CSV monitor. One CSV file per tag in
    ``<output_path>/<job_name>``, named after the tag with ``/`` as ``_``
    (``Train_Samples_train_loss.csv``), with a ``step,<last part of the tag>`` header and a row
    per logged step, by process 0 only. A run that starts at step 0 writes the files anew; a
    resumed one appends to them."""

    enabled: bool = False
    """Write CSV files."""
    output_path: str = checked_field("", path=True)
    """Where the job's directory is made. Empty (DeepSpeed's default): ``jzero train``'s
    ``train.log_dir``, or the working directory for an engine in your own loop."""
    job_name: str = "DeepSpeedJobName"
    """The directory made inside ``output_path`` for this job."""


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: DeepSpeed's Weights & Biases monitor, through the ``wandb`` package (the
    optional extra ``pip install 'jzero[wandb]'``), by process 0 only. ``WANDB_MODE=offline``
    and the other ``WANDB_*`` variables work as usual; the run's files go to ``WANDB_DIR``, else
    ``jzero train``'s ``train.log_dir``, else the working directory."""

    enabled: bool = False
    """Log to a wandb run."""
    project: str = "deepspeed"
    """The wandb project."""
    group: str | None = None
    """The wandb group, to group runs."""
    team: str | None = None
    """The wandb team (its ``entity``)."""


@dataclass(frozen=True)
class AutoLayoutConfig:
    """``auto_layout``: the rates the parallel layout's cost model ranks candidates by.

    Read only when a parallel size is ``"auto"`` (``tensor_parallel.autotp_size``,
    ``sequence_parallel_size``, ``context_parallel_size``, ``pipeline.stages``,
    ``expert_parallel.autoep_size``; see
    :mod:`jzero.engine.auto_layout`). Each rate left out takes its platform's default. The
    rates order the candidates; which one is kept is decided by its compiled memory.
    """

    intra_host_gbps: float | None = checked_field(None, min=0.0)
    """Bandwidth of one device's link within a host, GB/s; default per platform (GPU 300, TPU
    100, CPU 10)."""
    inter_host_gbps: float | None = checked_field(None, min=0.0)
    """Bandwidth of one device's share of the links between hosts, GB/s; default per platform
    (GPU 25, TPU 25, CPU 1)."""
    tflops: float | None = checked_field(None, min=0.0)
    """Model FLOPs one device computes per second, in TFLOP/s; default per platform (GPU 200,
    TPU 100, CPU 0.05)."""
    latency_us: float | None = checked_field(None, min=0.0)
    """The fixed cost of one collective, microseconds; default per platform (GPU 10, TPU 10,
    CPU 20)."""
