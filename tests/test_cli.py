"""`jzero train` end to end on a tiny model, and its handling of a bad config."""

import json
import subprocess
import sys

from jzero import cli

TINY = [
    "--set",
    "model={vocab_size: 256, seq_len: 16, num_layers: 2, num_heads: 2, d_model: 32, d_ff: 64}",
    "--set",
    "data={source: stdlib, max_bytes: 200000}",
    "--set",
    "train_micro_batch_size_per_gpu=2",
    "--set",
    "train.eval_interval=3",
    "--set",
    "train.eval_batches=1",
    "--set",
    "steps_per_print=2",
    "--set",
    "zero_optimization.stage=3",
    "--set",
    "zero_optimization.stage3_param_persistence_threshold=0",
]


def test_train_runs_end_to_end_and_writes_metrics(tmp_path, capsys):
    log_dir = tmp_path / "run"
    rc = cli.main(
        ["train", "configs/zero2.yaml", "--steps", "6", "--quiet", *TINY]
        + ["--set", f"train.log_dir={log_dir}"]
    )
    assert rc == 0
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "grad_norm", "lr", "tokens_per_s"} <= set(records[0])
    assert "eval_loss" in records[2] and "eval_loss" in records[5]
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["stage"] == 3 and summary["devices"] == 8
    assert summary["eval_loss"] < summary["first_eval_loss"]
    assert "done:" in capsys.readouterr().out


def test_bad_config_exits_2_with_the_message_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_optimization: {stage: 7}\ntrain_micro_batch_size_per_gpu: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "jzero.cli", "train", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "jzero: error: zero_optimization.stage: 7" in proc.stderr
    assert "Traceback" not in proc.stderr
