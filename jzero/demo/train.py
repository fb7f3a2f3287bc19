"""The ``jzero train`` loop as a library function: :func:`run` trains the built-in GPT.

``run(config)`` does what ``jzero train CONFIG`` does, without argparse: the CLI
(:mod:`jzero.cli`) parses the flags, gives the CPU its virtual devices, calls :func:`run` and
prints the summary it returns.

Decisions:

* The model is the built-in GPT (the ``model`` section), trained as a byte-level language model
  on the ``data`` section's corpus, by default the Python standard library's own source. A
  held-out tail gives an eval loss at step 0, every ``train.eval_interval`` steps and at the
  last step.
* With ``checkpoint.directory`` set, the run resumes from the checkpoint written last (unless
  ``resume=False``), and saves a final checkpoint at the end, also when it was interrupted or
  stopped. Starting fresh into a directory holding an earlier run's checkpoints needs
  ``overwrite=True``; the check runs before any model is built.
* The first SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send before they kill a job)
  stops the loop after the current step, every process after the same step. The run saves and
  returns its summary with ``interrupted`` true and the signal's name (the CLI exits with 128 +
  its number: 130, 143). A further SIGTERM is logged and changes nothing (SLURM signals every
  process of a job, so under a launcher each child gets it twice); a second Ctrl-C quits now
  (the step or the save in flight is abandoned; committed checkpoints stay). The handlers are
  installed once the distributed runtime is up (they replace its SIGTERM handler, which only
  logs), so a signal during set-up stops the run after its first step, and stay until the final
  checkpoint is committed and ``summary.json`` written; only from the main thread.
* ``train.max_consecutive_nonfinite`` steps in a row with inf/NaN gradients stop the run
  (``stopped`` says why; the CLI exits 1).
* **Storage that fails ends the run cleanly** (:mod:`jzero.checkpoint`'s decisions). A periodic
  save that fails (a full disk, a quota, an I/O error) is one error line and training goes on;
  ``checkpoint.max_consecutive_failures`` failed saves in a row stop the run, without a final
  save (the disk would refuse it too), and a final save that fails ends it too: either is one
  error line, ``checkpoint_error`` in the summary (with ``last_checkpoint``, the step a resume
  starts from) and exit status 1. (The limit is found by the save of the step that has just
  run, inside ``train_step``: that step counts in ``steps``, without a ``metrics.jsonl`` line.)
  The summary is written in every case, and a start removes the folders of saves that never
  completed.
* Every step appends a JSON line to ``<train.log_dir>/metrics.jsonl`` and the end writes
  ``summary.json``; both are strict JSON (NaN and infinities are ``null``) and written by
  process 0 only, which alone logs and shows the progress bar. A line holds every metric the
  step returns: with ``model.num_experts`` set, ``moe_aux_loss`` and ``moe_dropped_fraction``
  too, which the ``steps_per_print`` log line shows beside the loss (that loss, and the eval
  loss, include the load-balancing term).
* **The log folder is treated as the checkpoint directory is.** A run that resumes from a
  checkpoint appends to ``metrics.jsonl`` (first dropping the lines of steps after its
  checkpoint, which it trains again) and rewrites ``summary.json``. A run that starts at
  step 1 into a folder holding an earlier run's ``metrics.jsonl`` is refused before any model
  is built, unless ``overwrite=True`` (``--overwrite``), which replaces both files: a second
  ``jzero train`` of one config with another ``--set`` never silently replaces the first's
  metrics. The checkpoint directory may be a folder inside the log folder
  (``runs/zero2/ckpt``): the log folder's check reads only ``metrics.jsonl``, the checkpoint
  directory's only its own folder. The other way round (the log folder is the checkpoint
  directory, or inside it) is refused at the start: the first save would refuse the log files
  in a directory that holds only jzero's checkpoints, after the whole run had trained.
* The progress bar is shown only on a terminal (``progress=True`` and stderr a TTY), with the
  log lines written above it; its tokens/s is the last step's. The summary's ``tokens_per_s``
  is the run's average: the tokens of the steps this run trained over the loop's wall time
  (the evaluations in it, and on an accelerator the first step's compilation, included).
* Where the device's peak FLOP/s is known (:mod:`jzero.profiler`'s table, or
  ``flops_profiler.peak_flops``), each line carries ``mfu`` (the model's FLOPs of a step over
  what the devices could do in its time), the progress bar shows it, and the summary holds the
  mean after the first step; on CPU there is no peak and no MFU.
* The config's monitors (``tensorboard``, ``csv_monitor``, ``wandb``; :mod:`jzero.monitor`)
  get every step's metrics from the engine, with tokens/s, and the eval losses; with an empty
  ``output_path`` they write into ``train.log_dir``.
* JAX's persistent compilation cache is on for the run (``train.compile_cache``; by default
  in a cache folder, ``~/.cache/jzero/compile_cache``, never beside the checkpoints:
  :mod:`jzero.distributed.compile_cache`), so a restarted run loads its programs instead of
  compiling them; the summary counts both. A cache that can't be written is one warning.
* The peak memory per device is the engine's figure (:meth:`jzero.Engine.peak_bytes`, the one
  the monitors' ``peak_bytes`` is): the allocator's on an accelerator; on CPU, where the
  allocator keeps none, the compiled step's peak. A step's tokens/s and MFU are the monitors'
  (:class:`jzero.monitor.StepRates`), over the loop's time between steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from jzero import config as config_lib
from jzero import distributed, monitor
from jzero._util import format_bytes
from jzero.config import Config, load_config
from jzero.demo import data as data_lib
from jzero.demo import gpt
from jzero.engine import Engine, initialize
from jzero.plan import host_state_bytes, model_state_bytes

__all__ = ["ending", "exit_code", "format_summary", "run", "strict_json"]

logger = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


class _StopOnSignal:
    """Stop signals while the run is going, until its final checkpoint is committed.

    The first SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send before they kill a
    job) asks the loop to stop after the current step and save. A further SIGTERM is logged
    and otherwise ignored: SLURM signals every process of a job at its time limit, and under
    ``jzero launch`` each child gets it again from the launcher, so a second SIGTERM is normal
    and must not cost the final checkpoint (the launcher's grace period and SIGKILL are the
    hard stop). A second Ctrl-C means "quit now": it raises ``KeyboardInterrupt``, in the loop
    (the step in flight is abandoned, the final checkpoint is still written) and in the save
    (which is then abandoned; Orbax never commits a half-written step, so the checkpoints
    already on disk stay)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            return
        if signum == signal.SIGINT:  # a second Ctrl-C: quit now
            raise KeyboardInterrupt
        logger.warning(
            "jzero: %s received again; the run still stops after the current step and writes "
            "its final checkpoint (SIGKILL, or a second Ctrl-C, ends it at once)",
            signal.Signals(signum).name,
        )

    @property
    def requested(self) -> bool:
        return self.received is not None

    def name(self) -> str:
        """The signal's name; ``SIGINT`` for a KeyboardInterrupt the handler did not see."""
        return signal.Signals(self.received or signal.SIGINT).name

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``value`` with NaN and infinities as ``null``, as the run writes them.

    Args:
      value: a JSON-serialisable value (a metrics record, the summary).
      **kwargs: passed to ``json.dumps`` (``indent``, ...).
    """
    return json.dumps(_json_safe(value), allow_nan=False, **kwargs)


def ending(summary: Mapping[str, Any]) -> str:
    """How a run ended, the first word of ``jzero train``'s summary: ``failed`` (its
    checkpoints), ``interrupted`` (a signal), ``stopped`` (inf/NaN gradients) or ``done``."""
    if summary.get("checkpoint_error"):
        return "failed"
    if summary["interrupted"]:
        return "interrupted"
    return "stopped" if summary["stopped"] else "done"


def _format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _loss(value: float | None) -> str:
    return "NaN" if value is None else f"{value:.4f}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The few lines ``jzero train`` ends with, on stdout: how the run ended, then its figures,
    each named (the full record is ``summary.json``).

    Args:
      summary: what :func:`run` returned.
    """
    last, resumed = summary["steps"], summary.get("resumed_from")
    first = (resumed or 0) + 1
    ran = last - first + 1
    where = f"ZeRO stage {summary['stage']}, {summary['devices']} devices"
    if ran <= 0:
        what = "nothing trained" + (
            f": checkpoint {resumed} is at or past the last step" if resumed is not None else ""
        )
    else:
        what = f"trained steps {first}-{last} in {_format_seconds(summary['seconds'])}"
        if resumed is not None:
            what += f", resumed from checkpoint {resumed}"
    head = ending(summary)
    if head == "interrupted":
        what = f"{summary.get('signal') or 'SIGINT'} after step {last}; {what}"
    lines = [f"{head}: {what} ({where})"]
    for reason in (summary["stopped"], summary.get("checkpoint_error")):
        if reason:
            lines.append(f"  why:        {reason}")
    if ran > 0:
        loss = f"{_loss(summary['final_loss'])} at step {last} (training batch)"
        if summary.get("eval_loss") is not None or summary.get("first_eval_loss") is not None:
            loss += f"; eval loss {_loss(summary['eval_loss'])}"
            loss += f" ({_loss(summary['first_eval_loss'])} at step {first - 1})"
        lines.append(f"  loss:       {loss}")
        speed = (
            f"{summary['tokens_per_s']:,.0f} tokens/s, this run's average ({ran} step(s); "
            "evaluations and compiling included)"
        )
        if summary.get("mfu") is not None:
            speed += f"; MFU {100 * summary['mfu']:.1f}% (mean after the first step)"
        lines.append(f"  throughput: {speed}")
        if summary.get("skipped_steps"):
            lines.append(
                f"  skipped:    {summary['skipped_steps']} update(s), for inf/NaN gradients"
            )
    lines.append(
        f"  memory:     peak {format_bytes(summary['peak_bytes_per_device'])} per device "
        f"(model state {format_bytes(summary['model_state_bytes_per_device'])})"
    )
    metrics = Path(summary["metrics"])
    lines.append(f"  logs:       {metrics} (a line per step), {metrics.parent / SUMMARY}")
    directory, step = summary.get("checkpoint_directory"), summary.get("last_checkpoint")
    if not directory:
        saved = "none (the config sets no checkpoint.directory)"
    elif step is None:
        saved = f"none committed in {directory}"
    else:
        saved = f"step {step} in {directory}"
    lines.append(f"  checkpoint: {saved}")
    return "\n".join(lines)


def exit_code(summary: Mapping[str, Any]) -> int:
    """The exit status ``jzero train`` ends with for a summary :func:`run` returned.

    Returns:
      1 for a run whose checkpoints failed (``checkpoint_error``: its final save, or too many
      saves in a row); 128 + the signal's number for an interrupted run (130 for Ctrl-C, 143
      for SIGTERM), as a shell reports a process the signal ended; 1 for a run stopped by
      inf/NaN gradients; else 0.
    """
    if summary.get("checkpoint_error"):
        return 1
    if summary["interrupted"]:
        return 128 + int(signal.Signals[summary.get("signal") or "SIGINT"])
    return 1 if summary["stopped"] else 0


def _peak_bytes(engine: Engine, batches: data_lib.BatchIterator) -> Callable[[], int]:
    """The measured peak memory per device, the engine's figure (:meth:`Engine.peak_bytes`:
    the allocator's on an accelerator, else the compiled step's), measured on a real batch
    (the data position is put back); 0 where the allocator names none."""
    position = batches.state()
    probe = batches.next()
    batches.restore(position)
    measured = engine.peak_bytes(probe)
    return lambda: measured() or 0


def _bar_text(record: Mapping[str, float], peak: int, skipped: int) -> str:
    """The progress bar's figures after a step: its loss, its own tokens/s (the last step's
    rate, not the run's average), the peak memory per device, MFU, skipped updates."""
    parts = [
        f"loss {record['loss']:.3f}",
        f"{record['tokens_per_s']:,.0f} tok/s last step",
        f"peak {format_bytes(peak)}/device",
    ]
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if skipped:  # skipped steps are never silent
        parts.append(f"{skipped} skipped")
    return ", ".join(parts)


def _check_checkpoint_directory(cfg: Config, *, fresh: bool) -> None:
    """Before training: the checkpoint directory is jzero's, and a fresh start into an earlier
    run's steps was asked for explicitly (``--overwrite``)."""
    from jzero.checkpoint import dirs  # Orbax is needed only for checkpoints

    directory = Path(cfg.checkpoint.directory)
    dirs.check_ownership(directory)
    existing = dirs.write_order(directory)
    if fresh and existing and not cfg.checkpoint.overwrite:
        raise ValueError(
            f"--no-resume, but the checkpoint directory {str(directory)!r} holds the checkpoints "
            f"of an earlier run (steps {existing}, the latest {existing[-1]}). Pass --overwrite "
            "to replace them with this run's, set another checkpoint.directory, or drop "
            "--no-resume to continue that run."
        )


def _check_apart(cfg: Config) -> None:
    """Before training: the log folder is not the checkpoint directory, nor inside it."""
    log_dir, ckpt = Path(cfg.train.log_dir), Path(cfg.checkpoint.directory)
    if log_dir.resolve() == ckpt.resolve() or ckpt.resolve() in log_dir.resolve().parents:
        raise ValueError(
            f"train.log_dir ({str(log_dir)!r}) is the checkpoint directory or inside it "
            f"({str(ckpt)!r}), which holds jzero's checkpoints only: the first save would "
            "refuse the log files there. Give the checkpoints a folder of their own, e.g. "
            f"--set checkpoint.directory={log_dir / 'ckpt'}."
        )


def _check_log_dir(cfg: Config, *, fresh: bool) -> None:
    """Before training: a run that starts fresh (no checkpoint to resume from) writes into a
    log folder without an earlier run's ``metrics.jsonl``, unless ``--overwrite`` says to
    replace it."""
    log_dir = Path(cfg.train.log_dir)
    metrics = log_dir / METRICS
    if not metrics.is_file() or cfg.checkpoint.overwrite:
        return
    checkpoint = _last_checkpoint(cfg)
    if not fresh and checkpoint is not None:  # the same run goes on: its lines are appended
        return
    last = _last_logged_step(metrics)
    earlier = f" (its last line is step {last})" if last is not None else ""
    # (--no-resume beside a checkpoint was refused before, by the checkpoint directory's check)
    why = (
        f"there is no checkpoint to resume from in {str(cfg.checkpoint.directory)!r}"
        if cfg.checkpoint.directory
        else "the config sets no checkpoint.directory to resume from"
    )
    raise ValueError(
        f"The log folder {str(log_dir)!r} (train.log_dir) holds the {METRICS} of an earlier "
        f"run{earlier}, and this run starts from step 1 ({why}): it would replace that run's "
        f"{METRICS} and {SUMMARY}. Pass --overwrite to replace them, or give this run a "
        f"folder of its own, e.g. --set train.log_dir={log_dir}-2."
    )


def _last_logged_step(metrics: Path) -> int | None:
    """The step of the last line of a ``metrics.jsonl`` (``None`` if unreadable)."""
    try:
        lines = metrics.read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep_metrics_until(metrics: Path, step: int) -> None:
    """A resumed run's ``metrics.jsonl`` without the lines of steps after its checkpoint:
    they ran after the checkpoint was saved, and the resumed run trains them again."""
    if not metrics.is_file():
        return
    kept, dropped = [], []
    for line in metrics.read_text().splitlines():
        try:
            logged = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            logged = None
        (dropped if logged is not None and logged > step else kept).append((line, logged))
    if dropped:
        metrics.write_text("".join(line + "\n" for line, _ in kept))
        steps = [logged for _, logged in dropped]
        logger.info(
            "%s: dropped the lines of steps %d-%d, which ran after checkpoint %d (this run "
            "trains them again)",
            metrics,
            min(steps),
            max(steps),
            step,
        )


def _last_checkpoint(cfg: Config) -> int | None:
    """The last committed step in ``checkpoint.directory`` (``None``: none, or no directory)."""
    if not cfg.checkpoint.directory:
        return None
    from jzero.checkpoint import latest_step

    return latest_step(cfg.checkpoint.directory)


def _resume(engine: Engine, cfg: Config, *, fresh: bool) -> int | None:
    """Restores the latest checkpoint unless the run starts fresh; the step restored."""
    if fresh:
        return None
    resumed = engine.latest_checkpoint()
    if resumed is not None:
        engine.restore(resumed)
        logger.info("resumed from checkpoint %d in %s", resumed, cfg.checkpoint.directory)
    return resumed


def run(
    config: str | os.PathLike | Mapping[str, Any] | Config,
    *,
    overrides: Sequence[str] = (),
    steps: int | None = None,
    resume: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Trains the built-in GPT as ``jzero train`` does, and returns the run's summary.

    Call it before anything else touches JAX devices in this process: it starts
    ``jax.distributed`` from the config's ``distributed`` section (or the environment) first.

    Args:
      config: a YAML or JSON file, a mapping with DeepSpeed's keys plus jzero's, or a
        ``Config`` (see :func:`jzero.load_config`).
      overrides: ``"dotted.key=value"`` strings applied on top (``jzero train --set``).
      steps: the last step to train to; ``None`` for ``train.steps``. A resumed run continues
        from the step after its checkpoint.
      resume: continue from the latest checkpoint in ``checkpoint.directory``. ``False``
        starts fresh, and is refused when the directory holds an earlier run's checkpoints
        unless ``overwrite`` is given too.
      overwrite: start fresh and replace an earlier run's checkpoints in
        ``checkpoint.directory`` (deleted once this run's first checkpoint is committed) and
        its ``metrics.jsonl`` and ``summary.json`` in ``train.log_dir``; implies
        ``resume=False``.
      progress: show a progress bar (on process 0, when stderr is a terminal).

    Returns:
      The summary, as written to ``<train.log_dir>/summary.json`` (NaN as ``None``):
      ``steps`` (the last step trained), ``interrupted`` and ``signal`` (the signal that
      stopped the run, or ``None``), ``stopped`` (why inf/NaN gradients stopped it, or
      ``None``), ``skipped_steps``, ``final_loss``, ``first_eval_loss``, ``eval_loss``,
      ``seconds``, ``tokens_per_s``, ``resumed_from``, ``stage``, ``devices``,
      ``model_state_bytes_per_device``, ``host_state_bytes_per_device``,
      ``peak_bytes_per_device``, ``metrics`` (the path of ``metrics.jsonl``),
      ``checkpoint_directory`` (``checkpoint.directory``, or ``None``),
      ``compile_cache`` (its directory, or ``None``: ``train.compile_cache``), ``compiles``
      (the programs compiled), ``cache_hits`` (the programs loaded from the cache instead)
      and ``cache_misses`` (the programs compiled and written to it), ``checkpoint_error``
      (why the checkpoints failed the run: its final save, or
      ``checkpoint.max_consecutive_failures`` saves in a row; else ``None``) and
      ``last_checkpoint`` (the last committed step, the one a resume starts from).

    Raises:
      ConfigError: a bad config (a ``ValueError``, as are the refusals above, that of a
        fresh start into a ``train.log_dir`` holding an earlier run's ``metrics.jsonl``, and
        that of a ``train.log_dir`` in ``checkpoint.directory``).
    """
    all_overrides = [*overrides, *(["checkpoint.overwrite=true"] if overwrite else [])]
    cfg = load_config(config, overrides=all_overrides)
    fresh = not resume or overwrite
    if cfg.checkpoint.directory:
        _check_apart(cfg)
        _check_checkpoint_directory(cfg, fresh=fresh)
    _check_log_dir(cfg, fresh=fresh)
    distributed.init_distributed(cfg.distributed)  # before any JAX call
    if cfg.checkpoint.directory and distributed.is_main_process():
        from jzero.checkpoint import dirs

        dirs.clean_unfinished(cfg.checkpoint.directory)  # saves a killed run left unfinished
    # From here on a stop signal ends the run after a step with a final checkpoint; this
    # replaces the SIGTERM handler of JAX's distributed runtime (its preemption notifier, which
    # only logs), so a signal during set-up is not swallowed either.
    stop = _StopOnSignal()
    cache = distributed.compile_cache_dir(cfg.train.compile_cache)
    uncache = distributed.enable_compile_cache(cache) if cache is not None else None
    try:
        with distributed.CompileCounter() as compiled:
            summary = _train(cfg, stop, steps=steps, fresh=fresh, progress=progress)
        summary["compile_cache"] = None if cache is None else str(cache)
        summary.update(compiled.as_dict())
        if distributed.is_main_process():
            (Path(cfg.train.log_dir) / SUMMARY).write_text(strict_json(summary, indent=2) + "\n")
        return summary
    finally:
        stop.restore()
        if uncache is not None:  # this process's later programs are not the run's
            uncache()


def _batch_shapes(cfg: Config, model_cfg: Any, rows: int | None = None) -> Any:
    """The shapes of this process's rows of a global batch (``rows``; default the config's)."""
    rows = (rows or cfg.train_batch_size) // jax.process_count()
    return {"tokens": jax.ShapeDtypeStruct((rows, model_cfg.seq_len + 1), np.int32)}


def _train(
    cfg: Config, stop: _StopOnSignal, *, steps: int | None, fresh: bool, progress: bool
) -> dict[str, Any]:
    """:func:`run` after the runtime has started, with ``stop`` watching for signals."""
    main_process = distributed.is_main_process()  # only process 0 logs and writes files
    if not main_process:
        logging.getLogger("jzero").setLevel(logging.WARNING)
    model_cfg = gpt.config_for(cfg)
    steps = steps if steps is not None else cfg.train.steps
    # The built-in GPT is a Flax NNX module, built directly into its shards.
    if config_lib.batch_from_first_batch(cfg):
        raise config_lib.ConfigError(
            "The config sets no batch size (train_batch_size and train_micro_batch_size_per_gpu "
            'are missing or "auto"), but jzero train builds the data from them (there is no '
            "first batch to take them from); set train_micro_batch_size_per_gpu (the batch per "
            "device, e.g. --set train_micro_batch_size_per_gpu=8) or train_batch_size (the "
            "global batch)."
        )
    model = {"model": lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(cfg.seed)), "config": cfg}
    if cfg.train_batch_size:  # the batch's shapes known: the state made in its final layout
        engine = initialize(loss_fn=gpt.nnx_loss_fn, batch=_batch_shapes(cfg, model_cfg), **model)
    else:  # the global batch follows from the plan's data-parallel size
        engine = initialize(loss_fn=gpt.nnx_loss_fn, **model)
        engine.resolve(_batch_shapes(cfg, model_cfg, engine.train_batch_size))
    rows = engine.train_batch_size or cfg.train_batch_size  # an "auto" layout: the config's
    source = dict(cfg.data)
    tokens = data_lib.load_tokens(
        source.get("source", "stdlib"), source.get("path"), source.get("max_bytes")
    )
    train_tokens, eval_tokens = data_lib.split_train_eval(tokens, source.get("eval_fraction", 0.05))
    rank = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    batches = data_lib.BatchIterator(train_tokens, rows, model_cfg.seq_len, cfg.seed, **rank)
    eval_set = data_lib.eval_batches(
        eval_tokens, rows, model_cfg.seq_len, cfg.train.eval_batches, **rank
    )
    engine.data_iterator = batches  # checkpoints carry the data position
    resumed = None
    if cfg.checkpoint.directory:
        resumed = _resume(engine, cfg, fresh=fresh)
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
    engine.monitor_dir = str(log_dir)  # monitors without an output_path write beside metrics
    engine.tokens_per_sample = model_cfg.seq_len
    peak = _peak_bytes(engine, batches)  # on CPU compiles the step: the plan is final after
    by_category = model_state_bytes(engine.plan)
    on_disk = 0
    if cfg.zero_optimization.offload_optimizer.device == "nvme":  # between steps, in files
        on_disk = by_category.pop("opt_state", 0) + by_category.pop("master_params", 0)
        if cfg.zero_optimization.offload_param.device == "nvme":
            on_disk += by_category.pop("params", 0)
    state_bytes = sum(by_category.values())
    host_bytes = sum(host_state_bytes(engine.plan).values())
    tokens_per_step = engine.train_batch_size * model_cfg.seq_len
    logger.info("\n%s", engine.describe())
    logger.info(
        "training %d steps%s, %d tokens a step, per device: model state %s in device memory "
        "(%s in host memory%s), peak %s",
        steps - first_step + 1,
        f" ({first_step} to {steps})" if resumed is not None else "",
        tokens_per_step,
        format_bytes(state_bytes),
        format_bytes(host_bytes),
        f", {format_bytes(on_disk)} on NVMe" if on_disk else "",
        format_bytes(peak()),
    )

    def evaluate() -> float:
        loss = float(sum(float(engine.evaluate(b)) for b in eval_set) / len(eval_set))
        samples = engine.iteration * engine.train_batch_size  # the monitors' x-axis
        engine.monitor.write_events([(monitor.tag("eval_loss"), loss, samples)])
        return loss

    first_eval = evaluate() if cfg.train.eval_interval else None
    if first_eval is not None:
        logger.info("step %d: eval loss %.4f", first_step - 1, first_eval)
    last_eval = first_eval
    metrics_path = log_dir / METRICS if main_process else Path(os.devnull)
    if resumed is not None and main_process:
        _keep_metrics_until(metrics_path, resumed)
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
    # A step's tokens/s, and its MFU where the device's peak is known (jzero.profiler): the
    # model's FLOPs of a step over what the devices could do in the step's time; the monitors'
    # rates, their FLOPs traced once (jzero.monitor.step_rates).
    shape = (engine.train_batch_size, model_cfg.seq_len + 1)
    rates = monitor.step_rates(engine, {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)})
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
            m = engine.train_step(batches.next())
            loss = float(m["loss"])
            now = time.perf_counter()
            record = {k: float(v) for k, v in m.items()}
            seconds = now - t_last
            record.update(step=step, time=now - t_start, tokens_per_s=rates.tokens_per_s(seconds))
            mfu = rates.mfu(seconds)
            if mfu is not None:
                record["mfu"] = mfu
                if step > first_step:  # the first step's time holds its compilation
                    mfus.append(mfu)
            t_last, done = now, step
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
            if cfg.train.eval_interval and (step % cfg.train.eval_interval == 0 or step == steps):
                last_eval = evaluate()
                record["eval_loss"] = last_eval
                logger.info("step %d: eval loss %.4f", step, last_eval)
            metrics_file.write(strict_json(record) + "\n")
            metrics_file.flush()
            if show_bar:
                bar.set_postfix_str(_bar_text(record, peak(), skipped), refresh=False)
            bar.update(1)
            if cfg.steps_per_print and step % cfg.steps_per_print == 0:
                lr = f", lr {record['lr']:.3g}" if "lr" in record else ""
                moe = (  # an MoE model's load-balancing loss (in the loss) and capacity drops
                    f", moe aux {record['moe_aux_loss']:.4f}, dropped "
                    f"{100 * record.get('moe_dropped_fraction', 0.0):.1f}%"
                    if "moe_aux_loss" in record
                    else ""
                )
                logger.info(
                    "step %d: loss %.4f, grad norm %.3f%s%s",
                    step,
                    loss,
                    record["grad_norm"],
                    lr,
                    moe,
                )
            if limit and streak >= limit:
                stopped = (
                    f"stopped at step {step}: {streak} consecutive steps had inf/NaN "
                    f"gradients (train.max_consecutive_nonfinite: {limit}). Lower the "
                    "learning rate, check the data, or set skip_nonfinite: true; the "
                    "checkpoints with finite parameters are kept."
                )
                break
            if distributed.any_process(stop.requested):  # all stop after the same step
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
        try:
            saved = engine.save()
            engine.wait_until_finished()  # committed, or its failure raised
            if saved:
                where = cfg.checkpoint.directory
                logger.info("checkpoint %d written to %s", engine.iteration, where)
        except save_failed as e:
            checkpoint_error = str(e)
    if checkpoint_error:
        logger.error("jzero: %s", checkpoint_error)
    engine.close()  # the monitors flushed; the checkpointer's threads and lock released
    ran = done - (first_step - 1)
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
        "tokens_per_s": round(ran * tokens_per_step / max(elapsed, 1e-9), 1),
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
        "last_checkpoint": _last_checkpoint(cfg),
    }
    return _json_safe(summary)  # as written (by run, with the compilations): NaN is None
