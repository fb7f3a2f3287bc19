"""The closed-form estimate: ZeRO's per-device model-state memory for any model and device count.

Decisions:

* Device memory of the model states follows the ZeRO paper with mixed-precision Adam (K = 12:
  fp16 params 2 + fp16 grads 2 + fp32 master params, momentum and variance 12 bytes per
  parameter): stage 0 16 Psi, stage 1 4 Psi + 12 Psi/N, stage 2 2 Psi + 14 Psi/N, stage 3
  16 Psi/N bytes, Psi = parameter count, N = devices.
* Offload and host memory follow DeepSpeed's estimators
  (``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``,
  ``additional_buffer_factor`` 1.5, host memory per node): stages 1-2 with optimizer offload keep
  2 Psi on the device and Psi x max(4 N, 16) x 1.5 on the host; stage 3 with optimizer offload
  2 Psi/N + 4 LL on the device and 16 Psi / nodes x 1.5 on the host; stage 3 with optimizer and
  parameter offload 4 LL on the device and 18 Psi / nodes x 1.5 on the host, LL being the
  largest layer's parameter count (4 bytes: its fp16 params and grads, gathered at once; stage 3
  without offload adds it too).
* Without offload the host holds the fp32 model while it is loaded: 4 Psi x devices per node x
  1.5, at stage 3 only the largest layer (parameters are created in their shards, DeepSpeed's
  ``zero_init``).
* Communication per step, in elements: stage 0 2 Psi (all-reduce), stages 1-2 2 Psi
  (reduce-scatter + all-gather), stage 3 3 Psi.
* Activations are not counted; the margin of the recommendation is kept for them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from jzero.memory._format import (
    GB,
    Recommendation,
    _check_margin,
    _positive,
    _recommend,
    _render,
    find_row,
    parse_size,
)
from jzero.memory._plot import plot_bars

__all__ = ["BUFFER_FACTOR", "Estimate", "EstimateRow", "Offload", "estimate"]

BUFFER_FACTOR = 1.5
_COMM = {
    0: (2.0, "2 Psi all-reduce"),
    1: (2.0, "Psi reduce-scatter + Psi all-gather"),
    2: (2.0, "Psi reduce-scatter + Psi all-gather"),
    3: (3.0, "2 Psi all-gather + Psi reduce-scatter"),
}
Offload = Literal["none", "cpu"]


@dataclass(frozen=True)
class EstimateRow:
    """One option of :func:`estimate`: a stage with or without offload.

    Attributes:
      stage: the ZeRO stage.
      offload: ``"none"``, ``"optimizer"`` or ``"optimizer+params"``.
      device: bytes per device by category.
      host: bytes of host memory per node by category.
      comm_psi: communication volume per step in units of Psi (elements).
      comm: the collectives behind ``comm_psi``.
    """

    stage: int
    offload: str
    device: Mapping[str, float]
    host: Mapping[str, float]
    comm_psi: float
    comm: str

    @property
    def device_bytes(self) -> float:
        """Bytes per device."""
        return sum(self.device.values())

    @property
    def host_bytes(self) -> float:
        """Bytes of host memory per node."""
        return sum(self.host.values())


@dataclass(frozen=True)
class Estimate:
    """The result of :func:`estimate`; ``table()`` prints it, ``plot(path)`` draws it."""

    params: float
    devices: int
    devices_per_node: int
    rows: tuple[EstimateRow, ...]
    device_memory: int | None = None
    margin: float = 0.1
    largest_layer_params: float = 0
    additional_buffer_factor: float = BUFFER_FACTOR

    @property
    def recommendation(self) -> Recommendation | None:
        """The lowest stage that fits (offload only if needed); ``None`` without a memory size."""
        options = [(r.stage, r.offload, r.device_bytes) for r in self.rows]
        return _recommend(options, self.device_memory, self.margin, ("GB", GB))

    def row(self, stage: int, offload: str = "none") -> EstimateRow:
        """The row of one option."""
        return find_row(self.rows, stage, offload)

    def table(self) -> str:
        """The estimate as text: one row per option, the conventions, the recommendation."""
        nodes = self.devices // self.devices_per_node
        usable = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        header = ["stage", "offload", "device GB", "host GB/node", "comm/step"]
        header += (["fits"] if usable is not None else []) + ["collectives"]
        rows = []
        for r in self.rows:
            cells = [str(r.stage), r.offload, f"{r.device_bytes / GB:.2f}"]
            cells += [f"{r.host_bytes / GB:.2f}", f"{r.comm_psi:g} Psi"]
            if usable is not None:
                cells.append("yes" if r.device_bytes <= usable else "no")
            rows.append([*cells, r.comm])
        lines = [
            f"ZeRO model states per device: Psi = {self.params:.4g} parameters, "
            f"N = {self.devices} devices ({nodes} node(s) x {self.devices_per_node}); "
            "GB = 10^9 bytes",
            *_render(header, rows, (1, len(header) - 1)),
            "device: ZeRO paper, mixed-precision Adam (K = 12): 16 Psi, 4 Psi + 12 Psi/N, "
            "2 Psi + 14 Psi/N, 16 Psi/N for stages 0-3",
            f"  (+ 4 bytes x the largest layer's {self.largest_layer_params:.4g} parameters "
            "at stage 3, gathered at once).",
            "offload and host: DeepSpeed's estimators, additional_buffer_factor "
            f"{self.additional_buffer_factor:g}, host memory per node: offload at stages 1-2 "
            "2 Psi / Psi x max(4 N, 16) x 1.5;",
            "  stage 3 optimizer offload 2 Psi/N + 4 LL / 16 Psi/nodes x 1.5; stage 3 optimizer "
            "+ params 4 LL / 18 Psi/nodes x 1.5; no offload: 4 Psi x devices per node x 1.5",
            "  while loading (stage 3: the largest layer only). Activations are not counted.",
        ]
        if self.recommendation is not None:
            lines.append(str(self.recommendation))
        return "\n".join(lines)

    def bars(self) -> list[tuple[str, Mapping[str, float], Mapping[str, float]]]:
        """(label, device bytes by category, host bytes by category) per option, for plots."""
        return [(f"{r.stage}\n{r.offload}", r.device, r.host) for r in self.rows]

    def plot(self, path: str) -> None:
        """Draws the options as stacked bars (device solid, host per node hatched) into a PNG."""
        limit = None if self.device_memory is None else self.device_memory * (1 - self.margin)
        title = f"ZeRO estimate: {self.params:.3g} parameters on {self.devices} devices"
        plot_bars(path, title, self.bars(), limit=limit, unit=("GB", GB))


def estimate(
    params: float | str,
    devices: int,
    devices_per_node: int | None = None,
    device_memory: int | str | None = None,
    offload: Offload | None = None,
    *,
    largest_layer_params: float = 0,
    margin: float = 0.1,
    additional_buffer_factor: float = BUFFER_FACTOR,
) -> Estimate:
    """Closed-form per-device model-state memory of ZeRO stages 0-3, with and without offload.

    Args:
      params: the parameter count Psi, e.g. ``7.5e9``.
      devices: the number of data-parallel devices N.
      devices_per_node: devices per node (host figures are per node); by default the largest
        divisor of ``devices`` up to 8.
      device_memory: the memory of one device (bytes, or a size such as ``"80GB"``); with it
        the result marks what fits and recommends a stage.
      offload: ``None`` lists every option, ``"none"`` only those without offload, ``"cpu"``
        only those with offload to host memory.
      largest_layer_params: parameters of the largest layer, gathered whole at stage 3.
      margin: fraction of the device memory kept free (activations, fragmentation).
      additional_buffer_factor: DeepSpeed's slack on host memory.

    Returns:
      An :class:`Estimate`; ``print(result.table())``.

    Example:
      >>> e = estimate(7.5e9, 64)
      >>> round(e.row(0).device_bytes / 1e9, 1), round(e.row(3).device_bytes / 1e9, 3)
      (120.0, 1.875)
    """
    psi = _positive(params, "params", "7.5e9")
    n = _positive(devices, "devices", "64", integer=True)
    if devices_per_node is None:
        per_node = math.gcd(n, 8)
    else:
        per_node = _positive(devices_per_node, "devices_per_node", "8", integer=True)
        if n % per_node:
            raise ValueError(
                f"devices_per_node: {per_node} does not divide devices={n}, but the devices must "
                f"fill whole nodes. Pass a devices_per_node that divides {n}, e.g. "
                f"{math.gcd(n, per_node)}."
            )
    if offload not in (None, "none", "cpu"):
        raise ValueError(
            f"offload: {offload!r} is not allowed; it must be 'cpu' (only options with offload "
            "to host memory), 'none' (only options without) or None (all options)."
        )
    try:
        ll = float(largest_layer_params)
    except (TypeError, ValueError):
        ll = math.nan
    if not 0 <= ll <= psi:
        raise ValueError(
            f"largest_layer_params: {largest_layer_params!r} is not allowed; it must be between "
            f"0 and the parameter count {psi:.4g}."
        )
    memory = None if device_memory is None else parse_size(device_memory)
    buf, nodes = float(additional_buffer_factor), n // per_node
    loading = 4 * psi * per_node * buf
    rows = []
    if offload != "cpu":
        rows += [
            (0, "none", {"params": 2 * psi, "grads": 2 * psi, "optimizer state": 12 * psi}),
            (1, "none", {"params": 2 * psi, "grads": 2 * psi, "optimizer state": 12 * psi / n}),
            (2, "none", {"params": 2 * psi, "grads": 2 * psi / n, "optimizer state": 12 * psi / n}),
        ]
        rows = [(s, o, d, {"loading": loading}) for s, o, d in rows]
        stage3 = {"params": 2 * psi / n, "grads": 2 * psi / n, "optimizer state": 12 * psi / n}
        rows.append(
            (3, "none", {**stage3, "gathered layer": 4 * ll}, {"loading": 4 * ll * per_node * buf})
        )
    if offload != "none":
        host12 = {"grads and optimizer state": psi * max(4 * n, 16) * buf}
        rows += [(1, "optimizer", {"params": 2 * psi}, host12)]
        rows += [(2, "optimizer", {"params": 2 * psi}, host12)]
        rows.append(
            (
                3,
                "optimizer",
                {"params": 2 * psi / n, "gathered layer": 4 * ll},
                {"grads and optimizer state": 16 * psi / nodes * buf},
            )
        )
        rows.append(
            (
                3,
                "optimizer+params",
                {"gathered layer": 4 * ll},
                {"params, grads and optimizer state": 18 * psi / nodes * buf},
            )
        )
    out = tuple(
        EstimateRow(
            s, o, {k: v for k, v in d.items() if v}, {k: v for k, v in h.items() if v}, *_COMM[s]
        )
        for s, o, d, h in rows
    )
    return Estimate(psi, n, per_node, out, memory, _check_margin(margin), ll, buf)
