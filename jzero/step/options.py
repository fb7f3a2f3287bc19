"""What :func:`jzero.step.make_train_step` is told beyond the plan, the loss and the optimizer:
one typed, frozen value.

Decisions:

* :class:`StepOptions` holds the step's settings that come from a run's configuration
  (accumulation, clipping, rematerialisation, the offloaded update's grouping and where it
  runs); :mod:`jzero.engine.settings` makes it from a validated config, once. What belongs to
  the caller's code (whether the loss returns aux or takes extra state, the schedule for the
  ``lr`` metric, donation) stays a keyword of ``make_train_step``. Code that builds a step by
  hand names the fields it sets: ``StepOptions(gradient_clipping=1.0)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from jzero.rewrite import RematPolicy

__all__ = ["StepOptions"]


@dataclass(frozen=True)
class StepOptions:
    """The train step's settings.

    Attributes:
      accumulation_steps: micro-batches per step; the batch's leading dim must be
        ``accumulation_steps x micro-batch x data-parallel size`` (checked when the step is
        traced).
      gradient_clipping: clip the global gradient norm to this value (0 disables), as
        DeepSpeed's ``gradient_clipping``.
      remat_policy: activation checkpointing of each layer (every ``lax.scan`` body in the
        loss, each layer of a Python loop), a :class:`jzero.rewrite.remat.RematPolicy` or its
        text (``"full"``, ``"dots"``, ``"dots_no_batch"``, ``"names:a,b"``, ``"none"``); see
        :mod:`jzero.rewrite.remat`. ``None`` (the default): no checkpointing at stages 0-2;
        stage 3 checkpoints the scans it gathers with
        :data:`jzero.rewrite.gather.remat_save_policy`.
      sub_group_size: with the optimizer state offloaded, stream the update over groups of
        parameter leaves of at most this many elements, one group's state in device memory at
        a time (:mod:`jzero.step.streaming`; DeepSpeed's ``sub_group_size``); ``None``: one
        piece.
      offload_compute: ``"device"`` (default) brings the offloaded state into device memory
        for the update; ``"host"`` updates it in host memory (``compute_on("device_host")``,
        where DeepSpeed runs CPU Adam), group by group (:mod:`jzero.step.streaming`).
    """

    accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    remat_policy: RematPolicy | str | None = None
    sub_group_size: int | None = None
    offload_compute: str = "device"
