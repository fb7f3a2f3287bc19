"""`jzero train --model file.py:make` with a Hugging Face DeepSpeed config as it is ("auto"
optimizer, scheduler and batch values, no batch key): the user's NNX model trains, a SIGTERM
writes its final checkpoint and summary (exit 143), and the next start resumes the losses and
the data; every wrong entry point is one clear error."""

import json
import logging
import signal
import warnings

import pytest
from data_runs import USER_MODEL
from procs import signal_at_step
from repo import FIXTURES

from jzero import cli, train
from jzero.train import EntryPointError, elastic_split, load_entry

HF = FIXTURES / "ds_configs" / "hf_zero3_no_batch.json"


def _args(tmp_path, name, steps):
    return [
        "train",
        str(HF),
        "--model",
        USER_MODEL,
        "--steps",
        str(steps),
        "--quiet",
        "--set",
        "model={vocab_size: 256, seq_len: 8, d_model: 8}",
        "--set",
        "data={source: stdlib, max_bytes: 20000}",
        "--set",
        "train={micro_batch_size: 1, eval_interval: 2, eval_batches: 1, learning_rate: 0.01}",
        "--set",
        f"train.log_dir={tmp_path / name}",
        "--set",
        f"checkpoint={{directory: {tmp_path / (name + '_ckpt')}, async: false}}",
    ]


def _main(args):
    with warnings.catch_warnings():  # the template's no-effect keys are warned about
        warnings.simplefilter("ignore")
        return cli.main(args)


def _losses(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.usefixtures("x64")
def test_a_users_model_on_a_hugging_face_config_stops_and_resumes(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="jzero"):
        assert _main(_args(tmp_path, "whole", 4)) == 0
    # The config's "auto" values come from the run's own.
    filled = next(r.message for r in caplog.records if "filled the config" in r.message)
    for value in (
        "optimizer.params.lr=0.01",
        "scheduler.params.warmup_max_lr=0.01",
        "scheduler.params.total_num_steps=4",
        "train_micro_batch_size_per_gpu=1",
    ):
        assert value in filled
    assert "the model is " + USER_MODEL in caplog.text
    on = next(r.message for r in caplog.records if r.message.startswith("jzero: on: "))
    assert on.startswith("jzero: on: ZeRO stage 3 over {data=8}; parameters float64; ")
    assert "activation checkpointing of the gathered layers" in on and "no offload" in on
    assert on.endswith("| train 2,114 rows an epoch | eval 111 rows held out (eval_fraction 0.05)")
    assert "before its schedule" not in caplog.text  # total_num_steps was filled from --steps
    whole = _losses(tmp_path / "whole")

    signal_at_step(monkeypatch, signal.SIGTERM, 2)  # the run's handler catches it
    assert _main(_args(tmp_path, "run", 4)) == 128 + signal.SIGTERM
    monkeypatch.undo()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["signal"] == "SIGTERM"
    assert summary["last_checkpoint"] == 2

    assert _main(_args(tmp_path, "run", 4)) == 0  # resumes from checkpoint 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["steps"] == 4
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3, 4]
    for s in losses:  # float64: the same batches, the same updates
        assert losses[s] == pytest.approx(whole[s], rel=1e-10, abs=0), s


def test_a_wrong_entry_point_is_one_clear_error(tmp_path):
    with pytest.raises(EntryPointError, match="not 'module:function'"):
        load_entry("mymodel.py")
    with pytest.raises(EntryPointError, match="the file 'nothere.py' does not exist"):
        load_entry("nothere.py:make")
    with pytest.raises(EntryPointError, match="module 'no_such_pkg.models' can't be imported"):
        load_entry("no_such_pkg.models:make")
    f = tmp_path / "m.py"
    f.write_text("VALUE = 3\n\ndef other():\n    return {}\n\ndef broken(\n")
    with pytest.raises(EntryPointError, match="importing .*m.py' failed: SyntaxError"):
        load_entry(f"{f}:make")
    f.write_text("VALUE = 3\n\ndef other(a):\n    return 1\n\ndef pair():\n    return (1, 2)\n")
    with pytest.raises(EntryPointError, match="defines no 'make'; its functions: other, pair"):
        load_entry(f"{f}:make")
    with pytest.raises(EntryPointError, match="'VALUE' is a int, not a function"):
        load_entry(f"{f}:VALUE")
    model = train.entry.model_from_entry
    with pytest.raises(EntryPointError, match=r"called with the config's model keys \['b'\]"):
        model(f"{f}:other", {"entry": "x", "b": 1})
    with pytest.raises(EntryPointError, match="returned a int; it returns a dict"):
        model(f"{f}:other", {"a": 1})
    with pytest.raises(EntryPointError, match="returned a tuple"):
        model(f"{f}:pair", {})
    f.write_text("def make():\n    return {'model': 1, 'loss': 2}\n")
    with pytest.raises(EntryPointError, match=r"returned the keys \['loss', 'model'\].*unknown"):
        model(f"{f}:make", {})


def test_the_global_batch_split_over_another_device_count():
    assert elastic_split(32, 4, 4) == (4, 2)  # the micro-batch kept, accumulation doubled
    assert elastic_split(32, 8, 4) == (4, 1)
    assert elastic_split(24, 8, 2) == (1, 3)  # 3 rows per device: the micro-batch shrinks
    assert elastic_split(32, 16, 4) == (2, 1)
    with pytest.raises(ValueError, match=r"does not split over 3 .*\(1, 2, 4, 8, 16, 32\)"):
        elastic_split(32, 3, 4)
