"""``zero_optimization.stage: auto`` with a ``device_memory`` budget: the cheapest stage whose
compiled step fits is chosen at the first batch, compiled once, recorded in the config, and a
checkpoint of the run restores; a budget nothing fits is an error listing every need."""

import jax
import numpy as np
import pytest
import toy

import jzero
from jzero.config import ConfigError
from jzero.distributed import CompileCounter


def engine(budget, directory=None):
    """The toy model (its scanned blocks re-planned at stage 3, as a transformer's layers) at
    8 devices, batch 16: its stages need 347, 177, 177 and 60 KiB."""
    config = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": "auto", "stage3_param_persistence_threshold": 0},
        "device_memory": budget,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    if directory is not None:
        config["checkpoint"] = {"directory": str(directory)}
    return jzero.initialize(toy.make_params(num_layers=4, d=64), toy.loss_fn, config=config)


def test_a_budget_nothing_fits_lists_every_candidates_need():
    with pytest.raises(ConfigError) as info:
        engine(1).train_step(toy.make_batches(1, 16)[0])
    message = str(info.value)
    assert message.startswith("zero_optimization.stage: auto found no setting that fits 1 B")
    for name in ("stage 0 needs", "stage 1 needs", "stage 3 needs", "optimizer offload needs"):
        assert name in message, message


# The last candidate (stage 3, after the layout's re-plan) and one between, where measuring stops.
@pytest.mark.parametrize(("budget", "stage", "measured"), [("100KB", 3, 4), ("200KB", 1, 2)])
def test_the_cheapest_stage_that_fits_is_chosen_and_compiled_once(
    budget, stage, measured, caplog, monkeypatch
):
    e = engine(budget)
    batches = toy.make_batches(2, 16)
    # The state waits for the choice: it is made once, in the chosen layout, and never moved.
    monkeypatch.setattr("jzero.engine.engine.relayout", lambda *a: pytest.fail("state moved"))
    # Programs produced, compiled or loaded from the run's compilation cache (the other case's
    # candidates may be there): the count of each is the claim.
    with caplog.at_level("INFO", logger="jzero"), CompileCounter() as first:
        loss = float(e.train_step(batches[0])["loss"])
    assert e.plan.stage.stage == stage and e.config.zero_optimization.stage == stage
    # One compilation per candidate measured (stages 0.. up to the chosen one), the chosen one's
    # reused by the step: nothing compiled twice; the state's one init program.
    assert first.names.count("jit(step)") == measured, first.names
    assert first.names.count("jit(init)") == 1, first.names
    with CompileCounter() as second:
        e.train_step(batches[1])
    assert second.programs == 0, second.names
    line = next(r.message for r in caplog.records if "stage auto chose" in r.message)
    assert f"chose stage {stage}:" in line and "rejected stage 0 (short by" in line
    assert np.isfinite(loss)


def test_a_checkpoint_of_an_auto_run_restores(tmp_path):
    data = toy.make_batches(2, 16)
    first = engine("200KB", tmp_path)
    first.train_step(data[0])
    first.save()
    first.wait_until_finished()
    want = jax.device_get(first.params)
    second = engine("200KB", tmp_path)
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
