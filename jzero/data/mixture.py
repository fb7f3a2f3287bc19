"""Rows of several sources as one row set: weighted (a mixture) or end to end (eval rows).

Decisions:

* A mixture of sources ``j`` with weights ``w_j`` has ``N = sum_j n_j`` rows per epoch, where
  ``n_j = round(w_j / sum(w) * sum_j N_j)`` (at least 1 for a positive weight): each source
  gives its share of as many rows as the sources hold together. Slot ``t`` of source ``j`` in
  epoch ``e`` reads its row ``perm_j[(t + e * n_j) mod N_j]`` (``perm_j`` fixed by the seed): a
  source drawn less than its size walks on through its rows epoch by epoch, one drawn more is
  repeated. The epoch's shuffle (:mod:`~jzero.data.order`) then mixes the slots.
* Weights are checked: a negative weight, or no positive one, is a
  :class:`~jzero.data.errors.DataError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jzero.data.errors import DataError
from jzero.data.iterator import Rows

__all__ = ["ConcatRows", "MixedRows", "mixture_counts"]


def mixture_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Rows per epoch each source gives (see the module's decisions)."""
    for j, w in enumerate(weights):
        if not w >= 0:  # NaN too
            raise DataError(
                f"data.mixture[{j}] has weight {w}; weights must be >= 0. Fix the weight."
            )
    total_weight = float(sum(weights))
    if total_weight <= 0:
        raise DataError(
            f"data.mixture weights {list(weights)} are all zero: give a source a positive weight."
        )
    total = sum(sizes)
    return [max(1, round(w / total_weight * total)) if w > 0 else 0 for w in weights]


class _Parts:
    def __init__(self, parts: Sequence[Rows], counts: Sequence[int]):
        self.parts = list(parts)
        self.counts = np.asarray(counts, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _find(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        j = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return j, index - int(self.offsets[j])


class MixedRows(_Parts):
    """Weighted rows of ``parts`` (see the module's decisions)."""

    def __init__(self, parts: Sequence[Rows], weights: Sequence[float], seed: int):
        super().__init__(parts, mixture_counts([len(p) for p in parts], weights))
        self.perms = [
            np.random.default_rng([seed, 1 + j, 7]).permutation(len(p))
            for j, p in enumerate(self.parts)
        ]

    def get(self, index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``index`` of epoch ``epoch``'s slots."""
        j, t = self._find(index)
        perm = self.perms[j]
        return self.parts[j].get(int(perm[(t + epoch * int(self.counts[j])) % len(perm)]), epoch)


class ConcatRows(_Parts):
    """The rows of ``parts``, one after another."""

    def __init__(self, parts: Sequence[Rows]):
        super().__init__(parts, [len(p) for p in parts])

    def get(self, index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``index``."""
        j, t = self._find(index)
        return self.parts[j].get(t, epoch)
