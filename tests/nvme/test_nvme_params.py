"""The NVMe tier beyond the optimizer state: parameters on NVMe too (``offload_param: {device:
nvme}`` at stage 3), the first version written at ``initialize`` group by group, a layout
change at the first step, checkpoints between the tiers, and optimizers that cannot be updated
group by group.

Numerics are compared with the run in memory in float64, or within bf16's rounding with bf16
(``assert_close_run``; the bit-identical check is ``nvme_bits_child.py``'s "3p" run).
"""

import os
import re

import jax
import numpy as np
import optax
import pytest
import toy
from numerics import EPS, max_rel_error
from offload_runs import (
    BATCH,
    F64,
    PSI,
    STEPS,
    assert_close_run,
    assert_first_norm,
    config,
    flip_last_byte,
    host,
    nvme,
    reference,
    train,
)

import jzero
from jzero.nvme import NvmeIOError


def files(directory, prefix=""):
    return sorted(f for f in os.listdir(directory) if f.startswith(prefix) and f[0] != ".")


def on_nvme(path, param_path=None, bf16=False, **zero):
    return config(
        3,
        bf16,
        offload_optimizer=nvme(path),
        # A store of their own reads the parameters ahead (offload_param.pipeline_read).
        offload_param=nvme(param_path, pipeline_read=True) if param_path else nvme(path),
        sub_group_size=PSI // 3,
        **zero,
    )


@pytest.mark.parametrize("bf16", [False, True])
def test_parameters_on_nvme_train_like_the_run_in_memory(bf16, tmp_path):
    # bf16: the parameters in a store of their own (another nvme_path, as on a second drive).
    param_path = tmp_path / "params" if bf16 else None
    if param_path:
        param_path.mkdir()
    dtype = np.float32 if bf16 else F64
    run = train(on_nvme(tmp_path, param_path, bf16), dtype=dtype)
    if bf16:
        assert_close_run(run, reference(3, True), reference(3, dtype=F64))
    else:
        assert_close_run(run, reference(3, dtype=F64))
    e = run[3]
    # Between steps the state holds no parameter: they are in the parameters' files.
    assert all(0 in x.shape for x in jax.tree.leaves(e.state.params))
    store = e._disk.param_store
    assert (store is e._disk.store) == (not bf16)
    held = sum(int(np.prod(leaf.shape)) * (2 if bf16 else 8) for leaf in e.plan.leaves)
    arrays = sum(len(s.device_set) for s in jax.tree.leaves(e.plan.params))
    param_bytes = sum(
        os.path.getsize(os.path.join(store.directory, f)) for f in files(store.directory, "p-")
    )
    assert held <= param_bytes <= held + 4096 * (arrays + 8)
    # Evaluation reads them back; it agrees with the same engine's parameters in memory.
    # float64: the same forward to float64 rounding. bf16: the engine's forward rounds each
    # activation to bf16 about 8 times (embedding, 4 layers, head, the odd term) where the
    # float32 one does not, and a mean of squares doubles the relative error: 16 EPS.
    with jax.enable_x64(not bf16):
        batch = toy.make_batches(1, BATCH, dtype=dtype)[0]
        want = float(toy.loss_fn(jax.device_get(e.params), batch))
        got = float(e.evaluate(batch))
    np.testing.assert_allclose(got, want, rtol=16 * EPS["bfloat16"] if bf16 else 1e-10)
    e.close()
    assert files(tmp_path) == (["params"] if bf16 else [])
    if bf16:
        assert not os.listdir(param_path)


def test_initialize_writes_the_state_straight_to_its_files(tmp_path):
    # batch=: the layout is final at initialize (stage 3 fits its stacked layers), so the state
    # is made there, in its files.
    e = jzero.initialize(
        toy.make_params(),
        toy.loss_fn,
        optax.adamw(1e-2),
        on_nvme(tmp_path, bf16=True),
        batch=toy.make_batches(1, BATCH)[0],
    )
    plain = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2), config(3, True))
    # Before any step: version 0 on disk, placeholders in the engine's state.
    assert e._disk.version == 0
    groups = len(e._disk.groups)
    assert groups >= 2
    assert files(e._disk.store.directory) == sorted(
        [f"0-{g}.jznv" for g in range(groups)] + [f"p-0-{g}.jznv" for g in range(groups)]
    )
    state = e.state
    assert all(0 in x.shape for x in jax.tree.leaves((state.params, state.master)))
    # What the files hold is the state initialize makes in memory.
    for a, b in zip(host(e.params), host(plain.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(host(e.opt_state), host(plain.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    full = e._full_state()
    for a, b in zip(host(full.master), host(plain.state.master), strict=True):
        np.testing.assert_array_equal(a, b)
    # Read back into host memory (a state the device cannot hold can still be saved).
    moments = [x for x in jax.tree.leaves((full.opt_state, full.master)) if x.size > 1]
    assert {x.sharding.memory_kind for x in moments} == {"pinned_host"}
    e.close()
    plain.close()


def test_a_layout_change_at_the_first_step_relays_the_files(tmp_path):
    """8 stacked layers on 8 devices, the state read before any batch's shapes are known (so
    made in the provisional layout): the first step moves the stacked leaves off their layer
    dimension (``engine.resolve``); the files are re-laid group by group and training matches
    the run in memory."""
    tx = optax.adam(1e-2)

    def run(cfg):  # in float64: the re-laid files must hold what the run in memory holds
        cfg = dict(cfg, train_batch_size=16)
        with jax.enable_x64(True):
            params = toy.make_params(num_layers=8, dtype=F64)
            e = jzero.initialize(params, toy.loss_fn, tx, cfg)
            assert e.state is not None  # made now, before the layer dimensions are known
            metrics = [e.train_step(b) for b in toy.make_batches(STEPS, 16, dtype=np.float64)]
            dims = {leaf.path: leaf.param_dim for leaf in e.plan.leaves}
            norms = [float(m["grad_norm"]) for m in metrics]
            losses = [float(m["loss"]) for m in metrics]
            out = losses, host(e.params), host(e.opt_state), dims, norms
            e.close()
            return out

    want = run(config(3))
    got = run(on_nvme(tmp_path))
    assert got[3] == want[3] and want[3]["blocks.w"] == 1  # moved off the layer dimension
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got[4], want[4], rtol=1e-10, atol=0)
    assert max_rel_error(got[1] + got[2], want[1] + want[2]) < 1e-9
    with jax.enable_x64(True):  # both runs' first gradient against optax's (Adam hides its scale)
        batch = toy.make_batches(1, 16, dtype=np.float64)[0]
        grads = jax.grad(toy.loss_fn)(toy.make_params(num_layers=8, dtype=F64), batch)
        assert got[4][0] == pytest.approx(float(optax.global_norm(grads)), rel=1e-10, abs=0)


def test_a_bad_parameter_file_stops_the_step_and_a_checkpoint_brings_it_back(tmp_path, x64):
    cfg = on_nvme(tmp_path / "nvme")
    (tmp_path / "nvme").mkdir()
    cfg["checkpoint"] = {"directory": str(tmp_path / "ckpt")}
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    e = jzero.initialize(toy.make_params(dtype=F64), toy.loss_fn, tx, cfg)
    batches = toy.make_batches(STEPS, BATCH, dtype=np.float64)
    assert_first_norm([float(e.train_step(batches[0])["grad_norm"])], F64)
    e.save()
    e.wait_until_finished()
    directory = e._disk.store.directory
    before = files(directory)
    victim = os.path.join(directory, files(directory, "p-")[-1])
    flip_last_byte(victim)  # a parameter shard's data
    with pytest.raises(NvmeIOError, match=re.escape(os.path.basename(victim))):
        e.train_step(batches[1])
    assert int(e.state.step) == 1
    assert files(directory) == before  # nothing of the failed step is left
    e.restore()
    metrics = [e.train_step(b) for b in batches[1:]]
    # In float64: the restored run continues the run in memory, its gradients' scale too.
    ref = reference(3, dtype=F64)
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref[0][1:], rtol=1e-10)
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref[3][1:], rtol=1e-10)
    e.close()


def test_checkpoints_move_between_the_tiers(tmp_path, x64):
    """Saved with the parameters on NVMe, restored in memory, and the reverse; in float64, so
    that the restored step's loss is the saver's to float64 rounding."""
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    batches = toy.make_batches(STEPS, BATCH, dtype=np.float64)
    (tmp_path / "nvme").mkdir()

    def engine(on_disk, ckpt):
        cfg = on_nvme(tmp_path / "nvme") if on_disk else config(3)
        cfg["checkpoint"] = {"directory": str(tmp_path / ckpt)}
        params = toy.make_params(dtype=F64)  # batch=: the state made at initialize
        return jzero.initialize(params, toy.loss_fn, tx, cfg, batch=batches[0])

    for saver_on_disk in (True, False):
        ckpt = f"ckpt-{saver_on_disk}"
        a = engine(saver_on_disk, ckpt)
        assert_first_norm([float(a.train_step(b)["grad_norm"]) for b in batches[:2]], F64)
        a.save()
        a.wait_until_finished()
        want = float(a.train_step(batches[2])["loss"])
        a.close()
        r = engine(not saver_on_disk, ckpt)
        if not saver_on_disk:  # the restore reads the disk's leaves into host memory
            spilled = []
            spill = r._disk.spill
            r._disk.spill = lambda state, seen=spilled, spill=spill: (
                seen.append(state) or spill(state)
            )
        r.restore()
        if not saver_on_disk:  # restored onto the tier: back in its files at once
            assert all(0 in x.shape for x in jax.tree.leaves(r.state.params))
            moments = [x for x in jax.tree.leaves(spilled[0].opt_state) if x.size > 1]
            assert {x.sharding.memory_kind for x in moments} == {"pinned_host"}
        np.testing.assert_allclose(float(r.train_step(batches[2])["loss"]), want, rtol=1e-10)
        r.close()


def test_an_optimizer_that_reads_across_leaves_is_refused_at_initialize(tmp_path):
    """Grouped updates (the NVMe tier, and host offload with sub_group_size) would apply a
    cross-leaf transform per group: refused before anything is made."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    for offload in (nvme(tmp_path), {"device": "cpu"}):
        cfg = config(2, offload_optimizer=offload, sub_group_size=PSI // 3)
        with pytest.raises(ValueError, match="not leafwise.*gradient_clipping"):
            jzero.initialize(toy.make_params(), toy.loss_fn, tx, cfg)
    assert not os.listdir(tmp_path)  # the store made for it is gone
    # One group (the default sub_group_size) is the one-call update: allowed.
    jzero.initialize(
        toy.make_params(), toy.loss_fn, tx, config(2, offload_optimizer={"device": "cpu"})
    ).close()
