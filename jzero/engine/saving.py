"""An engine's checkpoints: its state and meta written through :mod:`jzero.checkpoint`, and
read back into its plan.

:class:`~jzero.engine.Engine` keeps the state and the bookkeeping (the step a checkpoint was
restored from or saved as, the data position); this module turns them into what the
:class:`jzero.checkpoint.Checkpointer` writes and back.

Decisions:

* **Logical shapes on disk.** A checkpoint holds every leaf without the padding a plan may
  rest it with, so any device count (and any stage, with or without offload) restores it;
  the restore reads straight into this plan's shardings and pads where this plan pads.
* **Never a bad checkpoint over good ones.** Parameters holding inf/NaN are not written (a
  warning says so; the checkpoints on disk stay).
* **A run resumed from an older step replaces the steps that followed it**, as DeepSpeed
  overwrites a tag it saves again; the old copy stays until the new one is committed.
* **The NVMe tier** is read back from its files for a save, and a restore reads into host
  memory, then back to the files.
* With ``stage3_gather_16bit_weights_on_model_save`` the parameters in their compute dtype go
  beside each checkpoint (:func:`jzero.weights.save_step_weights`); the directory is checked
  before anything is written. Orbax (and the weights code) is imported only when a checkpoint
  is opened.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jzero import config as config_lib
from jzero.engine.checks import finite
from jzero.plan import Plan
from jzero.step import (
    TrainState,
    from_logical,
    logical_shardings,
    logical_state,
    logical_view,
    state_shardings,
)

__all__ = ["open_checkpointer", "restore", "save"]

logger = logging.getLogger(__name__)


def open_checkpointer(cfg: config_lib.Config, directory: Any = None) -> Any:
    """The :class:`jzero.checkpoint.Checkpointer` of ``cfg``'s ``checkpoint`` section, in
    ``directory`` instead of ``checkpoint.directory`` when given; a clear error without
    either."""
    c = cfg.checkpoint
    if directory is not None:
        c = dataclasses.replace(c, directory=str(directory))
    if not c.directory:
        raise ValueError(
            "This engine has no checkpoint directory. Set checkpoint.directory in the "
            "config, e.g. checkpoint: {directory: runs/ckpt}, or name one: "
            "engine.save_checkpoint(save_dir)."
        )
    from jzero.checkpoint import Checkpointer  # Orbax is needed only for checkpoints

    return Checkpointer(
        c.directory,
        max_to_keep=c.max_to_keep,
        async_save=c.async_,
        overwrite=bool(getattr(c, "overwrite", False)),
        max_consecutive_failures=c.max_consecutive_failures,
    )


def save(
    ckpt: Any,
    step: int,
    cfg: config_lib.Config,
    plan: Plan,
    state: TrainState,
    meta: dict[str, Any],
    *,
    periodic: bool,
) -> bool:
    """Writes ``state`` (all of it in memory) as checkpoint ``step`` with ``meta``, unless its
    parameters hold inf/NaN (see the module's decisions).

    Returns:
      Whether a save started.
    """
    if not finite(state.params, state.master):
        logger.warning(
            "jzero: NOT saving checkpoint step %d: the parameters hold inf/NaN (a step with "
            "non-finite gradients was applied). The checkpoints on disk (%s) are kept. Set "
            "skip_nonfinite: true to skip such steps.",
            step,
            ckpt.all_steps() or "none",
        )
        return False
    gather16 = cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    if gather16:
        from jzero import weights

        weights.check_step_weights_dir(ckpt.directory)  # refuse before anything is written
    state = logical_view(plan, state)
    saved = ckpt.save(step, state, meta=meta, force=True, overwrite=True, periodic=periodic)
    if saved and gather16:  # the params in their compute dtype, beside the checkpoints
        weights.save_step_weights(ckpt.directory, step, state.params, ckpt.all_steps())
    return saved


def restore(
    ckpt: Any, step: int | None, plan: Plan, state: TrainState, disk: Any = None
) -> tuple[TrainState, dict[str, Any]]:
    """Checkpoint ``step`` (the latest for ``None``) read into ``plan``'s shardings, in place of
    ``state``; under the NVMe tier (``disk``) written back to its files.

    Returns:
      The restored state and the checkpoint's meta.
    """
    from jzero.checkpoint import abstract_target

    current = logical_state(plan, state)
    shardings = logical_shardings(plan, current)
    if disk is not None:  # its leaves are read into host memory, then to the files
        current = disk.abstract_full(state)
        shardings = disk.restore_shardings(state_shardings(plan))
    target = abstract_target(current, shardings)
    restored, meta = ckpt.restore(target, step)
    if disk is not None:  # back to the files (the restore read it all into memory)
        return disk.spill(restored), meta
    # The checkpoint holds logical shapes; padded leaves are padded into this plan's.
    return from_logical(plan, restored), meta
