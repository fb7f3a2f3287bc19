"""Engine checkpoints: save at step 2, restore in a fresh engine, and steps 3-4 are
bit-identical to the run that never stopped, with mixed precision, loss scaling and offload."""

import jax
import numpy as np
import optax
import pytest
import toy
from numerics import needs_float16

import jzero

STEPS, SAVED_AT = 4, 2  # fp16's scale window (2) acts before and after
CASES = {
    "bf16-offload-stage2": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True},
    },
    "fp16-stage3": {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2},
    },
}


def make_engine(case, directory):
    cfg = {
        "train_batch_size": 32,
        "gradient_clipping": 1.0,
        "checkpoint": {"directory": str(directory), "save_interval_steps": SAVED_AT},
        **CASES[case],
    }
    return jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2), cfg)


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=needs_float16) if "fp16" in c else c for c in sorted(CASES)]
)
def test_resume_continues_bit_identically(case, tmp_path):
    batches = toy.make_batches(STEPS, 32)
    with make_engine(case, tmp_path) as engine:  # saves every SAVED_AT steps by itself
        losses = [float(engine.train_step(b)["loss"]) for b in batches]
        final = leaves(engine.state)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [SAVED_AT, STEPS]
    with make_engine(case, tmp_path) as fresh:
        meta = fresh.restore(SAVED_AT)
        assert meta["iteration"] == SAVED_AT and meta["stage"] == fresh.plan.stage.stage
        assert meta["config"]["train_batch_size"] == 32
        resumed = [float(fresh.train_step(b)["loss"]) for b in batches[SAVED_AT:]]
        assert resumed == losses[SAVED_AT:]
        for a, b in zip(leaves(fresh.state), final, strict=True):
            np.testing.assert_array_equal(a, b)
        if "offload" in case:
            kinds = {x.sharding.memory_kind for x in jax.tree.leaves(fresh.state.opt_state)}
            assert kinds == {"pinned_host"}
        if "fp16" in case:  # the loss-scale state came back too
            assert float(fresh.state.loss_scale.scale) == float(final[-5])


def test_save_without_a_directory_says_how_to_set_one():
    engine = jzero.initialize(
        toy.make_params(), toy.loss_fn, optax.sgd(0.1), {"train_batch_size": 8}
    )
    with pytest.raises(ValueError, match="Set checkpoint.directory in the config"):
        engine.save()
