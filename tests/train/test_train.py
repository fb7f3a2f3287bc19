"""`jzero.train.run`, the `jzero train` loop as a library function: no argparse, its summary
returned, written and printed alike, and a SIGTERM stops it after the step with a checkpoint."""

import json
import logging
import math
import os
import signal
import threading

import pytest
from cli_runs import shared_compile_cache
from procs import signal_at_step

from jzero import train
from jzero.checkpoint import list_steps

TINY = [
    "checkpoint.directory=null",  # no checkpoints unless a test names a folder
    "model={vocab_size: 256, seq_len: 16, num_layers: 2, num_heads: 2, d_model: 32, d_ff: 64}",
    "data={source: stdlib, max_bytes: 200000}",
    "train_micro_batch_size_per_gpu=2",
    "train.eval_interval=0",  # no eval step: one compiled train step
    *shared_compile_cache(),  # the run-wide cache: tests/cli's runs compile the same step
]


def test_run_returns_the_summary_it_writes_and_stops_on_sigterm(tmp_path, monkeypatch, caplog):
    """SIGTERM (what SLURM sends before a kill) during step 2: the run ends after step 2,
    saves it, and reports the signal the CLI turns into exit status 143. (A second SIGTERM,
    and Ctrl-C, through the CLI's process: tests/cli/test_cli.py.)"""
    assert threading.current_thread() is threading.main_thread()  # run installs the handler
    log_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    signal_at_step(monkeypatch, signal.SIGTERM, 2)  # the run's handler catches it
    handler = signal.getsignal(signal.SIGTERM)
    overrides = [*TINY, f"train.log_dir={log_dir}", f"checkpoint.directory={ckpt}"]
    # Stage 3 as tests/cli/test_cli.py trains it: the same compiled step.
    overrides += ["zero_optimization.stage=3"]
    overrides += ["zero_optimization.stage3_param_persistence_threshold=0"]
    overrides.append("flops_profiler={peak_flops: 1.0e12}")  # a peak: MFU on every line
    with caplog.at_level(logging.WARNING, logger="jzero"):
        summary = train.run("configs/zero2.yaml", overrides=overrides, steps=50, progress=False)
    # A single SIGTERM is never reported as a second.
    assert "received again" not in caplog.text
    # --steps 50 under configs/zero2.yaml's 150-step cosine: said once.
    cut = "the run ends at step 50, before its schedule's decay ends (scheduler.params."
    assert caplog.text.count(cut) == 1
    assert "total_num_steps: 150): the learning rate never reaches" in caplog.text

    assert summary["steps"] == 2 and summary["interrupted"] is True
    assert summary["signal"] == "SIGTERM" and summary["stopped"] is None
    assert train.exit_code(summary) == 128 + signal.SIGTERM
    assert summary["stage"] == 3 and summary["devices"] == 8 and summary["resumed_from"] is None
    assert summary["first_eval_loss"] is None  # eval_interval 0
    # What run writes (summary.json) is what it returned.
    assert json.loads((log_dir / "summary.json").read_text()) == summary
    assert json.loads(train.strict_json(summary)) == summary
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["loss"] == pytest.approx(summary["final_loss"])
    assert all(0 < r["mfu"] < 1 for r in records) and summary["mfu"] == records[-1]["mfu"]
    assert list_steps(ckpt) == [2]  # the interrupted run's state, saved at the step it ended
    assert signal.getsignal(signal.SIGTERM) is handler  # run's handler is gone again
    # What the CLI prints: a few lines, each figure named (test_the_summary_names_its_figures).
    text = train.format_summary(summary)
    assert text.startswith("interrupted: SIGTERM after step 2; trained steps 1-2 in ")
    assert "% (mean after the first step)\n  memory:     peak " in text
    assert text.endswith(f"  checkpoint: step 2 in {ckpt}")


def test_the_summary_names_its_figures():
    """The lines `jzero train` ends with (stdout; the JSON is summary.json): the run's
    average tokens/s is told from the bar's last-step rate, a resumed run's eval loss from
    where it resumed, and what stopped or failed a run is said."""
    summary = {
        "steps": 150, "interrupted": False, "signal": None, "stopped": None,
        "skipped_steps": 0, "final_loss": 1.23456, "first_eval_loss": 2.5,
        "eval_loss": 1.5, "seconds": 125.0, "tokens_per_s": 12345.6, "resumed_from": 100,
        "stage": 2, "devices": 8, "peak_bytes_per_device": 3 * 2**20,
        "model_state_bytes_per_device": 2**20, "mfu": None, "metrics": "runs/a/metrics.jsonl",
        "checkpoint_directory": "runs/a/ckpt", "checkpoint_error": None, "last_checkpoint": 150,
    }  # fmt: skip
    assert train.format_summary(summary).splitlines() == [
        "done: trained steps 101-150 in 2 min 05 s, resumed from checkpoint 100 (ZeRO stage 2, "
        "8 devices)",
        "  loss:       1.2346 at step 150 (training batch); eval loss 1.5000 (2.5000 at step 100)",
        "  throughput: 12,346 tokens/s, this run's average (50 step(s); evaluations and "
        "compiling included)",
        "  memory:     peak 3.0 MiB per device (model state 1.0 MiB)",
        "  logs:       runs/a/metrics.jsonl (a line per step), runs/a/summary.json",
        "  checkpoint: step 150 in runs/a/ckpt",
    ]
    stopped = "stopped at step 3: 2 consecutive steps had inf/NaN gradients (...)"
    text = train.format_summary(
        {**summary, "resumed_from": None, "steps": 3, "stopped": stopped, "final_loss": None,
         "first_eval_loss": None, "eval_loss": None, "skipped_steps": 2,
         "checkpoint_directory": None, "last_checkpoint": None}
    )  # fmt: skip
    assert text.startswith("stopped: trained steps 1-3 in 2 min 05 s (ZeRO stage 2, 8 devices)")
    assert f"\n  why:        {stopped}\n  loss:       NaN at step 3 (training batch)\n" in text
    assert "\n  skipped:    2 update(s), for inf/NaN gradients\n" in text
    assert text.endswith("  checkpoint: none (the config sets no checkpoint.directory)")
    text = train.format_summary({**summary, "steps": 100})  # resumed at --steps or past it
    assert text.startswith("done: nothing trained: checkpoint 100 is at or past the last step")
    assert "loss" not in text and "tokens/s" not in text


def test_exit_code_of_a_summary():
    done = {"interrupted": False, "signal": None, "stopped": None}
    assert train.exit_code(done) == 0
    assert train.exit_code({**done, "stopped": "stopped at step 3: ..."}) == 1
    assert train.exit_code({**done, "interrupted": True, "signal": "SIGINT"}) == 130
    assert train.exit_code({**done, "interrupted": True, "signal": "SIGTERM"}) == 143


def test_run_with_the_state_and_parameters_on_nvme_resumes_from_its_checkpoint(tmp_path, caplog):
    """`jzero train` at stage 3 with offload_optimizer and offload_param on NVMe: the loop
    (its compiled-peak report, final checkpoint, resume) works on the tier, and the run leaves
    nothing under nvme_path."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    overrides = [
        *TINY,
        f"train.log_dir={tmp_path / 'run'}",
        f"checkpoint.directory={tmp_path / 'ckpt'}",
        f"zero_optimization.offload_optimizer={{device: nvme, nvme_path: {nvme}}}",
        "zero_optimization.offload_param={device: nvme}",
        "zero_optimization.sub_group_size=20000",
        # Every parameter sharded, none kept whole on each device (persistent): all take the
        # tier's path, and the checkpoint saves shards (no per-device slices to compile).
        "zero_optimization.stage3_param_persistence_threshold=0",
    ]
    caplog.set_level("INFO", logger="jzero")
    first = train.run("configs/zero3.yaml", overrides=overrides, steps=1, progress=False)
    assert first["steps"] == 1 and list_steps(tmp_path / "ckpt") == [1]
    again = train.run("configs/zero3.yaml", overrides=overrides, steps=2, progress=False)
    assert again["resumed_from"] == 1 and list_steps(tmp_path / "ckpt")[-1] == 2
    assert again["steps"] == 2 and math.isfinite(again["final_loss"])
    # The start-up line counts what is in files apart from device memory.
    line = next(r.getMessage() for r in caplog.records if "training 1 steps" in r.getMessage())
    assert "on NVMe" in line, line
    assert not os.listdir(nvme)
