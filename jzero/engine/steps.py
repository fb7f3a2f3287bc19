"""The engine's train step: one builder whatever the offload tier, and the profiled step.

Decisions:

* **One path builds a step.** :func:`build_step` maps the config's step settings once
  (:func:`jzero.engine.settings.step_options`) and hands them to the step of the tier the
  state rests in: :func:`jzero.step.make_train_step` (device or host memory: one jitted
  program) or, under the NVMe tier, :class:`jzero.nvme.NvmeStep` over its files (several
  programs a step; imported only then). ``stage: auto`` builds each candidate's step through
  it too.
* **The profiled step** (``flops_profiler.profile_step``) is compiled first, so its time is the
  step's and not the compilation's, timed to its result, then profiled
  (:func:`jzero.profiler.profile`); the printout goes to ``flops_profiler.output_file`` or the
  log, from process 0. A step without a single lowered program is run unprofiled, with a
  warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import optax

from jzero import config as config_lib
from jzero.engine import figures, settings
from jzero.plan import Plan
from jzero.step import make_train_step

__all__ = ["build_step", "profiled_step"]

logger = logging.getLogger(__name__)
PyTree = Any


def build_step(
    plan: Plan,
    cfg: config_lib.Config,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    accumulation_steps: int | None,
    takes_extra: bool,
    learning_rate: Callable[[jax.Array], jax.Array] | None,
    nvme: Any = None,
) -> Callable[..., Any]:
    """The train step of ``plan`` under ``cfg``'s step settings.

    Args:
      plan: the plan the state is laid out by.
      cfg: the config whose step settings (accumulation, clipping, remat, the offloaded
        update, the NVMe tier's pipelining) the step follows.
      loss_fn: the loss, as the engine holds it.
      optimizer: the optax transformation.
      accumulation_steps: the micro-batches a step accumulates (``None``: the config's).
      takes_extra: the loss takes and returns the model's non-trainable state.
      learning_rate: the schedule, for the ``lr`` metric; ``None`` where jzero does not know it.
      nvme: the NVMe tier's files (:class:`jzero.nvme.NvmeState`), or ``None`` without the tier.

    Returns:
      ``step(state, batch) -> (state, metrics)``, with ``.lower(state, batch)``.
    """
    options = settings.step_options(cfg, accumulation_steps)
    if nvme is None:
        return make_train_step(
            plan,
            loss_fn,
            optimizer,
            options,
            takes_extra=takes_extra,
            learning_rate=learning_rate,
        )
    from jzero.nvme import NvmeStep

    tier = settings.nvme_options(cfg)
    return NvmeStep(
        nvme,
        loss_fn,
        pipeline_read=tier.pipeline_read,
        pipeline_write=tier.pipeline_write,
        options=options,
        takes_extra=takes_extra,
        learning_rate=learning_rate,
    )


def profiled_step(engine: Any, step: Callable[..., Any], batch: PyTree) -> dict[str, jax.Array]:
    """Runs ``step`` once under ``flops_profiler`` (see the module's decisions): ``engine.state``
    becomes the step's result as soon as it exists (the old one was donated to it), and
    ``engine.flops_profile`` the :class:`jzero.profiler.FlopsProfile`.

    Returns:
      The step's metrics.
    """
    from jzero import profiler

    fp = engine.config.flops_profiler
    if not hasattr(step, "lower"):  # the NVMe tier runs several programs a step
        logger.warning("jzero: flops_profiler does not profile the NVMe tier's step.")
        engine.state, metrics = step(engine.state, batch)
        return metrics
    compiled = step.lower(engine.state, batch).compile()
    start = time.perf_counter()
    engine.state, metrics = step(engine.state, batch)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    loss, args = figures.traceable_loss(engine, batch)
    result = profiler.profile(
        loss,
        engine.plan.abstract_params,
        args,
        compiled,
        seconds,
        step=engine.iteration + 1,
        devices=list(engine.mesh.devices.flat),
        options=profiler.ProfileOptions(fp.module_depth, fp.peak_flops, fp.recompute_fwd_factor),
    )
    engine.flops_profile = result
    text = result.format(fp.top_modules, fp.detailed)
    if jax.process_index() == 0:
        if fp.output_file:
            with open(fp.output_file, "w") as f:
                f.write(text + "\n")
        else:
            logger.info("\n%s", text)
    return metrics
