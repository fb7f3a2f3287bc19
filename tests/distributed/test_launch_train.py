"""SIGTERM to `jzero launch` running `jzero train` in 2 processes: both children stop after
the same step, the final checkpoint is written by both, and the launcher exits 143.

Every child's output is kept in files under the test's directory (the launcher prefixes each
line with ``[p0]`` / ``[p1]``), and the children run with Python's fault handler on, so a
failure shows each process's own last lines, a native crash included, untruncated by the other.
"""

import json
import os
import signal
import subprocess
import sys
import time

from cli_runs import TINY  # noqa: E402

from jzero.checkpoint import latest_step, list_steps


def _each_process(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines of every process's output, process by process."""
    out = []
    for p in ("[p0] ", "[p1] ", "jzero launch"):
        mine = [line for line in text.splitlines() if line.startswith(p)]
        out.append(f"--- {p.strip()} ---\n" + "\n".join(mine[-lines:]))
    return "\n".join(out)


def _sigterm_when(tmp_path, ready, why):
    """Starts `jzero launch -n 2 -- jzero train`, sends the launcher SIGTERM once ``ready()``
    holds, and checks that both processes stopped after the same step with their shards of the
    final checkpoint and the summary, and the launcher exited 143. Returns the summary."""
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    metrics = log_dir / "metrics.jsonl"
    train = ["jzero", "train", "configs/zero2.yaml", "--steps", "100000", "--quiet", *TINY]
    train += ["--set", f"train.log_dir={log_dir}", "--set", "train.eval_interval=0"]
    train += ["--set", f"checkpoint.directory={ckpt}", "--set", "train_micro_batch_size_per_gpu=1"]
    # Monitors with an empty output_path write into train.log_dir, from process 0 only.
    train += ["--set", "csv_monitor.enabled=true", "--set", "tensorboard.enabled=true"]
    cmd = [
        sys.executable,
        "-m",
        "jzero.distributed.launch",
        "-n",
        "2",
        "--devices-per-process",
        "4",
    ]
    cmd += ["--grace-period", "120", "--", *train]
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    out_path, err_path = tmp_path / "launch.out", tmp_path / "launch.err"
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        proc = subprocess.Popen(
            cmd, stdout=out_file, stderr=err_file, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 300
            while not ready(metrics, err_path):
                assert proc.poll() is None, _each_process(err_path.read_text())
                assert time.monotonic() < deadline, f"not {why} within 300 s"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out, err = out_path.read_text(), err_path.read_text()
    shown = _each_process(err)
    assert proc.returncode == 143, shown
    assert "Traceback" not in err and "Fatal Python error" not in err, shown
    assert (log_dir / "summary.json").exists(), shown
    summary = json.loads((log_dir / "summary.json").read_text())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert summary["interrupted"] is True
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    assert list_steps(ckpt) == [summary["steps"]] == [latest_step(ckpt)]
    state = ckpt / str(summary["steps"]) / "state"
    assert (state / "ocdbt.process_0").is_dir() and (state / "ocdbt.process_1").is_dir()
    assert out.count("interrupted: ") == 1  # only process 0 reports
    # Only process 0 wrote to the monitors: one row per step, one TensorBoard event file.
    job = log_dir / "DeepSpeedJobName"
    rows = (job / "Train_Samples_train_loss.csv").read_text().splitlines()
    samples = 8  # train_micro_batch_size_per_gpu 1 on 2 x 4 devices
    assert [int(r.split(",")[0]) for r in rows[1:]] == [samples * r["step"] for r in records]
    assert rows[0] == "step,train_loss" and len(list(job.glob("events.out.tfevents.*"))) == 1
    return summary


def test_sigterm_to_the_launcher_saves_a_final_checkpoint_of_both_processes(tmp_path):
    def two_steps(metrics, err_path):
        return metrics.exists() and metrics.read_text().count("\n") >= 2

    assert _sigterm_when(tmp_path, two_steps, "two steps")["steps"] >= 2


def test_sigterm_while_the_engine_is_built_stops_after_the_first_step(tmp_path):
    """JAX's distributed runtime installs a SIGTERM handler of its own that only logs: a
    SIGTERM while the engine was built (compiling) used to be swallowed, and the run trained
    on until the launcher's SIGKILL. jzero's handler replaces it as soon as the runtime is up."""

    def building(metrics, err_path):  # process 0 logs the plan while initialize runs
        return "[p0] jzero: stage" in err_path.read_text()

    assert _sigterm_when(tmp_path, building, "the engine built")["steps"] == 1
