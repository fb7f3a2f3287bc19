"""Resume anywhere: a `jzero train` run of a user's model (`--model file.py:make`) checkpointed
at step 3 on 8 devices and resumed on 8 devices and on 4 (2 processes x 2 devices under
`jzero launch`: fewer devices and more processes than the save, in one run) reads exactly the
uninterrupted run's global batches (by the rows they read), keeps its global batch, and
continues its float64 losses at 1e-10."""

import json
import shutil
import sys

import data_runs
import pytest
from procs import Children, child_env, launcher
from repo import ROOT

STEPS = 6
CUT = 3
CHILD = ROOT / "tests" / "support" / "data_runs.py"


def _losses(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted run, and the run cut after step 3 (its checkpoint copied per resume)."""
    tmp = tmp_path_factory.mktemp("resume")
    whole_ids, whole = data_runs.run(str(tmp / "whole_ckpt"), str(tmp / "whole"), STEPS)
    cut_ids, cut = data_runs.run(str(tmp / "cut_ckpt"), str(tmp / "cut"), CUT)
    assert whole["steps"] == STEPS and cut["steps"] == CUT and cut["last_checkpoint"] == CUT
    assert cut_ids == whole_ids[:CUT]  # the first steps read the same batches
    lines = (tmp / "whole" / "metrics.jsonl").read_text().splitlines()
    eval3 = next(r["eval_loss"] for r in map(json.loads, lines) if r["step"] == CUT)
    return {"tmp": tmp, "ids": whole_ids, "losses": _losses(tmp / "whole"), "eval3": eval3}


def _resumed(runs, name):
    """A copy of the cut run's checkpoint and logs, for one resume."""
    tmp = runs["tmp"]
    shutil.copytree(tmp / "cut_ckpt", tmp / f"{name}_ckpt")
    shutil.copytree(tmp / "cut", tmp / name)
    return tmp / f"{name}_ckpt", tmp / name


def _check(runs, ids, log_dir, summary):
    """Steps 4-6 read the uninterrupted run's samples and trained to its losses; checkpoint 3
    evaluated here (the start of the resumed run) gives the uninterrupted run's eval loss at
    step 3: the eval set is the config's, whatever the device count."""
    assert ids == runs["ids"][CUT:]
    assert summary["first_eval_loss"] == pytest.approx(runs["eval3"], rel=1e-12, abs=0)
    losses = _losses(log_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(CUT + 1, STEPS + 1):
        assert losses[step] == pytest.approx(runs["losses"][step], rel=1e-10, abs=0), step


def test_the_global_batches_are_fixed_by_the_seed_and_the_step(runs):
    ids = runs["ids"]
    assert [len(b) for b in ids] == [data_runs.GLOBAL_BATCH] * STEPS
    flat = [i for batch in ids for i in batch]
    assert len(set(flat)) == len(flat)  # no sample twice within the epoch
    assert sorted(flat) != flat  # shuffled, not read in order


def test_resumed_on_eight_devices(runs):
    ckpt, log_dir = _resumed(runs, "eight")
    ids, summary = data_runs.run(str(ckpt), str(log_dir), STEPS)
    assert summary["resumed_from"] == CUT and summary["devices"] == 8
    _check(runs, ids[-(STEPS - CUT) :], log_dir, summary)  # the first read: a probe


def _child_ids(out, processes):
    """Per step, the global sample ids: each process's rows, in process order."""
    records = [json.loads(out.with_suffix(f".{p}.json").read_text()) for p in range(processes)]
    per_process = [r["ids"][-(STEPS - CUT) :] for r in records]
    return [sum((p[s] for p in per_process), []) for s in range(STEPS - CUT)], records[0]


def test_resumed_as_two_processes_of_two_devices(runs):
    ckpt, log_dir = _resumed(runs, "two")
    out = runs["tmp"] / "two_out"
    c = Children()
    try:
        cmd = launcher("-n", "2", "--devices-per-process", "2", "--", sys.executable)
        env = child_env(DATA_RUNS_SLOW_PROCESS="1")  # process 1 reads its batches slowly
        p = c.start([*cmd, str(CHILD), str(ckpt), str(log_dir), str(out), str(STEPS)], env)
        assert c.finish(p, timeout=300) == 0, "".join(p.out + p.err)
    finally:
        c.kill_all()
    ids, record = _child_ids(out, 2)
    assert record["devices"] == 4 and record["summary"]["devices"] == 4
    out_text = "".join(p.out + p.err)
    # 4 devices where the checkpoint was saved on 8: the global batch is the checkpoint's.
    assert "the checkpoint's global batch is 32 samples" in out_text
    assert "4 per device x 2 accumulation steps x 4 devices" in out_text
    _check(runs, ids, log_dir, record["summary"])
    # Each process's own time a step goes into metrics.jsonl; process 1 is named a straggler
    # once it was slow 2 steps in a row (distributed.straggler_steps: 2).
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    last = lines[-1]
    assert last["step"] == STEPS and last["process_times_step"] == STEPS - 1
    assert last["process_own_s"][1] >= 0.25 > last["process_own_s"][0]
    assert len(last["process_step_s"]) == 2
    assert out_text.count("is a straggler") == 1, out_text
    assert "process 1 (" in out_text.split("is a straggler")[0].rsplit("jzero:", 1)[1]


def test_the_eval_set_does_not_follow_the_training_batch(runs):
    """Checkpoint 3 evaluated by a run whose training batch is half (a batch size given with
    --set, so not the checkpoint's) evaluates the same rows to the same loss."""
    ckpt, log_dir = _resumed(runs, "half")
    _, summary = data_runs.run(str(ckpt), str(log_dir), CUT, ["train_micro_batch_size_per_gpu=2"])
    assert summary["steps"] == CUT and summary["resumed_from"] == CUT  # nothing left to train
    assert summary["first_eval_loss"] == pytest.approx(runs["eval3"], rel=1e-12, abs=0)
