"""The processes of a distributed run (its process layout): how many JAX processes, which one this
is, and process 0's coordinator address, resolved from the settings and the environment.

Decisions:

* Where the process layout comes from, highest priority first, key by key: the ``distributed``
  mapping a user passes (config section), the ``JZERO_COORDINATOR`` / ``JZERO_NUM_PROCESSES`` /
  ``JZERO_PROCESS_ID`` environment variables (``jzero launch`` sets them), then JAX's own cluster
  detection (``jax.distributed.initialize()`` without arguments) when :func:`detect_cluster`
  finds a job JAX can read: an Open MPI or Slurm job of more than one task, or a Kubernetes
  indexed job. Any other cluster is opted into with ``cluster_detection_method`` (a JAX method
  name such as ``"mpi4py"``, or ``"auto"`` to let JAX choose). Nothing set means one process,
  and nothing is started; ``JZERO_NUM_PROCESSES=1`` forces one process inside a cluster job.
* :func:`detect_cluster` asks what JAX's detection asks, in JAX's order (Open MPI before Slurm,
  since ``mpirun`` inside a Slurm allocation carries both), so that jzero starts the runtime
  exactly when JAX will find a layout; JAX stays the one that reads it. Where JAX would not
  find it but the job has several processes, the error says so instead of every process
  training alone: Open MPI 5 (no ``OMPI_MCA_orte_hnp_uri``) goes through JAX's ``mpi4py``
  method, and needs mpi4py; Kubernetes needs the ``kubernetes`` package (``jax[k8s]``).
* Devices: for a detected job with several processes on a host, JAX gives process ``i`` of the
  host its device ``i`` (one device per process); with one process on the host, it would give
  that process device 0 alone, so jzero passes an empty ``local_device_ids`` instead: the one
  process of a host uses all of the host's devices (``srun --ntasks-per-node=1``). A
  ``local_device_ids`` the user sets wins.
* The environment is read once, at the first call; later changes to it are ignored.
* This module only resolves; it imports no JAX, starts nothing and logs nothing.
  :mod:`jzero.distributed.runtime` starts the runtime from a :class:`DistributedSpec` and logs
  the layout once; :mod:`jzero.distributed` exports the names.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ClusterJob",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_INITIALIZATION_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DistributedSpec",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_REPLICAS",
    "detect_cluster",
    "resolve_spec",
]

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
    # the loop's watchdog (jzero.distributed.watchdog), not the runtime's:
    "hang_timeout",
    "straggler_share",
    "straggler_steps",
)


@dataclasses.dataclass(frozen=True)
class ClusterJob:
    """A cluster job whose process layout JAX reads by itself (see :func:`detect_cluster`).

    Attributes:
      name: ``"slurm"``, ``"ompi"`` (Open MPI) or ``"k8s"`` (a Kubernetes indexed job).
      process_id / num_processes: the layout as the job's variables state it, for the log
        line (JAX reads it itself); ``None`` where only JAX can ask (Kubernetes's count).
      local_processes: this job's processes on this host; ``None`` when not known.
      method: the ``cluster_detection_method`` JAX needs (``"mpi4py"`` for Open MPI 5), or
        ``None`` for JAX's default detection.
    """

    name: str
    process_id: int | None
    num_processes: int | None
    local_processes: int | None
    method: str | None = None

    def describe(self) -> str:
        """The job and its layout in words, for the log line."""
        kind = {"slurm": "Slurm", "ompi": "Open MPI", "k8s": "Kubernetes indexed"}[self.name]
        count = self.num_processes if self.num_processes is not None else "the job's parallelism"
        text = f"{kind} job: process {self.process_id} of {count}"
        if self.local_processes == 1:
            return text + ", the only one on its host: it uses all of the host's devices"
        if self.local_processes:
            return (
                text + f", {self.local_processes} processes on its host: one device each "
                "(JAX's rule: the host's process i drives device i)"
            )
        return text


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
      local_device_ids: this process's devices; ``None``: all it sees, except in a detected
        job of several processes a host (JAX then gives each process one device); ``()``: all
        it sees, always.
      initialization_timeout / heartbeat_timeout / shutdown_timeout: seconds.
      cluster: the detected cluster job, ``None`` when the layout is not JAX's to read or
        JAX's detection was chosen by name.
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
    cluster: ClusterJob | None = None

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


def _count(env: Mapping[str, str], var: str) -> int | None:
    text = env.get(var, "").strip()
    return int(text) if text.isdigit() else None


def _tasks_on_node(env: Mapping[str, str]) -> int | None:
    """This node's tasks of a Slurm step, from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``)."""
    counts: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            counts = []
            break
        counts += [int(found[1])] * int(found[2] or 1)
    node = _count(env, "SLURM_NODEID")
    if counts and node is not None and node < len(counts):
        return counts[node]
    tasks, nodes = _count(env, "SLURM_NTASKS"), _count(env, "SLURM_STEP_NUM_NODES")
    return 1 if tasks is not None and tasks == nodes else None


def detect_cluster(environ: Mapping[str, str] | None = None) -> ClusterJob | None:
    """The cluster job of several processes that JAX can read its layout from, if any.

    Args:
      environ: the environment to read; ``os.environ`` as first seen by default.

    Returns:
      The :class:`ClusterJob`, or ``None`` (no cluster, or a job of one process).

    Raises:
      ValueError: for a job of several processes that the installed packages cannot start.
    """
    env = _environ() if environ is None else environ
    size = _count(env, "OMPI_COMM_WORLD_SIZE")
    if size is not None and size > 1:
        rank, local = _count(env, "OMPI_COMM_WORLD_RANK"), _count(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        if "OMPI_MCA_orte_hnp_uri" in env:  # Open MPI 4 and older: JAX's "ompi" method
            return ClusterJob("ompi", rank, size, local)
        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError(
                f"This is an Open MPI job of {size} processes (OMPI_COMM_WORLD_SIZE={size}) "
                "without OMPI_MCA_orte_hnp_uri (Open MPI 5), where JAX finds the layout only "
                "through mpi4py, which is not installed. Install it (`pip install mpi4py`), or "
                "set JZERO_COORDINATOR, JZERO_NUM_PROCESSES and JZERO_PROCESS_ID in each process."
            )
        return ClusterJob("ompi", rank, size, local, method="mpi4py")
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    tasks = _count(env, "SLURM_NTASKS")
    if all(v in env for v in slurm) and tasks is not None and tasks > 1:
        return ClusterJob("slurm", _count(env, "SLURM_PROCID"), tasks, _tasks_on_node(env))
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        if importlib.util.find_spec("kubernetes") is None:
            raise ValueError(
                "This is a pod of a Kubernetes indexed job (JOB_COMPLETION_INDEX is set), where "
                "JAX reads the process layout from the Kubernetes API through the `kubernetes` "
                "package, which is not installed. Install it (`pip install jax[k8s]`), or set "
                "JZERO_COORDINATOR, JZERO_NUM_PROCESSES and JZERO_PROCESS_ID in the pod spec."
            )
        return ClusterJob("k8s", _count(env, "JOB_COMPLETION_INDEX"), None, 1)
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
        found = detect_cluster(env) if method in (None, "auto") else None
        if method is None and found is None:
            return DistributedSpec(**common)
        if found is not None and found.local_processes == 1 and ids is None:
            common["local_device_ids"] = ()  # not JAX's device 0 alone: all of the host's
        if found is not None:
            method = found.method
        return DistributedSpec(
            coordinator_address=None,
            num_processes=None,
            process_id=None,
            source="cluster",
            cluster_detection_method=None if method == "auto" else method,
            cluster=found,
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
