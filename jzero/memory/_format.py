"""Sizes in and out, and the recommendation every memory report ends with.

Decisions:

* Sizes are printed in GiB (2^30 bytes; the plan picks the binary unit of its sizes), the
  one unit of ``jzero estimate`` and ``jzero plan``; GB (10^9) only where DeepSpeed's own
  figures are quoted (DeepSpeed prints bytes / 2^30 and labels them GB). Sizes are written
  ``80GB`` (10^9), ``80GiB`` or ``8e10``: :func:`parse_size` reads them, and its error lists
  every unit.
* Counts (parameters, devices) must be positive; a bad one is named with an example of a good
  one. The margin is a fraction in [0, 1).
* "Fits" keeps a margin (10% by default) of the device memory for what no formula counts
  (allocator fragmentation, the runtime, and for the closed-form estimate without a transformer
  shape the activations).
* The recommendation weighs the levers in the order of their cost: the lowest ZeRO stage that
  fits without activation checkpointing and without offload; then, only if none does,
  activation checkpointing (it costs about one extra forward pass per step), lowest stage
  first; then offload to host memory (optimizer before optimizer+params), each without
  activation checkpointing before with it. When nothing fits: the option that needs least, and
  how much memory is missing.
* An option is ``(stage, offload, checkpointing, bytes)``; ``checkpointing`` is ``None`` (not
  known), ``"none"`` (without) or the policy (``"full"``, ``"dots"`` ...). Where any option has
  activation checkpointing, the recommendation also says which lever made it fit and by how
  much every option that does not fit is short ("compute how short you are"); otherwise its
  text is the stage-only one.
* Tables are plain aligned text columns; sizes are shown in a given unit or the largest binary
  unit that keeps the number at least 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jzero._util import byte_unit, format_bytes, read_size

__all__ = ["GB", "GIB", "Recommendation", "parse_size"]

GB = 10**9
"""A GB as sizes are written (``80GB``), 10^9 bytes."""
GIB = 2**30
"""The unit the estimate prints its sizes in, 2^30 bytes."""
_OFFLOAD_ORDER = ("none", "optimizer", "params", "optimizer+params", "nvme")


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
    number = read_size(value) if isinstance(value, int | float | str) else None
    if number is None or not math.isfinite(number) or number < 1:
        raise ValueError(
            f"{what}: {value!r} is not a memory size. Write a positive number of bytes with an "
            "optional unit, one of B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
            "(powers of 1024), e.g. 80GB, 80GiB or 8e10."
        )
    return int(number)


def check_positive(value: Any, what: str, example: str, integer: bool = False) -> Any:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0 or (integer and number != int(number)):
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{what}: {value!r} is not allowed; it must be {kind}, e.g. {example}.")
    return int(number) if integer else number


def check_margin(margin: float) -> float:
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(
            f"margin: {margin!r} is not allowed; it is the fraction of device memory kept free "
            "and must be at least 0 and below 1, e.g. 0.1 for 10%."
        )
    return float(margin)


def in_unit(n: float, unit: tuple[str, float]) -> str:
    return f"{n / unit[1]:.2f}"


def unit_for(n: float) -> tuple[str, float]:
    return byte_unit(n)


def _format_size(n: float, unit: tuple[str, float] | None = None) -> str:
    return format_bytes(n, digits=2, unit=unit)


def render_columns(
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


def recomputes(checkpointing: str | None) -> bool:
    """Whether an option's activation-checkpointing policy recomputes anything."""
    return checkpointing not in (None, "none")


def _option_name(stage: int, offload: str, checkpointing: str | None) -> str:
    what = f"ZeRO stage {stage}"
    if recomputes(checkpointing):
        what += f" with activation checkpointing (policy {checkpointing})"
    if offload != "none":
        what += f" with {offload} offload to host memory"
    return what


@dataclass(frozen=True)
class Recommendation:
    """The cheapest option (see the lever order above) whose need fits the usable device memory.

    Attributes:
      fits: whether any option fits.
      stage: the recommended stage, or the stage of the smallest option when none fits.
      offload: ``"none"``, ``"optimizer"`` or ``"optimizer+params"``.
      needed: bytes per device that option needs.
      usable: bytes per device usable: device memory less the margin.
      device_memory: the device memory in bytes.
      margin: the fraction of device memory kept free.
      unit: (name, bytes) to print sizes in; ``None`` picks a binary unit per size.
      checkpointing: the activation-checkpointing policy of the option (``"none"`` without);
        ``None`` when no option had activation checkpointing (it was not weighed).
      short: ``(stage, offload, checkpointing, bytes short)`` of every option that does not
        fit, in the order the levers are weighed; empty when activation checkpointing was not
        weighed.
    """

    fits: bool
    stage: int
    offload: str
    needed: float
    usable: float
    device_memory: int
    margin: float
    unit: tuple[str, float] | None = None
    checkpointing: str | None = None
    short: tuple[tuple[int, str, str | None, float], ...] = ()

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the recommended option uses activation checkpointing."""
        return recomputes(self.checkpointing)

    @property
    def lever(self) -> str | None:
        """What made it fit: ``"stage"``, ``"activation checkpointing"``, ``"offload"``, or
        ``None`` (stage 0 as it is, or nothing fits)."""
        if not self.fits:
            return None
        if self.offload != "none":
            return "offload"
        if self.activation_checkpointing:
            return "activation checkpointing"
        return "stage" if self.stage else None

    def __str__(self) -> str:
        show = lambda n: _format_size(n, self.unit)
        what = _option_name(self.stage, self.offload, self.checkpointing)
        budget = f"{show(self.usable)} usable ({1 - self.margin:.0%} of {show(self.device_memory)})"
        if self.fits:
            text = f"Recommendation: {what}; it needs {show(self.needed)} per device of {budget}."
        else:
            text = (
                f"No stage fits: the smallest option, {what}, needs {show(self.needed)} per "
                f"device, {show(self.needed - self.usable)} more than the {budget}. Use more "
                "devices, devices with more memory, or a smaller model or micro batch."
            )
        if self.checkpointing is None:
            return text
        return "\n".join([text, *self._lever_lines(show)])

    def _lever_lines(self, show: Any) -> list[str]:
        lines = []
        if self.lever == "stage" or (self.fits and self.lever is None):
            first = "the ZeRO stage" if self.stage else "none needed"
            lines.append(
                f"  Lever: {first}; stage {self.stage} is the lowest that fits without "
                "activation checkpointing or offload."
            )
        elif self.lever == "activation checkpointing":
            lines.append(
                "  Lever: activation checkpointing (about one extra forward pass per step); no "
                f"stage fits without it, stage {self.stage} is the lowest that fits with it."
            )
        elif self.lever == "offload":
            also = " and activation checkpointing" if self.activation_checkpointing else ""
            lines.append(
                f"  Lever: {self.offload} offload to host memory{also}; no stage fits without "
                "offload, with or without activation checkpointing."
            )
        groups: dict[str, list[str]] = {}
        for stage, offload, checkpointing, missing in self.short:
            key = ("with" if recomputes(checkpointing) else "without") + " activation checkpointing"
            if offload != "none":
                key = f"{offload} offload, {key}"
            groups.setdefault(key, []).append(f"stage {stage} by {show(missing)}")
        if groups:
            parts = "; ".join(f"{key}: {', '.join(v)}" for key, v in groups.items())
            lines.append(f"  Short of the {show(self.usable)} usable: {parts}.")
        return lines


def _lever_key(option: Sequence[Any]) -> tuple[bool, int, bool, int]:
    stage, offload, checkpointing = option[0], option[1], option[2]
    return (offload != "none", _OFFLOAD_ORDER.index(offload), recomputes(checkpointing), stage)


def recommend(
    options: Sequence[tuple[int, str, str | None, float]],
    device_memory: int | None,
    margin: float,
    unit: tuple[str, float] | None = None,
) -> Recommendation | None:
    """The first option in lever order that fits, or the smallest when none does."""
    if device_memory is None or not options:
        return None
    usable = device_memory * (1 - margin)
    ordered = sorted(options, key=_lever_key)
    weighed = any(recomputes(o[2]) for o in ordered)
    short = tuple((s, o, c, n - usable) for s, o, c, n in ordered if n > usable) if weighed else ()
    pick = next((o for o in ordered if o[3] <= usable), None)
    fits = pick is not None
    if pick is None:
        pick = min(ordered, key=lambda o: o[3])
    stage, offload, checkpointing, needed = pick
    if not weighed:
        checkpointing = None
    elif checkpointing is None:
        checkpointing = "none"
    return Recommendation(
        fits, stage, offload, needed, usable, device_memory, margin, unit, checkpointing, short
    )


def recommended_index(
    options: Sequence[tuple[int, str, bool]], recommendation: Recommendation | None
) -> int | None:
    """The index in ``options`` (stage, offload, activation checkpointing) of the recommended
    option, for a plot to mark; ``None`` without a device memory or when nothing fits."""
    if recommendation is None or not recommendation.fits:
        return None
    key = (recommendation.stage, recommendation.offload, recommendation.activation_checkpointing)
    return options.index(key) if key in options else None


def find_row(rows: Sequence[Any], stage: int, offload: str) -> Any:
    """The row of ``rows`` for one stage and offload option, or a ``KeyError`` listing them."""
    for r in rows:
        if (r.stage, r.offload) == (stage, offload):
            return r
    have = ", ".join(f"({r.stage}, {r.offload!r})" for r in rows)
    raise KeyError(f"No row for stage {stage} with offload {offload!r}; the rows are {have}.")
