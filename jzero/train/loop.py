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


def _fit(
    engine: Engine,
    train_data: Iterable[Any],
    eval_data: Iterable[Any] | None,
    steps: int | None,
    fresh: bool,
    progress: bool,
    watchers: tuple[signals.StopOnSignal, distributed.Watchdog],
) -> dict[str, Any]:
    stop, watchdog = watchers
    cfg = engine.config
    main_process = distributed.is_main_process()  # only process 0 logs and writes files
    if cfg.checkpoint.directory and main_process:
        from jzero.checkpoint import dirs

        dirs.clean_unfinished(cfg.checkpoint.directory)  # saves a killed run left unfinished
    steps = steps if steps is not None else cfg.train.steps
    batches = _iterator(engine, train_data)
    # A first batch settles what waits for shapes (the state is made once, in its final
    # layout, and the checkpoint read into it); a restore then moves the data to its saved
    # position, so the batch is read again there. Without a position it is step 1's.
    engine.on_phase = watchdog.phase if watchdog.active else None
    watchdog.phase("reading the batch of step {step}", engine.iteration + 1)
    probe = next(batches)
    engine.resolve(probe)
    if jax.process_count() > 1:  # the processes agree on the run before any collective
        watchdog.phase("agreeing on the run")
        distributed.agree("run", _fingerprint(engine))
    watchdog.phase("restoring the latest checkpoint")
    resumed = _resume(engine, fresh=fresh)
    if jax.process_count() > 1:  # and on the program each will run
        watchdog.phase("agreeing on the program")
        distributed.agree("program", {"train_step": _program_hash(engine, probe)})
    pending = None if resumed is not None and data_position.protocol(batches) else probe
    first_step = engine.iteration + 1
    if resumed is not None and first_step > steps:
        logger.warning(
            "checkpoint %d is at or past the last step, %d: there is nothing to train. Pass "
            "--steps above %d to train on, or --overwrite to start again.",
            resumed,
            steps,
            resumed,
        )
    log_dir = Path(cfg.train.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if engine.monitor_dir is None:  # monitors without an output_path write beside metrics
        engine.monitor_dir = str(log_dir)
    measured = engine.peak_bytes(probe)

    def peak() -> int:
        return measured() or 0

    state_bytes, host_bytes, on_disk = _state_bytes(engine)
    samples_per_step = engine.train_batch_size
    logger.info("\n%s", engine.describe())
    logger.info("jzero: on: %s", what_is_on(engine, batches))
    _warn_schedule_cut(engine, steps)
    logger.info(
        "training %d steps%s, %d samples a step, per device: model state %s in device memory "
        "(%s in host memory%s), peak %s",
        max(steps - first_step + 1, 0),
        f" ({first_step} to {steps})" if resumed is not None else "",
        samples_per_step,
        format_bytes(state_bytes),
        format_bytes(host_bytes),
        f", {format_bytes(on_disk)} on NVMe" if on_disk else "",
        format_bytes(peak()),
    )

    def evaluate() -> float:
        losses = [
            float(engine.evaluate(b)) for b in _eval_batches(eval_data, cfg.train.eval_batches)
        ]
        if not losses:
            raise ValueError(
                "eval_data gave no batch: pass a list of batches, or a collection that iterates "
                "again from its start (a Grain MapDataset or DataLoader), or eval_data=None."
            )
        loss = float(sum(losses) / len(losses))
        samples = engine.iteration * engine.train_batch_size  # the monitors' x-axis
        engine.monitor.write_events([(monitor.tag("eval_loss"), loss, samples)])
        return loss

    evaluating = eval_data is not None and cfg.train.eval_interval > 0
    watchdog.phase("evaluating after step {step}", first_step - 1)
    first_eval = evaluate() if evaluating else None
    if first_eval is not None:
        logger.info("step %d: eval loss %.4f", first_step - 1, first_eval)
    last_eval = first_eval
    metrics_path = log_dir / METRICS if main_process else Path(os.devnull)
    if resumed is not None and main_process:
        run_dirs.keep_metrics_until(metrics_path, resumed)
    metrics_file = metrics_path.open("a" if resumed is not None else "w")
    # The bar only on a terminal: piped into a file it would leave a carriage return per
    # update; there the steps_per_print lines are the progress.
    show_bar = progress and main_process and sys.stderr.isatty()
    bar = tqdm(
        total=steps,
        initial=first_step - 1,
        desc="jzero",
        unit="step",
        disable=not show_bar,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    live = contextlib.ExitStack()  # while the bar is shown, log lines are written above it
    if show_bar:
        live.enter_context(logging_redirect_tqdm())
    rates = monitor.step_rates(engine, _global_shapes(probe))
    mfus: list[float] = []
    t_start = time.perf_counter()
    t_last, done, loss = t_start, first_step - 1, float("nan")
    interrupted, stopped, checkpoint_error = False, None, None
    limit = cfg.train.max_consecutive_nonfinite
    streak, skipped = 0, 0
    save_failed: tuple[type[Exception], ...] = ()
    if cfg.checkpoint.directory:
        from jzero.checkpoint import CheckpointWriteError

        save_failed = (CheckpointWriteError,)
    try:
        for step in range(first_step, steps + 1):
            watchdog.phase("reading the batch of step {step}", step)
            batch = pending if pending is not None else next(batches)
            own = time.perf_counter() - t_last  # this process's own work before the step
            watchdog.phase("starting step {step}", step)
            pending = None
            m = engine.train_step(batch)
            watchdog.phase("step {step} dispatched, waiting for its results", step)
            loss = float(m["loss"])
            now = time.perf_counter()
            record = {k: float(v) for k, v in m.items()}
            seconds = now - t_last
            record.update(step=step, time=now - t_start)
            record["samples_per_s"] = samples_per_step / max(seconds, 1e-9)
            tokens_per_s = rates.tokens_per_s(seconds)
            if tokens_per_s is not None:
                record["tokens_per_s"] = tokens_per_s
            mfu = rates.mfu(seconds)
            if mfu is not None:
                record["mfu"] = mfu
                if step > first_step:  # the first step's time holds its compilation
                    mfus.append(mfu)
            t_last, done = now, step
            watchdog.finished(step, seconds, own)
            if watchdog.active and step > first_step:
                # Every process's times of the step before (each published them before this
                # step's collectives could finish), and the stragglers among them named.
                times_step, own_s, slow = watchdog.compare(step - 1)
                record.update(process_step_s=times_step, process_own_s=own_s)
                record["process_times_step"] = step - 1
                for warning in slow if main_process else ():
                    logger.warning("%s", warning)
            bad = record.get("nonfinite", 0.0) > 0
            streak = streak + 1 if bad else 0
            skipped += int(record.get("skipped", 0.0) > 0)
            if bad:
                logger.warning(
                    "step %d: the gradients hold inf/NaN (loss %s); %s",
                    step,
                    loss,
                    "the update was skipped" if record.get("skipped") else "the update was applied",
                )
            if evaluating and (step % cfg.train.eval_interval == 0 or step == steps):
                watchdog.phase("evaluating after step {step}", step)
                last_eval = evaluate()
                record["eval_loss"] = last_eval
                logger.info("step %d: eval loss %.4f", step, last_eval)
            metrics_file.write(strict_json(record) + "\n")
            metrics_file.flush()
            if show_bar:
                bar.set_postfix_str(_bar_text(record, peak(), skipped), refresh=False)
            bar.update(1)
            if cfg.steps_per_print and step % cfg.steps_per_print == 0:
                _log_step(step, record)
            if limit and streak >= limit:
                stopped = (
                    f"stopped at step {step}: {streak} consecutive steps had inf/NaN "
                    f"gradients (train.max_consecutive_nonfinite: {limit}). Lower the "
                    "learning rate, check the data, or set skip_nonfinite: true; the "
                    "checkpoints with finite parameters are kept."
                )
                break
            if distributed.any_process(stop.requested):  # all stop after one step
                interrupted = True
                break
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the handler was installed
        interrupted = True
    except save_failed as e:  # max_consecutive_failures periodic saves failed in a row
        checkpoint_error, done = str(e), engine.iteration
    finally:
        bar.close()
        live.close()
        metrics_file.close()
    elapsed = time.perf_counter() - t_start
    if stopped:
        logger.error("jzero: %s", stopped)
    if cfg.checkpoint.directory and checkpoint_error is None:  # on Ctrl-C and SIGTERM too
        watchdog.phase("saving the final checkpoint, step {step}", done)
        checkpoint_error = _final_save(engine, save_failed)
    if checkpoint_error:
        logger.error("jzero: %s", checkpoint_error)
    engine.on_phase = None
    engine.close()  # the monitors flushed; the checkpointer's threads and lock released
    ran = done - (first_step - 1)
    tokens = engine.tokens_per_sample
    summary = {
        "steps": done,
        "interrupted": interrupted,
        "signal": stop.name() if interrupted else None,
        "stopped": stopped,
        "skipped_steps": skipped,
        "final_loss": loss,
        "first_eval_loss": first_eval,
        "eval_loss": last_eval,
        "seconds": round(elapsed, 2),
        "samples_per_s": round(ran * samples_per_step / max(elapsed, 1e-9), 2),
        "tokens_per_s": (
            round(ran * samples_per_step * tokens / max(elapsed, 1e-9), 1) if tokens else None
        ),
        "resumed_from": resumed,
        "stage": engine.plan.stage.stage,
        "devices": engine.plan.data_parallel_size,
        "mesh": {str(k): int(v) for k, v in engine.mesh.shape.items()},
        "model_state_bytes_per_device": state_bytes,
        "host_state_bytes_per_device": host_bytes,
        "peak_bytes_per_device": peak(),
        "mfu": float(np.mean(mfus)) if mfus else None,  # None: the device's peak is unknown
        "metrics": str(log_dir / METRICS),
        "checkpoint_directory": cfg.checkpoint.directory or None,
        "checkpoint_error": checkpoint_error,
        "last_checkpoint": run_dirs.last_checkpoint(cfg),
    }
    return json_safe(summary)


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
         if plan.stage.stage == 3 else "no activation checkpointing")
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
    """One warning when the run ends before the scheduler's warm-up or decay does."""
    sched = engine.config.scheduler
    if sched is None:
        return
    params = dict(sched.params)
    for key, what in (("warmup_num_steps", "warm-up"), ("total_num_steps", "decay")):
        value = params.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and steps < value:
            lr = engine.setup.learning_rate
            at = f" (learning rate {float(lr(steps - 1)):.3g} at the last step)" if lr else ""
            logger.warning(
                "jzero: the run ends at step %d, before its schedule's %s ends "
                "(scheduler.params.%s: %d)%s. Set %s: %d to fit the run, or train on.",
                steps,
                what,
                key,
                value,
                at,
                key,
                steps,
            )
            return
