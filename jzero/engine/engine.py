"""The engine: the one stateful object, a thin shell over the pure plan and step.

``jzero.initialize`` (:mod:`jzero.engine.build`) reads the config, builds the mesh and the plan
and returns an :class:`Engine` over a :class:`~jzero.engine.resolve.Setup` (the run, apart from
its state). The engine keeps the setup, the state and its bookkeeping (the iteration, the step
built, the checkpointer and monitors opened); each method is a few lines over
:mod:`jzero.plan`, :mod:`jzero.step` and the engine's own modules, which hold the work:

* :mod:`~jzero.engine.resolve`: the decisions that wait for a batch's shapes (layout, batch
  sizes, ``stage: auto``, the layers the loss's scans consume), taken once, before the state
  exists;
* :mod:`~jzero.engine.steps`: the one builder of the train step, whatever the offload tier,
  and the step ``flops_profiler`` profiles;
* :mod:`~jzero.engine.figures`: the model's FLOPs and the peak memory per device;
* :mod:`~jzero.engine.saving`: checkpoints written and read back;
* :mod:`jzero.monitor` (:func:`~jzero.monitor.train_log`): what a step writes to the
  monitors; :mod:`jzero.weights`: the 16-bit export.

Decisions:

* **The state is created once, in its final layout.** It is made when first needed (a step,
  an evaluation, a save, ``engine.state`` read), after :func:`~jzero.engine.resolve.resolve`
  has taken every decision the shapes it knows allow: those of ``initialize(batch=...)``, else
  of the first batch. A restore before that reads the checkpoint straight into the layout, with
  no state made first. Only a state read before any batch's shapes are known is made in the
  provisional layout and moved once, at the first batch (a log line says so).

A user who wants full control calls the plan and the step directly.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from jzero import config as config_lib
from jzero import distributed
from jzero.engine import data_position, figures, layout, resolve, saving, steps
from jzero.engine.resolve import Setup
from jzero.plan import Plan, describe
from jzero.step import (
    TrainState,
    init_train_state,
    logical_view,
    make_eval_step,
    relayout,
)

__all__ = ["Engine"]

logger = logging.getLogger(__name__)
PyTree = Any


class Engine:
    """Trains one model with one ZeRO plan. Build it with :func:`jzero.initialize`.

    Attributes:
      setup: the run's :class:`jzero.engine.resolve.Setup` (config, plan, loss, optimizer,
        batch sizes); ``config``, ``plan`` and the batch sizes below read it.
      state: the :class:`jzero.step.TrainState` (params, optimizer state, step).
      train_batch_size / micro_batch_size / accumulation_steps: the resolved batch arithmetic.
    """

    def __init__(
        self,
        setup: Setup,
        make_state: Callable[[Setup], tuple[TrainState, Any]] | None,
        *,
        batch: PyTree | None = None,
        abstract: bool = False,
    ):
        """``make_state(setup) -> (state, nvme)`` creates the state in ``setup``'s plan (and
        the NVMe tier's files, or ``None``); ``batch``: the shapes ``initialize`` was given, if
        any; ``abstract``: the state is shapes only."""
        self.setup = setup
        self._make_state = make_state
        self._state: TrainState | None = None
        self._shapes = batch  # a batch's shapes, known before the first batch (initialize)
        self._abstract = abstract
        self._step: Callable[..., Any] | None = None  # built at the first step
        self._eval: Callable[..., Any] | None = None
        self.iteration = 0
        """Train steps run so far, skipped ones included: the number checkpoints are saved as."""
        self.data_iterator: Any = None
        """An iterator with ``state()``/``restore(state)`` whose position checkpoints carry."""
        self._ckpt: Any = None
        self._other_ckpts: dict[str, Any] = {}  # save_checkpoint's directories, by path
        self._unchanged_since: int | None = None  # the step restored or saved, until a train step
        self._disk: Any = None  # the NVMe tier's files (jzero.nvme.state.NvmeState), or None
        self.flops_profile: Any = None
        """The :class:`jzero.profiler.FlopsProfile` of ``flops_profiler.profile_step``, once run."""
        self.monitor_dir: str | None = None
        """Where a monitor with an empty ``output_path`` writes (``jzero train`` sets its
        ``train.log_dir``); ``None``: the working directory. Read when the monitors open."""
        self.tokens_per_sample: int | None = None
        # Told each phase of a step as it begins, ``on_phase(what, step)`` (``what`` may hold
        # ``{step}``; jzero.fit's watchdog publishes them, so a stuck process is named with the
        # phase it is in).
        self.on_phase: Callable[[str, int], None] | None = None
        self._watchdog: Any = None  # a user's own loop of several processes: see _watch
        self._last_step_start: float | None = None
        """Tokens in one sample, for the monitors' ``tokens_per_s`` (``jzero train`` sets the
        sequence length); ``None`` leaves it out."""
        self._monitors: Any = None  # jzero.monitor.Monitors, opened at first use
        self._train_log: Any = None  # jzero.monitor.TrainLog, from the first monitored step
        # Made now where its final layout is known; a layout search waits for the first need,
        # so that a restore first narrows it to the checkpoint's layout.
        known = batch is not None and setup.auto_layout is None
        if known or not resolve.waits_for_batch(setup):
            self._made_state()

    # -- the setup ---------------------------------------------------------------------------
    @property
    def config(self) -> config_lib.Config:
        """The resolved :class:`jzero.config.Config` (it records every decision taken)."""
        return self.setup.config

    @property
    def plan(self) -> Plan:
        """The sharding :class:`jzero.plan.Plan`."""
        return self.setup.plan

    @property
    def loss_fn(self) -> Callable[..., Any]:
        """The loss as the step runs it."""
        return self.setup.loss_fn

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """The optax transformation the step applies."""
        return self.setup.optimizer

    @property
    def learning_rate(self) -> Callable[[jax.Array], jax.Array] | None:
        """The config's learning-rate schedule (``None`` for an optimizer given in code)."""
        return self.setup.learning_rate

    @property
    def takes_extra(self) -> bool:
        """Whether the loss takes and returns the model's non-trainable state."""
        return self.setup.takes_extra

    @property
    def train_batch_size(self) -> int | None:
        """The global batch (``None`` until the first batch sets it, every batch key "auto")."""
        return None if self.setup.sizes is None else self.setup.sizes[0]

    @property
    def micro_batch_size(self) -> int | None:
        """The rows one device takes per micro-batch."""
        return self.setup.micro_batch_size

    @property
    def accumulation_steps(self) -> int | None:
        """The micro-batches one step accumulates."""
        return self.setup.accumulation_steps

    def resolve(self, batch: PyTree, *, train: bool = True) -> None:
        """Takes every decision still waiting for a batch's shapes, on ``batch`` (this
        process's rows, arrays or ``jax.ShapeDtypeStruct``; nothing runs): the parallel sizes
        ``"auto"``, the batch sizes, ``stage: auto`` and the stacked-layer dimensions the
        loss's scans consume (:func:`jzero.engine.resolve.resolve`). The first ``train_step``,
        ``evaluate`` or ``lower`` calls it, and ``initialize(batch=...)``; call it yourself to
        see the final plan (``describe()``) before. ``train=False``: an evaluation batch, which
        leaves the batch sizes and ``stage: auto`` to a train batch."""
        if not resolve.waits_for_batch(self.setup) and self.setup.sizes is not None:
            return
        old = self.setup.plan
        self.setup, step = resolve.resolve(self.setup, batch, train=train)
        if self.setup.plan is not old:
            self._step, self._eval = step, None
            if self._state is not None:  # made before the shapes were known: moved once
                self._move(old, self.setup.plan)

    def _move(self, old: Plan, new: Plan) -> None:
        """The state made under ``old`` moved to ``new``'s layout (only the leaves that
        changed; under the NVMe tier, the files group by group)."""
        moved = layout.moved_leaves(old, new)
        if self._disk is not None:
            if moved:
                self._state = self._disk.relayout(self._state, new)
            else:
                self._disk.use_plan(new)
        elif moved or layout.shardings_differ(old, new):
            self._state = relayout(self._state, old, new)
        if moved:
            layout.log_moved(moved)

    # -- state -------------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The :class:`jzero.step.TrainState`, created at its first use (see the module's
        decisions)."""
        return self._made_state()

    def _made_state(self) -> TrainState:
        """The state, made now if it was not yet (the decisions the known shapes allow taken
        first)."""
        if self._state is None:
            if self._shapes is not None:
                self.resolve(self._shapes)
            if resolve.waits_for_batch(self.setup):
                logger.info(
                    "jzero: the state is made before a batch's shapes are known, so its layout "
                    "may move once at the first batch; pass batch= (shapes suffice) to "
                    "jzero.initialize to make it in its final layout."
                )
            self._state, self._disk = self._make_state(self.setup)
            self._make_state = None  # made once: the caller's arrays are not held after
        return self._state

    @state.setter
    def state(self, state: TrainState) -> None:
        self._state = state

    def _abstract_state(self) -> TrainState:
        """The state's shapes in the plan's layout, made or not (nothing is created)."""
        if self._state is not None:
            return self._state
        plan = self.plan
        return init_train_state(
            plan, plan.abstract_params, self.optimizer, self.setup.extra, abstract=True
        )

    def _full_state(self) -> TrainState:
        """The state with everything in memory: under the NVMe tier, the optimizer state (and
        masters, and parameters on NVMe) read back from their files; else :attr:`state`."""
        state = self.state
        if self._disk is None:
            return state
        return self._disk.materialize(state)

    @property
    def params(self) -> PyTree:
        """The current parameters, sharded per the plan, at their logical shapes.

        A leaf that rests padded (its sharded dimension not divisible by the shard count, see
        ``describe()``) is handed out as a copy without the padding, laid out on a dimension the
        shard count divides (or whole); the others are the state's own arrays.

        They are donated to the next ``train_step``, which deletes these arrays (no second copy
        of the state in device memory): a handle kept across a step raises ``RuntimeError:
        Array has been deleted``. Keep a copy instead: ``jax.tree.map(jnp.copy,
        engine.params)`` on the device, or ``jax.device_get(engine.params)`` on the host. The
        same holds for :attr:`opt_state` and :attr:`state`. With the parameters on NVMe
        (``offload_param: {device: nvme}``) they are read from their files, a copy.
        """
        if self._disk is not None:
            return self._disk.params(self.state)
        if not self.plan.padded:
            return self.state.params
        return logical_view(self.plan, self.state._replace(opt_state=(), master=())).params

    def _resting_params(self) -> PyTree:
        """The params as they rest (padded leaves padded), as the eval step takes them."""
        return self.state.params if self._disk is None else self._disk.params(self.state)

    @property
    def model(self) -> Any:
        """The trained model: a Flax NNX or Equinox module (or Linen variables) over the current
        arrays."""
        if self.setup.to_model is None:
            raise AttributeError(
                "engine.model exists for Flax and Equinox models (jzero.initialize(model=...)); "
                "this engine trains a plain pytree: use engine.params."
            )
        return self.setup.to_model(self.params, self.state.extra)

    @property
    def opt_state(self) -> PyTree:
        """The current optimizer state, sharded per the plan (donated to the next step, as
        :attr:`params`), at its logical shapes (as :attr:`params`). Under the NVMe tier it is
        read from its files, a copy."""
        state = self._full_state()
        if not self.plan.padded:
            return state.opt_state
        return logical_view(self.plan, state._replace(params=(), master=())).opt_state

    @property
    def global_step(self) -> int:
        """Optimizer updates applied so far."""
        return int(self.state.step)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh."""
        return self.plan.mesh

    # -- the step ----------------------------------------------------------------------------
    def _check_batch(self, batch: PyTree) -> None:
        self.resolve(batch)
        distributed.check_batch(
            batch,
            self.train_batch_size,
            f" (= train_micro_batch_size_per_gpu {self.micro_batch_size} x "
            f"gradient_accumulation_steps {self.accumulation_steps} x data-parallel size "
            f"{self.plan.data_parallel_size})",
            rows=len(distributed.process_rows(self.plan.batch, self.train_batch_size)),
        )

    def _global(self, batch: PyTree) -> PyTree:
        """This process's rows of a train batch, checked, as the global batch the step takes."""
        self._check_batch(batch)
        return distributed.global_batch(batch, self.plan.batch, self.train_batch_size)

    def _step_fn(self, batch: PyTree) -> Callable[..., Any]:
        """The step for the global ``batch`` (the decisions its shapes allow taken first, the
        state made), built once; whether the loss returns aux is read when the step traces."""
        self.resolve(batch)
        self._made_state()  # in the final layout; the NVMe tier's files with it
        if self._step is None:
            self._step = steps.build_step(self.setup, self._disk)
        return self._step

    def train_step(self, batch: PyTree) -> dict[str, jax.Array]:
        """Runs one optimizer step on a global batch (leading dim ``train_batch_size``).

        Returns:
          The metrics, as JAX scalars: ``loss``, ``grad_norm``, ``nonfinite`` (1 when the
          gradients held inf/NaN), ``skipped`` (1 when the update was skipped), ``lr`` when
          jzero knows it, ``loss_scale`` under bf16/fp16, and any aux values.
        """
        started = time.perf_counter()  # a monitored step is timed from here
        self._check_concrete("train")
        self._watch(started)
        self._phase("step {step}: making the global batch")
        batch = self._global(batch)
        self._phase("step {step}: running the compiled step")
        fp = self.config.flops_profiler
        if fp.enabled and self.iteration + 1 == fp.profile_step:
            step = self._step_fn(batch)
            self.state, metrics, self.flops_profile = steps.profiled_step(
                self.setup, step, self.state, batch, self.iteration + 1
            )
        else:
            self.state, metrics = self._step_fn(batch)(self.state, batch)
        self.iteration += 1
        self._unchanged_since = None
        if self.monitor.enabled:
            self._log_step(metrics, batch, started)
        interval = self.config.checkpoint.save_interval_steps
        if self.config.checkpoint.directory and interval and self.iteration % interval == 0:
            self._phase("saving checkpoint {step}", self.iteration)
            self.save(periodic=True)
        return metrics

    def _watch(self, now: float) -> None:
        """In a user's own loop of several processes (no ``jzero.fit`` watching), the engine's
        own watchdog (:class:`jzero.distributed.Watchdog`): started at the first step, told
        each step's phases, and that the previous step finished when the next begins."""
        if self.on_phase is None and self._watchdog is None and jax.process_count() > 1:
            self._watchdog = distributed.Watchdog(
                distributed.hang_timeout(self.config.distributed),
                stragglers=distributed.stragglers(self.config.distributed),
            ).start()
            _OPEN_ENGINES.add(self)
        if self._watchdog is not None:
            if self._last_step_start is not None:
                self._watchdog.finished(self.iteration, now - self._last_step_start)
            self._last_step_start = now
            self._watchdog.phase("starting step {step}", self.iteration + 1)

    def _phase(self, name: str, step: int | None = None) -> None:
        if self._watchdog is not None:
            self._watchdog.phase(name, self.iteration + 1 if step is None else step)
        if self.on_phase is not None:
            self.on_phase(name, self.iteration + 1 if step is None else step)

    @property
    def monitor(self) -> Any:
        """The config's monitors (a :class:`jzero.monitor.Monitors`): ``tensorboard``,
        ``csv_monitor`` and ``wandb``, on process 0 (none elsewhere). ``train_step`` writes
        every step's metrics to them; ``engine.monitor.write_events([(tag, value, samples)])``
        adds your own, as with DeepSpeed's ``engine.monitor``. Opened at first use: a run from
        step 0 starts its CSV files anew, a restored one appends."""
        if self._monitors is None:
            from jzero import monitor

            self._monitors = monitor.open_monitors(
                self.config,
                process_index=jax.process_index(),
                default_dir=self.monitor_dir,
                fresh=self.iteration == 0,
            )
            if self._monitors.enabled:  # closed (flushed, the wandb run finished) at exit
                _OPEN_ENGINES.add(self)
        return self._monitors

    def _log_step(self, metrics: dict[str, jax.Array], batch: PyTree, started: float) -> None:
        """Writes this step's events (:func:`jzero.monitor.train_log`, set up at the first)."""
        if self._train_log is None:
            from jzero import monitor

            step = self._step_fn(batch)
            peak = figures.peak_bytes(self.setup, step, self.state, batch)
            self._train_log = monitor.train_log(self, batch, peak)
        self._train_log.log(metrics, self.iteration, started)

    def peak_bytes(self, batch: PyTree) -> Callable[[], int | None]:
        """The peak memory per device of the step on batches of ``batch``'s shapes (this
        process's rows, as ``train_step`` takes them), as a function that reads it: the
        allocator's figure on an accelerator (it moves as the run goes); on CPU, which keeps
        none, the compiled step's peak, of the executable the step runs (not compiled again).
        ``None`` where the allocator names no peak. The figure the monitors' ``peak_bytes``
        and ``jzero train`` report (:mod:`jzero.engine.figures`)."""
        batch = self._global(batch)
        return figures.peak_bytes(self.setup, self._step_fn(batch), self.state, batch)

    def step_cost(self, batch: PyTree) -> Any:
        """XLA's cost of the compiled step for this batch's shapes (a
        :class:`jzero.profiler.StepCost`: FLOPs and bytes per device), from the executable the
        step runs (compiled once: the step's own call reuses it)."""
        from jzero import profiler

        return profiler.step_cost(self.lower(batch).compile(), self.mesh.devices.size)

    def model_flops(self, batch: PyTree) -> float:
        """The model's FLOPs of one step on a global batch of ``batch``'s shapes (arrays or
        ``jax.ShapeDtypeStruct``): 3x the loss's forward matmuls, plus the forward passes
        ``flops_profiler.recompute_fwd_factor`` says activation checkpointing repeats. What MFU
        is computed from (:mod:`jzero.profiler`); traced, never run, once per batch shape."""
        return figures.model_flops(self.setup, batch)

    def _check_concrete(self, what: str) -> None:
        if self._abstract:
            raise ValueError(
                f"This engine was built with initialize(..., abstract=True): it holds the "
                f"state's shapes only, so it cannot {what}. It lowers steps "
                "(engine.lower(batch)) for memory and communication reports; build the engine "
                "without abstract=True to train."
            )

    def evaluate(self, batch: PyTree) -> jax.Array:
        """The mean loss of the current parameters on a global batch (no update).

        The batch's leading dim must be divisible by the data-parallel size.
        """
        self._check_concrete("evaluate")
        self.resolve(batch, train=False)
        lead = {np.shape(x)[0] for x in jax.tree.leaves(batch)}
        count = jax.process_count()  # several processes: each passes its rows
        total = round(next(iter(lead)) / distributed.batch_share(self.plan.batch)) if lead else 0
        if len(lead) != 1 or total % self.plan.data_parallel_size:
            raise ValueError(
                "An evaluation batch needs one leading dim divisible by the data-parallel "
                f"size {self.plan.data_parallel_size} (over all {count} process(es)), but its "
                f"leaves have leading dims {sorted(lead)} on this process. Pass a batch of that "
                "size."
            )
        batch = distributed.global_batch(batch, self.plan.batch, total)
        self._made_state()
        if self._eval is None:
            self._eval = make_eval_step(
                self.plan,
                self.loss_fn,
                takes_extra=self.takes_extra,
                micro_batches=self.accumulation_steps or 1,
            )
        return self._eval(self._resting_params(), self.state.extra, batch)

    def lower(self, batch: PyTree) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` of the step, for ``.compile().memory_analysis()``."""
        batch = self._global(batch)
        return self._step_fn(batch).lower(self.state, batch)

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpointer(self, directory: str | os.PathLike | None = None) -> Any:
        """The config's checkpointer, or (``save_checkpoint``'s ``save_dir``) one of its own
        for another directory."""
        if directory is not None and not _same_dir(directory, self.config.checkpoint.directory):
            key = str(Path(directory).expanduser().resolve())
            if key not in self._other_ckpts:
                self._other_ckpts[key] = saving.open_checkpointer(self.config, directory)
                _OPEN_ENGINES.add(self)
            return self._other_ckpts[key]
        if self._ckpt is None:
            self._ckpt = saving.open_checkpointer(self.config)
            _OPEN_ENGINES.add(self)
        return self._ckpt

    def save(self, step: int | None = None, *, periodic: bool = False) -> bool:
        """Saves a checkpoint (asynchronously unless ``checkpoint.async`` is false).

        What is saved: params, optimizer state (with the float32 master weights), the step
        count, the loss-scale state, non-trainable model state (RNG counters included), the
        data position of ``engine.data_iterator`` and the resolved config, so a restored run
        continues exactly. Every process writes only its own shards.

        Nothing is written when the state is exactly the checkpoint it was restored from (or
        last saved as), or when the parameters hold inf/NaN: a warning says so and the good
        checkpoints already on disk stay.

        Args:
          step: the checkpoint's number; default ``engine.iteration`` (train steps run).
          periodic: the save ``train_step`` makes every ``checkpoint.save_interval_steps``: a
            failure (disk full, ...) is logged and the next interval tries again, up to
            ``checkpoint.max_consecutive_failures`` in a row. Otherwise a failure raises.

        Returns:
          Whether a save started.

        Raises:
          CheckpointWriteError: the save failed (see ``periodic``); the checkpoints committed
            before are intact.
        """
        self._check_concrete("save")
        return self._save(self._checkpointer(), step, periodic=periodic)

    def _save(
        self, ckpt: Any, step: int | None, *, periodic: bool = False, client_state: Any = None
    ) -> bool:
        self._check_concrete("save")
        step = self.iteration if step is None else int(step)
        main = ckpt is self._ckpt
        if main and self._unchanged_since == step and step in ckpt.all_steps():
            logger.info("jzero: checkpoint step %d is already on disk and unchanged", step)
            return False
        meta = {
            "config": self.config.to_dict(),
            "iteration": self.iteration,
            "data": None,
            **data_position.saved_position(self.data_iterator),
            "stage": self.plan.stage.stage,
            "devices": self.plan.data_parallel_size,
            "train_batch_size": self.train_batch_size,
        }
        if client_state is not None:
            meta["client_state"] = client_state
        state = self._full_state()
        saved = saving.save(ckpt, step, self.config, self.plan, state, meta, periodic=periodic)
        if saved and main:
            self._unchanged_since = step if step == self.iteration else None
        return saved

    def save_checkpoint(
        self, save_dir: str | os.PathLike, tag: int | str | None = None, client_state: Any = None
    ) -> bool:
        """DeepSpeed's ``engine.save_checkpoint``: saves a checkpoint into ``save_dir``.

        The checkpoint is :meth:`save`'s (every process writes its own shards, asynchronously
        unless ``checkpoint.async`` is false), written into ``save_dir``, which need not be
        ``checkpoint.directory``.

        Args:
          save_dir: the checkpoint directory (created if missing; it holds jzero's checkpoints
            only).
          tag: the checkpoint's step: an int, ``"global_step<N>"`` (DeepSpeed's default tag) or
            ``"<N>"``; ``None``: ``engine.iteration``.
          client_state: a JSON value (a dict of numbers, strings, lists) saved with the
            checkpoint and returned by :meth:`load_checkpoint`.

        Returns:
          Whether a save started (``False``: the parameters hold inf/NaN; a warning says so).
        """
        step = _tag_step(tag)
        self._check_concrete("save")
        return self._save(self._checkpointer(save_dir), step, client_state=client_state)

    def load_checkpoint(
        self, load_dir: str | os.PathLike, tag: int | str | None = None
    ) -> tuple[str | None, Any]:
        """DeepSpeed's ``engine.load_checkpoint``: restores a checkpoint from ``load_dir``.

        The state is read into this engine's plan (any stage, offload and device count the
        shapes allow), the data position into ``engine.data_iterator``, as :meth:`restore`.

        Args:
          load_dir: the checkpoint directory.
          tag: the step to load (an int, ``"global_step<N>"`` or ``"<N>"``); ``None``: the
            latest.

        Returns:
          ``(load_path, client_state)``: the checkpoint's folder and the ``client_state`` saved
          with it (``None`` if none); ``(None, None)`` with a warning when ``load_dir`` holds
          no checkpoint, as DeepSpeed returns.
        """
        step = _tag_step(tag)
        ckpt = self._checkpointer(load_dir)
        if step is None and ckpt.latest_step() is None:
            logger.warning("jzero: no checkpoint found in %s; nothing was loaded", load_dir)
            return None, None
        meta = self._restore(ckpt, step)
        loaded = ckpt.latest_step() if step is None else step
        return str(Path(ckpt.directory) / str(loaded)), meta.get("client_state")

    def save_16bit_model(
        self,
        directory: str | Any,
        *,
        max_shard_size: int | str = "5GB",
        dtype: Any = None,
        names: Any = None,
    ) -> Any:
        """Writes the parameters as Hugging Face's sharded safetensors (DeepSpeed's name).

        ``model-00001-of-0000N.safetensors`` files of at most ``max_shard_size`` and
        ``model.safetensors.index.json``, tensors named by their dotted paths, one leaf on the
        host at a time; each process writes its own files. Load them back with
        ``jzero.InitOptions(init_from=directory)`` or Hugging Face's loaders.

        Args:
          directory: the output directory (created if missing).
          max_shard_size: the most bytes per file (``5GB``, ``500MiB`` or an int).
          dtype: the dtype of floating tensors; ``None``: the compute dtype (bf16/fp16 under
            mixed precision, else the params' own).
          names: a leaf's dotted path -> the tensor's name in the files (a callable, or a
            dict whose missing paths keep their name), for Hugging Face's names; read them
            back with ``InitOptions(init_from=directory, name_map=names)``.

        Returns:
          The index file's path.
        """
        from jzero import weights

        return weights.save_weights(
            directory, self.params, dtype=dtype, max_shard_size=max_shard_size, names=names
        )

    def restore(self, step: int | None = None) -> dict[str, Any]:
        """Restores a checkpoint (the latest by default) into this engine's plan.

        The checkpoint may come from any stage, with or without offload, and any device count
        the shapes allow: the state is read straight into this plan's shardings. The data
        position is restored into ``engine.data_iterator`` when both exist.

        Returns:
          The checkpoint's meta: ``config``, ``iteration``, ``data``, ``stage``, ``devices``.
        """
        return self._restore(self._checkpointer(), step)

    def _restore(self, ckpt: Any, step: int | None) -> dict[str, Any]:
        if self.setup.auto_layout is not None:  # the layout the run chose: no search again
            from jzero.engine import auto_layout

            auto_layout.adopt_saved(self.setup.auto_layout, ckpt.read_meta(step).get("config"))
        if self._state is None and self._shapes is not None:
            self.resolve(self._shapes)  # the final layout first: the checkpoint is read into it
        on_disk = self.config.zero_optimization.offload_optimizer.device == "nvme"
        if self._state is not None or on_disk or self._abstract:
            self.state, meta = saving.restore(ckpt, step, self.plan, self.state, self._disk)
        else:  # no state made yet: the checkpoint is the state
            self._state, meta = saving.restore(ckpt, step, self.plan, self._abstract_state())
        self.iteration = int(meta.get("iteration", self.global_step))
        restored = ckpt.latest_step() if step is None else int(step)
        self._unchanged_since = restored if restored == self.iteration else None
        data_position.restore_position(self.data_iterator, meta)
        return meta

    def latest_checkpoint(self) -> int | None:
        """The newest complete checkpoint step in ``checkpoint.directory``, or ``None``."""
        if not self.config.checkpoint.directory:
            return None
        return self._checkpointer().latest_step()

    def wait_until_finished(self) -> None:
        """Blocks until every checkpoint save in flight is on disk."""
        for ckpt in [self._ckpt, *self._other_ckpts.values()]:
            if ckpt is not None:
                ckpt.wait_until_finished()

    def close(self) -> None:
        """Waits for checkpoint saves in flight, then releases the checkpointer; idempotent.

        Also called at interpreter exit and when a ``with jzero.initialize(...) as engine:``
        block ends.
        """
        for ckpt in [self._ckpt, *self._other_ckpts.values()]:
            if ckpt is not None:
                ckpt.close()
        self._ckpt, self._other_ckpts = None, {}
        if self._monitors is not None:  # flushed; a later step opens them again
            self._monitors.close()
            self._monitors = self._train_log = None
        if self._disk is not None:
            try:  # the state outlives its files
                self.state = self._disk.materialize(self.state)
            except OSError as e:
                logger.warning(
                    "jzero: the state could not be read back from its NVMe files (%s); it is "
                    "lost with them. Restore a checkpoint to continue.",
                    e,
                )
            self._disk.close()
            self._disk = self._step = None
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        _OPEN_ENGINES.discard(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def auto_layout(self) -> Any:
        """The search the parallel sizes ``"auto"`` run at the first batch
        (:class:`jzero.engine.auto_layout.AutoLayout`: its budget, rates and candidates'
        stages), or ``None`` once the layout is chosen or when no size is ``"auto"``."""
        return self.setup.auto_layout

    def describe(self) -> str:
        """The plan report: every leaf's shape, spec per category and per-device bytes."""
        return describe(self.plan)


_OPEN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    """Lets in-flight checkpoint saves finish before the interpreter exits; one that fails is
    one error line (the steps committed before are intact), not a traceback at exit."""
    for engine in list(_OPEN_ENGINES):
        from jzero.checkpoint import CheckpointWriteError  # imported: the engine saved

        try:
            engine.close()
        except CheckpointWriteError as e:
            logger.error("jzero: %s", e)
            engine.close()  # the rest of it (the checkpointer is closed already)


def _same_dir(a: str | os.PathLike, b: str | os.PathLike | None) -> bool:
    return b is not None and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _tag_step(tag: int | str | None) -> int | None:
    """The step a DeepSpeed tag names: an int, ``"global_step<N>"`` or ``"<N>"``."""
    if tag is None or isinstance(tag, int) and not isinstance(tag, bool) and tag >= 0:
        return tag
    text = str(tag)
    digits = text.removeprefix("global_step")
    if isinstance(tag, str) and digits.isdigit():
        return int(digits)
    raise ValueError(
        f"tag={tag!r}: jzero's checkpoints are numbered by step, so a tag is a step: an int, "
        '"global_step<N>" (DeepSpeed\'s default tag) or "<N>"; None for engine.iteration '
        "(saving) or the latest (loading). Save under a number, e.g. tag=engine.iteration."
    )
