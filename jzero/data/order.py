"""Sample order: which packed row each global sample index reads, and which samples a
process's rows of a global batch are.

Decisions:

* Epoch ``e`` is a permutation of the ``N`` rows drawn from ``(seed, e)``: shuffling without
  replacement per epoch. Global sample ``s = e * N + i`` reads row ``perm_e[i]``.
* A global batch is ``B`` consecutive samples; process ``p`` of ``P`` reads its ``B / P`` of
  them, ``p * B / P`` on. Which samples form a batch depends on the seed and the first sample
  alone, never on the process count, so a position (the next global sample) resumes under any
  process count or global batch size with exactly the next samples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jzero.data.errors import DataError

__all__ = ["BatchSpec", "epoch_permutation", "locate", "sample_ids"]


@dataclass(frozen=True)
class BatchSpec:
    """The global batch (rows over all processes) and this process's share of it."""

    global_batch: int
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self):
        if self.global_batch < 1:
            raise DataError(f"The global batch must be positive, got {self.global_batch}.")
        if not 0 <= self.process_index < self.process_count:
            raise DataError(
                f"process_index={self.process_index} is not in [0, {self.process_count})."
            )
        if self.global_batch % self.process_count:
            raise DataError(
                f"The global batch {self.global_batch} is not divisible by process_count="
                f"{self.process_count}. Choose a batch that is a multiple of the process count."
            )

    @property
    def local(self) -> int:
        """Rows this process reads per batch."""
        return self.global_batch // self.process_count


def sample_ids(
    batch: int, global_batch: int, process_index: int = 0, process_count: int = 1, start: int = 0
) -> np.ndarray:
    """The global sample indices process ``process_index`` reads for global batch ``batch``,
    batches counted from sample ``start``."""
    local = BatchSpec(global_batch, process_index, process_count).local
    first = start + batch * global_batch + process_index * local
    return np.arange(first, first + local, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def epoch_permutation(seed: int, epoch: int, rows: int) -> np.ndarray:
    """Epoch ``epoch``'s order of ``rows`` rows, from ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch]).permutation(rows)


def locate(sample: int, seed: int, rows: int) -> tuple[int, int]:
    """``(epoch, row)`` global sample ``sample`` reads."""
    epoch, i = divmod(int(sample), rows)
    return epoch, int(epoch_permutation(seed, epoch, rows)[i])
