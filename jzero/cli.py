"""The ``jzero`` command: ``jzero train CONFIG [--set key=value ...]``.

Decisions:

* With no accelerator, the CLI asks JAX for 8 virtual CPU devices before anything touches a
  backend, so every stage shards for real on a laptop (``--cpu-devices`` changes the count).
* ``jzero train`` trains the built-in GPT (``model`` section) as a byte-level language model on
  the ``data`` section's corpus, by default the Python standard library's own source. A held-out
  tail gives an eval loss every ``train.eval_interval`` steps.
* A user's mistake (a bad config, a missing file) exits with status 2 and one message, never a
  traceback. Ctrl-C stops after the current step and prints the summary.
* Progress goes to a tqdm bar; every ``steps_per_print`` steps a log line; every step a JSON line
  in ``<train.log_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("jzero")


def _use_virtual_cpu_devices(count: int) -> None:
    """Gives the CPU backend ``count`` devices unless the user already chose a count."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend is already up; keep what it has
        pass


class _StopOnSignal:
    """The first Ctrl-C (SIGINT) or SIGTERM (what SLURM and Kubernetes send before they kill a
    job) asks the loop to stop after the current step and save; a second one stops now."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # the second one
            raise KeyboardInterrupt
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended."""
        return 128 + int(self.received or signal.SIGINT)

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


def _dumps(value: Any, **kwargs: Any) -> str:
    return json.dumps(_json_safe(value), allow_nan=False, **kwargs)


def _peak_bytes(engine: Any, batches: Any) -> Any:
    """The measured peak memory per device: the allocator's figure on an accelerator, else
    (CPU) the compiled step's peak from ``memory_analysis()``, computed once."""
    import jax

    device = jax.local_devices()[0]
    if device.memory_stats() is not None:
        return lambda: device.memory_stats().get("peak_bytes_in_use", 0)
    position = batches.state()
    probe = batches.next()  # a real batch to compile with; the data position is put back
    batches.restore(position)
    compiled = engine.memory_report(probe).rows[0].peak
    return lambda: compiled


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _train(args: argparse.Namespace) -> int:
    _use_virtual_cpu_devices(args.cpu_devices)
    import jax
    from tqdm import tqdm

    import jzero
    from jzero import data as data_lib
    from jzero.models import gpt

    overrides = [*(args.set or ()), *(["checkpoint.overwrite=true"] if args.overwrite else [])]
    cfg = jzero.load_config(args.config, overrides=overrides)
    if cfg.checkpoint.directory:
        _check_checkpoint_directory(cfg, fresh=args.no_resume or args.overwrite)
    from jzero import distributed

    distributed.init_distributed(cfg.distributed)  # before any JAX call
    main_process = distributed.is_main_process()  # only process 0 logs and writes files
    if not main_process:
        logger.setLevel(logging.WARNING)
    model_cfg = gpt.config_for(cfg)
    steps = args.steps if args.steps is not None else cfg.train.steps
    from flax import nnx

    # The built-in GPT is a Flax NNX module, built directly into its shards.
    engine = jzero.initialize(
        model=lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(cfg.seed)),
        loss_fn=gpt.nnx_loss_fn,
        config=cfg,
    )
    source = dict(cfg.data)
    tokens = data_lib.load_tokens(
        source.get("source", "stdlib"), source.get("path"), source.get("max_bytes")
    )
    train_tokens, eval_tokens = data_lib.split_train_eval(tokens, source.get("eval_fraction", 0.05))
    rank = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    batches = data_lib.BatchIterator(
        train_tokens, engine.train_batch_size, model_cfg.seq_len, cfg.seed, **rank
    )
    eval_set = data_lib.eval_batches(
        eval_tokens, engine.train_batch_size, model_cfg.seq_len, cfg.train.eval_batches, **rank
    )
    engine.data_iterator = batches  # checkpoints carry the data position
    resumed = None
    if cfg.checkpoint.directory:
        resumed = _resume(engine, cfg, fresh=args.no_resume or args.overwrite)
    first_step = engine.iteration + 1
    log_dir = Path(cfg.train.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    state_bytes = sum(engine.plan.model_state_bytes().values())
    host_bytes = sum(engine.plan.host_state_bytes().values())
    peak = _peak_bytes(engine, batches)
    tokens_per_step = engine.train_batch_size * model_cfg.seq_len
    logger.info("\n%s", engine.describe())
    logger.info(
        "training %d steps, %d tokens a step, per device: model state %s in device memory "
        "(%s in host memory), peak %s",
        steps,
        tokens_per_step,
        _format_bytes(state_bytes),
        _format_bytes(host_bytes),
        _format_bytes(peak()),
    )

    def evaluate() -> float:
        return float(sum(float(engine.evaluate(b)) for b in eval_set) / len(eval_set))

    first_eval = evaluate() if cfg.train.eval_interval else None
    if first_eval is not None:
        logger.info("step 0: eval loss %.4f", first_eval)
    last_eval = first_eval
    metrics_path = log_dir / "metrics.jsonl" if main_process else Path(os.devnull)
    metrics_file = metrics_path.open("a" if resumed is not None else "w")
    bar = tqdm(
        total=steps,
        initial=first_step - 1,
        desc="jzero",
        unit="step",
        disable=args.quiet or not main_process,
        dynamic_ncols=True,
    )
    t_start = time.perf_counter()
    t_last, done, loss = t_start, first_step - 1, float("nan")
    interrupted, stopped = False, None
    limit = cfg.train.max_consecutive_nonfinite
    streak, skipped = 0, 0
    stop = _StopOnSignal()
    try:
        for step in range(first_step, steps + 1):
            m = engine.train_step(batches.next())
            loss = float(m["loss"])
            now = time.perf_counter()
            record = {k: float(v) for k, v in m.items()}
            record.update(
                step=step, time=now - t_start, tokens_per_s=tokens_per_step / (now - t_last)
            )
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
            metrics_file.write(_dumps(record) + "\n")
            metrics_file.flush()
            postfix = {
                "loss": f"{loss:.3f}",
                "tok_s": f"{record['tokens_per_s']:,.0f}",
                "peak": _format_bytes(peak()),
            }
            if skipped:  # skipped steps are never silent
                postfix["skipped"] = skipped
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if cfg.steps_per_print and step % cfg.steps_per_print == 0:
                lr = f", lr {record['lr']:.3g}" if "lr" in record else ""
                logger.info(
                    "step %d: loss %.4f, grad norm %.3f%s", step, loss, record["grad_norm"], lr
                )
            if limit and streak >= limit:
                stopped = (
                    f"stopped at step {step}: {streak} consecutive steps had inf/NaN gradients "
                    f"(train.max_consecutive_nonfinite: {limit}). Lower the learning rate, check "
                    "the data, or set skip_nonfinite: true; the checkpoints with finite "
                    "parameters are kept."
                )
                break
            if distributed.any_process(stop.requested):  # all stop after the same step
                interrupted = True
                break
    except KeyboardInterrupt:  # a second signal, or one before the handler was installed
        interrupted = True
    finally:
        stop.restore()
        bar.close()
        metrics_file.close()
    elapsed = time.perf_counter() - t_start
    if stopped:
        logger.error("jzero: %s", stopped)
    if cfg.checkpoint.directory:  # a final checkpoint, on Ctrl-C and SIGTERM too
        if engine.save():
            logger.info("checkpoint %d written to %s", engine.iteration, cfg.checkpoint.directory)
        engine.close()
    ran = done - (first_step - 1)
    summary = {
        "steps": done,
        "interrupted": interrupted,
        "stopped": stopped,
        "skipped_steps": skipped,
        "final_loss": loss,
        "first_eval_loss": first_eval,
        "eval_loss": last_eval,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(ran * tokens_per_step / max(elapsed, 1e-9), 1),
        "resumed_from": resumed,
        "stage": engine.plan.stage.stage,
        "devices": engine.plan.num_shards,
        "model_state_bytes_per_device": state_bytes,
        "host_state_bytes_per_device": host_bytes,
        "peak_bytes_per_device": peak(),
        "metrics": str(log_dir / "metrics.jsonl"),
    }
    if main_process:
        (log_dir / "summary.json").write_text(_dumps(summary, indent=2) + "\n")
        word = "interrupted: " if interrupted else "stopped: " if stopped else "done: "
        print(word + _dumps(summary))
    del jax
    if interrupted:
        return stop.exit_code()
    return 1 if stopped else 0


def _check_checkpoint_directory(cfg: Any, *, fresh: bool) -> None:
    """Before training: the checkpoint directory is jzero's, and a fresh start into an earlier
    run's steps was asked for explicitly (``--overwrite``)."""
    from jzero import checkpoint_dir

    directory = Path(cfg.checkpoint.directory)
    checkpoint_dir.check_ownership(directory)
    existing = checkpoint_dir.write_order(directory)
    if fresh and existing and not cfg.checkpoint.overwrite:
        raise ValueError(
            f"--no-resume, but the checkpoint directory {str(directory)!r} holds the checkpoints "
            f"of an earlier run (steps {existing}, the latest {existing[-1]}). Pass --overwrite "
            "to replace them with this run's, set another checkpoint.directory, or drop "
            "--no-resume to continue that run."
        )


def _resume(engine: Any, cfg: Any, *, fresh: bool) -> int | None:
    """Restores the latest checkpoint unless the run starts fresh; the step restored."""
    if fresh:
        return None
    resumed = engine.latest_checkpoint()
    if resumed is not None:
        engine.restore(resumed)
        logger.info("resumed from checkpoint %d in %s", resumed, cfg.checkpoint.directory)
    return resumed


def build_parser() -> argparse.ArgumentParser:
    """The ``jzero`` argument parser."""
    ap = argparse.ArgumentParser(prog="jzero", description="DeepSpeed's ZeRO for JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train the built-in GPT from a config file")
    train.add_argument("config", help="a YAML or JSON config (DeepSpeed keys plus jzero's)")
    train.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set zero_optimization.stage=3 (repeatable)",
    )
    train.add_argument("--steps", type=int, help="override train.steps")
    train.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="virtual CPU devices when there is no accelerator (default 8)",
    )
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument(
        "--no-resume",
        action="store_true",
        help="start fresh; refused when checkpoint.directory holds an earlier run's checkpoints "
        "unless --overwrite is given too",
    )
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh and replace the checkpoints of an earlier run in checkpoint.directory "
        "(deleted once this run's first checkpoint is committed); implies --no-resume",
    )
    train.set_defaults(func=_train)
    from jzero import cli_checkpoint, cli_memory, launch

    cli_checkpoint.add_commands(sub)
    cli_memory.add_commands(sub)
    launch.add_commands(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jzero`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from jzero.checkpoint_dir import CheckpointWriteError

    try:
        return int(args.func(args))
    except CheckpointWriteError as e:  # the disk, not the config: not a usage error
        print(f"jzero: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"jzero: error: {e}", file=sys.stderr)
        return 2


def _main() -> Any:
    sys.exit(main())


if __name__ == "__main__":
    _main()
