"""The config read once: a validated :class:`jzero.config.Config` turned into the typed, frozen
values the core takes.

The core (:mod:`jzero.plan`, :mod:`jzero.rewrite`, :mod:`jzero.step`, :mod:`jzero.comm`,
:mod:`jzero.subgroups`) knows no config: each package owns the option types it reads
(:class:`jzero.plan.PlanOptions` and its groups, :class:`jzero.plan.Precision`,
:class:`jzero.rewrite.RematPolicy`, :class:`jzero.step.StepOptions`), and this module is the one
place that maps config fields onto them. ``jzero.initialize`` and the engine call it; a user who
builds a plan and a step by hand calls it too, or makes the values directly.

Decisions:

* One function per value: :func:`plan_options` (what :func:`jzero.plan.make_plan` needs beyond
  the params, the optimizer, the mesh and the stage), :func:`step_options` (what
  :func:`jzero.step.make_train_step` needs beyond the plan, the loss and the optimizer),
  :func:`nvme_options` (the NVMe tier's), :func:`precision`, :func:`memory_kinds`,
  :func:`comm_options`, :func:`remat_policy` and :func:`tensor_parallel` (AutoTP's specs, from
  the params' names and shapes).
* The config's rules are checked when it is loaded (:mod:`jzero.config`), ``"auto"`` values
  once they are resolved (:func:`jzero.config.resolve_auto`); this module translates and does
  not validate again. What needs the mesh or the devices is checked here, where they are known:
  a parallelism's mesh axis, a host memory kind the devices address, expert leaves found.
* Keys a config object predating them lacks take their defaults (``skip_nonfinite``, the
  ``bf16`` section's newer keys, ``activation_checkpointing``): a config read back from an older
  checkpoint still translates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jzero import config as config_lib
from jzero._util import dotted
from jzero.choices import stage_spec
from jzero.distributed import CONTEXT_AXIS, DATA_AXIS, EXPERT_AXIS, PIPE_AXIS, SEQ_AXIS
from jzero.parallel import expert, tensor
from jzero.plan import (
    PINNED_HOST,
    UNPINNED_HOST,
    CommOptions,
    ParallelOptions,
    PlanOptions,
    Precision,
    ZeroOptions,
    check_memory_kind,
)
from jzero.rewrite import RematPolicy, parse_policy
from jzero.step import StepOptions

__all__ = [
    "comm_options",
    "memory_kinds",
    "nvme_options",
    "parallel_options",
    "plan_options",
    "precision",
    "remat_policy",
    "step_options",
    "tensor_parallel",
    "zero_options",
]

logger = logging.getLogger("jzero.engine")
PyTree = Any

_DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}


def plan_options(
    cfg: config_lib.Config,
    mesh: jax.sharding.Mesh,
    abstract_params: PyTree,
    *,
    param_specs: PyTree | None = None,
    tp_rules: Sequence[str] | None = None,
) -> PlanOptions:
    """The :class:`~jzero.plan.PlanOptions` of ``cfg`` on ``mesh``.

    Args:
      cfg: a validated config with its ``"auto"`` values resolved.
      mesh: the run's mesh (its devices decide the host memory kinds; its axes the
        parallelisms' layout).
      abstract_params: the params' shapes, for the expert leaves.
      param_specs: the params' partition specs on other mesh axes (the user's, or AutoTP's
        from :func:`tensor_parallel`).
      tp_rules: AutoTP's rule per leaf, from :func:`tensor_parallel`.
    """
    return PlanOptions(
        zero=zero_options(cfg.zero_optimization, mesh.devices.flat),
        comm=comm_options(cfg.zero_optimization),
        parallel=parallel_options(
            cfg, mesh, abstract_params, param_specs=param_specs, tp_rules=tp_rules
        ),
        precision=precision(cfg),
    )


def zero_options(zero: config_lib.ZeroConfig, devices: Any = None) -> ZeroOptions:
    """The :class:`~jzero.plan.ZeroOptions` of a ``zero_optimization`` section; ``devices``
    (default: the local devices) for the host memory kinds they address."""
    opt_kind, param_kind = memory_kinds(zero, devices)
    return ZeroOptions(
        persistence_threshold=zero.stage3_param_persistence_threshold,
        offload_optimizer=opt_kind,
        offload_params=param_kind,
        offload_ratio=zero.offload_optimizer.ratio,
        reshard_after_forward=zero.reshard_after_forward,
        prefetch_bucket_size=zero.stage3_prefetch_bucket_size or 0,
        max_reuse_distance=zero.stage3_max_reuse_distance,
        max_live_parameters=zero.stage3_max_live_parameters,
        hpz=zero.zero_hpz_partition_size > 1,
        # The NVMe tier's files hold shards as they are split evenly: there a leaf the shard
        # count does not divide is split on a later dimension or stays whole (no padding),
        # elsewhere it rests padded.
        padding=zero.pad_shards and zero.offload_optimizer.device != "nvme",
    )


def comm_options(zero: config_lib.ZeroConfig) -> CommOptions:
    """``overlap_comm``, the bucket sizes and ZeRO++'s quantization, each where it acts at the
    section's stage (see their fields in :class:`jzero.config.ZeroConfig`)."""
    spec = stage_spec(zero.stage)
    overlap = bool(zero.overlap_comm)
    buckets = overlap and not spec.shard_params
    return CommOptions(
        overlap_comm=overlap,
        reduce_bucket_size=(zero.reduce_bucket_size or None) if buckets else None,
        allgather_bucket_size=(zero.allgather_bucket_size or None) if buckets else None,
        quantized_weights=8 if zero.zero_quantized_weights and spec.shard_params else 0,
        quantized_gradients=(
            zero.zero_quantized_gradients_bits
            if zero.zero_quantized_gradients and spec.reduce_scatter
            else 0
        ),
    )


def memory_kinds(
    zero: config_lib.ZeroConfig, devices: Sequence[Any] | None = None
) -> tuple[str | None, str | None]:
    """The (optimizer-state, parameter) memory kinds of a ``zero_optimization`` section.

    Args:
      zero: a :class:`jzero.config.ZeroConfig`.
      devices: the devices the run uses, for the capability check.

    Returns:
      ``None`` for state that stays in device memory, else the host memory kind.
    """
    devices = list(devices) if devices is not None else None  # read twice below
    kinds = []
    for key, section in (
        ("offload_optimizer", zero.offload_optimizer),
        ("offload_param", zero.offload_param),
    ):
        if section.device in ("none", "nvme"):  # NVMe: files between steps (jzero.nvme.step)
            kinds.append(None)
            continue
        if key == "offload_param" and section.ratio != 1.0:
            raise ValueError(
                f"zero_optimization.{key}.ratio is {section.ratio}, but jzero offloads all of the "
                "parameters or none of them (ratio splits the optimizer state: "
                "offload_optimizer.ratio). Set ratio to 1.0 (the default)."
            )
        kind = PINNED_HOST if section.pin_memory else UNPINNED_HOST
        what = f"zero_optimization.{key} (pin_memory: {section.pin_memory})"
        kinds.append(check_memory_kind(kind, what, devices))
    return kinds[0], kinds[1]


def precision(cfg: config_lib.Config) -> Precision:
    """The :class:`~jzero.plan.Precision` of a config.

    Whether non-finite steps are skipped follows the rule of :mod:`jzero.plan.precision`: fp16
    always; bf16 ``cfg.skip_nonfinite`` when it is not ``None``, else
    ``bf16.skip_nonfinite or bf16.check_grad_overflow``; float32 ``bool(cfg.skip_nonfinite)``.
    Which precisions go together (one of bf16 and fp16; 16-bit masters with bf16) is the
    config's rule, checked when it is loaded and when ``"auto"`` is resolved.
    """
    bf16, fp16 = cfg.bf16.enabled, cfg.fp16.enabled
    masters16 = bool(getattr(cfg.bf16, "bf16_master_weights_and_grads", False))
    compute = jnp.bfloat16 if bf16 else jnp.float16 if fp16 else None
    comm = cfg.communication_data_type
    accum = cfg.data_types.grad_accum_dtype
    return Precision(
        compute_dtype=None if masters16 else compute,
        master_dtype=jnp.bfloat16 if masters16 else None,
        stochastic_rounding=masters16 and bool(getattr(cfg.bf16, "stochastic_rounding", False)),
        comm_dtype=_DTYPES[comm] if comm else compute,
        accum_dtype=_DTYPES[accum] if accum else None,
        scaled=fp16,
        loss_scale=float(cfg.fp16.loss_scale),
        initial_scale_power=int(cfg.fp16.initial_scale_power),
        loss_scale_window=int(cfg.fp16.loss_scale_window),
        hysteresis=int(cfg.fp16.hysteresis),
        consecutive_hysteresis=bool(cfg.fp16.consecutive_hysteresis),
        min_loss_scale=float(cfg.fp16.min_loss_scale),
        skip_nonfinite=_skips_nonfinite(cfg, bf16=bf16, fp16=fp16),
    )


def _skips_nonfinite(cfg: Any, *, bf16: bool, fp16: bool) -> bool:
    """Whether a run of ``cfg`` skips steps with non-finite gradients (see :func:`precision`).
    Keys a config predating them lacks take their defaults."""
    if fp16:
        return True
    top = getattr(cfg, "skip_nonfinite", None)
    if not bf16:
        return bool(top)
    if top is not None:
        return bool(top)
    section = cfg.bf16
    return bool(getattr(section, "skip_nonfinite", False)) or bool(
        getattr(section, "check_grad_overflow", True)
    )


def remat_policy(cfg: config_lib.Config) -> RematPolicy | None:
    """The ``activation_checkpointing`` policy (``None``: jzero's default, see
    :mod:`jzero.rewrite.remat`)."""
    section = getattr(cfg, "activation_checkpointing", None)
    if section is None:
        return None
    return parse_policy(
        getattr(section, "policy", None),
        offload=bool(getattr(section, "cpu_checkpointing", 0)),
        partition=bool(getattr(section, "partition_activations", 0)),
    )


def step_options(cfg: config_lib.Config, accumulation_steps: int | None = 1) -> StepOptions:
    """The :class:`~jzero.step.StepOptions` of a config, with the engine's resolved
    ``accumulation_steps``."""
    zero = cfg.zero_optimization
    return StepOptions(
        accumulation_steps=accumulation_steps,
        gradient_clipping=cfg.gradient_clipping,
        remat_policy=remat_policy(cfg),
        sub_group_size=zero.sub_group_size,
        offload_compute=zero.offload_optimizer.compute,
    )


def nvme_options(cfg: config_lib.Config) -> Any:
    """The :class:`jzero.nvme.options.NvmeOptions` of ``offload_optimizer.device: nvme`` (and
    ``offload_param.device: nvme``), or ``None`` without the NVMe tier."""
    zero = cfg.zero_optimization
    opt, par = zero.offload_optimizer, zero.offload_param
    if opt.device != "nvme":
        return None
    from jzero.nvme.options import NvmeOptions  # the tier is imported only when it is used

    return NvmeOptions(
        path=opt.nvme_path,
        buffer_count=opt.buffer_count,
        sub_group_size=zero.sub_group_size,
        param_path=(par.nvme_path or opt.nvme_path) if par.device == "nvme" else None,
        param_buffer_count=par.buffer_count,
        prefetch_params=par.pipeline_read,
        pipeline_read=opt.pipeline_read,
        pipeline_write=opt.pipeline_write,
    )


def parallel_options(
    cfg: config_lib.Config,
    mesh: jax.sharding.Mesh,
    abstract_params: PyTree,
    *,
    param_specs: PyTree | None = None,
    tp_rules: Sequence[str] | None = None,
) -> ParallelOptions:
    """The :class:`~jzero.plan.ParallelOptions` of ``cfg`` on ``mesh``: the axes ZeRO shards
    over (``data``, with ``context``, ``seq`` or ``expert`` under context, sequence or expert
    parallelism), the expert leaves, the pipeline axis and schedule, and the given specs and
    AutoTP rules."""
    fields: dict[str, Any] = {"param_specs": param_specs, "tp_rules": tp_rules}
    fields.update(_zero_axes(cfg, mesh, abstract_params))
    fields.update(_pipeline(cfg, mesh))
    return ParallelOptions(**fields)


def _require_axis(key: str, size: int, axis: str, mesh: jax.sharding.Mesh) -> None:
    """A parallelism of ``size`` > 1 set by config ``key`` needs mesh axis ``axis`` of that
    size: a user's own mesh (``InitOptions(mesh=...)``) without it is refused with the fix."""
    if size > 1 and mesh.shape.get(axis, 1) != size:
        raise ValueError(
            f"{key}: {size} needs a mesh axis {axis!r} of {size} devices, but the mesh is "
            f"{dict(mesh.shape)}; drop InitOptions(mesh=...) to let the config build it, or "
            f"give it {axis}: {size}."
        )


def _zero_axes(cfg: config_lib.Config, mesh: jax.sharding.Mesh, abstract: PyTree) -> dict[str, Any]:
    """Under sequence or context parallelism (a ``seq`` or ``context`` axis of more than one
    device) ZeRO shards over ``data`` x ``context`` x ``seq``, as DeepSpeed shards over its
    sequence-parallel ranks; under expert parallelism (an ``expert`` axis) over ``data`` x
    ``expert``, each expert leaf split over ``expert`` on its experts dimension (DeepSpeed's
    expert and expert data-parallel groups); else ``data``."""
    _require_axis("sequence_parallel_size", cfg.sequence_parallel_size, SEQ_AXIS, mesh)
    _require_axis("context_parallel_size", cfg.context_parallel_size, CONTEXT_AXIS, mesh)
    _require_axis("expert_parallel.autoep_size", cfg.autoep_size(), EXPERT_AXIS, mesh)
    split = {
        field: axis
        for field, axis in (("context_axis", CONTEXT_AXIS), ("seq_axis", SEQ_AXIS))
        if mesh.shape.get(axis, 1) > 1
    }
    tokens = tuple(split.values())  # the axes whose devices share rows and split tokens
    if mesh.shape.get(EXPERT_AXIS, 1) > 1:
        out = _experts(cfg, mesh, abstract)
    elif tokens:
        out = {"axis": (DATA_AXIS,)}
    else:
        return {}
    # the experts' groups inside each sequence group's tokens, as the mesh orders them
    out["axis"] = tuple(a for a in mesh.axis_names if a in (*out["axis"], *tokens))
    return {**out, **split}


def _experts(cfg: config_lib.Config, mesh: jax.sharding.Mesh, abstract: PyTree) -> dict[str, Any]:
    """Expert parallelism's plan options: the expert leaves by name or by
    ``expert_parallel.expert_params``; none found is an error naming the leaves."""
    patterns = cfg.expert_params()
    found = expert.expert_leaves(abstract, patterns)
    if not any(found):
        names = [dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
        shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        how = (
            f"no leaf matches expert_parallel.expert_params {list(patterns)}"
            if patterns
            else ("no leaf is named as an expert parameter (a path component 'experts')")
        )
        raise ValueError(
            f"expert_parallel.autoep_size: {mesh.shape[EXPERT_AXIS]} but {how}; the leaves are "
            f"{shown}. List the expert leaves in expert_parallel.expert_params (dotted-path "
            "globs, e.g. ['*.experts.*']), or set autoep_size: 1."
        )
    return {
        "axis": (DATA_AXIS, EXPERT_AXIS),
        "expert_axis": EXPERT_AXIS,
        "expert_leaves": found,
        "num_experts": cfg.num_experts(),
    }


def _pipeline(cfg: config_lib.Config, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Pipeline parallelism (``pipeline.stages`` > 1): the ``pipe`` axis and the schedule; the
    leaves it splits are known once the loss is traced (:mod:`jzero.engine.resolve`)."""
    stages = cfg.pipeline_stages()
    _require_axis("pipeline.stages", stages, PIPE_AXIS, mesh)
    if mesh.shape.get(PIPE_AXIS, 1) <= 1:
        return {}
    return {
        "pipe_axis": PIPE_AXIS,
        "pipe_schedule": cfg.pipeline_schedule(),
        "pipe_virtual": cfg.pipeline_virtual_stages(),
    }


def needs_program(mesh: jax.sharding.Mesh, specs: PyTree, tp_rules: Any) -> bool:
    """Whether AutoTP is on (``tp_rules`` from :func:`tensor_parallel`) over a model axis of
    more than one device and its names split nothing over it (``specs``), so the model's
    program must be read: at the first batch, where ``initialize`` was given none."""
    if tp_rules is None or mesh.shape.get(tensor.MODEL_AXIS, 1) <= 1:
        return False
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return not any(tensor.MODEL_AXIS in tuple(x) for x in leaves if isinstance(x, P))


def _note_no_program(choices: Sequence[Any], axis: str) -> None:
    """Names matched no rule and no batch's shapes are known, so the program cannot be read:
    where nothing at all is split over ``axis``, the error that says how to give them."""
    if any(axis in tuple(c.spec) for c in choices):
        return
    raise ValueError(
        f"tensor_parallel.autotp_size: no parameter's name matches an AutoTP rule, so nothing "
        f"would be split over {axis!r}, and AutoTP reads the model's program only from a "
        "batch's shapes. Pass jzero.initialize(..., batch=batch) (arrays or "
        "jax.ShapeDtypeStruct), or give the leaves a tensor_parallel.tp_plan."
    )


def tensor_parallel(
    cfg: config_lib.Config,
    mesh: jax.sharding.Mesh,
    abstract: PyTree,
    param_specs: PyTree,
    program: Callable[[], Mapping[int, Any]] | None = None,
    *,
    wait: bool = False,
) -> tuple[PyTree, list[str] | None]:
    """AutoTP (``tensor_parallel.autotp_size`` > 1, or a ``tp_plan``): the params' specs over
    the model axis, the user's own winning, and the rule behind each; as given otherwise.
    ``program`` (read only when some leaf's name matches no rule) gives the splits the traced
    loss shows (:func:`jzero.rewrite.program_splits`); ``None`` where no batch's shapes are
    known yet: where the names split nothing, an error, unless ``wait`` (the engine reads the
    program at the first batch: :func:`needs_program`)."""
    size, tp_plan = cfg.autotp_size(), cfg.tp_plan()
    if size <= 1 and not tp_plan:
        return param_specs, None
    axis = tensor.MODEL_AXIS
    _require_axis("tensor_parallel.autotp_size", size, axis, mesh)
    heads = (cfg.tensor_parallel or {}).get("num_heads", cfg.model.get("num_heads"))
    keys = {"tp_plan": tp_plan, "param_specs": param_specs, "num_heads": heads, "axis": axis}
    tp = int(mesh.shape.get(axis, 1))
    specs, choices = tensor.autotp_specs(abstract, tp, **keys)
    if tensor.unmatched(choices) and tp > 1:
        if program is not None:
            specs, choices = tensor.autotp_specs(abstract, tp, program=program(), **keys)
        elif not wait:
            _note_no_program(choices, axis)
    loose = tensor.unmatched(choices)
    if loose and (program is not None or not wait):  # else read at the first batch
        logger.warning(
            "jzero: AutoTP matched no rule for %d leaves, replicated over %r: %s (give them a "
            "tensor_parallel.tp_plan entry to split them)",
            len(loose),
            axis,
            ", ".join(loose),
        )
    return specs, [c.rule for c in choices]
