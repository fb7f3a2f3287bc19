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
import os
import sys
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

    cfg = jzero.load_config(args.config, overrides=args.set or ())
    model_cfg = gpt.GPTConfig.from_dict(dict(cfg.model))
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
    batches = data_lib.BatchIterator(
        train_tokens, engine.train_batch_size, model_cfg.seq_len, cfg.seed
    )
    eval_set = data_lib.eval_batches(
        eval_tokens, engine.train_batch_size, model_cfg.seq_len, cfg.train.eval_batches
    )
    log_dir = Path(cfg.train.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    state_bytes = sum(engine.plan.model_state_bytes().values())
    tokens_per_step = engine.train_batch_size * model_cfg.seq_len
    logger.info("\n%s", engine.describe())
    logger.info(
        "training %d steps, %d tokens a step, model state %s per device",
        steps,
        tokens_per_step,
        _format_bytes(state_bytes),
    )

    def evaluate() -> float:
        return float(sum(float(engine.evaluate(b)) for b in eval_set) / len(eval_set))

    first_eval = evaluate() if cfg.train.eval_interval else None
    if first_eval is not None:
        logger.info("step 0: eval loss %.4f", first_eval)
    last_eval = first_eval
    metrics_file = (log_dir / "metrics.jsonl").open("w")
    bar = tqdm(total=steps, desc="jzero", unit="step", disable=args.quiet, dynamic_ncols=True)
    t_start = time.perf_counter()
    t_last, done, loss = t_start, 0, float("nan")
    interrupted = False
    try:
        for step in range(1, steps + 1):
            m = engine.train_step(batches.next())
            loss = float(m["loss"])
            now = time.perf_counter()
            record = {k: float(v) for k, v in m.items()}
            record.update(
                step=step, time=now - t_start, tokens_per_s=tokens_per_step / (now - t_last)
            )
            t_last, done = now, step
            if cfg.train.eval_interval and (step % cfg.train.eval_interval == 0 or step == steps):
                last_eval = evaluate()
                record["eval_loss"] = last_eval
                logger.info("step %d: eval loss %.4f", step, last_eval)
            metrics_file.write(json.dumps(record) + "\n")
            bar.set_postfix(
                loss=f"{loss:.3f}",
                tok_s=f"{record['tokens_per_s']:,.0f}",
                mem=_format_bytes(state_bytes),
                refresh=False,
            )
            bar.update(1)
            if cfg.steps_per_print and step % cfg.steps_per_print == 0:
                logger.info(
                    "step %d: loss %.4f, grad norm %.3f, lr %.3g",
                    step,
                    loss,
                    record["grad_norm"],
                    record["lr"],
                )
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        metrics_file.close()
    elapsed = time.perf_counter() - t_start
    summary = {
        "steps": done,
        "interrupted": interrupted,
        "final_loss": loss,
        "first_eval_loss": first_eval,
        "eval_loss": last_eval,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(done * tokens_per_step / max(elapsed, 1e-9), 1),
        "stage": engine.plan.stage.stage,
        "devices": engine.plan.num_shards,
        "model_state_bytes_per_device": state_bytes,
        "metrics": str(log_dir / "metrics.jsonl"),
    }
    (log_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(("interrupted: " if interrupted else "done: ") + json.dumps(summary))
    del jax
    return 130 if interrupted else 0


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
    train.set_defaults(func=_train)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jzero`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"jzero: error: {e}", file=sys.stderr)
        return 2


def _main() -> Any:
    sys.exit(main())


if __name__ == "__main__":
    _main()
