"""`jzero train` end to end on a tiny model (what it prints, its log folder and checkpoints),
its handling of a bad config, and of Ctrl-C."""

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_runs import TINY
from procs import signal_at_step
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jzero import cli
from jzero.checkpoint import latest_step, list_steps


def _monitored(job, name):
    """The ``(samples, value)`` rows of the CSV monitor's ``Train/Samples/<name>`` file."""
    rows = (job / f"Train_Samples_{name}.csv").read_text().splitlines()
    assert rows[0] == f"step,{name}"
    return [(int(r.split(",")[0]), float(r.split(",")[1])) for r in rows[1:]]


@contextlib.contextmanager
def process_logging():
    """The logging of a `jzero` process in this one: pytest's root handlers are put aside, so
    `cli.main` sets up its own (on the stderr capsys reads), and put back after."""
    root = logging.getLogger()
    named = [logging.getLogger(n) for n in ("jzero", "absl")]
    handlers, levels = root.handlers[:], [x.level for x in (root, *named)]
    root.handlers = []
    try:
        yield
    finally:
        root.handlers = handlers
        for x, level in zip((root, *named), levels, strict=True):
            x.setLevel(level)


# The INFO lines of JAX (its compilation cache) and Orbax (through absl) in a run that saves.
OTHERS_INFO = ("Resetting cache at", "Saving checkpoint at step", "CheckpointManager")


def test_train_runs_end_to_end_checkpoints_and_resumes(tmp_path, capsys):
    """Also what it prints: jzero's log lines on stderr (no bar: it is not a terminal), not the
    other libraries' INFO (but with --verbose), and its summary on stdout. The checkpoint
    directory is inside the log folder, as configs/zero2.yaml has it."""
    log_dir = tmp_path / "run"
    ckpt = log_dir / "ckpt"
    args = ["train", "configs/zero2.yaml", *TINY]
    args += ["--set", f"train.log_dir={log_dir}", "--set", f"checkpoint.directory={ckpt}"]
    # DeepSpeed's monitors, without an output_path: they write into train.log_dir.
    args += ["--set", "csv_monitor.enabled=true", "--set", "tensorboard.enabled=true"]
    with process_logging():
        assert cli.main([*args, "--steps", "6"]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err  # no bar: stderr is not a terminal
    for line in ("jzero: stage 3, ", "step 6: loss ", "step 6: eval loss ", "checkpoint 6 written"):
        assert line in err, err
    assert not [x for x in OTHERS_INFO if x in err], err
    assert out.startswith("done: trained steps 1-6 in ") and "(ZeRO stage 3, 8 devices)\n" in out
    for label in ("at step 6 (training batch); eval loss ", " at step 0)\n", " tokens/s, this "):
        assert label in out, out
    assert "  memory:     peak " in out and " per device (model state " in out
    assert f"  logs:       {log_dir / 'metrics.jsonl'} (a line per step), " in out
    assert out.endswith(f"  checkpoint: step 6 in {ckpt}\n")
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= set(records[0])
    assert "eval_loss" in records[2] and "eval_loss" in records[5]
    batch = 16  # train_micro_batch_size_per_gpu 2 on 8 devices; the monitors' step is samples
    job = log_dir / "DeepSpeedJobName"
    assert _monitored(job, "train_loss") == [(batch * r["step"], r["loss"]) for r in records]
    summary = json.loads((log_dir / "summary.json").read_text())
    evals = [(0, summary["first_eval_loss"])]
    evals += [(batch * r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert _monitored(job, "eval_loss") == evals
    assert len(_monitored(job, "tokens_per_s")) == 6
    events = EventAccumulator(str(job))
    events.Reload()
    series = [(e.step, e.value) for e in events.Scalars("Train/Samples/train_loss")]
    assert series == [(s, float(np.float32(v))) for s, v in _monitored(job, "train_loss")]
    assert summary["steps"] == 6 and summary["stage"] == 3 and summary["devices"] == 8
    assert summary["eval_loss"] < summary["first_eval_loss"]
    assert summary["resumed_from"] is None
    # The measured peak (compiled step on CPU) exceeds the model state alone.
    assert summary["peak_bytes_per_device"] > summary["model_state_bytes_per_device"] > 0
    # A final checkpoint was written; the next run picks up at step 7 and appends, once it has
    # dropped the line of a step after the checkpoint (as a run killed at step 7 leaves it).
    with (log_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({**records[-1], "step": 7}) + "\n")
    with process_logging():  # --verbose: the other libraries' INFO too
        assert cli.main([*args, "--steps", "8", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert all(x in err for x in OTHERS_INFO), err
    assert out.startswith("done: trained steps 7-8 in ") and "resumed from checkpoint 6" in out
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 6 and summary["steps"] == 8
    # The resumed run appended its rows to the monitor's CSV files.
    assert _monitored(job, "train_loss") == [(batch * r["step"], r["loss"]) for r in records]
    capsys.readouterr()
    assert cli.main(["checkpoint", "inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "complete steps: [6, 8]" in out and "\nstep 8 (saved on 8 devices):" in out
    assert "  tree params:" in out
    # An export prints its jzero line, not Orbax's read reports.
    weights = tmp_path / "model.safetensors"
    with process_logging():
        assert cli.main(["checkpoint", "export", str(ckpt), "--out", str(weights)]) == 0
    err = capsys.readouterr().err
    assert "jzero: exported 16 leaves of step 8" in err and "gbytes_per_sec" not in err, err
    # Not a checkpoint directory: a file (exported weights), the log folder around one.
    assert cli.main(["checkpoint", "inspect", str(weights)]) == 2
    err = capsys.readouterr().err
    assert f"{str(weights)!r} is a file, not a checkpoint directory. A jzero checkpoint" in err
    assert "A weights file (as jzero checkpoint export writes) is not a checkpoint" in err
    assert cli.main(["checkpoint", "export", str(log_dir), "--out", str(weights)]) == 2
    assert f"Inside it, {str(ckpt)!r} holds the steps [6, 8]." in capsys.readouterr().err
    # --no-resume into this run's directory is refused, and nothing there is touched ...
    assert cli.main([*args, "--steps", "1", "--no-resume"]) == 2
    assert "earlier run (steps [6, 8], the latest 8). Pass --overwrite" in capsys.readouterr().err
    assert list_steps(ckpt) == [6, 8]
    # ... and --overwrite starts again from step 1, whose checkpoint replaces the old run's.
    assert cli.main([*args, "--steps", "1", "--overwrite"]) == 0
    first = json.loads((log_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    assert _monitored(job, "train_loss") == [(batch, first["loss"])]  # a fresh run's files
    assert json.loads((log_dir / "summary.json").read_text())["resumed_from"] is None
    assert list_steps(ckpt) == [1] and latest_step(ckpt) == 1


def test_a_fresh_run_into_an_earlier_runs_log_folder_is_refused(tmp_path, capsys):
    """`jzero train CONFIG --set zero_optimization.stage=3` after `jzero train CONFIG` must not
    replace the first run's metrics.jsonl and summary.json: refused before anything is built.
    (A resumed run appends, and --overwrite replaces: the end-to-end test above.)"""
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    metrics = log_dir / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.4}\n')
    args = ["train", "configs/zero2.yaml", "--set", f"train.log_dir={log_dir}"]
    empty = log_dir / "ckpt"  # a checkpoint directory inside the log folder, with no step
    for ckpt, why in [
        ("null", "the config sets no checkpoint.directory to resume from"),
        (empty, f"there is no checkpoint to resume from in {str(empty)!r}"),
    ]:
        assert cli.main([*args, "--set", f"checkpoint.directory={ckpt}"]) == 2
        err = capsys.readouterr().err
        assert f"The log folder {str(log_dir)!r} (train.log_dir) holds the metrics.jsonl of " in err
        assert (
            f"earlier run (its last line is step 2), and this run starts from step 1 ({why})" in err
        )
        assert "Pass --overwrite to replace them, or give this run a folder of its own" in err
        assert f"--set train.log_dir={log_dir}-2." in err
    assert metrics.read_text().count("\n") == 2 and not empty.exists()
    # The log folder as the checkpoint directory: the first save would refuse its log files.
    assert cli.main([*args, "--overwrite", "--set", f"checkpoint.directory={log_dir}"]) == 2
    err = capsys.readouterr().err
    assert f"e.g. --set checkpoint.directory={log_dir / 'ckpt'}." in err


def test_bad_config_exits_2_with_the_message_and_no_traceback(tmp_path, capsys):
    """In this process: `python -m jzero.cli` hands main's status to the shell (the stop-signal
    test below reads 143 from a process of its own)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_optimization: {stage: 7}\ntrain_micro_batch_size_per_gpu: 1\n")
    with process_logging():
        assert cli.main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "jzero: error: zero_optimization.stage: 7" in err
    assert "Traceback" not in err


def test_ctrl_c_ends_after_the_step_with_a_summary_and_a_checkpoint(tmp_path, capsys, monkeypatch):
    """Ctrl-C (SIGINT) during step 2, in this process (the handler is the run's, as in a
    process of its own: the SIGTERM test below): the run ends after step 2 with its summary, a
    checkpoint of step 2 and exit status 130, and the one signal is never told as a second."""
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    signal_at_step(monkeypatch, signal.SIGINT, 2)  # the run's handler catches it
    handler = signal.getsignal(signal.SIGINT)
    args = ["train", "configs/zero2.yaml", "--steps", "100000", *TINY]
    args += ["--set", f"train.log_dir={log_dir}", "--set", "train.eval_interval=1"]
    args += ["--set", f"checkpoint.directory={ckpt}"]
    with process_logging():
        assert cli.main(args) == 128 + signal.SIGINT
    out, err = capsys.readouterr()
    assert signal.getsignal(signal.SIGINT) is handler  # the run's handler is gone again
    assert out.startswith("interrupted: SIGINT after step 2")
    assert "jzero: stage 3, " in err  # jzero's log lines are read here
    assert "Traceback" not in err and "received again" not in err
    assert "received after the run ended" not in err
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["signal"] == "SIGINT"
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert list_steps(ckpt) == [2]  # the interrupted run's state, saved at the step it ended


def test_sigterm_twice_ends_after_the_step_with_the_summary_and_a_checkpoint(tmp_path):
    """SIGTERM (what SLURM and Kubernetes send before a kill) stops a `jzero train` process
    gracefully. SLURM signals every process of a job, so under a launcher a child gets SIGTERM
    twice: the second, 0.3 s later (during the last step or the final save), must not cost the
    final checkpoint or the summary. (The first SIGTERM takes the path a single one takes, and
    tests/train/test_train.py stops a run with a single SIGTERM in the test's process; Ctrl-C:
    the test above.)"""
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    metrics = log_dir / "metrics.jsonl"
    args = ["train", "configs/zero2.yaml", "--steps", "100000", *TINY]  # no --quiet: piped
    args += ["--set", f"train.log_dir={log_dir}", "--set", "train.eval_interval=1"]
    args += ["--set", f"checkpoint.directory={ckpt}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jzero.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        # The metrics file is block-buffered: wait until its first lines reach the disk.
        while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no metrics line within 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    assert out.startswith("interrupted: SIGTERM after step ")
    # A process of its own, its stderr a pipe: no bar (no carriage return), jzero's lines, and
    # none of the other libraries' INFO (JAX's cache, Orbax's save reports).
    assert "\r" not in err and "jzero: stage 3, " in err and "step 0: eval loss" in err
    assert not [x for x in OTHERS_INFO if x in err], err[-3000:]
    # The second SIGTERM lands in the run (logged), just after it (logged too) or, when the
    # stop and save took under 0.3 s, while the interpreter shuts down (ignored: CPython's
    # finalization would reset a Python handler to the default, a kill, exit -15, as it did
    # here every time on a quiet machine); either way the exit status and the checkpoint are
    # the run's. A single signal is never reported as a second (Ctrl-C: the test above; a
    # single SIGTERM: tests/train/test_train.py).
    summary = json.loads((log_dir / "summary.json").read_text())
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert summary["interrupted"] is True
    assert 1 <= summary["steps"] < 100000
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    # The interrupted run's state was saved, complete, at the step it stopped after.
    assert list_steps(ckpt) == [summary["steps"]]


def test_a_run_whose_gradients_stay_nonfinite_stops_and_saves_no_nan(tmp_path, caplog):
    """lr 1e30 blows the float32 params up at step 1; every later step is NaN."""
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["train", "configs/zero2.yaml", "--quiet", "--steps", "50", *TINY]
    args += ["--set", f"train.log_dir={log_dir}", "--set", f"checkpoint.directory={ckpt}"]
    args += ["--set", "train.eval_interval=0", "--set", "optimizer.params.lr=1e30"]
    args += ["--set", "scheduler=null", "--set", "train.max_consecutive_nonfinite=2"]
    with caplog.at_level(logging.WARNING, logger="jzero"):
        assert cli.main(args) == 1
    err = caplog.text
    assert "stopped at step 3: 2 consecutive steps had inf/NaN gradients" in err
    assert "NOT saving checkpoint step 3: the parameters hold inf/NaN" in err
    assert list_steps(ckpt) == []  # no checkpoint of NaN parameters

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))

    records = [strict(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] for r in records] == [0.0, 1.0, 1.0]
    assert records[-1]["loss"] is None
    summary = strict((log_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["stopped"].startswith("stopped at step 3")
