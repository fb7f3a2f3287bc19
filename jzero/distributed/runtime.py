"""Several JAX processes: starting the distributed runtime, and each process's slice of a batch.

Decisions:

* The process layout (the ``distributed`` settings, the ``JZERO_*`` environment variables, a
  detected cluster; see :mod:`jzero.distributed.processes`) is resolved by :func:`resolve_spec`,
  exported by :mod:`jzero.distributed` with the other names of that module.
* The runtime must start before any JAX computation creates a backend. When several processes
  are asked for but a backend already exists, the error says to call ``init_distributed()``
  first. Whether a backend exists is read from one private JAX function, wrapped in
  :func:`backends_initialized`; if a JAX release drops it, JAX's own error is translated.
* A process that dies ends the others in bounded time: they connect with a heartbeat timeout
  of 30 s (a killed process is seen at once, since its connection closes; a hung one after the
  timeout), and JAX then aborts them with "Terminating process because the JAX distributed
  service detected fatal errors". The exit barrier waits at most 30 s for slower processes.
* The coordinator (process 0's service) listens on loopback only when the coordinator host is
  a loopback address (``127.x.x.x``, ``::1``, ``localhost``, as for ``jzero launch``), so a
  local run is not reachable from the network: ``coordinator_bind_address`` is passed as that
  host and port (``localhost`` binds 127.0.0.1). Any other host keeps JAX's default (all
  interfaces, the other machines must reach it), and so does a set
  ``JAX_COORDINATOR_BIND_ADDRESS`` (the user's choice). A JAX without the parameter (read once
  from ``inspect.signature``) gets nothing extra.
* One log line says how the runtime started: the layout given, or the cluster job detected
  and its layout (:meth:`~jzero.distributed.processes.ClusterJob.describe`): at INFO from process
  0, at DEBUG from the others.
* CPU processes exchange collectives through gloo (JAX's CPU default; set if a user unset it).
* Per-process data: each process passes its own rows of the global batch, process ``p`` rows
  ``p*b : (p+1)*b`` with ``b = B / process_count`` (as
  :class:`jzero.demo.data.BatchIterator` yields them). :func:`global_batch` joins them into one
  global ``jax.Array`` and checks that the mesh puts process ``p``'s devices on exactly those
  rows, so that 2 processes x 4 devices train on the same global batch, row for row, as 1
  process x 8 devices.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jzero._util import dotted
from jzero.distributed.processes import (
    ENV_NUM_PROCESSES,
    ENV_REPLICAS,
    DistributedSpec,
    resolve_spec,
)

__all__ = [
    "any_process",
    "barrier",
    "backends_initialized",
    "ensure_initialized",
    "global_batch",
    "init_distributed",
    "is_main_process",
    "local_batch_size",
]

logger = logging.getLogger(__name__)
PyTree = Any

_TOO_EARLY = (
    "{what} asks for several JAX processes, but a JAX backend was already initialized in this "
    "process (some JAX computation, jax.devices() or jax.device_put ran first), and the "
    "distributed runtime can only start before that. Call jzero.init_distributed() at the top "
    "of your script, before any other JAX call; jzero.initialize() calls it for you only if it "
    "runs first."
)


def backends_initialized() -> bool:
    """Whether a JAX backend exists already (after that, the runtime can no longer start)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without it: jax.distributed's error is mapped
        return False


def _bind_address(coordinator: str | None) -> str | None:
    """Where the coordinator should listen: ``coordinator`` itself when its host is loopback
    (``localhost`` as ``127.0.0.1``), else ``None`` (JAX's default: all interfaces)."""
    if not coordinator:
        return None
    host, _, port = coordinator.rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not host:
        return None
    if host.lower() == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name: it may name another machine's interface
    if not address.is_loopback:
        return None
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


@functools.cache
def _accepts(function: Any, parameter: str) -> bool:
    """Whether ``function`` takes a keyword ``parameter`` (JAX's API may change)."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return parameter in params


def _start(spec: DistributedSpec, what: str) -> None:
    if backends_initialized():
        raise RuntimeError(_TOO_EARLY.format(what=what))
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    extra: dict[str, Any] = {}
    bind = _bind_address(spec.coordinator_address)
    if (
        bind is not None
        and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
        and _accepts(jax.distributed.initialize, "coordinator_bind_address")
    ):
        extra["coordinator_bind_address"] = bind
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=None if spec.local_device_ids is None else list(spec.local_device_ids),
            cluster_detection_method=spec.cluster_detection_method,
            initialization_timeout=spec.initialization_timeout,
            heartbeat_timeout_seconds=spec.heartbeat_timeout,
            shutdown_timeout_seconds=spec.shutdown_timeout,
            **extra,
        )
    except RuntimeError as e:
        if "before any JAX calls" in str(e):
            raise RuntimeError(_TOO_EARLY.format(what=what)) from e
        raise
    if spec.cluster is not None:
        pid, layout = spec.cluster.process_id, spec.cluster.describe()
        layout += "; JAX read the layout and the coordinator from the job's variables"
    elif spec.source == "cluster":
        pid, layout = None, "layout from the cluster environment"
    else:
        pid = spec.process_id
        layout = f"process {pid} of {spec.num_processes}, coordinator {spec.coordinator_address}"
    logger.log(
        logging.INFO if pid in (0, None) else logging.DEBUG,  # process 0 speaks
        "jzero: distributed runtime started (%s)",
        layout,
    )


def init_distributed(dist_cfg: Mapping[str, Any] | None = None) -> DistributedSpec:
    """Starts JAX's distributed runtime when several processes are asked for (idempotent).

    DeepSpeed's ``deepspeed.init_distributed``. Call it before any other JAX call; on one
    process it does nothing. Calling it again, or after ``jax.distributed.initialize``,
    changes nothing.

    Args:
      dist_cfg: the ``distributed`` settings (see :func:`resolve_spec`); the ``JZERO_*``
        environment variables and the cluster environment fill what it leaves unset.

    Returns:
      The resolved :class:`DistributedSpec`.

    Raises:
      RuntimeError: if several processes are asked for but a JAX backend already exists.
      ValueError: for malformed settings.
    """
    spec = resolve_spec(dist_cfg)
    if jax.distributed.is_initialized():
        logger.debug("jzero: the distributed runtime is already running")
        return spec
    if not spec.multi_process:
        return spec
    where = {
        "env": f"The environment ({ENV_NUM_PROCESSES}={spec.num_processes})",
        "config": f"The distributed settings (num_processes={spec.num_processes})",
    }.get(spec.source, "The cluster environment")
    _start(spec, where)
    return spec


def ensure_initialized(dist_cfg: Mapping[str, Any] | None = None) -> None:
    """What ``jzero.initialize`` runs first: :func:`init_distributed`, a no-op once running.

    Args:
      dist_cfg: the config's ``distributed`` section, if any.
    """
    init_distributed(dist_cfg)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process; every process gets the same answer (one
    allgather of a boolean when there are several), so they all take the same branch before
    a collective or a checkpoint barrier."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.bool_(flag))))


def launcher_replicas() -> int | None:
    """The replica groups ``jzero launch --replicas`` asked for (``JZERO_REPLICAS``), if any.

    Raises:
      ValueError: for a value that is not a positive integer.
    """
    value = os.environ.get(ENV_REPLICAS)
    if value is None or value == "":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"{ENV_REPLICAS}={value!r} is not a positive integer; it is set by `jzero launch "
            "--replicas R`. Unset it, or set a number of replica groups."
        )
    return int(value)


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (one process needs no barrier)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def is_main_process() -> bool:
    """Whether this is process 0, the one that logs and writes files."""
    return jax.process_index() == 0


def local_batch_size(global_batch_size: int) -> int:
    """The rows each process passes: ``global_batch_size / jax.process_count()``.

    Raises:
      ValueError: if the global batch does not split evenly over the processes.
    """
    count = jax.process_count()
    if global_batch_size % count:
        raise ValueError(
            f"The global batch size {global_batch_size} is not divisible by the {count} "
            "processes. Choose a train_batch_size that is a multiple of the process count."
        )
    return global_batch_size // count


@functools.lru_cache(maxsize=64)  # asked twice a step (the check, the global batch)
def process_rows(sharding: jax.sharding.Sharding, global_batch_size: int) -> range:
    """The rows of a global batch of ``global_batch_size`` that this process's devices hold
    under the batch ``sharding``: ``p*b : (p+1)*b`` when the processes split the batch's axes,
    every row when a process holds a whole data group of each (a ``pipe`` axis across
    processes: every stage reads every row).

    Raises:
      ValueError: the rows are not one contiguous block (a mesh not in process order).
    """
    index = jax.process_index()
    rows: set[int] = set()
    for device, idx in sharding.devices_indices_map((global_batch_size,)).items():
        if device.process_index == index:
            rows.update(range(*idx[0].indices(global_batch_size)) if idx else ())
    if not rows or rows != set(range(min(rows), max(rows) + 1)):
        raise ValueError(
            f"The batch sharding puts process {index}'s devices on rows "
            f"{sorted(rows)[:4]}... of the global batch of {global_batch_size}, which are not one "
            "block. Build the mesh with jzero.make_mesh (devices in process order) so each "
            "process holds a contiguous block of the data axis."
        )
    return range(min(rows), max(rows) + 1)


def batch_share(sharding: jax.sharding.Sharding) -> float:
    """The fraction of a global batch's rows this process passes (:func:`process_rows`)."""
    n = sharding.num_devices
    return len(process_rows(sharding, n)) / n


def check_batch(
    batch: Any, global_batch_size: int, explain: str = "", rows: int | None = None
) -> None:
    """Every leaf of this process's ``batch`` has its rows of the global batch: leading dim
    ``rows`` (default ``global_batch_size / jax.process_count()``); else a clear error naming
    the leaf.

    Args:
      batch: this process's batch (a pytree of arrays).
      global_batch_size: the global batch's leading dim.
      explain: where that size comes from, for the one-process message (e.g. ``" (=
        train_micro_batch_size_per_gpu 4 x ...)"``).
      rows: the rows this process passes (:func:`process_rows` of the batch sharding).
    """
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not flat:
        raise ValueError("The batch is empty; pass a pytree of arrays with a leading batch dim.")
    expected = local_batch_size(global_batch_size) if rows is None else rows
    for path, x in flat:
        lead = np.shape(x)[0] if np.ndim(x) else None
        if lead == expected:
            continue
        name = dotted(path) or "<batch>"
        if expected != global_batch_size:  # several processes: each passes its rows
            whose = (
                f"each of the {jax.process_count()} processes passes its {expected} rows"
                if expected * jax.process_count() == global_batch_size
                else f"process {jax.process_index()} passes the {expected} rows its devices hold"
            )
            raise ValueError(
                f"Batch leaf {name!r} has leading dim {lead}, but {whose} of the global "
                f"train_batch_size {global_batch_size}. Pass this process's slice of {expected} "
                "rows (jzero.demo.data.BatchIterator with process_index/process_count yields "
                "it)."
            )
        raise ValueError(
            f"Batch leaf {name!r} has leading dim {lead} but train_batch_size is "
            f"{global_batch_size}{explain}. Pass a global batch of that size, or change the "
            "config's batch keys."
        )


def global_batch(
    local_batch: PyTree, sharding: jax.sharding.Sharding, global_batch_size: int
) -> PyTree:
    """Joins every process's rows into one global batch laid out by ``sharding``.

    On one process the batch is returned unchanged (the jitted step places it).

    Args:
      local_batch: this process's rows of the global batch (:func:`process_rows`): process
        ``p`` passes rows ``p*b:(p+1)*b`` of ``b = global_batch_size / jax.process_count()``
        when the processes split the batch's axes, the whole batch when each holds every row.
      sharding: the batch sharding (``plan.batch``), leading dim over the data axis.
      global_batch_size: the leading dim of the global batch.

    Returns:
      The batch as global ``jax.Array`` leaves of leading dim ``global_batch_size``.
    """
    if jax.process_count() == 1:
        return local_batch
    local = {
        id(x): x
        for x in jax.tree.leaves(local_batch)
        if not (isinstance(x, jax.Array) and not x.is_fully_addressable)  # already global
    }
    if local:
        check_batch(
            list(local.values()),
            global_batch_size,
            rows=len(process_rows(sharding, global_batch_size)),
        )

    def one(x: Any) -> jax.Array:
        if id(x) not in local:
            return x
        x = np.asarray(x)
        shape = (global_batch_size, *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(one, local_batch)
