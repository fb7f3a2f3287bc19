"""The process layout of a distributed run: how many JAX processes, which one this is, and
process 0's coordinator address, resolved from the settings and the environment.

Decisions:

* Where the process layout comes from, highest priority first, key by key: the ``distributed``
  mapping a user passes (config section), the ``JZERO_COORDINATOR`` / ``JZERO_NUM_PROCESSES`` /
  ``JZERO_PROCESS_ID`` environment variables (``jzero launch`` sets them), then JAX's own cluster
  detection (``jax.distributed.initialize()`` without arguments) when the environment shows a
  Slurm or Open MPI job of more than one task, or a Kubernetes indexed job. Any other cluster
  is opted into with ``cluster_detection_method`` (a JAX method name such as ``"mpi4py"``, or
  ``"auto"`` to let JAX choose). Nothing set means one process, and nothing is started;
  ``JZERO_NUM_PROCESSES=1`` forces one process inside a cluster job.
* The environment is read once, at the first call; later changes to it are ignored.
* This module only resolves; it imports no JAX and starts nothing.
  :mod:`jzero.distributed.runtime` starts the runtime from a :class:`DistributedSpec`;
  :mod:`jzero.distributed` exports the names. The one log line goes to the
  ``jzero.distributed`` logger, as before the split.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_INITIALIZATION_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DistributedSpec",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_REPLICAS",
    "resolve_spec",
]

logger = logging.getLogger("jzero.distributed")  # the logger these lines had before the split

ENV_COORDINATOR = "JZERO_COORDINATOR"
ENV_NUM_PROCESSES = "JZERO_NUM_PROCESSES"
ENV_PROCESS_ID = "JZERO_PROCESS_ID"
ENV_REPLICAS = "JZERO_REPLICAS"

DEFAULT_INITIALIZATION_TIMEOUT = 120
DEFAULT_HEARTBEAT_TIMEOUT = 30
DEFAULT_SHUTDOWN_TIMEOUT = 30

_KEYS = (
    "coordinator_address",
    "num_processes",
    "process_id",
    "local_device_ids",
    "cluster_detection_method",
    "initialization_timeout",
    "heartbeat_timeout",
    "shutdown_timeout",
)


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """A resolved process layout.

    Attributes:
      coordinator_address: ``host:port`` of process 0's coordinator, or ``None`` for JAX's
        cluster detection.
      num_processes / process_id: the layout, or ``None`` for JAX's cluster detection.
      source: where it came from: ``"config"``, ``"env"``, ``"cluster"`` or ``"single"``.
      cluster_detection_method: passed to ``jax.distributed.initialize`` (``None``: JAX's
        default detection).
      local_device_ids: this process's devices (``None``: all it sees).
      initialization_timeout / heartbeat_timeout / shutdown_timeout: seconds.
    """

    coordinator_address: str | None = None
    num_processes: int | None = 1
    process_id: int | None = 0
    source: str = "single"
    cluster_detection_method: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = DEFAULT_INITIALIZATION_TIMEOUT
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT

    @property
    def multi_process(self) -> bool:
        """Whether this layout needs the distributed runtime."""
        return self.source == "cluster" or (self.num_processes or 1) > 1


_environ_snapshot: dict[str, str] | None = None


def _environ() -> dict[str, str]:
    """The ``JZERO_*`` and cluster variables, read once per process."""
    global _environ_snapshot
    if _environ_snapshot is None:
        _environ_snapshot = dict(os.environ)
    return _environ_snapshot


def _int(value: Any, name: str, minimum: int) -> int:
    text = str(value).strip()
    number = int(text) if text.lstrip("-").isdigit() and not isinstance(value, bool) else None
    if number is None or number < minimum:
        raise ValueError(
            f"{name} is {value!r}, but it must be an integer >= {minimum}. "
            f"Set {name} to a whole number such as {max(minimum, 1)}."
        )
    return number


def _detect_cluster(env: Mapping[str, str]) -> str | None:
    """The cluster JAX can detect by itself, when it runs more than one process."""

    def several(var: str) -> bool:
        return env.get(var, "1").strip().isdigit() and int(env[var]) > 1

    if all(v in env for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID")) and several(
        "SLURM_NTASKS"
    ):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and several("OMPI_COMM_WORLD_SIZE"):
        return "ompi"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "k8s"
    return None


def resolve_spec(
    dist_cfg: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> DistributedSpec:
    """Resolves the process layout from a ``distributed`` mapping and the environment.

    Args:
      dist_cfg: a mapping (or a config section object) with keys ``coordinator_address``
        (``host:port``), ``num_processes``, ``process_id``, ``local_device_ids``,
        ``cluster_detection_method``, and the
        ``initialization_timeout`` / ``heartbeat_timeout`` / ``shutdown_timeout`` seconds;
        ``None`` values count as unset.
      environ: the environment to read; ``os.environ`` as first seen by default.

    Returns:
      The :class:`DistributedSpec`; ``source="single"`` when nothing asks for several processes.

    Raises:
      ValueError: for an unknown key, a malformed value, or an incomplete layout.
    """
    if dist_cfg is not None and not isinstance(dist_cfg, Mapping):
        dist_cfg = vars(dist_cfg)  # a config section object
    cfg = {k: v for k, v in dict(dist_cfg or {}).items() if v is not None}
    unknown = sorted(set(cfg) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in the distributed settings. Allowed keys: "
            f"{', '.join(_KEYS)}. Remove or rename them."
        )
    env = _environ() if environ is None else dict(environ)
    from_env = {
        "coordinator_address": env.get(ENV_COORDINATOR) or None,
        "num_processes": env.get(ENV_NUM_PROCESSES) or None,
        "process_id": env.get(ENV_PROCESS_ID) or None,
    }
    env_names = {
        "coordinator_address": ENV_COORDINATOR,
        "num_processes": ENV_NUM_PROCESSES,
        "process_id": ENV_PROCESS_ID,
    }
    merged: dict[str, Any] = {k: v for k, v in from_env.items() if v is not None}
    merged.update(cfg)

    def label(key: str) -> str:
        return f"distributed.{key}" if key in cfg else env_names.get(key, f"distributed.{key}")

    timeouts = {
        key: _int(merged.get(key, default), label(key), 1)
        for key, default in (
            ("initialization_timeout", DEFAULT_INITIALIZATION_TIMEOUT),
            ("heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT),
            ("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT),
        )
    }
    ids = merged.get("local_device_ids")
    if ids is not None:
        ids = (ids,) if isinstance(ids, int) else tuple(ids)
        ids = tuple(_int(i, "distributed.local_device_ids", 0) for i in ids)
    method = merged.get("cluster_detection_method")
    common = dict(timeouts, local_device_ids=ids)
    layout = ("coordinator_address", "num_processes", "process_id")
    if not any(k in merged for k in layout):
        # JAX detects the layout itself: opted into by a method name, or a known cluster.
        if method is None:
            found = _detect_cluster(env)
            if found is None:
                return DistributedSpec(**common)
            logger.info("jzero: %s job detected; JAX reads the process layout", found)
        return DistributedSpec(
            coordinator_address=None,
            num_processes=None,
            process_id=None,
            source="cluster",
            cluster_detection_method=None if method == "auto" else method,
            **common,
        )
    num = _int(merged.get("num_processes", 1), label("num_processes"), 1)
    if num == 1 and "process_id" not in merged and "coordinator_address" not in merged:
        return DistributedSpec(**common)
    missing = [env_names[k] + " / distributed." + k for k in layout if k not in merged]
    if missing:
        raise ValueError(
            f"Several processes are asked for ({num}), but {', '.join(missing)} is not set. "
            "Set all three of the coordinator address (host:port of process 0), the number "
            "of processes and this process's id, or start the processes with `jzero launch`."
        )
    pid = _int(merged["process_id"], label("process_id"), 0)
    if pid >= num:
        raise ValueError(
            f"{label('process_id')} is {pid}, but with {num} processes it must be in "
            f"[0, {num - 1}]. Number the processes 0 .. {num - 1}."
        )
    address = str(merged["coordinator_address"])
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{label('coordinator_address')} is {address!r}, but it must be host:port with a "
            "port in 1..65535, e.g. 'localhost:12355' or '10.0.0.1:12355' (process 0's host)."
        )
    source = "config" if any(k in cfg for k in layout) else "env"
    return DistributedSpec(address, num, pid, source, method, **common)
