"""DeepSpeed's monitors from the config: TensorBoard event files (read back with TensorBoard's
own reader), CSV files in DeepSpeed's layout, and an offline wandb run, each holding the loss
series the steps returned; only process 0 writes; a missing wandb is named before training.

``jzero train``'s monitors (eval loss, tokens/s, a resumed run appending) are checked in
tests/cli/test_cli.py, and two processes writing once in tests/distributed/test_launch_train.py.
"""

import csv
import importlib.util
import re

import numpy as np
import pytest
import toy
import wandb
import wandb_history
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import jzero
from jzero import monitor
from jzero.config import ConfigError, load_config
from jzero.distributed import CompileCounter

BATCH, STEPS = 16, 4


def _config(tmp_path, **monitors):
    return {
        "train_batch_size": BATCH,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flops_profiler": {"peak_flops": 1e12},  # a stated peak: MFU is logged on CPU too
        **monitors,
    }


def _csv_rows(path):
    with path.open(newline="") as f:
        return list(csv.reader(f))


def test_monitors_hold_the_steps_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    out = str(tmp_path / "logs")
    cfg = _config(
        tmp_path,
        tensorboard={"enabled": True, "output_path": out, "job_name": "tb"},
        csv_monitor={"enabled": True, "output_path": out, "job_name": "csv"},
        wandb={"enabled": True, "project": "jzero-tests", "group": "monitors"},
    )
    batches = toy.make_batches(STEPS, BATCH)
    # batch=: the state is made at initialize, so the counters below see the steps alone.
    engine = jzero.initialize(toy.make_params(), toy.loss_fn, config=cfg, batch=batches[0])
    with CompileCounter() as compiled:
        losses = [float(engine.train_step(b)["loss"]) for b in batches]
    engine.monitor.write_events([("Custom/accuracy", 0.5, 7)])  # a user's own event
    engine.close()
    # ``run.finish()`` only tells wandb's service process that the run is over: the service
    # writes the run's transaction log when it closes the run's stream, after finish returns
    # (read at once, the file holds just its 7-byte header). Teardown waits for the service to
    # close every stream and exit, so the log is complete before it is read.
    wandb.teardown()
    samples = [BATCH * (i + 1) for i in range(STEPS)]

    # TensorBoard's reader: one scalar series per tag, stepped by the samples trained.
    events = EventAccumulator(f"{out}/tb")
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train_loss", "lr", "grad_norm", "skipped", "samples_per_s", "mfu", "peak_bytes"}
    assert {f"Train/Samples/{t}" for t in expected} <= tags and "Custom/accuracy" in tags
    series = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in series] == samples
    assert [e.value for e in series] == [float(np.float32(x)) for x in losses]  # stored float32
    assert [e.value for e in events.Scalars("Train/Samples/lr")] == [float(np.float32(1e-3))] * 4

    # CSV: DeepSpeed's file names and header, one row per step, the values as returned.
    rows = _csv_rows(tmp_path / "logs" / "csv" / "Train_Samples_train_loss.csv")
    assert rows[0] == ["step", "train_loss"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == list(zip(samples, losses, strict=True))
    assert _csv_rows(tmp_path / "logs" / "csv" / "Custom_accuracy.csv") == [
        ["step", "accuracy"],
        ["7", "0.5"],
    ]
    mfu = [float(v) for _, v in _csv_rows(tmp_path / "logs" / "csv" / "Train_Samples_mfu.csv")[1:]]
    assert len(mfu) == STEPS and all(0 < m < 1 for m in mfu)

    # wandb offline: the run's history holds the loss at every step.
    (run_dir,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*")
    history = wandb_history.history(run_dir)
    loss_tag = "Train/Samples/train_loss"
    logged = [(r["_step"], r[loss_tag]) for r in history if loss_tag in r]
    assert logged == list(zip(samples, losses, strict=True))

    # The monitors cost no compilation: the peak bytes on CPU come from the step's executable.
    quiet = jzero.initialize(
        toy.make_params(), toy.loss_fn, config=_config(tmp_path), batch=batches[0]
    )
    assert not quiet.monitor.enabled
    with CompileCounter() as unmonitored:
        quiet_losses = [float(quiet.train_step(b)["loss"]) for b in batches]
    # Programs produced, compiled or loaded from the run's persistent cache: the quiet run may
    # load the monitored run's programs, so the programs are the count to compare.
    assert compiled.programs == unmonitored.programs
    assert quiet_losses == losses  # logging reads the step's values, it changes none


def test_only_process_zero_writes(tmp_path):
    out = tmp_path / "logs"
    cfg = load_config(
        {
            "tensorboard": {"enabled": True, "output_path": str(out)},
            "csv_monitor": {"enabled": True, "output_path": str(out)},
        }
    )
    other = monitor.open_monitors(cfg, process_index=1)
    other.write_events([("Train/Samples/train_loss", 1.0, 1)])
    assert not other.enabled and not out.exists()
    main = monitor.open_monitors(cfg, process_index=0)
    assert main.enabled and len(main.writers) == 2
    main.close()
    assert (out / "DeepSpeedJobName").is_dir()  # DeepSpeed's default job name


def test_csv_monitor_appends_on_resume_and_starts_fresh_from_step_0(tmp_path):
    cfg = load_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    path = tmp_path / "DeepSpeedJobName" / "Train_Samples_lr.csv"

    def run(fresh, *steps):
        m = monitor.open_monitors(cfg, process_index=0, fresh=fresh)
        m.write_events([("Train/Samples/lr", 0.1, s) for s in steps])
        m.close()

    run(True, 1, 2)
    run(False, 3)  # a resumed run: its rows follow, under the one header
    assert _csv_rows(path) == [["step", "lr"], ["1", "0.1"], ["2", "0.1"], ["3", "0.1"]]
    run(True, 1)  # a run from step 0 again: the file starts anew
    assert _csv_rows(path) == [["step", "lr"], ["1", "0.1"]]


def test_missing_wandb_is_named_before_anything_is_built(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    message = "wandb.enabled is true, but the wandb package is not installed. Install jzero's "
    message += "wandb extra (pip install 'jzero[wandb]'"
    with pytest.raises(ConfigError, match=re.escape(message)):
        jzero.initialize(
            params=toy.make_params(), loss_fn=toy.loss_fn, config={"wandb": {"enabled": True}}
        )
