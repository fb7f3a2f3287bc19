"""The measured report's shape: per-device bytes of each stage of a real model, as a table.

Decisions:

* A row holds the model state per category from the plan (``jzero.plan.model_state_bytes`` on
  the device, ``jzero.plan.host_state_bytes`` on the host), the largest leaf slice stage 3
  gathers at once, and, when a step was compiled, its ``memory_analysis()``.
* A measured peak is ``args + temp + outputs not aliased to inputs`` of ``memory_analysis()``.
  Gradients live in ``temp`` (the step's temporaries); everything resident between steps is an
  argument. Without a compiled step the peak is the model state alone, gradients included.
* A report can be judged against another device memory without recompiling anything
  (:meth:`PlanReport.with_device_memory`).
* Activation checkpointing: a row's ``temp`` and ``peak`` are the step compiled with the
  config's ``activation_checkpointing`` (``checkpointing``, ``"none"`` without). Where the
  report compares (``other_checkpointing`` set), the step compiled with the opposite setting
  gives ``other_temp_bytes`` / ``other_peak_bytes`` (``None`` where it was not measured), shown
  as two more columns (``temp AC``, ``peak AC``, or ``temp no AC``, ``peak no AC`` when the
  config checkpoints). Without a comparison the table is the stage-only one.
* The ``fits`` column says ``yes`` (fits without activation checkpointing), ``AC`` (fits only
  with it) or ``no``; the recommendation weighs the stage, then activation checkpointing, then
  offload (:mod:`jzero.memory._format`).
* Sizes in the table and the plot are in one binary unit, the one that suits the largest peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from jzero.memory._format import (
    Recommendation,
    find_row,
    in_unit,
    parse_size,
    recommend,
    recommended_index,
    recomputes,
    render_columns,
    unit_for,
)
from jzero.memory._plot import plot_bars

__all__ = ["PlanReport", "StageMemory"]


@dataclass(frozen=True)
class StageMemory:
    """Per-device bytes of one stage of a real model.

    Attributes:
      stage: the ZeRO stage.
      offload: ``"none"``, ``"optimizer"``, ``"params"`` or ``"optimizer+params"``.
      device: bytes in device memory by category (``jzero.plan.model_state_bytes``).
      host: bytes in host memory by category (``jzero.plan.host_state_bytes``; empty without it).
      gathered_layer: bytes of the largest leaf slice stage 3 gathers at once (0 otherwise).
      gathered_leaf: the path of that leaf.
      argument_bytes / temp_bytes / output_bytes / alias_bytes: the compiled step's
        ``memory_analysis()``, ``None`` when no step was compiled.
      other_argument_bytes: arguments besides the model state (batch shard, step counter,
        non-trainable model state), measured.
      checkpointing: the activation-checkpointing policy of the measured step (``"none"``:
        without).
      other_checkpointing: the opposite setting the report compares with (``None``: no
        comparison).
      other_temp_bytes / other_peak_bytes: ``temp_bytes`` and :attr:`peak` of the step compiled
        with ``other_checkpointing``; ``None`` when it was not measured.
      comm_bytes: bytes of every collective of the compiled step (full buffers, see
        :mod:`jzero.hlo`), ``None`` when no step was compiled.
      cross_replica_bytes: the part of ``comm_bytes`` whose device groups span the mesh's
        ``replica`` axis (across hosts under hybrid sharding); ``None`` without that axis.
      model_axis_bytes: the part whose groups span the ``model`` axis (tensor parallelism's
        activation all-reduces); ``None`` without that axis.
      seq_axis_bytes: the part whose groups span the ``seq`` axis only (sequence
        parallelism's all-to-alls); ``None`` without that axis.
      pipe_axis_bytes: the part whose groups span the ``pipe`` axis only (the activations and
        their gradients between neighbouring stages, the shared leaves' gradient sums);
        ``None`` without that axis.
      expert_axis_bytes: the part whose groups span the ``expert`` axis only (the tokens'
        all-to-alls to their experts and back); ``None`` without that axis.
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
    checkpointing: str = "none"
    other_checkpointing: str | None = None
    other_temp_bytes: int | None = None
    other_peak_bytes: int | None = None
    comm_bytes: int | None = None
    cross_replica_bytes: int | None = None
    model_axis_bytes: int | None = None
    seq_axis_bytes: int | None = None
    pipe_axis_bytes: int | None = None
    expert_axis_bytes: int | None = None

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

    def variants(self) -> list[tuple[str, int | None, int]]:
        """``(policy, temp bytes, peak bytes)`` of every activation-checkpointing setting
        measured: the config's first, then the opposite one when it was measured."""
        out = [(self.checkpointing, self.temp_bytes, self.peak)]
        if self.other_checkpointing is not None and self.other_peak_bytes is not None:
            out.append((self.other_checkpointing, self.other_temp_bytes, self.other_peak_bytes))
        return out

    def temp_with(self, checkpointing: bool) -> int | None:
        """Temporaries (activations, gradients, gathered layers) of the step compiled without
        (``False``) or with (``True``) activation checkpointing; ``None`` if not measured."""
        return next((t for p, t, _ in self.variants() if recomputes(p) == checkpointing), None)

    def peak_with(self, checkpointing: bool) -> int | None:
        """:attr:`peak` without (``False``) or with (``True``) activation checkpointing;
        ``None`` if not measured."""
        return next((k for p, _, k in self.variants() if recomputes(p) == checkpointing), None)


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
    def compares_checkpointing(self) -> bool:
        """Whether the report compares activation checkpointing (its extra columns)."""
        return any(r.other_checkpointing is not None for r in self.rows)

    @property
    def recommendation(self) -> Recommendation | None:
        """The cheapest option whose peak fits: lowest stage, then activation checkpointing,
        then offload; ``None`` without a device memory."""
        options = [(r.stage, r.offload, p, peak) for r in self.rows for p, _, peak in r.variants()]
        return recommend(options, self.device_memory, self.margin)

    def _largest(self) -> int:
        return max([peak for r in self.rows for _, _, peak in r.variants()] + [1])

    def row(self, stage: int, offload: str = "none") -> StageMemory:
        """The row of one stage."""
        return find_row(self.rows, stage, offload)

    def table(self) -> str:
        """The report as text: categories, gathered layer, measured memory, peak, advice."""
        keys = list(dict.fromkeys(k for r in self.rows for k in r.device))
        unit = unit_for(self._largest())
        usable = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        header = ["stage", "offload", *(k.replace("_", " ") for k in keys), "host", "gathered"]
        compare = self.compares_checkpointing
        other = next((r.other_checkpointing for r in self.rows if r.other_checkpointing), None)
        alt = "AC" if recomputes(other) else "no AC"
        comm = any(r.comm_bytes is not None for r in self.rows)
        cross = any(r.cross_replica_bytes is not None for r in self.rows)
        model = any(r.model_axis_bytes is not None for r in self.rows)
        seq = any(r.seq_axis_bytes is not None for r in self.rows)
        pipe = any(r.pipe_axis_bytes is not None for r in self.rows)
        expert = any(r.expert_axis_bytes is not None for r in self.rows)
        header += (["comm/step"] if comm else []) + (["x-replica/step"] if cross else [])
        header += (["model/step"] if model else []) + (["seq/step"] if seq else [])
        header += (["pipe/step"] if pipe else []) + (["expert/step"] if expert else [])
        header += ["args", "temp", "peak"]
        header += [f"temp {alt}", f"peak {alt}"] if compare else []
        header += ["fits"] if usable is not None else []
        rows = []
        for r in self.rows:
            cells = [str(r.stage), r.offload, *(in_unit(r.device.get(k, 0), unit) for k in keys)]
            cells += [in_unit(sum(r.host.values()), unit), in_unit(r.gathered_layer, unit)]
            for shown, v in (
                (comm, r.comm_bytes),
                (cross, r.cross_replica_bytes),
                (model, r.model_axis_bytes),
                (seq, r.seq_axis_bytes),
                (pipe, r.pipe_axis_bytes),
                (expert, r.expert_axis_bytes),
            ):
                if shown:
                    cells.append("-" if v is None else in_unit(v, unit))
            for v in (r.argument_bytes, r.temp_bytes):
                cells.append("-" if v is None else in_unit(v, unit))
            cells.append(in_unit(r.peak, unit))
            if compare:
                for v in (r.other_temp_bytes, r.other_peak_bytes):
                    cells.append("-" if v is None else in_unit(v, unit))
            if usable is not None:
                cells.append(_fits(r, usable))
            rows.append(cells)
        where = (
            "not measured (no batch)"
            if self.measured_devices is None
            else f"measured on the local {self.measured_devices} devices"
        )
        lines = [self.title, f"Per-device memory ({unit[0]})", *render_columns(header, rows)]
        lines += [
            f"model state (params ... host, gathered): the plan on {self.devices} devices; "
            f"args, temp: compiled step's memory_analysis(), {where}.",
            "peak = resident model state + other args (batch) + temp + outputs not aliased; "
            "grads and the gathered layer are part of temp.",
        ]
        if compare:
            mine = {r.checkpointing for r in self.rows}
            lines.append(
                f"temp, peak: activation_checkpointing policy {'/'.join(sorted(mine))} (the "
                f"config's); temp {alt}, peak {alt}: policy {other}; '-': not measured."
            )
        if comm:
            lines.append(
                "comm/step: bytes of every collective of the compiled step (full buffers)"
                + (
                    "; x-replica/step: the part whose device groups span the replica axis "
                    "(across hosts)."
                    if cross
                    else "."
                )
            )
        within = {
            "model/step: the part within the model axis (tensor parallelism's activation "
            "all-reduces)": model,
            "seq/step: within the seq axis (sequence parallelism's all-to-alls)": seq,
            "pipe/step: within the pipe axis (activations and their gradients between "
            "neighbouring stages)": pipe,
            "expert/step: within the expert axis (the tokens' all-to-alls)": expert,
        }
        if any(within.values()):
            lines.append("; ".join(text for text, shown in within.items() if shown) + ".")
        if compare and usable is not None:
            lines.append("fits: yes (without activation checkpointing), AC (only with it), no.")
        if self.recommendation is not None:
            lines.append(str(self.recommendation))
        return "\n".join(lines)

    def bars(self) -> list[tuple[str, Mapping[str, float], Mapping[str, float]]]:
        """(label, device bytes by category, host bytes by category) per row, for plots."""
        out = []
        for r in self.rows:
            host = {k.replace("_", " "): float(v) for k, v in r.host.items()}
            for i, (policy, _, peak) in enumerate(r.variants()):
                device = {k.replace("_", " "): float(v) for k, v in r.device.items()}
                rest = peak - sum(r.device.values())
                if r.measured and rest > 0:
                    device["activations and temporaries"] = float(rest)
                label = f"{r.stage}\n{r.offload}"
                if self.compares_checkpointing:
                    label += "\n+AC" if recomputes(policy) else "\nno AC"
                out.append((label, device, host if i == 0 else {}))
        return out

    def plot(self, path: str) -> None:
        """Draws the stages as horizontal stacked bars into a PNG file, each marked fits or not
        and the recommended one starred; each activation-checkpointing setting measured is a
        bar of its own."""
        limit = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        unit = unit_for(self._largest())
        options = [
            (r.stage, r.offload, recomputes(p)) for r in self.rows for p, _, _ in r.variants()
        ]
        pick = recommended_index(options, self.recommendation)
        plot_bars(path, self.title, self.bars(), limit=limit, unit=unit, recommended=pick)


def _fits(row: StageMemory, usable: float) -> str:
    """``yes`` (fits without activation checkpointing), ``AC`` (only with it) or ``no``."""
    without, with_ac = row.peak_with(False), row.peak_with(True)
    if without is not None and without <= usable:
        return "yes"
    return "AC" if with_ac is not None and with_ac <= usable else "no"
