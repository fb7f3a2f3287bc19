"""Stage 3's gather order: DeepSpeed's prefetch and reuse knobs on the traced gathers.

One recording pass of :mod:`jzero.rewrite.gather`'s replay lists where the step gathers parameters
(:class:`GatherEvent`); these pure functions turn that order into decisions:
:func:`prefetch_anchors` (``stage3_prefetch_bucket_size``: which earlier use a gather may start
at) and :func:`kept_leaves` (``stage3_max_reuse_distance`` within
``stage3_max_live_parameters``: which leaves are gathered once and kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GatherEvent", "kept_leaves", "prefetch_anchors"]


@dataclass(frozen=True)
class GatherEvent:
    """One place the program gathers parameters: ``leaves`` maps leaf index to the elements
    gathered; ``kind`` is ``use`` (a use outside scans and checkpointed layers), ``layer`` (a
    checkpointed layer of a Python loop) or ``scan`` (a stacked leaf, one slice at a time);
    ``unit``: the most elements gathered at once here."""

    leaves: dict[int, int]
    kind: str
    unit: int


def _between(events: Sequence[GatherEvent], leaf: int) -> int:
    """Elements of the other leaves ``events`` gather (each leaf counted once)."""
    sizes: dict[int, int] = {}
    for e in events:
        for i, n in e.leaves.items():
            if i != leaf:
                sizes[i] = max(sizes.get(i, 0), n)
    return sum(sizes.values())


def kept_leaves(events: Sequence[GatherEvent], distance: int, max_live: int) -> frozenset[int]:
    """DeepSpeed's ``stage3_max_reuse_distance`` on a recorded gather order: the leaves whose
    every next use is within ``distance`` elements of other gathered parameters are gathered
    once and kept until their last backward use.

    A leaf's reuses are its later forward uses (a tied embedding) and, after its last forward
    use, its backward use: the backward pass mirrors the forward, so that distance is twice
    what is gathered after it. Leaves with the shortest distance are kept first, while the
    kept elements plus the largest unit gathered stay within ``max_live``
    (``stage3_max_live_parameters``). Only uses outside scans and checkpointed layers count.
    """
    fixed = {i for e in events if e.kind != "use" for i in e.leaves}
    largest = max((e.unit for e in events), default=0)
    candidates = []
    for leaf in sorted({i for e in events if e.kind == "use" for i in e.leaves} - fixed):
        pos = [k for k, e in enumerate(events) if leaf in e.leaves]
        gaps = [_between(events[a + 1 : b], leaf) for a, b in zip(pos, pos[1:], strict=False)]
        gaps.append(2 * _between(events[pos[-1] + 1 :], leaf))
        if max(gaps) <= distance:
            size = max(events[k].leaves[leaf] for k in pos)
            candidates.append((max(gaps), leaf, size))
    kept, total = set(), 0
    for _, leaf, size in sorted(candidates):
        if total + size + largest <= max_live:
            kept.add(leaf)
            total += size
    return frozenset(kept)


def prefetch_anchors(events: Sequence[GatherEvent], bucket: int) -> list[int]:
    """DeepSpeed's ``stage3_prefetch_bucket_size`` on a recorded gather order: per use (the
    ``use`` events, in order), the earliest use whose operands its gather may wait for, such
    that what is gathered from there to it is at most ``bucket`` elements."""
    uses = [k for k, e in enumerate(events) if e.kind == "use"]
    anchors = []
    for j, at in enumerate(uses):
        i = j
        while i > 0 and sum(sum(e.leaves.values()) for e in events[uses[i - 1] + 1 : at + 1]) <= (
            bucket
        ):
            i -= 1
        anchors.append(i)
    return anchors
