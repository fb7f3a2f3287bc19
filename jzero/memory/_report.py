"""The measured report's shape: per-device bytes of each stage of a real model, as a table.

Decisions:

* A row holds the model state per category from the plan (``Plan.model_state_bytes`` on the
  device, ``Plan.host_state_bytes`` on the host), the largest leaf slice stage 3 gathers at once,
  and, when a step was compiled, its ``memory_analysis()``.
* A measured peak is ``args + temp + outputs not aliased to inputs`` of ``memory_analysis()``.
  Gradients live in ``temp`` (the step's temporaries); everything resident between steps is an
  argument. Without a compiled step the peak is the model state alone, gradients included.
* A report can be judged against another device memory without recompiling anything
  (:meth:`PlanReport.with_device_memory`).
* Sizes in the table and the plot are in one binary unit, the one that suits the largest peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from jzero.memory._format import (
    Recommendation,
    _fmt,
    _recommend,
    _render,
    _unit_for,
    find_row,
    parse_size,
)
from jzero.memory._plot import plot_bars

__all__ = ["PlanReport", "StageMemory"]


@dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one stage of a real model.

    Attributes:
      stage: the ZeRO stage.
      offload: ``"none"``, ``"optimizer"``, ``"params"`` or ``"optimizer+params"``.
      device: bytes in device memory by category (``Plan.model_state_bytes``).
      host: bytes in host memory by category (``Plan.host_state_bytes``; empty without it).
      gathered_layer: bytes of the largest leaf slice stage 3 gathers at once (0 otherwise).
      gathered_leaf: the path of that leaf.
      argument_bytes / temp_bytes / output_bytes / alias_bytes: the compiled step's
        ``memory_analysis()``, ``None`` when no step was compiled.
      other_argument_bytes: arguments besides the model state (batch shard, step counter,
        non-trainable model state), measured.
    """

    stage: int
    offload: str
    device: Mapping[str, int]
    host: Mapping[str, int]
    gathered_layer: int = 0
    gathered_leaf: str = ""
    argument_bytes: int | None = None
    temp_bytes: int | None = None
    output_bytes: int | None = None
    alias_bytes: int | None = None
    other_argument_bytes: int = 0

    @property
    def measured(self) -> bool:
        """Whether the compiled step's memory is included."""
        return self.temp_bytes is not None

    @property
    def resident_bytes(self) -> int:
        """Device bytes kept between steps (every category but the gradients)."""
        return sum(v for k, v in self.device.items() if k != "grads")

    @property
    def peak(self) -> int:
        """Peak bytes per device: resident state + other arguments + temporaries + new outputs.

        Without a compiled step: the model state alone (gradients included).
        """
        if not self.measured:
            return sum(self.device.values())
        fresh = max((self.output_bytes or 0) - (self.alias_bytes or 0), 0)
        return self.resident_bytes + self.other_argument_bytes + self.temp_bytes + fresh


@dataclass(frozen=True)
class PlanReport:
    """The result of :func:`plan_report` / :func:`memory_report`; ``table()``, ``plot(path)``."""

    title: str
    rows: tuple[StageMemory, ...]
    devices: int
    measured_devices: int | None
    device_memory: int | None = None
    margin: float = 0.1

    def with_device_memory(self, device_memory: int | str | None) -> PlanReport:
        """The same report judged against another device memory (nothing is recompiled)."""
        memory = None if device_memory is None else parse_size(device_memory)
        return dataclasses.replace(self, device_memory=memory)

    @property
    def recommendation(self) -> Recommendation | None:
        """The lowest stage whose peak fits (offload only if needed); ``None`` without memory."""
        options = [(r.stage, r.offload, r.peak) for r in self.rows]
        return _recommend(options, self.device_memory, self.margin)

    def row(self, stage: int, offload: str = "none") -> StageMemory:
        """The row of one stage."""
        return find_row(self.rows, stage, offload)

    def table(self) -> str:
        """The report as text: categories, gathered layer, measured memory, peak, advice."""
        keys = list(dict.fromkeys(k for r in self.rows for k in r.device))
        unit = _unit_for(max([r.peak for r in self.rows] + [1]))
        usable = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        header = ["stage", "offload", *(k.replace("_", " ") for k in keys), "host", "gathered"]
        header += ["args", "temp", "peak"] + (["fits"] if usable is not None else [])
        rows = []
        for r in self.rows:
            cells = [str(r.stage), r.offload, *(_fmt(r.device.get(k, 0), unit) for k in keys)]
            cells += [_fmt(sum(r.host.values()), unit), _fmt(r.gathered_layer, unit)]
            for v in (r.argument_bytes, r.temp_bytes):
                cells.append("-" if v is None else _fmt(v, unit))
            cells.append(_fmt(r.peak, unit))
            if usable is not None:
                cells.append("yes" if r.peak <= usable else "no")
            rows.append(cells)
        where = (
            "not measured (no batch)"
            if self.measured_devices is None
            else f"measured on the local {self.measured_devices} devices"
        )
        lines = [self.title, f"Per-device memory ({unit[0]})", *_render(header, rows)]
        lines += [
            f"model state (params ... host, gathered): the plan on {self.devices} devices; "
            f"args, temp: compiled step's memory_analysis(), {where}.",
            "peak = resident model state + other args (batch) + temp + outputs not aliased; "
            "grads and the gathered layer are part of temp.",
        ]
        if self.recommendation is not None:
            lines.append(str(self.recommendation))
        return "\n".join(lines)

    def bars(self) -> list[tuple[str, Mapping[str, float], Mapping[str, float]]]:
        """(label, device bytes by category, host bytes by category) per row, for plots."""
        out = []
        for r in self.rows:
            device = {k.replace("_", " "): float(v) for k, v in r.device.items()}
            rest = r.peak - sum(r.device.values())
            if r.measured and rest > 0:
                device["activations and temporaries"] = float(rest)
            host = {k.replace("_", " "): float(v) for k, v in r.host.items()}
            out.append((f"{r.stage}\n{r.offload}", device, host))
        return out

    def plot(self, path: str) -> None:
        """Draws the stages as stacked bars (device solid, host hatched) into a PNG file."""
        limit = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        unit = _unit_for(max([r.peak for r in self.rows] + [1]))
        plot_bars(path, self.title, self.bars(), limit=limit, unit=unit)
