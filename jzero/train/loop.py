"""The training loop for any model: :func:`fit` runs an engine's steps on a user's data, with
evaluation, logs, monitors, checkpoints and a clean stop on SIGTERM; ``jzero train`` is this loop.

Decisions:

* **The config drives it**, as it drives the engine: ``train.steps``, ``train.eval_interval``,
  ``train.eval_batches``, ``train.log_dir``, ``train.max_consecutive_nonfinite``,
  ``steps_per_print`` and the ``checkpoint`` section (:class:`jzero.config.TrainConfig`).
* **The data position is part of every checkpoint.** The data is any iterable of batches (this
  process's rows); its iterator becomes ``engine.data_iterator``, so each save (periodic, the
  final one, on a signal) writes its position in the same atomic step as the model and a resume
  continues it: jzero's :class:`jzero.data` iterators, a Grain ``DataLoader`` or dataset
  iterator (``get_state``/``set_state``), or any iterator with ``state()``/``restore()``. A
  generator has no position: a warning says a resumed run reads it from its beginning again.
* With ``checkpoint.directory`` set, the loop resumes from the checkpoint written last (unless
  ``resume=False``) and saves a final checkpoint at the end, also when it was interrupted or
  stopped. Starting fresh into a directory holding an earlier run's checkpoints needs
  ``checkpoint.overwrite`` (``--overwrite``); the check runs before the first step.
* The first SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send before they kill a job)
  stops the loop after the current step, every process after the same step. The run saves and
  returns its summary with ``interrupted`` true and the signal's name (``jzero train`` exits
  with 128 + its number: 130, 143). A further SIGTERM is logged and changes nothing (SLURM
  signals every process of a job, so under a launcher each child gets it twice); a second
  Ctrl-C quits now (the step or the save in flight is abandoned; committed checkpoints stay).
  Only from the main thread.
* ``train.max_consecutive_nonfinite`` steps in a row with inf/NaN gradients stop the run
  (``stopped`` says why; ``jzero train`` exits 1).
* **Storage that fails ends the run cleanly** (:mod:`jzero.checkpoint`'s decisions). A periodic
  save that fails is one error line and training goes on; ``checkpoint.max_consecutive_failures``
  failed saves in a row stop the run without a final save, and a final save that fails ends it
  too: either is one error line, ``checkpoint_error`` in the summary (with ``last_checkpoint``)
  and exit status 1. The summary is written in every case, and a start removes the folders of
  saves that never completed.
* Every step appends a strict JSON line to ``<train.log_dir>/metrics.jsonl`` and the end writes
  ``summary.json`` (:mod:`jzero.train.summary`), from process 0 only, which alone logs and shows
  the progress bar (on a terminal only). A resumed run appends (first dropping the lines after
  its checkpoint, :mod:`jzero.train.run_dirs`).
* The evaluation data is a finite collection of batches, read whole at each evaluation (at the
  start, every ``train.eval_interval`` steps and at the last step): a list, or anything that
  iterates again from its start (a Grain ``MapDataset`` or ``DataLoader``); at most
  ``train.eval_batches`` of an iterable that is no sequence.
* Rates: the summary's ``tokens_per_s`` and ``samples_per_s`` are the run's averages (the
  evaluations, and on an accelerator the first step's compilation, included); a step's line
  carries its own, and ``mfu`` where the device's peak FLOP/s is known. Tokens need
  ``engine.tokens_per_sample`` (``jzero train`` sets it to the sequence length).
* The peak memory per device is the engine's figure (:meth:`jzero.Engine.peak_bytes`),
  measured on the first batch before it trains.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from jzero import distributed, monitor
from jzero._util import format_bytes
from jzero.engine import Engine, data_position
from jzero.plan import host_state_bytes, model_state_bytes
from jzero.train import run_dirs, signals
from jzero.train.summary import METRICS, SUMMARY, json_safe, strict_json

__all__ = ["fit", "what_is_on"]

logger = logging.getLogger(__name__)


def fit(
    engine: Engine,
    train_data: Iterable[Any],
    *,
    eval_data: Iterable[Any] | None = None,
    steps: int | None = None,
    resume: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Trains ``engine`` on ``train_data`` as ``jzero train`` does, and returns the summary.

    Args:
      engine: what :func:`jzero.initialize` returned; its config's ``train`` and
        ``checkpoint`` sections say how long, how often to evaluate, where to log and save.
      train_data: an iterable of batches (this process's rows of each global batch, as
        ``engine.train_step`` takes them): a :mod:`jzero.data` iterator, a Grain
        ``DataLoader`` or dataset, a generator, ... Its iterator becomes
        ``engine.data_iterator``, whose position every checkpoint carries where it has one.
      eval_data: batches to evaluate on (a list, or anything iterated again from its start);
        ``None``: no evaluation.
      steps: the last step to train to; ``None`` for ``train.steps``. A resumed run continues
        from the step after its checkpoint.
      resume: continue from the latest checkpoint in ``checkpoint.directory`` (model, optimizer
        and data position). ``False`` starts fresh, and is refused when the directory holds an
        earlier run's checkpoints unless ``checkpoint.overwrite`` is set.
      progress: show a progress bar (on process 0, when stderr is a terminal).

    Returns:
      The summary, as written to ``<train.log_dir>/summary.json`` (NaN as ``None``):
      ``steps`` (the last step trained), ``interrupted`` and ``signal``, ``stopped``,
      ``skipped_steps``, ``final_loss``, ``first_eval_loss``, ``eval_loss``, ``seconds``,
      ``tokens_per_s``, ``samples_per_s``, ``resumed_from``, ``stage``, ``devices``, ``mesh``,
      ``model_state_bytes_per_device``, ``host_state_bytes_per_device``,
      ``peak_bytes_per_device``, ``mfu``, ``metrics``, ``checkpoint_directory``,
      ``checkpoint_error`` and ``last_checkpoint``.

    Raises:
      ValueError: a fresh start into an earlier run's checkpoints or ``metrics.jsonl``, or a
        log folder inside the checkpoint directory.
    """
    cfg = engine.config
    fresh = not resume or bool(cfg.checkpoint.overwrite)
    if cfg.checkpoint.directory:
        run_dirs.check_apart(cfg)
        run_dirs.check_checkpoint_directory(cfg, fresh=fresh)
    run_dirs.check_log_dir(cfg, fresh=fresh)
    watchdog = distributed.Watchdog(
        distributed.hang_timeout(cfg.distributed),
        on_hang=_hang_summary(cfg),
        stragglers=distributed.stragglers(cfg.distributed),
    )
    with signals.watching() as stop, watchdog:
        try:
            summary = _fit(engine, train_data, eval_data, steps, fresh, progress, (stop, watchdog))
        except jax.errors.JaxRuntimeError as e:  # a peer lost in a collective: named, then exit
            logger.exception("jzero: the step failed in the distributed runtime")
            watchdog.failed(e)
            raise
    if distributed.is_main_process():
        path = Path(cfg.train.log_dir) / SUMMARY
        path.write_text(strict_json(summary, indent=2) + "\n")
    return summary


def _iterator(engine: Engine, train_data: Iterable[Any]) -> Any:
    """``train_data``'s iterator, made ``engine.data_iterator``."""
    if data_position.protocol(train_data) is not None and hasattr(train_data, "__next__"):
        it = train_data
    else:
        it = iter(train_data)
    if data_position.protocol(it) is None:
        logger.warning(
            "jzero: the training data (%s) has no position to checkpoint (no get_state/"
            "set_state, as Grain's iterators have, nor state/restore): a resumed run reads it "
            "from its beginning again. Use jzero.data or a Grain pipeline to resume where it "
            "stopped.",
            type(train_data).__name__,
        )
    engine.data_iterator = it
    return it


def _resume(engine: Engine, *, fresh: bool) -> int | None:
    """Restores the latest checkpoint unless the run starts fresh; the step restored."""
    if fresh or not engine.config.checkpoint.directory:
        return None
    resumed = engine.latest_checkpoint()
    if resumed is not None:
        engine.restore(resumed)
        logger.info("resumed from checkpoint %d in %s", resumed, engine.config.checkpoint.directory)
    return resumed


def _eval_batches(eval_data: Iterable[Any], limit: int) -> Iterable[Any]:
    if isinstance(eval_data, Sequence):
        return eval_data
    return itertools.islice(iter(eval_data), limit)


def _global_shapes(batch: Any) -> Any:
    """The shapes of the global batch whose process rows ``batch`` is."""
    procs = jax.process_count()

    def shape(x: Any) -> jax.ShapeDtypeStruct:
        x = np.asarray(x) if not hasattr(x, "shape") else x
        lead = (x.shape[0] * procs,) if x.ndim else ()
        return jax.ShapeDtypeStruct(lead + tuple(x.shape[1:]), x.dtype)

    return jax.tree.map(shape, batch)


def _bar_text(record: Mapping[str, float], peak: int, skipped: int) -> str:
    """The progress bar's figures after a step: its loss, its own rate (the last step's, not
    the run's average), the peak memory per device, MFU, skipped updates."""
    rate = record.get("tokens_per_s")
    parts = [
        f"loss {record['loss']:.3f}",
        f"{rate:,.0f} tok/s last step"
        if rate is not None
        else f"{record['samples_per_s']:,.1f} samples/s last step",
        f"peak {format_bytes(peak)}/device",
    ]
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if skipped:  # skipped steps are never silent
        parts.append(f"{skipped} skipped")
    return ", ".join(parts)


def _state_bytes(engine: Engine) -> tuple[int, int, int]:
    """Per device: the model state in device memory, in host memory, and in NVMe files."""
    cfg = engine.config
    by_category = model_state_bytes(engine.plan)
    on_disk = 0
    if cfg.zero_optimization.offload_optimizer.device == "nvme":  # between steps, in files
        on_disk = by_category.pop("opt_state", 0) + by_category.pop("master_params", 0)
        if cfg.zero_optimization.offload_param.device == "nvme":
            on_disk += by_category.pop("params", 0)
    host = sum(host_state_bytes(engine.plan).values())
    return sum(by_category.values()), host, on_disk


class _Run:
    """One :func:`fit`: its engine and watchers, the steps it trains, what its steps counted."""

    def __init__(
        self,
        engine: Engine,
        watchers: tuple[signals.StopOnSignal, distributed.Watchdog],
        steps: int | None,
    ):
        self.engine, self.cfg = engine, engine.config
        self.stop, self.watchdog = watchers
        self.steps = steps if steps is not None else self.cfg.train.steps
        self.main = distributed.is_main_process()  # only process 0 logs and writes files
        self.log_dir = Path(self.cfg.train.log_dir)
        self.loss, self.streak, self.skipped = float("nan"), 0, 0
        self.mfus: list[float] = []
        self.interrupted, self.stopped, self.checkpoint_error = False, None, None
        self.save_failed: tuple[type[Exception], ...] = ()
        if self.cfg.checkpoint.directory:
            from jzero.checkpoint import CheckpointWriteError

            self.save_failed = (CheckpointWriteError,)

    def start(self, train_data: Iterable[Any], fresh: bool) -> None:
        """The data's iterator, the state (restored where a checkpoint is), the processes'
        agreement; ``first_step`` and the batch it trains on (``pending``)."""
        engine, watchdog = self.engine, self.watchdog
        if self.cfg.checkpoint.directory and self.main:
            from jzero.checkpoint import dirs

            dirs.clean_unfinished(self.cfg.checkpoint.directory)  # a killed run's saves
        self.batches = _iterator(engine, train_data)
        # A first batch settles what waits for shapes (the state is made once, in its final
        # layout, and the checkpoint read into it); a restore then moves the data to its saved
        # position, so the batch is read again there. Without a position it is step 1's.
        engine.on_phase = watchdog.phase if watchdog.active else None
        watchdog.phase("reading the batch of step {step}", engine.iteration + 1)
        self.probe = next(self.batches)
        engine.resolve(self.probe)
        if jax.process_count() > 1:  # the processes agree on the run before any collective
            watchdog.phase("agreeing on the run")
            distributed.agree("run", _fingerprint(engine))
        watchdog.phase("restoring the latest checkpoint")
        self.resumed = _resume(engine, fresh=fresh)
        if jax.process_count() > 1:  # and on the program each will run
            watchdog.phase("agreeing on the program")
            distributed.agree("program", {"train_step": _program_hash(engine, self.probe)})
        positioned = self.resumed is not None and data_position.protocol(self.batches)
        self.pending = None if positioned else self.probe
        self.first_step = engine.iteration + 1
        self.done = self.first_step - 1
        if self.resumed is not None and self.first_step > self.steps:
            logger.warning(
                "checkpoint %d is at or past the last step, %d: there is nothing to train. "
                "Pass --steps above %d to train on, or --overwrite to start again.",
                self.resumed,
                self.steps,
                self.resumed,
            )

    def announce(self) -> None:
        """The plan, what is on, and the figures the run starts with, logged."""
        engine = self.engine
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if engine.monitor_dir is None:  # monitors without an output_path write beside metrics
            engine.monitor_dir = str(self.log_dir)
        self.measured = engine.peak_bytes(self.probe)
        self.state_bytes = _state_bytes(engine)
        state, host, on_disk = self.state_bytes
        logger.info("\n%s", engine.describe())
        logger.info("jzero: on: %s", what_is_on(engine, self.batches))
        _warn_schedule_cut(engine, self.steps)
        logger.info(
            "training %d steps%s, %d samples a step, per device: model state %s in device "
            "memory (%s in host memory%s), peak %s",
            max(self.steps - self.first_step + 1, 0),
            f" ({self.first_step} to {self.steps})" if self.resumed is not None else "",
            engine.train_batch_size,
            format_bytes(state),
            format_bytes(host),
            f", {format_bytes(on_disk)} on NVMe" if on_disk else "",
            format_bytes(self.peak()),
        )
        self.rates = monitor.step_rates(engine, _global_shapes(self.probe))

    def peak(self) -> int:
        return self.measured() or 0

    def evaluate(self, eval_data: Iterable[Any], step: int) -> float:
        """The mean loss over the eval batches, logged and given to the monitors."""
        self.watchdog.phase("evaluating after step {step}", step)
        limit = self.cfg.train.eval_batches
        losses = [float(self.engine.evaluate(b)) for b in _eval_batches(eval_data, limit)]
        if not losses:
            raise ValueError(
                "eval_data gave no batch: pass a list of batches, or a collection that iterates "
                "again from its start (a Grain MapDataset or DataLoader), or eval_data=None."
            )
        loss = float(sum(losses) / len(losses))
        samples = self.engine.iteration * self.engine.train_batch_size  # the monitors' x-axis
        self.engine.monitor.write_events([(monitor.tag("eval_loss"), loss, samples)])
        logger.info("step %d: eval loss %.4f", step, loss)
        return loss

    def train(self, step: int) -> dict[str, Any]:
        """Step ``step`` trained; its ``metrics.jsonl`` record (without the eval loss)."""
        watchdog = self.watchdog
        watchdog.phase("reading the batch of step {step}", step)
        batch = self.pending if self.pending is not None else next(self.batches)
        own = time.perf_counter() - self.t_last  # this process's own work before the step
        watchdog.phase("starting step {step}", step)
        self.pending = None
        m = self.engine.train_step(batch)
        watchdog.phase("step {step} dispatched, waiting for its results", step)
        self.loss = float(m["loss"])
        now = time.perf_counter()
        record = {k: float(v) for k, v in m.items()}
        seconds = now - self.t_last
        record.update(step=step, time=now - self.t_start)
        record["samples_per_s"] = self.engine.train_batch_size / max(seconds, 1e-9)
        tokens_per_s = self.rates.tokens_per_s(seconds)
        if tokens_per_s is not None:
            record["tokens_per_s"] = tokens_per_s
        mfu = self.rates.mfu(seconds)
        if mfu is not None:
            record["mfu"] = mfu
            if step > self.first_step:  # the first step's time holds its compilation
                self.mfus.append(mfu)
        self.t_last, self.done = now, step
        watchdog.finished(step, seconds, own)
        if watchdog.active and step > self.first_step:
            # Every process's times of the step before (each published them before this
            # step's collectives could finish), and the stragglers among them named.
            times_step, own_s, slow = watchdog.compare(step - 1)
            record.update(process_step_s=times_step, process_own_s=own_s)
            record["process_times_step"] = step - 1
            for warning in slow if self.main else ():
                logger.warning("%s", warning)
        self._count_nonfinite(step, record)
        return record

    def _count_nonfinite(self, step: int, record: Mapping[str, float]) -> None:
        bad = record.get("nonfinite", 0.0) > 0
        self.streak = self.streak + 1 if bad else 0
        self.skipped += int(record.get("skipped", 0.0) > 0)
        if bad:
            logger.warning(
                "step %d: the gradients hold inf/NaN (loss %s); %s",
                step,
                self.loss,
                "the update was skipped" if record.get("skipped") else "the update was applied",
            )

    def should_stop(self, step: int) -> bool:
        """Whether the run ends after ``step``: too many inf/NaN steps, or a stop signal on
        any process (every process stops after the same step)."""
        limit = self.cfg.train.max_consecutive_nonfinite
        if limit and self.streak >= limit:
            self.stopped = (
                f"stopped at step {step}: {self.streak} consecutive steps had inf/NaN "
                f"gradients (train.max_consecutive_nonfinite: {limit}). Lower the learning "
                "rate, check the data, or set skip_nonfinite: true; the checkpoints with "
                "finite parameters are kept."
            )
            return True
        self.interrupted = distributed.any_process(self.stop.requested)
        return self.interrupted

    def finish(self) -> None:
        """The final checkpoint (on a stop or a signal too) and the engine closed."""
        if self.stopped:
            logger.error("jzero: %s", self.stopped)
        if self.cfg.checkpoint.directory and self.checkpoint_error is None:
            self.watchdog.phase("saving the final checkpoint, step {step}", self.done)
            self.checkpoint_error = _final_save(self.engine, self.save_failed)
        if self.checkpoint_error:
            logger.error("jzero: %s", self.checkpoint_error)
        self.engine.on_phase = None
        self.engine.close()  # the monitors flushed; the checkpointer's threads released

    def summary(self, elapsed: float, evals: tuple[float | None, float | None]) -> dict:
        """The run's summary (NaN as ``None``), as :func:`fit` returns and writes it."""
        engine, cfg = self.engine, self.cfg
        ran = self.done - (self.first_step - 1)
        samples, tokens = engine.train_batch_size, engine.tokens_per_sample
        state, host, _ = self.state_bytes
        summary = {
            "steps": self.done,
            "interrupted": self.interrupted,
            "signal": self.stop.name() if self.interrupted else None,
            "stopped": self.stopped,
            "skipped_steps": self.skipped,
            "final_loss": self.loss,
            "first_eval_loss": evals[0],
            "eval_loss": evals[1],
            "seconds": round(elapsed, 2),
            "samples_per_s": round(ran * samples / max(elapsed, 1e-9), 2),
            "tokens_per_s": (
                round(ran * samples * tokens / max(elapsed, 1e-9), 1) if tokens else None
            ),
            "resumed_from": self.resumed,
            "stage": engine.plan.stage.stage,
            "devices": engine.plan.data_parallel_size,
            "mesh": {str(k): int(v) for k, v in engine.mesh.shape.items()},
            "model_state_bytes_per_device": state,
            "host_state_bytes_per_device": host,
            "peak_bytes_per_device": self.peak(),
            "mfu": float(np.mean(self.mfus)) if self.mfus else None,  # None: no known peak
            "metrics": str(self.log_dir / METRICS),
            "checkpoint_directory": cfg.checkpoint.directory or None,
            "checkpoint_error": self.checkpoint_error,
            "last_checkpoint": run_dirs.last_checkpoint(cfg),
        }
        return json_safe(summary)


def _fit(
    engine: Engine,
    train_data: Iterable[Any],
    eval_data: Iterable[Any] | None,
    steps: int | None,
    fresh: bool,
    progress: bool,
    watchers: tuple[signals.StopOnSignal, distributed.Watchdog],
) -> dict[str, Any]:
    run = _Run(engine, watchers, steps)
    run.start(train_data, fresh)
    run.announce()
    cfg, first_step, last = engine.config, run.first_step, run.steps
    evaluating = eval_data is not None and cfg.train.eval_interval > 0
    first_eval = run.evaluate(eval_data, first_step - 1) if evaluating else None
    last_eval = first_eval
    metrics_path = run.log_dir / METRICS if run.main else Path(os.devnull)
    if run.resumed is not None and run.main:
        run_dirs.keep_metrics_until(metrics_path, run.resumed)
    metrics_file = metrics_path.open("a" if run.resumed is not None else "w")
    # The bar only on a terminal: piped into a file it would leave a carriage return per
    # update; there the steps_per_print lines are the progress.
    show_bar = progress and run.main and sys.stderr.isatty()
    bar = tqdm(total=last, initial=first_step - 1, desc="jzero", unit="step",
               disable=not show_bar, dynamic_ncols=True, file=sys.stderr)  # fmt: skip
    live = contextlib.ExitStack()  # while the bar is shown, log lines are written above it
    if show_bar:
        live.enter_context(logging_redirect_tqdm())
    run.t_start = run.t_last = time.perf_counter()
    try:
        for step in range(first_step, last + 1):
            record = run.train(step)
            if evaluating and (step % cfg.train.eval_interval == 0 or step == last):
                last_eval = record["eval_loss"] = run.evaluate(eval_data, step)
            metrics_file.write(strict_json(record) + "\n")
            metrics_file.flush()
            if show_bar:
                bar.set_postfix_str(_bar_text(record, run.peak(), run.skipped), refresh=False)
            bar.update(1)
            if cfg.steps_per_print and step % cfg.steps_per_print == 0:
                _log_step(step, record)
            if run.should_stop(step):
                break
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the handler was installed
        run.interrupted = True
    except run.save_failed as e:  # max_consecutive_failures periodic saves failed in a row
        run.checkpoint_error, run.done = str(e), engine.iteration
    finally:
        bar.close()
        live.close()
        metrics_file.close()
    elapsed = time.perf_counter() - run.t_start
    run.finish()
    return run.summary(elapsed, (first_eval, last_eval))


def _log_step(step: int, record: Mapping[str, float]) -> None:
    lr = f", lr {record['lr']:.3g}" if "lr" in record else ""
    moe = (  # an MoE model's load-balancing loss (in the loss) and capacity drops
        f", moe aux {record['moe_aux_loss']:.4f}, dropped "
        f"{100 * record.get('moe_dropped_fraction', 0.0):.1f}%"
        if "moe_aux_loss" in record
        else ""
    )
    logger.info(
        "step %d: loss %.4f, grad norm %.3f%s%s", step, record["loss"], record["grad_norm"], lr, moe
    )


def _final_save(engine: Engine, save_failed: tuple[type[Exception], ...]) -> str | None:
    """The final checkpoint (on a signal or a stop too); its failure's message, or ``None``."""
    try:
        saved = engine.save()
        engine.wait_until_finished()  # committed, or its failure raised
        if saved:
            logger.info(
                "checkpoint %d written to %s", engine.iteration, engine.config.checkpoint.directory
            )
    except save_failed as e:
        return str(e)
    return None


def _fingerprint(engine: Engine) -> dict[str, Any]:
    """What every process of a run must share: versions, mesh and the resolved config (less
    its ``distributed`` section, which names each process)."""
    import importlib.metadata

    import jaxlib

    config = {k: v for k, v in engine.config.to_dict().items() if k != "distributed"}
    return {
        "versions": {
            "jzero": importlib.metadata.version("jzero"),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
        },  # fmt: skip
        "mesh": {str(k): int(v) for k, v in engine.mesh.shape.items()},
        "config": json.loads(strict_json(config)),
    }


def _program_hash(engine: Engine, batch: Any) -> str:
    """A hash of the train step's lowered program (StableHLO text, locations stripped)."""
    text = engine.lower(batch).as_text(debug_info=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hang_summary(cfg: Any) -> Any:
    """The watchdog's callback: the hang's report as ``summary.json``."""

    def write(report: dict[str, Any]) -> None:
        log_dir = Path(cfg.train.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        behind = report["processes"]
        steps = [r["last_step"] for r in behind.values() if r["last_step"] is not None]
        summary = {
            "steps": min(steps) if steps else 0,
            "interrupted": False,
            "signal": None,
            "stopped": report["message"],
            "hang": report,
            "checkpoint_directory": cfg.checkpoint.directory or None,
            "last_checkpoint": run_dirs.last_checkpoint(cfg),
        }
        (log_dir / SUMMARY).write_text(strict_json(summary, indent=2) + "\n")

    return write


def what_is_on(engine: Engine, data: Any = None) -> str:
    """One line of what the run does: the stage and mesh, the compute and master dtypes,
    activation checkpointing, offload, and the data (its ``describe()`` or its type)."""
    cfg, plan = engine.config, engine.plan
    mesh = ", ".join(f"{k}={v}" for k, v in engine.mesh.shape.items())
    params = {str(x.dtype) for x in jax.tree.leaves(plan.abstract_params)}
    compute = plan.options.precision.compute_dtype
    dtypes = f"parameters {'/'.join(sorted(params))}"
    dtypes += f", compute {np.dtype(compute).name}" if compute is not None else ""
    dtypes += ", float32 master weights" if plan.master is not None else ""
    policy = cfg.activation_checkpointing.policy
    remat_text = (
        f"activation checkpointing {policy}" if policy else
        ("activation checkpointing of the gathered layers (stage 3's default)"
         if plan.stage.shard_params else "no activation checkpointing")
    )  # fmt: skip
    zero = cfg.zero_optimization
    offload = [
        f"{what} on {where}"
        for what, where in (
            ("optimizer state", zero.offload_optimizer.device),
            ("parameters", zero.offload_param.device),
        )
        if where not in (None, "none")
    ]
    described = getattr(data, "describe", None)
    source = described() if callable(described) else type(data).__name__ if data is not None else ""
    parts = [f"ZeRO stage {plan.stage.stage} over {{{mesh}}}", dtypes, remat_text]
    parts.append(", ".join(offload) if offload else "no offload")
    if source:
        parts.append(source if source.startswith("data: ") else f"data {source}")
    return "; ".join(parts)


def _warn_schedule_cut(engine: Engine, steps: int) -> None:
    """One warning when the run ends before the scheduler's warm-up or decay does (each
    step's ``lr`` in ``metrics.jsonl`` shows where it ends; computing it here would compile
    the schedule's operations one by one)."""
    sched = engine.config.scheduler
    if sched is None:
        return
    params = dict(sched.params)
    for key, what in (("warmup_num_steps", "warm-up"), ("total_num_steps", "decay")):
        value = params.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and steps < value:
            logger.warning(
                "jzero: the run ends at step %d, before its schedule's %s ends "
                "(scheduler.params.%s: %d): the learning rate never reaches the schedule's "
                "end. Set %s: %d to fit the run, or train on.",
                steps,
                what,
                key,
                value,
                key,
                steps,
            )
            return
