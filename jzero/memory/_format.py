"""Sizes in and out, and the recommendation every memory report ends with.

Decisions:

* GB means 10^9 bytes (the paper's 120 GB for 7.5e9 parameters); sizes are written ``80GB``,
  ``80GiB`` or ``8e10``. :func:`parse_size` reads them, and its error lists every unit.
* Counts (parameters, devices) must be positive; a bad one is named with an example of a good
  one. The margin is a fraction in [0, 1).
* "Fits" keeps a margin (10% by default) of the device memory for what no formula counts
  (allocator fragmentation, the runtime, and for the closed-form estimate the activations).
  The recommendation is the lowest stage that fits without offload; offload only if none does;
  when nothing fits, the option that needs least, and how much memory is missing.
* Tables are plain aligned text columns; sizes are shown in a given unit or the largest binary
  unit that keeps the number at least 1.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GB", "Recommendation", "parse_size"]

GB = 10**9
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
_OFFLOAD_ORDER = ("none", "optimizer", "params", "optimizer+params")


# -- input parsing -------------------------------------------------------------------------------


def parse_size(value: str | float, what: str = "device memory") -> int:
    """Reads a memory size: ``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"8e10"`` or a number.

    Args:
      value: the size, a string with an optional unit or a number of bytes.
      what: the name of the setting, for the error message.

    Returns:
      The size in bytes.

    Raises:
      ValueError: when ``value`` is not a positive size with a known unit.
    """
    number = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        unit = m.group(2).lower() or "b"
        if unit in _UNITS:
            number = float(m.group(1)) * _UNITS[unit]
    if number is None or not math.isfinite(number) or number < 1:
        raise ValueError(
            f"{what}: {value!r} is not a memory size. Write a positive number of bytes with an "
            "optional unit, one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
            "(powers of 1024), e.g. 80GB, 80GiB or 8e10."
        )
    return int(number)


def _positive(value: Any, what: str, example: str, integer: bool = False) -> Any:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0 or (integer and number != int(number)):
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{what}: {value!r} is not allowed; it must be {kind}, e.g. {example}.")
    return int(number) if integer else number


def _check_margin(margin: float) -> float:
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(
            f"margin: {margin!r} is not allowed; it is the fraction of device memory kept free "
            "and must be at least 0 and below 1, e.g. 0.1 for 10%."
        )
    return float(margin)


def _fmt(n: float, unit: tuple[str, float]) -> str:
    return f"{n / unit[1]:.2f}"


def _unit_for(n: float) -> tuple[str, float]:
    for name, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return name, size
    return "B", 1


def _show(n: float, unit: tuple[str, float] | None = None) -> str:
    name, size = _unit_for(n) if unit is None else unit
    return f"{n / size:.2f} {name}"


def _render(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (1,)
) -> list[str]:
    """Aligned text columns; the columns listed in ``left`` are left-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        cells = [
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), "-" * len(line(header)), *(line(r) for r in rows)]


# -- recommendation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    """The lowest stage (offload only if needed) whose need fits the usable device memory.

    Attributes:
      fits: whether any option fits.
      stage: the recommended stage, or the stage of the smallest option when none fits.
      offload: ``"none"``, ``"optimizer"`` or ``"optimizer+params"``.
      needed: bytes per device that option needs.
      usable: bytes per device usable: device memory less the margin.
      device_memory: the device memory in bytes.
      margin: the fraction of device memory kept free.
      unit: (name, bytes) to print sizes in; ``None`` picks a binary unit per size.
    """

    fits: bool
    stage: int
    offload: str
    needed: float
    usable: float
    device_memory: int
    margin: float
    unit: tuple[str, float] | None = None

    def __str__(self) -> str:
        show = lambda n: _show(n, self.unit)
        what = f"ZeRO stage {self.stage}" + (
            "" if self.offload == "none" else f" with {self.offload} offload to host memory"
        )
        budget = f"{show(self.usable)} usable ({1 - self.margin:.0%} of {show(self.device_memory)})"
        if self.fits:
            return f"Recommendation: {what}; it needs {show(self.needed)} per device of {budget}."
        return (
            f"No stage fits: the smallest option, {what}, needs {show(self.needed)} per device, "
            f"{show(self.needed - self.usable)} more than the {budget}. Use more devices, "
            "devices with more memory, or a smaller model or micro batch."
        )


def _recommend(
    options: Sequence[tuple[int, str, float]],
    device_memory: int | None,
    margin: float,
    unit: tuple[str, float] | None = None,
) -> Recommendation | None:
    if device_memory is None or not options:
        return None
    usable = device_memory * (1 - margin)
    ordered = sorted(options, key=lambda o: (o[1] != "none", _OFFLOAD_ORDER.index(o[1]), o[0]))
    for stage, offload, needed in ordered:
        if needed <= usable:
            return Recommendation(True, stage, offload, needed, usable, device_memory, margin, unit)
    stage, offload, needed = min(ordered, key=lambda o: o[2])
    return Recommendation(False, stage, offload, needed, usable, device_memory, margin, unit)


def find_row(rows: Sequence[Any], stage: int, offload: str) -> Any:
    """The row of ``rows`` for one stage and offload option, or a ``KeyError`` listing them."""
    for r in rows:
        if (r.stage, r.offload) == (stage, offload):
            return r
    have = ", ".join(f"({r.stage}, {r.offload!r})" for r in rows)
    raise KeyError(f"No row for stage {stage} with offload {offload!r}; the rows are {have}.")
