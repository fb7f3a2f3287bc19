"""SIGTERM to `jzero launch` running `jzero train` in 2 processes: both children stop after
the same step, the final checkpoint is written by both, and the launcher exits 143."""

import json
import os
import signal
import subprocess
import sys
import time

from test_cli import TINY

from jzero.checkpoint import latest_step, list_steps


def test_sigterm_to_the_launcher_saves_a_final_checkpoint_of_both_processes(tmp_path):
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    metrics = log_dir / "metrics.jsonl"
    train = ["jzero", "train", "configs/zero2.yaml", "--steps", "100000", "--quiet", *TINY]
    train += ["--set", f"train.log_dir={log_dir}", "--set", "train.eval_interval=0"]
    train += ["--set", f"checkpoint.directory={ckpt}", "--set", "train_micro_batch_size_per_gpu=1"]
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
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no metrics within 300 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (log_dir / "summary.json").exists(), (out[-3000:], err[-3000:])
    summary = json.loads((log_dir / "summary.json").read_text())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert summary["interrupted"] is True and summary["steps"] >= 2
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    assert list_steps(ckpt) == [summary["steps"]] == [latest_step(ckpt)]
    assert out.count("interrupted: ") == 1  # only process 0 reports
