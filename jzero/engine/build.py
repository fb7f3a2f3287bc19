"""``jzero.initialize``: from a config, a loss and parameters (or a model) to an :class:`Engine`.

It reads the config, builds the mesh and the plan, creates the parameters and the optimizer
state directly in their shards (or, under the NVMe tier, in their files) and hands them to
:class:`jzero.engine.Engine`, which does everything after. ``initialize`` and
:class:`InitOptions` are importable from :mod:`jzero` and :mod:`jzero.engine`.

``initialize`` reads as the sequence of its steps, each a function below it: load the config,
gather the model's inputs (a Flax or Equinox model through its adapter; the rarer settings of
how the parameters are made and placed come as one :class:`InitOptions`), the mesh, the
parameters' shapes, resolve "auto", the optimizer, the planner and the first plan (checked), the
batch sizes, the first state, one log line, the :class:`~jzero.engine.Engine`.

Decisions:

* The call keeps to eight parameters: a function of a key that creates the parameters is
  given as ``params`` itself (told from a value by kind, :func:`jzero._util.is_creator`, so a
  callable pytree such as an Equinox module stays a value), and what few runs set (their own
  mesh and partition specs, a Linen model's example inputs, weights to load and their names)
  is one frozen :class:`InitOptions`.

* Every "auto" in the config is resolved here, once, from the parameters' shapes and the
  optimizer given (:func:`jzero.config.resolve_auto`); the batch sizes wait for the first batch
  when they are all "auto" (the engine takes them then).
* The config is translated once, by :mod:`jzero.engine.settings`: the plan's options
  (:func:`~jzero.engine.settings.plan_options`), AutoTP's specs. The plan is made by a
  ``functools.partial`` of :func:`jzero.plan.make_plan` over the params, the optimizer, the
  mesh, the stage and those options, kept by the engine as ``replan``: the first step re-plans
  with ``layer_dims=`` (and ``pipe_leaves=``) only.
* Flax models go through :mod:`jzero.engine.flax_adapter` and Equinox ones through
  :mod:`jzero.engine.equinox_adapter`, imported only when ``model=`` is given; the engine then
  carries the non-trainable state as ``TrainState.extra``.
* The NVMe tier's paths are checked (room for two versions) before any state is made, and its
  stores are closed when making the first version fails.
* ``jzero.initialize`` is this module's :func:`initialize`; :mod:`jzero.engine` holds the
  :class:`~jzero.engine.Engine` it returns and does not import this module (no cycle).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jzero import config as config_lib
from jzero import distributed, monitor, optim
from jzero._util import abstract_tree, divisors, dotted, is_creator
from jzero.distributed import make_mesh
from jzero.engine import settings
from jzero.engine.checks import check_mesh_splits
from jzero.engine.engine import Engine
from jzero.engine.resolve import Setup
from jzero.plan import Plan, make_plan
from jzero.step import TrainState, init_train_state

__all__ = ["InitOptions", "initialize"]

logger = logging.getLogger("jzero.engine")  # the engine's one log name, for all its modules
PyTree = Any


def _is_abstract(tree: PyTree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _optimizer(
    cfg: config_lib.Config, optimizer: optax.GradientTransformation | None
) -> tuple[optax.GradientTransformation, Callable[[jax.Array], jax.Array] | None]:
    """The optimizer and its schedule (none for one passed in code, in which an
    ``optax.contrib.muon`` is made to orthogonalise once: :func:`jzero.optim.from_optax_muon`);
    its state kept in bfloat16 under ``bf16.bf16_optimizer_states``, whichever optimizer it
    is, as DeepSpeed does, and run in float32 on the bfloat16 params under
    ``bf16.bf16_master_weights_and_grads``
    (:func:`jzero.optim.float32_update`). That both need ``bf16.enabled`` is the config's rule,
    checked at load and once ``"auto"`` is resolved."""
    schedule = None
    if optimizer is None:  # else the config's sections were dropped (config.resolve_auto)
        if cfg.optimizer is None:
            raise ValueError(
                "No optimizer: pass optimizer=<an optax transformation> to jzero.initialize, or "
                "add an 'optimizer' section to the config, e.g. {type: AdamW, params: {lr: 0.001}}."
            )
        optimizer, schedule = optim.build_optimizer(cfg), optim.build_lr_schedule(cfg)
    else:  # optax's Muon orthogonalises each matrix once, whole, as jzero's does
        optimizer = optim.from_optax_muon(optimizer)
    if cfg.bf16.bf16_optimizer_states:
        optimizer = optim.low_precision_state(optimizer)
    if cfg.bf16.bf16_master_weights_and_grads:  # bf16 params are the masters: update in fp32
        optimizer = optim.float32_update(optimizer)
    return optimizer, schedule


def _check_array_leaves(params: PyTree) -> None:
    """Every leaf of ``params`` is an array (or its shape): a function or other object among
    them (an Equinox module's activation, held in a dict) is refused by name, never called."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or isinstance(
            leaf, (int, float, complex, np.generic)
        ):
            continue
        name = dotted(path) or "<root>"
        raise TypeError(
            f"params leaf {name} is a {type(leaf).__name__}, not an array: params must be a "
            "pytree of arrays. For an Equinox module pass model=module (or its constructor), "
            "or params=eqx.partition(module, eqx.is_array)[0] with a loss that calls "
            "eqx.combine(params, static)."
        )


def _check_sequence_parallel(cfg: config_lib.Config) -> None:
    """What sequence and context parallelism do not compose with yet: clear errors, never a
    wrong step."""
    zero = cfg.zero_optimization
    refused = {
        "zero_hpz_partition_size > 1 (ZeRO++ hpZ)": zero.zero_hpz_partition_size > 1,
        "zero_quantized_weights / zero_quantized_gradients (ZeRO++)": bool(
            zero.zero_quantized_weights or zero.zero_quantized_gradients
        ),
        "offload_optimizer.device: nvme": zero.offload_optimizer.device == "nvme",
    }
    key, size = next(
        (
            (k, n)
            for k, n in (
                ("sequence_parallel_size", cfg.sequence_parallel_size),
                ("context_parallel_size", cfg.context_parallel_size),
            )
            if n > 1
        ),
        ("sequence_parallel_size", cfg.sequence_parallel_size),
    )
    for what, on in refused.items():
        if on:
            raise ValueError(
                f"{key}: {size} does not compose with {what} yet; set {key}: 1, or turn that off."
            )


def _mesh_sizes(cfg: config_lib.Config) -> dict[str, int]:
    """The config's mesh, with ``jzero launch --replicas R`` as its replica axis."""
    sizes = cfg.mesh_sizes()
    devices = jax.device_count()
    for key, _, size in cfg.parallel_sizes():
        if size > 1 and devices % size:
            raise ValueError(
                f"{key}: {size} does not divide the {devices} devices, so they can't form "
                f"equal groups of {size}; use one of {', '.join(map(str, divisors(devices)))}."
            )
    replicas = distributed.launcher_replicas()
    if replicas is None:
        return sizes
    if sizes.get("replica", -1) not in (-1, replicas):
        raise ValueError(
            f"jzero launch --replicas {replicas} contradicts the config's mesh.replica: "
            f"{sizes['replica']}; drop one of them."
        )
    sizes["replica"] = replicas
    logger.info("jzero: %d replica groups from jzero launch --replicas", replicas)
    return sizes


def _note_optax_muon(plan: Any, tx: optax.GradientTransformation) -> None:
    """Logs, for an ``optax.contrib.muon`` passed in code that jzero could not find inside the
    optimizer (:func:`jzero.optim.from_optax_muon`, which ``initialize`` applies, rewrites the
    ones it finds) at a stage that shards its state, that it runs collectives in every
    Newton-Schulz iteration and ``jzero.optim.muon`` does not."""
    contrib = getattr(optax, "contrib", None)
    kind = getattr(contrib, "MuonState", None)
    if kind is None or not plan.stage.shard_opt_state:
        return
    nodes = jax.tree.leaves(plan.abstract_opt_state, is_leaf=lambda x: isinstance(x, kind))
    if any(isinstance(x, kind) for x in nodes) and not optim.exchanges_once(tx):
        logger.warning(
            "jzero: an optax.contrib.muon that jzero cannot see into (a transformation of "
            "your own class?) updates the sharded matrices where they rest, so under ZeRO "
            "stage %d every Newton-Schulz iteration runs collectives; "
            "jzero.optim.muon(...) takes the same rates (the rarer settings as one "
            "jzero.optim.MuonOptions) and orthogonalises each matrix once, whole (one exchange "
            "in and one out).",
            plan.stage.stage,
        )


@dataclasses.dataclass(frozen=True)
class InitOptions:
    """How :func:`initialize` makes and places the parameters, beyond the ``params`` or
    ``model`` given: the settings few runs need, kept apart from the call's common arguments
    (``jzero.initialize(params, loss_fn, tx, config, options=jzero.InitOptions(init_from=
    "hf/"))``). Every field is optional."""

    mesh: jax.sharding.Mesh | None = None
    """A mesh to use instead of the config's ``mesh`` section (refused beside a parallel size
    ``"auto"``, which chooses the mesh)."""
    param_specs: PyTree | None = None
    """Your own ``PartitionSpec`` per parameter leaf (a pytree shaped as the params) on mesh
    axes other than ZeRO's; with ``model=`` they replace the model's own annotations."""
    init_args: tuple = ()
    """A Flax Linen ``model``'s example inputs for its ``init``, e.g. ``(example_x,)``."""
    init_from: str | os.PathLike | None = None
    """Weights to start from: a ``.safetensors`` file, a sharded export (a directory with
    ``model.safetensors.index.json``) or a jzero checkpoint directory, each process reading
    only its own shards (see :mod:`jzero.weights`); ``params`` (or ``model``) then only give
    the shapes. Under mixed precision the loaded values become the float32 master weights.
    Takes precedence over the config's ``checkpoint.init_from``."""
    name_map: Mapping[str, str] | Callable[[str], str] | None = None
    """With ``init_from`` (or the config's ``checkpoint.init_from``): a parameter's dotted path
    -> the tensor's name in the file, as a dict (paths not in it keep their own name) or a
    function."""


def initialize(
    params: PyTree | Callable[[jax.Array], PyTree] | None = None,
    loss_fn: Callable[..., Any] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    config: str | Mapping[str, Any] | config_lib.Config | None = None,
    *,
    model: Any = None,
    batch: PyTree | None = None,
    abstract: bool = False,
    options: InitOptions | None = None,
) -> Engine:
    """Builds a ZeRO engine, DeepSpeed's ``deepspeed.initialize`` for JAX.

    Args:
      params: the initial parameters (arrays); or a function of a random key that creates
        them (``params=lambda key: make_params(key)``; a function, ``functools.partial``,
        method or class: a callable pytree such as an Equinox module is a value, never
        called), run inside the init program, so the parameters are created directly in their
        shards and no device ever holds the full model at stage 3; or their shapes
        (``jax.ShapeDtypeStruct``) with ``abstract=True`` or weights to load
        (``InitOptions(init_from=...)``).
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``: the mean loss of the
        batch it is given, written for full (unsharded) parameters.
      optimizer: an optax transformation; ``None`` builds the config's ``optimizer`` and
        ``scheduler`` sections.
      config: a dict, a YAML/JSON file path or a :class:`jzero.config.Config`.
      model: instead of ``params``, a Flax NNX module (or a function that builds one; it is
        then built directly in its shards) with ``loss_fn(model, batch)``, a Linen module with
        ``InitOptions(init_args=...)`` (see :mod:`jzero.engine.flax_adapter`), or an Equinox
        module (or its constructor). Non-trainable state (BatchNorm statistics) is carried
        through the step and never sharded as parameters.
      batch: a batch as ``train_step`` will take it (this process's rows), or its shapes
        (``jax.ShapeDtypeStruct``): every decision that waits for a batch (the parallel sizes
        ``"auto"``, the batch sizes, ``stage: auto``, the layers the loss's scans consume) is
        taken now, and the state is created once, in its final layout. Without it a config that
        needs one waits for the first batch, and creates the state then.
      abstract: build the plan and the state's shapes only (``jax.ShapeDtypeStruct`` with
        their shardings), as a meta-device model in FSDP: nothing is created on a device, so a
        model too large for a stage can be planned at it. ``engine.lower(batch)`` and the
        memory and communication reports work; training, evaluating and saving are refused.
      options: the rarer settings of how the parameters are made and placed, as one
        :class:`InitOptions`: your own mesh and partition specs, a Linen model's example
        inputs, weights to load (and their names in the file).

    Returns:
      The :class:`Engine`.
    """
    cfg = _load(config)
    if abstract and cfg.zero_optimization.offload_optimizer.device == "nvme":
        raise ValueError(
            "initialize(abstract=True) creates no state, and the NVMe tier's state lives in "
            "its files. Plan with offload_optimizer.device cpu (or none) instead."
        )
    if loss_fn is None:
        raise ValueError("loss_fn is required: loss_fn(params, batch) -> mean loss of the batch.")
    options = _options(options)
    model_in = _model_inputs(params, loss_fn, model, options)
    layout_auto = any(k in cfg.auto for k in config_lib.LAYOUT_KEYS)
    if layout_auto:
        _check_layout_auto(cfg, options.mesh)
    mesh = options.mesh if options.mesh is not None else make_mesh(_mesh_sizes(cfg))
    key = _key(cfg.seed)
    shapes = model_in.shapes(key)
    from_first_batch = config_lib.batch_from_first_batch(cfg)
    auto_keys = cfg.auto  # resolve_auto empties it; stage "auto" is chosen at the first batch
    cfg = _resolve(cfg, shapes, mesh, optimizer_given=optimizer is not None)
    program = model_in.program(shapes, batch)
    # Names that split nothing, and no batch yet: the program is read at the first batch (a
    # layout or stage search needs it at once, so there it is an error naming the fix).
    wait = not layout_auto and "zero_optimization.stage" not in auto_keys
    specs, tp_rules = settings.tensor_parallel(
        cfg, mesh, shapes, model_in.param_specs, program, wait=wait
    )
    tx, schedule = _optimizer(cfg, optimizer)
    planner = _planner(mesh, shapes, tx, specs, tp_rules)
    read_program = None
    if program is None and settings.needs_program(mesh, specs, tp_rules):
        read_program = _program_reader(cfg, mesh, (shapes, tx, model_in))
    auto = _auto_stage(cfg, auto_keys, mesh, planner)
    layout = None
    if layout_auto:  # the stage too is chosen with the layout, at the first batch
        layout = _auto_layout(
            cfg, auto_keys, mesh, auto, (shapes, tx, model_in.param_specs, program)
        )
        auto = None
    replan = planner(cfg) if read_program is None else _waiting(planner(cfg))
    plan = _first_plan(
        cfg,
        replan,
        mesh,
        tx,
        stage_chosen_later=auto is not None or layout is not None or read_program is not None,
    )
    sizes = (
        None
        if from_first_batch or layout is not None
        else config_lib.resolve_batch_sizes(cfg, plan.data_parallel_size)
    )
    init_from = options.init_from if options.init_from is not None else cfg.checkpoint.init_from
    # The values checked now, though the state may be made later (the weights by their headers).
    if init_from is None:
        _initial_values(plan, model_in.params, shapes, model_in.init_fn, key, None, None, abstract)
    elif not abstract:
        from jzero import weights

        weights.check_weights(init_from, plan.abstract_params, name_map=options.name_map)
    _log_built(plan, sizes)
    adapted = model_in.adapted
    setup = Setup(
        config=cfg,
        plan=plan,
        loss_fn=model_in.loss_fn,
        optimizer=tx,
        learning_rate=schedule,
        takes_extra=adapted is not None,
        extra=abstract_tree(model_in.extra) if adapted is None else adapted.abstract_extra,
        to_model=None if adapted is None else adapted.to_model,
        sizes=sizes,
        replan=replan,
        auto_stage=auto,
        auto_layout=layout,
        read_program=read_program,
    )

    def make_state(s: Setup) -> tuple[TrainState, Any]:
        args = (s.config, s.plan, model_in, shapes, key, s.optimizer)
        return _first_state(*args, init_from, options.name_map, abstract)

    return Engine(setup, make_state, batch=batch, abstract=abstract)


# -- initialize's steps, in the order it takes them ---------------------------------------------


def _load(config: str | Mapping[str, Any] | config_lib.Config | None) -> config_lib.Config:
    """The validated config, its monitors' packages checked (a missing wandb extra is named
    before anything is built) and the distributed runtime started (before any JAX call)."""
    cfg = config_lib.load_config(config)
    monitor.check_available(cfg)
    distributed.ensure_initialized(cfg.distributed)
    return cfg


@dataclasses.dataclass
class _ModelInputs:
    """What the state is made from: the parameters (arrays, or their shapes), the function
    that creates them, the loss as the engine runs it, the parameter specs, a model's
    non-trainable state, and the Flax/Equinox adapter (``None`` for a plain pytree)."""

    params: PyTree
    loss_fn: Callable[..., Any]
    init_fn: Callable[[jax.Array], PyTree] | None
    param_specs: PyTree | None
    extra: PyTree = ()
    adapted: Any = None

    def shapes(self, key: Callable[[], jax.Array]) -> PyTree:
        """The parameters' shapes (from ``init_fn`` when no params were given, which are then
        those shapes), every leaf checked to be an array."""
        if self.params is None:
            self.params = jax.eval_shape(lambda: self.init_fn(key()))
        _check_array_leaves(self.params)
        return abstract_tree(self.params)

    def program(self, shapes: PyTree, batch: PyTree | None) -> Callable[[], Any] | None:
        """AutoTP's reading of the traced loss on ``batch``'s shapes
        (:func:`jzero.rewrite.program_splits`), made once when first asked; ``None`` without a
        batch."""
        if batch is None:
            return None
        from jzero.rewrite import program_splits

        extra = () if self.adapted is None else (self.adapted.abstract_extra,)
        return functools.cache(lambda: program_splits(self.loss_fn, shapes, *extra, batch))

    @property
    def made_with_extra(self) -> bool:
        """A Flax/Equinox model built by its init function, which makes its non-trainable
        state too (else that state came with the values, or there is none)."""
        return self.adapted is not None and self.adapted.values is None


def _options(options: InitOptions | None) -> InitOptions:
    """``initialize``'s ``options``, checked to be an :class:`InitOptions` (a dict is refused
    with the fix, never read by its keys)."""
    if options is None:
        return InitOptions()
    if not isinstance(options, InitOptions):
        raise TypeError(
            f"options must be a jzero.InitOptions, got {type(options).__name__}: pass "
            "options=jzero.InitOptions(mesh=..., param_specs=..., init_args=..., "
            "init_from=..., name_map=...)."
        )
    return options


def _model_inputs(
    params: PyTree | Callable[[jax.Array], PyTree] | None,
    loss_fn: Callable[..., Any],
    model: Any,
    options: InitOptions,
) -> _ModelInputs:
    """``initialize``'s model arguments as one :class:`_ModelInputs`: a Flax or Equinox
    ``model`` through its adapter (imported only then), else the params, or the function of a
    key given as ``params`` that creates them (a creator, :func:`jzero._util.is_creator`: a
    callable pytree is a value)."""
    init_fn = params if is_creator(params) else None
    if init_fn is not None:
        params = None
    inputs = _ModelInputs(params, loss_fn, init_fn, options.param_specs)
    if model is not None:
        from jzero.engine import equinox_adapter, flax_adapter  # only for Flax/Equinox models

        if params is not None or init_fn is not None:
            raise ValueError("Pass either model=... or params=..., not both.")
        eqx_model, eqx_abstract = equinox_adapter.is_equinox(model)
        if eqx_model:
            adapted = equinox_adapter.adapt(model, loss_fn, eqx_abstract)
        else:
            adapted = flax_adapter.adapt(model, loss_fn, options.init_args)
        inputs = _ModelInputs(
            params=adapted.abstract_params,
            loss_fn=adapted.loss_fn,
            init_fn=(lambda key: adapted.init_fn(key)[0]) if adapted.values is None else None,
            param_specs=adapted.param_specs if options.param_specs is None else options.param_specs,
            adapted=adapted,
        )
        if adapted.values is not None:
            inputs.params, inputs.extra = adapted.values
    if inputs.params is None and inputs.init_fn is None:
        raise ValueError(
            "Pass params (arrays, or a function of a key that creates them: "
            "params=lambda key: ...) or model=... (a Flax or Equinox model)."
        )
    return inputs


def _key(seed: int) -> Callable[[], jax.Array]:
    """The config's random key, made inside the programs that use it (no program of its own)."""

    def key() -> jax.Array:
        return jax.random.key(seed)

    return key


def _resolve(
    cfg: config_lib.Config, shapes: PyTree, mesh: jax.sharding.Mesh, *, optimizer_given: bool
) -> config_lib.Config:
    """The config with every "auto" resolved from the parameters' shapes and the optimizer
    given (:func:`jzero.config.resolve_auto`); a config without batch sizes says that the first
    batch sets them (an "auto" logs its own line)."""
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu")
    if config_lib.batch_from_first_batch(cfg) and not any(k in cfg.auto for k in batch_keys):
        logger.info(
            "jzero: the config sets no batch size (train_batch_size, "
            "train_micro_batch_size_per_gpu); the first batch given to train_step sets them."
        )
    return config_lib.resolve_auto(
        cfg,
        shapes,
        optimizer_given=optimizer_given,
        data_parallel_size=math.prod(mesh.shape.get(a, 1) for a in ("data", "expert", "replica")),
    )


def _planner(
    mesh: jax.sharding.Mesh,
    shapes: PyTree,
    tx: optax.GradientTransformation,
    param_specs: PyTree | None,
    tp_rules: Any,
) -> Callable[[config_lib.Config], Callable[..., Plan]]:
    """``planner(cfg)``: ``make_plan`` over these params, optimizer and mesh with config
    ``cfg``'s options (:func:`jzero.engine.settings.plan_options`; ``stage: auto`` tries
    several), as a ``functools.partial`` the first step re-plans with ``layer_dims=`` only."""

    def planner(c: config_lib.Config) -> Callable[..., Plan]:
        options = settings.plan_options(c, mesh, shapes, param_specs=param_specs, tp_rules=tp_rules)
        return functools.partial(make_plan, shapes, tx, mesh, c.zero_optimization.stage, options)

    return planner


def _waiting(replan: functools.partial) -> functools.partial:
    """``replan`` (a ``make_plan`` partial) with its options marked ``tp_waiting``: its plan may
    leave the model axis unused until the first batch's program is read."""
    *args, options = replan.args
    parallel = dataclasses.replace(options.parallel, tp_waiting=True)
    options = dataclasses.replace(options, parallel=parallel)
    return functools.partial(replan.func, *args, options, **replan.keywords)


def _program_reader(
    cfg: config_lib.Config,
    mesh: jax.sharding.Mesh,
    model: tuple[PyTree, optax.GradientTransformation, _ModelInputs],
) -> Callable[[PyTree], Callable[..., Plan]]:
    """AutoTP waiting for a batch: ``reader(batch)`` reads the model's program on ``batch``'s
    shapes and returns the ``replan`` of the specs it gives."""
    shapes, tx, model_in = model

    def reader(batch: PyTree) -> Callable[..., Plan]:
        program = model_in.program(shapes, batch)
        specs, rules = settings.tensor_parallel(cfg, mesh, shapes, model_in.param_specs, program)
        return _planner(mesh, shapes, tx, specs, rules)(cfg)

    return reader


def _first_plan(
    cfg: config_lib.Config,
    replan: Callable[..., Plan],
    mesh: jax.sharding.Mesh,
    tx: optax.GradientTransformation,
    *,
    stage_chosen_later: bool,
) -> Plan:
    """The plan before the loss is traced, checked: the mesh's splits (unless ``stage: auto``
    chooses the stage at the first batch), what sequence and context parallelism do not
    compose with,
    ``optax.contrib.muon``'s collectives, and that ``offload_optimizer.compute: host`` has a
    leafwise optimizer to stream."""
    plan = replan()
    if not stage_chosen_later:
        check_mesh_splits(plan, mesh)
    if plan.options.parallel.seq_axis is not None or plan.options.parallel.context_axis:
        _check_sequence_parallel(cfg)
    _note_optax_muon(plan, tx)
    from jzero.step import streamed_groups

    zero = cfg.zero_optimization
    host = zero.offload_optimizer.compute == "host"
    streamed_groups(plan, zero.sub_group_size, tx, host)  # a leafwise optimizer?
    return plan


def _first_state(
    cfg: config_lib.Config,
    plan: Plan,
    model_in: _ModelInputs,
    shapes: PyTree,
    key: Callable[[], jax.Array],
    tx: optax.GradientTransformation,
    init_from: str | Any,
    name_map: Any,
    abstract: bool,
) -> tuple[TrainState, Any]:
    """The first state, made in its shards (or, under the NVMe tier, in its files, whose
    stores are returned too and closed if making it fails), or only its shapes (``abstract``).
    A model built by its init function is built once, in the one init program, unless its
    weights come from ``init_from`` or go to the NVMe tier's files: its non-trainable state is
    then made on its own."""
    values = _initial_values(
        plan, model_in.params, shapes, model_in.init_fn, key, init_from, name_map, abstract
    )
    adapted, extra = model_in.adapted, model_in.extra
    nvme = None if abstract else _nvme_state(settings.nvme_options(cfg), plan, tx)  # paths first
    if abstract:
        if model_in.made_with_extra:
            extra = jax.eval_shape(lambda: adapted.init_fn(key()))[1]
        return init_train_state(plan, values, tx, extra, abstract=True), None
    if nvme is None and model_in.made_with_extra and init_from is None:
        return init_train_state(plan, lambda: adapted.init_fn(key()), tx, returns_extra=True), None
    try:
        if model_in.made_with_extra:
            extra = _init_extra(adapted, key, plan)
        if nvme is None:
            return init_train_state(plan, values, tx, extra), None
        from jzero.nvme import first_version

        return first_version(nvme, values, extra), nvme
    except BaseException:
        if nvme is not None:
            nvme.close()
        raise


def _log_built(plan: Plan, sizes: tuple[int, int, int] | None) -> None:
    """The one log line of an engine built: its stage, parameters, data-parallel size and
    batch arithmetic."""
    total = sum(math.prod(leaf.shape) for leaf in plan.leaves)
    logger.info(
        "jzero: stage %d, %s parameters, data-parallel %d, batch %s",
        plan.stage.stage,
        f"{total:,}",
        plan.data_parallel_size,
        "from the first batch"
        if sizes is None
        else "{} = {} x {} x {}".format(*sizes, plan.data_parallel_size),
    )


def _initial_values(
    plan: Plan,
    params: PyTree,
    shapes: PyTree,
    init_fn: Callable[[jax.Array], PyTree] | None,
    key: Callable[[], jax.Array],
    init_from: str | Any,
    name_map: Any,
    abstract: bool,
) -> Any:
    """What the state's parameters are made from: their shapes (``abstract``), the weights
    ``init_from`` names (each process reading its own shards), ``init_fn`` (the function of a
    key given as ``params``, called inside the init's program) or the params given."""
    if abstract:
        values = plan.abstract_params  # nothing is read: init_from only gives the values
    elif init_from is not None:
        from jzero import weights
        from jzero.plan import even_sharding, on_device

        # Read at the logical shapes, in layouts jit accepts for them; the init pads them.
        shardings = jax.tree.map(
            lambda x, sh: even_sharding(tuple(x.shape), sh),
            plan.abstract_params,
            on_device(plan.master if plan.options.precision.mixed else plan.params),
        )
        values = weights.load_weights(init_from, plan.abstract_params, shardings, name_map=name_map)
    elif init_fn is not None:
        values = lambda: init_fn(key())  # noqa: E731  created inside init_train_state's jit
    elif _is_abstract(params):
        raise ValueError(
            "params are abstract (jax.ShapeDtypeStruct) and nothing creates them. Pass a "
            "function of a key that creates them (params=lambda key: ...), concrete arrays, "
            "or weights to load (options=jzero.InitOptions(init_from=...))."
        )
    else:
        values = params
    return values


def _auto_stage(
    cfg: config_lib.Config,
    auto_keys: tuple[str, ...],
    mesh: jax.sharding.Mesh,
    planner: Callable[[config_lib.Config], Callable[..., Plan]],
) -> Any:
    """What ``zero_optimization.stage: auto`` chooses from (:mod:`jzero.engine.auto_stage`), or
    None for a config with a stage. Its budget is checked now: a clear error before anything is
    built on a device that reports no memory and no ``device_memory``."""
    if "zero_optimization.stage" not in auto_keys:
        return None
    from jzero.engine import auto_stage

    zero = cfg.zero_optimization
    if zero.offload_optimizer.device == "nvme" or zero.offload_param.device != "none":
        raise config_lib.ConfigError(
            "zero_optimization.stage: auto chooses among stages 0-3, activation checkpointing "
            "and optimizer offload to host memory, but this config also offloads "
            f"{'to NVMe' if zero.offload_optimizer.device == 'nvme' else 'the parameters'}; "
            "set the stage (e.g. stage: 3) for that, or remove the offload."
        )
    return auto_stage.AutoStage(
        budget=auto_stage.budget(cfg, mesh.devices.flat[0]),
        candidates=auto_stage.candidates(
            "activation_checkpointing.policy" in auto_keys, zero.offload_optimizer.device == "cpu"
        ),
        planner=planner,
    )


def _check_layout_auto(cfg: config_lib.Config, mesh: jax.sharding.Mesh | None) -> None:
    """A parallel size ``"auto"``: the sizes written as numbers divide the devices, the global
    batch is fixed, and no ``InitOptions(mesh=...)`` fixes the layout."""
    from jzero.engine import auto_layout

    if mesh is not None:
        raise config_lib.ConfigError(
            f'{", ".join(k for k in config_lib.LAYOUT_KEYS if k in cfg.auto)} "auto" chooses '
            "the mesh, but initialize was given InitOptions(mesh=...); drop that mesh, or write "
            "the sizes in the config."
        )
    auto_layout.check_fixed_sizes(cfg, jax.device_count())


def _auto_layout(
    cfg: config_lib.Config,
    auto_keys: tuple[str, ...],
    mesh: jax.sharding.Mesh,
    auto: Any,
    model: tuple[PyTree, optax.GradientTransformation, PyTree | None, Any],
) -> Any:
    """What the parallel sizes ``"auto"`` choose from (:mod:`jzero.engine.auto_layout`): the
    stages of ``stage: auto`` (``auto``) or the one configured, the budget, the rates, and a
    planner that builds each candidate's mesh and AutoTP specs."""
    from jzero import costs
    from jzero.engine import auto_layout, auto_stage

    shapes, tx, user_specs, program = model
    device = mesh.devices.flat[0]
    what = 'the parallel sizes "auto"'

    def planner(c: config_lib.Config) -> Callable[..., Plan]:
        m = make_mesh(_mesh_sizes(c))
        specs, rules = settings.tensor_parallel(c, m, shapes, user_specs, program)
        return _planner(m, shapes, tx, specs, rules)(c)

    zero = cfg.zero_optimization
    stages = (
        list(auto.candidates)
        if auto is not None
        else [auto_stage.Candidate(zero.stage, zero.offload_optimizer.device == "cpu")]
    )
    return auto_layout.AutoLayout(
        budget=auto.budget if auto is not None else auto_stage.budget(cfg, device, what),
        stages=stages,
        rates=costs.Rates.of(cfg.auto_layout, device.platform),
        planner=planner,
        keys=auto_keys,
    )


def _init_extra(adapted: Any, key: Callable[[], jax.Array], plan: Plan) -> PyTree:
    """A Flax model's non-trainable state alone, replicated (where the parameters are made
    elsewhere: loaded by ``init_from``, or written to the NVMe tier's files)."""
    return jax.jit(lambda: adapted.init_fn(key())[1], out_shardings=plan.replicated)()


def _nvme_state(options: Any, plan: Plan, optimizer: optax.GradientTransformation) -> Any:
    """The NVMe tier (``offload_optimizer.device: nvme``, and ``offload_param`` too) of
    :class:`jzero.nvme.options.NvmeOptions` ``options``: its stores, their paths checked now
    (room for two versions of this process's part), or None without the tier."""
    if options is None:
        return None
    from jzero.nvme import NvmeState, NvmeStore, state_bytes

    on_disk = options.param_path is not None
    sizes = state_bytes(plan, params_on_disk=on_disk)
    mine = jax.local_device_count() / max(1, jax.device_count())
    shared = on_disk and os.path.realpath(options.param_path) == os.path.realpath(options.path)
    store = NvmeStore(
        options.path,
        buffer_count=options.buffer_count,
        needed_bytes=int(2 * mine * (sizes["optimizer"] + (sizes["params"] if shared else 0))),
        what="zero_optimization.offload_optimizer.nvme_path",
    )
    param_store = store if shared else None
    try:
        if on_disk and not shared:
            param_store = NvmeStore(
                options.param_path,
                buffer_count=options.param_buffer_count,
                needed_bytes=int(2 * mine * sizes["params"]),
                what="zero_optimization.offload_param.nvme_path",
            )
        return NvmeState(
            plan,
            optimizer,
            store,
            sub_group_size=options.sub_group_size,
            param_store=param_store,
            prefetch_params=options.prefetch_params,
        )
    except BaseException:
        store.close()
        if param_store is not None and param_store is not store:
            param_store.close()
        raise
