"""The engine: the one stateful object, a thin shell over the pure plan and step.

``jzero.initialize`` (:mod:`jzero.engine.build`) reads the config, builds the mesh and the plan,
creates the parameters and the optimizer state directly in their shards, and returns an
:class:`Engine`. The engine keeps the state between steps and its bookkeeping (the batch sizes,
the iteration, the step built, the checkpointer and monitors opened); each method is a few
lines over :mod:`jzero.plan` and :mod:`jzero.step` and the engine's own modules, which hold
the work:

* :mod:`~jzero.engine.steps`: the one builder of the train step, whatever the offload tier,
  and the step ``flops_profiler`` profiles;
* :mod:`~jzero.engine.layout`: the layers the loss's scans consume, and the leaves a re-plan
  for them moves; :mod:`~jzero.engine.auto_stage`: ``stage: auto``'s choice;
* :mod:`~jzero.engine.figures`: the model's FLOPs and the peak memory per device;
* :mod:`~jzero.engine.saving`: checkpoints written and read back;
* :mod:`jzero.monitor` (:func:`~jzero.monitor.train_log`): what a step writes to the
  monitors; :mod:`jzero.weights`: the 16-bit export.

A user who wants full control calls the plan and the step directly.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from jzero import config as config_lib
from jzero import distributed
from jzero.engine import figures, layout, saving, steps
from jzero.engine.checks import _check_live_parameters
from jzero.plan import Plan
from jzero.step import (
    TrainState,
    is_abstract,
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
      config: the resolved :class:`jzero.config.Config`.
      plan: the sharding :class:`jzero.plan.Plan`.
      state: the :class:`jzero.step.TrainState` (params, optimizer state, step).
      train_batch_size / micro_batch_size / accumulation_steps: the resolved batch arithmetic.
    """

    def __init__(
        self,
        *,
        config: config_lib.Config,
        plan: Plan,
        state: TrainState,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        learning_rate: Callable[[jax.Array], jax.Array] | None,
        batch_sizes: tuple[int, int, int],
        takes_extra: bool = False,
        to_model: Callable[[PyTree, PyTree], Any] | None = None,
        replan: Callable[..., Plan] | None = None,
        nvme: Any = None,
        auto_stage: Any = None,
        auto_layout: Any = None,
    ):
        self.config = config
        self.plan = plan
        self.state = state
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        # None: all "auto"; the first batch given to train_step decides (_take_batch_sizes).
        self.train_batch_size, self.micro_batch_size, self.accumulation_steps = (
            batch_sizes if batch_sizes is not None else (None, None, None)
        )
        self.takes_extra = takes_extra  # the loss takes and returns ``state.extra``
        self._to_model = to_model
        self._replan = replan  # make_plan with this engine's arguments, for layer_dims=
        self._layout_fitted = replan is None
        self._step: Callable[..., Any] | None = None  # built at the first step (fit_layout)
        self._eval: Callable[..., Any] | None = None
        self.iteration = 0
        """Train steps run so far, skipped ones included: the number checkpoints are saved as."""
        self.data_iterator: Any = None
        """An iterator with ``state()``/``restore(state)`` whose position checkpoints carry."""
        self._ckpt: Any = None
        self._unchanged_since: int | None = None  # the step restored or saved, until a train step
        self._disk = nvme  # the NVMe tier's files (jzero.nvme.state.NvmeState), or None
        self._auto_stage = auto_stage  # stage "auto": chosen at the first batch (auto_stage.py)
        self._auto_layout = auto_layout  # sizes "auto": chosen at the first batch (auto_layout.py)
        self.flops_profile: Any = None
        """The :class:`jzero.profiler.FlopsProfile` of ``flops_profiler.profile_step``, once run."""
        self.monitor_dir: str | None = None
        """Where a monitor with an empty ``output_path`` writes (``jzero train`` sets its
        ``train.log_dir``); ``None``: the working directory. Read when the monitors open."""
        self.tokens_per_sample: int | None = None
        """Tokens in one sample, for the monitors' ``tokens_per_s`` (``jzero train`` sets the
        sequence length); ``None`` leaves it out."""
        self._monitors: Any = None  # jzero.monitor.Monitors, opened at first use
        self._train_log: Any = None  # jzero.monitor.TrainLog, from the first monitored step
        self._model_flops: dict[Any, float] = {}  # traced once per batch shape (figures.py)

    def _full_state(self) -> TrainState:
        """The state with everything in memory: under the NVMe tier, the optimizer state (and
        masters, and parameters on NVMe) read back from their files; else :attr:`state`."""
        if self._disk is None:
            return self.state
        return self._disk.materialize(self.state)

    # -- state -------------------------------------------------------------------------------
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
        if self._to_model is None:
            raise AttributeError(
                "engine.model exists for Flax and Equinox models (jzero.initialize(model=...)); "
                "this engine trains a plain pytree: use engine.params."
            )
        return self._to_model(self.params, self.state.extra)

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
    def _take_batch_sizes(self, batch: PyTree) -> None:
        """With every batch key "auto", the first batch sets them: its leading dimension (times
        the processes) is the global batch, split over the data axis and
        ``gradient_accumulation_steps`` (1 unless set); the config records the values."""
        if self.train_batch_size is not None:
            return
        leads = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
        if len(leads) != 1 or None in leads:
            raise ValueError(
                "The config sets no batch size, so the first batch sets them, but its leaves have "
                f"leading dims {sorted(leads, key=str)}; pass a batch whose leaves share one "
                "leading dim, or set train_micro_batch_size_per_gpu in the config."
            )
        cfg = dataclasses.replace(
            self.config,
            train_batch_size=leads.pop() * jax.process_count(),
            gradient_accumulation_steps=self.config.gradient_accumulation_steps or 1,
        )
        sizes = config_lib.resolve_batch_sizes(cfg, self.plan.data_parallel_size)
        self.config = dataclasses.replace(
            cfg,
            train_micro_batch_size_per_gpu=sizes[1],
            gradient_accumulation_steps=sizes[2],
        )
        self.train_batch_size, self.micro_batch_size, self.accumulation_steps = sizes
        logger.info(
            "jzero: batch sizes from the first batch: train_batch_size %d = "
            "train_micro_batch_size_per_gpu %d x gradient_accumulation_steps %d x data-parallel %d",
            *sizes,
            self.plan.data_parallel_size,
        )

    def _check_batch(self, batch: PyTree) -> None:
        if self._auto_layout is not None:
            self._choose_layout(batch)
        self._take_batch_sizes(batch)
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

    def fit_layout(self, batch: PyTree) -> None:
        """Finds the stacked-layer dimensions the loss's scans consume, once.

        The loss is traced on a micro-batch of ``batch``'s shapes (arrays or
        ``jax.ShapeDtypeStruct``; nothing runs). Where the plan shards parameters at rest
        (stage 3) on such a dimension, the engine re-plans and moves the state to the new layout,
        so each layer is gathered on its own. The first ``train_step``, ``evaluate`` or
        ``lower`` calls it; call it yourself to see the final plan (``describe()``) before.
        """
        if self._layout_fitted:
            return
        self._layout_fitted = True
        if not (self.plan.stage.shard_params or self.plan.pipe_axis or self.plan.expert_axis):
            return
        dims, piped = layout.traced_layers(self, batch)
        new = self._replan(layer_dims=dims, **piped)
        _check_live_parameters(new, self.config.zero_optimization.stage3_max_live_parameters)
        moved = layout.moved_leaves(self.plan, new)
        if not moved:
            self.plan = new
            if self._disk is not None:
                self._disk.use_plan(new)
            return
        if self._disk is not None:  # the files too, group by group
            self.state = self._disk.relayout(self.state, new)
        else:
            self.state = relayout(self.state, self.plan, new)
        self.plan = new
        self._step = self._eval = None
        layout.log_moved(moved)

    def _choose_stage(self, batch: PyTree) -> None:
        """``zero_optimization.stage: auto``: the candidate chosen (:mod:`jzero.engine.auto_stage`)
        becomes this engine's config, plan and step, the state moved to its layout once."""
        from jzero.engine import auto_stage

        auto, self._auto_stage = self._auto_stage, None
        cfg, plan, step = auto_stage.choose_stage(auto, self, batch)
        self.state = relayout(self.state, self.plan, plan)
        self.plan, self.config, self._step, self._eval = plan, cfg, step, None
        self._replan = auto.planner(cfg)
        self._layout_fitted = True

    def _choose_layout(self, batch: PyTree) -> None:
        """Parallel sizes ``"auto"``: the layout chosen (:mod:`jzero.engine.auto_layout`) becomes
        this engine's config, mesh, plan, step and batch sizes, the state moved to it once."""
        from jzero.engine import auto_layout

        auto, self._auto_layout = self._auto_layout, None
        choice = auto_layout.choose_layout(auto, self, batch)
        self.state = relayout(self.state, self.plan, choice.plan)
        self.plan, self.config, self._step, self._eval = (
            choice.plan,
            choice.config,
            choice.step,
            None,
        )
        self._replan, self._layout_fitted, self._auto_stage = choice.replan, True, None
        self.train_batch_size, self.micro_batch_size, self.accumulation_steps = choice.sizes

    def _step_fn(self, batch: PyTree) -> Callable[..., Any]:
        if self._auto_stage is not None:
            self._choose_stage(batch)
        self.fit_layout(batch)
        if self._step is None:  # whether the loss returns aux is read when the step traces
            self._step = steps.build_step(
                self.plan,
                self.config,
                self.loss_fn,
                self.optimizer,
                accumulation_steps=self.accumulation_steps,
                takes_extra=self.takes_extra,
                learning_rate=self.learning_rate,
                nvme=self._disk,
            )
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
        batch = self._global(batch)
        fp = self.config.flops_profiler
        if fp.enabled and self.iteration + 1 == fp.profile_step:
            metrics = steps.profiled_step(self, self._step_fn(batch), batch)
        else:
            self.state, metrics = self._step_fn(batch)(self.state, batch)
        self.iteration += 1
        self._unchanged_since = None
        if self.monitor.enabled:
            self._log_step(metrics, batch, started)
        interval = self.config.checkpoint.save_interval_steps
        if self.config.checkpoint.directory and interval and self.iteration % interval == 0:
            self.save(periodic=True)
        return metrics

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

            self._train_log = monitor.train_log(self, batch, figures.peak_bytes(self, batch))
        self._train_log.log(metrics, self.iteration, started)

    def peak_bytes(self, batch: PyTree) -> Callable[[], int | None]:
        """The peak memory per device of the step on batches of ``batch``'s shapes (this
        process's rows, as ``train_step`` takes them), as a function that reads it: the
        allocator's figure on an accelerator (it moves as the run goes); on CPU, which keeps
        none, the compiled step's peak, of the executable the step runs (not compiled again).
        ``None`` where the allocator names no peak. The figure the monitors' ``peak_bytes``
        and ``jzero train`` report (:mod:`jzero.engine.figures`)."""
        return figures.peak_bytes(self, self._global(batch))

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
        return figures.model_flops(self, batch, self._model_flops)

    def _check_concrete(self, what: str) -> None:
        if is_abstract(self.state):
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
        if self._auto_layout is not None:
            self._choose_layout(batch)
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
        self.fit_layout(batch)
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
    def _checkpointer(self) -> Any:
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
        step = self.iteration if step is None else int(step)
        ckpt = self._checkpointer()
        if self._unchanged_since == step and step in ckpt.all_steps():
            logger.info("jzero: checkpoint step %d is already on disk and unchanged", step)
            return False
        meta = {
            "config": self.config.to_dict(),
            "iteration": self.iteration,
            "data": self.data_iterator.state() if self.data_iterator is not None else None,
            "stage": self.plan.stage.stage,
            "devices": self.plan.data_parallel_size,
        }
        state = self._full_state()
        saved = saving.save(ckpt, step, self.config, self.plan, state, meta, periodic=periodic)
        if saved:
            self._unchanged_since = step if step == self.iteration else None
        return saved

    def save_16bit_model(
        self, directory: str | Any, *, max_shard_size: int | str = "5GB", dtype: Any = None
    ) -> Any:
        """Writes the parameters as Hugging Face's sharded safetensors (DeepSpeed's name).

        ``model-00001-of-0000N.safetensors`` files of at most ``max_shard_size`` and
        ``model.safetensors.index.json``, tensors named by their dotted paths, one leaf on the
        host at a time; each process writes its own files. Load them back with
        ``jzero.initialize(init_from=directory)`` or Hugging Face's loaders.

        Args:
          directory: the output directory (created if missing).
          max_shard_size: the most bytes per file (``5GB``, ``500MiB`` or an int).
          dtype: the dtype of floating tensors; ``None``: the compute dtype (bf16/fp16 under
            mixed precision, else the params' own).

        Returns:
          The index file's path.
        """
        from jzero import weights

        return weights.save_weights(
            directory, self.params, dtype=dtype, max_shard_size=max_shard_size
        )

    def restore(self, step: int | None = None) -> dict[str, Any]:
        """Restores a checkpoint (the latest by default) into this engine's plan.

        The checkpoint may come from any stage, with or without offload, and any device count
        the shapes allow: the state is read straight into this plan's shardings. The data
        position is restored into ``engine.data_iterator`` when both exist.

        Returns:
          The checkpoint's meta: ``config``, ``iteration``, ``data``, ``stage``, ``devices``.
        """
        ckpt = self._checkpointer()
        self.state, meta = saving.restore(ckpt, step, self.plan, self.state, self._disk)
        if self._auto_layout is not None:  # the layout the run chose: no search again
            from jzero.engine import auto_layout

            auto_layout.adopt_saved(self._auto_layout, meta.get("config"))
        self.iteration = int(meta.get("iteration", self.global_step))
        restored = ckpt.latest_step() if step is None else int(step)
        self._unchanged_since = restored if restored == self.iteration else None
        if self.data_iterator is not None and meta.get("data") is not None:
            self.data_iterator.restore(meta["data"])
        return meta

    def latest_checkpoint(self) -> int | None:
        """The newest complete checkpoint step in ``checkpoint.directory``, or ``None``."""
        if not self.config.checkpoint.directory:
            return None
        return self._checkpointer().latest_step()

    def wait_until_finished(self) -> None:
        """Blocks until every checkpoint save in flight is on disk."""
        if self._ckpt is not None:
            self._ckpt.wait_until_finished()

    def close(self) -> None:
        """Waits for checkpoint saves in flight, then releases the checkpointer; idempotent.

        Also called at interpreter exit and when a ``with jzero.initialize(...) as engine:``
        block ends.
        """
        if self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
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
        return self._auto_layout

    def describe(self) -> str:
        """The plan report: every leaf's shape, spec per category and per-device bytes."""
        return self.plan.describe()


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
