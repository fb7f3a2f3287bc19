"""The process runtime: the mesh, the processes of a run and their runtime, ``jzero launch``.

Import direction: this package imports nothing else of jzero's (only the shared helpers of
:mod:`jzero._util`); every other package may import it. The parallelisms that use the mesh's
axes have their rooms in :mod:`jzero.parallel`.

* :mod:`~jzero.distributed.mesh`: device meshes (the ``data`` and ``replica`` axes, and the
  names of the parallelisms' axes).
* :mod:`~jzero.distributed.processes`: the processes of a run (how many, which one this is, the
  coordinator) from settings, ``JZERO_*`` variables or a detected Slurm, Open MPI or Kubernetes
  job (imports no JAX). "Layout" elsewhere is where leaves rest on devices.
* :mod:`~jzero.distributed.runtime`: the runtime started before any JAX call, decisions taken
  alike on every process, each process's rows joined into the global batch, the barrier.
* :mod:`~jzero.distributed.compile_cache`: JAX's persistent compilation cache for a run, and
  counting compilations.
* :mod:`~jzero.distributed.agreement`: processes agree on their run before the first step
  (fingerprints through the runtime's key-value store).
* :mod:`~jzero.distributed.watchdog`: a run of several processes never hangs in silence.
* :mod:`~jzero.distributed.launch`: ``jzero launch``, several local processes started and
  stopped together (``python -m jzero.distributed.launch``).

The names load on first use (:func:`jzero._util.lazy_exports`), so the launcher's process and
the ``processes`` settings import no JAX; the mesh and the runtime import it when first read.
"""

from typing import TYPE_CHECKING

from jzero._util import lazy_exports

if TYPE_CHECKING:
    from jzero.distributed.agreement import ProcessesDisagree as ProcessesDisagree
    from jzero.distributed.agreement import agree as agree
    from jzero.distributed.compile_cache import CompileCounter as CompileCounter
    from jzero.distributed.compile_cache import compile_cache_dir as compile_cache_dir
    from jzero.distributed.compile_cache import enable_compile_cache as enable_compile_cache
    from jzero.distributed.mesh import CONTEXT_AXIS as CONTEXT_AXIS
    from jzero.distributed.mesh import DATA_AXIS as DATA_AXIS
    from jzero.distributed.mesh import EXPERT_AXIS as EXPERT_AXIS
    from jzero.distributed.mesh import PIPE_AXIS as PIPE_AXIS
    from jzero.distributed.mesh import REPLICA_AXIS as REPLICA_AXIS
    from jzero.distributed.mesh import SEQ_AXIS as SEQ_AXIS
    from jzero.distributed.mesh import make_mesh as make_mesh
    from jzero.distributed.processes import DEFAULT_HEARTBEAT_TIMEOUT as DEFAULT_HEARTBEAT_TIMEOUT
    from jzero.distributed.processes import (
        DEFAULT_INITIALIZATION_TIMEOUT as DEFAULT_INITIALIZATION_TIMEOUT,
    )
    from jzero.distributed.processes import DEFAULT_SHUTDOWN_TIMEOUT as DEFAULT_SHUTDOWN_TIMEOUT
    from jzero.distributed.processes import ENV_COORDINATOR as ENV_COORDINATOR
    from jzero.distributed.processes import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
    from jzero.distributed.processes import ENV_PROCESS_ID as ENV_PROCESS_ID
    from jzero.distributed.processes import ENV_REPLICAS as ENV_REPLICAS
    from jzero.distributed.processes import ClusterJob as ClusterJob
    from jzero.distributed.processes import DistributedSpec as DistributedSpec
    from jzero.distributed.processes import detect_cluster as detect_cluster
    from jzero.distributed.processes import resolve_spec as resolve_spec
    from jzero.distributed.runtime import any_process as any_process
    from jzero.distributed.runtime import backends_initialized as backends_initialized
    from jzero.distributed.runtime import barrier as barrier
    from jzero.distributed.runtime import batch_share as batch_share
    from jzero.distributed.runtime import check_batch as check_batch
    from jzero.distributed.runtime import ensure_initialized as ensure_initialized
    from jzero.distributed.runtime import global_batch as global_batch
    from jzero.distributed.runtime import init_distributed as init_distributed
    from jzero.distributed.runtime import is_main_process as is_main_process
    from jzero.distributed.runtime import launcher_replicas as launcher_replicas
    from jzero.distributed.runtime import local_batch_size as local_batch_size
    from jzero.distributed.runtime import process_rows as process_rows
    from jzero.distributed.watchdog import HANG_EXIT as HANG_EXIT
    from jzero.distributed.watchdog import Watchdog as Watchdog
    from jzero.distributed.watchdog import hang_timeout as hang_timeout
    from jzero.distributed.watchdog import stragglers as stragglers

__all__ = [
    "HANG_EXIT",
    "ProcessesDisagree",
    "Watchdog",
    "agree",
    "any_process",
    "hang_timeout",
    "stragglers",
    "backends_initialized",
    "barrier",
    "batch_share",
    "check_batch",
    "ClusterJob",
    "compile_cache_dir",
    "CONTEXT_AXIS",
    "CompileCounter",
    "DATA_AXIS",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_INITIALIZATION_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "detect_cluster",
    "DistributedSpec",
    "enable_compile_cache",
    "ensure_initialized",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_REPLICAS",
    "EXPERT_AXIS",
    "global_batch",
    "init_distributed",
    "is_main_process",
    "launcher_replicas",
    "local_batch_size",
    "process_rows",
    "make_mesh",
    "PIPE_AXIS",
    "REPLICA_AXIS",
    "resolve_spec",
    "SEQ_AXIS",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ProcessesDisagree": "jzero.distributed.agreement.ProcessesDisagree",
        "agree": "jzero.distributed.agreement.agree",
        "CompileCounter": "jzero.distributed.compile_cache.CompileCounter",
        "compile_cache_dir": "jzero.distributed.compile_cache.compile_cache_dir",
        "enable_compile_cache": "jzero.distributed.compile_cache.enable_compile_cache",
        "CONTEXT_AXIS": "jzero.distributed.mesh.CONTEXT_AXIS",
        "DATA_AXIS": "jzero.distributed.mesh.DATA_AXIS",
        "EXPERT_AXIS": "jzero.distributed.mesh.EXPERT_AXIS",
        "PIPE_AXIS": "jzero.distributed.mesh.PIPE_AXIS",
        "REPLICA_AXIS": "jzero.distributed.mesh.REPLICA_AXIS",
        "SEQ_AXIS": "jzero.distributed.mesh.SEQ_AXIS",
        "make_mesh": "jzero.distributed.mesh.make_mesh",
        "DEFAULT_HEARTBEAT_TIMEOUT": "jzero.distributed.processes.DEFAULT_HEARTBEAT_TIMEOUT",
        "DEFAULT_INITIALIZATION_TIMEOUT": (
            "jzero.distributed.processes.DEFAULT_INITIALIZATION_TIMEOUT"
        ),
        "DEFAULT_SHUTDOWN_TIMEOUT": "jzero.distributed.processes.DEFAULT_SHUTDOWN_TIMEOUT",
        "ENV_COORDINATOR": "jzero.distributed.processes.ENV_COORDINATOR",
        "ENV_NUM_PROCESSES": "jzero.distributed.processes.ENV_NUM_PROCESSES",
        "ENV_PROCESS_ID": "jzero.distributed.processes.ENV_PROCESS_ID",
        "ENV_REPLICAS": "jzero.distributed.processes.ENV_REPLICAS",
        "ClusterJob": "jzero.distributed.processes.ClusterJob",
        "DistributedSpec": "jzero.distributed.processes.DistributedSpec",
        "detect_cluster": "jzero.distributed.processes.detect_cluster",
        "resolve_spec": "jzero.distributed.processes.resolve_spec",
        "any_process": "jzero.distributed.runtime.any_process",
        "backends_initialized": "jzero.distributed.runtime.backends_initialized",
        "barrier": "jzero.distributed.runtime.barrier",
        "batch_share": "jzero.distributed.runtime.batch_share",
        "check_batch": "jzero.distributed.runtime.check_batch",
        "ensure_initialized": "jzero.distributed.runtime.ensure_initialized",
        "global_batch": "jzero.distributed.runtime.global_batch",
        "init_distributed": "jzero.distributed.runtime.init_distributed",
        "is_main_process": "jzero.distributed.runtime.is_main_process",
        "launcher_replicas": "jzero.distributed.runtime.launcher_replicas",
        "local_batch_size": "jzero.distributed.runtime.local_batch_size",
        "process_rows": "jzero.distributed.runtime.process_rows",
        "HANG_EXIT": "jzero.distributed.watchdog.HANG_EXIT",
        "Watchdog": "jzero.distributed.watchdog.Watchdog",
        "hang_timeout": "jzero.distributed.watchdog.hang_timeout",
        "stragglers": "jzero.distributed.watchdog.stragglers",
    },
)
