"""The names of ``pipeline.schedule``: the schedules :func:`jzero.distributed.make_schedule`
builds, which the config validates against."""

from __future__ import annotations

__all__ = ["SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble")
"""The schedules :func:`jzero.distributed.make_schedule` builds (``pipeline.schedule``)."""
