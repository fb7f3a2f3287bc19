"""Measured memory: a model at every stage, or one engine, from the compiled step.

:func:`measure_stages` builds a model (through the ``model`` it is given: this package imports
no engine and no model) once per stage, and compiles its step; :func:`memory_report` reports
one existing engine. Both return a :class:`~jzero.memory.PlanReport`. ``jzero plan``'s
:func:`~jzero.demo.plan.plan_report` is :func:`measure_stages` with the built-in GPT.

Decisions:

* The model state per category comes from the plan; the rest of the peak (batch, step
  counters, temporaries) from ``engine.lower(batch).compile().memory_analysis()``.
* For more devices than the machine has, the model state comes from a plan on a
  ``jax.sharding.AbstractMesh`` and the rest of the peak (batch, temporaries) is measured on the
  local devices at the same per-device micro batch, and is labelled so.
* The largest gathered layer: a leaf whose stacked-layer dimension a ``scan`` consumes (found
  in the traced loss, ``plan.layer_dims``) and that is sharded on another dim is gathered one
  layer slice at a time; any other sharded leaf is gathered whole. A plan made without the
  trace (no batch) falls back to a guess: a leaf whose siblings all share its leading dim.
* Offload variants are measured only when asked, or when a device memory is given and no
  option without offload fits (with or without activation checkpointing).
* Activation checkpointing: every row is compiled with the config's ``activation_checkpointing``
  (no section or ``policy: null``: nothing at stages 0-2, and stage 3 keeps its own rule for
  the layers it gathers; both count as without, labelled ``none``). The opposite setting is
  loaded from the same source with more overrides, so it means exactly what ``--set`` means:
  a config without checkpointing (no policy, or ``none``) gets ``policy=full``; a config with
  a policy gets ``policy=null`` and ``cpu_checkpointing=false`` (what leaving the section out
  means). It is compiled once more per row when it can matter. Without a device memory: for
  every row (the report's purpose is to show both; this doubles the compilations;
  ``compare_checkpointing=False`` skips it). With a device memory: only where it can change
  the recommendation, since the stage is weighed before activation checkpointing: a config
  without checkpointing measures it only for the rows that do not fit without it; a config
  with checkpointing measures the step without it only for the rows that fit with it
  (without it they need more).
* :func:`memory_report` labels its row with the engine's own policy and compares nothing: the
  engine's step is compiled with one setting, and another needs another engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jzero.memory._format import check_margin, check_positive, parse_size, recommend
from jzero.memory._report import PlanReport, StageMemory
from jzero.parallel.zero import largest_gathered
from jzero.plan import HOST_MEMORY_KINDS, host_state_bytes, model_state_bytes

__all__ = ["StageRows", "measure_stages", "memory_report", "offload_variants"]

logger = logging.getLogger(__name__)


def _policy(cfg: Any) -> str:
    """The config's activation-checkpointing policy; ``"none"`` also for no policy (jzero's
    default: nothing at stages 0-2, stage 3's own rule for the layers it gathers)."""
    policy = getattr(getattr(cfg, "activation_checkpointing", None), "policy", None)
    return "none" if policy in (None, "none") else str(policy)


def _state_bytes(
    plan: Any, count: Callable[..., dict[str, int]], accumulation_steps: int
) -> dict[str, int]:
    per_category = count(plan, accumulation_steps=accumulation_steps)
    return {k: int(v) for k, v in per_category.items()}


def _host_kind(shardings: Any) -> str | None:
    import jax

    kinds = {getattr(s, "memory_kind", None) for s in jax.tree.leaves(shardings)}
    return next((k for k in HOST_MEMORY_KINDS if k in kinds), None)


def _offload_name(plan: Any) -> str:
    opt, params = _host_kind(plan.opt_state), _host_kind(plan.params)
    return {(False, False): "none", (True, False): "optimizer", (False, True): "params"}.get(
        (opt is not None, params is not None), "optimizer+params"
    )


def offload_variants(stages: Sequence[int]) -> list[tuple[int, str]]:
    """The (stage, offload) rows with offload that ``stages`` allow, from the stage table,
    in the order the plan prints them (each offload option, then the stages)."""
    from jzero.plan import OFFLOADS, stage_spec

    return [
        (s, option) for option in OFFLOADS[1:] for s in stages if option in stage_spec(s).offloads
    ]


def _plan_on(engine: Any, devices: int) -> Any:
    """The engine's plan recomputed for ``devices`` on an abstract mesh (no devices needed)."""
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from jzero import plan as plan_lib

    local = engine.plan
    if len(local.zero_axes) > 1:
        raise ValueError(
            f"jzero plan --devices: planning another device count is for meshes whose ZeRO "
            f"axis is data alone, but this one shards over {' x '.join(local.zero_axes)} "
            "(sequence parallelism); drop --devices to plan the config's mesh."
        )
    sizes = {**dict(local.mesh.shape), local.options.parallel.axis: devices}
    mesh = AbstractMesh(
        tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes)
    )
    zero = engine.config.zero_optimization
    specs = None
    if any(tuple(b) for b in local.base_specs):
        specs = jax.tree.structure(local.abstract_params).unflatten(list(local.base_specs))
    options = plan_lib.PlanOptions().replace(
        axis=local.options.parallel.axis,
        persistence_threshold=zero.stage3_param_persistence_threshold,
        param_specs=specs,
        precision=local.options.precision,
        offload_optimizer=_host_kind(local.opt_state),
        offload_ratio=zero.offload_optimizer.ratio,
        offload_params=_host_kind(local.params),
        reshard_after_forward=local.options.zero.reshard_after_forward,
        hpz=local.options.zero.hpz,
    )
    return plan_lib.make_plan(
        local.abstract_params,
        engine.optimizer,
        mesh,
        local.stage,
        options,
        layer_dims=local.layer_dims if local.layers_traced else None,
    )


def _stage_memory(engine: Any, batch: Any = None, plan: Any = None) -> StageMemory:
    local = engine.plan
    plan = local if plan is None else plan
    accum = engine.accumulation_steps
    device = _state_bytes(plan, model_state_bytes, accum)
    host = {k: v for k, v in _state_bytes(plan, host_state_bytes, accum).items() if v}
    layer, leaf = largest_gathered(plan, in_bytes=True)
    row = StageMemory(plan.stage.stage, _offload_name(plan), device, host, layer, leaf)
    if batch is None:
        return row
    from jzero import hlo

    compiled = engine.lower(batch).compile()
    mem = compiled.memory_analysis()
    by_axes = hlo.collectives_by_axes(compiled, engine.mesh)
    comm = sum(s.bytes for stats in by_axes.values() for s in stats.values())
    cross = None
    if "replica" in engine.mesh.shape:
        cross = sum(
            s.bytes for axes, stats in by_axes.items() if "replica" in axes for s in stats.values()
        )
    within = {
        name: sum(s.bytes for axes, stats in by_axes.items() if axes == (name,)
                  for s in stats.values())
        if name in engine.mesh.shape
        else None
        for name in ("model", "seq", "pipe", "expert")
    }  # fmt: skip
    local_device = _state_bytes(local, model_state_bytes, accum)
    resident = sum(v for k, v in local_device.items() if k != "grads")
    if not mem.host_argument_size_in_bytes:  # host arrays are then counted among the arguments
        resident += sum(v for k, v in _state_bytes(local, host_state_bytes, accum).items())
    other = mem.argument_size_in_bytes - resident
    if other < 0:
        logger.warning(
            "memory_analysis reports %d argument bytes, less than the plan's %d",
            mem.argument_size_in_bytes,
            resident,
        )
    return dataclasses.replace(
        row,
        argument_bytes=int(mem.argument_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        other_argument_bytes=max(int(other), 0),
        comm_bytes=int(comm),
        cross_replica_bytes=cross,
        model_axis_bytes=within["model"],
        seq_axis_bytes=within["seq"],
        pipe_axis_bytes=within["pipe"],
        expert_axis_bytes=within["expert"],
    )


def memory_report(
    engine: Any,
    batch: Any = None,
    device_memory: int | str | None = None,
    margin: float = 0.1,
    devices: int | None = None,
) -> PlanReport:
    """The memory report of one engine: its plan's bytes, and with a batch the compiled step's.

    Args:
      engine: a :class:`jzero.Engine`.
      batch: a global batch (arrays or ``jax.ShapeDtypeStruct``); with it the step is compiled
        and ``memory_analysis()`` gives the peak.
      device_memory: the memory of one device, to say whether the engine's stage fits.
      margin: fraction of device memory kept free.
      devices: report the model state for this many data-parallel devices (planned on an
        abstract mesh); the compiled part stays the engine's own.

    Returns:
      A :class:`PlanReport` with one row.
    """
    local = engine.plan.num_shards
    n = local if devices is None else check_positive(devices, "devices", str(local), integer=True)
    if batch is not None:
        engine.resolve(batch)  # the final plan: stacked layers found in the traced loss
    row = _stage_memory(engine, batch, None if n == local else _plan_on(engine, n))
    row = dataclasses.replace(row, checkpointing=_policy(engine.config))
    title = f"jzero memory report: ZeRO stage {row.stage}, {n} devices"
    memory = None if device_memory is None else parse_size(device_memory)
    measured = local if batch is not None else None
    return PlanReport(title, (row,), n, measured, memory, check_margin(margin))


def _with_zero(cfg: Any, stage: int, offload: str, sizes: tuple[int, int, int] | None) -> Any:
    zero = cfg.zero_optimization
    opt = "cpu" if offload in ("optimizer", "optimizer+params") else "none"
    par = "cpu" if offload == "optimizer+params" else "none"
    zero = dataclasses.replace(
        zero,
        stage=stage,
        offload_optimizer=dataclasses.replace(zero.offload_optimizer, device=opt),
        offload_param=dataclasses.replace(zero.offload_param, device=par),
    )
    cfg = dataclasses.replace(cfg, zero_optimization=zero)
    if sizes is not None:
        tbs, micro, accum = sizes
        cfg = dataclasses.replace(
            cfg,
            train_batch_size=tbs,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accum,
        )
    return cfg


@dataclasses.dataclass(frozen=True)
class StageRows:
    """Which rows :func:`measure_stages` compiles, each costing one compilation."""

    stages: Sequence[int] = (0, 1, 2, 3)
    """The ZeRO stages to measure."""
    offload: bool | None = None
    """Also measure the stages with offload to host memory: ``True`` always, ``False`` never,
    ``None`` only when a device memory is given and no stage fits without."""
    compare_checkpointing: bool | None = None
    """Also compile each row with the opposite activation-checkpointing setting: ``True``
    always, ``False`` never, ``None`` always without a device memory and with one only where it
    can change the recommendation (see the module's decisions)."""


def measure_stages(
    config: Any,
    model: Callable[[Any], tuple[str, Callable[[Any, Any], tuple[Any, Any]]]],
    devices: int | None = None,
    device_memory: int | str | None = None,
    *,
    overrides: Sequence[str] = (),
    margin: float = 0.1,
    rows: StageRows | None = None,
) -> PlanReport:
    """Every ZeRO stage of a config's model side by side, measured from the compiled step.

    The model is built once per stage (and per activation-checkpointing setting compared), as
    an abstract engine (``initialize(..., abstract=True)``), and its step compiled
    (``engine.lower(batch).compile().memory_analysis()``). This package builds no model and
    imports no engine: ``model`` does both (:func:`jzero.demo.plan.plan_report` passes the
    built-in GPT).

    Args:
      config: a config (path, mapping or :class:`jzero.Config`).
      model: ``model(cfg) -> (name, build)``, called once with the loaded config (a bad model
        section fails there, before anything is built): ``name`` describes the model in the
        title (``"GPT 2 layers, d_model 32"``); ``build(cfg, mesh) -> (engine, batch)`` makes
        the abstract engine of a row's config on ``mesh`` (``None``: the config's own) and a
        global batch of ``jax.ShapeDtypeStruct`` for its step.
      devices, device_memory, overrides, margin: as :func:`jzero.demo.plan.plan_report`
        describes them.
      rows: the rows to compile (:class:`StageRows`: the stages, their offload variants, the
        opposite activation checkpointing); ``None``: its defaults.

    Returns:
      A :class:`PlanReport`; ``print(result.table())``.
    """
    import jax

    from jzero import config as config_lib
    from jzero.distributed import make_mesh
    from jzero.plan import stage_spec

    choice = rows if rows is not None else StageRows()
    stages, offload = choice.stages, choice.offload
    compare_checkpointing = choice.compare_checkpointing
    if not stages:
        raise ValueError("stages is empty; pass the ZeRO stages to measure, e.g. (0, 1, 2, 3).")
    stages = tuple(stage_spec(s).stage for s in stages)  # a clear error for a bad stage
    cfg = config_lib.load_config(config, overrides=overrides)
    model_name, build = model(cfg)
    memory = None if device_memory is None else parse_size(device_memory)
    margin = check_margin(margin)
    local_n = jax.device_count()
    mesh, sizes, n = None, None, None
    if devices is not None:
        n = check_positive(devices, "devices", str(local_n), integer=True)
        others = {k: v for k, v in cfg.mesh_sizes().items() if k != "data" and v not in (1, -1)}
        if others:
            raise ValueError(
                f"jzero plan --devices {n}: planning another device count is for a mesh of the "
                f"data axis alone, but this config's mesh also has {others} (tensor, sequence "
                "or pipeline parallelism); drop --devices to plan the config's own mesh."
            )
        sizes = config_lib.resolve_batch_sizes(cfg, n)  # a clear error if n does not fit the batch
        mesh = make_mesh(min(n, local_n))
        if n > local_n:
            _, micro, accum = sizes
            sizes = (micro * accum * local_n, micro, accum)

    policy = _policy(cfg)
    other = "full" if policy == "none" else "none"
    usable = None if memory is None else memory * (1 - margin)
    loaded: dict[str, Any] = {}

    # Without checkpointing is what a config without the section means (policy null; stage 3
    # then keeps its own rule for the layers it gathers), and host checkpointing goes with it.
    flip = ["activation_checkpointing.policy=full"]
    if policy != "none":
        flip = [
            "activation_checkpointing.policy=null",
            "activation_checkpointing.cpu_checkpointing=false",
        ]

    def other_cfg() -> Any:  # loaded only when first needed
        if "cfg" not in loaded:
            with warnings.catch_warnings():  # the same no-effect keys were reported above
                warnings.simplefilter("ignore", config_lib.JzeroConfigWarning)
                loaded["cfg"] = config_lib.load_config(config, overrides=[*overrides, *flip])
        return loaded["cfg"]

    def wanted(row: StageMemory) -> bool:
        if compare_checkpointing is not None or usable is None:
            return compare_checkpointing is not False
        return row.peak > usable if policy == "none" else row.peak <= usable

    def measure_row(stage: int, offload_name: str) -> StageMemory:
        row = measure(cfg, stage, offload_name)
        if compare_checkpointing is False:
            return dataclasses.replace(row, checkpointing=policy)
        row = dataclasses.replace(row, checkpointing=policy, other_checkpointing=other)
        if not wanted(row):
            return row
        alt = measure(other_cfg(), stage, offload_name)
        return dataclasses.replace(row, other_temp_bytes=alt.temp_bytes, other_peak_bytes=alt.peak)

    def measure(base: Any, stage: int, offload_name: str) -> StageMemory:
        engine, batch = build(_with_zero(base, stage, offload_name, sizes), mesh)
        engine.resolve(batch)
        seen.setdefault("devices", engine.plan.num_shards)
        seen.setdefault("mesh", dict(engine.mesh.shape))
        seen.setdefault("replicas", engine.plan.num_replicas)
        seen.setdefault("micro", (engine.micro_batch_size, engine.accumulation_steps))
        seen.setdefault("psi", sum(math.prod(leaf.shape) for leaf in engine.plan.leaves))
        target = n if n is not None else engine.plan.num_shards
        plan = None if target == engine.plan.num_shards else _plan_on(engine, target)
        return _stage_memory(engine, batch, plan)

    seen: dict[str, Any] = {}
    measured = [measure_row(stage, "none") for stage in stages]
    n = seen["devices"] if n is None else n
    options = [(r.stage, r.offload, p, peak) for r in measured for p, _, peak in r.variants()]
    fits = recommend(options, memory, margin)
    if offload or (offload is None and fits is not None and not fits.fits):
        measured += [measure_row(stage, name) for stage, name in offload_variants(stages)]
    micro, accum = seen["micro"]
    title = (
        f"jzero plan: {model_name}, {seen['psi']:,} parameters, {n} devices"
        + (f" per replica x {seen['replicas']} replicas" if seen["replicas"] > 1 else "")
        + (
            f" of ZeRO's axes in mesh {seen['mesh']}"
            if any(a in seen["mesh"] for a in ("model", "seq", "pipe"))
            else ""
        )
        + f", micro batch {micro} x {accum} accumulation"
    )
    return PlanReport(title, tuple(measured), n, seen["devices"], memory, margin)
