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

from jzero.engine import figures, settings
from jzero.step import make_train_step

__all__ = ["build_step", "profiled_step"]

logger = logging.getLogger(__name__)
PyTree = Any


def build_step(setup: Any, nvme: Any = None) -> Callable[..., Any]:
    """The train step of ``setup`` (a :class:`jzero.engine.resolve.Setup`): its plan, under its
    config's step settings (accumulation, clipping, remat, the offloaded update, the NVMe tier's
    pipelining), for its loss and optimizer; ``nvme``: the NVMe tier's files
    (:class:`jzero.nvme.NvmeState`), or ``None`` without the tier.

    Returns:
      ``step(state, batch) -> (state, metrics)``, with ``.lower(state, batch)``.
    """
    cfg, loss_fn = setup.config, setup.loss_fn
    takes_extra, learning_rate = setup.takes_extra, setup.learning_rate
    options = settings.step_options(cfg, setup.accumulation_steps)
    if nvme is None:
        return make_train_step(
            setup.plan,
            loss_fn,
            setup.optimizer,
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


def profiled_step(
    setup: Any, step: Callable[..., Any], state: Any, batch: PyTree, iteration: int
) -> tuple[Any, dict[str, jax.Array], Any]:
    """Runs ``step`` (of ``setup``) once on ``state`` under ``flops_profiler`` (see the module's
    decisions), as train step ``iteration``.

    Returns:
      The new state (the old one was donated to the step), the step's metrics and the
      :class:`jzero.profiler.FlopsProfile` (``None`` for a step that is not one program).
    """
    from jzero import profiler

    fp = setup.config.flops_profiler
    if not hasattr(step, "lower"):  # the NVMe tier runs several programs a step
        logger.warning("jzero: flops_profiler does not profile the NVMe tier's step.")
        state, metrics = step(state, batch)
        return state, metrics, None
    compiled = step.lower(state, batch).compile()
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    seconds = time.perf_counter() - start
    loss, args = figures.traceable_loss(setup, batch)
    mesh = setup.plan.mesh
    result = profiler.profile(
        loss,
        setup.plan.abstract_params,
        args,
        compiled,
        seconds,
        step=iteration,
        devices=list(mesh.devices.flat),
        options=profiler.ProfileOptions(fp.module_depth, fp.peak_flops, fp.recompute_fwd_factor),
    )
    text = result.format(fp.top_modules, fp.detailed)
    if jax.process_index() == 0:
        if fp.output_file:
            with open(fp.output_file, "w") as f:
                f.write(text + "\n")
        else:
            logger.info("\n%s", text)
    return state, metrics, result
