"""``zero_optimization.stage: auto`` with a ``device_memory`` budget: the cheapest stage whose
compiled step fits is chosen at the first batch, compiled once, recorded in the config, and a
checkpoint of the run restores; a budget nothing fits is an error listing every need."""

import functools

import jax
import numpy as np
import pytest
import toy

import jzero
from jzero import data
from jzero.config import ConfigError
from jzero.distributed import CompileCounter
from jzero.models import gpt

CFG = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=64, d_ff=256, num_heads=2)


@functools.cache
def batches(n=2):
    tokens = data.load_tokens("stdlib", max_bytes=64 * 1024) % CFG.vocab_size
    it = data.BatchIterator(tokens, 16, CFG.seq_len, seed=0)
    return [it.next() for _ in range(n)]


def engine(budget, directory=None, model="gpt"):
    config = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": "auto", "stage3_param_persistence_threshold": 0},
        "device_memory": budget,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if directory is not None:
        config["checkpoint"] = {"directory": str(directory)}
    if model == "toy":  # cheaper to compile; its stages need 347, 177, 177 and 60 KiB
        return jzero.initialize(toy.make_params(num_layers=4, d=64), toy.loss_fn, config=config)
    params = gpt.init_params(jax.random.key(0), CFG)
    return jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, CFG), config=config)


def test_a_budget_nothing_fits_lists_every_candidates_need():
    with pytest.raises(ConfigError) as info:
        engine(1, model="toy").train_step(toy.make_batches(1, 16)[0])
    message = str(info.value)
    assert message.startswith("zero_optimization.stage: auto found no setting that fits 1 B")
    for name in ("stage 0 needs", "stage 1 needs", "stage 3 needs", "optimizer offload needs"):
        assert name in message, message


@pytest.mark.parametrize(("budget", "stage", "measured"), [("1MB", 3, 4), ("2MB", 1, 2)])
def test_the_cheapest_stage_that_fits_is_chosen_and_compiled_once(budget, stage, measured, caplog):
    # The tiny GPT at 8 devices: stage 0 needs 2.5 MiB, stages 1-2 1.8 MiB, stage 3 0.7 MiB
    # (the rest of the budgets' margins: the batch and temporaries of each compiled step).
    e = engine(budget)
    with caplog.at_level("INFO", logger="jzero"), CompileCounter() as first:
        loss = float(e.train_step(batches()[0])["loss"])
    assert e.plan.stage.stage == stage and e.config.zero_optimization.stage == stage
    # One compilation per candidate measured (stages 0.. up to the chosen one), the chosen one's
    # reused by the step: nothing compiled twice, and the state moved once.
    assert first.names.count("jit(step)") == measured, first.names
    assert first.names.count("jit(step)") + 1 >= len(first.names) - 1, first.names
    with CompileCounter() as second:
        e.train_step(batches()[1])
    assert second.compiles == 0, second.names
    line = next(r.message for r in caplog.records if "stage auto chose" in r.message)
    assert f"chose stage {stage}:" in line and "rejected stage 0 (short by" in line
    assert np.isfinite(loss)


def test_a_checkpoint_of_an_auto_run_restores(tmp_path):
    data = toy.make_batches(2, 16)
    first = engine("200KB", tmp_path, model="toy")
    first.train_step(data[0])
    first.save()
    first.wait_until_finished()
    want = jax.device_get(first.params)
    second = engine("200KB", tmp_path, model="toy")
    second.restore()
    got = jax.device_get(second.params)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)
    m1 = first.train_step(data[1])
    m2 = second.train_step(data[1])  # chooses stage 1 again, from the restored state
    assert first.plan.stage.stage == second.plan.stage.stage == 1
    assert float(m1["loss"]) == float(m2["loss"])


def test_stage_auto_on_cpu_without_device_memory_says_the_fix():
    with pytest.raises(ConfigError, match="device_memory"):
        engine(None)
