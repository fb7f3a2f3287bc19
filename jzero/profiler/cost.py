"""The compiled step's cost (XLA's own count of FLOPs and bytes), the device's peak, and MFU.

Decisions:

* **The compiled program's numbers.** ``compiled.cost_analysis()`` is XLA's count for one
  device's partition of the step: every FLOP it runs (matmuls, elementwise work, the optimizer
  update, a replicated update counted on every device) and the bytes it reads and writes. The
  step's total is that times the devices. These are the "hardware" FLOPs; MFU counts the
  model's (:mod:`jzero.profiler.modules`: 3x the forward matmuls), so recomputation and
  replication do not raise it.
* **Peaks from a table of known accelerators** (dense bfloat16 tensor-core / MXU FLOP/s per
  device, the figure MFU is conventionally quoted against), matched on ``device_kind``; a
  ``peak_flops`` key overrides it. On CPU, and on an accelerator not in the table, the peak is
  unknown and no MFU is reported: a guess would be a made-up number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PEAK_FLOPS", "StepCost", "mfu", "peak_flops", "step_cost"]

PEAK_FLOPS: dict[str, float] = {
    # NVIDIA, dense bf16 tensor cores (SXM parts)
    "H200": 989.4e12,
    "H100": 989.4e12,
    "GH200": 989.4e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16)
    # Google TPUs, bf16 per chip
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
}
"""Dense bfloat16 peak FLOP/s per device, by a substring of ``jax.Device.device_kind``."""


@dataclass(frozen=True)
class StepCost:
    """XLA's cost of one device's partition of a compiled step.

    Attributes:
      flops: floating-point operations per device per step.
      bytes_accessed: bytes read and written per device per step.
      devices: the devices the step runs on (the step's total is ``flops * devices``).
    """

    flops: float
    bytes_accessed: float
    devices: int

    @property
    def total_flops(self) -> float:
        return self.flops * self.devices


def step_cost(compiled: Any, devices: int) -> StepCost:
    """The :class:`StepCost` of a ``jax.stages.Compiled`` step run on ``devices`` devices."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per partition
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return StepCost(
        float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)), devices
    )


def peak_flops(device: Any, override: float | None = None) -> float | None:
    """The device's dense bf16 peak FLOP/s: ``override`` when given, else the table's entry for
    its ``device_kind``, else ``None`` (unknown: CPU, or an accelerator not in the table)."""
    if override:
        return float(override)
    if getattr(device, "platform", "cpu") == "cpu":
        return None
    kind = str(getattr(device, "device_kind", ""))
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):  # "GH200" before "H200"
        if name.lower() in kind.lower():
            return PEAK_FLOPS[name]
    return None


def mfu(model_flops: float, seconds: float, devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the model's FLOPs of one step over what ``devices`` devices at
    ``peak`` could do in ``seconds``; ``None`` when the peak is unknown."""
    if not peak or seconds <= 0:
        return None
    return model_flops / (seconds * devices * peak)
