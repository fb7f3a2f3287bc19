"""ZeRO-Infinity's NVMe tier: the file store and format, the state in files, its step.

Import direction: imports :mod:`jzero.plan`, :mod:`jzero.step` and :mod:`jzero.subgroups`;
imported only by :mod:`jzero.engine` (the core step never imports it).

* :mod:`~jzero.nvme.options`: :class:`NvmeOptions`, the tier's settings as one typed value
  (:mod:`jzero.engine.settings` makes it from a config).
* :mod:`~jzero.nvme.file_format`: one key's arrays in one CRC-checked file.
* :mod:`~jzero.nvme.store`: :class:`NvmeStore`, the files of each group, written in the background.
* :mod:`~jzero.nvme.shards`: :func:`host_shards`, an array as this process's distinct shards on
  the host.
* :mod:`~jzero.nvme.state`: which leaves live in which files, and the moves in and out.
* :mod:`~jzero.nvme.step`: the step that reads, updates and writes them around the gradients.
* :mod:`~jzero.nvme.initial_state`: :func:`first_version`, the state made straight into its
  files, group by group.

The package exports ``first_version`` and ``host_shards``, the functions; their modules are
named for what they hold (``initial_state``, ``shards``), so no module shadows its function.
"""

from jzero.nvme.file_format import NvmeIOError as NvmeIOError
from jzero.nvme.initial_state import first_version as first_version
from jzero.nvme.options import NvmeOptions as NvmeOptions
from jzero.nvme.shards import host_shards as host_shards
from jzero.nvme.state import NvmeState as NvmeState
from jzero.nvme.state import state_bytes as state_bytes
from jzero.nvme.step import NvmeStep as NvmeStep
from jzero.nvme.store import NVME_PATH_KEY as NVME_PATH_KEY
from jzero.nvme.store import NvmeStore as NvmeStore
from jzero.nvme.store import check_nvme_path as check_nvme_path

__all__ = [
    "check_nvme_path",
    "first_version",
    "host_shards",
    "NVME_PATH_KEY",
    "NvmeIOError",
    "NvmeOptions",
    "NvmeState",
    "NvmeStep",
    "NvmeStore",
    "state_bytes",
]
