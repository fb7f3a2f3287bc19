"""``initialize(..., abstract=True)``: the plan and the state's shapes, nothing on a device.

``jzero plan`` measures every stage this way, so a stage the model does not fit is planned
instead of running out of memory at its initialisation."""

import jax
import optax
import pytest
import toy

import jzero

CFG = {
    "train_batch_size": 16,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "bf16": {"enabled": True},  # masters and 16-bit params: every field of the state
}


def test_an_abstract_engine_holds_shapes_in_their_shardings_and_lowers_the_same_step():
    batch = toy.make_batches(1, 16)[0]
    before = {id(x) for x in jax.live_arrays()}
    abstract = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-3), CFG,
                                abstract=True)  # fmt: skip
    leaves = jax.tree.leaves(abstract.state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    # Nothing was created on a device beyond the caller's own parameters.
    made = [x for x in jax.live_arrays() if id(x) not in before]
    assert sum(x.nbytes for x in made) < sum(x.nbytes for x in jax.tree.leaves(toy.make_params()))
    concrete = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-3), CFG)
    for a, c in zip(leaves, jax.tree.leaves(concrete.state), strict=True):
        assert isinstance(c, jax.Array)
        assert (a.shape, a.dtype, a.sharding) == (c.shape, c.dtype, c.sharding)
    got = abstract.lower(batch).compile().memory_analysis()
    want = concrete.lower(batch).compile().memory_analysis()
    assert got.argument_size_in_bytes == want.argument_size_in_bytes > 0
    assert got.temp_size_in_bytes == want.temp_size_in_bytes
    for call in (abstract.train_step, abstract.evaluate):
        with pytest.raises(ValueError, match=r"abstract=True.*build the engine without"):
            call(batch)
    with pytest.raises(ValueError, match="cannot save"):
        abstract.save()
    concrete.close()
    abstract.close()


def test_an_abstract_engine_refuses_the_nvme_tier(tmp_path):
    cfg = {
        **CFG,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
    }
    with pytest.raises(ValueError, match="NVMe tier's state lives in its files"):
        jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-3), cfg, abstract=True)
    assert not list(tmp_path.iterdir())  # nothing written
