"""``zero_optimization.stage: auto``: the cheapest ZeRO setting whose compiled step fits.

Decisions:

* **Measured, not estimated.** Each candidate's step is compiled for the first batch's shapes
  (with abstract state: nothing is allocated) and ``memory_analysis()`` gives its peak per
  device: the arguments (the state, the batch) plus temporaries plus the outputs not aliased
  to an input, less the state a candidate keeps in host memory where the program counts it
  among its arguments (CPU devices have one memory).
* **The planner's order of cost** (``jzero plan``'s levers): stages 0-3 as configured; then,
  under ``activation_checkpointing: {policy: auto}``, stages 0-3 with ``policy: full``; then the
  optimizer state in host memory (``offload_optimizer: {device: cpu}``) at stages 1-3, with
  checkpointing last where it is a candidate. The first that fits is chosen; compiling stops
  there. NVMe is no candidate: its files need a path and a tier built at ``initialize``.
* **The budget** is the top-level ``device_memory`` when set, else the accelerator's
  ``memory_stats()["bytes_limit"]`` less 10% for what XLA's analysis does not see (the
  allocator's fragmentation, other programs). On CPU there is no such figure: ``device_memory``
  is then required.
* **Compiled once.** The chosen candidate's jitted step is the engine's step: its first call
  runs the executable the measurement compiled. The candidates compile on abstract state, so
  the state is made after the choice, once, in the chosen layout (:mod:`jzero.engine.resolve`).
* **Recorded.** The engine's config holds the chosen stage, offload and checkpointing policy,
  so ``describe()``, checkpoints' metadata and ``jzero train``'s summary name them; one log line
  lists every rejected candidate and how far it was short.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jzero import config as config_lib
from jzero._util import format_bytes
from jzero.engine.figures import compiled_peak_bytes as peak_bytes
from jzero.plan import host_state_bytes

__all__ = [
    "AutoStage",
    "Candidate",
    "budget",
    "candidates",
    "choose_stage",
    "compiled_need",
    "peak_bytes",
]

logger = logging.getLogger(__name__)

MARGIN = 0.1
"""Fraction of an accelerator's ``bytes_limit`` kept free when no ``device_memory`` is set."""


@dataclass(frozen=True)
class Candidate:
    """One setting ``stage: auto`` may choose."""

    stage: int
    offload: bool = False
    checkpointing: bool = False

    @property
    def name(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.checkpointing:
            parts.append("activation checkpointing")
        if self.offload:
            parts.append("optimizer offload")
        return " + ".join(parts)

    def config(self, cfg: config_lib.Config) -> config_lib.Config:
        """``cfg`` with this candidate's stage, offload and checkpointing."""
        zero = cfg.zero_optimization
        offload = zero.offload_optimizer
        if self.offload:
            offload = dataclasses.replace(offload, device="cpu")
        zero = dataclasses.replace(zero, stage=self.stage, offload_optimizer=offload)
        cfg = dataclasses.replace(cfg, zero_optimization=zero)
        if self.checkpointing:
            ac = dataclasses.replace(cfg.activation_checkpointing, policy="full")
            cfg = dataclasses.replace(cfg, activation_checkpointing=ac)
        return cfg


def candidates(checkpointing: bool, offload_configured: bool) -> list[Candidate]:
    """The candidates in the planner's order of cost (see the module's decisions).
    ``offload_configured``: the config already offloads the optimizer state (every candidate
    does then, and it is no lever)."""
    out = [Candidate(s, offload_configured) for s in range(4)]
    if checkpointing:
        out += [Candidate(s, offload_configured, True) for s in range(4)]
    if not offload_configured:
        out += [Candidate(s, True) for s in range(1, 4)]
        if checkpointing:
            out += [Candidate(s, True, True) for s in range(1, 4)]
    return out


def budget(cfg: config_lib.Config, device: Any, what: str = "zero_optimization.stage: auto") -> int:
    """The bytes a candidate's step may use on one device (see the module's decisions)."""
    if cfg.device_memory is not None:
        return int(cfg.device_memory)
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics (CPU)
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        raise config_lib.ConfigError(
            f"{what} chooses what fits the device memory, but "
            f"this {device.platform} device reports no memory limit; set the top-level "
            "device_memory (e.g. device_memory: 12GB) to the memory one device may use."
        )
    return int(limit * (1 - MARGIN))


@dataclass
class AutoStage:
    """What an engine needs to choose its stage at the first batch.

    Attributes:
      budget: bytes per device a step may use.
      candidates: in order of cost.
      planner: ``planner(config)(**replan_kwargs)`` makes the plan of a config.
    """

    budget: int
    candidates: Sequence[Candidate]
    planner: Callable[[config_lib.Config], Callable[..., Any]]

    def choose(
        self, measure: Callable[[Candidate], tuple[int, Any]]
    ) -> tuple[Candidate, int, Any, list[tuple[Candidate, int]]]:
        """The first candidate whose ``measure(c) -> (peak bytes, result)`` fits the budget,
        its peak, its result, and the ones rejected with their peaks; a ``ConfigError``
        listing every need when none fits."""
        rejected: list[tuple[Candidate, int]] = []
        for c in self.candidates:
            need, result = measure(c)
            if need <= self.budget:
                return c, need, result, rejected
            rejected.append((c, need))
        needs = "; ".join(f"{c.name} needs {format_bytes(n)}" for c, n in rejected)
        raise config_lib.ConfigError(
            f"zero_optimization.stage: auto found no setting that fits {format_bytes(self.budget)} "
            f"per device: {needs}. Use more devices, a smaller micro batch "
            "(train_micro_batch_size_per_gpu), activation_checkpointing: {policy: auto}, NVMe "
            "offload, or raise device_memory if the device has more."
        )

    def describe(self, chosen: Candidate, need: int, rejected: list[tuple[Candidate, int]]) -> str:
        """The log line of a choice."""
        line = (
            f"jzero: stage auto chose {chosen.name}: its step needs {format_bytes(need)} per "
            f"device of {format_bytes(self.budget)}"
        )
        if rejected:
            line += "; rejected " + ", ".join(
                f"{c.name} (short by {format_bytes(n - self.budget)})" for c, n in rejected
            )
        return line


def compiled_need(setup: Any, batch: Any) -> tuple[int, Any]:
    """A candidate's step (``setup``, a :class:`jzero.engine.resolve.Setup` holding the
    candidate's config, plan and batch sizes; built as the engine builds its own,
    :func:`jzero.engine.steps.build_step`) compiled on the state's shapes in its plan's layout
    (nothing allocated), and its peak bytes per device: ``(need, step)``; the step's first call
    runs the executable compiled here."""
    from jzero.engine import steps
    from jzero.step import init_train_state

    plan = setup.plan
    step = steps.build_step(setup)
    shapes = init_train_state(
        plan, plan.abstract_params, setup.optimizer, setup.extra, abstract=True
    )
    compiled = step.lower(shapes, batch).compile()
    host = sum(host_state_bytes(plan, setup.accumulation_steps or 1).values())
    return peak_bytes(compiled, host), step


def choose_stage(auto: AutoStage, setup: Any, batch: Any) -> tuple[config_lib.Config, Any, Any]:
    """The setting ``auto`` chooses for the step of ``setup`` (a
    :class:`jzero.engine.resolve.Setup`) on the global ``batch``: each
    candidate's plan (for the layers the loss's scans consume) and step (built as the engine
    builds its own, :func:`jzero.engine.steps.build_step`), compiled on the state's shapes in
    its layout, the first that fits kept; one log line says which, and what was rejected.

    Returns:
      The chosen config, plan and step (its executable compiled: the step's first call runs it).
    """
    from jzero.engine import layout

    dims, piped = layout.traced_layers(setup, batch)

    def measure(c: Candidate) -> tuple[int, Any]:
        cfg = c.config(setup.config)
        plan = auto.planner(cfg)(layer_dims=dims, **piped)
        need, step = compiled_need(dataclasses.replace(setup, config=cfg, plan=plan), batch)
        return need, (cfg, plan, step)

    chosen, need, (cfg, plan, step), rejected = auto.choose(measure)
    logger.info(auto.describe(chosen, need, rejected))
    return cfg, plan, step
