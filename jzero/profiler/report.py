"""One step's profile (DeepSpeed's ``flops_profiler`` printout): the compiled step's FLOPs and
bytes, its time, achieved FLOP/s and MFU, and the model's FLOPs per module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jzero.profiler.cost import StepCost, mfu

__all__ = ["FlopsProfile"]


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}".rstrip()


@dataclass(frozen=True)
class FlopsProfile:
    """What the profiler measured at one step.

    Attributes:
      step: the step profiled (1-based, as DeepSpeed's ``profile_step``).
      cost: XLA's cost of one device's partition of the compiled step.
      seconds: the step's wall time (dispatch to the result ready).
      forward: the model's forward FLOPs per module (matmuls), the whole global batch.
      params: parameters per module (same keys where a module owns parameters).
      peak: the device's peak FLOP/s, ``None`` when unknown.
      device_kind: the device's name.
      recompute_fwd_factor: forward passes repeated by activation checkpointing (0 to 1).
    """

    step: int
    cost: StepCost
    seconds: float
    forward: dict[str, int]
    params: dict[str, int] = field(default_factory=dict)
    peak: float | None = None
    device_kind: str = ""
    recompute_fwd_factor: float = 0.0

    @property
    def model_flops(self) -> float:
        """The model's FLOPs of one step: forward + backward (2x) + recomputed forward."""
        return (3.0 + self.recompute_fwd_factor) * sum(self.forward.values())

    @property
    def mfu(self) -> float | None:
        return mfu(self.model_flops, self.seconds, self.cost.devices, self.peak)

    def summary(self) -> dict[str, Any]:
        """The figures as plain numbers (for logs and JSON)."""
        return {
            "step": self.step,
            "devices": self.cost.devices,
            "flops_per_device": self.cost.flops,
            "flops_total": self.cost.total_flops,
            "bytes_per_device": self.cost.bytes_accessed,
            "model_flops": self.model_flops,
            "seconds": self.seconds,
            "flops_per_s_per_device": self.cost.flops / self.seconds if self.seconds else None,
            "peak_flops": self.peak,
            "mfu": self.mfu,
        }

    def format(self, top_modules: int = 1, detailed: bool = True) -> str:
        """The printout: totals, then the ``top_modules`` (``-1``: all) most expensive modules
        when ``detailed``."""
        c, s = self.cost, self.seconds
        lines = [
            "-" * 30 + " jzero flops profiler " + "-" * 30,
            f"Profile summary at step {self.step}:",
            f"devices:                              {c.devices} ({self.device_kind})",
            f"compiled step FLOPs per device:       {_si(c.flops, 'FLOPs')}",
            f"compiled step FLOPs, all devices:     {_si(c.total_flops, 'FLOPs')}",
            f"bytes accessed per device:            {_si(c.bytes_accessed, 'B')}",
            f"model FLOPs (fwd + bwd, matmuls):     {_si(self.model_flops, 'FLOPs')}",
            f"step time:                            {s * 1e3:.2f} ms",
            f"achieved FLOP/s per device:           {_si(c.flops / s if s else 0, 'FLOPS')}",
        ]
        if self.peak is None:
            lines.append(
                "peak FLOP/s per device:               unknown on this device (set "
                "flops_profiler.peak_flops to report MFU)"
            )
        else:
            lines.append(f"peak FLOP/s per device:               {_si(self.peak, 'FLOPS')}")
            lines.append(f"MFU (model FLOPs / peak x time):      {100 * (self.mfu or 0):.2f}%")
        if detailed and self.forward:
            total = sum(self.forward.values()) or 1
            items = list(self.forward.items())
            if top_modules is not None and top_modules >= 0:
                items = items[: max(top_modules, 1)]
            lines += [
                "",
                "Per module (forward matmul FLOPs of the step's batch; training ~3x):",
                f"{'module':<40} {'params':>12} {'fwd FLOPs':>14} {'share':>7}",
            ]
            for name, flops in items:
                n = self.params.get(name)
                count = f"{n:,}" if n is not None else "-"
                lines.append(f"{name:<40} {count:>12} {_si(flops):>14} {flops / total:>7.1%}")
        lines.append("-" * 82)
        return "\n".join(lines)
