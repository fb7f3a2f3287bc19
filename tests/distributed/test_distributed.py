"""jzero on several processes: a bounded end when a process dies, ``jzero launch``'s output and
clean-up, and the error for starting too late (training on two processes like one:
test_two_processes.py).

Multi-process runs are child processes (tests/dist_*.py), each in its own process group, every
wait bounded by a timeout, and every group killed when the test ends, however it ends.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import dist_peer
import jax
import numpy as np
import pytest
from procs import child_env, device_env, gone, launcher
from repo import ROOT, SUPPORT

from jzero import distributed
from jzero.demo import data
from jzero.distributed import launch


# -- a dying process ------------------------------------------------------------------------------
def test_killing_one_process_ends_the_other_within_its_heartbeat_bound(children):
    """dist_peer.py starts the runtime with a heartbeat timeout of HEARTBEAT s (the default is
    30 s: test_layout_from_config_env_and_cluster): process 0 must end within a few of them."""
    port = launch.free_port()
    env = {"XLA_FLAGS": device_env(4)["XLA_FLAGS"]}
    procs = [
        children.start(
            [sys.executable, str(SUPPORT / "dist_peer.py")],
            child_env(**env, **launch.child_env({}, i, 2, port)),
        )
        for i in range(2)
    ]
    children.wait_for_line(procs[0], r"^step 2 sum 8\.0", timeout=180)
    children.wait_for_line(procs[1], r"^process 1 waiting", timeout=60)
    os.kill(procs[1].pid, signal.SIGKILL)
    code = children.finish(procs[0], timeout=3 * dist_peer.HEARTBEAT)
    assert code != 0
    err = "".join(procs[0].err)
    assert "another task died" in err or "Connection closed by peer" in err, err


# -- jzero launch ---------------------------------------------------------------------------------
def test_launch_forwards_prefixed_lines_returns_the_failing_code_and_leaves_nothing(
    children, tmp_path
):
    cmd = launcher("-n", "2", "--grace-period", "1", "--", sys.executable)
    p = children.start([*cmd, str(SUPPORT / "dist_echo.py")], child_env(ECHO_DIR=str(tmp_path)))
    assert children.finish(p, timeout=120) == 5
    out, err = "".join(p.out), "".join(p.err)
    pids = {
        int(i): int(pid) for i, pid in re.findall(r"^\[p(\d)\] out \1 pid (\d+) of 2$", out, re.M)
    }
    assert sorted(pids) == [0, 1]
    assert re.search(r"^\[p0\] err 0$", err, re.M) and re.search(r"^\[p1\] err 1$", err, re.M)
    # Gloo's report of a communicator connected as expected is dropped; a missing peer is not.
    assert "is connected to 1 peer ranks" not in out
    assert out.count("is connected to 0 peer ranks. Expected number") == 2
    assert f"process 1 (pid {pids[1]}) exited with code 5" in err
    grandchild = int(re.search(r"^\[p0\] grandchild (\d+)$", out, re.M).group(1))
    for pid in pids.values():  # the launcher waited for its children: their PIDs are free
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    deadline = time.monotonic() + 10
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(grandchild)  # process 0 ignored SIGTERM: SIGKILL reached its whole group


def test_launch_stops_everything_on_ctrl_c(children, tmp_path):
    cmd = launcher(
        "-n", "2", "--grace-period", "1", "--", sys.executable, str(SUPPORT / "dist_echo.py")
    )
    p = children.start(cmd, child_env(ECHO_DIR=str(tmp_path), ECHO_EXIT="wait"))
    lines = [children.wait_for_line(p, rf"^\[p{i}\] ready {i}", timeout=120) for i in (1, 0)]
    assert len(lines) == 2
    os.kill(p.pid, signal.SIGINT)
    assert children.finish(p, timeout=60) == 130
    assert "jzero launch: interrupted; stopped all 2 process(es)." in "".join(p.err)
    for pid in map(int, re.findall(r"^\[p\d\] out \d pid (\d+)", "".join(p.out), re.M)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_command_line_and_child_environment(monkeypatch):
    ap = argparse.ArgumentParser()
    launch.add_commands(ap.add_subparsers(dest="command_name"))
    args = ap.parse_args(["launch", "-n", "2", "--devices-per-process", "4", "--", "jzero", "x"])
    assert (args.num_processes, args.devices_per_process, args.func) == (2, 4, launch._run)
    assert launch._resolve_command(args.command) == [sys.executable, "-m", "jzero.cli", "x"]
    env = launch.child_env(
        {"XLA_FLAGS": "--a --xla_force_host_platform_device_count=8"}, 1, 3, 99, 4
    )
    assert env["XLA_FLAGS"] == "--a --xla_force_host_platform_device_count=4"
    assert (env["JZERO_COORDINATOR"], env["JZERO_NUM_PROCESSES"], env["JZERO_PROCESS_ID"]) == (
        "127.0.0.1:99",
        "3",
        "1",
    )
    with pytest.raises(ValueError, match=r"--num-processes is 0; it must be a positive integer"):
        launch.launch(["true"], 0)
    with pytest.raises(ValueError, match="needs a command to run"):
        launch.launch(["--"], 2)
    line = (
        "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"
    )
    assert launch.is_gloo_chatter(line) and not launch.is_gloo_chatter(line.replace("to 7", "to 6"))
    calls = []
    monkeypatch.setattr(launch, "launch", lambda *a, **kw: calls.append(kw) or 0)
    for extra in ([], ["--verbose"]):  # jzero train --verbose shows every library's lines
        launch._run(ap.parse_args(["launch", "-n", "2", "--", "jzero", "train", "c", *extra]))
    assert [kw["output"].keep_gloo_lines for kw in calls] == [False, True]


# -- starting the runtime -------------------------------------------------------------------------
def test_jax_before_initialize_with_two_processes_in_the_env_says_init_distributed_first():
    code = (
        "import jax.numpy as jnp, optax, toy, jzero\n"
        "jnp.ones(2).sum()\n"
        "try:\n"
        "    jzero.initialize(toy.make_params(), toy.loss_fn, optax.sgd(0.1),\n"
        "                     {'train_batch_size': 8})\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "    raise SystemExit(3)\n"
    )
    env = child_env(
        PYTHONPATH=f"{ROOT}{os.pathsep}{SUPPORT}",
        JZERO_NUM_PROCESSES="2",
        JZERO_PROCESS_ID="0",
        JZERO_COORDINATOR="127.0.0.1:9",
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "The environment (JZERO_NUM_PROCESSES=2) asks for several JAX processes" in proc.stdout
    assert "Call jzero.init_distributed() at the top of your script" in proc.stdout


def test_too_late_from_the_config_too_and_one_process_needs_nothing():
    jax.devices()  # a backend exists in the test process
    with pytest.raises(RuntimeError, match=r"num_processes=2\) asks for several JAX processes"):
        distributed.init_distributed(
            {"coordinator_address": "localhost:9", "num_processes": 2, "process_id": 1}
        )
    assert distributed.init_distributed().source == "single"  # idempotent no-op here
    batch = {"x": np.ones((4, 2))}
    assert distributed.global_batch(batch, None, 4) is batch


def test_layout_from_config_env_and_cluster():
    env = {"JZERO_COORDINATOR": "h:1234", "JZERO_NUM_PROCESSES": "4", "JZERO_PROCESS_ID": "2"}
    spec = distributed.resolve_spec(None, env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == (
        "h:1234",
        4,
        2,
        "env",
    )
    spec = distributed.resolve_spec({"process_id": 3, "heartbeat_timeout": 5}, env)
    assert (spec.process_id, spec.source, spec.heartbeat_timeout) == (3, "config", 5)
    assert distributed.resolve_spec(None, {}).multi_process is False
    # A dead process ends the others within this bound (dist_peer.py tests a shorter one).
    assert distributed.resolve_spec(None, env).heartbeat_timeout == 30
    assert distributed.resolve_spec({"num_processes": 1}, {}).source == "single"
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0"}
    slurm["SLURM_LOCALID"] = "0"  # JAX reads it too
    assert distributed.resolve_spec(None, {**slurm, "SLURM_NTASKS": "2"}).source == "cluster"
    assert distributed.resolve_spec(None, {**slurm, "SLURM_NTASKS": "1"}).source == "single"
    forced = {**slurm, "SLURM_NTASKS": "2", "JZERO_NUM_PROCESSES": "1"}
    assert distributed.resolve_spec(None, forced).source == "single"
    ompi = {"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}
    assert distributed.resolve_spec(None, ompi).source == "cluster"
    auto = distributed.resolve_spec({"cluster_detection_method": "auto"}, {})
    assert (auto.source, auto.cluster_detection_method) == ("cluster", None)


@pytest.mark.parametrize(
    "cfg, env, message",
    [
        (None, {"JZERO_NUM_PROCESSES": "two"}, "JZERO_NUM_PROCESSES is 'two', but it must be"),
        (None, {"JZERO_NUM_PROCESSES": "2"}, "JZERO_COORDINATOR / distributed.coordinator_add"),
        ({"num_processes": 2, "process_id": 2, "coordinator_address": "h:1"}, {}, r"in \[0, 1\]"),
        ({"num_processes": 2, "process_id": 0, "coordinator_address": "h"}, {}, "host:port"),
        ({"num_procs": 2}, {}, r"Unknown key\(s\) \['num_procs'\]"),
    ],
)
def test_layout_errors_name_the_value_and_the_fix(cfg, env, message):
    with pytest.raises(ValueError, match=message):
        distributed.resolve_spec(cfg, env)


# -- data per process -----------------------------------------------------------------------------
@pytest.mark.parametrize("count", [2, 4])
def test_process_slices_put_together_are_the_one_process_batch(count):
    tokens = np.arange(1000, dtype=np.uint16) % 251
    whole = data.BatchIterator(tokens, 8, 16, seed=3)
    parts = [
        data.BatchIterator(tokens, 8, 16, seed=3, process_index=i, process_count=count)
        for i in range(count)
    ]
    for _ in range(3):
        joined = np.concatenate([p.next()["tokens"] for p in parts])
        np.testing.assert_array_equal(joined, whole.next()["tokens"])
    evals = [
        data.eval_batches(tokens, 8, 16, 2, process_index=i, process_count=count)
        for i in range(count)
    ]
    for b, ref in enumerate(data.eval_batches(tokens, 8, 16, 2)):
        joined = np.concatenate([e[b]["tokens"] for e in evals])
        np.testing.assert_array_equal(joined, ref["tokens"])
