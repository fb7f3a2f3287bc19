"""What the NVMe tier is told: one typed, frozen value.

Decisions:

* :class:`NvmeOptions` holds DeepSpeed's ``offload_optimizer`` / ``offload_param`` settings with
  ``device: nvme`` as the tier reads them: the folders, the buffers, the group size and the
  overlap of reads and writes with the step. :mod:`jzero.engine.settings` makes it from a
  validated config (``None`` without the tier); nothing here reads a config.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NvmeOptions"]


@dataclass(frozen=True)
class NvmeOptions:
    """The NVMe tier's settings.

    Attributes:
      path: the folder of the optimizer state's files (``offload_optimizer.nvme_path``).
      buffer_count: groups of the optimizer state held in host memory at once, read ahead and
        being written (``offload_optimizer.buffer_count``).
      sub_group_size: the most elements of one group of leaves, read, updated and written
        together (``zero_optimization.sub_group_size``).
      param_path: the folder of the parameters' files under ``offload_param.device: nvme``
        (its ``nvme_path``, else ``path``); ``None``: the parameters stay in memory.
      param_buffer_count: as ``buffer_count``, for the parameters' own store
        (``offload_param.buffer_count``).
      prefetch_params: read the parameters' files ahead (``offload_param.pipeline_read``).
      pipeline_read: read the next groups while the current one updates
        (``offload_optimizer.pipeline_read``).
      pipeline_write: write a group's results while the next one updates
        (``offload_optimizer.pipeline_write``).
    """

    path: str
    buffer_count: int
    sub_group_size: int
    param_path: str | None = None
    param_buffer_count: int = 4
    prefetch_params: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
