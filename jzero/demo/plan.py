"""``jzero plan``'s measurement: the built-in GPT of a config at every ZeRO stage.

:func:`plan_report` is :func:`jzero.memory.measure_stages` given the built-in GPT: the model
is built as ``jzero train`` builds it (:mod:`jzero.demo.gpt`, a Flax NNX module made in its
shards), here as an abstract engine (``initialize(..., abstract=True)``, shapes only, so a
stage the model does not fit is planned all the same), and its step compiled for a global
batch of ``model.seq_len + 1`` int32 tokens. What is measured and how the rows are chosen is
:mod:`jzero.memory`'s (its ``_measure`` decisions); this module only knows the model, so the
estimator package imports neither the engine nor a model (nor reaches back here: callers
import :func:`plan_report` from this module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jzero import memory
from jzero.costs import Architecture
from jzero.demo import gpt, llama
from jzero.engine import InitOptions, initialize

__all__ = ["architecture_report", "auto_layout_table", "plan_report"]


def _gpt(cfg: Any) -> tuple[str, Callable[[Any, Any], tuple[Any, Any]]]:
    """The built-in GPT of ``cfg``'s ``model`` section, as :func:`jzero.memory.measure_stages`
    takes a model: its name for the title, and how to build a row's engine and batch."""
    model_cfg = gpt.config_for(cfg)

    def build(row: Any, mesh: Any) -> tuple[Any, Any]:
        engine = initialize(
            model=lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(cfg.seed)),
            loss_fn=gpt.nnx_loss_fn,
            config=row,
            abstract=True,  # shapes only: a stage the model does not fit is planned all the same
            options=InitOptions(mesh=mesh),
        )
        shape = (engine.train_batch_size, model_cfg.seq_len + 1)
        return engine, {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)}

    return f"GPT {model_cfg.num_layers} layers, d_model {model_cfg.d_model}", build


def _llama(arch: Architecture) -> Callable[[Any], tuple[str, Callable[[Any, Any], Any]]]:
    """The Llama-shaped model of ``arch`` (:mod:`jzero.demo.llama`) as
    :func:`jzero.memory.measure_stages` takes a model; the config gives the sequence length
    (``model.seq_len``), the batch and the precision."""

    def model(cfg: Any) -> tuple[str, Callable[[Any, Any], tuple[Any, Any]]]:
        seq_len = cfg.model.get("seq_len")
        if not seq_len:
            raise ValueError(
                "Planning an architecture needs the sequence length: set model.seq_len in the "
                "config (e.g. --set model.seq_len=2048)."
            )
        dtype = jnp.bfloat16 if cfg.bf16.enabled else jnp.float16 if cfg.fp16.enabled else None
        dtype = dtype or jnp.float32
        llama.check(arch)

        def build(row: Any, mesh: Any) -> tuple[Any, Any]:
            engine = initialize(
                params=lambda key: llama.init_params(key, arch),
                loss_fn=functools.partial(llama.loss_fn, arch=arch, dtype=dtype),
                config=row,
                abstract=True,
                options=InitOptions(mesh=mesh),
            )
            shape = (engine.train_batch_size, int(seq_len) + 1)
            return engine, {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)}

        name = (
            f"Llama-shaped {arch.layers} layers, hidden {arch.hidden}, {arch.heads} heads "
            f"({arch.kv_heads or arch.heads} kv), vocab {arch.vocab}"
        )
        return name, build

    return model


def architecture_report(
    config: Any,
    arch: Architecture,
    devices: int | None = None,
    device_memory: int | str | None = None,
    *,
    overrides: Sequence[str] = (),
    margin: float = 0.1,
    rows: memory.StageRows | None = None,
) -> memory.PlanReport:
    """Every ZeRO stage of the Llama-shaped model of ``arch`` (:mod:`jzero.demo.llama`),
    measured as :func:`plan_report` measures the built-in GPT; ``jzero plan --preset``.

    Args:
      config: a config (path, mapping or :class:`jzero.Config`) with ``model.seq_len``; its
        other ``model`` keys are not read.
      arch: the shape (:class:`jzero.costs.Architecture`, e.g. ``jzero.costs.PRESETS[name]``;
        dense, rotary positions).
      devices, device_memory, overrides, margin: as :func:`plan_report`.
      rows: the rows to compile (:class:`jzero.memory.StageRows`); ``None``: its defaults.

    Returns:
      A :class:`jzero.memory.PlanReport`.

    Raises:
      ValueError: for an architecture with experts or learned positions, or no
        ``model.seq_len``.
    """
    return memory.measure_stages(
        config, _llama(arch), devices, device_memory, overrides=overrides, margin=margin,
        rows=rows,
    )  # fmt: skip


def plan_report(
    config: Any,
    devices: int | None = None,
    device_memory: int | str | None = None,
    *,
    overrides: Sequence[str] = (),
    margin: float = 0.1,
    offload: bool | None = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    compare_checkpointing: bool | None = None,
) -> memory.PlanReport:
    """Every ZeRO stage of a config's built-in GPT side by side, measured from the compiled step.

    The model is built as ``jzero train`` builds it, once per stage, and its step is compiled
    (``engine.lower(batch).compile().memory_analysis()``).

    Args:
      config: a config (path, mapping or :class:`jzero.Config`) with a ``model`` section.
      devices: data-parallel devices to plan for; by default the config's mesh. More devices
        than this machine has: the model state is planned on an abstract mesh and the compiled
        step is measured on the local devices at the same per-device micro batch.
      device_memory: the memory of one device (bytes or ``"80GB"``), for the recommendation.
      overrides: ``"key=value"`` config overrides, as ``--set`` passes them.
      margin: fraction of device memory kept free.
      offload: also measure stages with offload to host memory: ``True`` always, ``False``
        never, ``None`` only when ``device_memory`` is given and no stage fits without.
      stages: the stages to measure (each costs one compilation).
      compare_checkpointing: also compile each row with the opposite activation-checkpointing
        setting (the config has none: ``policy: full``; it has one: ``policy: none``):
        ``True`` always, ``False`` never, ``None`` always without ``device_memory`` and with it
        only where it can change the recommendation (see :mod:`jzero.memory`'s measured
        report). Each costs one more compilation.

    Returns:
      A :class:`jzero.memory.PlanReport`; ``print(result.table())``.
    """
    rows = memory.StageRows(stages, offload, compare_checkpointing)
    return memory.measure_stages(
        config, _gpt, devices, device_memory, overrides=overrides, margin=margin, rows=rows
    )


def auto_layout_table(
    config: Any, device_memory: int | str | None = None, *, overrides: Sequence[str] = ()
) -> str:
    """``jzero plan --auto``: the candidates a config's parallel sizes ``"auto"`` rank, each
    compiled for its need, as a table (:func:`jzero.engine.auto_layout.format_table`); nothing
    is trained. The built-in GPT is built as an abstract engine, its batch
    ``train_batch_size`` x ``model.seq_len + 1`` int32 tokens.

    Raises:
      ConfigError: a config with no parallel size ``"auto"``.
    """
    from jzero import config as config_lib
    from jzero.engine import auto_layout

    cfg = config_lib.load_config(config, overrides)
    if not any(k in cfg.auto for k in config_lib.LAYOUT_KEYS):
        raise config_lib.ConfigError(
            'jzero plan --auto ranks the layouts of the parallel sizes written "auto", and this '
            f'config has none; write one of {", ".join(config_lib.LAYOUT_KEYS)} as "auto" '
            "(e.g. --set sequence_parallel_size=auto)."
        )
    if device_memory is not None:
        cfg = config_lib.load_config({**cfg.to_dict(), "device_memory": device_memory})
    model_cfg = gpt.config_for(cfg)
    engine = initialize(
        model=lambda: gpt.GPT(model_cfg, rngs=nnx.Rngs(cfg.seed)),
        loss_fn=gpt.nnx_loss_fn,
        config=cfg,
        abstract=True,
    )
    auto = engine.auto_layout
    shape = (cfg.train_batch_size, model_cfg.seq_len + 1)
    batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)}
    rows = auto_layout.ranked_table(auto, engine.setup, batch)
    return auto_layout.format_table(rows, auto.budget)
