"""The names of ``pipeline.schedule``: the schedules :func:`jzero.choices.schedules.make_schedule`
builds, which the config validates against."""

from __future__ import annotations

__all__ = ["SCHEDULES", "virtual_stages"]

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
"""The schedules :func:`make_schedule` builds (``pipeline.schedule``)."""


def virtual_stages(schedule: str, given: int | None = None) -> int:
    """``pipeline.virtual_stages``: the chunks of layers each stage holds, ``given`` where
    set, else 2 under ``interleaved_1f1b`` and 1 under the other schedules."""
    if given:
        return int(given)
    return 2 if schedule == "interleaved_1f1b" else 1
