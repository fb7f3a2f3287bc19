"""The run resolved before its state exists: :class:`Setup`, and :func:`resolve`, one step in a
fixed order.

Decisions:

* **Five decisions depend on a batch's shapes**, and each changes where the state rests:
  AutoTP's specs read from the model's program (where no parameter's name matched a rule),
  the parallel sizes ``"auto"`` (the mesh), the batch sizes when every batch key is ``"auto"``,
  ``zero_optimization.stage: auto``, and the stacked-layer dimensions the loss's scans consume
  (at stage 3, under a pipeline or over experts a leaf is split beside the dimension its scan
  consumes). :func:`resolve` takes them in that order from shapes alone (the loss traced, each
  candidate's step compiled on abstract state: nothing is allocated), so the state is created
  once, already in its final layout.
* **Where the shapes come from**: ``jzero.initialize(..., batch=...)`` (arrays or
  ``jax.ShapeDtypeStruct``, this process's rows), else the first batch given to the engine,
  which then creates the state before its first step runs (lazily: nothing is created twice).
* **A setup is a value.** :class:`Setup` is frozen; a decision returns a new one
  (``dataclasses.replace``). The engine holds the setup and the state; the helpers that measure
  or trace a run (:mod:`~jzero.engine.layout`, :mod:`~jzero.engine.auto_stage`,
  :mod:`~jzero.engine.auto_layout`, :mod:`~jzero.engine.figures`) take the setup, never the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from jzero import config as config_lib
from jzero.engine import layout
from jzero.engine.checks import check_live_parameters, check_mesh_splits
from jzero.plan import Plan

__all__ = ["Setup", "read_program", "resolve", "waits_for_batch"]

logger = logging.getLogger("jzero.engine")
PyTree = Any


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run is, apart from its state: the config, the plan, the model's functions and
    the decisions still waiting for a batch's shapes.

    Attributes:
      config: the resolved :class:`jzero.config.Config` (it records every decision taken).
      plan: the sharding :class:`jzero.plan.Plan`.
      loss_fn: the loss as the step runs it (``loss(params, batch)``, or
        ``loss(params, extra, batch) -> (loss, extra)`` where ``takes_extra``).
      optimizer: the optax transformation the step applies.
      learning_rate: the schedule, for the ``lr`` metric (``None`` where jzero does not know it).
      takes_extra: the loss takes and returns the model's non-trainable state.
      extra: that state's shapes (``()`` for a plain pytree of parameters).
      to_model: the Flax/Equinox model over given arrays (``None`` for a plain pytree).
      sizes: ``(train_batch_size, micro_batch_size, accumulation_steps)``; ``None`` until a
        batch sets them (every batch key ``"auto"``).
      replan: ``make_plan`` over this run's arguments, taking ``layer_dims=`` (and
        ``pipe_leaves=``); ``None`` once the layer dimensions are fitted.
      auto_stage: ``stage: auto``'s pending choice (:class:`jzero.engine.auto_stage.AutoStage`).
      auto_layout: the pending layout search (:class:`jzero.engine.auto_layout.AutoLayout`).
      traced: the model's FLOPs traced so far, by shapes (:func:`jzero.engine.figures.model_flops`).
      read_program: AutoTP waiting for a batch (no name split anything and ``initialize`` had
        no batch): ``read_program(batch)`` reads the model's program on the batch's shapes and
        returns the ``replan`` of its specs; ``None`` otherwise.
    """

    config: config_lib.Config
    plan: Plan
    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    learning_rate: Callable[[jax.Array], jax.Array] | None = None
    takes_extra: bool = False
    extra: PyTree = ()
    to_model: Callable[[PyTree, PyTree], Any] | None = None
    sizes: tuple[int, int, int] | None = None
    replan: Callable[..., Plan] | None = None
    auto_stage: Any = None
    auto_layout: Any = None
    traced: dict[Any, float] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    read_program: Callable[[PyTree], Callable[..., Plan]] | None = None

    @property
    def micro_batch_size(self) -> int | None:
        return None if self.sizes is None else self.sizes[1]

    @property
    def accumulation_steps(self) -> int | None:
        return None if self.sizes is None else self.sizes[2]

    @property
    def fits_layers(self) -> bool:
        """Whether the layer dimensions are still to be traced, and matter: some leaf rests
        split where a scan may consume it (stage 3, a pipeline, experts)."""
        plan, par = self.plan, self.plan.options.parallel
        return self.replan is not None and bool(
            plan.stage.shard_params or par.pipe_axis or par.expert_axis
        )


def waits_for_batch(setup: Setup) -> bool:
    """Whether a decision that moves the state still waits for a batch's shapes (the batch
    sizes alone do not: they change no layout)."""
    return (
        setup.auto_layout is not None
        or setup.auto_stage is not None
        or setup.read_program is not None
        or setup.fits_layers
    )


def resolve(setup: Setup, batch: PyTree, *, train: bool = True) -> tuple[Setup, Any]:
    """Every decision ``setup`` still waits for, taken on ``batch``'s shapes (this process's
    rows; arrays or ``jax.ShapeDtypeStruct``), in a fixed order: the layout, the batch sizes,
    the stage, the layer dimensions. ``train=False`` (an evaluation batch) leaves the batch
    sizes and ``stage: auto`` to a train batch.

    Returns:
      The resolved setup, and the step a choice compiled (its first call runs that
      executable), or ``None`` where nothing was compiled.
    """
    step = None
    if setup.read_program is not None:
        setup = read_program(setup, batch)
    if setup.auto_layout is not None:
        setup, step = _choose_layout(setup, batch)
    if train:
        setup = take_batch_sizes(setup, batch)
        if setup.auto_stage is not None:
            setup, step = _choose_stage(setup, batch)
    if setup.fits_layers and (train or setup.auto_stage is None):
        setup = fit_layers(setup, batch)
    return setup, step


def read_program(setup: Setup, batch: PyTree) -> Setup:
    """AutoTP from the program: the model's program read on ``batch``'s shapes gives the
    model-axis specs (:func:`jzero.rewrite.program_splits`), and the plan made with them is
    checked as ``initialize`` checks a plan (the model axis must now split something)."""
    replan = setup.read_program(batch)
    plan = replan()
    check_mesh_splits(plan, plan.mesh)
    return dataclasses.replace(setup, plan=plan, replan=replan, read_program=None)


def take_batch_sizes(setup: Setup, batch: PyTree) -> Setup:
    """With every batch key "auto", ``batch`` sets them: its leading dimension (times the
    processes) is the global batch, split over the data axis and
    ``gradient_accumulation_steps`` (1 unless set); the config records the values."""
    if setup.sizes is not None:
        return setup
    leads = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(leads) != 1 or None in leads:
        raise ValueError(
            "The config sets no batch size, so the first batch sets them, but its leaves have "
            f"leading dims {sorted(leads, key=str)}; pass a batch whose leaves share one "
            "leading dim, or set train_micro_batch_size_per_gpu in the config."
        )
    cfg = dataclasses.replace(
        setup.config,
        train_batch_size=leads.pop() * jax.process_count(),
        gradient_accumulation_steps=setup.config.gradient_accumulation_steps or 1,
    )
    sizes = config_lib.resolve_batch_sizes(cfg, setup.plan.data_parallel_size)
    cfg = dataclasses.replace(
        cfg, train_micro_batch_size_per_gpu=sizes[1], gradient_accumulation_steps=sizes[2]
    )
    logger.info(
        "jzero: batch sizes from the first batch: train_batch_size %d = "
        "train_micro_batch_size_per_gpu %d x gradient_accumulation_steps %d x data-parallel %d",
        *sizes,
        setup.plan.data_parallel_size,
    )
    return dataclasses.replace(setup, config=cfg, sizes=sizes)


def fit_layers(setup: Setup, batch: PyTree) -> Setup:
    """The plan for the stacked-layer dimensions the loss's scans consume (traced on a
    micro-batch of ``batch``'s shapes), checked against ``stage3_max_live_parameters``."""
    if not setup.fits_layers:
        return dataclasses.replace(setup, replan=None)
    dims, piped = layout.traced_layers(setup, batch)
    plan = setup.replan(layer_dims=dims, **piped)
    check_live_parameters(plan, setup.config.zero_optimization.stage3_max_live_parameters)
    return dataclasses.replace(setup, plan=plan, replan=None)


def _choose_stage(setup: Setup, batch: PyTree) -> tuple[Setup, Any]:
    """``stage: auto``: the candidate chosen (:mod:`jzero.engine.auto_stage`) becomes the
    setup's config and plan (fitted to the layers), with the step its measure compiled."""
    from jzero.engine import auto_stage

    cfg, plan, step = auto_stage.choose_stage(setup.auto_stage, setup, batch)
    return dataclasses.replace(setup, config=cfg, plan=plan, replan=None, auto_stage=None), step


def _choose_layout(setup: Setup, batch: PyTree) -> tuple[Setup, Any]:
    """Parallel sizes ``"auto"``: the layout chosen (:mod:`jzero.engine.auto_layout`) becomes the
    setup's config, mesh, plan and batch sizes (the stage chosen with it), with its step."""
    from jzero.engine import auto_layout

    choice = auto_layout.choose_layout(setup.auto_layout, setup, batch)
    chosen = dataclasses.replace(
        setup,
        config=choice.config,
        plan=choice.plan,
        sizes=choice.sizes,
        replan=None,
        auto_stage=None,
        auto_layout=None,
    )
    return chosen, choice.step
