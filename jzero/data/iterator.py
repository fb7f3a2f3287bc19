"""The resumable training iterator: this process's rows of each global batch, prefetched by
Grain.

Decisions:

* Grain is imported here only. The rows a process reads form a ``grain.MapDataset`` whose
  element ``i`` is the ``i``-th sample it reads from the position on; ``.batch`` then
  ``.to_iter_dataset(ReadOptions(num_threads, prefetch_buffer_size))`` reads batches ahead in
  threads, so the step does not wait. Restoring rebuilds that pipeline at the new position:
  where the batches start is jzero's (:mod:`~jzero.data.order`), never Grain's iterator state.
* The position is the global sample index of the next batch, with the seed and a fingerprint
  of the rows (their count and layout, the sources), so :meth:`DataIterator.restore` refuses a
  state from other data or another seed.
* A batch is ``{"tokens", "segment_ids", "positions"}``, int32 ``[B / P, seq_len + 1]``; the
  samples read are :attr:`DataIterator.last_sample_ids`, the packed rows they read
  :attr:`DataIterator.last_row_ids`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import grain
import numpy as np

from jzero.data.errors import DataError
from jzero.data.order import BatchSpec, locate

__all__ = ["DataIterator", "Rows"]

logger = logging.getLogger("jzero.data")
_ENDLESS = 2**62


class Rows(Protocol):
    """Random-access rows: ``len`` of them, each ``get(index, epoch)``."""

    def __len__(self) -> int: ...

    def get(self, index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class _ProcessSamples:
    """The samples one process reads from ``start`` on, as a sequence Grain can map."""

    def __init__(self, rows: Rows, seed: int, spec: BatchSpec, start: int):
        self.rows, self.seed, self.spec, self.start = rows, seed, spec, start

    def __len__(self) -> int:
        return _ENDLESS

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        b, j = divmod(int(i), self.spec.local)
        sample = self.start + b * self.spec.global_batch + self.spec.process_index * self.spec.local
        sample += j
        epoch, row = locate(sample, self.seed, len(self.rows))
        tokens, segments, positions = self.rows.get(row, epoch)
        return {
            "tokens": tokens,
            "segment_ids": segments,
            "positions": positions,
            "sample_ids": np.int64(sample),
            "row_ids": np.int64(row),
        }


class DataIterator:
    """This process's rows of each global batch, in the order of :mod:`jzero.data.order`.

    Args:
        rows: the packed (or mixed) rows, ``N`` of them.
        seed: the data seed: epoch ``e``'s order is drawn from ``(seed, e)``.
        spec: the global batch and this process's share.
        fingerprint: names the rows' data; a state from other data is refused.
        num_threads: Grain's reading threads (0 reads in the caller's thread).
        prefetch: batches read ahead.
        skipped_records: bad records skipped while the data was built.
    """

    def __init__(
        self,
        rows: Rows,
        seed: int,
        spec: BatchSpec,
        *,
        fingerprint: str = "",
        num_threads: int = 2,
        prefetch: int = 4,
        skipped_records: int = 0,
    ):
        if not len(rows):
            raise DataError("The training data has no row. Use more data or a shorter seq_len.")
        if num_threads < 0 or prefetch < 0:
            raise DataError(f"num_threads and prefetch must be >= 0, got {num_threads}, {prefetch}")
        self.rows, self.seed, self.spec = rows, int(seed), spec
        self.fingerprint = fingerprint
        self.num_threads, self.prefetch = num_threads, prefetch
        self.skipped_records = skipped_records
        self.last_sample_ids = np.zeros(0, np.int64)
        self.last_row_ids = np.zeros(0, np.int64)
        self.summary = f"{len(rows):,} packed rows an epoch"  # from_config names the sources
        self._sample = 0
        self._logged_epoch = -1
        self._it = None

    def describe(self) -> str:
        """One line: the sources, their sizes and the split (as :func:`from_config` built it)."""
        return self.summary

    @property
    def num_rows(self) -> int:
        """``N``: the rows of one epoch."""
        return len(self.rows)

    @property
    def epoch(self) -> int:
        """The epoch of the next sample to read."""
        return self._sample // len(self.rows)

    @property
    def position(self) -> int:
        """The global sample index of the next batch."""
        return self._sample

    def _pipeline(self):
        source = _ProcessSamples(self.rows, self.seed, self.spec, self._sample)
        dataset = grain.MapDataset.source(source).batch(self.spec.local)
        options = grain.ReadOptions(
            num_threads=self.num_threads, prefetch_buffer_size=self.prefetch
        )
        return iter(dataset.to_iter_dataset(options))

    def next(self) -> dict[str, np.ndarray]:
        """This process's rows of the next global batch."""
        if self._it is None:
            self._it = self._pipeline()
        batch = next(self._it)
        self.last_sample_ids = np.asarray(batch.pop("sample_ids"), np.int64)
        self.last_row_ids = np.asarray(batch.pop("row_ids"), np.int64)
        self._sample += self.spec.global_batch
        last_epoch = (self._sample - 1) // len(self.rows)
        if last_epoch != self._logged_epoch:
            if last_epoch > 0 or self._logged_epoch >= 0:
                logger.info(
                    "data epoch %d begins (%d rows an epoch, sample %d)",
                    last_epoch, len(self.rows), last_epoch * len(self.rows),
                )  # fmt: skip
            self._logged_epoch = last_epoch
        return {k: np.asarray(v, np.int32) for k, v in batch.items()}

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next()

    def state(self) -> dict[str, Any]:
        """The position to checkpoint (JSON-serialisable)."""
        return {
            "sample": self._sample,
            "seed": self.seed,
            "rows": len(self.rows),
            "fingerprint": self.fingerprint,
            "epoch": self.epoch,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from a :meth:`state`: the next batch starts at its sample.

        Raises:
            DataError: for a state saved with another seed or other data.
        """
        if "sample" not in state:
            raise DataError(
                f"The data state {state!r} holds no sample position: it was saved by another "
                "data iterator (jzero.demo.data's holds a step). Start the data afresh."
            )
        if int(state["seed"]) != self.seed:
            raise DataError(
                f"The data state was saved with seed={state['seed']} but this iterator has "
                f"seed={self.seed}; resuming would give different data. Use the saved seed."
            )
        if state.get("fingerprint") != self.fingerprint or state.get("rows") != len(self.rows):
            raise DataError(
                f"The data state was saved for other data ({state.get('rows')} rows, "
                f"fingerprint {state.get('fingerprint')}) than this ({len(self.rows)} rows, "
                f"fingerprint {self.fingerprint}): the sources, tokenizer or seq_len changed. "
                "Use the same data section to resume, or start the data afresh."
            )
        self.close()
        self._sample = int(state["sample"])
        self._logged_epoch = (self._sample - 1) // len(self.rows) if self._sample else -1

    get_state = state
    set_state = restore

    def close(self) -> None:
        """Stops the prefetching threads (the next batch restarts them)."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None
