"""Compiled programs read back: HLO text, collective bytes, the facts of overlap.

Import direction: imports nothing else of jzero's; only tests, benchmarks and
:mod:`jzero.memory` import it.

* :mod:`~jzero.hlo.parse`: a program's text, its computations, instructions and device groups.
* :mod:`~jzero.hlo.collective_bytes`: collective executions and bytes per kind, axes and dtype.
* :mod:`~jzero.hlo.facts`: layout copies, asynchronous collectives, collectives in loops and
  collectives unordered against a loop.
"""

from jzero.hlo.collective_bytes import CollectiveStats as CollectiveStats
from jzero.hlo.collective_bytes import collectives as collectives
from jzero.hlo.collective_bytes import collectives_by_axes as collectives_by_axes
from jzero.hlo.collective_bytes import collectives_by_dtype as collectives_by_dtype
from jzero.hlo.collective_bytes import permute_sends as permute_sends
from jzero.hlo.facts import AsyncCollective as AsyncCollective
from jzero.hlo.facts import LayoutCopy as LayoutCopy
from jzero.hlo.facts import LoopCollective as LoopCollective
from jzero.hlo.facts import UnorderedCollective as UnorderedCollective
from jzero.hlo.facts import async_collectives as async_collectives
from jzero.hlo.facts import layout_copies as layout_copies
from jzero.hlo.facts import loop_collectives as loop_collectives
from jzero.hlo.facts import unordered_collectives as unordered_collectives
from jzero.hlo.parse import KINDS as KINDS
from jzero.hlo.parse import program_text as program_text
from jzero.hlo.parse import replica_groups as replica_groups
from jzero.hlo.parse import source_target_pairs as source_target_pairs

__all__ = [
    "async_collectives",
    "AsyncCollective",
    "collectives",
    "collectives_by_axes",
    "collectives_by_dtype",
    "CollectiveStats",
    "KINDS",
    "layout_copies",
    "LayoutCopy",
    "loop_collectives",
    "LoopCollective",
    "permute_sends",
    "program_text",
    "replica_groups",
    "source_target_pairs",
    "unordered_collectives",
    "UnorderedCollective",
]
