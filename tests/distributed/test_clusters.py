"""jzero under a cluster's own launcher (``srun``, ``mpirun``, a Kubernetes indexed job): the
runtime starts with no ``JZERO_*`` variable, exactly when JAX's detection will find the layout,
and the one process of a host keeps all of the host's devices."""

import json
import logging
import random
import socket
import sys

import jax
import pytest
from procs import child_env, device_env
from repo import SUPPORT

from jzero import distributed
from jzero.distributed import processes, runtime

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[1-4]",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_TASKS_PER_NODE": "1(x4)",
}
TWO_A_NODE = {
    **SLURM,
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}
OMPI = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
K8S = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}


def test_detection_asks_what_jax_asks_in_jax_order():
    one = distributed.detect_cluster(SLURM)
    assert one == distributed.ClusterJob("slurm", 2, 4, 1)
    assert one.describe() == (
        "Slurm job: process 2 of 4, the only one on its host: it uses all of the host's devices"
    )
    spec = distributed.resolve_spec(None, SLURM)
    assert (spec.source, spec.cluster, spec.local_device_ids) == ("cluster", one, ())
    assert spec.num_processes is None and spec.process_id is None  # JAX reads them
    two = distributed.resolve_spec(None, TWO_A_NODE)
    assert two.cluster.local_processes == 2 and two.local_device_ids is None  # JAX's rule
    assert "2 processes on its host: one device each" in two.cluster.describe()
    mixed = {**TWO_A_NODE, "SLURM_STEP_TASKS_PER_NODE": "2,1(x2)", "SLURM_STEP_NUM_NODES": "3"}
    assert distributed.detect_cluster(mixed).local_processes == 1  # node 1 runs one task
    unknown = {k: v for k, v in TWO_A_NODE.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert distributed.detect_cluster(unknown).local_processes is None  # 4 tasks, 2 nodes
    chosen = distributed.resolve_spec({"local_device_ids": [0, 1]}, SLURM)
    assert chosen.local_device_ids == (0, 1)  # the user's choice wins
    no_local = {k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}
    assert distributed.resolve_spec(None, no_local).source == "single"  # JAX needs it too
    # mpirun inside a Slurm allocation carries both; JAX takes Open MPI first, and so do we.
    both = {**SLURM, **OMPI, "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:4000"}
    assert distributed.detect_cluster(both) == distributed.ClusterJob("ompi", 5, 8, 4)
    assert distributed.resolve_spec(None, both).cluster_detection_method is None


def test_open_mpi_5_and_kubernetes_need_their_package(monkeypatch):
    installed = set()
    find_spec = processes.importlib.util.find_spec
    monkeypatch.setattr(
        processes.importlib.util,
        "find_spec",
        lambda name: find_spec("json") if name in installed else None,
    )
    with pytest.raises(ValueError, match=r"Open MPI job of 8 processes .*\(`pip install mpi4py`\)"):
        distributed.resolve_spec(None, OMPI)
    with pytest.raises(ValueError, match=r"Kubernetes indexed job .*\(`pip install jax\[k8s\]`\)"):
        distributed.resolve_spec(None, K8S)
    assert distributed.resolve_spec(None, {**K8S, "JZERO_NUM_PROCESSES": "1"}).source == "single"
    installed.update({"mpi4py", "kubernetes"})
    ompi5 = distributed.resolve_spec(None, OMPI)
    assert (ompi5.cluster.name, ompi5.cluster_detection_method) == ("ompi", "mpi4py")
    k8s = distributed.resolve_spec(None, K8S)
    assert k8s.cluster == distributed.ClusterJob("k8s", 3, None, 1) and k8s.local_device_ids == ()


def test_start_gives_a_lone_process_all_devices_and_logs_the_job(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(runtime, "backends_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    caplog.set_level(logging.INFO, logger="jzero.distributed")
    for env in ({**SLURM, "SLURM_PROCID": "0"}, TWO_A_NODE):
        runtime._start(distributed.resolve_spec(None, env), "test")
    assert [c["local_device_ids"] for c in calls] == [[], None]  # [] restricts nothing
    assert [(c["num_processes"], c["coordinator_address"]) for c in calls] == [(None, None)] * 2
    assert caplog.messages == [
        "jzero: distributed runtime started (Slurm job: process 0 of 4, the only one on its "
        "host: it uses all of the host's devices; JAX read the layout and the coordinator from "
        "the job's variables)"
    ]  # process 2 of TWO_A_NODE logs at DEBUG


def _jax_slurm_port() -> int:
    """A free port among those JAX derives from SLURM_JOB_ID (61440 + job id mod 4096)."""
    for port in random.sample(range(61440, 65536), 64):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 61440..65535")


def test_two_processes_of_a_slurm_job_form_one_run(children):
    """srun's variables only (two tasks on one node, the node list localhost), no JZERO_*."""
    job = 4096 * 17 + _jax_slurm_port() - 61440
    base = {
        k: v
        for k, v in child_env(XLA_FLAGS=device_env(4)["XLA_FLAGS"]).items()
        if not k.startswith(("SLURM_", "OMPI_", "KUBERNETES_", "JOB_COMPLETION_INDEX"))
    }
    procs = []
    for i in range(2):
        env = {
            **base,
            "SLURM_JOB_ID": str(job),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_TASKS_PER_NODE": "2",
        }
        procs.append(children.start([sys.executable, str(SUPPORT / "cluster_child.py")], env))
    for i, p in enumerate(procs):
        assert children.finish(p, timeout=120) == 0, "".join(p.out + p.err)
        record = json.loads(next(line for line in reversed(p.out) if line.startswith("{")))
        assert record == {
            "source": "cluster",
            "process_index": i,
            "process_count": 2,
            "devices": 8,
            "local_devices": 4,
            "sum": 4 * 1.0 + 4 * 2.0,  # each device holds its process index + 1
        }
        started = f"jzero: distributed runtime started (Slurm job: process {i} of 2, 2 processes"
        assert any(line.startswith(started) for line in p.err), p.err
