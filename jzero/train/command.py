"""``jzero train CONFIG`` as a library function: :func:`run` builds the model (the built-in GPT
or a user's entry point), the data and the engine from a config, then trains them with
:func:`jzero.fit`.

Decisions:

* **Any model.** ``model.entry`` (or ``--model``, :mod:`jzero.train.entry`) names a user's
  function; without one the ``model`` section is the built-in GPT's, and the log says so.
* **The data** is the config's ``data`` section (:mod:`jzero.data`): token rows of
  ``seq_len + 1``, the sequence length the model section's ``seq_len`` (or ``data.seq_len``).
* **Hugging Face's ``"auto"`` values** in the ``optimizer`` and ``scheduler`` sections are
  filled from the run's own (the ``train`` section's ``learning_rate``, ``warmup_steps``,
  ``weight_decay`` and ``steps``; AdamW's betas (0.9, 0.999) and eps 1e-8), as the Trainer
  fills them from its arguments; one line lists them. A batch left to the first batch takes
  ``train.micro_batch_size`` per device.
* **A resumed run keeps its global batch** at another device count, as DeepSpeed's elasticity
  does: the micro-batch stays and the accumulation steps change where they can, else the
  micro-batch changes; one line says so. Where no split fits, the run stops with the device
  counts that would; ``--set train_batch_size=...`` (or a micro-batch or accumulation steps)
  decides instead.
* JAX's persistent compilation cache is on for the run (``train.compile_cache``,
  :mod:`jzero.distributed.compile_cache`); the summary counts the programs compiled and loaded.
* The checks of the folders run before any model is built, and the stop signals are watched
  from the moment the distributed runtime is up, so a signal during set-up stops the run after
  its first step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jzero import config as config_lib
from jzero import distributed
from jzero.config import Config, load_config
from jzero.engine import Engine, initialize
from jzero.train import entry, run_dirs, signals
from jzero.train.loop import fit
from jzero.train.summary import SUMMARY, strict_json

__all__ = ["build_engine", "data_loaders", "elastic_split", "model_args", "run"]

logger = logging.getLogger(__name__)

_BATCH = ("tokens", "segment_ids", "positions")  # a jzero.data batch's arrays
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def run(
    config: str | os.PathLike | Mapping[str, Any] | Config,
    *,
    overrides: Sequence[str] = (),
    steps: int | None = None,
    resume: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    model: str | None = None,
) -> dict[str, Any]:
    """Trains a model as ``jzero train`` does, and returns the run's summary.

    Call it before anything else touches JAX devices in this process: it starts
    ``jax.distributed`` from the config's ``distributed`` section (or the environment) first.

    Args:
      config: a YAML or JSON file, a mapping with DeepSpeed's keys plus jzero's, or a
        ``Config`` (see :func:`jzero.load_config`).
      overrides: ``"dotted.key=value"`` strings applied on top (``jzero train --set``).
      steps: the last step to train to; ``None`` for ``train.steps``.
      resume: continue from the latest checkpoint in ``checkpoint.directory``. ``False``
        starts fresh, and is refused when the directory holds an earlier run's checkpoints
        unless ``overwrite`` is given too.
      overwrite: start fresh and replace an earlier run's checkpoints and its
        ``metrics.jsonl`` and ``summary.json``; implies ``resume=False``.
      progress: show a progress bar (on process 0, when stderr is a terminal).
      model: a model entry point, ``package.module:function`` or ``file.py:function``
        (``--model``; else the config's ``model.entry``, else the built-in GPT).

    Returns:
      :func:`jzero.fit`'s summary, with ``compile_cache``, ``compiles``, ``cache_hits`` and
      ``cache_misses``.

    Raises:
      ConfigError: a bad config (a ``ValueError``, as are the refusals of :func:`jzero.fit`,
        a bad entry point and bad data).
    """
    extra = ["checkpoint.overwrite=true"] if overwrite else []
    if model is not None:
        extra.append(f"model.entry={model}")
    given = [*overrides, *extra]
    cfg = load_config(config, overrides=given)
    filled = _fill_auto(cfg, steps)
    if filled:
        logger.info('jzero train: filled the config\'s "auto" values: %s', ", ".join(filled))
        given = [*given, *filled]
        cfg = load_config(config, overrides=given)
    fresh = not resume or overwrite
    if cfg.checkpoint.directory:
        run_dirs.check_apart(cfg)
        run_dirs.check_checkpoint_directory(cfg, fresh=fresh)
    run_dirs.check_log_dir(cfg, fresh=fresh)
    distributed.init_distributed(cfg.distributed)  # before any JAX call
    # From here on a stop signal ends the run after a step with a final checkpoint; this
    # replaces the SIGTERM handler of JAX's distributed runtime (which only logs).
    with signals.watching():
        cache = distributed.compile_cache_dir(cfg.train.compile_cache)
        uncache = distributed.enable_compile_cache(cache) if cache is not None else None
        try:
            with distributed.CompileCounter() as compiled:
                explicit = any(o.split("=", 1)[0].strip() in _BATCH_KEYS for o in overrides)
                engine, seq_len, vocab = _engine(config, cfg, given, fresh=fresh, keep=not explicit)
                loaders = data_loaders(engine, seq_len, vocab)
                summary = fit(
                    engine,
                    loaders.train,
                    eval_data=loaders.eval or None,
                    steps=steps,
                    resume=not fresh,
                    progress=progress,
                )
        finally:
            if uncache is not None:  # this process's later programs are not the run's
                uncache()
    summary["compile_cache"] = None if cache is None else str(cache)
    summary.update(compiled.as_dict())
    if distributed.is_main_process():
        (Path(cfg.train.log_dir) / SUMMARY).write_text(strict_json(summary, indent=2) + "\n")
    return summary


# -- "auto" values -------------------------------------------------------------------------------


def _fill_auto(cfg: Config, steps: int | None) -> list[str]:
    """Overrides for the ``"auto"`` values ``jzero train`` fills from its own (see the
    module's decisions)."""
    train = cfg.train
    values = {
        "lr": train.learning_rate,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": train.weight_decay,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": train.learning_rate,
        "warmup_num_steps": max(train.warmup_steps, 1),  # DeepSpeed's WarmupLR needs one
        "total_num_steps": steps if steps is not None else train.steps,
    }
    filled = []
    for key in config_lib.auto_keys(cfg.optimizer, "optimizer") + config_lib.auto_keys(
        cfg.scheduler, "scheduler"
    ):
        name = key.rsplit(".", 1)[1]
        if name not in values:
            raise config_lib.ConfigError(
                f'{key} is "auto", which jzero train fills from its own values only for '
                f"{', '.join(sorted(values))}; write the value in the config."
            )
        filled.append(f"{key}={values[name]}")
    if config_lib.batch_from_first_batch(cfg):  # no first batch here: the train section's
        filled.append(f"train_micro_batch_size_per_gpu={train.micro_batch_size}")
    return filled


# -- the model and the engine --------------------------------------------------------------------


def model_args(cfg: Config, *, float64: bool = False) -> tuple[dict[str, Any], int, int | None]:
    """``initialize``'s arguments for the config's model, its sequence length and vocabulary
    size (``None``: not known, ids are not checked). ``float64`` (under ``jax_enable_x64``):
    the built-in GPT as float64 parameters of its functional form, as :mod:`jzero.train.verify`
    compares layouts."""
    section = dict(cfg.model)
    data = dict(cfg.data)
    if "entry" in section:
        args = entry.model_from_entry(section["entry"], section)
        seq_len = data.get("seq_len", section.get("seq_len"))
        if seq_len is None:
            raise config_lib.ConfigError(
                f"model.entry {section['entry']!r}: jzero train needs the sequence length of "
                "its token rows; set data.seq_len (or model.seq_len, which the entry point "
                "then receives too)."
            )
        vocab = data.get("vocab_size", section.get("vocab_size"))
        logger.info("jzero train: the model is %s", section["entry"])
        return args, int(seq_len), None if vocab is None else int(vocab)
    from flax import nnx

    from jzero.demo import gpt

    model_cfg = gpt.config_for(cfg)
    logger.info(
        "jzero train: the model is the built-in GPT (%d layers, d_model %d, vocabulary %d); "
        "set model.entry or --model to train your own",
        model_cfg.num_layers,
        model_cfg.d_model,
        model_cfg.vocab_size,
    )
    if float64:
        model_cfg = dataclasses.replace(model_cfg, dtype="float64")
        made = jax.jit(lambda key: gpt.init_params(key, model_cfg))(jax.random.key(cfg.seed))
        params = jax.tree.map(lambda x: np.asarray(x, np.float64), made)
        args = {"params": params, "loss_fn": functools.partial(gpt.loss_fn, cfg=model_cfg)}
        return args, model_cfg.seq_len, model_cfg.vocab_size
    args = {
        "model": lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(cfg.seed)),
        "loss_fn": gpt.nnx_loss_fn,
    }
    return args, model_cfg.seq_len, model_cfg.vocab_size


def _shapes(rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of this process's rows of a global batch of ``rows``."""
    local = (rows // jax.process_count(), seq_len + 1)
    return {k: jax.ShapeDtypeStruct(local, np.int32) for k in _BATCH}


def build_engine(cfg: Config, args: Mapping[str, Any], seq_len: int) -> Engine:
    """The engine, its state made once in its final layout where the batch is known."""
    if cfg.train_batch_size:
        return initialize(config=cfg, batch=_shapes(cfg.train_batch_size, seq_len), **args)
    engine = initialize(config=cfg, **args)  # the global batch follows the data-parallel size
    engine.resolve(_shapes(engine.train_batch_size, seq_len))
    return engine


def _saved_batch(cfg: Config, fresh: bool) -> int | None:
    """The global batch of the checkpoint a resume starts from (``None``: none)."""
    step = None if fresh else run_dirs.last_checkpoint(cfg)
    if step is None:
        return None
    from jzero.checkpoint import read_info

    meta = read_info(cfg.checkpoint.directory, step).meta
    saved = meta.get("train_batch_size") or (meta.get("config") or {}).get("train_batch_size")
    return None if saved is None else int(saved)


def elastic_split(global_batch: int, data_parallel: int, micro: int) -> tuple[int, int]:
    """``(micro-batch per device, accumulation steps)`` that keep ``global_batch`` over
    ``data_parallel`` devices: the micro-batch kept where it can be, else the largest below it
    that fits.

    Raises:
      ConfigError: no split fits; the message names the device counts that would.
    """
    if global_batch % data_parallel == 0:
        per_device = global_batch // data_parallel
        for m in range(min(micro, per_device), 0, -1):
            if per_device % m == 0:
                return m, per_device // m
    fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
    raise config_lib.ConfigError(
        f"The checkpoint's global batch, {global_batch} samples, does not split over "
        f"{data_parallel} data-parallel devices. Resume on a data-parallel size that divides "
        f"it ({', '.join(map(str, fits))}), or set another global batch: --set "
        f"train_batch_size=<a multiple of {data_parallel}> (the data continues from the same "
        "sample)."
    )


def _engine(
    config: Any, cfg: Config, given: Sequence[str], *, fresh: bool, keep: bool
) -> tuple[Engine, int, int | None]:
    """The engine of the config's model, with the checkpoint's global batch on a resume unless
    ``keep`` is false (a batch size given with ``--set``; see the module's decisions); its
    sequence length and vocabulary size."""
    args, seq_len, vocab = model_args(cfg)
    saved = _saved_batch(cfg, fresh) if cfg.checkpoint.directory else None
    if saved is None or not keep:
        return build_engine(cfg, args, seq_len), seq_len, vocab
    engine = initialize(config=cfg, **args)  # planned only: the state waits for the batch
    if engine.train_batch_size == saved:
        engine.resolve(_shapes(saved, seq_len))
        return engine, seq_len, vocab
    now, dp = engine.train_batch_size, engine.plan.data_parallel_size
    engine.close()
    micro, accum = elastic_split(saved, dp, engine.config.train_micro_batch_size_per_gpu or 1)
    sizes = {"train_batch_size": saved, "train_micro_batch_size_per_gpu": micro}
    sizes["gradient_accumulation_steps"] = accum
    logger.info(
        "jzero train: the checkpoint's global batch is %d samples; over %d data-parallel "
        "devices the config would give %d, so the run keeps %d: %d per device x %d "
        "accumulation steps x %d devices (--set train_batch_size=... decides otherwise)",
        saved,
        dp,
        now,
        saved,
        micro,
        accum,
        dp,
    )
    cfg = load_config(config, overrides=[*given, *(f"{k}={v}" for k, v in sizes.items())])
    return build_engine(cfg, args, seq_len), seq_len, vocab


# -- the data ------------------------------------------------------------------------------------

# What the command reads of the data section itself; the rest is jzero.data's.
_OWN_DATA_KEYS = ("seq_len", "vocab_size")


def data_loaders(engine: Engine, seq_len: int, vocab: int | None) -> Any:
    """The config's ``data`` section as :mod:`jzero.data`'s loaders: this process's training
    iterator (its position in every checkpoint) and eval batches; one line names them."""
    from jzero import data

    cfg = engine.config
    engine.tokens_per_sample = seq_len
    section = {k: v for k, v in cfg.data.items() if k not in _OWN_DATA_KEYS}
    section.setdefault("eval_batches", cfg.train.eval_batches)
    dp = engine.plan.data_parallel_size
    section.setdefault("eval_batch_size", math.lcm(data.EVAL_BATCH, dp))
    if section["eval_batch_size"] % dp:
        raise config_lib.ConfigError(
            f"data.eval_batch_size: {section['eval_batch_size']} rows do not split over the "
            f"{dp} data-parallel devices; set a multiple of {dp}, e.g. "
            f"data.eval_batch_size: {math.lcm(int(section['eval_batch_size']), dp)}."
        )
    loaders = data.from_config(
        section,
        seq_len=seq_len,
        vocab_size=vocab,
        seed=cfg.seed,
        global_batch=engine.train_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    logger.info("%s", loaders.describe())
    return loaders
