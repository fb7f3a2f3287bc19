"""`jzero.fit`, the loop for any model: a user's Flax NNX model on a Grain pipeline stops on
SIGTERM with its final checkpoint and summary, and a resumed run continues both the losses and
the data; a Grain DataLoader in a user's own loop is put back by `engine.restore()`; DeepSpeed's
`save_checkpoint`/`load_checkpoint` carry a client state under a tag."""

import json
import signal

import grain
import grain.python as gp
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from procs import signal_at_step

import jzero

RECORDS = 48
BATCH = 8  # one row per device


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 1, rngs=rngs, param_dtype=jnp.float64)

    def __call__(self, x):
        return self.linear(x)[:, 0]


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _records():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(RECORDS, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=RECORDS)
    return [{"x": x[i], "y": y[i]} for i in range(RECORDS)]


def _pipeline():
    """A user's Grain pipeline: shuffled each epoch, batched, repeated."""
    ds = grain.MapDataset.source(_records()).shuffle(seed=7).repeat().batch(BATCH)
    return ds.to_iter_dataset()


def _config(tmp_path, **train):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
        "train": {"steps": 6, "eval_interval": 3, "log_dir": str(tmp_path / "run"), **train},
        "checkpoint": {"directory": str(tmp_path / "ckpt"), "async": False},
    }


def _engine(cfg):
    return jzero.initialize(model=Regressor(rngs=nnx.Rngs(0)), loss_fn=loss_fn, config=cfg)


def _losses(tmp_path, name="run"):
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.usefixtures("x64")
def test_fit_stops_on_sigterm_and_resumes_the_losses_and_the_data(tmp_path, monkeypatch):
    evals = [{"x": r["x"][None], "y": r["y"][None]} for r in _records()[:BATCH]]
    evals = [{k: np.concatenate([e[k] for e in evals]) for k in ("x", "y")}]
    whole = tmp_path / "whole"
    summary = jzero.fit(_engine(_config(whole)), _pipeline(), eval_data=evals, progress=False)
    assert summary["steps"] == 6 and not summary["interrupted"]
    assert summary["eval_loss"] is not None and summary["tokens_per_s"] is None
    uninterrupted = _losses(whole)

    signal_at_step(monkeypatch, signal.SIGTERM, 3)  # the run's handler catches it
    cut = jzero.fit(_engine(_config(tmp_path)), _pipeline(), eval_data=evals, progress=False)
    monkeypatch.undo()
    assert cut["interrupted"] and cut["signal"] == "SIGTERM" and cut["steps"] == 3
    assert cut["last_checkpoint"] == 3  # the final checkpoint, written on the signal
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["steps"] == 3 and written["signal"] == "SIGTERM"
    assert jzero.train.exit_code(written) == 128 + signal.SIGTERM
    assert "samples/s, this run's average" in jzero.train.format_summary(written)  # no tokens

    # A new process would build all of it again: a new engine and the pipeline from its start.
    resumed = jzero.fit(_engine(_config(tmp_path)), _pipeline(), eval_data=evals, progress=False)
    assert resumed["resumed_from"] == 3 and resumed["steps"] == 6
    losses = _losses(tmp_path)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]  # appended after the checkpoint's lines
    # Steps 4-6 read the batches that followed step 3 (the data position came back with the
    # model): float64 losses equal the uninterrupted run's.
    for s in range(1, 7):
        assert losses[s] == pytest.approx(uninterrupted[s], rel=1e-10, abs=1e-12), s
    # Without the data position step 4 would have read the first batch again.
    assert abs(losses[4] - uninterrupted[1]) > 1e-3


def _loader():
    sampler = gp.IndexSampler(
        num_records=RECORDS, shard_options=gp.NoSharding(), shuffle=True, num_epochs=None, seed=3
    )
    return gp.DataLoader(
        data_source=_records(), sampler=sampler, operations=[gp.Batch(BATCH)], worker_count=0
    )


@pytest.mark.usefixtures("x64")
def test_restore_puts_back_a_grain_dataloader_and_the_client_state(tmp_path):
    """A user's own loop with a Grain DataLoader: `engine.save_checkpoint` keeps its position
    and a client state under DeepSpeed's tag; `load_checkpoint` puts both back."""
    engine = _engine(_config(tmp_path))
    data = iter(_loader())
    engine.data_iterator = data
    for _ in range(2):
        engine.train_step(next(data))
    saved = tmp_path / "ds"
    assert engine.save_checkpoint(saved, tag="global_step2", client_state={"epoch": 0, "k": [1]})
    engine.wait_until_finished()
    after = [next(data)["y"] for _ in range(2)]  # what the run read after the checkpoint
    path, client = engine.load_checkpoint(saved, tag="global_step2")
    assert path == str(saved / "2") and client == {"epoch": 0, "k": [1]}
    assert [next(data)["y"].tolist() for _ in range(2)] == [a.tolist() for a in after]
    # The config's directory is another: nothing was written there.
    assert not (tmp_path / "ckpt").exists()
    assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    with pytest.raises(ValueError, match="tag='best'.*numbered by step"):
        engine.save_checkpoint(saved, tag="best")
    # A checkpoint with a Grain position refused into an iterator without one.
    engine.data_iterator = iter([{"x": 1}])
    with pytest.raises(ValueError, match="get_state.*Grain.*neither protocol"):
        engine.load_checkpoint(saved)
    engine.close()
